"""Architectures we run, by the name in a checkpoint's ``config.json``.

Each model module is imported only when a checkpoint asks for it. Besides the
model class, a module may define the hooks the engine needs to build requests:
``default_decoder_prompt(hf_config, generation_config, tokenizer) -> list[int]``,
``make_audio_processor(hf_config)`` (audio models), ``logits_processors()``
(processors every request of this model gets, e.g. Whisper's suppress tokens),
``load_tokenizer(path)`` and ``complete_generation_config(hf_config,
generation_config, tokenizer_path)`` (checkpoint load: fill in what the
generation config lacks, e.g. Whisper's special-token ids).
"""
from __future__ import annotations

import importlib
from types import ModuleType

_MODELS = {
    "BartForConditionalGeneration": "encdec.models.bart",
    "BartModel": "encdec.models.bart",
    "WhisperForConditionalGeneration": "encdec.models.whisper",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


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
