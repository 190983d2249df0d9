"""A seeded request's tokens depend on its seed and logits only: not on the rows
around it, its row number, or a preemption in between."""
from __future__ import annotations

import zlib

import torch

from encdec.sample.logits_processor import build_logitsprocs
from encdec.sample.sampler import Sampler
from encdec.sampling_params import SamplingParams, derive_seed
from encdec.worker.input_batch import InputBatch

VOCAB = 50
STEPS = 8
SEEDED = SamplingParams(seed=1234, temperature=1.0, top_p=0.95, max_tokens=64)


def _logits_for(req_id: str, step: int) -> torch.Tensor:
    """A fake model: each sequence's logits depend on its id and step only."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{step}".encode()))
    return torch.randn(VOCAB, generator=gen) * 2  # (vocab,)


def _run(schedule: dict[int, list[tuple[str, SamplingParams]]], steps: int = STEPS,
         swap_at: set[int] = frozenset(), preempt: dict[int, str] | None = None) -> dict[str, list[int]]:
    """Drive an InputBatch like the model runner: joins per step, optional swaps,
    optional remove-and-re-add of one sequence; returns every sequence's tokens."""
    ib = InputBatch(max_num_reqs=16, vocab_size=VOCAB, device="cpu",
                    logitsprocs=build_logitsprocs(None, "cpu", include_entry_points=False))
    outputs: dict[str, list[int]] = {}
    params: dict[str, SamplingParams] = {}
    sampler = Sampler()
    for step in range(steps):
        for req_id, p in schedule.get(step, []):
            outputs[req_id], params[req_id] = [], p
            ib.add_request(req_id, p, [2, 0], outputs[req_id])
        if preempt and step in preempt:
            victim = preempt[step]
            ib.remove_request(victim)
            ib.condense()
            ib.refresh_metadata()  # a step runs without it
            ib.add_request(victim, params[victim], [2, 0], outputs[victim])
        ib.condense()
        if step in swap_at and ib.num_reqs >= 2:
            ib.swap_states(0, ib.num_reqs - 1)
        md = ib.refresh_metadata()
        logits = torch.stack([_logits_for(r, len(outputs[r])) for r in ib.req_ids])
        out = sampler(logits, md)
        for req_id, token in zip(ib.req_ids, out.sampled_token_ids[:, 0].tolist()):
            outputs[req_id].append(token)
    return outputs


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = _run({0: [("s", SEEDED)]})["s"]
    crowded = _run({
        0: [("a", SamplingParams()), ("b", SamplingParams(temperature=0.0)), ("s", SEEDED)],
        2: [("c", SamplingParams(seed=9, top_k=3)), ("d", SamplingParams(min_p=0.2))],
    }, swap_at={1, 3, 5})["s"]
    late_neighbours = _run({0: [("x", SamplingParams(seed=5)), ("s", SEEDED)],
                            1: [("y", SamplingParams(repetition_penalty=1.5))]})["s"]
    assert len(alone) == STEPS
    assert crowded == alone
    assert late_neighbours == alone


def test_different_seed_different_tokens() -> None:
    # Guards the test above: the tokens do depend on the seed.
    a = _run({0: [("s", SEEDED)]})["s"]
    other = SamplingParams(seed=4321, temperature=1.0, top_p=0.95, max_tokens=64)
    assert _run({0: [("s", other)]})["s"] != a


def test_preempted_sequence_continues_its_seeded_stream() -> None:
    plain = _run({0: [("s", SEEDED), ("a", SamplingParams())]})["s"]
    preempted = _run({0: [("s", SEEDED), ("a", SamplingParams())]}, preempt={4: "s"})["s"]
    # Re-added with 4 tokens done, its generator is fast-forwarded past 4 draws.
    assert preempted == plain


def test_n_greater_than_one_derives_distinct_seeds() -> None:
    assert derive_seed(10, 0) == 10 and derive_seed(10, 3) == 13 and derive_seed(None, 2) is None
    ib = InputBatch(max_num_reqs=4, vocab_size=VOCAB, device="cpu")
    outs = [[], []]
    for i in range(2):
        ib.add_request(f"seq{i}", SEEDED, [2, 0], outs[i], seed_index=i)
    md = ib.refresh_metadata()
    first = [g.initial_seed() for g in (md.generators[0], md.generators[1])]
    assert first == [1234, 1235]
    logits = torch.zeros(2, VOCAB)  # same logits: only the seeds differ
    tokens = [Sampler()(logits.clone(), md).sampled_token_ids[:, 0].tolist() for _ in range(6)]
    assert any(a != b for a, b in tokens)


def test_unseeded_rows_use_the_global_generator() -> None:
    ib = InputBatch(max_num_reqs=4, vocab_size=VOCAB, device="cpu")
    ib.add_request("r", SamplingParams(), [2, 0], [])
    md = ib.refresh_metadata()
    assert md.generators == {}
    torch.manual_seed(0)
    a = Sampler()(torch.zeros(1, VOCAB), md).sampled_token_ids
    torch.manual_seed(0)
    b = Sampler()(torch.zeros(1, VOCAB), md).sampled_token_ids
    assert torch.equal(a, b)
