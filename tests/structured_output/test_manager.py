"""Per-sequence grammar state on real sequences: masks by seq_id, tokens
accepted until the grammar ends the sequence, a fork continuing from its
parent's state on its own, never a special token or an id past the tokenizer."""
from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")
import torch

from encdec import SamplingParams, StructuredOutputsParams
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus
from encdec.structured_output.manager import StructuredOutputManager

EXTRA = 8  # logits wider than the tokenizer (T5: 32128 for 32100)


@pytest.fixture(scope="module")
def tok(tiny_bart):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_bart)


def _group(params: SamplingParams, n: int = 1, first_id: int = 0) -> SequenceGroup:
    inputs = {"prompt_token_ids": [2], "encoder_prompt_token_ids": [0, 5, 2]}
    seqs = [Sequence(first_id + i, inputs, 16, eos_token_id=2) for i in range(n)]
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return SequenceGroup("r", seqs, 0.0, params, encoder_seq=Sequence(first_id, inputs, 16, from_decoder_prompt=False))


def _allowed(masks, seq_id: int, vocab: int) -> set[int]:
    row = masks.bitmask[masks.rows[seq_id]]
    return {t for t in range(vocab) if int(row[t // 32]) >> (t % 32) & 1}


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_masks_accept_and_end(tok):
    vocab = len(tok) + EXTRA
    manager = StructuredOutputManager(tok, vocab_size=vocab, eos_token_id=tok.eos_token_id)
    group = _group(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    seq = group.seqs[0]
    allowed = _allowed(manager.fill_masks([group]), seq.seq_id, vocab)
    assert allowed and all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    assert not allowed & (set(tok.all_special_ids) | set(range(len(tok), vocab)))
    for t in _ids(tok, "yes"):
        seq.append_token_id(t)
        assert manager.accept(seq, t) is False
    assert _allowed(manager.fill_masks([group]), seq.seq_id, vocab) == {tok.eos_token_id}
    seq.append_token_id(tok.eos_token_id)
    assert manager.accept(seq, tok.eos_token_id) is True  # the grammar is done


def test_unconstrained_groups_have_no_masks(tok):
    manager = StructuredOutputManager(tok, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    assert manager.fill_masks([_group(SamplingParams())]) is None
    assert manager.accept(_group(SamplingParams()).seqs[0], 5) is False


def test_fork_continues_on_its_own_and_free_forgets(tok):
    vocab = len(tok)
    manager = StructuredOutputManager(tok, vocab_size=vocab, eos_token_id=tok.eos_token_id)
    group = _group(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["ab", "ac"])))
    parent = group.seqs[0]
    manager.fill_masks([group])
    (a,) = _ids(tok, "a") if len(_ids(tok, "a")) == 1 else pytest.skip("'a' is not one token")
    parent.append_token_id(a)
    manager.accept(parent, a)
    child = parent.fork(99)
    group.add(child)
    manager.fork(parent, child)
    b, c = _ids(tok, "b")[0], _ids(tok, "c")[0]
    parent.append_token_id(b)
    assert manager.accept(parent, b) is False
    masks = manager.fill_masks([group])
    assert _allowed(masks, parent.seq_id, vocab) == {tok.eos_token_id}
    assert c in _allowed(masks, child.seq_id, vocab) and b in _allowed(masks, child.seq_id, vocab)
    manager.free([parent.seq_id, child.seq_id])
    assert manager._states == {}


def test_a_refused_token_marks_the_sequence_dead(tok):
    vocab = len(tok)
    manager = StructuredOutputManager(tok, vocab_size=vocab, eos_token_id=tok.eos_token_id)
    group = _group(SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    seq = group.seqs[0]
    manager.fill_masks([group])
    bad = _ids(tok, "x")[0]
    seq.append_token_id(bad)
    assert manager.accept(seq, bad) is True  # the sequence must end
    row = manager.fill_masks([group]).bitmask[0]
    specials = set(tok.all_special_ids) - {tok.eos_token_id}
    assert _allowed_row(row, vocab) == set(range(vocab)) - specials  # a dead beam's row: anything but specials


def _allowed_row(row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if int(row[t // 32]) >> (t % 32) & 1}
