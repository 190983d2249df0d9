"""Steps that admit requests beside decoding ones, on CPU: their short-prompt
prefills riding the fused decode step's C call (``step_plan.admits_as_decodes``)
against running op by op, one engine, one process, sides alternating.

The copy model's held-out documents (``benchmarks.spec_bench``'s continuous
workload: one ``generate`` call with at most ``--in-flight`` running, a request
joining as one finishes), greedy. The op-by-op side switches the runner's
admission test off; outputs must be identical.

    python -m benchmarks.admission_bench [--in-flight 8 64] [--docs 512] [--repeats 4]
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: a spinning runtime halves CPU speed


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="the copy model (default: spec_bench's)")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[8, 64], help="requests running at once")
    ap.add_argument("--docs", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=4, help="rounds; the best per side is reported")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from benchmarks.spec_bench import DEFAULT_MODEL_DIR, copy_workload
    from encdec import LLM
    from encdec.bench.common import OtherCPUMonitor, isa_header
    from encdec.worker import enc_dec_model_runner as runner

    torch.set_num_threads(args.threads)
    print(isa_header())
    model_dir, admits = args.model_dir or DEFAULT_MODEL_DIR, runner.admits_as_decodes
    sides = {"op by op": lambda *a: False, "admitted": admits}
    results: dict[int, dict[str, float]] = {}
    try:
        for n in args.in_flight:
            work = copy_workload(model_dir, args.docs, n, continuous=True)
            llm = LLM(model_dir, kv_cache_memory=256 << 20, num_threads=args.threads, **work.engine_options)
            llm.generate(work.batches[0][:n], work.params, use_tqdm=False)  # warm-up
            best, outs, other = {s: float("inf") for s in sides}, {}, {s: 0.0 for s in sides}
            for _ in range(args.repeats):
                for name, rule in sides.items():
                    runner.admits_as_decodes = rule
                    with OtherCPUMonitor() as mon:
                        seconds, got = _timed(llm, work)
                    if seconds < best[name]:
                        best[name], other[name] = seconds, mon.mean()
                    outs[name] = got
            if outs["op by op"] != outs["admitted"]:
                raise SystemExit(f"{n} in flight: outputs differ between the sides")
            results[n] = best
            print(f"{work.label}: op by op {best['op by op']:.3f} s (other CPU {other['op by op']:.0f}%), "
                  f"admitted {best['admitted']:.3f} s (other CPU {other['admitted']:.0f}%), "
                  f"{best['op by op'] / best['admitted']:.2f}x; outputs identical", flush=True)
    finally:
        runner.admits_as_decodes = admits
    return results


def _timed(llm, work) -> tuple[float, list[list[int]]]:
    import time

    t0 = time.perf_counter()
    outs = [list(o.outputs[0].token_ids) for b in work.batches for o in llm.generate(b, work.params, use_tqdm=False)]
    return time.perf_counter() - t0, outs


if __name__ == "__main__":
    main()
