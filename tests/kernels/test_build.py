"""The kernel builds: ``build_all`` (and ``encdec build-kernels``) compiles every
missing kernel for an ISA into the cache ``$ENCDEC_CACHE_DIR`` names and nothing
once they are there; a first use that must compile says so once; a build that
fails leaves its callers on torch's path."""
from __future__ import annotations

import logging
import os

import pytest

from encdec.entrypoints.cli import main
from encdec.kernels.cpu import build

# Two of the quickest kernels to compile: the machine's cores are shared.
SMALL = ["greedy_cpu.c", "whisper_rules_cpu.c"]
NOTICE = "compiling CPU kernels"


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty kernel cache, builds limited to SMALL, the notice not yet given,
    and ``load``'s memo cleared before and after (its libraries live in tmp_path)."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("ENCDEC_DISABLE_C_KERNELS", raising=False)
    monkeypatch.setenv("ENCDEC_PRECISION_RATIOS", "bfloat16=0.5")  # build-kernels' bf16 probe: test_precision
    monkeypatch.setattr(build, "sources", lambda: list(SMALL))
    monkeypatch.setattr(build, "_announced", False)
    build.load.cache_clear()
    yield tmp_path
    build.load.cache_clear()


def test_cache_dir_follows_the_env(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    assert build.cache_dir() == str(tmp_path)
    assert build.built_path("greedy_cpu.c", "none").startswith(str(tmp_path) + os.sep)
    monkeypatch.delenv(build.CACHE_ENV)
    assert build.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "encdec")


def test_build_all_compiles_each_missing_kernel_once(fresh_cache):
    isa = build.cpu_isa()
    assert build.build_all(isa) == {s: None for s in SMALL}
    assert sorted(os.listdir(fresh_cache)) == sorted(os.path.basename(build.built_path(s, isa)) for s in SMALL)
    assert build.build_all(isa) == {}  # cached: nothing compiled
    os.unlink(build.built_path(SMALL[1], isa))
    assert build.build_all(isa) == {SMALL[1]: None}


def test_build_kernels_cli(fresh_cache, capsys):
    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out
    assert f"compiled 2 of 2 CPU kernels for {build.cpu_isa()}" in out and str(fresh_cache) in out
    assert main(["build-kernels"]) == 0
    assert "already built" in capsys.readouterr().out
    assert len(os.listdir(fresh_cache)) == 2
    assert main(["build-kernels", "--isa", "none"]) == 0  # every host runs the portable build
    assert len(os.listdir(fresh_cache)) == (2 if build.cpu_isa() == "none" else 4)


def test_a_first_use_that_compiles_says_so_once(fresh_cache, caplog):
    isa = build.cpu_isa()
    with caplog.at_level(logging.INFO, logger="encdec"):
        assert build.load(SMALL[0], "", isa) is not None  # builds both missing kernels
        assert build.load(SMALL[1], "", isa) is not None  # already built with the first
        os.unlink(build.built_path(SMALL[1], isa))
        build.load.cache_clear()
        assert build.load(SMALL[1], "", isa) is not None  # a second build in this process: no second notice
    notices = [r for r in caplog.records if NOTICE in r.getMessage()]
    assert len(notices) == 1
    assert notices[0].levelno >= logging.WARNING  # shown by an unconfigured logger (the CLI's)
    assert "one time" in notices[0].getMessage() and isa in notices[0].getMessage()


def test_no_notice_where_the_kernels_are_built(fresh_cache, caplog):
    build.build_all(notice=False)
    build.load.cache_clear()
    with caplog.at_level(logging.INFO, logger="encdec"):
        assert build.load(SMALL[0], "", build.cpu_isa()) is not None
    assert not [r for r in caplog.records if NOTICE in r.getMessage()]


def test_a_failed_build_declines_and_says_why(fresh_cache, monkeypatch, caplog, capsys):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    isa = build.cpu_isa()
    assert all(error is not None for error in build.build_all(isa).values())
    assert os.listdir(fresh_cache) == []  # no half-written library left behind
    with caplog.at_level(logging.WARNING, logger="encdec"):
        assert build.load(SMALL[0], "the torch path runs", isa) is None
    assert any("building greedy_cpu.c" in r.getMessage() and "the torch path runs" in r.getMessage()
               for r in caplog.records)
    assert main(["build-kernels"]) == 1
    assert "greedy_cpu.c" in capsys.readouterr().err


def test_disabled_kernels_build_nothing(fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("ENCDEC_DISABLE_C_KERNELS", "1")
    with pytest.raises(RuntimeError, match="ENCDEC_DISABLE_C_KERNELS"):
        build.build_all()
    assert build.load(SMALL[0], "", build.cpu_isa()) is None
    assert main(["build-kernels"]) == 1 and "torch's paths" in capsys.readouterr().err
    assert os.listdir(fresh_cache) == []
