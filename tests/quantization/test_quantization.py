"""Reduced precision on CPU (encdec.quantization): int8 and bfloat16
linears against a float64 reference within each format's own error bound, per
ISA path this host runs (ENCDEC_CPU_ISA); the float32 C kernels decline bf16;
the options' validation."""
from __future__ import annotations

import os

import pytest
import torch

from encdec.engine.arg_utils import EngineArgs, compute_type_options
from encdec.kernels.cpu import build, small_linear_int8_cpu
from encdec.models.layers import Linear, onednn_available
from encdec import quantization

torch.set_num_threads(1)
BF16_EPS = 2.0**-8  # bfloat16's unit roundoff (8 significant bits), rounded up


def _linear(k: int, n: int, seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] *= 20  # an outlier output channel: per-channel scales keep the others fine
    b = torch.randn(n, generator=g) * 0.1
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    return lin, w.double(), b.double()


def _int8_paths() -> list[str]:
    """The host's own path, and fbgemm's (the fallback of CPUs without exact oneDNN int8)."""
    return sorted({quantization.int8_path(), "fbgemm-7bit" if quantization.reduce_range() else "fbgemm"})


@pytest.mark.parametrize("isa", build.host_isas())
@pytest.mark.parametrize("path", _int8_paths())
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_int8_linear_within_its_quantization_bound(monkeypatch, isa, path, rows):
    monkeypatch.setenv(build.ISA_ENV, isa)
    lin, w, b = _linear(96, 200, seed=rows)
    lin.quantize_int8(path)
    assert lin.int8 is not None and lin.weight.dtype == torch.int8 and lin.packed is None
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)) * 2
    got = lin(x).double()
    ref = x.double() @ w.T + b
    # weights: |w - s q| <= s/2 per output channel (s = max|w| / 127)
    sw = w.abs().amax(1) / 127
    # activations: per row, over [-max|x|, max|x|]: 255 levels for fbgemm (127 in
    # 7 bits), 254 (-127 .. 127) for oneDNN's symmetric int8
    levels = {"onednn": 254, "fbgemm": 255, "fbgemm-7bit": 127}[path]
    sx = x.double().abs().amax(1, keepdim=True) * 2 / levels  # (rows, 1)
    xa = x.double().abs()
    bound = (xa @ (sw / 2).expand(96, -1)  # weight error times |x|
             + (sx / 2) * (w.abs().sum(1) + 96 * sw / 2)  # activation error times |w q|
             ) * 1.001 + 1e-5 * (ref.abs() + 1)  # float32 accumulation and dequantization
    err = (got - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert err.max() > 0  # it ran int8, not float
    gelu = lin.forward_gelu(x).double()
    assert torch.allclose(gelu, torch.nn.functional.gelu(got), atol=1e-6)
    assert torch.equal(lin.forward_act(x, "relu").double(), got.relu())
    # per-row scales: a row's result does not depend on the other rows of its batch
    alone = lin(x[:1]).double()
    assert torch.equal(alone[0], got[0])
    loud = torch.cat([x[:1], x[:1] * 1000])  # a row 1000x larger beside it changes nothing
    assert torch.equal(lin(loud).double()[0], got[0])


def test_int8_linear_without_the_c_row_passes_gives_the_same_values(monkeypatch):
    """No compiler: the oneDNN path's row passes run in torch ops, the same values
    up to float32 rounding of the scale products."""
    from encdec.kernels.cpu import int8_rows_cpu

    lin, _, _ = _linear(96, 200, seed=4)
    lin.quantize_int8("onednn")
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(3)) * 2
    with_c = {act: lin.forward_act(x, act) for act in ("none", "relu", "gelu")}
    monkeypatch.setattr(int8_rows_cpu, "quantize_rows", lambda *a, **k: None)
    monkeypatch.setattr(int8_rows_cpu, "dequantize_rows", lambda *a, **k: None)
    for act, ref in with_c.items():
        torch.testing.assert_close(lin.forward_act(x, act), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(quantization.int8_path() != "onednn", reason="oneDNN's int8 is not exact here (no VNNI)")
def test_few_rows_take_the_panel_kernel_with_the_same_values(monkeypatch):
    """Up to small_linear_cpu.MAX_ROWS rows (an LM head's decode step) an int8
    Linear runs the decode step's panel kernel where VNNI runs it: bit for bit
    oneDNN's values (same quantization, exact sums, the bias in one FMA), every
    activation; more rows stay on oneDNN."""
    from encdec.kernels.cpu import small_linear_cpu, small_linear_int8_cpu

    if not small_linear_int8_cpu.vnni_available():
        pytest.skip("the int8 panel kernel needs VNNI")
    lin, _, _ = _linear(200, 300, seed=9)
    lin.quantize_int8("onednn")
    assert lin.int8_small_rows
    calls = []
    real = small_linear_int8_cpu.small_linear_int8
    monkeypatch.setattr(small_linear_int8_cpu, "small_linear_int8",
                        lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    x = torch.randn(small_linear_cpu.MAX_ROWS + 1, 200, generator=torch.Generator().manual_seed(2)) * 3
    for act in ("none", "relu", "gelu"):
        big = lin.forward_act(x, act)  # oneDNN
        assert calls == []
        for rows in (1, 7, small_linear_cpu.MAX_ROWS):
            assert torch.equal(lin.forward_act(x[:rows], act), big[:rows]), (act, rows)
        assert calls == [1, 7, small_linear_cpu.MAX_ROWS]
        calls.clear()


def test_onednn_int8_is_chosen_only_where_exact():
    """The oneDNN path needs exact int32 sums: the probe's answer and the path agree."""
    a = torch.full((1, 64), 127, dtype=torch.int8)
    exact = int(torch._int_mm(a, a.t().contiguous())[0, 0]) == 127 * 127 * 64
    assert (quantization.int8_path() == "onednn") == (exact and not quantization.reduce_range())
    with pytest.raises(ValueError, match="path must be one of"):
        Linear(4, 4).quantize_int8("int4")


@pytest.mark.parametrize("isa", build.host_isas())
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_bf16_linear_within_its_rounding_bound(monkeypatch, isa, rows):
    monkeypatch.setenv(build.ISA_ENV, isa)
    lin, w, b = _linear(96, 200, seed=rows)
    lin = lin.to(torch.bfloat16)
    packed = lin.pack()
    assert packed <= onednn_available()  # False also where oneDNN runs no bf16 ISA (F.linear then)
    if "avx512bw" in build.cpu_flags() and not os.environ.get("ONEDNN_MAX_CPU_ISA"):
        assert packed == onednn_available()
    assert not lin.small_rows  # the float32 small-row kernel never sees bf16
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)) * 2
    got = lin(x.bfloat16())
    assert got.dtype == torch.bfloat16
    ref = x.double() @ w.T + b
    # x, W and b each rounded to bf16, float32 accumulation, the output rounded to bf16
    mag = x.double().abs() @ w.abs().T + b.abs()
    bound = mag * (3 * BF16_EPS) + ref.abs() * BF16_EPS + 1e-6
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_float32_linear_keeps_its_float32_paths():
    from encdec.kernels.cpu import small_linear_cpu

    lin, _, _ = _linear(64, 48, seed=3)
    x = torch.randn(7, 64)
    assert lin.int8 is None and torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert lin.pack() == onednn_available()
    assert lin.weight.dtype == torch.float32 and lin.small_rows == (onednn_available()
                                                                     and small_linear_cpu.available())


