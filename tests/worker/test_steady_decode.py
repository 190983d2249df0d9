"""A decode step with the same rows as the step before is packed from that
step's inputs (``SteadyDecode``): the packed step must equal what ``prepare``
packs row by row, and whole runs must give the tokens they give without it."""
from __future__ import annotations

import copy

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from encdec.worker.steady_decode import PaddedTables, SteadyDecode


@pytest.fixture(scope="module")
def llm(tiny_bart):
    return LLM(tiny_bart, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=16)


def _prompts(n: int) -> list[TokensPrompt]:
    return [TokensPrompt(prompt_token_ids=[5 + (i * 7 + j) % 40 for j in range(3 + i % 11)]) for i in range(n)]


def _slow_twin(runner):
    """The runner as it would pack a step with no memory of the last one."""
    twin = copy.copy(runner)
    twin._steady = SteadyDecode(runner.backend, runner.block_size, runner._steady.host_slots_max)
    twin._self_tables, twin._cross_tables = PaddedTables(), PaddedTables()
    return twin


def _trim(t: torch.Tensor, lens) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(t, lens)]


@pytest.mark.parametrize("rows", [5, 12], ids=["host-slots", "tensor-slots"])
def test_steady_step_packs_what_prepare_packs(llm, rows, monkeypatch):
    runner = llm.llm_engine.worker.model_runner
    monkeypatch.setattr(runner._steady, "host_slots_max", 8)  # 12 rows: the tensor slot path
    real = runner.prepare
    checked = []

    def prepare(metas, moved=True, ahead=(), same_rows=False):
        got = real(metas, moved, ahead, same_rows)
        if same_rows and got.owed == [] and not any(m.is_prompt for m in metas):
            want = _slow_twin(runner).prepare(metas, moved, ahead, False)
            a, b = got.attn_metadata, want.attn_metadata
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.positions, want.positions)
            assert torch.equal(a.slot_mapping, b.slot_mapping)
            assert a.seq_lens == b.seq_lens and torch.equal(a.seq_lens_tensor, b.seq_lens_tensor)
            assert torch.equal(a.context_lens_tensor, b.context_lens_tensor)
            assert a.max_decode_seq_len == b.max_decode_seq_len and a.num_decode_tokens == b.num_decode_tokens
            lens = [len(t) for t in b.block_tables_list]
            assert _trim(a.block_tables, lens) == _trim(b.block_tables, lens)
            assert [(r.seq_id, r.hidden_index) for r in got.sampled_rows] == \
                [(r.seq_id, r.hidden_index) for r in want.sampled_rows]
            checked.append(len(metas))
        return got

    monkeypatch.setattr(runner, "prepare", prepare)
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * (i % 5), min_tokens=4) for i in range(rows)]
    llm.generate(_prompts(rows), params, use_tqdm=False)
    assert len(checked) > 10 and max(checked) == rows


def test_tokens_equal_with_and_without_the_short_paths(llm, monkeypatch):
    """A mixed batch (stop ids, eos, min_tokens, n > 1, logprobs, seeded
    sampling, a beam search) run with the steady-step paths and without."""
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=20 + i, min_tokens=i % 3,
                             stop_token_ids=[17] if i % 4 == 1 else None,
                             logprobs=2 if i == 3 else None,
                             n=2 if i == 5 else 1, seed=i, ignore_eos=i == 7)
              for i in range(10)]
    params[6] = SamplingParams(temperature=0.8, seed=11, max_tokens=25)

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=12))
        return ([[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs],
                [[b.tokens for b in o.sequences] for o in beams])

    fast = run()
    engine = llm.llm_engine
    monkeypatch.setattr(engine.worker.model_runner._steady, "advance", lambda *a, **k: None)
    monkeypatch.setattr(engine.scheduler._room, "due", lambda *a, **k: None)
    monkeypatch.setattr(engine.scheduler.stop_checker, "quick_rule", lambda *a, **k: None)
    engine.scheduler._stop_rules.clear()
    assert run() == fast
