"""Done-when 2 with the official ``openai`` client against a real ``encdec
serve``: ``structured_outputs`` (vLLM's extra body field) and OpenAI's
``response_format`` hold every output; a bad constraint is a 400 in OpenAI's
error shape naming the field; the transcription form field holds each segment."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.entrypoints.conftest import SPEECH, bart_server, client, whisper_server  # noqa: E402,F401
from tests.structured_output.conftest import CHOICES, REGEX, SCHEMA  # noqa: E402


def test_structured_outputs_extra_body(client):
    out = client.completions.create(model="tiny-bart", prompt=["hello world", "quick brown fox"], max_tokens=120,
                                    temperature=0, extra_body={"structured_outputs": {"json": SCHEMA}})
    assert len(out.choices) == 2
    for c in out.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for so, ok in (({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)), ({"choice": CHOICES}, lambda t: t in CHOICES)):
        out = client.completions.create(model="tiny-bart", prompt="rain in spain", max_tokens=40, seed=1,
                                        temperature=1.0, n=3, extra_body={"structured_outputs": so})
        assert all(ok(c.text) for c in out.choices), [c.text for c in out.choices]
    beams = client.completions.create(model="tiny-bart", prompt="rain in spain", max_tokens=40, n=2,
                                      extra_body={"use_beam_search": True, "structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES for c in beams.choices)


def test_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    out = client.completions.create(model="tiny-bart", prompt="hello", max_tokens=120, temperature=0,
                                    extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    out = client.completions.create(model="tiny-bart", prompt="hello", max_tokens=200, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "length" or isinstance(json.loads(out.choices[0].text), dict)


@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "structured_outputs.regex cannot be compiled"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "Unsupported type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be one of"),
])
def test_bad_constraint_is_a_400_in_openai_shape(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-bart", prompt="hello", max_tokens=8, extra_body=body)
    error = err.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["param"] == param
    assert words in error["message"]
    assert client.completions.create(model="tiny-bart", prompt="hello", max_tokens=4).choices  # still serves


@pytest.fixture()
def wclient(whisper_server):  # noqa: F811
    return openai.OpenAI(base_url=whisper_server.v1, api_key="unused", max_retries=0, timeout=120)


def test_transcription_form_field(wclient):
    commands = [" Please remember to turn off the lights.", " Please send me the report.", " Can you tell me the way?"]
    with open(SPEECH / "s21.wav", "rb") as f:  # "Please send me the report by the end of the week."
        out = wclient.audio.transcriptions.create(
            model="tiny.en", file=f, extra_body={"structured_outputs": json.dumps({"choice": commands})})
    assert out.text.strip() == commands[1].strip()
    with open(SPEECH / "s21.wav", "rb") as f, pytest.raises(openai.BadRequestError) as err:
        wclient.audio.transcriptions.create(model="tiny.en", file=f,
                                            extra_body={"structured_outputs": json.dumps({"regex": "(ab"})})
    assert err.value.response.json()["error"]["param"] == "structured_outputs"
