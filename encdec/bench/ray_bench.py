"""Ray Data scale-out on one machine: rows/s of a summarization job on 1 and 2
actors (1 thread each) against one process with 2 threads, on the same rows.

A random BART (d_model 256, 4+4 layers; no hub) summarizes text rows of 40-160
words, greedy, exactly ``--max-tokens`` tokens per row (``ignore_eos``), so
every configuration does the same work; the outputs are checked equal. Times
are end to end, as a job sees them: the single process includes loading its
LLM, a Ray job includes starting its actors and loading one LLM in each (the
process's generate-only figure is printed too). The cluster is local: 2 CPUs,
127.0.0.1, no dashboard.

    python -m benchmarks.ray_bench [--rows 256] [--max-tokens 32] [--batch-size 32]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time

from .common import OtherCPUMonitor

MODEL_DIMS = dict(d_model=256, layers=4, heads=4, ffn=1024, max_positions=512)
LLM_KW = dict(kv_cache_memory=256 << 20, swap_space=0.1)


def make_rows(n: int, seed: int) -> list[str]:
    from encdec.testing import _CORPUS

    words = _CORPUS.split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(40, 160))) for _ in range(n)]


def run_one_process(model: str, rows: list[str], params, threads: int) -> tuple[list[str], float, float]:
    """(texts, end-to-end seconds, generate-only seconds)."""
    import torch

    from encdec import LLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model, **LLM_KW)
    t1 = time.perf_counter()
    outs = llm.generate(rows, params, use_tqdm=False)
    t2 = time.perf_counter()
    return [o.outputs[0].text for o in outs], t2 - t0, t2 - t1


def run_ray(model: str, rows: list[str], params, actors: int, batch_size: int) -> tuple[list[str], float]:
    import ray

    from encdec.ray import LLMPredictor

    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(rows)])
    t0 = time.perf_counter()
    out = ds.map_batches(
        LLMPredictor, fn_constructor_kwargs=dict(model=model, params=params, num_threads=1, **LLM_KW),
        batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=1).take_all()
    seconds = time.perf_counter() - t0
    out.sort(key=lambda r: int(r["id"]))
    if [int(r["id"]) for r in out] != list(range(len(rows))):
        raise RuntimeError(f"{actors} actors: rows lost or duplicated ({len(out)} of {len(rows)})")
    return [r["generated_text"] for r in out], seconds


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32, help="rows per Ray Data batch (one engine call)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from encdec import SamplingParams
    from encdec.testing import make_random_bart

    work = tempfile.mkdtemp(prefix="encdec-raybench-")
    try:
        model = make_random_bart(os.path.join(work, "bart"), seed=args.seed, **MODEL_DIMS)
        rows = make_rows(args.rows, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        print(f"{args.rows} rows of 40-160 words -> {args.max_tokens} tokens each; random BART "
              f"{MODEL_DIMS}; batch_size {args.batch_size}; {os.cpu_count()} CPUs on this host")
        results = []
        with OtherCPUMonitor() as mon:
            want, seconds, gen_only = run_one_process(model, rows, params, threads=2)
            results.append(("one process, 2 threads", seconds,
                            f"(generate only: {args.rows / gen_only:.1f} rows/s)"))
            ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20,
                     include_dashboard=False, _node_ip_address="127.0.0.1",
                     _temp_dir=os.path.join(work, "ray"), log_to_driver=False, logging_level="warning")
            try:
                ctx = ray.data.DataContext.get_current()
                ctx.enable_progress_bars = False
                ctx.print_on_execution_start = False
                for actors in (1, 2):
                    texts, seconds = run_ray(model, rows, params, actors, args.batch_size)
                    same = "same outputs" if texts == want else "OUTPUTS DIFFER from one process"
                    results.append((f"Ray Data, {actors} actor{'s' * (actors > 1)} x 1 thread", seconds, same))
            finally:
                ray.shutdown()
        for name, seconds, note in results:
            print(f"{name:<30} {args.rows / seconds:7.1f} rows/s  ({seconds:6.1f} s)  {note}")
        print(mon.summary() + "; the host is shared, so single runs swing")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_transfers(port: int, model_dir: str, label: str) -> None:
    """What a disaggregated server's decoder engines received from its encoder
    workers, read from its ``/metrics`` (the counters since it started, warm-up
    included): bytes and times per request moved, requests the encoder cache spared."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from encdec.worker.encoder_pass import encoder_transfer_bytes

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    total: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith(("encdec:encoder_transfer", "encdec:encoder_worker")):
                total[smp.name] = total.get(smp.name, 0.0) + smp.value
    moved = total.get("encdec:encoder_transfer_requests_total", 0.0)
    if not moved:
        print(f"{label}: no encoder output moved (metrics: {total})")
        return
    from encdec.models.loader import open_checkpoint

    cfg = open_checkpoint(model_dir).hf_config  # HF or CTranslate2 directories
    per = total["encdec:encoder_transfer_bytes_total"] / moved
    encode = total["encdec:encoder_worker_encode_seconds_total"] / moved
    trip = total["encdec:encoder_transfer_round_trip_seconds_total"] / moved
    out_b, kv_b = encoder_transfer_bytes(cfg, 1, 4)  # float32 (the CPU engines' dtype)
    print(f"{label}: {moved:.0f} requests took an encoder worker's output, "
          f"{total.get('encdec:encoder_transfer_skipped_total', 0):.0f} the encoder cache's; "
          f"{per / 1024:.1f} KiB moved per request (encoder output; its cross K/V would be "
          f"{kv_b / out_b:.0f}x that: {out_b} vs {kv_b} bytes per encoder token); per request: "
          f"encoder call {1000 * trip:.1f} ms, of which the encoder's batch {1000 * encode:.1f} ms and "
          f"queueing + transfer {1000 * max(0.0, trip - encode):.1f} ms; "
          f"{total.get('encdec:encoder_transfer_retries_total', 0):.0f} retries", flush=True)


if __name__ == "__main__":
    main()
