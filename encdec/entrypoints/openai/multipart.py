"""Reading a ``multipart/form-data`` upload: starlette's parser, plus RFC 5987
file names.

python-multipart drops a ``filename*=UTF-8''...`` parameter (RFC 5987/6266,
what clients send for a non-ASCII name), so a part named only that way reached
the app as a text field, its audio decoded as text. Here such a part is a file
whose name is the decoded value; where both forms are given, the plain
``filename`` is used, as before.
"""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartParser

_EXTENDED = re.compile(rb"""(?:^|;)\s*filename\*\s*=\s*"?([^";]*)"?""", re.IGNORECASE)
_PLAIN = re.compile(rb"(?:^|;)\s*filename\s*=", re.IGNORECASE)


def extended_filename(disposition: bytes) -> str | None:
    """The RFC 5987 ``filename*`` of a Content-Disposition value (``charset'lang'%XX``
    text, decoded), or None when there is none or a plain ``filename`` is given."""
    m = _EXTENDED.search(disposition)
    if m is None or _PLAIN.search(disposition):
        return None
    charset, quote, rest = m.group(1).decode("latin-1").partition("'")
    if not quote:  # no charset'lang' prefix: take the value as it is
        return unquote(charset, encoding="utf-8", errors="replace")
    _, _, value = rest.partition("'")
    try:
        return unquote(value, encoding=charset or "utf-8", errors="replace")
    except LookupError:  # an unknown charset name
        return unquote(value, encoding="utf-8", errors="replace")


class _Parser(MultiPartParser):
    def on_headers_finished(self) -> None:
        part = self._current_part
        name = extended_filename(part.content_disposition or b"")
        if name is not None:  # as a plain filename, which the parser understands
            quoted = name.replace("\\", "\\\\").replace('"', '\\"').encode("utf-8")
            part.content_disposition += b'; filename="' + quoted + b'"'
        super().on_headers_finished()


async def read_form(request: Any, *, max_files: int, max_fields: int) -> FormData:
    """``request.form(...)`` that also takes RFC 5987 file names. Raises
    starlette's ``MultiPartException`` on a malformed body."""
    parser = _Parser(request.headers, request.stream(), max_files=max_files, max_fields=max_fields)
    return await parser.parse()
