"""The ingress of ``encdec serve --ray``: every request relayed to an engine replica.

It reads a request's body (up to the largest audio upload plus form fields,
else 413; within ``--body-timeout`` seconds, else 408), sends it with the request's scope to a replica through the
deployment handle and streams the replica's answer back. A replica that dies
or goes silent for ``RELAY_IDLE_TIMEOUT`` seconds turns into a 503 in OpenAI's
error shape, or, once a stream has started, an SSE error event and the end of
the stream; a WebSocket gets close code 1011. ``/metrics`` merges every live
replica's metrics (``asgi_relay.merge_metrics``).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

from encdec.entrypoints.openai.asgi_relay import error_messages, merge_metrics, portable_scope
from encdec.entrypoints.openai.metrics import CONTENT_TYPE
from encdec.entrypoints.openai.protocol import APIError

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
BOARD = "encdec-metrics-board"
STALE_SECONDS = 10.0  # a replica silent this long is left out of /metrics
RELAY_IDLE_TIMEOUT = 600.0  # the longest wait for the next piece of a replica's answer


class MetricsBoard:
    """The last metrics text of each replica (a Ray actor, no CPU)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def snapshot(self, max_age: float) -> dict[str, bytes]:
        now = time.monotonic()
        return {r: text for r, (t, text) in self.texts.items() if now - t <= max_age}


def metrics_board() -> Any:
    """The board actor, made by whichever process asks first; if its owner dies
    with it, the next caller makes another (it refills within a push period)."""
    import ray

    return ray.remote(MetricsBoard).options(name=BOARD, get_if_exists=True, num_cpus=0).remote()


def _replica_lost(e: BaseException, replica: str | None) -> APIError:
    reason = "did not answer in time" if isinstance(e, TimeoutError) else f"failed ({type(e).__name__})"
    which = f"engine replica {replica}" if replica else "engine replica"
    return APIError(503, f"the {which} serving this request {reason}; it is being replaced, "
                    "retry the request", type="service_unavailable")


async def _messages(stream: Any, timeout: float):
    """The replica's messages one by one (it sends them in lists); a list slower
    than ``timeout`` seconds raises TimeoutError."""
    while True:
        try:
            batch = await asyncio.wait_for(stream.__anext__(), timeout)
        except StopAsyncIteration:
            return
        for message in batch:
            yield message


class RelayedResponse(Response):
    """Sends what the replica's app sends. A replica lost before it took the
    request (it had not named itself: Serve routed to it before seeing it die)
    means one more try on another replica; a replica lost with the request is a
    503 before the response starts, after it an SSE error event (streams) or a
    cut body."""

    def __init__(self, call: Any, timeout: float):
        super().__init__()
        self.call, self.timeout = call, timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """(A client that goes away makes Serve cancel this call, which cancels
        the replica's.)"""
        started, event_stream, replica, tries, ended = False, False, None, 2, False
        stream = self.call()
        messages = _messages(stream, self.timeout)
        try:
            while True:
                try:
                    message = await messages.__anext__()
                except StopAsyncIteration:
                    ended = True  # nothing to cancel: a finished call's cancel can reach the proxy's
                    return
                except (Exception, asyncio.CancelledError) as e:  # ray's errors, a timeout; not the client's
                    if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                        raise  # this call is being cancelled (the client left)
                    tries -= 1
                    if replica is None and tries and not isinstance(e, TimeoutError):
                        stream.cancel()
                        stream = self.call()
                        messages = _messages(stream, self.timeout)
                        continue
                    await _fail(send, _replica_lost(e, replica), started, event_stream)
                    return
                if message["type"] == "relay.replica":
                    replica = message["replica"]
                    continue
                if message["type"] == "http.response.start":
                    started = True
                    event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                       for k, v in message.get("headers", ()))
                await send(message)
        finally:
            if not ended:
                stream.cancel()


