"""Speculating requests that ask log-probs: each kept token reports what the
sampler reports for it without speculation (its log-prob and rank, the top
``N``, raw or processed), scored at its own query row of the verifying step.

Tolerance: the values are computed from the same weights at the same positions,
but a position scored among several query rows of its sequence goes through
the multi-row attention path (other summation order, other kernels), so the
hidden states differ by float32 rounding (~1e-6 relative); log-softmax over
the vocabulary carries that to ~1e-5 absolute. ``atol=1e-4`` bounds it with
room, and is far below any difference a wrong row or a wrong prefix makes
(those move log-probs by whole units on these models)."""
from __future__ import annotations


import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.testing import make_random_bart
from tests.spec_decode.test_engine_spec import _prompts, _spec

ATOL = 1e-4


def _all_free(llm: LLM) -> bool:
    free, _ = llm.llm_engine.num_free_blocks()
    return free == llm.llm_engine.cache_config.num_gpu_blocks


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    return make_random_bart(str(tmp_path_factory.mktemp("bart")), seed=1)


def _params(n: int) -> list[SamplingParams]:
    """Greedy requests asking 0, 1 and 5 log-probs, raw and processed, one
    beside them asking none, and one with a logit bias (processed log-probs
    differ from raw ones there; a processor acts on it: it runs unspeculated)."""
    out = []
    for i in range(n):
        mode = "processed_logprobs" if i % 2 else "raw_logprobs"
        out.append(SamplingParams(temperature=0, max_tokens=30 + i % 5, logprobs=(0, 1, 5, None)[i % 4],
                                  logprobs_mode=mode))
    out[3] = SamplingParams(temperature=0, max_tokens=20, logprobs=2, logit_bias={50: 3.0},
                            logprobs_mode="processed_logprobs")
    return out