def test_quantize_unties_a_tied_head_and_keeps_the_embedding():
    emb = torch.nn.Embedding(50, 16)
    head = Linear(16, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert quantization.quantize(model, "int8") == 1
    assert emb.weight.dtype == torch.float32 and head.weight.dtype == torch.int8
    x = torch.randn(3, 16)
    ref = x @ emb.weight.detach().T
    assert (head(x) - ref).abs().max() < 0.05 * ref.abs().max()
    assert head.pack() is False  # int8 linears never take the oneDNN float path


@pytest.mark.parametrize("rows", [3, 40])  # a decode step's few rows (the C panel kernel), and more (oneDNN)
@torch.inference_mode()
def test_bf16_lm_head_gives_the_float32_sums_of_its_bf16_values(rows):
    """bfloat16 on CPU: the LM head's logits are float32 sums of the bf16 hidden
    states times the bf16 weights, not rounded to bf16 (which ties logits closer
    than their spacing: 0.125 near 20); the embedding it was tied to keeps its
    bf16 weight. Other dtypes and devices are left alone."""
    g = torch.Generator().manual_seed(5)
    emb = torch.nn.Embedding(500, 64)
    emb.weight.data.copy_(torch.randn(500, 64, generator=g))
    head = Linear(64, 500, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head}).to(torch.bfloat16)
    model.vocab_size = 500
    cpu = torch.device("cpu")
    assert quantization.float32_logits(model, torch.float32, cpu) == 0
    assert quantization.float32_logits(model, torch.bfloat16, torch.device("meta")) == 0
    assert head.weight.dtype == torch.bfloat16
    assert quantization.float32_logits(model, torch.bfloat16, cpu) == 1
    assert emb.weight.dtype == torch.bfloat16 and head.weight.dtype == torch.float32
    assert torch.equal(head.weight.bfloat16(), emb.weight)  # the same values
    head.pack()
    x = (torch.randn(rows, 64, generator=g) * 4).bfloat16()
    got = head(x)
    ref = x.double() @ emb.weight.double().T
    bound = 64 * 2.0**-24 * (x.double().abs() @ emb.weight.double().abs().T)  # float32 sums of exact products
    print(f"{rows} rows: max |logit - float64| {float((got - ref).abs().max()):.2e}, "
          f"bf16-rounded logits' {float((ref.bfloat16().double() - ref).abs().max()):.2e}")
    assert got.dtype == torch.float32 and bool(((got.double() - ref).abs() <= bound).all())


