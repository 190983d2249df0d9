"""Weights and the CPU KV cache on transparent huge pages (encdec.platform.huge_pages)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from encdec.platform import huge_pages
from encdec.worker.cache_engine import CacheEngine

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The bracketed mode of ``THP`` ("always", "madvise", "never"), or None."""
    try:
        with open(THP) as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
                               reason=f"Linux grants no transparent huge pages here ({THP}: {thp_mode()})")


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's header: "start-end perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(4096, 128)  # 2 MiB
        self.embed.weight.data = torch.randn(4096, 128, generator=g)
        self.head = nn.Linear(128, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied, as Whisper's proj_out
        self.big = nn.Linear(1024, 512)  # 2 MiB weight, 2 KiB bias
        self.norm = nn.LayerNorm(128)  # small: stays put


@needs_thp
def test_move_parameters_keeps_values_and_ties_on_huge_pages(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    m = Tied()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    small = {n: p.data_ptr() for n, p in m.named_parameters() if p.numel() * 4 < huge_pages.MIN_BYTES}
    moved = huge_pages.move_parameters(m)
    assert moved == 4096 * 128 * 4 + 512 * 1024 * 4  # the tied weight once, and big.weight
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n
    assert m.head.weight is m.embed.weight
    assert {n: p.data_ptr() for n, p in m.named_parameters() if n in small} == small
    assert m.embed.weight.data_ptr() % huge_pages.HUGE_PAGE == 0  # the arena's start
    assert m.big.weight.data_ptr() % 64 == 0
    assert huge_kib(m.embed.weight) >= 2048, "the arena is not on huge pages"
    x = torch.randn(3, 1024)
    torch.testing.assert_close(m.big(x), x @ before["big.weight"].T + before["big.bias"], rtol=0, atol=0)


def test_turned_off_leaves_parameters_where_they_are(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    m = Tied()
    ptrs = [p.data_ptr() for p in m.parameters()]
    assert huge_pages.move_parameters(m) == 0
    assert [p.data_ptr() for p in m.parameters()] == ptrs


@needs_thp
def test_cpu_kv_cache_is_private_on_huge_pages_and_zero(monkeypatch):
    from encdec.attention.backends.torch_sdpa import TorchSDPABackend

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    cache = CacheEngine(num_layers=1, num_kv_heads=2, head_size=64, block_size=16, num_gpu_blocks=1024,
                        num_cpu_blocks=4, dtype=torch.float32, device=torch.device("cpu"),
                        backend=TorchSDPABackend, prefault_bytes=8 << 20)
    layer = cache.gpu_cache[0]  # (2, 1024, 16, 2, 64) float32: 16 MiB
    assert layer.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not layer.any()
    assert huge_kib(layer) >= 4096, "the prefaulted blocks are not on huge pages"


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() != "madvise",
                    reason=f"only under THP madvise does the advice decide ({THP}: {thp_mode()})")
def test_cpu_kv_cache_blocks_past_the_warm_part_fault_in_on_small_pages(monkeypatch):
    """Blocks first written mid-run are not advised for huge pages: under
    ``defrag=madvise`` a huge page's first write compacts memory synchronously
    (4x slower here); the warm blocks, written at start, are."""
    from encdec.attention.backends.torch_sdpa import TorchSDPABackend

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    cache = CacheEngine(num_layers=1, num_kv_heads=2, head_size=64, block_size=16, num_gpu_blocks=1024,
                        num_cpu_blocks=4, dtype=torch.float32, device=torch.device("cpu"),
                        backend=TorchSDPABackend, prefault_bytes=8 << 20)
    layer = cache.gpu_cache[0]  # K: 1024 blocks of 8 KiB; the first 512 (4 MiB) warm
    assert cache.num_warm_blocks == 512
    for kv in (0, 1):
        cold = layer[kv, 600:]
        cold.fill_(1.0)
        assert huge_kib(cold) == 0, "blocks past the warm part were faulted in on huge pages"
        assert huge_kib(layer[kv, :256]) >= 2048, "the warm blocks are not on huge pages"
