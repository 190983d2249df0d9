"""How one decoding attempt of a window is asked for, and what its output scores.

``beam_size`` follows HF long-form ``generate(num_beams=beam_size)``: an attempt
at temperature 0 is beam search of width ``beam_size``; an attempt at a
temperature > 0 (a fallback retry) samples one sequence at that temperature --
HF turns beams off when it samples (``num_beams = 1`` with ``do_sample``), and
that is also faster-whisper with ``best_of=1``. (HF keeps ``num_beams = 1`` for
every later window of the call once one window has sampled; we go back to beams
at temperature 0, as faster-whisper does.)

The fallback rule's average log-probability is the sum over the output tokens
(eos included) divided by their number, as HF's ``_retrieve_avg_logprobs`` and
openai/whisper's ``sum_logprobs``. Both take the log-softmax of the logits after
the Whisper processors (suppressed tokens, the timestamp rules), before
temperature, so an attempt asks for ``logprobs_mode="processed_logprobs"``. The
raw log-probs differ where the timestamp rules mask much of a step's mass: on a
window of silence tiny.en's "you" averages -2.11 raw against -0.83 processed,
and the raw figure failed the -1.0 threshold, retrying windows HF and
faster-whisper keep. For a beam hypothesis HF renormalises the same way the
scores its search ranked on (log-softmax, then the processors' masks): the sum is
the hypothesis' ``renormalized_logprob``, not its ``cumulative_logprob``.
"""
from __future__ import annotations

from typing import Any

from encdec.sampling_params import BeamSearchParams, SamplingParams


def attempt_params(temperature: float, *, beam_size: int, max_tokens: int | None, seed: int | None,
                   prompt_token_logprobs: dict[int, list[int]] | None = None) -> SamplingParams | BeamSearchParams:
    """The params of one attempt at ``temperature`` (module docstring);
    ``prompt_token_logprobs`` as ``SamplingParams``' (P(no speech) of a window's first attempt)."""
    if beam_size > 1 and temperature == 0.0:
        return BeamSearchParams(beam_size, max_tokens, renormalized_logprob=True,
                                prompt_token_logprobs=prompt_token_logprobs)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0,
                          logprobs_mode="processed_logprobs", seed=seed, prompt_token_logprobs=prompt_token_logprobs)


def attempt_result(completion: Any) -> tuple[list[int], float]:
    """(output ids incl. eos, summed log-probs) of a finished attempt; a beam
    hypothesis carries no per-token log-probs, only their sum."""
    ids = list(completion.token_ids)
    if completion.logprobs is None:
        return ids, float(completion.renormalized_logprob)
    return ids, sum(d[t].logprob for t, d in zip(ids, completion.logprobs))
