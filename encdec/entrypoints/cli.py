"""``encdec generate | transcribe | bench | serve``."""
from __future__ import annotations

import argparse
import json
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF hub id or local checkpoint directory")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache")
    p.add_argument("--swap-space", type=float, default=4, help="GiB of CPU swap for KV blocks")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["xformers", "torch_sdpa"])
    p.add_argument("--logits-processors", nargs="*", default=None,
                   help="custom logits processors as pkg.module:Class")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
                block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                swap_space=args.swap_space, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, attention_backend=args.attention_backend,
                logits_processors=args.logits_processors)


def _generate(args: argparse.Namespace) -> int:
    from encdec import LLM
    from encdec.beam_search.defaults import with_overrides
    from encdec.inputs import ExplicitEncoderDecoderPrompt

    prompts: list = list(args.prompts)
    if args.input_file:
        with open(args.input_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("encdec generate: give prompts as arguments or --input-file", file=sys.stderr)
        return 2
    if args.decoder_prompt is not None:
        prompts = [ExplicitEncoderDecoderPrompt(encoder_prompt=p, decoder_prompt=args.decoder_prompt)
                   for p in prompts]
    llm = LLM(args.model, **engine_kwargs(args))
    # The checkpoint's generation defaults (e.g. bart-large-cnn's 4 beams), then the flags given.
    params = with_overrides(
        llm.get_default_sampling_params(), max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed, n=args.n,
        ignore_eos=args.ignore_eos or None, beam_width=args.beam_width, length_penalty=args.length_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size)
    for out in llm.generate(prompts, params, use_tqdm=not args.quiet):
        if args.json:
            print(json.dumps({"prompt": out.encoder_prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                 **({"score": c.score} if hasattr(c, "score") else {})}
                for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(c.text)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import runpy

    script = {"bart": "bart_bench", "whisper": "whisper_bench"}[args.which]
    sys.argv = [script] + args.rest
    runpy.run_module(f"benchmarks.{script}", run_name="__main__")
    return 0


def _serve(args: argparse.Namespace) -> int:
    print("encdec serve: the OpenAI-compatible server is not built yet; use the offline "
          "LLM API or `encdec generate` / `encdec transcribe`", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="encdec", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (BART etc.) for prompts")
    _add_engine_args(g)
    g.add_argument("prompts", nargs="*", help="encoder prompts (text)")
    g.add_argument("--input-file", default=None, help="one encoder prompt per line")
    g.add_argument("--decoder-prompt", default=None, help="decoder prompt text for every request")
    # Unset options keep the checkpoint's generation defaults (LLM.get_default_sampling_params).
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--n", type=int, default=None)
    g.add_argument("--beam-width", type=int, default=None, help="beam search with this many beams (1: none)")
    g.add_argument("--length-penalty", type=float, default=None, help="beam search: HF's length_penalty")
    g.add_argument("--no-repeat-ngram-size", type=int, default=None, help="ban repeated n-grams (0: off)")
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per request")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=_generate)

    try:
        from encdec.entrypoints import transcribe_cli
    except ImportError:
        transcribe_cli = None
    if transcribe_cli is not None:
        transcribe_cli.add_parser(sub)

    b = sub.add_parser("bench", help="benchmarks against HF generate (run from the repo root)")
    b.add_argument("which", choices=["bart", "whisper"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    b.set_defaults(func=_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible server (not built yet)")
    sv.add_argument("rest", nargs=argparse.REMAINDER)
    sv.set_defaults(func=_serve)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"encdec {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
