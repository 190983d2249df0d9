"""Ray Data stages: summarization and transcription jobs past one machine.

Ray Data already schedules, retries, autoscales and reads/writes storage; this
module adds only the per-actor engine::

    ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model=path, params=params),
                   batch_size=64, compute=ray.data.ActorPoolStrategy(size=4), num_cpus=2)

Ray builds one ``LLMPredictor`` per actor, so each actor loads one ``LLM`` once
and keeps it for every batch it is given. A batch goes to the engine in one
call, so continuous batching sees all of its rows at once; the actor pool
keeps several batches in flight, one per actor. The predictor accepts Ray
Data's ``"numpy"`` (default) and ``"pandas"`` batch formats, keeps the input
columns and adds its own.

Unlike ``ray.data.llm`` (vLLM's stage), rows may carry an explicit decoder
prompt and ``params`` may be ``BeamSearchParams``, and a bad row (no prompt,
undecodable audio) becomes a row with an ``error`` instead of failing its
batch and, after Ray's retries, the job (``on_error="raise"`` to fail fast).
"""
from __future__ import annotations

import io
import os
import re
from typing import Any

try:
    import ray.data  # noqa: F401  (the stage is meaningless without Ray Data)
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "encdec.ray needs Ray Data, which is not installed: pip install 'encdec[ray]'"
    ) from e

import numpy as np

__all__ = ["LLMPredictor"]

TASKS = ("generate", "transcribe")
# Output columns per task; a batch that already has one of them is refused
# rather than silently overwritten.
OUTPUT_COLUMNS = {"generate": ("generated_text",), "transcribe": ("text", "language")}
ON_ERROR = ("row", "raise")
# The engine's and transcribe's prefix naming an input of a call ("prompt 3: ");
# a row refused alone is input 0 of its call, which says nothing.
_INDEX = re.compile(r"^(prompt|audio input) 0: ")


