"""Structured outputs: a request's output held to a JSON schema, a regex, a
list of choices or a grammar (xgrammar, the optional ``encdec[structured]``
extra, imported only when a request asks for a constraint).

    params.py   StructuredOutputsParams (torch- and xgrammar-free)
    backend.py  xgrammar: tokenizer info, compiling (off the caller's thread, cached)
    manager.py  per-sequence matchers: a step's masks, accepting tokens, beam forks
    bitmask.py  the sampler's side: the step's masks in batch-row order, applied to the logits
    requests.py a server request's constraint (structured_outputs, OpenAI's response_format)
"""
from __future__ import annotations

from encdec.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
