"""Small decode steps run on one intra-op thread (``encdec.platform.cpu_threads``): the
decoder layers and the logits rules of a step of <= SMALL_STEP_ROWS rows, while
the LM head, prefills and bigger steps keep torch's count, and paged decode
attention over several rows asks for the count set aside."""
from __future__ import annotations

import threading

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.platform import cpu_threads
from encdec.platform.cpu_threads import (SMALL_STEP_ROWS, bandwidth_threads, cgroup_cpu_limit, kernel_threads,
                                         single_thread)


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
    thread for small decode steps and small prefills, two for decode steps of
    more than SMALL_STEP_ROWS rows and every LM head."""
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
    # prefills this small (a few tokens, tiny d_model: step_plan.one_thread_prefills) on one
    # thread; the LM head on two
    assert {t for kind, _, t in seen if kind == "prefill"} == {1}, seen
    assert {t for kind, _, t in seen if kind == "lm_head"} == {2}, seen
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
    from encdec.platform import cpu_runtime

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


needs_per_thread_counts = pytest.mark.skipif(
    cpu_threads.omp_set_num_threads() is None,
    reason="this torch's intra-op thread count cannot be set per thread (not OpenMP)")


@needs_per_thread_counts
def test_map_one_thread_each_runs_items_on_threads_of_one_intra_op_thread(two_threads):
    """Items run on pool threads whose torch (and C-kernel) count is one, each
    kept on one CPU of the caller's, the results in the items' order and as the
    caller's threads compute them; the caller's own count and CPUs are left as
    they were; grad and inference modes carry over."""
    import os

    mine = os.sched_getaffinity(0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    xs = [torch.randn(64, 256, generator=g) for _ in range(6)]
    seen, cpus = [], {}

    def fn(x):
        seen.append((threading.get_ident(), torch.get_num_threads(), kernel_threads(),
                     torch.is_inference_mode_enabled()))
        cpus.setdefault(threading.get_ident(), set()).add(frozenset(os.sched_getaffinity(0)))
        return x @ w

    with torch.inference_mode():
        out = cpu_threads.map_one_thread_each(fn, xs, 2)
    print("threads, counts:", [(t == threading.get_ident(), n, k, inf) for t, n, k, inf in seen])
    assert len(out) == len(xs)
    for x, y in zip(xs, out):
        torch.testing.assert_close(y, x @ w, atol=1e-5, rtol=1e-5)
    assert {(n, k, inf) for _, n, k, inf in seen} == {(1, 1, True)}
    assert threading.get_ident() not in {t for t, *_ in seen} and len({t for t, *_ in seen}) <= 2
    print("CPUs of each pool thread:", list(cpus.values()))
    for masks in cpus.values():
        assert len(masks) == 1 and len(next(iter(masks))) == 1 and next(iter(masks)) <= mine
    if len(mine) > 1 and len(cpus) == 2:
        assert len(set().union(*cpus.values())) == 2, "the two pool threads share a CPU"
    assert torch.get_num_threads() == 2 and kernel_threads() == 2 and os.sched_getaffinity(0) == mine
    assert cpu_threads.map_one_thread_each(lambda _: torch.is_grad_enabled(), [0, 1], 2) == [True, True]


def test_map_one_thread_each_declines_what_it_cannot_share(two_threads):
    """None, nothing run: one worker, fewer items than workers (the caller's
    threads do those better), or a call from a pool thread (it would wait on its
    own pool)."""
    ran = []
    assert cpu_threads.map_one_thread_each(ran.append, [1, 2, 3], 1) is None
    assert cpu_threads.map_one_thread_each(ran.append, [1], 2) is None
    assert ran == []
    if cpu_threads.omp_set_num_threads() is not None:  # a pool thread's own call runs nothing there
        nested = cpu_threads.map_one_thread_each(lambda _: cpu_threads.map_one_thread_each(ran.append, [1, 2], 2),
                                                 [0, 1], 2)
        assert nested == [None, None] and ran == []


@needs_per_thread_counts
def test_map_one_thread_each_raises_an_items_error_and_stays_usable(two_threads):
    def fn(i):
        if i == 3:
            raise ValueError("item 3")
        return i * 2

    with pytest.raises(ValueError, match="item 3"):
        cpu_threads.map_one_thread_each(fn, list(range(8)), 2)
    assert cpu_threads.map_one_thread_each(fn, [0, 1, 2], 2) == [0, 2, 4]


@needs_per_thread_counts
def test_pool_threads_follow_the_callers_cpus(two_threads):
    """Pinned one per CPU where the workers are as many as the caller's CPUs;
    otherwise on the caller's whole mask, as it is at the call (a caller moved
    to fewer CPUs takes its pool threads with it)."""
    import os

    mine = os.sched_getaffinity(0)
    if len(mine) != 2:
        pytest.skip(f"needs a process on exactly 2 CPUs, this one has {len(mine)}")
    masks = lambda: set(cpu_threads.map_one_thread_each(lambda _: frozenset(os.sched_getaffinity(0)), range(8), 2))
    assert masks() <= {frozenset({c}) for c in mine}
    one = {min(mine)}
    os.sched_setaffinity(0, one)
    try:
        moved = masks()
    finally:
        os.sched_setaffinity(0, mine)
    print("pinned:", masks(), "caller on one CPU:", moved)
    assert moved == {frozenset(one)}
