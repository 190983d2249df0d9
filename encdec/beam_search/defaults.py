"""A checkpoint's generation defaults as engine params, read as HF reads them.

HF's ``generate(input_ids)`` with no arguments uses the model's
``GenerationConfig`` (``generation_config.json``, else
``GenerationConfig.from_model_config(config)``), which the loader already built
the same way. Its lengths count the whole decoder sequence; ours count
generated tokens after the model's default decoder prompt, so both shift by that
prompt's length (BART's ``[<DEC>, <BOS>]`` holds the BOS that HF forces as its
first generated token, so the totals agree).
"""
from __future__ import annotations

from typing import Any

from encdec.beam_search.params import BeamSearchParams
from encdec.sampling_params import SamplingParams


def default_params(gen: Any, default_prompt_len: int) -> SamplingParams | BeamSearchParams:
    """``gen``: a transformers ``GenerationConfig``."""
    num_beams = getattr(gen, "num_beams", None) or 1
    do_sample = bool(getattr(gen, "do_sample", False))
    if getattr(gen, "max_new_tokens", None) is not None:
        max_tokens = gen.max_new_tokens
    else:
        max_tokens = max(1, (getattr(gen, "max_length", None) or 20) - default_prompt_len)
    if getattr(gen, "min_new_tokens", None) is not None:
        min_tokens = gen.min_new_tokens
    else:
        min_tokens = max(0, (getattr(gen, "min_length", None) or 0) - default_prompt_len)
    min_tokens = min(min_tokens, max_tokens)
    no_repeat = getattr(gen, "no_repeat_ngram_size", None) or 0
    forced = {key: getattr(gen, key, None) for key in ("forced_bos_token_id", "forced_eos_token_id")}
    forced = {key: value for key, value in forced.items() if value is not None}
    if num_beams > 1:
        if do_sample:
            raise ValueError("the checkpoint's generation config asks for beam sampling "
                             "(num_beams > 1 with do_sample=True), which is not supported")
        return BeamSearchParams(
            num_beams, max_tokens, min_tokens=min_tokens,
            length_penalty=1.0 if gen.length_penalty is None else float(gen.length_penalty),
            early_stopping=gen.early_stopping or False,
            no_repeat_ngram_size=no_repeat,
            num_return_sequences=getattr(gen, "num_return_sequences", None) or 1, **forced)
    sampling: dict[str, Any] = {"temperature": 0.0}
    if do_sample:
        sampling = {"temperature": float(getattr(gen, "temperature", None) or 1.0),
                    "top_k": getattr(gen, "top_k", None) or 0,
                    "top_p": float(getattr(gen, "top_p", None) or 1.0)}
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, no_repeat_ngram_size=no_repeat,
        repetition_penalty=float(getattr(gen, "repetition_penalty", None) or 1.0),
        n=getattr(gen, "num_return_sequences", None) or 1,
        extra_args=forced or None, **sampling)


_SAMPLING_ONLY = ("temperature", "top_p", "top_k", "n", "seed")


def with_overrides(defaults: SamplingParams | BeamSearchParams,
                   **overrides: Any) -> SamplingParams | BeamSearchParams:
    """The CLI's rule: the checkpoint's defaults, then every option the user gave
    (None = not given). ``beam_width`` > 1 asks for beam search and 1 for
    sampling; without it, beam defaults stay beam search unless a sampling-only
    option (temperature > 0, top_p, top_k, n, seed) is given."""
    given = {key: value for key, value in overrides.items() if value is not None}
    width = given.pop("beam_width", None)
    sampling = {key: given.pop(key) for key in _SAMPLING_ONLY if key in given}
    if width is not None:
        beam = width > 1
    else:
        beam = isinstance(defaults, BeamSearchParams) and not (
            sampling.get("temperature", 0.0) > 0 or set(sampling) - {"temperature"})
    if beam and sampling:
        raise ValueError(f"{sorted(sampling)} apply to sampling, not to beam search (beam_width={width})")
    if not beam and "length_penalty" in given:
        raise ValueError("length_penalty applies to beam search only; give beam_width > 1")
    if isinstance(defaults, BeamSearchParams):
        forced = {key: getattr(defaults, key) for key in ("forced_bos_token_id", "forced_eos_token_id")
                  if getattr(defaults, key) is not None}
    else:
        forced = dict(defaults.extra_args or {})
    base = {"max_tokens": defaults.max_tokens, "min_tokens": defaults.min_tokens,
            "no_repeat_ngram_size": defaults.no_repeat_ngram_size, "ignore_eos": defaults.ignore_eos}
    if "max_tokens" in given and base["max_tokens"] is not None and given["max_tokens"] is not None:
        base["min_tokens"] = min(base["min_tokens"], given["max_tokens"])  # a shorter cap wins
    if beam:
        if isinstance(defaults, BeamSearchParams):
            base = {"length_penalty": defaults.length_penalty, "early_stopping": defaults.early_stopping,
                    **base}
        base.update(given)
        return BeamSearchParams(width or getattr(defaults, "beam_width", 1), base.pop("max_tokens"),
                                **base, **forced)
    if isinstance(defaults, SamplingParams):
        base.update(temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k,
                    n=defaults.n, seed=defaults.seed, repetition_penalty=defaults.repetition_penalty)
    base.update(given, **sampling)
    base.setdefault("temperature", 0.0)
    return SamplingParams(**base, extra_args=forced or None)
