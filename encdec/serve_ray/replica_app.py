"""What Ray Serve's HTTP proxy calls in an engine replica: ``encdec serve``'s app,
wrapped.

The replica is the ingress deployment itself, so a request crosses one Ray hop
(the proxy to the replica that runs its engine). Around the app this wrapper

- names the replica to the proxy, first thing, when the proxy asks for it
  (``proxy_errors`` marks the scope): a request lost with its replica can then
  be answered with a 503 naming it, and one lost before any replica took it
  can be tried again;
- tags each response with ``x-encdec-replica``;
- answers ``/metrics`` with every live replica's metrics, each sample labelled
  with its replica (the board the replicas push to);
- caps every body at the largest audio upload (the app caps audio routes only);
- sends a stream's pieces at most every ``coalesce`` seconds: what the app made
  meanwhile crosses as one message, since each message costs a Ray hop's work
  in this process and in the proxy.

The app's lifespan is the replica's (entered by ``EngineReplica``); Serve's own
lifespan calls end here.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from encdec.entrypoints.openai.asgi_relay import REPLICA_HEADER

REPLICA_MESSAGE = "encdec.replica"  # the ASGI message that names the replica to the proxy
NAME_REPLICA = "encdec.name_replica"  # scope extension: the proxy wants REPLICA_MESSAGE first
STALE_SECONDS = 10.0  # a replica silent this long is left out of /metrics

Send = Callable[[dict], Awaitable[None]]


class ReplicaApp:
    """ASGI: ``app`` served from replica ``replica`` (see the module docstring).
    ``metrics``: async, the merged metrics text; ``on_shutdown``: async, run at
    Serve's lifespan shutdown."""

    def __init__(self, app: Any, replica: str, *, max_body: int, read_timeout: float, body_timeout: float,
                 metrics: Callable[[], Awaitable[bytes]], on_shutdown: Callable[[], Awaitable[None]],
                 coalesce: float):
        from encdec.entrypoints.openai.http_limits import BodyLimits

        self.app = BodyLimits(app, read_timeout=read_timeout, body_timeout=body_timeout,
                              max_bytes=lambda _path: max_body)
        self.replica, self.metrics, self.on_shutdown, self.coalesce = replica, metrics, on_shutdown, coalesce

    async def __call__(self, scope: dict, receive: Callable, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if NAME_REPLICA in (scope.get("extensions") or {}):
            await send({"type": REPLICA_MESSAGE, "replica": self.replica})
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET":
            return await self._metrics(send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stream = _Coalescer(send, self.coalesce, self.replica.encode())
        try:
            await self.app(scope, receive, stream.send)
        finally:
            stream.close()
        await stream.flush()

    async def _lifespan(self, receive: Callable, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _metrics(self, send: Send) -> None:
        from encdec.entrypoints.openai.metrics import CONTENT_TYPE

        body = await self.metrics()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode()),
                                (REPLICA_HEADER, self.replica.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _Coalescer:
    """One response's ``send``: the start tagged with the replica; body pieces
    that come within ``period`` seconds of the last one sent wait and go joined
    (the last piece flushes what waits, then goes)."""

    def __init__(self, send: Send, period: float, replica: bytes):
        self._send, self.period, self.replica = send, period, replica
        self.waiting: list[bytes] = []
        self.last = 0.0  # loop time of the last body piece sent
        self.timer: asyncio.TimerHandle | None = None
        self.lock = asyncio.Lock()  # the timer's flush and the app's sends keep their order

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", ()), (REPLICA_HEADER, self.replica)])
        elif message["type"] == "http.response.body" and message.get("more_body"):
            loop = asyncio.get_running_loop()
            if self.waiting or loop.time() - self.last < self.period:
                self.waiting.append(message.get("body", b""))
                if self.timer is None:
                    self.timer = loop.call_at(self.last + self.period, lambda: asyncio.ensure_future(self.flush()))
                return
        elif message["type"] == "http.response.body":  # the last piece: what waits goes first
            message = dict(message, body=b"".join(self._take()) + message.get("body", b""))
        async with self.lock:
            await self._sent(message)

    def _take(self) -> list[bytes]:
        waiting, self.waiting = self.waiting, []
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return waiting

    async def flush(self) -> None:
        """Send what waits (the timer's call, and once the app has returned)."""
        async with self.lock:
            waiting = self._take()
            if waiting:
                await self._sent({"type": "http.response.body", "body": b"".join(waiting), "more_body": True})

    async def _sent(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            self.last = asyncio.get_running_loop().time()
        await self._send(message)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
