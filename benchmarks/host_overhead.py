"""The host's work per decode step: our engine and HF ``generate`` on a model whose
kernels cost almost nothing (BART, 1 layer, d_model 32), so what is timed is the
bookkeeping around them.

Rows 1, 16, 64, 256 (one request each, 64 tokens, greedy, eos suppressed until then: ``min_tokens`` and HF's ``min_new_tokens``), both
sides in one process on the same weights and threads, alternating. Printed per
row count: ms per step (a run's time / its 64 tokens), and the slope between the
two largest counts, in us per row per step (the cost one more request adds to a
step). Our side's step is split by phase from one extra run with timers around
the engine's seams: schedule, execute (prepare, forward, logits + sample, the
rest), update, outputs.

    python -m benchmarks.host_overhead [--rows 1 16 64 256] [--tokens 64] [--threads 2]
        [--repeats 3] [--profile ROWS]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections import defaultdict

from encdec.bench.common import OtherCPUMonitor, allocator_for_both_sides, isa_header


def workload(rows: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed + rows)
    return [[rng.randrange(4, vocab - 1) for _ in range(rng.randint(16, 48))] for _ in range(rows)]


class Ours:
    def __init__(self, model_dir: str):
        from encdec import LLM

        self.llm = LLM(model_dir, kv_cache_memory=1 << 30, swap_space=0.1, max_num_seqs=512)

    def run(self, enc: list[list[int]], tokens: int) -> list[list[int]]:
        from encdec import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)  # as HF min_new_tokens
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=e) for e in enc], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    @contextlib.contextmanager
    def phases(self):
        """Timers around the engine's seams for one run (instance attributes
        shadow the methods; removed on exit). Yields {phase: seconds}."""
        eng = self.llm.llm_engine
        runner = eng.worker.model_runner
        spent: dict[str, float] = defaultdict(float)
        wrapped = []

        def wrap(obj, name, phase):
            fn = getattr(obj, name)
            own = name in vars(obj)  # an instance attribute (the runner's sampler), not a method

            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[phase] += time.perf_counter() - t0
            setattr(obj, name, timed)
            wrapped.append((obj, name, fn if own else None))

        wrap(eng.scheduler, "schedule", "schedule")
        wrap(eng.worker, "execute_model", "execute")
        wrap(runner, "prepare", "execute: prepare")
        wrap(runner, "_eager", "execute: forward")
        wrap(runner.model, "compute_logits", "execute: logits+sample")
        wrap(runner, "sampler", "execute: logits+sample")
        wrap(eng.scheduler, "update", "update")
        wrap(eng.output_processor, "make_output", "outputs")
        try:
            yield spent
        finally:
            for obj, name, fn in reversed(wrapped):
                if fn is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, fn)


def run_hf(model, enc: list[list[int]], tokens: int) -> list[list[int]]:
    import torch

    from .harness import padded

    ids, mask = padded(enc)
    with torch.inference_mode():
        # Our BART decoder prompt is </s><s>; HF starts at </s> and forces <s>: one step more.
        g = model.generate(ids, attention_mask=mask, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1,
                           do_sample=False, num_beams=1, decoder_start_token_id=2,
                           forced_bos_token_id=0, no_repeat_ngram_size=0)
    return [row[2:].tolist() for row in g]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="cProfile our run at this many rows")
    args = ap.parse_args()

    import torch
    from transformers import BartForConditionalGeneration

    from encdec.testing import make_random_bart

    torch.set_num_threads(args.threads)
    print(isa_header())
    print(allocator_for_both_sides())
    print(f"threads: {args.threads}; BART 1 layer, d_model 32; {args.tokens} tokens a request, greedy; "
          f"best of {args.repeats}, sides alternating")
    d = make_random_bart(tempfile.mkdtemp(prefix="host_overhead_"), d_model=32, layers=1, heads=2, ffn=64,
                         vocab_size=1000, max_positions=256, seed=0)
    ours = Ours(d)
    hf = BartForConditionalGeneration.from_pretrained(d).eval()
    ours.run(workload(2, 1000), 4)  # warm both
    run_hf(hf, workload(2, 1000), 4)
    table = {}
    with OtherCPUMonitor() as mon:
        for rows in args.rows:
            enc = workload(rows, 1000)
            t_ours, t_hf = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                got = ours.run(enc, args.tokens)
                t_ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ref = run_hf(hf, enc, args.tokens)
                t_hf.append(time.perf_counter() - t0)
            same = sum(a == b for a, b in zip(got, ref))
            table[rows] = (min(t_ours) / args.tokens * 1e3, min(t_hf) / (args.tokens + 1) * 1e3, same)
            with ours.phases() as spent:
                t0 = time.perf_counter()
                ours.run(enc, args.tokens)
                total = time.perf_counter() - t0
            split = ", ".join(f"{k} {v / args.tokens * 1e3:.3f}" for k, v in sorted(spent.items()))
            rest = total - sum(v for k, v in spent.items() if ":" not in k)
            print(f"rows {rows:4d}: ours {table[rows][0]:7.3f} ms/step, HF {table[rows][1]:7.3f} ms/step, "
                  f"ours/HF {table[rows][0] / table[rows][1]:.2f}; outputs equal to HF: {same}/{rows}")
            print(f"           our phases (ms/step): {split}, engine loop rest {rest / args.tokens * 1e3:.3f}")
        if args.profile:
            import cProfile
            import pstats

            enc = workload(args.profile, 1000)
            prof = cProfile.Profile()
            prof.enable()
            ours.run(enc, args.tokens)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    big = sorted(table)[-2:]
    if len(big) == 2:
        (a, b) = big
        for side, i in (("ours", 0), ("HF", 1)):
            slope = (table[b][i] - table[a][i]) / (b - a) * 1e3
            print(f"{side}: {slope:.1f} us per row per step (slope {a} -> {b} rows)")
    print(f"ours / HF per step: " + ", ".join(f"{r} rows {v[0] / v[1]:.2f}" for r, v in sorted(table.items())))
    print(mon.summary())


if __name__ == "__main__":
    main()
