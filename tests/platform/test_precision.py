"""The reduced-precision rule on CPU: a dtype that runs slower than float32 is
refused with the measured factor, a faster one accepted, for bfloat16 and
float16 alike; the measurement is taken once per host setting and kept on disk.
The ratios are given through ``$ENCDEC_PRECISION_RATIOS`` so the rule's tests do
not depend on this host's speed; the real probe (the engine end to end, seconds)
runs in the slow tests."""
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
    assert precision.check_cpu_dtype(CPU, dtype) is None  # no ValueError: accepted


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


def test_measured_once_then_the_cache(fresh, monkeypatch, caplog):
    """A measurement is announced once and kept; later calls in this process use
    the memo, a later process reads the cache file, keyed by this host's setting."""
    probed = []
    monkeypatch.setattr(precision, "probe", lambda dtype: probed.append(dtype) or 1.7)
    with caplog.at_level("WARNING", logger=precision.__name__):
        assert precision.time_ratio(torch.bfloat16) == (1.7, "measured")
        assert precision.time_ratio(torch.bfloat16) == (1.7, "measured")  # this process's memo
    assert probed == [torch.bfloat16]
    assert [r.getMessage() for r in caplog.records] == [
        "measuring whether bfloat16 pays on this CPU, one time, ~8 s; `encdec build-kernels` does it at set-up"]
    data = json.loads((fresh / "precision.json").read_text())
    assert data == {precision.host_key(): {"bfloat16": 1.7}}
    monkeypatch.setattr(precision, "_measured", {})  # as a new process
    assert precision.time_ratio(torch.bfloat16) == (1.7, "cached")
    assert precision.time_ratio(torch.bfloat16) == (1.7, "cached")  # the memo keeps where it came from
    assert probed == [torch.bfloat16]


def test_the_key_names_what_changes_the_figure(monkeypatch):
    """The kernels' ISA and the probe's method are part of the key: a float32 run
    without the C kernels, or an older probe's figure, is another measurement."""
    key = precision.host_key()
    assert f"probe {precision.PROBE_VERSION}" in key and "kernels " in key
    monkeypatch.setenv("ENCDEC_DISABLE_C_KERNELS", "1")
    assert precision.host_key() != key and "kernels off" in precision.host_key()


@pytest.mark.slow
def test_the_real_probe_runs_in_a_child_and_is_kept(fresh):
    """The real probe (bfloat16: the quicker of the two), in its child process."""
    ratio, source = precision.time_ratio(torch.bfloat16)
    assert source == "measured" and 0.01 < ratio < 100
    assert json.loads((fresh / "precision.json").read_text()) == {precision.host_key(): {"bfloat16": ratio}}


@pytest.mark.slow
def test_the_probe_runs_the_engine_without_checking_precision(monkeypatch):
    """Both engines are built with the check off (no recursion into the check the
    probe feeds), float32 and the reduced dtype."""
    from encdec.engine.llm_engine import LLMEngine
    from encdec.platform import precision_probe

    built = []
    init = LLMEngine.__init__

    def spy(self, args, **kwargs):
        built.append((args.dtype, kwargs))
        init(self, args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", spy)
    monkeypatch.setattr(precision, "check_cpu_dtype", lambda *a: pytest.fail("the probe checked precision"))
    assert 0.01 < precision_probe.time_ratio(torch.bfloat16) < 100
    assert built == [("float32", {"check_precision": False}), ("bfloat16", {"check_precision": False})]


def test_a_failed_probe_says_why(fresh, monkeypatch):
    """A child that fails is a RuntimeError carrying its error output, and nothing is kept."""
    monkeypatch.setattr(precision.sys, "executable", "false")
    with pytest.raises(RuntimeError, match="measuring bfloat16 on this CPU failed .*exit 1"):
        precision.time_ratio(torch.bfloat16)
    assert not (fresh / "precision.json").exists()


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


@pytest.mark.parametrize(("given", "verdict"), [("0.5", "0.50x float32's time, accepted"),
                                                ("1.7", "1.70x float32's time, refused (slower than float32)")])
def test_build_kernels_gives_the_bfloat16_verdict(fresh, monkeypatch, capsys, given, verdict):
    """Set-up measures bfloat16 after the kernels, so a first use finds it cached."""
    from encdec.entrypoints.cli import main
    from encdec.kernels.cpu import build

    monkeypatch.setattr(build, "sources", lambda: [])  # nothing to compile: the precision step alone
    monkeypatch.setenv(precision.RATIOS_ENV, f"bfloat16={given}")
    assert main(["build-kernels"]) == 0
    assert f"dtype='bfloat16' on this CPU: {verdict} (given;" in capsys.readouterr().out


def test_build_kernels_measures_bfloat16_once_without_the_notice(fresh, monkeypatch, capsys, caplog):
    from encdec.entrypoints.cli import main
    from encdec.kernels.cpu import build

    monkeypatch.setattr(build, "sources", lambda: [])
    probed = []
    monkeypatch.setattr(precision, "probe", lambda dtype: probed.append(dtype) or 0.8)
    assert main(["build-kernels"]) == 0
    monkeypatch.setattr(precision, "_measured", {})  # as a new process
    assert main(["build-kernels"]) == 0  # the second finds it kept
    out = capsys.readouterr().out
    assert "0.80x float32's time, accepted (measured in" in out and "accepted (cached;" in out
    assert probed == [torch.bfloat16]
    assert not [r for r in caplog.records if "measuring" in r.getMessage()]  # build-kernels says it itself
    assert json.loads((fresh / "precision.json").read_text()) == {precision.host_key(): {"bfloat16": 0.8}}