def _compare(want, got) -> None:
    """Same tokens, the same top-N ids in order, log-probs and ranks, cumulative log-prob."""
    for w, g in zip(want, got):
        cw, cg = w.outputs[0], g.outputs[0]
        assert list(cg.token_ids) == list(cw.token_ids)
        if cw.logprobs is None:
            assert cg.logprobs is None
            continue
        assert len(cg.logprobs) == len(cw.logprobs) == len(cw.token_ids)
        for tok, dw, dg in zip(cw.token_ids, cw.logprobs, cg.logprobs):
            assert list(dg) == list(dw)  # the sampled token first, then the top N, same order
            for t in dw:
                assert dg[t].rank == dw[t].rank
                assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=ATOL)
        assert cg.cumulative_logprob == pytest.approx(cw.cumulative_logprob, abs=ATOL * len(cw.token_ids))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_logprobs_match_speculation_off(bart_dir, k):
    prompts, params = _prompts(12), _params(12)
    kw = dict(kv_cache_memory=16 << 20, enable_encoder_cache=False)
    want = LLM(bart_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(bart_dir, **kw, speculative_config=_spec(k))
    got = llm.generate(prompts, params, use_tqdm=False)
    _compare(want, got)
    asking = [o for o, p in zip(got, params) if p.logprobs is not None and not p.logit_bias]
    assert all(o.metrics.spec_decode_off is None for o in asking)
    # the tokens reported above include kept drafts, not only first rows
    assert sum(o.metrics.spec_decode_accepted_tokens for o in asking) > 10
    assert got[3].metrics.spec_decode_accepted_tokens == 0
    assert _all_free(llm)


def test_logprobs_of_kept_drafts_are_their_positions_rows(bart_dir, monkeypatch):
    """A drafted position reports its own row: a mutation that reports the
    first row's log-probs for every kept token fails the comparison."""
    from encdec.sample import draft_logprobs as mod

    real = mod.draft_logprobs

    def first_row_only(drafts, batch_row, logits, draft_logits, md):
        out = real(drafts, batch_row, logits, draft_logits, md)
        if out is not None:
            for sid, _, d in drafts:
                s = out.start[sid]
                out.logprobs[s + 1:s + 1 + len(d)] = out.logprobs[s]
        return out

    prompts, params = _prompts(6, seed=2), [SamplingParams(temperature=0, max_tokens=30, logprobs=1)] * 6
    kw = dict(kv_cache_memory=16 << 20, enable_encoder_cache=False)
    want = LLM(bart_dir, **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr("encdec.worker.enc_dec_model_runner.draft_logprobs", first_row_only)
    llm = LLM(bart_dir, **kw, speculative_config=_spec(3))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.spec_decode_accepted_tokens for o in got) > 0
    with pytest.raises(AssertionError):
        _compare(want, got)


def test_sampled_rows_report_the_targets_logprobs_of_kept_tokens(tmp_path):
    """Rejection sampling keeps tokens of the target's distribution; each
    reports the target's log-prob of that token at its position (raw: the
    model's; checked by scoring the whole output again, greedily forced, in a
    run without speculation: prompt log-probs of the decoder prompt)."""
    path = make_random_bart(str(tmp_path), seed=3, d_model=32, layers=1, heads=2, ffn=64, init_std=1.0)
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 5, 6, 7, 8, 5, 6])
    params = SamplingParams(temperature=0.3, max_tokens=10, ignore_eos=True, logprobs=3)
    llm = LLM(path, kv_cache_memory=16 << 20, speculative_config=_spec(3), seed=11)
    outs = llm.generate([prompt] * 40, params, use_tqdm=False)
    assert sum(o.metrics.spec_decode_accepted_tokens for o in outs) > 20
    assert all(o.metrics.spec_decode_off is None for o in outs)
    ref = LLM(path, kv_cache_memory=16 << 20)
    from encdec.inputs import ExplicitEncoderDecoderPrompt

    for o in outs[:10]:
        c = o.outputs[0]
        dec = list(o.prompt_token_ids) + list(c.token_ids)
        scored = ref.generate([ExplicitEncoderDecoderPrompt(encoder_prompt=prompt,
                                                            decoder_prompt=TokensPrompt(prompt_token_ids=dec))],
                              SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
        n = len(o.prompt_token_ids)
        for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
            want = scored.prompt_logprobs[n + i]
            assert d[tok].logprob == pytest.approx(want[tok].logprob, abs=ATOL)
            assert d[tok].rank == want[tok].rank
            top = [t for t in d if d[t].rank <= 3]
            assert sorted(top) == sorted(t for t in want if want[t].rank <= 3)
        total = sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_processed_logprobs_of_draft_rows_see_processors_per_position():
    """``apply_at``'s default is a processor's row-independent part; the
    processed rows of ``draft_logprobs`` go through it."""
    from types import SimpleNamespace

    from encdec.sample.draft_logprobs import draft_logprobs
    from encdec.sample.logits_processor import LogitsProcessor
    from encdec.sample.logits_processor.state import LogitsProcessors

    class Ban(LogitsProcessor):  # bans token 1 everywhere; token 2 after a 7 was appended
        def __init__(self, *a):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits

        def apply_at(self, logits, slots, ahead):
            logits[:, 1] = float("-inf")
            for i, a in enumerate(ahead):
                if a and a[-1] == 7:
                    logits[i, 2] = float("-inf")

    procs = LogitsProcessors()
    procs.add(Ban())
    logits = torch.zeros(2, 5)  # rows: seq 10 (row 0), seq 11 (row 1)
    draft_logits = torch.zeros(2, 5)  # seq 10's two drafts [7, 3]
    md = SimpleNamespace(max_num_logprobs=1, processed_logprobs_rows=torch.tensor([0]), logitsprocs=procs)
    out = draft_logprobs([(10, 2, [7, 3])], {10: 0, 11: 1}, logits, draft_logits, md)
    lp = out.logprobs
    assert out.start == {10: 0} and lp.shape == (3, 5)
    assert torch.isinf(lp[:, 1]).all()
    assert torch.isinf(lp[1, 2]) and not torch.isinf(lp[0, 2]) and not torch.isinf(lp[2, 2])
    owners, t = out.gather({10: [0, 4]})
    assert owners == [10, 10] and t.logprob_token_ids[:, 0].tolist() == [0, 4]
    assert t.logprobs[0, 0].item() == pytest.approx(-torch.log(torch.tensor(4.0)).item())
    assert t.logprobs[1, 0].item() == pytest.approx(-torch.log(torch.tensor(3.0)).item())


def test_copy_model_logprobs_with_most_tokens_from_drafts():
    """The trained copy model (``benchmarks.train_copy_model``; skipped where it
    was not trained on this machine): most tokens come from kept drafts, and
    every one reports the log-probs of the run without speculation."""
    import os

    from benchmarks.spec_bench import DEFAULT_MODEL_DIR
    from encdec.bench.copy_model import held_out, read_manifest, source_ids, task_from_manifest

    manifest = read_manifest(DEFAULT_MODEL_DIR) if os.path.isdir(DEFAULT_MODEL_DIR) else None
    if manifest is None:
        pytest.skip(f"no copy model in {DEFAULT_MODEL_DIR} (python -m benchmarks.train_copy_model)")
    task = task_from_manifest(manifest)
    docs = held_out(task, 16, manifest["options"]["seed"])
    prompts = [TokensPrompt(prompt_token_ids=source_ids(d)) for d, _ in docs]
    params = [SamplingParams(temperature=0, max_tokens=task.max_summary_len(), logprobs=2,
                             logprobs_mode=("raw_logprobs", "processed_logprobs")[i % 2]) for i in range(16)]
    kw = dict(kv_cache_memory=64 << 20, enable_encoder_cache=False)
    want = LLM(DEFAULT_MODEL_DIR, **kw).generate(prompts, params, use_tqdm=False)
    got = LLM(DEFAULT_MODEL_DIR, **kw, speculative_config=_spec(3)).generate(prompts, params, use_tqdm=False)
    _compare(want, got)
    tokens = sum(len(o.outputs[0].token_ids) for o in got)
    assert sum(o.metrics.spec_decode_accepted_tokens for o in got) > tokens / 2
