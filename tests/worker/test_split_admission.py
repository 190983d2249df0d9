"""A CPU step that admits requests beside decoding ones runs in two parts: the
prefills op by op, then the decode rows (and their drafts) as the one C call
of a decode-only step (``EncoderDecoderModelRunner._splits``). Under
continuous admission (``max_num_seqs`` below the number of requests) nearly
every step is such a step. The split changes no token: greedy stays HF's,
speculation stays equal to no speculation, and every block comes back."""
from __future__ import annotations

import pytest

from encdec import LLM, SamplingParams
from encdec.kernels.cpu import decoder_step_cpu
from encdec.worker.enc_dec_model_runner import EncoderDecoderModelRunner
from tests.models.test_bart_parity import hf_greedy, mixed_prompts

pytestmark = pytest.mark.skipif(not decoder_step_cpu.available(), reason="no C build of the fused decode step")


@pytest.fixture
def split_steps(monkeypatch):
    """Counts two-part steps, and fused decode steps while one runs."""
    seen = {"split": 0, "fused_in_split": 0, "mixed": []}  # mixed: (decode rows, split) per step admitting
    real_splits, real_step = EncoderDecoderModelRunner._splits, decoder_step_cpu.decode_step
    state = {"in": False}

    def splits(self, metas, n, drafts):
        out = real_splits(self, metas, n, drafts)
        if 0 < n < len(metas):
            seen["mixed"].append((sum(len(m.seq_data) for m in metas[n:]) + sum(map(len, (drafts or {}).values())),
                                  out))
        seen["split"] += out
        state["in"] = out
        return out

    def step(*a, **k):
        out = real_step(*a, **k)
        seen["fused_in_split"] += bool(state["in"] and out is not None)
        return out

    monkeypatch.setattr(EncoderDecoderModelRunner, "_splits", splits)
    monkeypatch.setattr(decoder_step_cpu, "decode_step", step)
    return seen


def _free(llm: LLM) -> bool:
    free_gpu, _ = llm.llm_engine.num_free_blocks()
    return free_gpu == llm.llm_engine.cache_config.num_gpu_blocks


def _continuous_run_matches_hf(tiny_bart: str, hf_bart, seed: int) -> LLM:
    """14 parity prompts, at most 3 running: every output HF's greedy one."""
    llm = LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=3)
    prompts, max_tokens = mixed_prompts(llm.get_tokenizer(), n=14, seed=seed)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens],
                        use_tqdm=False)
    for out, m in zip(outs, max_tokens):
        ref = hf_greedy(hf_bart, out.encoder_prompt_token_ids, out.prompt_token_ids, m)
        assert out.outputs[0].token_ids == ref, f"request {out.request_id}"
    return llm


def test_continuous_admission_matches_hf(tiny_bart, hf_bart, split_steps):
    llm = _continuous_run_matches_hf(tiny_bart, hf_bart, seed=3)
    assert split_steps["split"] >= 5 and split_steps["fused_in_split"] == split_steps["split"]
    assert _free(llm)


