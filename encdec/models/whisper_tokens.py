"""Whisper's special token ids, resolved once at checkpoint load, and the decoder prompts built from them.

OpenAI's checkpoints ship a ``generation_config.json`` naming every id
(``no_timestamps_token_id``, ``lang_to_id``, ...); many others do not: a model
saved by ``save_pretrained`` from a fresh config, most fine-tunes, CTranslate2
directories. The ids are all in the tokenizer, so ``WhisperSpecialTokens.resolve``
takes each from the generation config when it has it, else from the tokenizer's
``<|...|>`` tokens, and ``fill`` writes the missing ones back onto the
generation config the engine keeps (``encdec.transcribe`` and ``encdec.inputs``
read them there). Decoding rules stay as HF ``generate`` applies them to the
checkpoint: ``suppress_tokens``, ``begin_suppress_tokens`` and
``max_initial_timestamp_index`` are never invented here (HF skips what the config
lacks), and ``lang_to_id``/``task_to_id`` are added only to multilingual models
(on an English-only model HF would take a ``lang_to_id`` as a cue to detect the language).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["WhisperSpecialTokens", "special_token_ids", "language_token", "default_decoder_prompt",
           "prepare_decoder_prompt"]

MULTILINGUAL_VOCAB = 51865  # openai/whisper: a model is multilingual iff n_vocab >= 51865


def special_token_ids(tokens: Any) -> dict[str, int]:
    """``<|...|>`` token -> id, from a tokenizer (``get_vocab``) or a CTranslate2
    vocabulary list (index = id)."""
    items = tokens.get_vocab().items() if hasattr(tokens, "get_vocab") else \
        ((t, i) for i, t in enumerate(tokens))
    return {t: i for t, i in items if t.startswith("<|") and t.endswith("|>")}


@dataclass(frozen=True)
class WhisperSpecialTokens:
    sot: int  # <|startoftranscript|>: decoder_start_token_id
    eot: int  # <|endoftext|>: eos_token_id
    no_timestamps: int  # <|notimestamps|>; timestamp tokens start right after it
    prev_sot: int  # <|startofprev|>: opens a previous-text prompt
    transcribe: int | None  # <|transcribe|> (None on English-only models, as HF takes no task there)
    translate: int | None  # <|translate|>
    is_multilingual: bool
    lang_to_id: Mapping[str, int] = field(default_factory=dict)  # "<|en|>" -> id; empty if English-only

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def task_to_id(self) -> dict[str, int]:
        return {k: v for k, v in (("transcribe", self.transcribe), ("translate", self.translate))
                if v is not None}

    @classmethod
    def resolve(cls, hf_config: Any, generation_config: Any,
                token_ids: Mapping[str, int] | None = None) -> WhisperSpecialTokens:
        """Each id from ``generation_config`` when set, else from ``token_ids``
        (``special_token_ids(tokenizer)``); a ValueError names what neither has."""
        gc, ids = generation_config, token_ids or {}
        missing: list[str] = []

        def pick(attr: str, token: str) -> int:
            value = getattr(gc, attr, None)
            if isinstance(value, (list, tuple)):  # eos_token_id may be a list
                value = value[0] if value else None
            if value is None:
                value = ids.get(token)
            if value is None:
                missing.append(f"{attr} ({token})")
                return -1
            return int(value)

        sot = pick("decoder_start_token_id", "<|startoftranscript|>")
        eot = pick("eos_token_id", "<|endoftext|>")
        no_ts = pick("no_timestamps_token_id", "<|notimestamps|>")
        prev = pick("prev_sot_token_id", "<|startofprev|>")
        task_to_id = getattr(gc, "task_to_id", None) or {}
        transcribe = task_to_id.get("transcribe") if "transcribe" in task_to_id else ids.get("<|transcribe|>")
        translate = task_to_id.get("translate") if "translate" in task_to_id else ids.get("<|translate|>")
        multilingual = getattr(gc, "is_multilingual", None)
        if multilingual is None and hf_config is not None:
            multilingual = hf_config.vocab_size >= MULTILINGUAL_VOCAB
        if multilingual is None:
            missing.append("is_multilingual")
        lang_to_id = getattr(gc, "lang_to_id", None)
        if multilingual:  # English-only models take no task or language tokens
            for name, value in (("transcribe", transcribe), ("translate", translate)):
                if value is None:
                    missing.append(f"task_to_id[{name!r}] (<|{name}|>)")
            if lang_to_id is None:
                lang_to_id = _languages_from_tokens(ids, sot, translate or 0)
            if not lang_to_id:
                missing.append("lang_to_id (<|en|>, <|de|>, ...)")
        else:
            transcribe = translate = lang_to_id = None
        if missing:
            raise ValueError(f"Whisper checkpoint: the generation config and the tokenizer both lack "
                             f"{', '.join(missing)}; add them to generation_config.json or pass a "
                             "Whisper tokenizer (tokenizer=...)")
        return cls(sot=sot, eot=eot, no_timestamps=no_ts, prev_sot=prev, transcribe=transcribe,
                   translate=translate, is_multilingual=bool(multilingual),
                   lang_to_id=MappingProxyType(dict(lang_to_id or {})))

    @classmethod
    def of(cls, generation_config: Any) -> WhisperSpecialTokens:
        """From a generation config that ``fill`` completed (the engine's): no tokenizer needed."""
        return cls.resolve(None, generation_config)

    def fill(self, generation_config: Any) -> list[str]:
        """Set the ids ``generation_config`` lacks (HF ``generate`` reads the same
        attributes); returns the names set."""
        values: dict[str, Any] = {
            "decoder_start_token_id": self.sot, "eos_token_id": self.eot,
            "no_timestamps_token_id": self.no_timestamps, "prev_sot_token_id": self.prev_sot,
            "is_multilingual": self.is_multilingual,
        }
        if self.is_multilingual:
            values["lang_to_id"] = dict(self.lang_to_id)
            values["task_to_id"] = self.task_to_id
        added = []
        for name, value in values.items():
            if getattr(generation_config, name, None) is None:
                setattr(generation_config, name, value)
                added.append(name)
        return added


def _languages_from_tokens(ids: Mapping[str, int], sot: int, translate: int) -> dict[str, int]:
    """``<|xx|>`` for every language code Whisper knows, in the id range where the
    tokenizer puts languages (between ``<|startoftranscript|>`` and ``<|translate|>``)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return {f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES
            if f"<|{code}|>" in ids and sot < ids[f"<|{code}|>"] < translate}


# ---- decoder prompts ----

def language_token(generation_config: Any, language: str) -> int:
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    lang_to_id = WhisperSpecialTokens.of(generation_config).lang_to_id
    key = language.lower().strip()
    code = key.strip("<|>") if key.startswith("<|") else TO_LANGUAGE_CODE.get(key, key)
    token = f"<|{code}|>"
    if token not in lang_to_id:
        raise ValueError(f"language {language!r} is not one this model knows; "
                         f"use a code or name such as 'en', 'english', 'de'")
    return lang_to_id[token]


def default_decoder_prompt(hf_config: Any, generation_config: Any, tokenizer: Any = None, *,
                           language: str | None = None, task: str = "transcribe",
                           timestamps: bool = False) -> list[int]:
    """The decoder prompt HF ``generate`` builds for these options (the registry hook
    calls it with the first three arguments: English or language-less transcription,
    no timestamps)."""
    if task not in ("transcribe", "translate"):
        raise ValueError(f"task must be 'transcribe' or 'translate', got {task!r}")
    tokens = WhisperSpecialTokens.of(generation_config)
    ids = [tokens.sot]
    if tokens.is_multilingual:
        if language is not None:
            ids.append(language_token(generation_config, language))
        ids.append(tokens.task_to_id[task])
    else:
        if language is not None and language.lower().strip("<|>") not in ("en", "english"):
            raise ValueError(f"this is an English-only model; language={language!r} is not available")
        if task != "transcribe":
            raise ValueError("this is an English-only model; task='translate' is not available")
    if not timestamps:
        ids.append(tokens.no_timestamps)
    return ids


def prepare_decoder_prompt(ids: list[int], generation_config: Any) -> list[int]:
    """Prepend ``<|startoftranscript|>`` unless the prompt starts with it or ``<|startofprev|>``."""
    tokens = WhisperSpecialTokens.of(generation_config)
    if ids and ids[0] in (tokens.sot, tokens.prev_sot):
        return list(ids)
    return [tokens.sot, *ids]
