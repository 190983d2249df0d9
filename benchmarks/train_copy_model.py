"""Trains the copy model that ``benchmarks.spec_bench`` measures speculative decoding on:
a small BART (random init) taught extractive summaries of synthetic documents (the
output copies the sentences that start with a marker word; ``encdec.bench.copy_task``),
on CPU, seeded and deterministic, then saved as an HF checkpoint with a word-level
tokenizer and a manifest. A directory whose manifest records the same options is
reused. After training (or on reuse, with ``--verify``) it prints the held-out exact
match of HF ``generate`` and checks that our ``LLM`` gives the same greedy tokens.

    python -m benchmarks.train_copy_model [--out DIR] [--seed 0] [--steps N] [--verify]
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from encdec.bench.copy_model import TrainOptions, greedy_hf, held_out, read_manifest, source_ids, train_and_save

DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "encdec", "copy_bart")


def options_from(args: argparse.Namespace, base: TrainOptions | None = None) -> TrainOptions:
    """``base`` (default: ``TrainOptions()``) with the options given on the command line."""
    base = base or TrainOptions()
    fields = {f.name for f in dataclasses.fields(TrainOptions)} - {"task"}
    opts = dataclasses.replace(base, **{k: v for k, v in vars(args).items() if k in fields and v is not None})
    if args.num_words is not None:
        opts = dataclasses.replace(opts, task=dataclasses.replace(opts.task, num_words=args.num_words))
    return opts


def check_against_hf(out_dir: str, count: int, threads: int) -> tuple[float, bool]:
    """(HF's held-out exact match, whether our engine's greedy tokens equal HF's) on
    ``count`` held-out documents."""
    import torch
    from transformers import BartForConditionalGeneration

    from encdec import LLM, SamplingParams, TokensPrompt
    from encdec.bench.copy_model import exact_match, task_from_manifest, until_eos

    manifest = read_manifest(out_dir)
    task, seed = task_from_manifest(manifest), manifest["options"]["seed"]
    test = held_out(task, count, seed)
    docs = [d for d, _ in test]
    torch.set_num_threads(threads)
    hf = BartForConditionalGeneration.from_pretrained(out_dir).eval()
    theirs = greedy_hf(hf, docs, task.max_summary_len())
    llm = LLM(out_dir, num_threads=threads, kv_cache_memory=128 << 20, swap_space=0.25)
    outs = llm.generate([TokensPrompt(prompt_token_ids=source_ids(d)) for d in docs],
                        SamplingParams(temperature=0.0, max_tokens=task.max_summary_len()), use_tqdm=False)
    ours = [until_eos(list(o.outputs[0].token_ids)) for o in outs]
    return exact_match(theirs, test), ours == theirs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_copy_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="checkpoint directory (default %(default)s)")
    d = TrainOptions()
    ap.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    ap.add_argument("--steps", type=int, default=None, help=f"AdamW steps (default {d.steps})")
    ap.add_argument("--batch", type=int, default=None, help=f"examples per step (default {d.batch})")
    ap.add_argument("--num-words", type=int, default=None,
                    help=f"content words in the vocabulary (default {d.task.num_words})")
    ap.add_argument("--threads", type=int, default=None, help=f"torch threads while training (default {d.threads})")
    ap.add_argument("--eval", type=int, default=200, help="held-out documents scored after training")
    ap.add_argument("--verify", action="store_true", help="also compare our engine with HF on the held-out set")
    return ap


def main(argv: list[str] | None = None, *, base: TrainOptions | None = None) -> dict:
    """``base``: the options the command line starts from (tests pass a tiny model)."""
    args = build_parser().parse_args(argv)
    opts = options_from(args, base)
    manifest = train_and_save(args.out, opts, eval_count=args.eval)
    print(f"held-out exact match (HF generate, greedy): {manifest['held_out_exact_match']:.1%} "
          f"of {manifest['held_out_count']}; trained in {manifest['train_seconds']:.0f} s on "
          f"{manifest['options']['threads']} thread(s); weights sha256 {manifest['weights_sha256'][:16]}")
    if args.verify:
        acc, same = check_against_hf(args.out, min(args.eval, 64), opts.threads)
        print(f"our LLM vs HF generate on {min(args.eval, 64)} held-out documents: "
              f"{'identical' if same else 'DIFFERENT'} greedy tokens (HF exact match {acc:.1%})")
        if not same:
            raise SystemExit("our engine's greedy outputs differ from HF generate on the copy model")
    return manifest


if __name__ == "__main__":
    main()
