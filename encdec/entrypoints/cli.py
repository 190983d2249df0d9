"""``encdec generate | transcribe | bench | build-kernels | serve``."""
from __future__ import annotations

import argparse
import json
import sys

from encdec.entrypoints.cli_options import add_engine_args, engine_options


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF hub id or local checkpoint directory")
    add_engine_args(p.add_argument_group("engine options (as LLM takes them)"))


engine_kwargs = engine_options  # the engine options given (--model included), as LLM(**...) takes them


def _generate(args: argparse.Namespace) -> int:
    from encdec import LLM, configure_cpu_runtime
    from encdec.beam_search.defaults import with_overrides
    from encdec.inputs import ExplicitEncoderDecoderPrompt

    prompts: list = list(args.prompts)
    if args.input_file:
        try:
            with open(args.input_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            print(f"encdec generate: error: cannot read --input-file {args.input_file!r}: {reason}",
                  file=sys.stderr)
            return 2
    if not prompts:
        print("encdec generate: give prompts as arguments or --input-file", file=sys.stderr)
        return 2
    translating = args.src_lang is not None or args.tgt_lang is not None
    if translating and args.decoder_prompt is not None:
        print("encdec generate: give --decoder-prompt or --src-lang/--tgt-lang, not both "
              "(the languages choose the decoder prompt)", file=sys.stderr)
        return 2
    if args.decoder_prompt is not None:
        prompts = [ExplicitEncoderDecoderPrompt(encoder_prompt=p, decoder_prompt=args.decoder_prompt)
                   for p in prompts]
    configure_cpu_runtime()  # a program owns its process: full CPU speed
    llm = LLM(**engine_options(args))
    # The checkpoint's generation defaults (e.g. bart-large-cnn's 4 beams), then the flags given.
    params = with_overrides(
        llm.get_default_sampling_params(), max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed, n=args.n,
        ignore_eos=args.ignore_eos or None, beam_width=args.beam_width, length_penalty=args.length_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, truncate_prompt_tokens=args.truncate_prompt_tokens)
    if translating:
        outs = llm.translate(prompts, params, src_lang=args.src_lang, tgt_lang=args.tgt_lang,
                             use_tqdm=not args.quiet, truncation=args.truncation)
    else:
        outs = llm.generate(prompts, params, use_tqdm=not args.quiet, truncation=args.truncation)
    for out in outs:
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
    from encdec import bench

    return bench.run(args.which, args.rest)


def _build_kernels(args: argparse.Namespace) -> int:
    import time

    from encdec.kernels.cpu import build

    isa = build.checked_isa(args.isa)
    t0 = time.perf_counter()
    try:
        built = build.build_all(isa, notice=False)
    except RuntimeError as e:
        print(f"encdec build-kernels: {e}: the kernels' callers run torch's paths", file=sys.stderr)
        return 1
    failed = {source: error for source, error in built.items() if error is not None}
    for source, error in failed.items():
        print(f"encdec build-kernels: {source} ({isa}) failed: {error}", file=sys.stderr)
    if built:
        print(f"compiled {len(built) - len(failed)} of {len(built)} CPU kernels for {isa} in "
              f"{time.perf_counter() - t0:.1f} s into {build.cache_dir()}")
    else:
        print(f"all {len(build.sources())} CPU kernels for {isa} already built in {build.cache_dir()}")
    if failed:
        return 1
    _measure_bfloat16()  # with every kernel built: the float32 it is measured against is the real one
    return 0


def _measure_bfloat16() -> None:
    """Set-up also measures whether bfloat16 pays here (seconds, kept with the
    kernels), so its first use finds the answer. float16 is measured at its own
    first use: it has no fast CPU path in torch and its probe is the longest."""
    import time

    import torch

    from encdec.platform import precision

    t0 = time.perf_counter()
    try:
        ratio, source = precision.time_ratio(torch.bfloat16, notice=False)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"encdec build-kernels: bfloat16 not measured ({e}): its first use measures it", file=sys.stderr)
        return
    took = f"measured in {time.perf_counter() - t0:.1f} s" if source == "measured" else source
    verdict = "accepted" if ratio <= 1.0 else "refused (slower than float32)"
    print(f"dtype='bfloat16' on this CPU: {ratio:.2f}x float32's time, {verdict} ({took}; {precision.cache_file()})")


