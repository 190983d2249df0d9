"""xgrammar, the grammar backend: the tokenizer's vocabulary as xgrammar sees
it (built once per engine) and a compiler whose results are cached by the
constraint (``StructuredOutputsParams.key``).

Compiles run on a worker thread (``submit`` returns a future), so a caller
that is not the engine's thread never holds the engine while a schema
compiles; the processor waits for its own request's grammar before queueing
it, which is where a schema xgrammar refuses becomes a ``ValueError`` naming
the field and xgrammar's reason. xgrammar is imported here only, on first use.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from encdec.structured_output.params import StructuredOutputsParams

EXTRA = "pip install 'encdec[structured]'"
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs need the xgrammar package ({EXTRA})") from e
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary: ``vocab_size`` is the logits' width
    (T5's head is 32128 wide for a 32100-token tokenizer; the ids past the
    tokenizer's are never allowed)."""
    xgr = import_xgrammar()
    try:
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    except Exception as e:  # xgrammar raises its own types for tokenizers it cannot map
        raise ValueError(f"structured outputs: this model's tokenizer ({type(tokenizer).__name__}) cannot be "
                         f"mapped to xgrammar's vocabulary: {e}") from e


def _compile(compiler: Any, params: StructuredOutputsParams) -> Any:
    kind = params.kind
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                         "(its JSON is compact); leave it unset")
    if kind == "json":
        import json

        return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        xgr = import_xgrammar()
        alternatives = " | ".join(json_string(c) for c in params.choice)
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {alternatives}"))
    grammar = params.grammar
    if _looks_like_lark(grammar):
        raise ValueError("structured_outputs.grammar: Lark grammars are not supported; give EBNF "
                         "(GBNF: `root ::= ...`)")
    return compiler.compile_grammar(grammar)


def json_string(text: str) -> str:
    """An EBNF string literal for ``text`` (EBNF's escapes are JSON's)."""
    import json

    return json.dumps(text, ensure_ascii=False)


def _looks_like_lark(grammar: str) -> bool:
    return "::=" not in grammar and ":" in grammar


class GrammarCompiler:
    """Compiles constraints off the caller's thread, once per distinct constraint."""

    def __init__(self, info: Any, *, max_threads: int = 1):
        xgr = import_xgrammar()
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encdec-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar's future; a cached constraint's at once."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(_compile, self._compiler, params)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar, waiting for it; an invalid constraint is a
        ``ValueError`` naming its field (and is not cached)."""
        future = self.submit(params)
        try:
            return future.result()
        except Exception as e:
            with self._lock:
                if self._cache.get(params.key()) is future:
                    del self._cache[params.key()]
            if isinstance(e, ValueError) and str(e).startswith("structured_outputs"):
                raise
            reason = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e)).strip()  # xgrammar's reason, not its source line
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {reason}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
