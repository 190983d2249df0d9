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
