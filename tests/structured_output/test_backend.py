"""xgrammar behind one door: a missing package names the extra; compiles are
cached by constraint and run off the caller's thread; a constraint xgrammar
refuses is a ValueError naming the field and its reason, never cached."""
from __future__ import annotations

import sys
import threading

import pytest

pytest.importorskip("xgrammar")

from encdec import StructuredOutputsParams
from encdec.structured_output import backend
from tests.structured_output.conftest import SCHEMA


@pytest.fixture(scope="module")
def compiler(tiny_bart):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bart)
    return backend.GrammarCompiler(backend.tokenizer_info(tok, len(tok) + 8, [tok.eos_token_id]))


def test_missing_xgrammar_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r"encdec\[structured\]"):
        backend.import_xgrammar()


def test_compiled_once_per_constraint_off_the_callers_thread(compiler, monkeypatch):
    threads = []
    compile_ = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda c, p: threads.append(threading.current_thread()) or compile_(c, p))
    so = StructuredOutputsParams(json=dict(SCHEMA, title="cached"))
    first = compiler.compile(so)
    again = compiler.compile(StructuredOutputsParams(json=dict(SCHEMA, title="cached")))
    assert again is first and len(threads) == 1 and threads[0] is not threading.current_thread()


@pytest.mark.parametrize("so, reason", [
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex cannot be compiled: Regex parsing error"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json cannot be compiled: Unsupported type"),
    (StructuredOutputsParams(grammar="root ::= x"), 'structured_outputs.grammar cannot be compiled: .*"x"'),
    (StructuredOutputsParams(grammar="start: WORD"), "structured_outputs.grammar: Lark grammars are not supported"),
    (StructuredOutputsParams(regex="a", whitespace_pattern=" *"), "whitespace_pattern is not supported"),
])
def test_refused_with_the_field_and_reason(compiler, so, reason):
    with pytest.raises(ValueError, match=reason):
        compiler.compile(so)
    assert so.key() not in compiler._cache


def test_every_kind_compiles(compiler):
    for so in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
               StructuredOutputsParams(regex="[a-z]+"), StructuredOutputsParams(choice=['say "hi"', "x"]),
               StructuredOutputsParams(grammar='root ::= "a" | "b"')):
        assert compiler.compile(so) is not None
