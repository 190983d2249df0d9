"""Whether a draft checkpoint can draft for a target: read from their configs and
tokenizers, never their weights, so a bad pairing fails before anything loads.

A draft's token ids are the target's token ids: the target scores them as they
are. So the two must agree on the vocabulary (size and every token's id), on
the special ids generation starts and stops with, and on the kind of encoder
input (a text draft cannot read a Whisper target's audio). Architectures may
differ (a 6-layer BART drafting for a 12-layer one, any family with the same
tokenizer), as may sizes and weights' dtype.
"""
from __future__ import annotations

import os
from typing import Any

# Config ids a draft must share with its target: where decoding starts, ends, pads.
SPECIAL_IDS = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id")


def _audio(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == "whisper"


def _tokenizer(checkpoint: Any) -> Any:
    from encdec.engine.processor import load_tokenizer
    from encdec.models.registry import get_model_hooks

    return load_tokenizer(get_model_hooks(checkpoint.architecture), checkpoint.path)


def check_draft_compatible(target: str | os.PathLike, draft: str | os.PathLike) -> None:
    """``ValueError`` (naming ``speculative_config.model``) unless ``draft`` can draft
    for ``target``: a supported architecture, the same kind of encoder input,
    the same vocabulary size, special ids and tokenizer vocabulary. Reads
    configs and tokenizers only."""
    from encdec.models.loader import open_checkpoint
    from encdec.models.registry import supported_architectures

    field = "speculative_config.model"
    try:
        t, d = open_checkpoint(target), open_checkpoint(draft)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from e
    if d.architecture not in supported_architectures():
        raise ValueError(f"{field}: the draft's architecture {d.architecture} is not supported "
                         f"(supported: {supported_architectures()})")
    if _audio(t.hf_config) != _audio(d.hf_config):
        kinds = {True: "audio (Whisper)", False: "text"}
        raise ValueError(f"{field}: the draft reads {kinds[_audio(d.hf_config)]} while the target reads "
                         f"{kinds[_audio(t.hf_config)]}; a draft must take the target's encoder input")
    tv, dv = t.hf_config.vocab_size, d.hf_config.vocab_size
    if tv != dv:
        raise ValueError(f"{field}: the draft's vocabulary has {dv} tokens, the target's {tv}; "
                         f"a draft must share the target's tokenizer")
    for name in SPECIAL_IDS:
        a, b = getattr(t.hf_config, name, None), getattr(d.hf_config, name, None)
        if a != b:
            raise ValueError(f"{field}: the draft's {name} is {b}, the target's {a}; "
                             f"a draft must share the target's tokenizer")
    try:
        tt, dt = _tokenizer(t), _tokenizer(d)
    except Exception as e:  # a missing or unreadable tokenizer
        raise ValueError(f"{field}: cannot read the tokenizers to compare them ({type(e).__name__}: {e})") from e
    tvocab, dvocab = tt.get_vocab(), dt.get_vocab()
    if tvocab != dvocab:
        differ = sorted(set(tvocab.items()) ^ set(dvocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"{field}: the draft's tokenizer differs from the target's (e.g. {differ}); "
                         f"a draft must share the target's tokenizer")
