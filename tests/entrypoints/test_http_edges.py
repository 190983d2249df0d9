"""The server's edges: every refusal in OpenAI's error shape with its 4xx, slow
clients dropped, upload caps enforced while the body streams; after each, the
server still answers the next good request. Raw sockets where httpx would
hide what is sent (slow headers, unfinished chunked bodies), all on 127.0.0.1,
every wait bounded."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .conftest import API_KEY, SPEECH
from .test_errors import AUTH, GOOD, assert_error, post

CLIP = SPEECH / "s00.wav"
HEADER_TIMEOUT, BODY_TIMEOUT = 2.0, 3.0  # the bart_server fixture's --header/--body-read-timeout
BODY_DEADLINE = 6.0  # the bart_server fixture's --body-timeout


def good_completion(server) -> None:
    ok = post(server, GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text


def good_transcription(server) -> None:
    ok = httpx.post(server.v1 + "/audio/transcriptions", files={"file": ("a.wav", CLIP.read_bytes(), "audio/wav")},
                    data={"response_format": "text"}, timeout=60)
    assert ok.status_code == 200 and ok.text.strip(), ok.text


def connect(server) -> socket.socket:
    host, port = server.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_response(sock: socket.socket, seconds: float) -> tuple[int, dict, float]:
    """(status, JSON body, seconds waited) of the response on ``sock``; fails past ``seconds``."""
    return read_response_from(sock, b"", seconds)


def read_response_from(sock: socket.socket, data: bytes, seconds: float) -> tuple[int, dict, float]:
    """``read_response`` where ``data`` of the response has arrived already."""
    start = time.monotonic()
    sock.settimeout(seconds)
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a full response: {data!r}"
        data += chunk
        assert time.monotonic() - start < seconds, "no response in time"
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body[:_length(data)]), time.monotonic() - start


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def assert_error_shape(status: int, body: dict, want: int, *words: str) -> None:
    assert status == want, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == want
    for w in words:
        assert w in body["error"]["message"], body


@pytest.mark.parametrize("method, path, status, words", [
    ("GET", "/v1/nope", 404, ("Invalid URL (GET /v1/nope)",)),
    ("GET", "/v1/completions", 405, ("GET is not allowed on /v1/completions", "POST")),
    ("DELETE", "/v1/models", 405, ("DELETE",)),
])
def test_unknown_paths_and_methods(bart_server, method, path, status, words):
    assert_error(httpx.request(method, bart_server.base + path, headers=AUTH, timeout=30), status, *words)
    good_completion(bart_server)


def test_a_405_lists_the_allowed_methods(bart_server):
    """RFC 9110: a 405 carries ``Allow``."""
    resp = httpx.get(bart_server.v1 + "/completions", headers=AUTH, timeout=30)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    resp = httpx.delete(bart_server.v1 + "/models", headers=AUTH, timeout=30)
    assert resp.status_code == 405 and "GET" in resp.headers["allow"].split(", ")


def test_a_websocket_to_a_wrong_path_is_a_404_that_names_the_right_one(bart_server):
    pytest.importorskip("websockets")
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect as ws_connect

    url = bart_server.base.replace("http://", "ws://")
    for path in ("/v1/nope", "/realtime", "/"):
        with pytest.raises(InvalidStatus) as e:
            with ws_connect(url + path, open_timeout=10):
                pass
        response = e.value.response
        assert response.status_code == 404, path
        error = json.loads(response.body)["error"]
        assert error["code"] == 404 and f"WebSocket {path}" in error["message"], error
        assert "/v1/realtime" in error["message"]
    good_completion(bart_server)


@pytest.mark.parametrize("content, ctype, words, param", [
    (b'{"prompt": "x", "max_tokens": }', "application/json",
     ("not valid JSON: Expecting value", "after 'max_tokens', at character 30"), "max_tokens"),
    (b'{"prompt": "x", }', "application/json", ("not valid JSON", "at character 16"), "prompt"),
    (b'{"prompt": "x"', "application/json", ("not valid JSON",), "prompt"),
    (b'{', "application/json", ("not valid JSON", "at character 1"), None),
    (b"prompt=x", "application/x-www-form-urlencoded", ("body",), None),
    (b'["x"]', "application/json", ("body",), None),
    (b'{"prompt": "x", "max_tokens": 4}', "text/plain",
     ("must be JSON", "Content-Type: application/json", "got content-type 'text/plain'"), None),
    (b'{"prompt": "x", "max_tokens": 4}', None, ("must be JSON", "got no content-type"), None),
    (b'{"prompt": "\xff\xfe x"}', "application/json", ("not UTF-8", "byte 0xff at position 12"), None),
    ('{"prompt": "d\u00e9j\u00e0 vu"}'.encode("latin-1"), "application/json; charset=utf-8",
     ("not UTF-8", "byte 0xe9 at position 13"), None),
])
def test_bodies_that_do_not_parse(bart_server, content, ctype, words, param):
    headers = {**AUTH, "content-type": ctype} if ctype else AUTH  # httpx sends none for bytes
    resp = httpx.post(bart_server.v1 + "/completions", content=content, headers=headers, timeout=30)
    assert_error(resp, 400, *words)
    assert resp.json()["error"]["param"] == param
    good_completion(bart_server)


@pytest.mark.parametrize("patch, words", [
    ({"logprobs": True}, ("logprobs", "integer")),
    ({"logprobs": 6}, ("logprobs", "5")),
    ({"logprobs": -1}, ("logprobs",)),
    ({"logprobs": "2"}, ("logprobs", "integer")),
])
def test_logprobs_is_an_int_from_0_to_5(bart_server, patch, words):
    assert_error(post(bart_server, {**GOOD, **patch}), 400, *words, param="logprobs")
    ok = post(bart_server, {**GOOD, "logprobs": 5})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 5


def test_auth_scheme_is_case_insensitive(bart_server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert post(bart_server, GOOD, headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    for header in (f"Basic {API_KEY}", f"Bearer{API_KEY}", API_KEY, f"bearer {API_KEY}x"):
        assert_error(post(bart_server, GOOD, headers={"Authorization": header}), 401, "API key")
    good_completion(bart_server)


def test_a_slow_header_client_is_dropped(bart_server):
    sock = connect(bart_server)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start, closed = time.monotonic(), False
        while time.monotonic() - start < HEADER_TIMEOUT + 10:  # one header byte every 0.5 s
            try:
                sock.sendall(b"X")
                sock.settimeout(0.5)
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        waited = time.monotonic() - start
    finally:
        sock.close()
    assert closed and HEADER_TIMEOUT - 0.5 <= waited < HEADER_TIMEOUT + 10, waited
    good_completion(bart_server)


def test_a_stalled_body_gets_408(bart_server):
    sock = connect(bart_server)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        status, body, waited = read_response(sock, BODY_TIMEOUT + 15)
    finally:
        sock.close()
    assert_error_shape(status, body, 408, "stalled", "--body-read-timeout")
    assert waited >= BODY_TIMEOUT - 0.5
    good_completion(bart_server)


def test_a_body_dribbled_under_the_read_timeout_ends_at_its_deadline(bart_server):
    """One byte every 0.5 s never trips the read timeout (3 s between pieces);
    the whole body's deadline (6 s) ends it with a 408."""
    sock = connect(bart_server)
    start, answered = time.monotonic(), b""
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
        sock.settimeout(0.5)
        while time.monotonic() - start < BODY_DEADLINE + 10 and not answered:
            try:
                sock.sendall(b" ")
                answered = sock.recv(65536)
            except socket.timeout:
                continue
        waited = time.monotonic() - start
        assert answered, "no answer to a dribbled body"
        rest_status, body, _ = read_response_from(sock, answered, 10)
    finally:
        sock.close()
    assert_error_shape(rest_status, body, 408, "not complete within 6 s", "--body-timeout")
    assert BODY_DEADLINE - 0.5 <= waited < BODY_DEADLINE + 5, waited
    good_completion(bart_server)


