"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked at the edge.

Two methods, vLLM's names::

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_max": n, "prompt_lookup_min": m}
    {"method": "draft_model", "model": DIR_OR_ID, "num_speculative_tokens": k,
     "quantization": None | "int8", "draft_vocab_size": None | N}

Every check here runs before anything loads: a bad value is a ``ValueError``
(a wrong type a ``TypeError``) naming the field. Whether a draft checkpoint
fits its target (same vocabulary, same tokenizer, same kind of encoder input)
is ``check_draft_compatible`` (``compat``), which reads configs and
tokenizers, never weights.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
DRAFT_QUANTIZATIONS = (None, "int8")
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_NGRAM_ONLY = ("prompt_lookup_max", "prompt_lookup_min")
_DRAFT_ONLY = ("model", "quantization", "draft_vocab_size")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"speculative_config.{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative configuration (build it with ``from_dict``)."""

    method: str  # "ngram": drafts copied from the encoder input and the decoder's own tokens; "draft_model"
    num_speculative_tokens: int  # k: draft tokens proposed and verified per request and step, >= 1
    prompt_lookup_max: int | None = None  # ngram: the longest suffix n-gram searched
    prompt_lookup_min: int | None = None  # ngram: the shortest, <= prompt_lookup_max
    model: str | None = None  # draft_model: checkpoint directory or hub id (may be the target itself)
    quantization: str | None = None  # draft_model: None or "int8" (an int8 self-draft of a float32 target)
    # draft_model: the draft's LM head keeps the rows of the N lowest token ids and the
    # ids the decoding rules need (spec_decode.draft_vocab); None (or N >= the vocabulary): all rows
    draft_vocab_size: int | None = None
    # vLLM's: no drafts in a step whose running requests are more than this many
    # (a big batch's step is compute-bound: scoring drafts costs more than it saves)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft()

    def _check_ngram(self) -> None:
        for name in _DRAFT_ONLY:
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} applies to method 'draft_model', not 'ngram'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _positive_int(name, value)
        if lo is None or hi is None:  # vLLM's defaults: both 5, or the one given for both
            lo = hi = DEFAULT_PROMPT_LOOKUP if lo is None and hi is None else (lo if hi is None else hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")

    def _check_draft(self) -> None:
        for name in _NGRAM_ONLY:
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} applies to method 'ngram', not 'draft_model'")
        if self.model is None:
            raise ValueError("speculative_config.model is required for method 'draft_model' "
                             "(a checkpoint directory or hub id; the target's own gives a self-draft)")
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"speculative_config.model must be a str or path, got {type(self.model).__name__}")
        object.__setattr__(self, "model", os.fspath(self.model))
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization must be None or 'int8', got {self.quantization!r}")
        if self.draft_vocab_size is not None:
            _positive_int("draft_vocab_size", self.draft_vocab_size)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
        """From vLLM's dict (or its JSON text, as ``--speculative-config`` gives it).
        Unknown keys are refused by name. Without ``method``, a ``model`` means
        "draft_model" and ``"model": "ngram"`` means "ngram" (vLLM's older spelling)."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(spec, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}")
        values = dict(spec)
        if values.get("method") is None:
            if values.get("model") in ("ngram", "[ngram]"):
                values["method"], values["model"] = "ngram", None
            elif values.get("model") is not None:
                values["method"] = "draft_model"
            else:
                raise ValueError(f"speculative_config.method is required: one of {list(METHODS)}")
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config.num_speculative_tokens is required (k >= 1)")
        return cls(**values)

    def check_draft(self, target_model: str | os.PathLike) -> None:
        """For "draft_model": ``ValueError`` unless the draft fits ``target_model``
        (``compat.check_draft_compatible``; configs and tokenizers only, before
        any weight loads). Nothing to check for "ngram"."""
        if self.method == "draft_model":
            from encdec.spec_decode.compat import check_draft_compatible

            check_draft_compatible(target_model, self.model)
