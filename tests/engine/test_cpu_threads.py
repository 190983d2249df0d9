"""Small decode steps run on one intra-op thread (``encdec.cpu_threads``): the
decoder layers and the logits rules of a step of <= SMALL_STEP_ROWS rows, while
the LM head, prefills and bigger steps keep torch's count, and paged decode
attention over several rows asks for the count set aside."""
from __future__ import annotations

import threading

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.cpu_threads import SMALL_STEP_ROWS, bandwidth_threads, single_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_single_thread_sets_aside_and_restores(two_threads):
    assert bandwidth_threads() == 2
    with single_thread():
        assert torch.get_num_threads() == 1 and bandwidth_threads() == 2
    assert torch.get_num_threads() == 2 and bandwidth_threads() == 2
    with single_thread(False):
        assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), single_thread():
        raise KeyError("restored on the way out")
    assert torch.get_num_threads() == 2 and bandwidth_threads() == 2


def test_set_aside_count_is_per_python_thread(two_threads):
    """torch's count is process-wide (another thread sees 1 meanwhile), but only
    the thread inside ``single_thread`` is told the count set aside."""
    seen = []
    with single_thread():
        t = threading.Thread(target=lambda: seen.append((bandwidth_threads(), torch.get_num_threads())))
        t.start()
        t.join(timeout=10)
    assert seen == [(1, 1)]


def test_runner_threads_per_step_kind(tiny_bart, two_threads):
    """Record the thread count the model's forward and the LM head see: one
    thread for small decode steps, two for prefills, decode steps of more than
    SMALL_STEP_ROWS rows and every LM head."""
    llm = LLM(tiny_bart)
    runner = llm.llm_engine.model_runner
    model = runner.model
    seen: list[tuple[str, int, int]] = []
    forward, logits = model.forward, model.compute_logits

    def spy_forward(input_ids, positions, kv_caches, attn_metadata, **kw):
        kind = "prefill" if attn_metadata.num_prefill_tokens else "decode"
        seen.append((kind, attn_metadata.num_decode_tokens, torch.get_num_threads()))
        return forward(input_ids, positions, kv_caches, attn_metadata, **kw)

    def spy_logits(hidden):
        seen.append(("lm_head", hidden.shape[0], torch.get_num_threads()))
        return logits(hidden)

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=[0, 5 + i, 9, 2]) for i in range(SMALL_STEP_ROWS + 4)]
    model.forward, model.compute_logits = spy_forward, spy_logits
    try:
        llm.generate(prompts, params, use_tqdm=False)  # decode steps of 20 rows
        llm.generate(prompts[:3], params, use_tqdm=False)  # and of 3
    finally:
        model.forward, model.compute_logits = forward, logits
    decode = {(n, t) for kind, n, t in seen if kind == "decode"}
    assert (SMALL_STEP_ROWS + 4, 2) in decode and (3, 1) in decode, decode
    assert all(t == (1 if n <= SMALL_STEP_ROWS else 2) for n, t in decode), decode
    assert {t for kind, _, t in seen if kind != "decode"} == {2}, seen
    assert torch.get_num_threads() == 2
