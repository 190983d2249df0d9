"""RFC 5987 file names in a multipart part's Content-Disposition."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from encdec.entrypoints.openai.multipart import extended_filename  # noqa: E402


@pytest.mark.parametrize("disposition, name", [
    (b"form-data; name=\"file\"; filename*=UTF-8''d%C3%A9j%C3%A0%20vu.wav", "déjà vu.wav"),
    (b"form-data; name=\"file\"; filename*=\"utf-8'en'clip.wav\"", "clip.wav"),
    (b"form-data; name=\"file\"; filename*=iso-8859-1''caf%E9.wav", "café.wav"),
    (b"form-data; name=\"file\"; filename*=no-such-charset''a%41.wav", "aA.wav"),
    (b"form-data; name=\"file\"; filename=\"plain.wav\"; filename*=UTF-8''other.wav", None),  # plain wins
    (b"form-data; name=\"file\"; filename=\"plain.wav\"", None),
    (b"form-data; name=\"response_format\"", None),
])
def test_extended_filename(disposition, name):
    assert extended_filename(disposition) == name
