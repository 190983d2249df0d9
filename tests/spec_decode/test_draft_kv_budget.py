"""A CPU self-draft's bfloat16 copy of its rows' K/V (``DraftKV``) is inside
``kv_cache_memory``: the target's cache and the copy's cap together never
exceed it (the copy gets a third, ``copy_budget``), greedy output is what it
is without speculation, and a budget too small for a request and its copy is
a ``ValueError`` naming ``kv_cache_memory``."""
from __future__ import annotations

import pytest

from encdec import LLM, SamplingParams
from encdec.block_manager.capacity import longest_request_blocks
from encdec.worker import draft_model
from encdec.worker.draft_kv import DraftKV
from tests.spec_decode.test_engine_spec import _prompts

BUDGET = 16 << 20
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def bart(tmp_path_factory) -> str:
    from encdec.testing import make_random_bart

    return make_random_bart(str(tmp_path_factory.mktemp("bart")), seed=1)


def _self_draft(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "quantization": "int8"}


def _cache_bytes(llm: LLM) -> int:
    """Bytes of the target's device cache tensors."""
    return sum(t.nbytes for t in llm.llm_engine.worker.cache_engine.gpu_cache)


@pytest.fixture()
def copies(monkeypatch) -> list[tuple[int, DraftKV]]:
    """Each ``DraftKV`` the engine builds, with the cap it was given."""
    made = []

    class Recorded(DraftKV):
        def __init__(self, target_caches, block_size, max_bytes):
            super().__init__(target_caches, block_size, max_bytes)
            made.append((max_bytes, self))

    monkeypatch.setattr(draft_model, "DraftKV", Recorded)
    return made


def test_the_target_cache_and_the_copy_fit_kv_cache_memory(bart, copies):
    prompts, params = _prompts(12, seed=3), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = LLM(bart, kv_cache_memory=BUDGET).generate(prompts, params, use_tqdm=False)
    llm = LLM(bart, kv_cache_memory=BUDGET, speculative_config=_self_draft(bart))
    cfg = llm.llm_engine.cache_config
    ((cap, copy),) = copies
    assert cap == cfg.draft_kv_bytes == BUDGET // 3
    assert _cache_bytes(llm) + cap <= BUDGET < _cache_bytes(llm) + cap + _cache_bytes(llm) // cfg.num_gpu_blocks
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
    assert copy.caches and sum(c.nbytes for c in copy.caches) <= cap  # the drafts read the copy, within its cap


def test_a_default_cpu_cache_keeps_its_blocks_and_holds_the_copy(bart, copies):
    """Without ``kv_cache_memory`` the CPU budget is sized for both: the target
    gets the blocks it gets without a draft, the copy a third of the whole."""
    alone = LLM(bart, max_num_seqs=8).llm_engine.cache_config.num_gpu_blocks
    cfg = LLM(bart, max_num_seqs=8, speculative_config=_self_draft(bart)).llm_engine.cache_config
    ((cap, _),) = copies
    assert cfg.num_gpu_blocks == alone and cap == cfg.draft_kv_bytes > 0


def test_a_budget_too_small_for_a_request_and_its_copy_names_kv_cache_memory(bart, copies):
    """1.2 times one longest request's blocks: enough without a draft, not once
    a third goes to the copy."""
    probe = LLM(bart, kv_cache_memory=BUDGET, max_model_len=MAX_MODEL_LEN)
    mc, cfg = probe.llm_engine.model_config, probe.llm_engine.cache_config
    block_bytes = _cache_bytes(probe) // cfg.num_gpu_blocks
    dec, cross, _ = longest_request_blocks(mc.max_model_len, mc.max_encoder_len, cfg.block_size, 0)
    budget = (dec + cross) * block_bytes * 6 // 5
    LLM(bart, kv_cache_memory=budget, max_model_len=MAX_MODEL_LEN)  # the target alone fits
    with pytest.raises(ValueError, match=r"self-draft's bfloat16 K/V copy.*raise kv_cache_memory"):
        LLM(bart, kv_cache_memory=budget, max_model_len=MAX_MODEL_LEN, speculative_config=_self_draft(bart))
    assert not copies  # refused before any proposer was built
