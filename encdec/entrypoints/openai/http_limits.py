"""How long and how much a client may send to ``encdec serve``.

uvicorn's h11 protocol times out only idle keep-alive connections, and every
byte that arrives disarms that timer: a client sending one header byte every
few seconds holds its connection forever (slowloris). ``header_timeout_protocol``
gives each request a deadline for its request line and headers, counted from
the connection's start or the previous response's end; past it the connection
is closed.

The body is read by the app through ASGI ``receive``, which ``BodyLimits``
wraps: a wait longer than the read timeout for the next piece of the body (408),
a whole body not in by its deadline, counted from the end of the headers (408:
a client dribbling one byte every few seconds never trips the read timeout, so
only a deadline bounds it), or more bytes than the route's cap, counted as they
arrive (413: a chunked upload without Content-Length stops at the cap instead of
being spooled to disk whole), ends the request with OpenAI's error JSON and
``Connection: close``.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from encdec.entrypoints.openai.protocol import APIError


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline of ``seconds`` for each request's headers."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            # IDLE: the next request's headers have not all arrived (a request in
            # progress is past IDLE; its body has its own timeout).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("dropped a connection that sent no complete request headers in %s s", seconds)
                self.transport.close()

    return HeaderTimeoutProtocol


class _Refused(Exception):
    """Raised into the app by ``receive`` when the body breaks a limit."""


class BodyLimits:
    """ASGI middleware: each request's body arrives with no gap longer than
    ``read_timeout`` seconds, whole within ``body_timeout`` seconds of the
    request reaching the app, and within ``max_bytes(path)`` bytes (None: no
    cap). A refused request gets the refusal instead of whatever the app
    answered to its cut-off body."""

    def __init__(self, app: Any, *, read_timeout: float, body_timeout: float,
                 max_bytes: Callable[[str], int | None]):
        self.app = app
        self.read_timeout = read_timeout
        self.body_timeout = body_timeout
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = self.max_bytes(scope["path"])
        length = dict(scope["headers"]).get(b"content-length", b"")
        if cap is not None and length.isdigit() and int(length) > cap:
            return await _send_error(send, _too_large(int(length), cap, "is"))
        refusal: APIError | None = None
        received, body_done, started = 0, False, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout

        async def limited_receive() -> dict:
            nonlocal refusal, received, body_done
            if refusal is not None:  # refused already: an app that reads again gets no more
                raise _Refused
            if body_done:  # after the body, receive waits for a disconnect: no deadline
                return await receive()
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.read_timeout, left)))
            except asyncio.TimeoutError:
                refusal = self._timed_out(received, stalled=self.read_timeout < left)
                raise _Refused from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if cap is not None and received > cap:
                    refusal = _too_large(received, cap, "reached")
                    raise _Refused
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if refusal is not None:  # the app's answer to a body it did not get in full
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if refusal is None:
                raise
        if refusal is not None and not started:
            await _send_error(send, refusal)


    def _timed_out(self, received: int, *, stalled: bool) -> APIError:
        if stalled:
            return APIError(408, f"the request body stalled: nothing arrived for {self.read_timeout:g} s "
                            f"(--body-read-timeout)", type="timeout_error")
        return APIError(408, f"the request body was not complete within {self.body_timeout:g} s "
                        f"({received} bytes arrived; --body-timeout)", type="timeout_error")


def _too_large(size: int, cap: int, verb: str) -> APIError:
    return APIError(413, f"the request body {verb} {size} bytes, over this route's limit of {cap} bytes "
                    f"(--max-audio-mb sets it for audio)", param="file")


async def _send_error(send: Callable, e: APIError) -> None:
    """OpenAI's error JSON, closing the connection: the rest of the body is not read."""
    body = json.dumps(e.response_body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
