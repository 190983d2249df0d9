"""Small decode steps run on one intra-op thread (``encdec.cpu_threads``): the
decoder layers and the logits rules of a step of <= SMALL_STEP_ROWS rows, while
the LM head, prefills and bigger steps keep torch's count, and paged decode
attention over several rows asks for the count set aside."""
from __future__ import annotations

import threading

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec import cpu_threads
from encdec.cpu_threads import SMALL_STEP_ROWS, bandwidth_threads, cgroup_cpu_limit, kernel_threads, single_thread


@pytest.fixture
def two_threads(monkeypatch):
    # These tests are about the count set aside, not the cap at the cores the
    # process can get (tested below): a 1-core host gets 2 as well.
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
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


def _tree(root, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(root)


def test_cgroup_v2_quota_is_the_lowest_on_the_path(tmp_path):
    root = _tree(tmp_path, {"cpu.max": "max 100000", "a/cpu.max": "150000 100000",
                            "a/b/cpu.max": "max 100000"})
    assert cgroup_cpu_limit("0::/a/b\n", root) == 1.5  # the parent's quota binds its children
    assert cgroup_cpu_limit("0::/\n", root) is None  # "max": no quota
    assert cgroup_cpu_limit("0::/elsewhere\n", root) is None
    assert cgroup_cpu_limit("", root) is None


def test_cgroup_v1_quota(tmp_path):
    root = _tree(tmp_path, {"cpu,cpuacct/job/cpu.cfs_quota_us": "50000", "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
                            "cpu,cpuacct/free/cpu.cfs_quota_us": "-1", "cpu,cpuacct/free/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit("4:cpu,cpuacct:/job\n3:memory:/x\n", root) == 0.5
    assert cgroup_cpu_limit("4:cpu,cpuacct:/free\n", root) is None  # -1: no quota


def test_available_cores_is_affinity_capped_by_the_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for quota, want in [(None, 4), (1.5, 2), (0.2, 1), (8.0, 4)]:
        monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda text, q=quota: q)
        cpu_threads.available_cores.cache_clear()
        assert cpu_threads.available_cores() == want
    cpu_threads.available_cores.cache_clear()


def test_kernel_and_torch_threads_never_exceed_available_cores(monkeypatch):
    from encdec.worker import cpu_runtime

    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 1)
    monkeypatch.setattr(cpu_runtime, "available_cores", lambda: 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernel_threads() == 1 and kernel_threads(8) == 1 and bandwidth_threads() == 1
        assert cpu_runtime.configure_cpu_runtime(4, retain_freed_memory=False) == 1
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="num_threads"):
            cpu_runtime.configure_cpu_runtime(0, retain_freed_memory=False)
    finally:
        torch.set_num_threads(before)
