"""Architectures we run, by the name in a checkpoint's ``config.json``, and the
hooks each model module gives the engine.

Each model module is imported only when a checkpoint asks for it. Besides the
model class it defines the hooks ``ModelHooks`` declares: one required
(``default_decoder_prompt``), the rest optional. ``get_model_hooks(arch)`` reads
them once into an object on which every hook is present, a callable or None, so
callers test ``is None`` and never ``getattr`` a module.

A new family: a module with the model class and ``default_decoder_prompt``, plus
whichever optional hooks it needs, and one ``_MODELS`` line per architecture name.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import fields, make_dataclass
from types import ModuleType
from typing import Any, Protocol

_MODELS = {
    "BartForConditionalGeneration": "encdec.models.bart",
    "BartModel": "encdec.models.bart",
    "M2M100ForConditionalGeneration": "encdec.models.m2m100",
    "MarianMTModel": "encdec.models.marian",
    "MBartForConditionalGeneration": "encdec.models.mbart",
    "MT5ForConditionalGeneration": "encdec.models.t5",
    "T5ForConditionalGeneration": "encdec.models.t5",
    "UMT5ForConditionalGeneration": "encdec.models.t5",
    "WhisperForConditionalGeneration": "encdec.models.whisper",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


_REQUIRED_HOOKS = ("default_decoder_prompt",)


class ModelHooks(Protocol):
    """What a model module gives the engine besides its model class.

    Required:

    - ``default_decoder_prompt(hf_config, generation_config, tokenizer) -> list[int]``:
      the decoder prompt of a request that gives none (BART ``[<DEC>, <BOS>]``,
      Whisper ``<|startoftranscript|>`` + language + task).

    Optional (None where the module does not define it):

    - ``make_audio_processor(hf_config, device) -> process(audios, *, labels=None)``:
      the model reads audio; ``process`` turns a batch of audio inputs into one
      ``(features, encoder_len)`` per input, host tensors computed on ``device``
      (the engine's). None: the encoder reads token ids.
    - ``prepare_decoder_prompt(ids, generation_config) -> list[int]``: fix up a
      user's decoder prompt (Whisper prepends ``<|startoftranscript|>``). None:
      used as given.
    - ``logits_processors() -> list[type]``: processor classes every request of
      this model gets (Whisper's suppress and timestamp rules). None: no such processors.
    - ``load_tokenizer(path)``: the tokenizer of a checkpoint directory (CT2
      Whisper directories carry only ``tokenizer.json``). None: ``AutoTokenizer``.
    - ``complete_generation_config(hf_config, generation_config, tokenizer_path)``:
      at checkpoint load, fill in what the generation config lacks (Whisper's
      special-token ids), in place. None: the config is used as loaded.
    """

    default_decoder_prompt: Callable[[Any, Any, Any], list[int]]
    make_audio_processor: Callable[[Any, Any], Callable[..., list[tuple[Any, int]]]] | None
    prepare_decoder_prompt: Callable[[list[int], Any], list[int]] | None
    logits_processors: Callable[[], list[type]] | None
    load_tokenizer: Callable[[str], Any] | None
    complete_generation_config: Callable[[Any, Any, str], Any] | None


# What get_model_hooks returns: ModelHooks's fields, frozen.
_ModuleHooks = make_dataclass("_ModuleHooks", list(ModelHooks.__annotations__.items()), frozen=True)


def get_model_hooks(architecture: str) -> ModelHooks:
    """The hooks of ``architecture``'s module, each a callable or None (optional
    hooks the module lacks). A module missing a required hook is a TypeError."""
    module = get_model_module(architecture)
    missing = [name for name in _REQUIRED_HOOKS if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"model module {module.__name__} (architecture {architecture!r}) "
                        f"lacks the required hook(s) {missing}")
    return _ModuleHooks(**{f.name: getattr(module, f.name, None) for f in fields(_ModuleHooks)})


def get_model_module(architecture: str) -> ModuleType:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; encdec runs {supported_architectures()}"
        )
    return importlib.import_module(_MODELS[architecture])


def get_model_cls(architecture: str) -> type:
    module = get_model_module(architecture)
    name = "BartForConditionalGeneration" if architecture == "BartModel" else architecture
    return getattr(module, name)
