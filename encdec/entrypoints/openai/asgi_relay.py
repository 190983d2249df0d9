"""ASGI messages carried between processes, and what the Ray Serve path
shares with ``encdec serve``: an app run on a body read whole with its
``send`` messages collected (``run_asgi``: ``benchmarks/serve_hops`` times a
request relayed so), an ``APIError`` as the messages of its OpenAI-shaped
response (``error_messages``: Serve's proxy middleware answers a lost
replica with them), and several replicas' ``/metrics`` merged, labelled by
replica (``merge_metrics``).

What must hold: the app task is cancelled when the caller goes away (a
cancelled stream aborts its engine requests); the app's own errors are
already OpenAI-shaped responses, and an app that fails before answering still
gets a 500 in that shape.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from encdec.entrypoints.openai.protocol import APIError

logger = logging.getLogger("encdec")

Receive = Callable[[], Awaitable[dict]]
REPLICA_HEADER = b"x-encdec-replica"


def body_receive(body: bytes) -> Receive:
    """ASGI ``receive`` for a body read whole: the body, then nothing until the
    call is cancelled (the ingress cancels it when its client disconnects)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


def error_messages(error: APIError) -> list[dict]:
    """An ``APIError`` as the ASGI messages of its JSON response."""
    import json

    body = json.dumps(error.response_body()).encode()
    return [{"type": "http.response.start", "status": error.status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body, "more_body": False}]


async def run_asgi(app: Any, scope: dict, receive: Receive, replica: str) -> AsyncIterator[list[dict]]:
    """Run ``app`` on one request and yield what it sends, in batches: whatever
    is queued when the caller asks again goes as one list, consecutive body pieces
    joined (each item crossing processes costs far more than its bytes). A
    response start is tagged with the replica's id (``x-encdec-replica``)."""
    out: asyncio.Queue = asyncio.Queue()
    done = object()
    started = False

    async def send(message: dict) -> None:
        await out.put(message)

    async def runner() -> None:
        try:
            await app(scope, receive, send)
        except Exception:  # starlette has answered already, or nothing was sent
            logger.exception("the app failed on a relayed %s request", scope.get("type"))
        finally:
            await out.put(done)

    task = asyncio.create_task(runner())
    try:
        finished = False
        while not finished:
            batch = [await out.get()]
            while not out.empty():
                batch.append(out.get_nowait())
            finished = batch[-1] is done
            messages = [m for m in batch if m is not done]
            for i, message in enumerate(messages):
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", ()), (REPLICA_HEADER, replica.encode())]
                    messages[i] = dict(message, headers=headers)
                started = started or message["type"] in ("http.response.start", "websocket.accept")
            if messages:
                yield _join_bodies(messages)
        if not started and scope["type"] == "http":
            yield error_messages(APIError(500, "internal error: the app sent no response", type="internal_error"))
    finally:
        task.cancel()


def _join_bodies(messages: list[dict]) -> list[dict]:
    """Consecutive ``http.response.body`` messages as one."""
    out: list[dict] = []
    for m in messages:
        if out and m["type"] == out[-1]["type"] == "http.response.body" and out[-1].get("more_body"):
            out[-1] = {"type": "http.response.body", "body": out[-1].get("body", b"") + m.get("body", b""),
                       "more_body": m.get("more_body", False)}
        else:
            out.append(m)
    return out


def merge_metrics(texts: dict[str, bytes | str]) -> bytes:
    """Prometheus text from several replicas as one exposition: each family once,
    every sample labelled with its ``replica``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric

    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        text = text.decode() if isinstance(text, bytes) else text
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                merged.add_sample(s.name, dict(s.labels, replica=replica), s.value, s.timestamp, s.exemplar)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
