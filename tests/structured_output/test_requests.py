"""A server request's constraint: vLLM's structured_outputs (object or JSON
text) or OpenAI's response_format, one at a time; the realtime session says it
has none."""
from __future__ import annotations

import pytest

from encdec import StructuredOutputsParams
from encdec.structured_output.requests import request_constraint


def test_the_spellings():
    assert request_constraint(None) is None
    assert request_constraint({"regex": "a+"}) == StructuredOutputsParams(regex="a+")
    assert request_constraint('{"choice": ["x", "y"]}') == StructuredOutputsParams(choice=["x", "y"])
    assert request_constraint(None, {"type": "text"}) is None
    assert request_constraint(None, {"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert request_constraint(None, fmt) == StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("so, fmt, match", [
    ({"regex": "a"}, {"type": "json_object"}, "structured_outputs and response_format both given"),
    ("{nope", None, "structured_outputs must be a JSON object"),
    (None, {"type": "xml"}, "response_format.type must be one of"),
    (None, {"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema must be"),
    (None, {"type": "json_schema", "json_schema": {"schema": 3}}, "response_format.json_schema.schema"),
    (None, "json", "response_format must be an object"),
])
def test_refused_naming_the_field(so, fmt, match):
    with pytest.raises((ValueError, TypeError), match=match):
        request_constraint(so, fmt)


def test_realtime_session_refuses_structured_outputs():
    pytest.importorskip("fastapi")
    from encdec.entrypoints.openai.realtime_protocol import RealtimeError, SessionConfig

    session = {"type": "transcription", "audio": {"input": {"transcription": {
        "model": None, "structured_outputs": {"choice": ["yes", "no"]}}}}}
    with pytest.raises(RealtimeError, match="structured_outputs is not supported in realtime sessions") as err:
        SessionConfig().update(session)
    assert err.value.param == "session.audio.input.transcription.structured_outputs"