class LLMPredictor:
    """One ``LLM`` per Ray actor, mapping batches of rows to outputs.

    task="generate": reads ``prompt`` (text, or a list of token ids) and, when
    present, ``decoder_prompt`` (text, token ids or None for the model's
    default), and adds ``generated_text`` (the best completion). ``params`` is
    whatever ``LLM.generate`` takes (``SamplingParams``, ``BeamSearchParams``);
    None uses the checkpoint's generation defaults.

    task="transcribe": reads ``audio`` (a path, or the file's bytes decoded in
    memory) and adds ``text`` and ``language``; ``transcribe_options`` are
    ``LLM.transcribe``'s keyword options (language, beam_size, timestamps, ...).

    ``on_error="row"`` (default): a row the engine cannot take (no prompt, an
    empty one, undecodable audio, a missing column) gets None outputs and its
    message in an added ``error`` column (None on good rows); the other rows of
    its batch complete. ``on_error="raise"``: such a row fails its batch, and
    so the job, naming the row (no ``error`` column).

    ``num_threads`` sets torch's threads in the actor (the actor is its own
    process, so this is the one place to set them); None keeps what Ray gave
    the worker (``OMP_NUM_THREADS`` = the actor's ``num_cpus``). Other keyword
    arguments go to ``LLM``.
    """

    def __init__(self, model: str | os.PathLike, *, task: str = "generate", params: Any = None,
                 transcribe_options: dict[str, Any] | None = None, num_threads: int | None = None,
                 on_error: str = "row", **llm_kwargs: Any):
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if task == "transcribe" and params is not None:
            raise ValueError("params applies to task='generate'; for task='transcribe' pass "
                             "LLM.transcribe's options in transcribe_options")
        if task == "generate" and transcribe_options is not None:
            raise ValueError("transcribe_options applies to task='transcribe' only")
        if isinstance(params, (list, tuple)):
            raise TypeError("params must be one params object for every row, got a "
                            f"{type(params).__name__}")
        outputs = max(getattr(params, "n", 1) or 1, getattr(params, "num_return_sequences", 1) or 1)
        if outputs > 1:
            raise ValueError(f"params asks for {outputs} completions per row; LLMPredictor writes "
                             "one generated_text per row (set n=1 / num_return_sequences=1)")
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        from encdec import LLM, configure_cpu_runtime

        options = dict(transcribe_options or {})
        if "use_tqdm" in options:
            raise ValueError("transcribe_options must not set use_tqdm: actors show no progress bars")
        if task == "transcribe":
            from encdec.transcription.options import TranscribeOptions

            try:  # bad options fail here, when the actor starts, not on the first batch
                TranscribeOptions(**{"initial_prompt" if k == "prompt" else k: v for k, v in options.items()})
            except (TypeError, ValueError) as e:
                raise type(e)(f"transcribe_options: {e}") from None
        self.task = task
        self.params = params
        self.transcribe_options = options
        self.num_threads = num_threads
        self.on_error = on_error
        # The actor is its own process, so it sets the process-wide CPU settings
        # (threads, retained host memory) a program sets, before its engine starts.
        configure_cpu_runtime(self.num_threads)
        self.llm = LLM(os.fspath(model), **llm_kwargs)

    def __call__(self, batch: Any) -> Any:
        columns = _Columns(batch)
        added = OUTPUT_COLUMNS[self.task] + (("error",) if self.on_error == "row" else ())
        for name in added:
            if name in columns.names:
                raise ValueError(f"the batch already has a {name!r} column, which LLMPredictor "
                                 f"(task={self.task!r}, on_error={self.on_error!r}) writes; rename or "
                                 f"drop it first")
        errors: list[str | None] = [None] * columns.num_rows
        if self.task == "generate":
            inputs = self._cells(columns, "prompt", _singleton, errors)
            if "decoder_prompt" in columns.names:
                decoder = self._cells(columns, "decoder_prompt", _decoder_prompt, errors)
                inputs = [_explicit(p, d) for p, d in zip(inputs, decoder)]
        else:
            inputs = self._cells(columns, "audio", _load_audio, errors)
        done = self._complete(inputs, [row for row, e in enumerate(errors) if e is None], errors)
        new = {name: [done[row][k] if row in done else None for row in range(columns.num_rows)]
               for k, name in enumerate(OUTPUT_COLUMNS[self.task])}
        if self.on_error == "row":
            new["error"] = errors
        return columns.with_new(new)

    def _cells(self, columns: _Columns, name: str, convert: Any, errors: list[str | None]) -> list[Any]:
        """Each row's cell of column ``name`` through ``convert``; a cell it refuses
        (or a missing column) is its row's error, or raises naming the row."""
        if name not in columns.names:
            message = f"task={self.task!r} reads a {name!r} column; the batch has {columns.names}"
            if self.on_error == "raise":
                raise ValueError(message)
            errors[:] = [e or f"ValueError: {message}" for e in errors]
            return [None] * columns.num_rows
        out: list[Any] = []
        for row, value in enumerate(columns.get(name)):
            try:
                out.append(convert(value))
            except (ValueError, TypeError) as e:
                if self.on_error == "raise":
                    raise type(e)(f"row {row}: {e}") from None
                errors[row] = errors[row] or f"{type(e).__name__}: {e}"
                out.append(None)
        return out

    def _complete(self, inputs: list[Any], rows: list[int], errors: list[str | None]) -> dict[int, tuple]:
        """Outputs of ``rows`` (row -> output columns), from one engine call when
        it takes them all. The engine checks a whole call before queuing anything,
        so a refusal costs no decoding: with on_error="row" the rows are split in
        halves until each refused row stands alone and gets the engine's message."""
        if not rows:
            return {}
        try:
            return dict(zip(rows, self._run([inputs[row] for row in rows])))
        except (ValueError, TypeError) as e:
            if self.on_error == "raise":
                raise _refused(e, len(errors)) from e
            if len(rows) == 1:
                errors[rows[0]] = f"{type(e).__name__}: {_INDEX.sub('', str(e))}"
                return {}
            half = len(rows) // 2
            return {**self._complete(inputs, rows[:half], errors), **self._complete(inputs, rows[half:], errors)}

    def _run(self, inputs: list[Any]) -> list[tuple]:
        """One engine call: a tuple of output columns per input."""
        if self.task == "transcribe":
            results = self.llm.transcribe(inputs, **self.transcribe_options, use_tqdm=False)
            return [(r.text, r.language) for r in results]
        if self.params is None:  # the checkpoint's defaults
            outs = self.llm.generate(inputs, use_tqdm=False)
        else:
            outs = self.llm.generate(inputs, self.params, use_tqdm=False)
        return [(o.outputs[0].text,) for o in outs]


