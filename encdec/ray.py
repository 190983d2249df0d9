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
prompt and ``params`` may be ``BeamSearchParams``.
"""
from __future__ import annotations

import inspect
import io
import os
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

    ``num_threads`` sets torch's threads in the actor (the actor is its own
    process, so this is the one place to set them); None keeps what Ray gave
    the worker (``OMP_NUM_THREADS`` = the actor's ``num_cpus``). Other keyword
    arguments go to ``LLM``.
    """

    def __init__(self, model: str | os.PathLike, *, task: str = "generate", params: Any = None,
                 transcribe_options: dict[str, Any] | None = None, num_threads: int | None = None,
                 **llm_kwargs: Any):
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
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
            try:  # unknown options fail here, when the actor starts, not on the first batch
                inspect.signature(LLM.transcribe).bind(None, None, **options)
            except TypeError as e:
                raise TypeError(f"transcribe_options: {e}") from None
        self.task = task
        self.params = params
        self.transcribe_options = options
        self.num_threads = num_threads
        # The actor is its own process, so it sets the process-wide CPU settings
        # (threads, retained host memory) a program sets, before its engine starts.
        configure_cpu_runtime(self.num_threads)
        self.llm = LLM(os.fspath(model), **llm_kwargs)

    def __call__(self, batch: Any) -> Any:
        columns = _Columns(batch)
        for name in OUTPUT_COLUMNS[self.task]:
            if name in columns.names:
                raise ValueError(f"the batch already has a {name!r} column, which LLMPredictor "
                                 f"(task={self.task!r}) writes; rename or drop it first")
        if columns.num_rows == 0:
            return columns.with_new({name: [] for name in OUTPUT_COLUMNS[self.task]})
        if self.task == "generate":
            return columns.with_new({"generated_text": self._generate(columns)})
        texts, languages = self._transcribe(columns)
        return columns.with_new({"text": texts, "language": languages})

    def _generate(self, columns: _Columns) -> list[str]:
        from encdec.inputs import ExplicitEncoderDecoderPrompt

        prompts: list[Any] = [_singleton(v, row, "prompt")
                              for row, v in enumerate(columns.get("prompt", self.task))]
        if "decoder_prompt" in columns.names:
            prompts = [ExplicitEncoderDecoderPrompt(
                encoder_prompt=p, decoder_prompt=None if d is None else _singleton(d, row, "decoder_prompt"))
                for row, (p, d) in enumerate(zip(prompts, columns.get("decoder_prompt", self.task)))]
        try:
            if self.params is None:  # the checkpoint's defaults
                outs = self.llm.generate(prompts, use_tqdm=False)
            else:
                outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        except (ValueError, TypeError) as e:
            raise _refused(e, columns.num_rows) from e
        return [o.outputs[0].text for o in outs]

    def _transcribe(self, columns: _Columns) -> tuple[list[str], list[str | None]]:
        wavs = [_load_audio(v, row) for row, v in enumerate(columns.get("audio", self.task))]
        try:
            results = self.llm.transcribe(wavs, **self.transcribe_options, use_tqdm=False)
        except (ValueError, TypeError) as e:
            raise _refused(e, columns.num_rows) from e
        return [r.text for r in results], [r.language for r in results]


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

    def get(self, name: str, task: str) -> list[Any]:
        if name not in self.names:
            raise ValueError(f"task={task!r} reads a {name!r} column; the batch has {self.names}")
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


def _singleton(value: Any, row: int, column: str) -> Any:
    """A cell -> a prompt the engine takes: text, or token ids as a TokensPrompt."""
    from encdec.inputs import TokensPrompt

    if isinstance(value, str):
        return str(value)  # np.str_ -> str
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return TokensPrompt(prompt_token_ids=[int(t) for t in value])
    if isinstance(value, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value):
        return TokensPrompt(prompt_token_ids=[int(t) for t in value])
    raise TypeError(f"row {row}: {column!r} must be text or a list of token ids, "
                    f"got {type(value).__name__} {_preview(value)}")


def _load_audio(value: Any, row: int) -> np.ndarray:
    """A cell (path or encoded bytes) -> 16 kHz mono float32, decoded once, here,
    so that an unreadable file names its row."""
    from encdec.audio import load_audio

    if isinstance(value, (str, os.PathLike)):
        source: Any = os.fspath(value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        import soundfile

        try:
            data, sr = soundfile.read(io.BytesIO(bytes(value)), dtype="float32")
        except Exception as e:  # soundfile raises its own LibsndfileError and RuntimeError
            raise ValueError(f"row {row}: 'audio' bytes ({len(value)} bytes) cannot be decoded: "
                             f"{type(e).__name__}: {e}; formats libsndfile cannot read in memory "
                             f"(e.g. m4a) must be given as paths") from None
        source = (data, int(sr))
    else:
        raise TypeError(f"row {row}: 'audio' must be a path or the file's bytes, got "
                        f"{type(value).__name__} {_preview(value)}")
    try:
        return load_audio(source)
    except ValueError as e:
        raise ValueError(f"row {row}: {e}") from None


def _refused(e: Exception, num_rows: int) -> Exception:
    """The engine validates a whole call before queuing anything; its messages
    index prompts in call order, which is row order within this batch."""
    kind = TypeError if isinstance(e, TypeError) else ValueError
    return kind(f"encdec refused a batch of {num_rows} rows (an index below is the row "
                f"within this batch): {e}")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
