"""The dense attention kernel in int8 (quantization="int8": Whisper's encoder),
once per ISA path this CPU runs with VNNI (the path is in the test id): the kernel
does the arithmetic its C file describes, stays close to float64, a channel that
every key shares costs it nothing, a tail of small weights keeps its mass; without
VNNI the attention stays float32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encdec.kernels.cpu import build, dense_attention_cpu

from .test_dense_attention_cpu import isa as built_isa  # noqa: F401  (a fixture: each vector path that built)


@pytest.fixture
def isa(built_isa) -> str:  # noqa: F811
    if not dense_attention_cpu.int8_available(built_isa):
        pytest.skip(f"this CPU lacks the VNNI the {built_isa} path's int8 attention needs "
                    f"(avx512_vnni: {'avx512_vnni' in build.cpu_flags()}, avx_vnni: {'avx_vnni' in build.cpu_flags()})")
    return built_isa


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dim, as int8_rows_cpu.c's quantize_row."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(x * inv).clamp(-127, 127), amax / 127.0


KC = 128  # keys a block of P shares a scale over (the C file's KC)


def emulate(q, k, v, scale):
    """The C file's int8 attention in torch: keys minus their mean key (summed in
    order, float32), int8 rows with one scale each for the scores; P = exp(s - max)
    in unsigned bytes scaled by each block of KC keys' largest (255 exp(s - the
    block's largest score)), V in int8 per channel, the row's sum from the
    quantized P."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    mean = k.cumsum(2)[:, :, -1:] / k.shape[2]
    q8, qs = quantize_rows(q * scale)
    k8, ks = quantize_rows(k - mean)
    acc = (q8.double() @ k8.double().transpose(-1, -2)).float()  # exact: int32 sums
    scores = acc * (ks.transpose(-1, -2) * qs)
    row_max = scores.amax(-1, keepdim=True)
    v8, vs = quantize_rows(v.transpose(-1, -2))  # per channel: rows of the transpose
    out, total = 0, 0
    for t0 in range(0, scores.shape[-1], KC):
        block = scores[..., t0:t0 + KC]
        block_max = block.amax(-1, keepdim=True)
        p8 = torch.round(255.0 * torch.exp(block - block_max))  # exp(s - max) over its block's largest
        ps = torch.exp(block_max - row_max) / 255.0
        out = out + (p8.double() @ v8[..., t0:t0 + KC].transpose(-1, -2).double()) * ps.double()
        total = total + p8.sum(-1, keepdim=True).double() * ps.double()
    return (out * vs.transpose(-1, -2).double() / total).transpose(1, 2)


def reference(q, k, v, scale):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


def qkv(B, T, H, seed, shared=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 3, H, 64, generator=g)
    x[:, :, 1, :, 5] += shared  # a channel every key shares (the mean takes it out)
    return x[:, :, 0], x[:, :, 1], x[:, :, 2]


@pytest.mark.parametrize("B, T, H", [(1, 1, 1), (2, 17, 2), (1, 100, 3), (2, 1500, 2)])
def test_int8_attention_does_what_the_c_file_says(isa, B, T, H):
    q, k, v = qkv(B, T, H, seed=T)
    out = dense_attention_cpu.dense_attention(q, k, v, 0.125, int8=True, isa=isa)
    assert out is not None and out.shape == (B, T, H, 64)
    emulated, ref = emulate(q, k, v, 0.125), reference(q, k, v, 0.125)
    err_emulated = (out.double() - emulated).abs().max().item()
    err_ref = (out.double() - ref).abs().max().item()
    print(f"\n{isa} B={B} T={T} H={H}: int8 attention vs its emulation {err_emulated:.1e}, vs float64 {err_ref:.1e}")
    # float32 rounding of the scores and scales: now and then a P byte one step off (1/255 of its block's max)
    assert err_emulated < 1e-3 and (out.double() - emulated).abs().mean().item() < 1e-6
    assert err_ref < 0.06 and (out.double() - ref).abs().mean().item() < 0.01  # the quantization's own error
    f32 = dense_attention_cpu.dense_attention(q, k, v, 0.125, isa=isa)
    assert not torch.equal(out, f32)  # the int8 path ran (V in int8, even under one key)


def test_a_channel_every_key_shares_costs_nothing(isa):
    """Keys with a large value on one channel in common (as Whisper's have): the
    mean key takes it out before the int8 range is set, so the error is that of
    the same keys without it; quantizing the raw keys would spend the range on it."""
    q, k, v = qkv(1, 300, 2, seed=3)
    _, k_shared, _ = qkv(1, 300, 2, seed=3, shared=30.0)
    err = {}
    for name, keys in (("plain", k), ("shared", k_shared)):
        out = dense_attention_cpu.dense_attention(q, keys, v, 0.125, int8=True, isa=isa)
        err[name] = (out.double() - reference(q, keys, v, 0.125)).abs().mean().item()
    q8, qs = quantize_rows(q.transpose(1, 2) * 0.125)  # what raw int8 keys would give, for scale
    k8, ks = quantize_rows(k_shared.transpose(1, 2))
    raw = torch.softmax(((q8 @ k8.transpose(-1, -2)) * (ks.transpose(-1, -2) * qs)).double(), -1) @ v.transpose(1, 2).double()
    err["raw"] = (raw.transpose(1, 2) - reference(q, k_shared, v, 0.125)).abs().mean().item()
    print(f"\n{isa}: mean error {err}")
    assert err["shared"] < 1.5 * err["plain"] and err["raw"] > 3 * err["shared"]


def test_without_vnni_the_attention_stays_float32(isa, monkeypatch):
    q, k, v = qkv(2, 50, 2, seed=9)
    f32 = dense_attention_cpu.dense_attention(q, k, v, 0.125, isa=isa)
    monkeypatch.setattr(build, "vnni_in_cpu", lambda path: False)
    assert not dense_attention_cpu.int8_available(isa)
    assert torch.equal(dense_attention_cpu.dense_attention(q, k, v, 0.125, int8=True, isa=isa), f32)


def test_a_heavy_tail_of_small_weights_keeps_its_mass(isa):
    """One key far above 1499 others whose weights, each ~1/1000 of the peak's, sum
    to more than it: with one byte scale a row they would all round to 0 (the
    output would be the peak's value alone); a scale per block of keys keeps them."""
    T = 1500
    q = torch.zeros(1, 1, 1, 64)
    q[..., 0] = 1.0
    k = torch.zeros(1, T, 1, 64)
    k[:, 700, 0, 0] = 7.0  # score 7 against 0 for every other key: p = e^-7 ~ 0.0009 there
    v = torch.randn(1, T, 1, 64, generator=torch.Generator().manual_seed(5))
    out = dense_attention_cpu.dense_attention(q, k, v, 1.0, int8=True, isa=isa)
    ref = reference(q, k, v, 1.0)
    peak_only = v[:, 700:701].double()
    err, err_peak = ((out.double() - ref).abs().max().item(), (peak_only - ref).abs().max().item())
    print(f"\n{isa}: heavy tail: error {err:.1e}; the peak's value alone would be {err_peak:.1e} off")
    assert err < 0.05 * err_peak
