"""Each bad request gets its status and a message naming the problem; the next good one succeeds."""
from __future__ import annotations

import httpx
import pytest

from .conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": "tiny-bart", "prompt": "The rain in Spain", "max_tokens": 4, "temperature": 0}


def post(server, body, headers=AUTH, path="/completions"):
    return httpx.post(server.v1 + path, json=body, headers=headers, timeout=60)


def assert_error(resp, status: int, *words: str, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    for w in words:
        assert w in err["message"], err
    if param is not None:
        assert err["param"] == param


BAD = [
    ({"temperature": -1}, 400, ("temperature", ">= 0"), "temperature"),
    ({"top_p": 0}, 400, ("top_p",), "top_p"),
    ({"n": 0}, 400, ("n must be",), "n"),
    ({"max_tokens": 0}, 400, ("max_tokens",), "max_tokens"),
    ({"temperature": "hot"}, 400, ("temperature",), "temperature"),
    ({"max_token": 5}, 400, ("unsupported field 'max_token'",), "max_token"),
    ({"echo": True}, 400, ("echo",), "echo"),
    ({"suffix": "end"}, 400, ("suffix",), "suffix"),
    ({"length_penalty": 2.0}, 400, ("length_penalty",), "length_penalty"),
    ({"prompt": []}, 400, ("prompt",), "prompt"),
    ({"prompt": [0, 5, 99999]}, 400, ("99999", "vocabulary"), "prompt"),
    ({"stop_token_ids": [10**6]}, 400, ("stop_token_ids",), "stop_token_ids"),
    ({"logit_bias": {"999999": 5}}, 400, ("logit_bias",), "logit_bias"),
    ({"logit_bias": {"the": 5}}, 400, ("logit_bias",), "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 4}, 400, ("min_tokens",), "min_tokens"),
    ({"stream": True, "best_of": 3, "n": 1}, 400, ("best_of",), "best_of"),
    ({"stream_options": {"include_usage": True}}, 400, ("stream_options",), "stream_options"),
    ({"decoder_prompt": [0, 10**6]}, 400, ("decoder_prompt", "vocabulary"), "decoder_prompt"),
    ({"prompt": ["a", "b"], "decoder_prompt": [0, 10**6]}, 400, ("decoder_prompt", "vocabulary"), "decoder_prompt"),
    ({"model": "gpt-4"}, 404, ("gpt-4",), "model"),
]


@pytest.mark.parametrize("patch,status,words,param", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_request_then_good(bart_server, patch, status, words, param):
    assert_error(post(bart_server, {**GOOD, **patch}), status, *words, param=param)
    ok = post(bart_server, GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_api_key_required(bart_server):
    assert_error(post(bart_server, GOOD, headers={}), 401, "API key")
    assert_error(post(bart_server, GOOD, headers={"Authorization": "Bearer nope"}), 401, "API key")
    assert httpx.get(bart_server.base + "/health").status_code == 200  # outside /v1: no key
    assert post(bart_server, GOOD).status_code == 200


def test_bad_json_and_no_audio_on_bart(bart_server):
    resp = httpx.post(bart_server.v1 + "/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert_error(resp, 400)
    files = {"file": ("a.wav", b"RIFF....", "audio/wav")}
    resp = httpx.post(bart_server.v1 + "/audio/transcriptions", files=files, data={"model": "tiny-bart"},
                      headers=AUTH, timeout=30)
    assert_error(resp, 400, "audio", param="model")
    assert post(bart_server, GOOD).status_code == 200


def test_sdk_raises_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-bart", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert client.completions.create(model="tiny-bart", prompt="x", max_tokens=2).choices
