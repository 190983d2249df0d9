"""What a transcription job reads of an engine: its configs and tokenizer
(fixed once the engine is built), and one way to run work that needs the model
itself (word alignment) on the thread that owns the engine.

``LLMEngine`` is driven by its caller's thread, so there the model is called
in place; ``AsyncLLMEngine``'s thread owns its engine, so work that needs the
model goes to that thread as a command (``AsyncLLMEngine.call``) and the job
waits for the result off the event loop. A job never holds the model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineView:
    hf_config: Any
    generation_config: Any
    tokenizer: Any
    # call_model(fn) -> fn(model), run on the thread that owns the engine (blocks until done)
    call_model: Callable[[Callable[[Any], Any]], Any]


def engine_view(engine: Any) -> EngineView:
    """The view of an ``LLMEngine``, an ``AsyncLLMEngine`` or a view."""
    if isinstance(engine, EngineView):
        return engine
    if hasattr(engine, "call_model"):  # AsyncLLMEngine: the model lives on its thread
        return EngineView(engine.hf_config, engine.generation_config, engine.tokenizer, engine.call_model)
    return EngineView(engine.hf_config, engine.generation_config, engine.tokenizer,
                      lambda fn: fn(engine.model))
