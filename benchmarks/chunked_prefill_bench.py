"""Chunked decoder prefill: decoding requests while long decoder prompts arrive.

BART (bart-base dims, random weights, CPU): ``--streams`` requests decode
(greedy, ``--stream-tokens`` tokens, eos ignored, short prompts); once each has a
few tokens, ``--arrivals`` requests with ``--prompt-len``-token decoder prompts
(64-token encoder inputs, ``--arrival-tokens`` tokens each) arrive at once. The
engine is driven step by step in this process, once per setting of
``--budgets`` ("whole" = chunked prefill off; a number = enable_chunked_prefill
with that max_num_batched_tokens), each on a fresh engine.

    python -m benchmarks.chunked_prefill_bench [--budgets whole,128,512] [--threads 2]

Prints per setting: the streaming requests' inter-token latency (median, p99,
max) from the arrival until they finish, the wall time until every request
finished, and the CPU other processes used meanwhile (the machine is shared).
Outputs must be identical across settings.
"""
from __future__ import annotations

import argparse
import random

from encdec.bench.common import bart_base_dir, stream_gaps


def _prompts(n: int, dec_len: int, seed: int) -> list:
    from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt

    rng = random.Random(seed)
    return [ExplicitEncoderDecoderPrompt(
        encoder_prompt=TokensPrompt(prompt_token_ids=[0] + [rng.randrange(4, 50264) for _ in range(62)] + [2]),
        decoder_prompt=TokensPrompt(prompt_token_ids=[2, 0] + [rng.randrange(4, 50264) for _ in range(dec_len - 2)]))
        for _ in range(n)]


def run(model_dir: str, budget: int | None, args) -> dict:
    from encdec import LLM, SamplingParams

    extra = dict(enable_chunked_prefill=True, max_num_batched_tokens=budget) if budget else {}
    llm = LLM(model_dir, kv_cache_memory=2 << 30, swap_space=0.5, num_threads=args.threads, **extra)
    engine, sched = llm.llm_engine, llm.llm_engine.scheduler
    llm.generate(_prompts(1, 8, 99), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    stream = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
    streams = [f"s{i}" for i in range(args.streams)]
    for rid, p in zip(streams, _prompts(args.streams, 4, 1)):
        engine.add_request(rid, p, stream)
    while min(sched.get_seq_group(r).seqs[0].get_output_len() for r in streams) < 3:
        engine.step()
    arrival = SamplingParams(temperature=0.0, max_tokens=args.arrival_tokens, ignore_eos=True)

    def arrive() -> None:
        for j, p in enumerate(_prompts(args.arrivals, args.prompt_len, 2)):
            engine.add_request(f"a{j}", p, arrival)

    return stream_gaps(engine, streams, args.stream_tokens, arrive)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="whole,128,512")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--arrival-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    model_dir = bart_base_dir()
    print(f"BART bart-base dims: {args.streams} streams decoding {args.stream_tokens} tokens; {args.arrivals} "
          f"requests with {args.prompt_len}-token decoder prompts arrive at once")
    first = None
    for name in args.budgets.split(","):
        budget = None if name == "whole" else int(name)
        r = run(model_dir, budget, args)
        first = first or r["tokens"]
        print(f"{name:>6}: inter-token median {r['median'] * 1e3:7.1f} ms, p99 {r['p99'] * 1e3:7.1f} ms, "
              f"max {r['max'] * 1e3:7.1f} ms, p99/median {r['p99'] / r['median']:5.1f}, all done {r['seconds']:.2f} s, "
              f"same tokens: {r['tokens'] == first}; {r['other_cpu']}")


if __name__ == "__main__":
    main()