def multipart(filename: bytes, data: bytes) -> tuple[bytes, str]:
    """A one-file form written by hand: httpx would percent-escape a NUL in the name."""
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + data + b"\r\n--b\r\nContent-Disposition: form-data; "
            b'name="response_format"\r\n\r\ntext\r\n--b--\r\n')
    return body, "multipart/form-data; boundary=b"


@pytest.mark.parametrize("filename, data, status", [
    (b"clip.w\x00av", CLIP.read_bytes(), 200),  # the name is only a hint: the audio decodes
    (b"a\x00b.wav", CLIP.read_bytes(), 200),
    (b"junk.\x00\x00", b"not audio" * 40, 400),
])
def test_a_nul_byte_in_the_filename_is_no_500(whisper_server, filename, data, status):
    body, ctype = multipart(filename, data)
    resp = httpx.post(whisper_server.v1 + "/audio/transcriptions", content=body,
                      headers={"content-type": ctype}, timeout=60)
    if status == 200:
        assert resp.status_code == 200 and resp.text.strip(), resp.text
    else:
        assert_error(resp, 400, "decode", param="file")
    good_transcription(whisper_server)


@pytest.mark.parametrize("disposition", [
    b"filename*=UTF-8''d%C3%A9j%C3%A0%20vu.wav",  # RFC 5987, as clients send a non-ASCII name
    b"filename*=\"utf-8'en'clip.wav\"",
    b"FILENAME*=UTF-8''clip.wav",
])
def test_a_file_named_only_by_filename_star_is_the_file(whisper_server, disposition):
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; ' + disposition + b"\r\n"
            b"Content-Type: audio/wav\r\n\r\n" + CLIP.read_bytes() + b"\r\n--b\r\nContent-Disposition: form-data; "
            b'name="response_format"\r\n\r\ntext\r\n--b--\r\n')
    resp = httpx.post(whisper_server.v1 + "/audio/transcriptions", content=body,
                      headers={"content-type": "multipart/form-data; boundary=b"}, timeout=60)
    assert resp.status_code == 200 and resp.text.strip(), resp.text


