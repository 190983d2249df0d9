"""Sampling parameters of one request, validated at the edge.

Everything a user can get wrong raises here, before the request is scheduled:
a ``TypeError`` for a value of the wrong kind, a ``ValueError`` naming the field
and the value otherwise. Token ids need the vocabulary, which the engine knows,
so they are checked by ``verify_against(vocab_size)`` at request entry. Nothing
here imports torch.
"""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

from encdec.param_checks import check_bool as _bool
from encdec.param_checks import check_int as _int
from encdec.param_checks import check_number as _num
from encdec.param_checks import int_list as _int_list
from encdec.param_checks import prompt_token_logprobs as _prompt_token_logprobs
from encdec.param_checks import str_list as _str_list
from encdec.param_checks import truncation as _truncation
from encdec.structured_output.params import StructuredOutputsParams, check_structured

_SAMPLING_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM
_MAX_BIAS = 100.0  # logit_bias values are clamped to +-100 (OpenAI's range)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3  # a beam search row (BeamRowParams): greedy logits, HF's beam rules choose the token


_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of the ``index``-th sequence of an ``n > 1`` request: ``seed + index``
    (vLLM V1's rule), so each sequence samples differently yet reproducibly.
    Wrapped to 64 bits as torch reads a seed (a negative seed is its two's
    complement), so every seed of the accepted range derives a valid one."""
    return None if seed is None else (seed + index) % 2**64


def _logit_bias(value: Any) -> dict[int, float] | None:
    """Token id -> bias, clamped to +-100 as OpenAI does. OpenAI clients send
    string keys ("50256"); a key that is no integer, or a NaN/inf bias, is refused."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict, got {type(value).__name__}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        else:
            token = _int("logit_bias keys", key)
        out[token] = min(_MAX_BIAS, max(-_MAX_BIAS, _num(f"logit_bias[{key!r}]", bias)))
    return out


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(kw_only=True)
class SamplingParams:
    """vLLM's ``SamplingParams``; see API.md. ``top_k`` of -1 or 0 disables it;
    ``max_tokens=None`` means "until max_model_len"."""

    n: int = 1
    best_of: int | None = None  # None -> n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Which log-probs ``logprobs`` reports: "raw_logprobs" (the model's logits) or
    # "processed_logprobs" (after the processors and penalties, before temperature
    # and top-k/top-p: Whisper's fallback rule scores attempts at different
    # temperatures on these, as HF and openai/whisper do). vLLM sets this per engine.
    logprobs_mode: str = "raw_logprobs"
    prompt_logprobs: int | None = None
    # Raw log-probs of chosen tokens as the token after chosen decoder-prompt
    # positions: {position: [token ids]}; a negative position counts from the
    # end (-1: the last prompt token, whose distribution is the first generated
    # token's before any processor). Reported once, as
    # RequestOutput.prompt_token_logprobs {position: {token id: log-prob}}.
    # vLLM's prompt_logprobs is every position's top-k; Whisper's no-speech rule
    # needs one token at one position, read from the window's own prefill.
    prompt_token_logprobs: dict[int, list[int]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None
    no_repeat_ngram_size: int = 0  # HF's: ban any n-gram of this size from repeating (0 = off)
    # vLLM's: cut the encoder prompt (token ids; audio features are never cut) to
    # k tokens, -1: to the model's encoder positions; None: a longer prompt is
    # refused. ``truncation_side`` "left" keeps the last k (vLLM's); "right" the
    # first k, a final eos kept (HF's tokenizer(truncation=True), what
    # LLM.generate(..., truncation=True) asks for).
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # The output must match this constraint (a JSON schema, regex, choice or grammar)
    structured_outputs: StructuredOutputsParams | None = None

    # Set by the engine, not the user: eos ids folded into the stop set, and the
    # bad words as token-id sequences (see update_from_tokenizer).
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so turn them off.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        """Types first (normalising numpy scalars and arrays to Python ones), then ranges."""
        self.stop = _str_list("stop", self.stop)
        self.bad_words = _str_list("bad_words", self.bad_words)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids) or []
        self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.prompt_token_logprobs = _prompt_token_logprobs(self.prompt_token_logprobs)
        self.truncate_prompt_tokens = _truncation(self.truncate_prompt_tokens, self.truncation_side)
        self.structured_outputs = check_structured(self.structured_outputs)
        if self.best_of is None:
            self.best_of = self.n
        for name in ("n", "best_of", "top_k", "min_tokens", "no_repeat_ngram_size"):
            setattr(self, name, _int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            setattr(self, name, _int(name, getattr(self, name), none_ok=True))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            setattr(self, name, _num(name, getattr(self, name)))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            setattr(self, name, _bool(name, getattr(self, name)))
        checks = [
            ("n", self.n >= 1, ">= 1"),
            ("best_of", self.best_of >= self.n, f">= n ({self.n})"),
            ("temperature", self.temperature >= 0.0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1 or 0 (off) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "> 0"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("seed", self.seed is None or _SEED_MIN <= self.seed <= _SEED_MAX,
             "a 64-bit integer, in [-2**63, 2**64 - 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            ("no_repeat_ngram_size", self.no_repeat_ngram_size >= 0, ">= 0 (0 = off)"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, ">= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, ">= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if any(s == "" for s in self.stop):
            raise ValueError(f"stop must not contain an empty string, got {self.stop!r}")
        if self.stop and not self.detokenize:
            # vLLM's rule: stop strings are matched in the detokenized text.
            raise ValueError(f"stop strings are only supported when detokenize is True, got "
                             f"stop={self.stop!r} with detokenize=False; set detokenize=True to use stop")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must not contain blank words, got {self.bad_words!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty, got []")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")

    def verify_against(self, vocab_size: int) -> None:
        """Check every token id the user gave against the model's vocabulary; the
        engine calls this at request entry, before anything is scheduled. The
        other fields are checked again too, in case they were set after construction."""
        self._verify()
        self._all_stop_token_ids.update(self.stop_token_ids)
        fields = {
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
            "stop_token_ids": self.stop_token_ids,
            "bad_words": [t for w in self._bad_words_token_ids or () for t in w],
            "prompt_token_logprobs": [t for ids in (self.prompt_token_logprobs or {}).values() for t in ids],
        }
        for name, ids in fields.items():
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must be <= the vocabulary size ({vocab_size}), got {value}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        """``stop_token_ids`` plus the model's eos ids (unless ``ignore_eos``), once
        ``update_from_generation_config`` ran; min_tokens masks exactly these."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token-id sequences of ``bad_words``; None until ``update_from_tokenizer``."""
        return self._bad_words_token_ids

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer must hold back so a stop string can still
        be cut from the streamed text."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def update_from_generation_config(
        self, generation_config: dict[str, Any] | None, model_eos_token_id: int | None = None
    ) -> None:
        """Fold the model's eos ids into the stop set, as vLLM does at request entry."""
        if model_eos_token_id is not None and not self.ignore_eos:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos = (generation_config or {}).get("eos_token_id")
        if eos is not None and not self.ignore_eos:
            eos_ids = {eos} if isinstance(eos, int) else set(eos)
            eos_ids.discard(model_eos_token_id)
            self.stop_token_ids = self.stop_token_ids + sorted(eos_ids - set(self.stop_token_ids))
            self._all_stop_token_ids.update(eos_ids)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` with and without a leading space (vLLM's rule):
        a word at the start of text and mid-sentence are different tokens."""
        ids: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            ids.append(plain)
            # Keep the spaced form only where the space makes a new word token.
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
        self._bad_words_token_ids = ids

    def clone(self) -> SamplingParams:
        """A copy sharing no container with this one. Only the containers are
        deep-copied (every other field is immutable): ``copy.deepcopy`` of the
        whole object was a fifth of processing 512 prompts with params each."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (list, dict, set)):
                setattr(new, name, copy.deepcopy(value))
        return new


# Re-export (API.md): BeamSearchParams lives with the beam search code.
from encdec.beam_search.params import BeamSearchParams  # noqa: E402,F401

__all__ = ["SamplingParams", "SamplingType", "BeamSearchParams", "BeamRowParams", "StructuredOutputsParams"]


@dataclass(kw_only=True)
class BeamRowParams(SamplingParams):
    """The ``SamplingParams`` a beam request's rows run with: greedy (so
    validation, eos folding, the max_tokens cap, the persistent batch and every
    logits processor treat its rows like any other), carrying the user's
    ``BeamSearchParams``. Its ``sampling_type`` is ``BEAM``: the sampler selects
    the group's candidates and the scheduler's beam search decides its beams."""

    beam: BeamSearchParams | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beam is None:
            raise ValueError("BeamRowParams needs beam=BeamSearchParams(...)")

    @property
    def sampling_type(self) -> SamplingType:
        return SamplingType.BEAM

    @classmethod
    def from_beam_params(cls, params: BeamSearchParams) -> BeamRowParams:
        """``best_of = beam_width``: the group is made with ``beam_width`` sequences,
        which share the decoder prompt's blocks and the one cross table."""
        extra = {key: getattr(params, key) for key in ("forced_bos_token_id", "forced_eos_token_id")
                 if getattr(params, key) is not None and getattr(params, key) is not False}
        return cls(
            n=1, best_of=params.beam_width, temperature=0.0, max_tokens=params.max_tokens,
            min_tokens=params.min_tokens, ignore_eos=params.ignore_eos, stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, detokenize=False,
            no_repeat_ngram_size=params.no_repeat_ngram_size, extra_args=extra or None,
            prompt_token_logprobs=params.prompt_token_logprobs, truncate_prompt_tokens=params.truncate_prompt_tokens,
            truncation_side=params.truncation_side, structured_outputs=params.structured_outputs, beam=params)
