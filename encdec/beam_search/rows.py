"""The ``SamplingParams`` a beam request's rows run with.

A beam request enters the engine as a ``BeamRowParams``: a greedy
``SamplingParams`` (so validation, eos folding, the max_tokens cap, the
persistent batch and every logits processor treat its rows like any other)
that also carries the user's ``BeamSearchParams``. The model runner and the
engine recognise beam groups by this type.
"""
from __future__ import annotations

from dataclasses import dataclass

from encdec.beam_search.params import BeamSearchParams
from encdec.sampling_params import SamplingParams


@dataclass(kw_only=True)
class BeamRowParams(SamplingParams):
    beam: BeamSearchParams | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beam is None:
            raise ValueError("BeamRowParams needs beam=BeamSearchParams(...)")

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
            prompt_token_logprobs=params.prompt_token_logprobs, beam=params)