def test_an_undecodable_upload_says_why(whisper_server):
    resp = httpx.post(whisper_server.v1 + "/audio/transcriptions",
                      files={"file": ("junk.wav", b"\0\1garbage" * 40, "audio/wav")}, timeout=60)
    assert_error(resp, 400, "could not decode the audio file 'junk.wav'", "libsndfile: Format not recognised",
                 param="file")
    good_transcription(whisper_server)


def test_a_chunked_upload_over_the_limit_is_refused_while_it_streams(whisper_server):
    """No Content-Length: the 2 MiB cap (--max-audio-mb 2) is counted as the body
    arrives. The body is never finished, so a 413 proves the server refused it
    before reading it all (the old code waited for the end, then spooled it)."""
    limit = 2 << 20
    sock = connect(whisper_server)
    boundary = b"encdecboundary"
    head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n")
    try:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: multipart/form-data; boundary=" + boundary + b"\r\n\r\n")
        piece = 64 << 10
        for data in [head] + [b"\0" * piece] * ((limit + (256 << 10)) // piece):
            sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
        status, body, _ = read_response(sock, 30)
    finally:
        sock.close()
    assert_error_shape(status, body, 413, "limit")
    good_transcription(whisper_server)


def test_a_declared_length_over_the_limit_is_refused_before_reading(whisper_server):
    sock = connect(whisper_server)
    try:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\n\r\n")
        status, body, _ = read_response(sock, 30)
    finally:
        sock.close()
    assert_error_shape(status, body, 413, "99999999")
    good_transcription(whisper_server)
