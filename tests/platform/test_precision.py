"""The reduced-precision rule on CPU: a dtype that runs slower than float32 is
refused with the measured factor, a faster one accepted, for bfloat16 and
float16 alike; the measurement is taken once per host setting and kept on disk.
The ratios are given through ``$ENCDEC_PRECISION_RATIOS`` so the rule's tests do
not depend on this host's speed; one test runs the real probe."""
from __future__ import annotations

import json

import pytest
import torch

from encdec.platform import precision

CPU = torch.device("cpu")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache file (the kernels keep theirs), no ratio given, nothing
    measured in this process yet."""
    monkeypatch.setattr(precision, "cache_file", lambda: str(tmp_path / "precision.json"))
    monkeypatch.delenv(precision.RATIOS_ENV, raising=False)
    monkeypatch.setattr(precision, "_measured", {})
    return tmp_path


@pytest.mark.parametrize("dtype", precision.REDUCED)
def test_refused_where_slower_with_the_factor(fresh, monkeypatch, dtype):
    name = str(dtype).removeprefix("torch.")
    monkeypatch.setenv(precision.RATIOS_ENV, f"{name}=6.3")
    with pytest.raises(ValueError, match=rf"dtype='{name}' runs 6\.3x slower than float32 on this CPU"):
        precision.check_cpu_dtype(CPU, dtype)


@pytest.mark.parametrize("dtype", precision.REDUCED)
def test_accepted_where_faster(fresh, monkeypatch, dtype):
    name = str(dtype).removeprefix("torch.")
    monkeypatch.setenv(precision.RATIOS_ENV, f"{name}=0.42")
    precision.check_cpu_dtype(CPU, dtype)


def test_each_dtype_by_its_own_ratio(fresh, monkeypatch):
    monkeypatch.setenv(precision.RATIOS_ENV, "bfloat16=0.4, float16=5")
    precision.check_cpu_dtype(CPU, torch.bfloat16)
    with pytest.raises(ValueError, match=r"'float16' runs 5\.0x slower"):
        precision.check_cpu_dtype(CPU, torch.float16)


def test_float32_and_other_devices_are_never_measured(fresh, monkeypatch):
    monkeypatch.setattr(precision, "probe", lambda dtype: pytest.fail("probed"))
    precision.check_cpu_dtype(CPU, torch.float32)
    precision.check_cpu_dtype(torch.device("cuda"), torch.float16)
    precision.check_cpu_dtype(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("text", ["bfloat16", "bfloat16=fast", "float16=-2", "bfloat16=0"])
def test_a_malformed_ratio_is_refused_naming_the_variable(fresh, monkeypatch, text):
    monkeypatch.setenv(precision.RATIOS_ENV, text)
    with pytest.raises(ValueError, match=precision.RATIOS_ENV):
        precision.check_cpu_dtype(CPU, torch.bfloat16)


def test_probe_once_then_the_cache(fresh, monkeypatch):
    """The real probe runs once (bfloat16: the quicker of the two); a later process
    reads the cache file, keyed by this host's setting, and does not probe again."""
    ratio, source = precision.time_ratio(torch.bfloat16)
    assert source == "measured" and 0.01 < ratio < 100
    data = json.loads((fresh / "precision.json").read_text())
    assert data == {precision.host_key(): {"bfloat16": ratio}}
    monkeypatch.setattr(precision, "probe", lambda dtype: pytest.fail("probed again"))
    assert precision.time_ratio(torch.bfloat16) == (ratio, "measured")  # this process's memo
    monkeypatch.setattr(precision, "_measured", {})  # as a new process
    assert precision.time_ratio(torch.bfloat16) == (ratio, "cached")


def test_a_cached_slowdown_is_refused_and_says_where_it_came_from(fresh, monkeypatch):
    (fresh / "precision.json").write_text(json.dumps({precision.host_key(): {"float16": 4.5}}))
    monkeypatch.setattr(precision, "probe", lambda dtype: pytest.fail("probed despite the cache"))
    with pytest.raises(ValueError, match=r"4\.5x slower .*as measured here before"):
        precision.check_cpu_dtype(CPU, torch.float16)


def test_another_setting_measures_again(fresh, monkeypatch):
    """A cache entry for another thread count (or CPU, or torch) is not this one's."""
    threads = torch.get_num_threads()
    (fresh / "precision.json").write_text(json.dumps({precision.host_key(): {"float16": 4.5}}))
    probed = []
    monkeypatch.setattr(precision, "probe", lambda dtype: probed.append(dtype) or 0.5)
    torch.set_num_threads(threads + 1)
    try:
        assert precision.time_ratio(torch.float16) == (0.5, "measured")
    finally:
        torch.set_num_threads(threads)
    assert probed == [torch.float16]
    assert len(json.loads((fresh / "precision.json").read_text())) == 2  # both settings kept



def test_kept_beside_the_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("ENCDEC_CACHE_DIR", str(tmp_path))
    assert precision.cache_file() == str(tmp_path / "precision.json")


def test_llm_refuses_a_slower_dtype_before_loading(fresh, monkeypatch, tiny_bart):
    from encdec import LLM

    monkeypatch.setenv(precision.RATIOS_ENV, "float16=5.5,bfloat16=0.5")
    with pytest.raises(ValueError, match=r"dtype='float16' runs 5\.5x slower than float32"):
        LLM(tiny_bart, dtype="float16")
    assert LLM(tiny_bart, dtype="bfloat16", kv_cache_memory=16 << 20).llm_engine is not None  # faster: loads
    monkeypatch.setenv(precision.RATIOS_ENV, "bfloat16=1.2")
    with pytest.raises(ValueError, match=r"dtype='bfloat16' runs 1\.2x slower"):
        LLM(tiny_bart, dtype="bfloat16")