class _Columns:
    """Column access over Ray Data's numpy (dict of arrays) and pandas batches."""

    def __init__(self, batch: Any):
        if isinstance(batch, dict):
            self.names = list(batch)
            lengths = {len(v) for v in batch.values()}
            if len(lengths) > 1:
                raise ValueError(f"batch columns have different lengths: {sorted(lengths)}")
            self.num_rows = lengths.pop() if lengths else 0
        elif _is_dataframe(batch):
            self.names, self.num_rows = list(batch.columns), len(batch)
        else:
            raise TypeError(f"LLMPredictor takes batch_format='numpy' or 'pandas' batches, got "
                            f"{type(batch).__module__}.{type(batch).__name__}")
        self.batch = batch

    def get(self, name: str) -> list[Any]:
        col = self.batch[name]
        return col.tolist() if _is_dataframe(self.batch) else list(col)

    def with_new(self, new: dict[str, list[Any]]) -> Any:
        if _is_dataframe(self.batch):
            return self.batch.assign(**new)
        out = dict(self.batch)
        for name, values in new.items():
            arr = np.empty(len(values), dtype=object)  # variable-length text, not fixed-width '<U'
            arr[:] = values
            out[name] = arr
        return out


def _is_dataframe(batch: Any) -> bool:
    import pandas  # a dependency of Ray Data

    return isinstance(batch, pandas.DataFrame)


def _singleton(value: Any, column: str = "prompt") -> Any:
    """A cell -> a prompt the engine takes: text, or token ids as a TokensPrompt."""
    from encdec.inputs import TokensPrompt

    if isinstance(value, str):
        return str(value)  # np.str_ -> str
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return TokensPrompt(prompt_token_ids=[int(t) for t in value])
    if isinstance(value, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value):
        return TokensPrompt(prompt_token_ids=[int(t) for t in value])
    raise TypeError(f"{column!r} must be text or a list of token ids, "
                    f"got {type(value).__name__} {_preview(value)}")


def _decoder_prompt(value: Any) -> Any:
    return None if value is None else _singleton(value, "decoder_prompt")


def _explicit(prompt: Any, decoder_prompt: Any) -> Any:
    from encdec.inputs import ExplicitEncoderDecoderPrompt

    return ExplicitEncoderDecoderPrompt(encoder_prompt=prompt, decoder_prompt=decoder_prompt)


def _load_audio(value: Any) -> np.ndarray:
    """A cell (path or encoded bytes) -> 16 kHz mono float32, decoded once, here,
    so that an unreadable file is its row's error."""
    from encdec.audio import load_audio

    if isinstance(value, (bytes, bytearray, memoryview)) and _is_path_text(bytes(value)):
        # Arrow types a column by its values: one that mixes paths and bytes is
        # ``binary``, and its paths arrive as their UTF-8 bytes.
        path = bytes(value).decode("utf-8")
        if not os.path.exists(path):
            raise ValueError(f"'audio' bytes {_preview(bytes(value))} are text, not audio, and name no "
                             f"file when read as a path (as a column mixing paths and bytes gives them)")
        value = path
    if isinstance(value, (str, os.PathLike)):
        source: Any = os.fspath(value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        import soundfile

        try:
            data, sr = soundfile.read(io.BytesIO(bytes(value)), dtype="float32")
        except Exception as e:  # soundfile raises its own LibsndfileError and RuntimeError
            raise ValueError(f"'audio' bytes ({len(value)} bytes) cannot be decoded: "
                             f"{type(e).__name__}: {e}; formats libsndfile cannot read in memory "
                             f"(e.g. m4a) must be given as paths") from None
        source = (data, int(sr))
    else:
        raise TypeError(f"'audio' must be a path or the file's bytes, got "
                        f"{type(value).__name__} {_preview(value)}")
    return load_audio(source)


def _is_path_text(data: bytes) -> bool:
    """Bytes that can only be a path: UTF-8 text of a path's length without NUL.
    No audio file is: each format's header holds NUL bytes (WAV/AIFF/M4A sizes,
    FLAC, Ogg, ID3) or bytes that are not UTF-8 (an MPEG frame's 0xFF sync)."""
    if not 0 < len(data) <= 4096 or b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _refused(e: Exception, num_rows: int) -> Exception:
    """The engine validates a whole call before queuing anything; its messages
    index prompts in call order, which is row order within this batch."""
    kind = TypeError if isinstance(e, TypeError) else ValueError
    return kind(f"encdec refused a batch of {num_rows} rows (an index below is the row "
                f"within this batch): {e}")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
