"""How one decoding attempt of a window is asked for, and what its output scores.

``beam_size`` follows HF long-form ``generate(num_beams=beam_size)``: an attempt
at temperature 0 is beam search of width ``beam_size``. An attempt at a
temperature > 0 (a fallback retry) samples ``best_of`` sequences at that
temperature and keeps the most likely, faster-whisper's ``best_of`` (default 5)
and openai/whisper's: the sum of a sample's log-probs (eot included) over its
number of tokens before eot (``MaximumLikelihoodRanker`` without a length
penalty). HF samples one (``best_of=1``); it also turns beams off when it
samples (``num_beams = 1`` with ``do_sample``) and keeps ``num_beams = 1`` for
every later window of the call once one window has sampled, where we go back to
beams at temperature 0, as faster-whisper does.

Measured (Whisper base, the benchmark's 8 six-minute files, 2906 s, unseeded):
WER 0.077-0.087 with one sample per retry (three runs), 0.068-0.078 with 5 (four
runs; faster-whisper 0.070-0.076), in about the same time (encoder cache off:
132.2 s with one, 131.6-135.3 s with five). Only 13-25 of ~550 segments come
from retries, but a single sample at 0.2-0.4 often keeps a wrong reading or a
repetition that passes the thresholds.

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

from collections.abc import Sequence
from typing import Any

from encdec.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from encdec.transcription.rules import compression_ratio


def attempt_params(temperature: float, *, beam_size: int, best_of: int, max_tokens: int | None,
                   seed: int | None, prompt_token_logprobs: dict[int, list[int]] | None = None,
                   structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams | BeamSearchParams:
    """The params of one attempt at ``temperature`` (module docstring);
    ``prompt_token_logprobs`` as ``SamplingParams``' (P(no speech) of a window's first attempt);
    ``structured_outputs``: the window's text held to it."""
    if beam_size > 1 and temperature == 0.0:
        return BeamSearchParams(beam_size, max_tokens, renormalized_logprob=True,
                                prompt_token_logprobs=prompt_token_logprobs, structured_outputs=structured_outputs)
    n = best_of if temperature > 0.0 else 1
    return SamplingParams(temperature=temperature, n=n, max_tokens=max_tokens, logprobs=0,
                          logprobs_mode="processed_logprobs", seed=seed, prompt_token_logprobs=prompt_token_logprobs,
                          structured_outputs=structured_outputs)


def window_constraint(options: Any) -> StructuredOutputsParams | None:
    """What a ``TranscribeOptions``' windows are held to: its ``structured_outputs``,
    else its ``sampling_params``'."""
    if options.structured_outputs is not None:
        return options.structured_outputs
    return options.sampling_params.structured_outputs if options.sampling_params is not None else None


def attempt_result(completions: Sequence[Any], eot: int) -> tuple[list[int], float]:
    """(output ids incl. eos, summed log-probs) of a finished attempt: of its
    ``best_of`` samples, the one openai/whisper's ``MaximumLikelihoodRanker``
    ranks first (summed log-prob over the number of tokens before eot; the first
    on a tie). A beam hypothesis carries no per-token log-probs, only their sum."""
    def ranked(completion: Any) -> tuple[float, list[int], float]:
        ids = list(completion.token_ids)
        if completion.logprobs is None:
            total = float(completion.renormalized_logprob)
        else:
            total = sum(d[t].logprob for t, d in zip(ids, completion.logprobs))
        length = len(ids) - 1 if ids and ids[-1] == eot else len(ids)
        return total / max(length, 1), ids, total

    _, ids, total = max(map(ranked, completions), key=lambda r: r[0])
    return ids, total


def score_attempt(result: tuple[list[int], float], tokenizer: Any, eot: int) -> tuple[list[int], float, float]:
    """(ids, summed log-probs) of an attempt -> (ids, average log-prob, compression
    ratio of its text): what the fallback rules judge (``rules.needs_fallback``)."""
    ids, total = result
    text = tokenizer.decode([t for t in ids if t < eot]).strip()
    return ids, total / max(len(ids), 1), compression_ratio(text)
