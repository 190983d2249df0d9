"""What a beam search request asks for, and what it returns (vLLM's shapes).

``BeamSearchParams`` carries vLLM's names plus HF's beam options; the meanings
are HF transformers' ``generate(num_beams=...)``. Nothing here imports torch or
``encdec.sampling_params`` (which re-exports this class).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from encdec.param_checks import (check_bool, check_int, check_number, int_list, prompt_token_logprobs, str_list,
                                 truncation)
from encdec.structured_output.params import StructuredOutputsParams, check_structured


@dataclass
class BeamSearchParams:
    """Beam search as HF's ``generate(num_beams=beam_width, do_sample=False)``.

    ``max_tokens`` / ``min_tokens`` count generated tokens (HF's ``max_length`` /
    ``min_length`` count the whole decoder sequence; ``LLM.get_default_sampling_params``
    converts). ``length_penalty`` is the exponent of the generated length that
    divides a finished hypothesis' summed log-probabilities. ``early_stopping``:
    True stops a request once ``beam_width`` hypotheses are finished; False stops
    when the best running beam, scored at its current length, cannot beat the
    worst finished one; "never" scores it at ``max_tokens`` when
    ``length_penalty > 0``.
    """

    beam_width: int
    max_tokens: int | None = 16  # None: until the model's max decoder length
    _: KW_ONLY
    min_tokens: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    num_return_sequences: int = 1
    ignore_eos: bool = False
    temperature: float = 0.0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # HF: forced as the first generated token / when one token is left. None: the
    # checkpoint's generation config decides (HF's merge rule); False: none forced.
    forced_bos_token_id: int | bool | None = None
    forced_eos_token_id: int | bool | None = None
    # Also report each hypothesis' log-probs renormalised after the processors, summed
    # (BeamCompletionOutput.renormalized_logprob: HF Whisper's fallback average); one
    # more vocabulary-wide pass per step, so off unless asked for.
    renormalized_logprob: bool = False
    # SamplingParams.prompt_token_logprobs: raw log-probs of chosen tokens at chosen
    # decoder-prompt positions, from the prefill (RequestOutput.prompt_token_logprobs)
    prompt_token_logprobs: dict[int, list[int]] | None = None
    # SamplingParams.truncate_prompt_tokens / truncation_side (vLLM's): the encoder prompt cut to k tokens
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # SamplingParams.structured_outputs: every returned hypothesis matches it
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "min_tokens", "no_repeat_ngram_size", "num_return_sequences"):
            setattr(self, name, check_int(name, getattr(self, name)))
        for name in ("max_tokens", "forced_bos_token_id", "forced_eos_token_id"):
            if not (name.startswith("forced") and getattr(self, name) is False):
                setattr(self, name, check_int(name, getattr(self, name), none_ok=True))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "renormalized_logprob"):
            setattr(self, name, check_bool(name, getattr(self, name)))
        for name in ("length_penalty", "temperature"):
            setattr(self, name, check_number(name, getattr(self, name)))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        checks = [
            ("beam_width", self.beam_width >= 1, ">= 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            ("no_repeat_ngram_size", self.no_repeat_ngram_size >= 0, ">= 0 (0 = off)"),
            ("num_return_sequences", 1 <= self.num_return_sequences <= self.beam_width,
             f"in [1, beam_width={self.beam_width}]"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.temperature != 0:
            raise ValueError(
                f"temperature must be 0 for beam search (deterministic, as HF's num_beams > 1 with "
                f"do_sample=False; beam sampling is not supported), got {self.temperature!r}")
        self.stop = str_list("stop", self.stop)
        if any(s == "" for s in self.stop):
            raise ValueError(f"stop must not contain an empty string, got {self.stop!r}")
        self.stop_token_ids = int_list("stop_token_ids", self.stop_token_ids) or []
        self.prompt_token_logprobs = prompt_token_logprobs(self.prompt_token_logprobs)
        self.truncate_prompt_tokens = truncation(self.truncate_prompt_tokens, self.truncation_side)
        self.structured_outputs = check_structured(self.structured_outputs)


@dataclass
class BeamSearchSequence:
    """One finished hypothesis (vLLM's ``BeamSearchSequence``)."""

    tokens: list[int]  # decoder prompt + generated ids (incl. the final eos)
    text: str  # generated text
    cum_logprob: float  # sum of the processed log-probabilities of the generated tokens
    score: float  # HF's: cum_logprob / generated_len ** length_penalty
    finish_reason: str  # "stop" (eos or stop token/string) | "length"
    stop_reason: int | str | None = None  # the stop token id or string, if any
    logprobs: list[dict[int, float]] = field(default_factory=list)  # not recorded: empty


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: the hypotheses, best first."""

    sequences: list[BeamSearchSequence]
