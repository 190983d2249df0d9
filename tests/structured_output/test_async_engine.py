"""The async engine compiles a request's grammar off its engine thread (a step
never waits on another request's compile) and refuses a bad one before
anything is queued."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from encdec import SamplingParams, StructuredOutputsParams  # noqa: E402
from encdec.engine.arg_utils import EngineArgs  # noqa: E402
from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest  # noqa: E402
from encdec.structured_output import backend  # noqa: E402
from tests.entrypoints.test_async_engine import run  # noqa: E402
from tests.structured_output.conftest import SCHEMA  # noqa: E402


@pytest.fixture()
def engine(tiny_bart):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01))
    yield eng
    eng.shutdown(30)


def test_compiled_off_the_engine_thread(engine, monkeypatch):
    callers = []
    compile_ = backend.GrammarCompiler.compile

    def spy(self, params):
        callers.append(threading.current_thread().name)
        return compile_(self, params)

    monkeypatch.setattr(backend.GrammarCompiler, "compile", spy)
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA))

    async def go():
        (stream,) = await engine.add_requests([AsyncRequest("a", "hello", params)])
        async for out in stream:
            last = out
        return last

    out = run(engine, go)
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert callers and callers[0] != "encdec-engine"  # the first compile: before the engine thread's cached lookups


def test_bad_grammar_refused_before_queueing(engine):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))

    async def go():
        with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled"):
            await engine.add_requests([AsyncRequest("good", "hi", SamplingParams(max_tokens=4)),
                                       AsyncRequest("bad", "hi", params)])
        return engine.engine.get_num_unfinished_requests()

    assert run(engine, go) == 0