# Flags of the Ray path and their defaults: given without --ray they would do nothing.
_RAY_ONLY = (("--ingress", "ingress", "serve"), ("--replicas", "replicas", 1), ("--replica-cpus", "replica_cpus", 1.0),
             ("--replica-gpus", "replica_gpus", 0.0))


def _serve(args: argparse.Namespace) -> int:
    stray = [flag for flag, name, default in _RAY_ONLY if getattr(args, name) != default]
    if stray and not (args.ray or args.disaggregate):
        print(f"encdec serve: {', '.join(stray)} take effect with --ray only; add --ray, or drop them",
              file=sys.stderr)
        return 2
    if args.ray or args.disaggregate:  # the same app on Ray Serve (encdec.serve_ray)
        try:
            from encdec.serve_ray import serve_ray

            return serve_ray(args)
        except ImportError as e:
            print(str(e), file=sys.stderr)
            return 2
    try:
        from encdec.entrypoints.openai.api_server import serve
    except ImportError as e:
        print(f"encdec serve needs the serve extra (pip install 'encdec[serve]'): {e}", file=sys.stderr)
        return 2
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    """``encdec``'s parser, every subcommand's options included."""
    parser = argparse.ArgumentParser(prog="encdec", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (BART etc.) for prompts")
    _add_engine_args(g)
    g.add_argument("prompts", nargs="*", help="encoder prompts (text)")
    g.add_argument("--input-file", default=None, help="one encoder prompt per line")
    g.add_argument("--decoder-prompt", default=None, help="decoder prompt text for every request")
    g.add_argument("--src-lang", default=None,
                   help="translate from this language (NLLB eng_Latn, M2M100 en, mBART en_XX, T5 English)")
    g.add_argument("--tgt-lang", default=None,
                   help="translate into this language (LLM.translate: the family's control-token prompts)")
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
    g.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="K",
                   help="cut each encoder prompt to its last K tokens (vLLM's truncate_prompt_tokens; -1: the "
                   "model's limit); without it or --truncation a longer prompt is an error")
    g.add_argument("--truncation", action="store_true",
                   help="cut encoder prompts longer than the model's limit to their first tokens and final </s> "
                   "(HF's tokenizer truncation=True; LLM.generate/translate(truncation=True))")
    g.add_argument("--json", action="store_true", help="one JSON object per request")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=_generate)

    try:
        from encdec.entrypoints import transcribe_cli
    except ImportError:
        transcribe_cli = None
    if transcribe_cli is not None:
        transcribe_cli.add_parser(sub)

    # Lists the benchmark modules only; each imports its own dependencies when run.
    from encdec import bench

    b = sub.add_parser("bench", help="benchmarks of encdec alone (encdec/bench/NAME_bench.py); "
                       f"{', '.join(sorted(bench.CHECKOUT_ONLY))} compare with HF and run from a checkout")
    b.add_argument("which", choices=sorted([*bench.names(), *bench.CHECKOUT_ONLY]))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    b.set_defaults(func=_bench)

    from encdec.kernels.cpu.build import ISA_FLAGS

    k = sub.add_parser("build-kernels", help="compile the C kernels for this CPU now (else the first use does)",
                       description="Compile every C kernel for this CPU's instruction set into the kernel cache "
                       "($ENCDEC_CACHE_DIR, default ~/.cache/encdec); kernels already built are kept. Then "
                       "measure whether dtype='bfloat16' runs faster than float32 here (kept there too).")
    k.add_argument("--isa", default=None, choices=tuple(ISA_FLAGS),
                   help="instruction set to build for (default: the best this CPU runs, or $ENCDEC_CPU_ISA)")
    k.set_defaults(func=_build_kernels)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the serve extra)",
                        description="An OpenAI-compatible server: /v1/completions, /v1/audio/"
                        "transcriptions, /v1/audio/translations, /v1/models, /health, /metrics.")
    from encdec.entrypoints.openai.cli_args import add_server_args

    add_server_args(sv)
    sv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"encdec {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
