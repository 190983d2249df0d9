"""``paged_attention_cpu.round_units_bf16`` (a self-draft's bfloat16 copy of
K/V, ``worker/draft_kv.py``), per ISA build in the ids: chosen units of a
float32 cache rounded into chosen units of a bfloat16 one exactly as torch
rounds, nothing else written; other dtypes or layouts are declined (None,
nothing written)."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import build, paged_attention_cpu

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler here")


@pytest.mark.parametrize("isa", build.host_isas())
@pytest.mark.parametrize("unit", [(16, 2, 64), (3, 40)])  # a block of slots, a slot of odd width
def test_units_round_as_torch_rounds(isa, unit):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 9, *unit, generator=g) * 1e3
    src.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), 3.0e38])
    dst = torch.full((2, 5, *unit), 7.0, dtype=torch.bfloat16)
    s, d = torch.tensor([4, 0, 8, 9 + 2]), torch.tensor([1, 3, 0, 5 + 4])  # units of the flattened (2 * n) axis
    assert paged_attention_cpu.round_units_bf16(src, dst, s, d, unit[0] * unit[1] * (unit[2] if len(unit) > 2 else 1),
                                                isa=isa) is dst
    want = torch.full_like(dst, 7.0)
    want.view(-1, *unit)[d] = src.view(-1, *unit)[s].to(torch.bfloat16)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("isa", build.host_isas())
def test_other_dtypes_are_declined_untouched(isa):
    src, dst = torch.randn(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    idx = torch.tensor([0, 1])
    assert paged_attention_cpu.round_units_bf16(src.double(), dst, idx, idx, 8, isa=isa) is None
    assert paged_attention_cpu.round_units_bf16(src, dst.float(), idx, idx, 8, isa=isa) is None
    assert paged_attention_cpu.round_units_bf16(src, dst, idx.int(), idx, 8, isa=isa) is None
    assert paged_attention_cpu.round_units_bf16(src.t(), dst, idx, idx, 8, isa=isa) is None
    assert not dst.any()
