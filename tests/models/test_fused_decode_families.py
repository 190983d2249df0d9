"""The pre-norm BART families (mBART: GELU; M2M100 and NLLB: ReLU) have Whisper's
decoder layer, T5's (ReLU, RMSNorm, no biases, a position bias) is the same
with those changes, and BART's (GELU) the same with each norm after its
residual add, so their decode-only CPU steps run every layer in one C call
(``decoder_step_cpu``): the same tokens and log-probabilities as op by op, for
each ISA build this CPU runs. Marian's SiLU FFN and T5 v1.1's gated FFN run op
by op."""
from __future__ import annotations

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.kernels.cpu import build, decoder_step_cpu
from encdec.testing import make_random_bart, make_random_marian, make_random_mbart, make_random_m2m100, make_random_t5


def _t5(path: str, seed: int) -> str:
    # 4 heads x 16 = d_model, the kernel's shape; at 1.5x T5's init (5x amplifies float32 rounding)
    return make_random_t5(path, seed=seed, d_kv=16, init_factor=1.5)


FUSED = {"m2m100": (make_random_m2m100, "relu"), "mbart": (make_random_mbart, "gelu"), "t5": (_t5, "relu"),
         "bart": (make_random_bart, "gelu")}


@pytest.fixture(scope="module", params=sorted(FUSED))
def family(request, tmp_path_factory):
    make, activation = FUSED[request.param]
    path = make(str(tmp_path_factory.mktemp(request.param)), seed=1)
    return request.param, activation, LLM(path, kv_cache_memory=32 << 20, enable_encoder_cache=False)


def _run(llm: LLM, fused: bool) -> list[tuple[list[int], list[float]]]:
    llm.llm_engine.worker.model.fused_decode = fused
    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(4, 900, (int(n),), generator=g).tolist())
               for n in torch.randint(3, 40, (9,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
def test_families_decode_in_one_call(family, isa, monkeypatch):
    name, activation, llm = family
    monkeypatch.setenv(build.ISA_ENV, isa)
    assert decoder_step_cpu.path(isa) == isa
    model = llm.llm_engine.worker.model
    assert model.fused_activation == activation
    assert model.fused_post_norm == (name == "bart")
    ran = []
    real = decoder_step_cpu.decode_step
    monkeypatch.setattr(decoder_step_cpu, "decode_step", lambda *a, **k: (out := real(*a, **k), ran.append(
        out is not None))[0])
    fused = _run(llm, True)
    assert ran and all(ran), f"{name}: the fused step did not run ({ran[:5]})"
    ran.clear()
    by_op = _run(llm, False)
    assert not ran
    for (toks_f, lp_f), (toks_o, lp_o) in zip(fused, by_op):
        assert toks_f == toks_o, name
        # float32 rounding differs between the paths (random weights at init_std 0.5
        # make large activations): seen up to 1.1e-4 on logprobs near -0.9
        torch.testing.assert_close(torch.tensor(lp_f), torch.tensor(lp_o), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("make", [make_random_marian, lambda p: make_random_t5(p, style="t5-v1.1", d_kv=16)])
def test_silu_marian_and_gated_t5_run_op_by_op(make, tmp_path):
    model = LLM(make(str(tmp_path / "m")), kv_cache_memory=16 << 20).llm_engine.worker.model
    assert model.fused_decode is False


def test_t5_with_heads_narrower_than_d_model_runs_op_by_op(tmp_path):
    """flan-t5-small's shape (heads x d_kv != d_model): the kernel declines it."""
    llm = LLM(make_random_t5(str(tmp_path / "m"), d_kv=12), kv_cache_memory=16 << 20)
    model = llm.llm_engine.worker.model
    assert model.fused_decode is True
    assert _run(llm, True) and model._fused_checked and model._fused_weights is None


@pytest.mark.parametrize("make", [make_random_m2m100, make_random_bart])  # pre-norm, post-norm
@pytest.mark.parametrize("isa", build.host_isas())
def test_int8_decoder_steps_run_int8_in_one_call(tmp_path, monkeypatch, isa, make):
    """quantization="int8" where the kernels' ISA has VNNI: the fused step runs the
    decoder's int8 weights (small_linear_int8_cpu), with the same tokens as the
    int8 layers op by op (the same int8 products; float32 rounding of the scales differs)."""
    from encdec.kernels.cpu import small_linear_int8_cpu

    monkeypatch.setenv(build.ISA_ENV, isa)
    if not small_linear_int8_cpu.vnni_available():
        pytest.skip(f"the fused int8 step needs VNNI on the {isa} path (AVX512-VNNI, AVX-VNNI); "
                    "without it the decoder keeps float32 weights in the step")
    llm = LLM(make(str(tmp_path / "m"), seed=1), kv_cache_memory=32 << 20,
              enable_encoder_cache=False, quantization="int8")
    model = llm.llm_engine.worker.model
    assert all(m.int8 is not None for m in (model.decoder.layers[0].fc1, model.decoder.layers[-1].self_attn.qkv_proj))
    ran = []
    real = decoder_step_cpu.decode_step
    monkeypatch.setattr(decoder_step_cpu, "decode_step", lambda *a, **k: (out := real(*a, **k), ran.append(
        out is not None))[0])
    fused = _run(llm, True)
    assert ran and all(ran) and model._fused_weights.int8_table is not None
    by_op = _run(llm, False)
    for (toks_f, lp_f), (toks_o, lp_o) in zip(fused, by_op):
        assert toks_f == toks_o
        # An input that differs in its last float32 bit between the paths (the C
        # LayerNorm sums in double) can round to the next int8 level: a difference
        # of one quantization step, not of float rounding (seen 0.008 on one of 108)
        torch.testing.assert_close(torch.tensor(lp_f), torch.tensor(lp_o), atol=0.03, rtol=0)