async def _fail(send: Any, error: APIError, started: bool, event_stream: bool) -> None:
    if not started:
        for message in error_messages(error):
            await send(message)
        return
    tail = f"data: {json.dumps(error.response_body())}\n\n".encode() if event_stream else b""
    await send({"type": "http.response.body", "body": tail, "more_body": False})


class OpenAIIngress:
    """Relays each request to an engine replica; Serve calls
    ``__serve_build_asgi_app__`` after the constructor for the routes."""

    def __init__(self, replicas: Any, max_body: int, body_timeout: float):
        self.replicas, self.max_body, self.body_timeout = replicas, max_body, body_timeout
        self.board = metrics_board()

    def __serve_build_asgi_app__(self) -> FastAPI:
        # no docs routes of its own: /docs and /openapi.json are the replicas' (encdec serve's)
        app = FastAPI(title="encdec (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)
        app.get("/metrics")(self.metrics)
        app.api_route("/{path:path}", methods=_METHODS)(self.relay)
        app.websocket("/{path:path}")(self.websocket)
        return app

    async def metrics(self) -> Response:
        try:
            texts = await self.board.snapshot.remote(STALE_SECONDS)
        except Exception:  # its owner died: a new board fills within a second
            self.board, texts = metrics_board(), {}
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE)

    async def relay(self, request: Request, path: str) -> Response:
        try:
            body = await asyncio.wait_for(self._read_body(request), self.body_timeout)
        except TimeoutError:
            body = APIError(408, f"the request body was not complete within {self.body_timeout:g} s "
                            "(--body-timeout)", type="timeout_error")
        if isinstance(body, APIError):
            return Response(json.dumps(body.response_body()), status_code=body.status,
                            media_type="application/json", headers={"connection": "close"})
        scope = portable_scope(request.scope, request.url.path)
        handle = self.replicas.options(method_name="http", stream=True)
        return RelayedResponse(lambda: handle.remote(scope, body), RELAY_IDLE_TIMEOUT)

    async def _read_body(self, request: Request) -> bytes | APIError:
        """The whole body (the replica gets it in one piece), or a 413 past the cap."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return APIError(413, f"the request body is over {self.max_body} bytes, this server's limit "
                                "(--max-audio-mb sets it for audio)", param="file")
        return bytes(body)

    async def websocket(self, ws: WebSocket, path: str) -> None:
        from ray.util.queue import Queue

        inbox = Queue(actor_options={"num_cpus": 0})
        scope = portable_scope(ws.scope, ws.url.path)
        stream = self.replicas.options(method_name="websocket", stream=True).remote(scope, inbox)
        pump = asyncio.create_task(_pump(ws, inbox))
        replica = None
        try:
            async for message in _messages(stream, RELAY_IDLE_TIMEOUT):
                if message["type"] == "relay.replica":
                    replica = message["replica"]
                else:
                    await ws.send(message)
            stream = None  # ended: nothing to cancel
        except Exception as e:  # the replica died: its session ends, others go on
            await _close(ws, 1011, _replica_lost(e, replica).message)
        finally:
            pump.cancel()
            if stream is not None:
                stream.cancel()
            inbox.shutdown(force=True)


def ingress_deployment(serve: Any) -> Any:
    """``OpenAIIngress`` as a Serve deployment (ASGI ingress, no CPU reserved)."""
    return serve.deployment(serve.ingress()(OpenAIIngress), name="OpenAIIngress",
                            ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)


async def _pump(ws: WebSocket, inbox: Any) -> None:
    """Client events (connect, messages, disconnect) to the replica's queue."""
    while True:
        message = await ws.receive()
        await inbox.put_async(message)
        if message["type"] == "websocket.disconnect":
            return


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    from starlette.websockets import WebSocketState

    try:
        if ws.client_state == WebSocketState.CONNECTING:
            await ws.send({"type": "websocket.close", "code": code, "reason": reason[:120]})
        elif ws.client_state == WebSocketState.CONNECTED:
            await ws.close(code, reason[:120])
    except Exception:  # the client is gone too
        pass
