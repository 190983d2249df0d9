"""What a request returns, and the incremental detokenizer that builds its text.

Detokenizing only the newest token each step (vLLM's prefix/read offsets)
keeps text cost per step constant instead of growing with the output.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from encdec.sequence import Logprob, RequestMetrics, Sequence, SequenceGroup, SequenceStatus


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # decoder prompt text, if the user gave text
    prompt_token_ids: list[int]  # decoder prompt
    encoder_prompt: str | None
    encoder_prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # {prompt position: {token id: raw log-prob}}, as SamplingParams.prompt_token_logprobs asked
    prompt_token_logprobs: dict[int, dict[int, float]] | None = None
    error: str | None = None  # set when the request could not run (e.g. never fits the cache)

    @classmethod
    def from_seq_group(cls, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs = group.get_seqs()
        n = getattr(params, "n", 1) or 1
        if group.is_finished() and len(seqs) > n:
            # best_of > n: keep the n most likely sequences.
            seqs = sorted(seqs, key=lambda s: s.get_cumulative_logprob(), reverse=True)[:n]
        want_lp = params is not None and params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=s.data.sample_index,
                text=s.output_text,
                token_ids=list(s.get_output_token_ids()),
                cumulative_logprob=s.get_cumulative_logprob() if want_lp else None,
                logprobs=s.output_logprobs if want_lp else None,
                finish_reason=SequenceStatus.get_finished_reason(s.status),
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]
        enc_ids = group.encoder_prompt_token_ids
        if "encoder_features" in group.seqs[0].inputs:
            enc_ids = []  # audio: the encoder "tokens" are placeholders
        return cls(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            encoder_prompt=group.encoder_prompt,
            encoder_prompt_token_ids=list(enc_ids),
            outputs=outputs,
            finished=group.is_finished(),
            metrics=group.metrics,
            prompt_logprobs=group.prompt_logprobs,
            prompt_token_logprobs=group.prompt_token_logprobs,
            error=group.error,
        )


def _rust_conversions(tokenizer: Any) -> tuple[Callable[[int], str | None], Callable[[list[str]], str]] | None:
    """(id -> token, tokens -> text) bound to the Rust tokenizer, where the
    tokenizer's class keeps transformers' own conversions (which only forward to
    it); None where a class overrides them (Marian, M2M100: sentencepiece rules).
    The stop checker detokenizes every new token of every sequence, a host cost
    of each decode step: at 256 rows the wrappers took ~40% of it."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend)
            or cls.convert_ids_to_tokens is not TokenizersBackend.convert_ids_to_tokens
            or cls.convert_tokens_to_string is not TokenizersBackend.convert_tokens_to_string):
        return None
    backend = tokenizer.backend_tokenizer
    decoder = backend.decoder
    return backend.id_to_token, (decoder.decode if decoder is not None else " ".join)


class Detokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # Fast path: ids -> token strings without a Python call per id.
        self._all_special = set(getattr(tokenizer, "all_special_ids", []) or [])
        rust = _rust_conversions(tokenizer)
        self._id_to_token = rust[0] if rust else None
        self._tokens_to_string = rust[1] if rust else tokenizer.convert_tokens_to_string

    def _to_tokens(self, ids: list[int], skip_special: bool) -> list[str]:
        if skip_special:
            ids = [i for i in ids if i not in self._all_special]
        # An id the tokenizer lacks (a model vocab larger than its tokenizer) has no text.
        if self._id_to_token is not None:
            id_to_token = self._id_to_token
            return [id_to_token(i) or "" for i in ids]
        return [t or "" for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def _to_string(self, tokens: list[str], params: Any) -> str:
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            return "".join(self._tokens_to_string([t]) for t in tokens)
        return self._tokens_to_string(tokens)

    def decode_sequence_inplace(self, seq: Sequence, params: Any) -> int:
        """Append the text of every output token ``output_text`` lacks, the newest
        last; return the number of characters the newest added (the stop checker
        searches only those, and trims them when the token ends the sequence)."""
        self.decode_owed(seq, params, upto=seq.get_output_len() - 1)
        return self._decode_next(seq, params)

    def decode_owed(self, seq: Sequence, params: Any, upto: int | None = None) -> None:
        """Append the text of the output tokens before ``upto`` (default: all)
        that ``output_text`` lacks. Owed text from the first token on is decoded
        in one call when it ends cleanly: the text token-by-token decoding gives
        (tests/test_detokenizer.py), at a fraction of its cost; text ending in
        an incomplete character goes token by token, which holds it back."""
        ids = seq.get_output_token_ids()
        end = len(ids) if upto is None else upto
        if seq.num_text_tokens >= end:
            return
        if seq.tokens is None and seq.num_text_tokens == 0 and end > 1:
            tokens = self._to_tokens(ids[:end], params.skip_special_tokens)
            text = self._to_string(tokens, params) if tokens else ""
            if not text.endswith("\ufffd"):
                seq.output_text += text
                seq.tokens = tokens
                seq.prefix_offset = max(len(tokens) - 5, 0)
                seq.read_offset = len(tokens)
                seq.num_text_tokens = end
                return
        while seq.num_text_tokens < end:
            self._decode_next(seq, params)

    def _decode_next(self, seq: Sequence, params: Any) -> int:
        """The first owed token's text (vLLM's prefix/read offsets); returns the characters added."""
        skip = params.skip_special_tokens
        ids = seq.get_output_token_ids()
        i = seq.num_text_tokens
        if seq.tokens is None:
            # Start from the output so far (nonempty only after a fork/recompute).
            seq.tokens = self._to_tokens(ids[:i], skip)
            seq.prefix_offset = max(len(seq.tokens) - 5, 0)
            seq.read_offset = len(seq.tokens)
        seq.tokens.extend(self._to_tokens([ids[i]], skip))
        seq.num_text_tokens = i + 1
        # Empty after every token that produced text (the common case): no decoder call.
        prefix = (self._to_string(seq.tokens[seq.prefix_offset: seq.read_offset], params)
                  if seq.read_offset > seq.prefix_offset else "")
        text = self._to_string(seq.tokens[seq.prefix_offset:], params)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            added = text[len(prefix):]
            seq.output_text += added
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(seq.tokens)
            return len(added)
        return 0


