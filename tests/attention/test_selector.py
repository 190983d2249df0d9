"""Which backend the selector picks, and why: CPU keeps torch_sdpa; CUDA takes
torch_native, with one warning where xFormers is installed without CUDA kernels
that says how to get them; ``attention_backend="xformers"`` on CUDA only when its
kernels run the backend's real calls (BlockDiagonalMask, BlockDiagonalCausalMask,
the model's dtype), else a ValueError. A fake ``xformers`` module stands in for
"imports but has no CUDA kernels" (the PyPI wheel) and for a working one; the
probe's tensors go to the CPU through the selector's ``_probe_device`` seam."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from encdec.attention import selector
from encdec.attention.selector import get_attn_backend

NO_CUDA = ("No operator found for `memory_efficient_attention_forward` with inputs:\n"
           "     query : shape=(1, 3, 2, 64) (torch.float16)\n"
           "`cutlassF-pt` is not supported because:\n    xFormers wasn't build with CUDA support")


class _Bias:
    def __init__(self, q_seqlen, kv_seqlen=None, device=None):
        self.q, self.kv, self.device = q_seqlen, kv_seqlen or q_seqlen, device

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
        return cls(q_seqlen, kv_seqlen, device)


def fake_xformers(monkeypatch, *, has_cuda_kernels: bool) -> list:
    """Install a fake xformers package; returns the list of (bias type, dtype) it was called with."""
    calls = []
    BlockDiagonalMask = type("BlockDiagonalMask", (_Bias,), {})
    BlockDiagonalCausalMask = type("BlockDiagonalCausalMask", (_Bias,), {})

    def memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None):
        calls.append((type(attn_bias).__name__, q.dtype))
        if not has_cuda_kernels:
            raise NotImplementedError(NO_CUDA)
        return torch.zeros_like(q)

    pkg = types.ModuleType("xformers")
    ops = types.ModuleType("xformers.ops")
    fmha = types.ModuleType("xformers.ops.fmha")
    attn_bias = types.ModuleType("xformers.ops.fmha.attn_bias")
    ops.memory_efficient_attention = memory_efficient_attention
    attn_bias.AttentionBias = _Bias
    attn_bias.BlockDiagonalMask = BlockDiagonalMask
    attn_bias.BlockDiagonalCausalMask = BlockDiagonalCausalMask
    pkg.ops, ops.fmha, fmha.attn_bias = ops, fmha, attn_bias
    for name, mod in (("xformers", pkg), ("xformers.ops", ops), ("xformers.ops.fmha", fmha),
                      ("xformers.ops.fmha.attn_bias", attn_bias)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(selector, "_probe_device", lambda device: "cpu")
    monkeypatch.setattr(selector, "_warned", set())
    return calls


def test_cpu_default_is_torch_sdpa_and_torch_native_runs_by_name():
    assert get_attn_backend(None, "cpu").get_name() == "torch_sdpa"
    assert get_attn_backend("torch_native", "cpu").get_name() == "torch_native"
    with pytest.raises(ValueError, match="torch_native"):
        get_attn_backend("flash", "cuda")


def test_xformers_without_cuda_kernels_gives_torch_native_and_one_warning(monkeypatch, caplog):
    calls = fake_xformers(monkeypatch, has_cuda_kernels=False)
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        chosen = get_attn_backend(None, "cuda", dtype=torch.float16)
        again = get_attn_backend(None, "cuda", dtype=torch.float16)
    assert chosen.get_name() == again.get_name() == "torch_native"
    assert calls[0] == ("BlockDiagonalMask", torch.float16)  # the backend's own bias type and dtype
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    why = warnings[0]
    assert "NotImplementedError: No operator found" in why and "torch_native" in why
    assert "download.pytorch.org/whl" in why and "PyPI wheel has no CUDA kernels" in why


def test_asking_for_xformers_that_cannot_run_is_a_value_error(monkeypatch):
    fake_xformers(monkeypatch, has_cuda_kernels=False)
    with pytest.raises(ValueError, match="attention_backend='xformers' cannot run here") as e:
        get_attn_backend("xformers", "cuda", dtype=torch.bfloat16)
    assert "torch.bfloat16" in str(e.value) and "download.pytorch.org/whl" in str(e.value)
    assert "attention_backend='torch_native'" in str(e.value)


def test_xformers_with_cuda_kernels_runs_by_name_after_every_bias_runs(monkeypatch, caplog):
    calls = fake_xformers(monkeypatch, has_cuda_kernels=True)
    monkeypatch.delitem(sys.modules, "encdec.attention.backends.xformers", raising=False)
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        assert get_attn_backend(None, "cuda", dtype=torch.float32).get_name() == "torch_native"
        assert get_attn_backend("xformers", "cuda", dtype=torch.float32).get_name() == "xformers"
    assert {c[0] for c in calls} == {"BlockDiagonalMask", "BlockDiagonalCausalMask"}
    assert {c[1] for c in calls} == {torch.float32}
    assert not caplog.records  # kernels that run: nothing to warn about


def test_no_xformers_gives_torch_native_silently(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "xformers", None)
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    monkeypatch.setattr(selector, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        assert get_attn_backend(None, "cuda").get_name() == "torch_native"
    assert not caplog.records
    with pytest.raises(ValueError, match="xformers does not import"):
        get_attn_backend("xformers", "cuda")


def test_the_pypi_wheel_itself_is_refused(monkeypatch):
    """The wheel installed here (PyPI, no CUDA kernels): the probe runs its real
    memory_efficient_attention with the real bias types, on CPU tensors."""
    pytest.importorskip("xformers.ops")
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the real kernels may run")
    monkeypatch.setattr(selector, "_probe_device", lambda device: "cpu")
    problem = selector.xformers_problem("cuda", torch.float16)
    assert problem is not None and "No operator found" in problem


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llm_on_cuda_runs_whatever_xformers_is_installed(tiny_bart, caplog):
    """LLM(model) on a CUDA host: torch_native, and exactly one warning where
    xFormers imports without CUDA kernels (the PyPI wheel)."""
    from encdec import LLM, SamplingParams

    selector._warned.clear()
    problem = selector.xformers_problem("cuda", torch.float16)
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        # Two engines sized by profiling (0.2 of the GPU each): the second gets its own share.
        llm = LLM(tiny_bart, device="cuda", dtype="float16", gpu_memory_utilization=0.2)
        LLM(tiny_bart, device="cuda", dtype="float16", gpu_memory_utilization=0.2)
    assert llm.llm_engine.worker.backend.get_name() == "torch_native"
    warned = [r for r in caplog.records if "torch_native" in r.getMessage()]
    imports = problem is not None and not problem.startswith("xformers does not import")
    assert len(warned) == (1 if imports else 0)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
