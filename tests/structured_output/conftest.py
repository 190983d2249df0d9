"""Tiny random checkpoints of every text family (random weights make free text:
only the constraint shapes it) and the constraints the tests hold them to."""
from __future__ import annotations

import pytest

FAMILIES = ("bart", "t5", "marian", "m2m100", "nllb", "mbart")

# nested object, enum, array, integer bounds
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 10000,
                                                              "maximum": 99999},
                                                      "ok": {"type": "boolean"}},
                    "required": ["zip", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["turn left", "turn right", "stop now"]
# EBNF (GBNF): a sum of two or three small numbers (bounded, so a random model
# cannot run it to max_tokens); PY_GRAMMAR is the same language as a regex
GRAMMAR = 'root ::= num op num | num op num op num\nnum ::= [1-9] [0-9]?\nop ::= " + " | " - "'
PY_GRAMMAR = r"[1-9][0-9]?(?: [+-] [1-9][0-9]?){1,2}"


def make_checkpoint(family: str, out_dir: str) -> str:
    from encdec import testing

    make = {"bart": testing.make_random_bart, "t5": testing.make_random_t5,
            "marian": testing.make_random_marian, "m2m100": testing.make_random_m2m100,
            "nllb": testing.make_random_nllb, "mbart": testing.make_random_mbart}[family]
    return make(out_dir, seed=0)


def make_llm(path: str):
    from encdec import LLM

    return LLM(path, kv_cache_memory=64 << 20, swap_space=0.05)


@pytest.fixture(scope="session")
def tiny_bart_llm(tiny_bart):
    return make_llm(tiny_bart)


@pytest.fixture(scope="module", params=FAMILIES)
def family_llm(request, tmp_path_factory):
    return make_llm(make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param))))


def prompts(n: int) -> list[str]:
    words = "rain spain falls mainly plain quick brown fox jumps lazy dog".split()
    return [" ".join(words[(i + j) % len(words)] for j in range(1 + i % 7)) for i in range(n)]
