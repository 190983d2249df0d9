"""BatchUpdate construction: seed 000's two worked examples, then a fuzz test that
drives random add/finish/reorder streams through InputBatch and checks every
processor's per-row state against a plain list model of the batch."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encdec.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)
from encdec.sampling_params import SamplingParams
from encdec.worker.input_batch import InputBatch
from tests.sample.dummy_processor import DummyLogitsProcessor

UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
VOCAB = 32


class Recorder(LogitsProcessor):
    """Keeps every BatchUpdate, and a {slot: tag} map via process_dict_updates."""

    def __init__(self, config: Any = None, device: Any = None, is_pin_memory: bool = False) -> None:
        self.updates: list[BatchUpdate | None] = []
        self.tags: dict[int, str] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        process_dict_updates(self.tags, batch_update, lambda p, _pr, _o: p.extra_args["tag"])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _params(tag: str, **kw) -> SamplingParams:
    return SamplingParams(extra_args={"tag": tag}, **kw)


def _batch(tags: str, rec: Recorder) -> tuple[InputBatch, dict[str, SamplingParams]]:
    ib = InputBatch(max_num_reqs=8, vocab_size=VOCAB, device="cpu", logitsprocs=LogitsProcessors([rec]))
    params = {t: _params(t) for t in tags}
    for t in tags:
        ib.add_request(t, params[t], [1], [])
    ib.refresh_metadata()
    return ib, params


def test_seed_example_fewer_new_than_finished() -> None:
    rec = Recorder()
    ib, _ = _batch("ABCD", rec)
    ib.remove_request("A")
    ib.remove_request("C")
    e = _params("E")
    ib.add_request("E", e, [1], [])
    ib.condense()
    ib.swap_states(0, 1)
    ib.refresh_metadata()
    update = rec.updates[-1]
    assert update.batch_size == 3
    assert [(i, p) for i, p, _, _ in update.added] == [(0, e)]
    assert list(update.removed) == [2]
    assert list(update.moved) == [(3, 2, UNI), (0, 1, SWAP)]
    assert ib.req_ids == ["B", "E", "D"]
    assert rec.tags == {0: "B", 1: "E", 2: "D"}


def test_seed_example_more_new_than_finished() -> None:
    rec = Recorder()
    ib, _ = _batch("ABCD", rec)
    ib.remove_request("C")
    e, f = _params("E"), _params("F")
    ib.add_request("E", e, [1], [])
    ib.add_request("F", f, [1], [])
    ib.condense()
    ib.swap_states(0, 1)
    ib.refresh_metadata()
    update = rec.updates[-1]
    assert update.batch_size == 5
    assert [(i, p) for i, p, _, _ in update.added] == [(2, e), (4, f)]
    assert list(update.removed) == []
    assert list(update.moved) == [(0, 1, SWAP)]
    assert ib.req_ids == ["B", "A", "E", "D", "F"]


def test_no_change_gives_none_and_live_output_lists() -> None:
    rec = Recorder()
    ib, _ = _batch("AB", rec)
    outputs = []
    ib.add_request("C", _params("C"), [1], outputs)
    md = ib.refresh_metadata()
    assert rec.updates[-1] is not None and rec.updates[-1].added[0][3] is outputs
    assert ib.refresh_metadata() is md and rec.updates[-1] is None
    outputs.append(7)  # the engine appends; the metadata sees it without a rebuild
    assert md.output_token_ids[2] == [7]


@pytest.mark.parametrize("first", ["A", "B"])
def test_add_then_remove_in_one_step_leaves_no_state(first: str) -> None:
    rec = Recorder()
    ib, _ = _batch("AB", rec)
    ib.remove_request(first)
    ib.add_request("X", _params("X"), [1], [])  # takes the freed slot...
    ib.remove_request("X")  # ...and leaves before any step ran
    ib.refresh_metadata()
    left = "B" if first == "A" else "A"
    assert ib.req_ids == [left] and rec.tags == {0: left}


def _apply(tags: dict[int, str], update: BatchUpdate) -> dict[int, str]:
    new = {"E": "E", "F": "F"}
    process_dict_updates(tags, update, lambda p, _pr, _o: new[p])
    return tags


def test_process_dict_updates_follows_seed_semantics() -> None:
    abcd = lambda: dict(enumerate("ABCD"))  # noqa: E731
    # [A,B,C,D] remove 1 -> [A,x,C,D]; add E@1 replaces B; add F@4 extends
    assert _apply(abcd(), BatchUpdate(4, [1], [], [])) == {0: "A", 2: "C", 3: "D"}
    assert _apply(abcd(), BatchUpdate(5, [], [(1, "E", [], []), (4, "F", [], [])], [])) == \
        {0: "A", 1: "E", 2: "C", 3: "D", 4: "F"}
    # unidirectional 3 -> 1 discards B and empties 3; swap 3 <-> 1 exchanges
    assert _apply(abcd(), BatchUpdate(3, [], [], [(3, 1, UNI)])) == {0: "A", 1: "D", 2: "C"}
    assert _apply(abcd(), BatchUpdate(4, [], [], [(3, 1, SWAP)])) == {0: "A", 1: "D", 2: "C", 3: "B"}


def test_add_after_move_in_one_step_is_refused() -> None:
    ib, _ = _batch("ABC", Recorder())
    ib.remove_request("A")
    ib.condense()
    try:
        ib.add_request("D", _params("D"), [1], [])
    except RuntimeError as e:
        assert "refresh_metadata" in str(e)
    else:
        raise AssertionError("add after a move must be refused")


# ---- fuzz -------------------------------------------------------------------

step_ops = st.tuples(
    st.lists(st.integers(0, 7), max_size=4),  # rows to finish (mod current size)
    st.integers(0, 4),  # new requests
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=2),  # swaps
)


@settings(max_examples=60, deadline=None)
@given(st.lists(step_ops, min_size=1, max_size=12), st.data())
def test_fuzz_processor_state_matches_list_model(steps, data) -> None:
    rec = Recorder()
    dummy = DummyLogitsProcessor(None, torch.device("cpu"), False)
    min_p = MinPLogitsProcessor(None, torch.device("cpu"), False)
    ib = InputBatch(max_num_reqs=8, vocab_size=VOCAB, device="cpu",
                    logitsprocs=LogitsProcessors([rec, dummy, min_p]))
    model: list[str] = []  # the batch as seed 000 describes it
    params: dict[str, SamplingParams] = {}
    outputs: dict[str, list[int]] = {}
    counter = 0
    for finish, num_new, swaps in steps:
        # 1. finish: leave holes
        slots: list[str | None] = list(model)
        for row in {r % len(model) for r in finish} if model else ():
            ib.remove_request(slots[row])
            slots[row] = None
        # 2. add: lowest holes first, then extend
        for _ in range(min(num_new, 8 - sum(s is not None for s in slots))):
            tag = f"q{counter}"
            counter += 1
            target = data.draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)))
            extra = {"tag": tag} if target is None else {"tag": tag, "target_token": target}
            params[tag] = SamplingParams(extra_args=extra, min_p=data.draw(st.sampled_from([0.0, 0.5])),
                                         temperature=data.draw(st.sampled_from([0.0, 0.7])))
            outputs[tag] = []
            index = ib.add_request(tag, params[tag], [1], outputs[tag])
            hole = next((i for i, s in enumerate(slots) if s is None), len(slots))
            assert index == hole
            slots[hole:hole + 1] = [tag]
        # 3. condense: highest row into lowest hole
        while None in slots:
            hole = slots.index(None)
            while slots and slots[-1] is None:
                slots.pop()
            if hole < len(slots):
                slots[hole] = slots.pop()
        ib.condense()
        # 4. swaps
        for a, b in swaps:
            if slots:
                a, b = a % len(slots), b % len(slots)
                if a != b:
                    slots[a], slots[b] = slots[b], slots[a]
                    ib.swap_states(a, b)
        model = slots
        md = ib.refresh_metadata()
        for tag in model:  # the engine appends a token each step
            outputs[tag].append(0)

        assert ib.req_ids == model
        assert rec.tags == dict(enumerate(model))
        want_targets = {i: params[t].extra_args["target_token"] for i, t in enumerate(model)
                        if "target_token" in params[t].extra_args}
        assert dummy.req_info == want_targets
        want_min_p = [params[t].min_p for t in model]
        got_min_p = [0.0] * len(model) if min_p.min_p is None else min_p.min_p[:, 0].tolist()
        assert got_min_p == want_min_p
        assert all(md.output_token_ids[i] is outputs[t] for i, t in enumerate(model))
        temps = [0.0 if params[t].temperature == 0.0 else params[t].temperature for t in model]
        if md.temperature is not None:
            assert md.temperature.tolist() == torch.tensor(temps).tolist()
        assert md.all_greedy == all(t == 0.0 for t in temps)