def test_c_kernels_decline_bfloat16():
    from encdec.kernels.cpu.dense_attention_cpu import dense_attention
    from encdec.kernels.cpu.greedy_cpu import greedy_logprobs
    from encdec.kernels.cpu.paged_attention_cpu import paged_decode_attention
    from encdec.kernels.cpu.whisper_rules_cpu import whisper_rules

    bf = torch.bfloat16
    q = torch.randn(1, 4, 2, 64, dtype=bf)
    assert dense_attention(q, q, q, 0.125) is None
    cache = torch.zeros(2, 16, 2, 64, dtype=bf)
    one = torch.ones(1, 1, dtype=torch.int32)
    assert paged_decode_attention(q[0, :1].contiguous(), cache, cache, one, one[0], 0.125) is None
    logits = torch.randn(2, 100, dtype=bf)
    assert greedy_logprobs(logits) is None
    assert whisper_rules(logits, [0, 0], [0, 0], None, None, no_timestamps=1, eos=2, timestamp_begin=50,
                         max_initial=None) is None


def test_fused_decoder_step_takes_int8_weights_with_vnni_only_and_declines_bf16():
    from types import SimpleNamespace

    from encdec.kernels.cpu import decoder_step_cpu

    def layer():
        norms = [torch.nn.LayerNorm(64) for _ in range(3)]
        sa = SimpleNamespace(qkv_proj=Linear(64, 192), out_proj=Linear(64, 64), scale=0.125, num_heads=1)
        ca = SimpleNamespace(q_proj=Linear(64, 64), out_proj=Linear(64, 64), scale=0.125, num_heads=1)
        return SimpleNamespace(self_attn=sa, encoder_attn=ca, self_attn_layer_norm=norms[0],
                               encoder_attn_layer_norm=norms[1], final_layer_norm=norms[2],
                               fc1=Linear(64, 256), fc2=Linear(256, 64))

    def linears(ly):
        return [ly.self_attn.qkv_proj, ly.self_attn.out_proj, ly.encoder_attn.q_proj, ly.encoder_attn.out_proj,
                ly.fc1, ly.fc2]

    from encdec.kernels.cpu import small_linear_int8_cpu

    ly = layer()
    for m in linears(ly):
        m.quantize_int8("fbgemm")
    weights = decoder_step_cpu.decoder_weights([ly])
    if small_linear_int8_cpu.vnni_available():  # int8 matmuls in the step
        assert weights is not None and weights.int8_table is not None and weights.int8_table.shape == (1, 18)
    else:
        assert weights is None
    ly = layer()
    ly.fc1.quantize_int8("fbgemm")  # some int8, some float32: declined
    assert decoder_step_cpu.decoder_weights([ly]) is None
    ly = layer()
    for m in [*linears(ly), ly.self_attn_layer_norm, ly.encoder_attn_layer_norm, ly.final_layer_norm]:
        m.to(torch.bfloat16)
    assert decoder_step_cpu.decoder_weights([ly]) is None


def test_option_validation():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model="m", quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model="m", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="dtype must be 'auto' or 'float32'"):
        quantization.check_quantization("int8", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="CPU only"):
        quantization.check_quantization("int8", torch.device("cuda"), torch.float32)
    quantization.check_quantization("int8", cpu, torch.float32)
    quantization.check_quantization(None, cpu, torch.float32)
    kv = quantization.kv_cache_dtype
    assert kv("bfloat16", torch.float32, cpu, "torch_sdpa") == torch.bfloat16  # widened by the C kernels
    assert kv("bfloat16", torch.bfloat16, cpu, "torch_sdpa") == torch.bfloat16
    assert kv("auto", torch.float32, cpu, "torch_sdpa") == torch.float32
    assert kv("float32", torch.float32, cpu, "torch_sdpa") == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' with dtype='float32' runs on CPU"):
        kv("bfloat16", torch.float32, torch.device("cuda"), "torch_native")
    with pytest.raises(ValueError, match="torch_sdpa attention backend only"):
        kv("bfloat16", torch.float32, cpu, "xformers")
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' with dtype='float32' is not supported"):
        kv("float16", torch.float32, cpu, "torch_sdpa")
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' with dtype='bfloat16' is not supported"):
        kv("float32", torch.bfloat16, cpu, "torch_sdpa")
    assert EngineArgs(model="m", kv_cache_dtype="bfloat16").cache_config().cache_dtype == "bfloat16"
    assert EngineArgs(model="m", quantization="int8").load_config().quantization == "int8"


