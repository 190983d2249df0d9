"""In Ray Serve's HTTP proxy: a request whose engine replica is lost gets an
answer in OpenAI's error shape.

Serve's proxy calls the engine replica directly (the replica is the ingress);
when the replica dies it ends the response without a word (a bare 500 from the
HTTP server). This ASGI middleware, which Serve puts around its proxy when
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names ``middlewares`` below (set in
the proxy's environment: ``proxy_env()``), asks the replica to name itself
first thing (``replica_app``), and then:

- a replica lost after it named itself: a 503 in OpenAI's error shape naming it
  before the response started, an SSE error event ending a stream that had
  started, a close with code 1011 for a WebSocket;
- an OpenAI API request (``/v1/...``) whose replica was lost before its name
  reached the proxy (the replica had barely taken it) is sent once more, with
  the body read so far; lost again, a 503;
- anything else (another application's request) is left as Serve answers it.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from encdec.serve_ray.replica_app import NAME_REPLICA, REPLICA_MESSAGE

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "encdec.serve_ray.proxy_errors.middlewares"
OPENAI_PREFIX = "/v1/"  # the routes whose requests are ours even before a replica names itself


def proxy_env() -> dict[str, str]:
    """The environment Serve's proxy needs for this middleware."""
    return {CALLBACK_ENV: CALLBACK}


def middlewares() -> list:
    """Serve's proxy callback: the middlewares it puts around itself."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLoss)]


def lost_message(replica: str | None) -> str:
    which = f"engine replica {replica}" if replica else "engine replica"
    return f"the {which} serving this request failed; it is being replaced, retry the request"


class _Try:
    """What one call through the proxy showed: the replica, how far the answer got."""

    def __init__(self, send: Callable[[dict], Awaitable[None]]):
        self._send = send
        self.replica: str | None = None
        self.started = False  # http.response.start or websocket.accept went out
        self.ended = False  # the last body piece or a close went out
        self.event_stream = False

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == REPLICA_MESSAGE:
            self.replica = message["replica"]
            return
        if kind == "http.response.start":
            self.started = True
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
        elif kind == "websocket.accept":
            self.started = True
        elif kind == "websocket.close" or (kind == "http.response.body" and not message.get("more_body")):
            self.ended = True
        await self._send(message)


class ReplicaLoss:
    """ASGI middleware (see the module docstring)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = dict(scope, extensions={**(scope.get("extensions") or {}), NAME_REPLICA: {}})
        ours = scope["type"] == "http" and scope["path"].startswith(OPENAI_PREFIX)
        gone = [False]  # the client left: it needs no answer
        seen: list[dict] = []  # the client's messages, while a second try may need them
        attempt = _Try(send)

        async def recorded() -> dict:
            message = await receive()
            gone[0] = gone[0] or message["type"] in ("http.disconnect", "websocket.disconnect")
            if ours and attempt.replica is None:
                seen.append(message)
            return message

        await self.app(scope, recorded, attempt.send)
        if ours and attempt.replica is None and not attempt.started and not gone[0]:
            replay = iter(list(seen))

            async def replayed() -> dict:
                return next(replay, None) or await recorded()

            attempt = _Try(send)
            await self.app(scope, replayed, attempt.send)
        if (ours or attempt.replica is not None) and not attempt.ended and not gone[0]:
            await _fail(attempt, scope["type"], send)


async def _fail(attempt: _Try, kind: str, send: Callable) -> None:
    """The end of an answer the proxy cut short (its replica was lost)."""
    from encdec.entrypoints.openai.asgi_relay import error_messages
    from encdec.entrypoints.openai.protocol import APIError

    error = APIError(503, lost_message(attempt.replica), type="service_unavailable")
    if kind == "websocket":
        messages = [{"type": "websocket.close", "code": 1011, "reason": error.message[:120]}]
    elif not attempt.started:
        messages = error_messages(error)
    else:
        tail = f"data: {json.dumps(error.response_body())}\n\n".encode() if attempt.event_stream else b""
        messages = [{"type": "http.response.body", "body": tail, "more_body": False}]
    try:
        for message in messages:
            await send(message)
    except Exception:  # noqa: BLE001 - the client is gone too
        pass
