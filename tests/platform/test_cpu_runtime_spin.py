"""A process whose OpenMP runtime loaded without OMP_WAIT_POLICY=PASSIVE gets
one warning naming the fix (its spinning threads take the cores the C kernels
need); with PASSIVE, none."""
from __future__ import annotations

import logging

import torch

from encdec.platform import cpu_runtime


def test_a_spinning_runtime_is_named_once(monkeypatch, caplog):
    torch.zeros(64, 64) @ torch.zeros(64, 64)  # the runtime is loaded
    monkeypatch.setattr(cpu_runtime, "_warned_spinning", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with caplog.at_level(logging.WARNING, logger=cpu_runtime.__name__):
        assert cpu_runtime.warn_if_openmp_spins()
        assert not cpu_runtime.warn_if_openmp_spins()  # once
    assert sum("OMP_WAIT_POLICY=PASSIVE" in r.getMessage() for r in caplog.records) == 1


def test_passive_is_not_warned(monkeypatch, caplog):
    monkeypatch.setattr(cpu_runtime, "_warned_spinning", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with caplog.at_level(logging.WARNING, logger=cpu_runtime.__name__):
        assert not cpu_runtime.warn_if_openmp_spins()
    assert not caplog.records
