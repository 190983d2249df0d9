"""torch_sdpa's prefill on CPU: short prompts as paged queries in one C call,
and the per-sequence loops that run on one thread."""
from __future__ import annotations

import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.attention.backends import torch_sdpa
from encdec.kernels.cpu import paged_attention_cpu
from encdec.testing import make_random_bart


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(4, 900, (int(n),), generator=g).tolist())
               for n in torch.randint(3, 60, (12,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def test_short_prompts_prefill_as_paged_queries(tmp_path, monkeypatch):
    """A prefill of short decoder prompts reads its self and cross K/V from the
    cache in one paged C call each per layer (no SDPA call per sequence), with the
    tokens and log-probs of the per-sequence loop."""
    if not paged_attention_cpu.available():
        import pytest

        pytest.skip("no C paged kernel on this machine")
    llm = LLM(make_random_bart(str(tmp_path / "m"), seed=3), kv_cache_memory=32 << 20, enable_encoder_cache=False)
    llm.llm_engine.worker.model.fused_decode = False  # decode steps through the backend too
    calls, sdpa = [], []
    real_paged, real_sdpa = paged_attention_cpu.paged_decode_attention, torch_sdpa._sdpa
    monkeypatch.setattr(paged_attention_cpu, "paged_decode_attention",
                        lambda q, *a, **k: (calls.append(q.shape[0]), real_paged(q, *a, **k))[1])
    monkeypatch.setattr(torch_sdpa, "_sdpa", lambda *a, **k: (sdpa.append(1), real_sdpa(*a, **k))[1])
    paged = _generate(llm)
    cfg = llm.llm_engine.worker.model.config
    prefill_calls = [n for n in calls if n == 24]  # 12 prompts of 2 decoder tokens: 24 paged queries
    assert len(prefill_calls) == 2 * cfg.decoder_layers
    # only the encoder's self-attention, per sequence (each call through _sdpa twice: it adds a batch dim)
    assert len(sdpa) == 2 * 12 * cfg.encoder_layers
    monkeypatch.setattr(torch_sdpa, "_paged_prefill", lambda *a, **k: False)
    loop = _generate(llm)
    for (toks_p, lp_p), (toks_l, lp_l) in zip(paged, loop):
        assert toks_p == toks_l
        torch.testing.assert_close(torch.tensor(lp_p), torch.tensor(lp_l), atol=1e-4, rtol=1e-4)


def test_small_prefill_loops_run_on_one_thread():
    """torch_sdpa's per-sequence prefill loops take one thread where every call
    is small (``_ONE_THREAD_MACS``), on CPU only; an empty step keeps the count."""
    from encdec.attention.backends import torch_sdpa

    cpu, width = torch.device("cpu"), 2 * 16
    short = [(0, 2, 0, 40), (2, 4, 40, 88)]  # (q_start, q_end, enc_start, enc_end): 2 queries over 40 and 48 keys
    assert torch_sdpa._one_thread(short, width, cpu)
    assert not torch_sdpa._one_thread(short + [(4, 6, 88, 88 + 40_000)], width, cpu)
    assert not torch_sdpa._one_thread([(0, 300, 0, 300)], 12 * 64, cpu)  # bart-base encoder: both threads
    assert not torch_sdpa._one_thread(short, width, torch.device("meta"))
    assert not torch_sdpa._one_thread([], width, cpu)


def test_long_cross_attention_prefill_keeps_the_per_sequence_loop():
    """Cross-attention prefill goes paged only where each sequence's call is small:
    Whisper's 4-token prompts over 1500 frames (6 heads of 64) keep SDPA, which
    reads a sequence's keys once for its queries; BART's 2-token prompts go paged."""
    from types import SimpleNamespace

    if not paged_attention_cpu.available():
        import pytest

        pytest.skip("no C paged kernel on this machine")
    cache = torch.zeros(2, 200, 16, 6, 64)

    def md(queries: int, keys: int) -> SimpleNamespace:
        n = 8
        bounds = [(i * queries, (i + 1) * queries, i * keys, (i + 1) * keys) for i in range(n)]
        return SimpleNamespace(num_prefills=n, prefill_bounds=bounds, encoder_seq_lens=[keys] * n,
                               cross_block_tables=torch.zeros(n, 94, dtype=torch.int32), block_size=16)

    q = torch.zeros(8 * 4, 6, 64)
    assert not torch_sdpa._paged_prefill(md(4, 1500), cache, q, cross=True)
    assert torch_sdpa._paged_prefill(md(2, 300), cache, q[:16], cross=True)
    assert not torch_sdpa._paged_prefill(md(40, 300), cache, torch.zeros(8 * 40, 6, 64), cross=True)  # dense kernel's
