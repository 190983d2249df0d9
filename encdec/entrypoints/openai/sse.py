"""Server-sent events: one ``data:`` line per JSON object, and a response that always
closes its body (so a client gone mid-stream aborts its requests at once)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Closes its body iterator however the response ends (a client gone mid-stream
    included), so the requests behind it are aborted now, not at garbage collection."""

    def __init__(self, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
