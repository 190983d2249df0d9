"""BART throughput: encdec vs HF ``generate`` on the same random bart-base weights
(``--family t5|marian|m2m100``: those families at base dimensions, with
CTranslate2 beside them; ``families.py``).

64 requests, encoder lengths uniform in 32..512, output lengths uniform in
8..128 (forced: ``ignore_eos`` for us, ``min_new_tokens`` for HF). HF runs in
padded batches of 16 in input order, as a user would; each batch runs until its
longest request is done, and only each request's own tokens count as useful.

    python -m benchmarks.bart_bench [--requests 64] [--threads N] [--profile] [--background-load N]
        [--compute-type int8] [--family t5|marian|m2m100]

With ``--compute-type int8`` (or ``bfloat16``) our run takes ``quantization="int8"``
(``dtype="bfloat16"``); our float32 run and CTranslate2 (if installed) at that
``compute_type`` on the same weights, in padded batches as HF, are timed beside
it, with the share of tokens equal to our float32 run's (random weights: a
test of agreement, not of quality). With ``--family``, ``--compute-type int8``
runs ours int8 against HF float32 and CTranslate2 int8.

With ``--background-load N`` both sides also run with N busy processes taking
cores, printed beside the idle figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from encdec.bench.common import (
    OtherCPUMonitor,
    add_background_load_arg,
    allocator_for_both_sides,
    background_load,
    isa_header,
    load_label,
    load_levels,
)

from .harness import agreement, make_workload, padded, run_ct2, run_ours


def run_hf(model_dir: str, enc, out_lens, batch: int) -> tuple[int, float]:
    import time

    import torch
    from transformers import BartForConditionalGeneration

    model = BartForConditionalGeneration.from_pretrained(model_dir).eval()
    useful = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(enc), batch):
            chunk, lens = enc[i:i + batch], out_lens[i:i + batch]
            ids, mask = padded(chunk)
            m = max(lens)
            g = model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,
                               do_sample=False, num_beams=1, decoder_start_token_id=2,
                               forced_bos_token_id=0, no_repeat_ngram_size=0)
            assert g.shape[1] >= m
            useful += sum(lens)
    return useful, time.perf_counter() - t0


def _parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="alternate ours/HF this many times")
    ap.add_argument("--profile", action="store_true", help="cProfile our run")
    ap.add_argument("--model-dir", default=None, help="reuse a checkpoint (default: make bart-base dims)")
    ap.add_argument("--beams", type=int, default=1, help="beam search with this many beams (> 1)")
    ap.add_argument("--compute-type", default="float32", choices=("float32", "int8", "bfloat16"),
                    help="our precision (int8: quantization='int8'), timed beside our float32 and CTranslate2's")
    ap.add_argument("--family", default="bart", choices=("bart", "t5", "marian", "m2m100"),
                    help="t5, marian, m2m100: that family at base dims, with CTranslate2's row (families.py)")
    add_background_load_arg(ap)
    return ap


def main(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    ap = _parser(prog)
    args = ap.parse_args(argv)
    if args.family != "bart" and (args.beams > 1 or args.compute_type == "bfloat16" or args.background_load
                                  or args.repeats > 1 or args.profile):
        ap.error("--family other than bart runs greedy once, idle, float32 or int8: no --beams, "
                 "--compute-type bfloat16, --background-load, --repeats or --profile")
    levels = load_levels(args.background_load)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["ENCDEC_NUM_THREADS"] = str(torch.get_num_threads())
    if args.family != "bart":
        from .families import family_checkpoint, run_family_bench

        model_dir = family_checkpoint(args.family, args.model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        enc, out_lens = make_workload(args.requests, vocab - 128, args.seed)  # below language codes
        print(f"workload: {args.requests} requests, encoder tokens {sum(map(len, enc))}, "
              f"output tokens {sum(out_lens)}, threads {torch.get_num_threads()}, {allocator_for_both_sides()}")
        print(isa_header())
        run_family_bench(args.family, model_dir, (enc, out_lens), hf_batch=args.hf_batch, skip_hf=args.skip_hf,
                         compute_type=args.compute_type)
        return
    from encdec.testing import make_random_bart

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "encdec_bench_bart_base")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_random_bart(model_dir, vocab_size=50265, d_model=768, layers=6, heads=12, ffn=3072,
                         max_positions=1024, init_std=0.02, position_std=0.02)
    enc, out_lens = make_workload(args.requests, 50265, args.seed)
    print(f"workload: {args.requests} requests, encoder tokens {sum(map(len, enc))}, "
          f"output tokens {sum(out_lens)}, threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {allocator_for_both_sides()}")
    print(isa_header())
    if args.beams > 1:  # beam search: bart_beams.py
        from .bart_beams import run_beam_bench

        run_beam_bench(model_dir, enc, out_lens, beams=args.beams, hf_batch=args.hf_batch,
                       skip_hf=args.skip_hf)
        return
    if args.compute_type != "float32":
        run_compute_type(model_dir, enc, out_lens, args.compute_type, args.hf_batch)
        return
    _alternate(args, levels, model_dir, enc, out_lens)


def _alternate(args: argparse.Namespace, levels: list[int], model_dir: str, enc: list, out_lens: list) -> None:
    """Our engine and HF, alternating, ``args.repeats`` times at each background load."""
    ratios: dict[int, list[float]] = {busy: [] for busy in levels}
    speeds: dict[int, list[float]] = {busy: [] for busy in levels}
    for rep in range(args.repeats):
        for busy in levels:
            # Alternate the two sides so slow drifts of a shared host hit both.
            label = f"[{rep}] {load_label(busy)}"
            with background_load(busy), OtherCPUMonitor() as mon:
                useful, t_ours = run_ours(model_dir, enc, out_lens, args.profile and rep == 0 and not busy)
            ours = useful / t_ours
            speeds[busy].append(ours)
            print(f"{label} encdec: {useful} tokens in {t_ours:.1f} s = {ours:.1f} tok/s; {mon.summary()}")
            if args.skip_hf:
                continue
            with background_load(busy), OtherCPUMonitor() as mon:
                useful_hf, t_hf = run_hf(model_dir, enc, out_lens, args.hf_batch)
            hf = useful_hf / t_hf
            print(f"{label} HF generate (batches of {args.hf_batch}): {useful_hf} tokens in {t_hf:.1f} s = "
                  f"{hf:.1f} tok/s; {mon.summary()}")
            ratios[busy].append(ours / hf)
    for busy in levels:
        if busy:
            slowdown = statistics.median(speeds[0]) / statistics.median(speeds[busy])
            print(f"{load_label(busy)}: encdec {slowdown:.2f}x slower than idle (median tok/s)")
        if ratios[busy]:
            print(f"{load_label(busy)}: ratio encdec / HF: {statistics.median(ratios[busy]):.2f}x (median of "
                  f"{len(ratios[busy])}; all: {', '.join(f'{r:.2f}' for r in ratios[busy])})")


def run_compute_type(model_dir: str, enc, out_lens, compute_type: str, batch: int) -> None:
    """Ours at ``compute_type`` against our float32 and CTranslate2 at ``compute_type``."""
    from encdec.engine.arg_utils import compute_type_options

    f32, low = [], []
    with OtherCPUMonitor() as mon:
        useful, t32 = run_ours(model_dir, enc, out_lens, False, tokens=f32)
    print(f"encdec float32: {useful / t32:.1f} tok/s ({t32:.1f} s); {mon.summary()}")
    with OtherCPUMonitor() as mon:
        _, tlow = run_ours(model_dir, enc, out_lens, False, compute_type_options(compute_type), tokens=low)
    print(f"encdec {compute_type}: {useful / tlow:.1f} tok/s ({tlow:.1f} s), tokens equal to our float32's "
          f"{agreement(low, f32):.3f}; {mon.summary()}")
    print(f"encdec {compute_type} / encdec float32: {t32 / tlow:.2f}x")
    try:
        with OtherCPUMonitor() as mon:
            useful_ct2, tct2, ct2_tokens = run_ct2(model_dir, enc, out_lens, batch, compute_type)
    except ImportError:
        print("ctranslate2 not installed: its row skipped")
        return
    print(f"CTranslate2 {compute_type} (batches of {batch}): {useful_ct2 / tct2:.1f} tok/s ({tct2:.1f} s), "
          f"tokens equal to our float32's {agreement([t[1:] for t in ct2_tokens], f32):.3f}; {mon.summary()}")
    print(f"encdec {compute_type} / CTranslate2 {compute_type}: {(useful / tlow) / (useful_ct2 / tct2):.2f}x")


if __name__ == "__main__":
    main()
