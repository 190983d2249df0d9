"""A server request's constraint: vLLM's ``structured_outputs`` body field (or
form field, as JSON text) and OpenAI's ``response_format``, as one
``StructuredOutputsParams``. Errors are ``ValueError``/``TypeError`` whose
first word is the field, which the server turns into a 400 naming it.
"""
from __future__ import annotations

import json
from typing import Any

from encdec.structured_output.params import StructuredOutputsParams

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def request_constraint(structured_outputs: Any, response_format: Any = None) -> StructuredOutputsParams | None:
    """The constraint of a request that gives either field (or neither)."""
    if structured_outputs is not None and response_format is not None:
        raise ValueError("structured_outputs and response_format both given; give one")
    if structured_outputs is not None:
        if isinstance(structured_outputs, str):
            structured_outputs = _json_text(structured_outputs)
        return StructuredOutputsParams.from_dict(structured_outputs)
    if response_format is None:
        return None
    return _response_format(response_format)


def _json_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured_outputs must be a JSON object, got text that is not JSON: {e}") from None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    """OpenAI's shapes: {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if not isinstance(value, dict):
        raise TypeError(f"response_format must be an object, got {type(value).__name__}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type must be one of {list(RESPONSE_FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError("response_format.json_schema must be an object with a schema, as "
                         '{"name": ..., "schema": {...}}')
    try:
        return StructuredOutputsParams(json=spec["schema"])
    except (ValueError, TypeError) as e:
        raise type(e)(f"response_format.json_schema.schema: {e}") from None
