"""Decoder prefix cache: several decoder prompts over each document, cache on vs off.

BART (bart-base dims, random weights): 8 documents (--doc-min..--doc-max
tokens) x 8 decoder prompts that share a 32-token prefix (then 1-8 tokens of
their own), 64 requests, 16 greedy output tokens each, all sent in one
``generate`` call. The encoder cache is on for both sides (one encoder pass per
document); only ``enable_prefix_caching`` differs. Each side runs on a fresh
engine in this process, off first, then on, ``--repeats`` times, best of;
outputs must be identical.

    python -m benchmarks.prefix_cache_bench [--threads N] [--repeats 2]

Prints per side: wall time, prefill tokens the cache saved (its hits), and the
CPU other processes used meanwhile (the machine is shared).
"""
from __future__ import annotations

import argparse
import os
import random
import time

from encdec.bench.common import OtherCPUMonitor, allocator_for_both_sides, bart_base_dir

PREFIX_LEN = 32


def workload(num_docs: int, num_prompts: int, doc_len: tuple[int, int], seed: int = 0) -> list:
    from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt

    rng = random.Random(seed)
    docs = [[0] + [rng.randrange(4, 50264) for _ in range(rng.randint(*doc_len))] + [2] for _ in range(num_docs)]
    prefix = [2, 0] + [rng.randrange(4, 50264) for _ in range(PREFIX_LEN - 2)]
    asks = [[rng.randrange(4, 50264) for _ in range(rng.randint(1, 8))] for _ in range(num_prompts)]
    return [ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=doc),
                                         decoder_prompt=TokensPrompt(prompt_token_ids=prefix + ask))
            for doc in docs for ask in asks]


def run(model_dir: str, on: bool, prompts: list, params, threads: int | None) -> tuple[list, dict]:
    from encdec import LLM, TokensPrompt

    llm = LLM(model_dir, kv_cache_memory=2 << 30, swap_space=0.5, num_threads=threads, enable_prefix_caching=on)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], params, use_tqdm=False)  # warm-up, nothing shared
    bm = llm.llm_engine.scheduler.block_manager
    q0, h0 = bm.prefix_cache_stats()
    with OtherCPUMonitor() as mon:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    q1, h1 = bm.prefix_cache_stats()
    return [o.outputs[0].token_ids for o in outs], dict(seconds=seconds, queries=q1 - q0, hits=h1 - h0,
                                                        other_cpu=mon.summary())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as configured)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side; the best is reported")
    ap.add_argument("--doc-min", type=int, default=128)
    ap.add_argument("--doc-max", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    import torch

    from encdec import SamplingParams

    model_dir = bart_base_dir()
    print(f"threads {args.threads or torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"{allocator_for_both_sides()}")
    prompts = workload(8, 8, (args.doc_min, args.doc_max))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    best: dict[bool, tuple[list, dict]] = {}
    for _ in range(args.repeats):
        for on in (False, True):
            tokens, f = run(model_dir, on, prompts, params, args.threads)
            print(f"prefix cache {'on ' if on else 'off'}: {f['seconds']:6.2f} s, decoder prompt tokens "
                  f"{f['queries']}, found cached {f['hits']}; {f['other_cpu']}")
            if on not in best or f["seconds"] < best[on][1]["seconds"]:
                best[on] = (tokens, f)
    same = best[True][0] == best[False][0]
    ratio = best[False][1]["seconds"] / best[True][1]["seconds"]
    print(f"BART 8 documents x 8 prompts sharing a {PREFIX_LEN}-token decoder prefix: "
          f"speed-up {ratio:.2f}x (best of {args.repeats}), outputs identical: {same}")
    if not same:
        raise SystemExit("outputs differ with the prefix cache on")


if __name__ == "__main__":
    main()
