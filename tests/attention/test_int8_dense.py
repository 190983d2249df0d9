"""quantization="int8": the torch_sdpa backend's prefill cross-attention runs the
dense C kernel's int8 products once its impl's ``use_int8_dense`` granted them (Whisper's
sequential prefill: the previous text's ~225 queries over 1500 keys), and only
there: prompts under the dense kernel's minimum stay on torch's SDPA."""
from __future__ import annotations

import random

import pytest
import torch

from encdec.attention import AttentionBackend, AttentionType
from encdec.attention.backends import torch_sdpa
from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.kernels.cpu import dense_attention_cpu

from .conftest import BlockPool, SeqSpec, make_attn_metadata


def test_prefill_cross_attention_takes_the_int8_dense_kernel_when_asked():
    if not dense_attention_cpu.int8_available():
        pytest.skip("the dense kernel's int8 path needs VNNI (AVX512-VNNI or AVX-VNNI) on this CPU")
    H, D, bs = 6, 64, 16
    g = torch.Generator().manual_seed(0)
    long, short = SeqSpec(40, 300), SeqSpec(5, 200)  # 40 queries take the dense kernel, 5 do not
    pool = BlockPool(256, scattered=False, rng=random.Random(0))
    for s in (long, short):
        s.grow(pool, bs)
    md = make_attn_metadata(TorchSDPABackend, prefills=[long, short], decodes=[], block_size=bs)
    q = torch.randn(45, H * D, generator=g)
    k, v = torch.randn(500, H * D, generator=g), torch.randn(500, H * D, generator=g)
    cache = torch.zeros(AttentionBackend.get_kv_cache_shape(256, bs, H, D))
    impl = TorchSDPABackend.get_impl_cls()(H, D, D ** -0.5, H, AttentionType.ENCODER_DECODER)
    assert impl.int8_dense is False  # the default: float32
    fp32 = impl.forward(q, k, v, cache, md).view(45, H, D)
    assert impl.use_int8_dense()
    int8 = impl.forward(q, k, v, cache, md).view(45, H, D)

    def dense(rows, keys, as_int8):
        return dense_attention_cpu.dense_attention(q.view(45, H, D)[rows][None], k.view(500, H, D)[keys][None],
                                                   v.view(500, H, D)[keys][None], D ** -0.5, int8=as_int8)[0]
    assert torch.equal(fp32[:40], dense(slice(0, 40), slice(0, 300), False))
    assert torch.equal(int8[:40], dense(slice(0, 40), slice(0, 300), True))
    gap = (int8[:40] - fp32[:40]).abs().max().item()
    assert 0 < gap < 0.05, gap  # int8 products: close to float32, not the same floats
    # the short prompt: torch's SDPA either way, the same floats
    assert torch.equal(int8[40:], fp32[40:])
    assert torch_sdpa._DENSE_MIN_QUERIES > 5
