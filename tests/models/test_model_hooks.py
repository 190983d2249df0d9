"""The model-hook contract: every registered architecture's module gives its
required hooks, and every optional one is present on the hooks object."""
from __future__ import annotations

import sys
import types

import pytest

from encdec.models import registry
from encdec.models.registry import ModelHooks, get_model_hooks, supported_architectures

HOOK_NAMES = list(ModelHooks.__annotations__)


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_hook_present_callable_or_none(arch):
    hooks = get_model_hooks(arch)
    assert callable(hooks.default_decoder_prompt)
    for name in HOOK_NAMES:
        value = getattr(hooks, name)
        assert value is None or callable(value), name
        # The same object the module defines, or None exactly where it defines none.
        assert value is getattr(registry.get_model_module(arch), name, None)


def test_whisper_defines_all_hooks_bart_only_the_required_one():
    whisper = get_model_hooks("WhisperForConditionalGeneration")
    assert all(getattr(whisper, name) is not None for name in HOOK_NAMES)
    bart = get_model_hooks("BartForConditionalGeneration")
    assert [name for name in HOOK_NAMES if getattr(bart, name) is not None] == ["default_decoder_prompt"]


def test_hooks_are_frozen():
    hooks = get_model_hooks("BartModel")
    with pytest.raises(AttributeError):
        hooks.load_tokenizer = print


def test_missing_required_hook_names_it(monkeypatch):
    module = types.ModuleType("encdec_test_model_without_hooks")
    monkeypatch.setitem(registry._MODELS, "NoHooksModel", module.__name__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(TypeError, match="default_decoder_prompt"):
        get_model_hooks("NoHooksModel")


def test_unknown_architecture():
    with pytest.raises(ValueError, match="unsupported architecture 'Nope'"):
        get_model_hooks("Nope")
