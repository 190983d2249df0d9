"""``StructuredOutputsParams``: what a request's output must match (vLLM's
names), validated at the edge. Torch-free and xgrammar-free: the grammar is
compiled by the engine (``encdec.structured_output.backend``), which also
reports a schema, regex or grammar xgrammar cannot compile, before anything
is queued.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

# the constraint fields; exactly one is set per request
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, as a dict or its JSON
    text), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (EBNF in xgrammar's GBNF dialect, or Lark) or
    ``json_object=True`` (any JSON object). ``whitespace_pattern`` is vLLM's
    name for the whitespace JSON may hold; xgrammar takes no pattern, so it is
    refused by the engine (the JSON it makes is compact: no whitespace)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            self.json = _schema(self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a str, got {type(value).__name__}")
        if self.regex == "" or self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs: regex and grammar must not be empty")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(f"structured_outputs.choice must be a list of str, got {type(self.choice).__name__}")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of str, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {type(self.json_object).__name__}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")

    @property
    def kind(self) -> str:
        """The field that holds the constraint."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, str | None]:
        """What the compiled grammar depends on: the compile cache's key."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = _json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = _json.dumps(value)
        return kind, str(value), self.whitespace_pattern

    @classmethod
    def from_dict(cls, value: Any, field: str = "structured_outputs") -> StructuredOutputsParams:
        """A request body's object (the server's ``structured_outputs``): unknown
        keys are refused."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"{field} must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS) - {"whitespace_pattern"})
        if unknown:
            raise ValueError(f"{field}: unknown key(s) {unknown}; expected {list(KINDS) + ['whitespace_pattern']}")
        return cls(**value)


def _schema(value: Any) -> dict | bool:
    """A JSON schema as a dict (or a boolean schema): JSON text is parsed here."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                        f"got {type(value).__name__}")
    return value


def check_structured(value: Any) -> StructuredOutputsParams | None:
    """``SamplingParams.structured_outputs`` / ``BeamSearchParams``'s: None, the
    params, or a dict of them."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        return StructuredOutputsParams.from_dict(value)
    raise TypeError(f"structured_outputs must be StructuredOutputsParams, got {type(value).__name__}")
