"""Whisper's decoding rules as one batch-level logits processor.

HF ``WhisperForConditionalGeneration.generate`` applies, in this order:
begin-suppress (``begin_suppress_tokens`` on the first generated token),
suppress (``suppress_tokens`` on every step), then, when timestamps are on,
``WhisperTimeStampLogitsProcessor``. We do the same per row, where a row's
"first generated token" is its first output token (HF's ``begin_index`` is the
decoder prompt length, previous-text prompts included).

A row follows the timestamp rules when its decoder prompt, after the last
``<|startoftranscript|>``, lacks ``<|notimestamps|>`` -- and, on multilingual
models, names a task (a bare ``<|startoftranscript|>`` is language detection).
``SamplingParams.extra_args`` may override per request:
``{"whisper_timestamps": bool, "whisper_suppress_tokens": bool}``.

On CPU the rules run in one C call for all rows
(``encdec.kernels.cpu.whisper_rules_cpu``; this module computes each row's
flags from its output). Elsewhere, or without a C compiler, the torch ops run;
the tests hold both to HF's processors.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from encdec.kernels.cpu import build, whisper_rules_cpu
from encdec.kernels.cpu.whisper_rules_cpu import BEGIN, FIRST, LAST_TS, PENULT_TS, SUPPRESS, TIMESTAMPS
from encdec.models.whisper_tokens import WhisperSpecialTokens
from encdec.platform.device_tensors import to_device
from encdec.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

_NEG_INF = float("-inf")
_EXTRA_KEYS = ("whisper_timestamps", "whisper_suppress_tokens")


def _generation_config(config: Any):
    gc = getattr(config, "generation_config", None)
    if gc is None:
        gc = getattr(getattr(config, "model_config", None), "generation_config", None)
    if gc is None:
        raise ValueError("WhisperLogitsProcessor needs the model's generation config "
                         "(config.generation_config or config.model_config.generation_config)")
    return gc


@dataclass
class _Row:
    output: list[int]  # live list: the engine appends sampled tokens
    timestamps: bool
    suppress: bool


class WhisperLogitsProcessor(LogitsProcessor):
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        gc = _generation_config(config)
        tokens = WhisperSpecialTokens.of(gc)
        vocab = config.model_config.hf_config.vocab_size
        self.device = device
        self.vocab = vocab
        self.sot, self.eos, self.no_ts = tokens.sot, tokens.eot, tokens.no_timestamps
        self.ts_begin = tokens.timestamp_begin
        self.max_initial = getattr(gc, "max_initial_timestamp_index", None)  # HF: None if unset
        self.task_ids = set(tokens.task_to_id.values())
        self.multilingual = tokens.is_multilingual
        self.suppress_ids = self._ids(gc.suppress_tokens, vocab)  # (k,) int64, None if none
        self.begin_ids = self._ids(gc.begin_suppress_tokens, vocab)
        self.rows: dict[int, _Row] = {}
        # The ISA the C rules run with (None: torch ops): CPU only; tests set it to compare the two.
        self.rules_isa = build.cpu_isa() if device.type == "cpu" and whisper_rules_cpu.available() else None

    def _ids(self, ids: list[int] | None, vocab: int) -> torch.Tensor | None:
        ids = sorted({i for i in (ids or []) if 0 <= i < vocab})
        return torch.tensor(ids, dtype=torch.long, device=self.device) if ids else None

    @classmethod
    def validate_params(cls, params: Any) -> None:
        extra = getattr(params, "extra_args", None) or {}
        for key in _EXTRA_KEYS:
            if key in extra and extra[key] is not None and not isinstance(extra[key], bool):
                raise ValueError(f"extra_args[{key!r}] must be a bool or None, got {extra[key]!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # suppressing tokens changes the argmax

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        """No slot: every rule (suppress, begin-suppress, the timestamp rules)
        is computed per draft position by ``apply_at``."""
        return ()

    def apply_static(self, logits: torch.Tensor) -> None:
        if self.suppress_ids is not None:
            logits.index_fill_(1, self.suppress_ids, _NEG_INF)

    def apply_at(self, logits: torch.Tensor, slots: Sequence[int], ahead: Sequence[Sequence[int]]) -> None:
        """Draft rows: each row gets its slot's rules as ``apply`` would give
        them once the row's output had grown by ``ahead`` (the timestamp rules
        read the output's last tokens and the row's own logits; begin-suppress
        the output's length), so a verified position sees what it would see
        without speculation. A slot the processor does not track gets no rule,
        as in ``apply``."""
        rows = {}
        for i, (slot, more) in enumerate(zip(slots, ahead)):
            r = self.rows.get(slot)
            if r is not None:
                rows[i] = _Row(r.output + list(more), r.timestamps, r.suppress) if more else r
        self._apply_rows(logits, rows)

    def wants_timestamps(self, prompt_ids: list[int]) -> bool:
        tail = prompt_ids
        if self.sot in prompt_ids:
            tail = prompt_ids[len(prompt_ids) - 1 - prompt_ids[::-1].index(self.sot):]
        if self.no_ts in tail:
            return False
        return not self.multilingual or any(t in self.task_ids for t in tail)

    def _new_row(self, params: Any, prompt_ids: list[int], output_ids: list[int]) -> _Row:
        extra = getattr(params, "extra_args", None) or {}
        ts = extra.get("whisper_timestamps")
        return _Row(output_ids, self.wants_timestamps(prompt_ids) if ts is None else ts,
                    extra.get("whisper_suppress_tokens", True) is not False)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # (num_reqs, vocab)
        if not self.rows:
            return logits
        n = logits.shape[0]
        return self._apply_rows(logits, {i: r for i, r in self.rows.items() if i < n})

    def _apply_rows(self, logits: torch.Tensor, rows: dict[int, _Row]) -> torch.Tensor:
        """The rules of ``rows`` (logits row -> its state) on those rows of ``logits``."""
        if not rows:
            return logits
        if self.rules_isa is not None and logits.shape[1] == self.vocab and self._apply_c(logits, rows):
            return logits
        # Suppressed ids are written column by column (~90 of ~51865): a
        # vocab-wide mask was a third of this processor's time at 8 rows.
        self._suppress(logits, [i for i, r in rows.items() if r.suppress], self.suppress_ids)
        self._suppress(logits, [i for i, r in rows.items() if r.suppress and not r.output], self.begin_ids)
        ts_rows = sorted(i for i, r in rows.items() if r.timestamps)
        if ts_rows:
            self._timestamp_rules(logits, ts_rows, [rows[i].output for i in ts_rows])
        return logits

    def _apply_c(self, logits: torch.Tensor, rows: dict[int, _Row]) -> bool:
        """The rules in one C call; False, having done nothing, where it declines."""
        n = logits.shape[0]
        flags, lows = [0] * n, [0] * n  # a row the processor does not track: no rule
        for i, r in rows.items():
            f = (SUPPRESS | (0 if r.output else BEGIN)) if r.suppress else 0
            if r.timestamps:
                last_ts, penult_ts, lows[i] = self._timestamp_state(r.output)
                f |= (TIMESTAMPS | (LAST_TS if last_ts else 0) | (PENULT_TS if penult_ts else 0)
                      | (0 if r.output else FIRST))
            flags[i] = f
        return whisper_rules_cpu.whisper_rules(
            logits, flags, lows, self.suppress_ids, self.begin_ids, no_timestamps=self.no_ts, eos=self.eos,
            timestamp_begin=self.ts_begin, max_initial=self.max_initial, isa=self.rules_isa) is not None

    def _timestamp_state(self, seq: list[int]) -> tuple[bool, bool, int]:
        """(the last token is a timestamp, the one before is one or missing, the
        lowest timestamp token allowed next) for a row's output ``seq``."""
        tb = self.ts_begin
        last_ts = len(seq) >= 1 and seq[-1] >= tb
        penult_ts = len(seq) < 2 or seq[-2] >= tb
        low = tb
        for t in reversed(seq):
            if t >= tb:
                low = t if last_ts and not penult_ts else t + 1
                break
        return last_ts, penult_ts, low

    @staticmethod
    def _suppress(logits: torch.Tensor, rows: list[int], ids: torch.Tensor | None) -> None:
        if ids is None or not rows:
            return
        if len(rows) == logits.shape[0]:
            logits.index_fill_(1, ids, _NEG_INF)
        else:
            logits[to_device(rows, torch.long, logits.device).unsqueeze(-1), ids] = _NEG_INF

    def _timestamp_rules(self, logits: torch.Tensor, ts_rows: list[int], outputs: list[list[int]]) -> None:
        """HF ``WhisperTimeStampLogitsProcessor``, row by row (begin_index = first output)."""
        tb, vocab = self.ts_begin, logits.shape[1]
        whole = ts_rows == list(range(logits.shape[0]))  # every row: edit in place, no gather/scatter
        sub = logits if whole else logits[ts_rows]  # (R, vocab)
        sub[:, self.no_ts] = _NEG_INF
        lows = []
        for k, seq in enumerate(outputs):
            last_ts, penult_ts, low = self._timestamp_state(seq)
            if last_ts:
                if penult_ts:  # a pair just closed: text (or eos) next
                    sub[k, tb:] = _NEG_INF
                else:  # an open pair: its closing timestamp or eos, no text
                    sub[k, : self.eos] = _NEG_INF
            lows.append(low)
            if not seq:  # the first token is a timestamp, at most max_initial in
                sub[k, :tb] = _NEG_INF
                if self.max_initial is not None:
                    sub[k, tb + self.max_initial + 1:] = _NEG_INF
        # Monotonic: timestamps below each row's low. Masked on the timestamp columns
        # only (1501 of ~51865): three vocab-wide ops fewer per decode step.
        ts_ids = torch.arange(tb, vocab, device=sub.device)
        low_t = to_device(lows, torch.long, sub.device).unsqueeze(-1)
        sub[:, tb:].masked_fill_(ts_ids < low_t, _NEG_INF)
        # HF compares log-softmaxed values: logsumexp(timestamps) - Z > max(text) - Z.
        # Z cancels, so the raw logits decide, without a vocab-wide log-softmax
        # (30 us a row here; the same decision to float rounding).
        scores = sub.float()
        ts_mass = scores[:, tb:].logsumexp(dim=-1)
        best_text = scores[:, :tb].amax(dim=-1)  # the values only: max() also finds indices, 10x slower
        to_timestamp = ts_mass > best_text  # (R,) rows whose next token must be a timestamp
        if bool(to_timestamp.any()):
            sub[to_timestamp, :tb] = _NEG_INF
        if not whole:
            logits[ts_rows] = sub
