"""The two ASGI pieces of ``encdec serve --ray`` without a cluster: the replica's
wrapper (``replica_app``: names itself when asked, tags responses, coalesces a
stream's pieces, caps bodies, answers /metrics) and the middleware in Serve's
proxy (``proxy_errors``: a lost replica's request becomes OpenAI's 503 naming it,
a stream gets an error event, a WebSocket a 1011 close, an API request whose
replica was lost before naming itself is sent once more; other applications'
requests are left to Serve)."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")  # the serve extra: the app's body limits and error shapes

from encdec.serve_ray.proxy_errors import ReplicaLoss  # noqa: E402
from encdec.serve_ray.replica_app import NAME_REPLICA, REPLICA_HEADER, REPLICA_MESSAGE, ReplicaApp  # noqa: E402


def _scope(path: str = "/v1/completions", kind: str = "http") -> dict:
    return {"type": kind, "path": path, "method": "POST", "headers": [], "extensions": {}}


def _run(app, scope: dict, incoming: list[dict]) -> list[dict]:
    """Call ``app`` with ``incoming`` as what the client sends; what it sent back."""
    sent: list[dict] = []

    async def main() -> None:
        queue = list(incoming)

        async def receive() -> dict:
            if queue:
                return queue.pop(0)
            await asyncio.sleep(3600)

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(main())
    return sent


BODY = [{"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}]


def _streaming_app(pieces: int, gap: float):
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(pieces):
            await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
            await asyncio.sleep(gap)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})
    return app


def _replica_app(app, coalesce: float = 0.05, max_body: int = 1 << 20) -> ReplicaApp:
    async def metrics() -> bytes:
        return b"# merged\n"

    async def shutdown() -> None:
        pass

    return ReplicaApp(app, "r1", max_body=max_body, read_timeout=5, body_timeout=5, metrics=metrics,
                      on_shutdown=shutdown, coalesce=coalesce)


def test_replica_names_itself_only_when_the_proxy_asks_and_tags_the_response():
    asked = dict(_scope(), extensions={NAME_REPLICA: {}})
    sent = _run(_replica_app(_streaming_app(0, 0)), asked, BODY)
    assert sent[0] == {"type": REPLICA_MESSAGE, "replica": "r1"}
    assert (REPLICA_HEADER, b"r1") in sent[1]["headers"]
    plain = _run(_replica_app(_streaming_app(0, 0)), _scope(), BODY)
    assert plain[0]["type"] == "http.response.start" and (REPLICA_HEADER, b"r1") in plain[0]["headers"]


def test_stream_pieces_are_coalesced_in_order_and_the_last_goes_at_once():
    """The first piece goes at once; pieces within the period wait and go joined with the last."""
    sent = _run(_replica_app(_streaming_app(20, 0), coalesce=60.0), _scope(), BODY)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert [m["body"] for m in bodies] == [b"0;", b"".join(b"%d;" % i for i in range(1, 20)) + b"end"]
    assert [m["more_body"] for m in bodies] == [True, False]


def test_a_waiting_piece_goes_when_its_period_ends():
    sent: list[dict] = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b", "more_body": True})
        for _ in range(1000):  # the timer sends "b" (10 s at most)
            if any(m.get("body") == b"b" for m in sent):
                break
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> None:
        async def receive() -> dict:
            return BODY[0]

        async def send(message: dict) -> None:
            sent.append(message)

        await _replica_app(app, coalesce=0.02)(_scope(), receive, send)

    asyncio.run(main())
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"a", True), (b"b", True), (b"", False)]


def test_every_route_caps_the_body_and_metrics_are_the_merged_text():
    big = [{"type": "http.request", "body": b"x" * 2048, "more_body": False}]
    sent = _run(_replica_app(_streaming_app(0, 0), max_body=1024), _scope(), big)
    assert sent[0]["status"] == 413 and "limit" in json.loads(sent[1]["body"])["error"]["message"]
    sent = _run(_replica_app(_streaming_app(0, 0)), dict(_scope("/metrics"), method="GET"), [])
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"# merged\n"


def _proxy(behaviours: list[str]):
    """A stand-in for Serve's proxy: each call takes the next behaviour."""
    calls = []

    async def proxy(scope, receive, send):
        kind = behaviours[len(calls)]
        calls.append((kind, await receive()))
        assert NAME_REPLICA in scope["extensions"]
        if kind == "lost before naming":
            return
        await send({"type": REPLICA_MESSAGE, "replica": "r7"})
        if kind == "lost after naming":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        if kind == "lost mid-stream":
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return proxy, calls


def test_a_replica_lost_with_the_request_is_a_503_naming_it():
    proxy, calls = _proxy(["lost after naming"])
    sent = _run(ReplicaLoss(proxy), _scope(), BODY)
    assert len(calls) == 1 and sent[0]["status"] == 503
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "service_unavailable" and "replica r7 " in error["message"]


def test_a_stream_cut_short_ends_with_an_error_event():
    proxy, _ = _proxy(["lost mid-stream"])
    sent = _run(ReplicaLoss(proxy), _scope(), BODY)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[-1]["more_body"] is False and b"replica r7 " in sent[-1]["body"]
    assert json.loads(sent[-1]["body"].removeprefix(b"data: "))["error"]["code"] == 503


def test_an_api_request_no_replica_named_itself_for_is_sent_again_with_its_body():
    proxy, calls = _proxy(["lost before naming", "answers"])
    sent = _run(ReplicaLoss(proxy), _scope(), BODY)
    assert [c[0] for c in calls] == ["lost before naming", "answers"]
    assert calls[1][1] == BODY[0]  # the body replayed
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    proxy, calls = _proxy(["lost before naming", "lost before naming"])
    sent = _run(ReplicaLoss(proxy), _scope(), BODY)
    assert len(calls) == 2 and sent[0]["status"] == 503  # only once more


def test_another_applications_request_is_left_to_serve():
    proxy, calls = _proxy(["lost before naming"])
    assert _run(ReplicaLoss(proxy), _scope("/other/app"), BODY) == [] and len(calls) == 1


def test_a_client_that_left_gets_nothing_more():
    async def proxy(scope, receive, send):
        await send({"type": REPLICA_MESSAGE, "replica": "r7"})
        await receive()
        await receive()  # the disconnect: Serve then cancels the call

    gone = [*BODY, {"type": "http.disconnect"}]
    assert _run(ReplicaLoss(proxy), _scope(), gone) == []


@pytest.mark.parametrize("kind", ["lost after naming", "answers"])
def test_a_websocket_whose_replica_is_lost_closes_with_1011(kind):
    async def proxy(scope, receive, send):
        await receive()
        await send({"type": REPLICA_MESSAGE, "replica": "r7"})
        await send({"type": "websocket.accept"})
        if kind == "answers":
            await send({"type": "websocket.close", "code": 1000})

    sent = _run(ReplicaLoss(proxy), _scope("/v1/realtime", "websocket"), [{"type": "websocket.connect"}])
    assert sent[0]["type"] == "websocket.accept"
    assert sent[-1]["type"] == "websocket.close"
    assert sent[-1]["code"] == (1011 if kind == "lost after naming" else 1000)
