"""A self-draft's bfloat16 copy of its rows' K/V (``worker/draft_kv.py``) and
how ``DraftModel`` proposes with it: the copy holds the target's cross K/V and
verified self K/V rounded to bfloat16, follows each sequence as the target
verifies more positions, keeps within its cap (rows past it draft from the
target's cache), frees what a sequence held when it leaves; a row stops
drafting after a stop token. Exactness with the copy in use is the engine
tests' (``test_draft_model.py``: int8 self-drafts on a float32 CPU cache)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.worker.draft_kv import DraftKV
from encdec.worker.draft_model import DraftModel, DraftRow

LAYERS, BLOCKS, BS, H, D = 2, 40, 4, 2, 8


def _target() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, BLOCKS, BS, H, D, generator=g) for _ in range(LAYERS)]


def _row(seq_id: int, n: int, k: int, self_blocks: list[int], cross: list[int], stop: tuple = ()) -> DraftRow:
    meta = SimpleNamespace(block_tables={seq_id: self_blocks}, cross_block_table=cross,
                           encoder_seq_data=SimpleNamespace(prompt_token_ids=[0] * (len(cross) * BS - 1)),
                           sampling_params=SimpleNamespace(all_stop_token_ids=set(stop)))
    return DraftRow(seq_id, meta, list(range(n)), k)


def _slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in positions]


def _assert_holds(copy: DraftKV, target: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    for t, c in zip(target, copy.caches):
        want = t.view(2, -1, H, D)[:, src].to(torch.bfloat16)
        assert torch.equal(c.view(2, -1, H, D)[:, dst], want)


def test_the_copy_holds_cross_and_verified_self_kv_rounded_and_follows_the_sequence():
    target = _target()
    copy = DraftKV(target, BS, 1 << 20)
    table, cross = [7, 3, 30, 12, 9, 21], [5, 6, 8]  # positions 0..23; the cross K/V of 11 encoder tokens
    row = _row(1, 10, 3, table, cross)
    assert copy.prepare([row])
    assert len(copy.self_table(1)) == 3  # positions up to 10 - 2 + 3 = 11: three blocks
    _assert_holds(copy, target, _slots(cross, range(12)), _slots(copy.cross_table(1), range(12)))
    _assert_holds(copy, target, _slots(table, range(9)), _slots(copy.self_table(1), range(9)))

    # The target verifies positions 9..13 (what the draft wrote there is overwritten).
    for t in target:
        t.view(2, -1, H, D)[:, _slots(table, range(9, 14))] += 1.0
    assert copy.prepare([_row(1, 15, 3, table, cross)])
    assert len(copy.self_table(1)) == 5
    _assert_holds(copy, target, _slots(table, range(14)), _slots(copy.self_table(1), range(14)))


def test_int8_cross_blocks_hold_the_target_s_cross_kv_quantized_and_self_blocks_stay_bfloat16():
    from encdec.kernels.cpu import cross_i8

    target = _target()
    copy = DraftKV(target, BS, 1 << 20)
    copy.choose_cross_int8(True)
    assert copy.cross_int8
    table, cross = [7, 3, 30], [5, 6, 8]
    assert copy.prepare([_row(1, 10, 3, table, cross)])
    got_blocks = torch.tensor(copy.cross_table(1))
    for t, c in zip(target, copy.caches):
        want = t[:, cross]
        got = cross_i8.read_blocks(c, got_blocks)
        step = want.abs().amax(-1, keepdim=True) / 127  # each (slot, head)'s int8 step
        assert bool(((got - want).abs() <= step / 2 + 1e-6).all())
    _assert_holds(copy, target, _slots(table, range(9)), _slots(copy.self_table(1), range(9)))
    with pytest.raises(RuntimeError, match="already copied"):
        copy.choose_cross_int8(False)
    copy.forget([1])
    copy.choose_cross_int8(False)  # nothing copied: the format may change
    assert copy.prepare([_row(2, 10, 3, table, cross)])
    _assert_holds(copy, target, _slots(cross, range(12)), _slots(copy.cross_table(2), range(12)))


def test_rows_past_the_cap_draft_from_the_target_and_leaving_frees_their_blocks():
    target = _target()
    per_seq = 3 + 2  # cross blocks + self blocks of the rows below
    block_bytes = 2 * LAYERS * BS * H * D * 2
    copy = DraftKV(target, BS, per_seq * block_bytes)
    a, b = _row(1, 6, 3, [0, 1, 2], [10, 11, 12]), _row(2, 6, 3, [3, 4, 5], [13, 14, 15])
    assert not copy.prepare([a, b])  # both do not fit
    assert copy.prepare([a])
    assert copy.prepare([b])  # sequence 1 drafts no more this step: its blocks go to 2
    _assert_holds(copy, target, _slots([13, 14, 15], range(12)), _slots(copy.cross_table(2), range(12)))
    copy.forget([2])
    assert copy.blocks_used == 0


class _Counter(torch.nn.Module):
    """A draft whose greedy token after t is t + 1 (hidden states one-hot at
    input + 1); it records each step's inputs and metadata."""

    vocab = 16

    def __init__(self):
        super().__init__()
        self.steps: list[tuple] = []

    def forward(self, input_ids, positions, kv_caches, md):
        assert kv_caches[0].dtype == torch.bfloat16  # the copy, not the target's cache
        rows = md.decode_rows
        self.steps.append((input_ids.tolist(), positions.tolist(), md.slot_mapping.tolist(), md.seq_lens,
                           md.seq_lens_tensor.tolist(), md.context_lens_tensor.tolist(), md.max_decode_seq_len,
                           rows.self_lens.tolist(), rows.cross_lens.tolist()))
        return torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float()

    def compute_logits(self, hidden):
        return hidden


def test_a_row_stops_drafting_after_a_stop_token_and_each_step_has_its_rows_inputs():
    """Steps after the first advance the first's inputs in place while the rows
    stay; a step with fewer rows packs them anew: either way each step's inputs
    are its rows' tokens, positions, slots and lengths."""
    target, model = _target(), _Counter()
    draft = DraftModel(model, TorchSDPABackend, torch.device("cpu"), BS, target_cache=SimpleNamespace(gpu_cache=target))
    rows = [_row(1, 6, 5, [0, 1, 2], [10, 11, 12], stop=(8,)), _row(2, 9, 5, [3, 4, 5, 6], [13, 14, 15])]
    # Row 1's last token is 5: drafts 6, 7, 8 and no more; row 2 drafts all 5.
    assert draft.propose_rows(rows) == {1: [6, 7, 8], 2: [9, 10, 11, 12, 13]}
    tables = {sid: draft._copy.self_table(sid) for sid in (1, 2)}
    want = []
    for step in range(5):
        live = [(1, 6), (2, 9)] if step < 3 else [(2, 9)]
        pos = [n - 1 + step for _, n in live]
        lens = [p + 1 for p in pos]
        want.append((pos, pos, [_slots(tables[sid], range(p, p + 1))[0] for (sid, _), p in zip(live, pos)], lens,
                     lens, [n - 1 for n in lens], max(lens), lens, [11] * len(live)))
    assert model.steps == want  # a row's input token at position p is token p: the counter's drafts
