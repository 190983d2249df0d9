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

M2M100 codes may be given bare (``"fr"`` for ``__fr__``). A code is looked up
in the tokenizer's own language table where it has one (HF's ``M2M100Tokenizer``
keeps its codes in ``lang_code_to_id`` / ``lang_token_to_id``, not among its
added tokens), else among its added tokens, never a plain special token
(``</s>``, ``<mask>``...) nor a word piece. Which mBART layout a checkpoint has
is read off its tokenizer (where it puts the language code).
Families without languages (BART, Whisper: use ``transcribe``) are refused.
The forced first token is returned so that beam search counts it as HF's
``forced_bos_token_id`` does (``with_forced_bos``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt
from encdec.sampling_params import BeamSearchParams, SamplingParams

TRANSLATION_FAMILIES = ("m2m_100", "marian", "mbart", "t5")


@dataclass(frozen=True)
class TranslationPrompts:
    prompts: list[ExplicitEncoderDecoderPrompt]  # one per text, in order
    forced_bos_token_id: int | None  # the target language as HF's forced first token, if the family has one


def language_table(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's language codes -> token ids: its own table where it has
    one (``lang_code_to_id``, ``lang_token_to_id``: both spellings, ``"de"`` and
    ``"__de__"``), else its added special tokens (where NLLB's and mBART-50's
    codes live), else its added tokens; never a plain special token (``</s>``,
    ``<mask>``, ``<madeupword0>``: a code is not spelled ``<...>``)."""
    table: dict[str, int] = {}
    for name in ("lang_token_to_id", "lang_code_to_id"):
        own = getattr(tokenizer, name, None)
        if isinstance(own, dict):
            table.update({k: int(v) for k, v in own.items() if isinstance(k, str)})
    if table:
        return table
    added = {t: i for t, i in tokenizer.get_added_vocab().items() if not (t.startswith("<") and t.endswith(">"))}
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    return {t: i for t, i in added.items() if t in special} or added


def _lang_token(tokenizer: Any, code: str, field: str, family: str, *, bare: str | None = None) -> int:
    """The id of language code ``code`` (or ``bare % code``: M2M100's ``__fr__``
    for ``fr``) in the tokenizer's ``language_table``, so a code is never taken
    for a word piece ("de") or a special token ("</s>")."""
    table = language_table(tokenizer)
    for token in (bare % code if bare else None, code):
        if token is not None and token in table:
            return table[token]
    codes = sorted(table, key=lambda t: (t.startswith("_"), t))  # bare codes first where both are listed
    raise ValueError(f"{field}={code!r}: the {family} tokenizer has no such language token"
                     + (f"; its language codes include {codes[:20]}" if codes else "; it has no language codes"))


def _marian_target(tokenizer: Any, code: str) -> int:
    """Marian's ``>>code<<`` target token (a vocabulary token, not an added one)."""
    vocab = tokenizer.get_vocab()
    token = f">>{code}<<"
    if token in vocab:
        return vocab[token]
    known = sorted(t for t in vocab if t.startswith(">>") and t.endswith("<<"))
    raise ValueError(f"tgt_lang={code!r}: the Marian tokenizer has no such language token {token!r}"
                     + (f"; its targets include {known[:20]}" if known else
                        "; this checkpoint has one target language: leave tgt_lang unset"))


def _texts(texts: Any) -> list[str]:
    """``texts`` as a list of str: one str, or a list/tuple of them."""
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence) or isinstance(texts, (bytes, bytearray)):
        raise TypeError(f"texts must be a str or a list of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__} {text!r}")
    if not texts:
        raise ValueError("texts is empty: give at least one text to translate")
    return list(texts)


def _language_arg(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str (a language code), got {type(value).__name__} {value!r}")
    return value


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _mbart_suffix_layout(tokenizer: Any) -> bool:
    """True for mBART cc25 / en-ro (``text </s> <src>``), False for mBART-50
    (``<src> text </s>``): where the tokenizer itself puts its language code."""
    ids = tokenizer("").input_ids
    return len(ids) >= 2 and ids[-2] == tokenizer.eos_token_id


def translation_prompts(texts: str | Sequence[str], *, hf_config: Any, tokenizer: Any, src_lang: str | None,
                        tgt_lang: str | None) -> TranslationPrompts:
    """Prompts that translate ``texts`` (one str or a list) from ``src_lang`` to
    ``tgt_lang`` on a checkpoint of ``hf_config.model_type`` (see the module
    docstring). Bad input is a TypeError/ValueError naming the argument."""
    texts = _texts(texts)
    src_lang, tgt_lang = _language_arg("src_lang", src_lang), _language_arg("tgt_lang", tgt_lang)
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
        head = [] if tgt_lang is None else [_marian_target(tokenizer, tgt_lang)]
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
    if not isinstance(params, (SamplingParams, BeamSearchParams)):
        raise TypeError(f"sampling_params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
    if isinstance(params, BeamSearchParams):
        return dataclasses.replace(params, forced_bos_token_id=forced_bos_token_id)
    extra = {**(params.extra_args or {}), "forced_bos_token_id": forced_bos_token_id}
    return dataclasses.replace(params, extra_args=extra)
