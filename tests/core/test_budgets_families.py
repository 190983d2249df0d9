"""The step budgets on the families BART / T5 / Whisper tests do not cover:
Marian, M2M100, NLLB and mBART (both language layouts). Each family's parity
prompts (``tests.models.seq2seq_parity.mixed_prompts``: mixed-length encoder
inputs, the family's decoder prompts, plus long explicit decoder prompts that
chunk), with greedy rows under the checkpoint's defaults (forced tokens, bad
words), beam search and seeded ``n > 1`` mixed in, ``max_num_seqs`` small so
that requests are admitted while others decode. Under
``enable_chunked_prefill`` with budgets that end chunks mid-block (21, block 16)
and of one token, and under a small ``max_num_encoder_input_tokens``, every
request's outputs are token for token the unbudgeted engine's, and every block
is free at the end."""
from __future__ import annotations

import random

import pytest

from encdec import LLM, SamplingParams
from encdec.beam_search.defaults import with_overrides
from encdec.sampling_params import BeamSearchParams
from encdec.testing import M2M100_LANGS, MBART_LANGS, NLLB_LANGS
from tests.models.seq2seq_parity import mixed_prompts

LONG = 40  # tokens of a long explicit decoder prompt's tail: chunks under budgets of 21 and 1


def _build(family: str, out_dir: str) -> str:
    from encdec import testing

    if family == "marian":
        return testing.make_random_marian(out_dir, seed=0)
    if family == "m2m100":
        return testing.make_random_m2m100(out_dir, seed=0)
    if family == "nllb":
        return testing.make_random_nllb(out_dir, seed=2)
    return testing.make_random_mbart(out_dir, seed=0, style=family)


def _decoder_starts(family: str, tok) -> tuple[tuple[int, int], list[list[int]]]:
    """The family's raw encoder id range and explicit decoder prompts, as its parity test has them."""
    if family == "marian":
        pad = tok.pad_token_id
        return (2, pad), [[pad], [pad, 300, 41], [17, 230]]
    if family == "m2m100":
        fr, de = tok.convert_tokens_to_ids([M2M100_LANGS[1], M2M100_LANGS[2]])
        return (1, tok.convert_tokens_to_ids(M2M100_LANGS[0])), [[2, fr], [2, de, 1, 300], [2, fr, 57]]
    if family == "nllb":
        fra = tok.convert_tokens_to_ids(NLLB_LANGS[1])
        return (4, tok.convert_tokens_to_ids(NLLB_LANGS[0])), [[2, fra], [2]]
    ro, de = tok.convert_tokens_to_ids(["ro_RO", "de_DE"])
    starts = [[2, de], [2, ro, 500]] if family == "mbart-50" else [[de], [ro, 500]]
    return (4, tok.convert_tokens_to_ids(MBART_LANGS[0])), starts


def family_workload(llm: LLM, family: str, *, seed: int = 0, n: int = 20) -> tuple[list, list]:
    """``n`` parity prompts (every other one with an explicit decoder prompt,
    some of them long) and their params: greedy under the checkpoint's defaults,
    every fifth beam search (3 beams, 2 returned), every fifth ``n=2`` sampling."""
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    (lo, hi), starts = _decoder_starts(family, tok)
    longs = [starts[i % len(starts)] + [rng.randrange(lo, hi) for _ in range(LONG + 7 * i)] for i in range(2)]
    prompts = mixed_prompts(tok, seed=seed, token_range=(lo, hi), decoder_prompts=longs + starts, n=n)
    defaults = llm.get_default_sampling_params()
    params = []
    for i in range(n):
        if i % 5 == 3:
            params.append(BeamSearchParams(3, 8, num_return_sequences=2))
        elif i % 5 == 4:
            params.append(SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=8))
        else:
            params.append(with_overrides(defaults, beam_width=1, max_tokens=rng.randint(4, 16), min_tokens=0))
    return prompts, params


def engine(path: str, **budgets) -> LLM:
    return LLM(path, device="cpu", kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=6, **budgets)


def outputs(llm: LLM, prompts: list, params: list) -> tuple[list, int]:
    """Every request's outputs' token ids and the steps taken; asserts every
    block (device and swap) is free at the end."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.llm_engine
    bm = eng.scheduler.block_manager
    assert eng.num_free_blocks() == (bm.num_total_gpu_blocks, bm.num_total_cpu_blocks)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], eng.scheduler.num_steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(family)``: the family's tiny random checkpoint, built once per module."""
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = _build(family, str(tmp_path_factory.mktemp(family)))
        return built[family]

    return get


@pytest.mark.parametrize("family", ["marian", "m2m100", "nllb", "mbart-50", "cc25"])
def test_chunked_prefill_and_encoder_budget_equal_plain(family, checkpoint):
    path = checkpoint(family)
    llm = engine(path)
    prompts, params = family_workload(llm, family)
    plain, plain_steps = outputs(llm, prompts, params)
    assert sum(len(c) for o in plain for c in o) > 4 * len(prompts)  # outputs long enough to differ
    chunked, steps = outputs(engine(path, enable_chunked_prefill=True, max_num_batched_tokens=21), prompts, params)
    assert chunked == plain
    assert steps > plain_steps  # the long prompts were split
    # most encoder inputs are over 16 tokens: each runs alone in its step (or in pieces)
    budgeted, _ = outputs(engine(path, max_num_encoder_input_tokens=16), prompts, params)
    assert budgeted == plain


@pytest.mark.parametrize("family", ["marian", "m2m100", "mbart-50"])
def test_one_token_chunks_equal_plain(family, checkpoint):
    """A budget of one token: a long prompt takes a step per token beside the
    others' decode rows."""
    path = checkpoint(family)
    llm = engine(path)
    prompts, params = family_workload(llm, family, seed=1, n=6)
    plain, _ = outputs(llm, prompts, params)
    got, steps = outputs(engine(path, enable_chunked_prefill=True, max_num_batched_tokens=1), prompts, params)
    assert got == plain
    assert steps > LONG