def test_a_step_past_the_fused_rows_runs_as_one(tiny_bart, split_steps, monkeypatch):
    monkeypatch.setattr(decoder_step_cpu, "MAX_ROWS", 2)  # 3 running rows: more than the step takes
    llm = LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=4)
    prompts, max_tokens = mixed_prompts(llm.get_tokenizer(), n=10, seed=4)
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    mixed = split_steps["mixed"]
    assert any(rows > 2 for rows, _ in mixed), "no step past the fused rows: the test proves nothing"
    assert all(split == (rows <= 2) for rows, split in mixed)
    assert _free(llm)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int8"},
], ids=["ngram", "int8-self-draft"])
def test_drafts_ride_the_decode_part(tiny_bart, split_steps, spec):
    spec = dict(spec, model=tiny_bart) if spec["method"] == "draft_model" else spec
    plain = LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=3)
    spec_llm = LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=3, speculative_config=spec)
    prompts, max_tokens = mixed_prompts(plain.get_tokenizer(), n=12, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    split_steps["split"] = 0
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert split_steps["split"] >= 3
    stats = spec_llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert _free(spec_llm)


@pytest.fixture
def admitted_steps(monkeypatch):
    """Per step whose prefills rode the C call: op-by-op decoder layer passes in it
    (must be none) and whether the C call ran."""
    from encdec.models.bart import BartDecoderLayer

    seen = {"admitted": 0, "layers_in_admitted": 0, "fused_in_admitted": 0, "layers": 0}
    real_layer, real_forward, real_step = BartDecoderLayer.forward, EncoderDecoderModelRunner._forward, \
        decoder_step_cpu.decode_step

    def layer(self, *a, **k):
        seen["layers"] += 1
        return real_layer(self, *a, **k)

    def forward(self, plan):
        before, fused = seen["layers"], seen["fused_in_admitted"]
        out = real_forward(self, plan)
        if plan.admitted:
            seen["admitted"] += 1
            seen["layers_in_admitted"] += seen["layers"] - before
            assert seen["fused_in_admitted"] == fused + 1, "an admitted step's rows did not run as one C call"
        return out

    def step(*a, **k):
        out = real_step(*a, **k)
        seen["fused_in_admitted"] += out is not None
        return out

    monkeypatch.setattr(BartDecoderLayer, "forward", layer)
    monkeypatch.setattr(EncoderDecoderModelRunner, "_forward", forward)
    monkeypatch.setattr(decoder_step_cpu, "decode_step", step)
    return seen


def test_short_prompts_ride_the_c_call(tiny_bart, hf_bart, admitted_steps):
    """BART's default decoder prompt (decoder start, bos) and short explicit ones
    (longer ones mixed in, which keep their step op by op): the admitted steps
    run no decoder layer op by op, outputs stay HF's, every block comes back."""
    llm = _continuous_run_matches_hf(tiny_bart, hf_bart, seed=7)
    assert admitted_steps["admitted"] >= 3, "no step admitted its prefills as decode rows: the test proves nothing"
    assert admitted_steps["layers_in_admitted"] == 0
    assert _free(llm)


def test_prompt_logprobs_keep_a_prefill_op_by_op(tiny_bart, admitted_steps):
    """A prefill asking for its prompt's log-probs needs its rows' hidden states:
    its step runs its prefills op by op, and its answer equals a lone run's."""
    from encdec import TokensPrompt

    llm = LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=2)
    prompts = [TokensPrompt(prompt_token_ids=[5 + i, 9, 11 + i, 7]) for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, prompt_logprobs=1 if i == 3 else None)
              for i in range(5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    alone = LLM(tiny_bart, kv_cache_memory=64 << 20, swap_space=0.05).generate(prompts[3], params[3],
                                                                                use_tqdm=False)[0]
    assert outs[3].prompt_logprobs is not None and outs[3].prompt_logprobs == alone.prompt_logprobs
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids
    assert admitted_steps["admitted"] >= 1 and admitted_steps["layers_in_admitted"] == 0
    assert admitted_steps["layers"] > 0  # the prompt_logprobs prefill's step ran op by op
    assert _free(llm)


def _t5_workload(llm: LLM, n: int) -> tuple[list, list]:
    from tests.models.seq2seq_parity import mixed_prompts as family_prompts

    tok = llm.get_tokenizer()
    prompts = family_prompts(tok, seed=0, token_range=(3, len(tok)), decoder_prompts=[[0], [0, 300, 41], [17, 230]],
                             n=n)
    return prompts, [SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 5)) for i in range(n)]


@pytest.mark.parametrize("family", ["m2m100", "nllb", "mbart-50", "t5"])
def test_admitted_prefills_equal_op_by_op_per_family(family, tmp_path, monkeypatch, admitted_steps):
    """Every family whose decode steps run the C call (Marian's activation does
    not), on its parity prompts (explicit decoder prompts, M2M100's with a
    <pad> inside, which runs op by op; beams and n=2 sampling mixed in) under
    continuous admission: the same tokens as with every prefill op by op (which
    the parity tests hold to HF)."""
    from encdec import testing
    from encdec.worker import enc_dec_model_runner
    from tests.core.test_budgets_families import _build, family_workload

    t5 = family == "t5"
    path = (testing.make_random_t5(str(tmp_path), style="t5", seed=0, d_kv=16, init_factor=1.5)
            if t5 else _build(family, str(tmp_path)))
    llm = LLM(path, device="cpu", kv_cache_memory=64 << 20, swap_space=0.05, max_num_seqs=3)
    prompts, params = _t5_workload(llm, 20) if t5 else family_workload(llm, family, n=30)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert admitted_steps["admitted"] >= 1, "no step admitted its prefills as decode rows: the test proves nothing"
    monkeypatch.setattr(enc_dec_model_runner, "admits_as_decodes", lambda *a: False)
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert _free(llm)
