"""retain_freed_memory: large freed buffers are reused instead of re-faulted."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc mallopt only")

PROBE = """
import resource, sys, torch
torch.set_num_threads(1)
from encdec.platform.host_allocator import retain_freed_memory
on = retain_freed_memory()
x = torch.ones(16 << 20)  # 64 MiB
faults = []
for _ in range(32):  # an op making a same-sized output each step, as a model's layers do
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = x + 1
    del y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(on, sorted(faults[-8:])[4])  # steady state: glibc's heap settles within a few steps
"""


def probe(env_value: str | None) -> tuple[bool, int]:
    env = dict(os.environ)
    env.pop("ENCDEC_RETAIN_FREED_MEMORY", None)
    if env_value is not None:
        env["ENCDEC_RETAIN_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


def test_reuses_freed_pages_and_can_be_turned_off():
    on, faults_on = probe(None)
    off, faults_off = probe("0")
    assert on and not off
    pages = (64 << 20) // 4096
    assert faults_off > pages // 2  # glibc maps fresh pages for every 64 MiB output
    assert faults_on < pages // 20  # ... and with the setting reuses the freed ones