def test_compute_type_maps_to_engine_options():
    # int8 keeps K/V in bfloat16 unless the caller chose a cache dtype
    assert compute_type_options("int8") == {"quantization": "int8", "kv_cache_dtype": "bfloat16"}
    assert compute_type_options("int8", {"kv_cache_dtype": "auto"})["kv_cache_dtype"] == "bfloat16"
    assert compute_type_options("int8", {"kv_cache_dtype": "float32"})["kv_cache_dtype"] == "float32"
    assert compute_type_options("bfloat16", {"dtype": "auto", "quantization": None}) == {
        "dtype": "bfloat16", "quantization": None}
    assert compute_type_options("float32", {"dtype": "auto"}) == {"dtype": "float32"}
    with pytest.raises(ValueError, match="compute_type"):
        compute_type_options("int8_float16")
    with pytest.raises(ValueError, match="contradicts dtype"):
        compute_type_options("bfloat16", {"dtype": "float32"})


@pytest.mark.parametrize("style", ["t5", "t5-v1.1"])
def test_quantize_without_vnni_keeps_a_fused_t5_decoder_float32(tmp_path, monkeypatch, style):
    """Without VNNI the decoder layers the fused float32 step runs stay float32:
    T5's too (its FFN is ``ffn.wi``/``ffn.wo``); a gated FFN (v1.1), which the step
    declines, is quantized everywhere."""
    from encdec import LLM
    from encdec.kernels.cpu import decoder_step_cpu, small_linear_int8_cpu
    from encdec.testing import make_random_t5

    if not decoder_step_cpu.available():
        pytest.skip("no fused decode step built here")
    monkeypatch.setattr(small_linear_int8_cpu, "vnni_available", lambda isa=None: False)
    path = make_random_t5(str(tmp_path / "m"), style=style, d_kv=16, init_factor=1.5)
    model = LLM(path, kv_cache_memory=16 << 20, quantization="int8").llm_engine.worker.model
    layer = model.decoder.layers[0]
    fc1 = layer.ffn.wi_0 if style == "t5-v1.1" else layer.ffn.wi
    assert model.encoder.layers[0].ffn.wo.int8 is not None
    assert (fc1.int8 is None) == (style == "t5")
    assert (layer.self_attn.qkv_proj.int8 is None) == (style == "t5")


@pytest.mark.skipif(not small_linear_int8_cpu.vnni_available(), reason="no VNNI: no decode step reads int8 panels")
def test_decode_panels_packed_at_load_into_one_huge_page_arena(monkeypatch):
    """place_decode_panels: each decoder layer's six int8 matmuls and the LM head get
    their panels at load, the same bytes ``pack`` makes, side by side in one arena
    (on huge pages where Linux grants them), and the head's few-row output is unchanged."""
    from transformers import WhisperConfig

    from encdec.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec.kernels.cpu import decoder_step_cpu
    from encdec.models.whisper import WhisperForConditionalGeneration
    from encdec.platform import huge_pages
    from tests.platform.test_huge_pages import huge_kib, thp_mode

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    cfg = WhisperConfig(vocab_size=8192, d_model=256, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, num_mel_bins=80,
                        pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg, TorchSDPABackend).eval()
    quantization.quantize(model, "int8")
    want = quantization.decode_panel_linears(model)
    layer_linears = [m for ly in model.decoder.layers for m in decoder_step_cpu.decoder_linears(ly)]
    assert want == layer_linears + [model.proj_out]  # 12 matmuls and the head, no encoder or cross K/V linear
    x = torch.randn(3, 256)
    before = model.proj_out(x)
    moved = quantization.place_decode_panels(model)
    if not huge_pages.enabled():
        assert moved == 0
        return
    panels = [m.int8_panels for m in want]
    assert moved == sum(p.wq.numel() for p in panels) > huge_pages.HUGE_PAGE
    for m, p in zip(want, panels):
        assert torch.equal(p.wq, small_linear_int8_cpu.pack(m.weight, m.weight_scale).wq)
    starts = sorted(p.wq.data_ptr() for p in panels)
    assert starts[0] % huge_pages.HUGE_PAGE == 0 and all(a % 64 == 0 for a in starts)
    assert starts[-1] - starts[0] < moved + 64 * len(panels)  # one arena, side by side
    if thp_mode() not in (None, "never"):
        assert huge_kib(panels[0].wq) >= 2048, "the arena is not on huge pages"
    assert torch.equal(model.proj_out(x), before)
