"""Translation prompts per family: what ``LLM.translate(texts, src_lang=...,
tgt_lang=...)`` sends to ``generate``.

Each family names its languages in its own way; this module turns a pair of
language codes into encoder token ids and a decoder prompt, as the family's HF
tokenizer and ``generate`` would:

    family (model_type)    encoder input                    decoder prompt         forced first token
    M2M100, NLLB (m2m_100) <src> text </s>                  [</s>, <tgt>]          <tgt>
    mBART-50 (mbart)       <src> text </s>                  [</s>, <tgt>]          <tgt>
    mBART cc25, en-ro      text </s> <src>                  [<tgt>]                (the decoder start)
    Marian (marian)        >>tgt<< text </s> (multi-target) the model's default    -
    T5 (t5)                translate {src} to {tgt}: text   the model's default    -

M2M100 codes may be given bare (``"fr"`` for ``__fr__``). Which mBART layout a
checkpoint has is read off its tokenizer (where it puts the language code).
Families without languages (BART, Whisper: use ``transcribe``) are refused.
The forced first token is returned so that beam search counts it as HF's
``forced_bos_token_id`` does (``with_forced_bos``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt
from encdec.sampling_params import BeamSearchParams, SamplingParams

TRANSLATION_FAMILIES = ("m2m_100", "marian", "mbart", "t5")


@dataclass(frozen=True)
class TranslationPrompts:
    prompts: list[ExplicitEncoderDecoderPrompt]  # one per text, in order
    forced_bos_token_id: int | None  # the target language as HF's forced first token, if the family has one


def _lang_token(tokenizer: Any, code: str, field: str, family: str, *, bare: str | None = None,
                added_only: bool = True) -> int:
    """The id of language token ``code`` (or ``bare % code``: M2M100's ``__fr__``
    for ``fr``). ``added_only``: only the tokenizer's added tokens count (where
    language codes live), so a code is never mistaken for a word piece ("de")."""
    vocab = tokenizer.get_added_vocab() if added_only else tokenizer.get_vocab()
    for token in (bare % code if bare else None, code):
        if token is not None and token in vocab:
            return vocab[token]
    plain = {tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token, tokenizer.bos_token,
             tokenizer.mask_token}
    known = sorted(t for t in tokenizer.get_added_vocab() if t not in plain)
    raise ValueError(f"{field}={code!r}: the {family} tokenizer has no such language token"
                     + (f"; its language tokens: {known[:20]}" if known else ""))


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"texts must be strings, got {type(text).__name__}")
    return tokenizer(text, add_special_tokens=False).input_ids


def _mbart_suffix_layout(tokenizer: Any) -> bool:
    """True for mBART cc25 / en-ro (``text </s> <src>``), False for mBART-50
    (``<src> text </s>``): where the tokenizer itself puts its language code."""
    ids = tokenizer("").input_ids
    return len(ids) >= 2 and ids[-2] == tokenizer.eos_token_id


def translation_prompts(texts: list[str], *, hf_config: Any, tokenizer: Any, src_lang: str | None,
                        tgt_lang: str | None) -> TranslationPrompts:
    """Prompts that translate ``texts`` from ``src_lang`` to ``tgt_lang`` on a
    checkpoint of ``hf_config.model_type`` (see the module docstring)."""
    family = getattr(hf_config, "model_type", None)
    if family not in TRANSLATION_FAMILIES:
        raise ValueError(f"translate needs a model with languages ({', '.join(TRANSLATION_FAMILIES)}); "
                         f"this checkpoint is {family!r}" + ("; use LLM.transcribe" if family == "whisper" else ""))
    eos = tokenizer.eos_token_id
    start = hf_config.decoder_start_token_id
    if family == "t5":
        if not src_lang or not tgt_lang:
            raise ValueError("T5 translates with the text prefix 'translate {src_lang} to {tgt_lang}: '; "
                             f"give both as language names (e.g. 'English', 'German'), got {src_lang!r}, {tgt_lang!r}")
        prefix = f"translate {src_lang} to {tgt_lang}: "
        return TranslationPrompts([_explicit(_text_ids(tokenizer, prefix + t) + [eos], None) for t in texts], None)
    if family == "marian":
        if src_lang is not None:
            raise ValueError(f"src_lang={src_lang!r}: a Marian checkpoint translates one fixed source language; "
                             "leave src_lang unset")
        head = [] if tgt_lang is None else [_lang_token(tokenizer, f">>{tgt_lang}<<", "tgt_lang", "Marian",
                                                         added_only=False)]
        return TranslationPrompts([_explicit(head + _text_ids(tokenizer, t) + [eos], None) for t in texts], None)
    if not src_lang or not tgt_lang:
        raise ValueError(f"{family} needs src_lang and tgt_lang, got {src_lang!r}, {tgt_lang!r}")
    bare = "__%s__" if family == "m2m_100" else None
    src = _lang_token(tokenizer, src_lang, "src_lang", family, bare=bare)
    tgt = _lang_token(tokenizer, tgt_lang, "tgt_lang", family, bare=bare)
    if family == "mbart" and _mbart_suffix_layout(tokenizer):
        return TranslationPrompts([_explicit(_text_ids(tokenizer, t) + [eos, src], [tgt]) for t in texts], None)
    return TranslationPrompts([_explicit([src] + _text_ids(tokenizer, t) + [eos], [start, tgt]) for t in texts], tgt)


def _explicit(encoder_ids: list[int], decoder_ids: list[int] | None) -> ExplicitEncoderDecoderPrompt:
    return ExplicitEncoderDecoderPrompt(
        encoder_prompt=TokensPrompt(prompt_token_ids=encoder_ids),
        decoder_prompt=None if decoder_ids is None else TokensPrompt(prompt_token_ids=decoder_ids))


def with_forced_bos(params: SamplingParams | BeamSearchParams,
                    forced_bos_token_id: int | None) -> SamplingParams | BeamSearchParams:
    """``params`` forcing ``forced_bos_token_id`` as the first generated token (the
    target language, already at the end of the decoder prompt): beam search then
    scores it as HF's ``generate(forced_bos_token_id=...)`` does, and a
    checkpoint's own forced language is not inherited. None: unchanged."""
    if forced_bos_token_id is None:
        return params
    if isinstance(params, BeamSearchParams):
        return dataclasses.replace(params, forced_bos_token_id=forced_bos_token_id)
    extra = {**(params.extra_args or {}), "forced_bos_token_id": forced_bos_token_id}
    return dataclasses.replace(params, extra_args=extra)
