"""A local Ray cluster for the tests on 127.0.0.1, bounded in time, whose processes
all end when it stops (the cluster tests must stop by themselves)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

# Shared by the Ray Serve tests: the shipped clips, the engines' cache sizes, a step's time bound.
SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
BART_KW = dict(kv_cache_memory=64 << 20, swap_space=0.05)
WHISPER_KW = dict(kv_cache_memory=256 << 20, swap_space=0.1)
STEP_SECONDS = 300  # generous: other test suites share these 2 cores


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise in the main thread if the block takes longer than ``seconds``."""
    def expire(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def start(prefix: str) -> str:
    """``ray.init`` a quiet 2-CPU local cluster; its temp dir (short: Ray puts unix sockets there)."""
    import ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp_dir = tempfile.mkdtemp(prefix=prefix)
    with deadline(120, "ray.init"):
        ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20,
                 include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir,
                 log_to_driver=False, configure_logging=False)
    return temp_dir


def stop(ours: list, temp_dir: str) -> list:
    """``ray.shutdown``, then end ``ours`` (this process's Ray children) and any child
    started since, by pid; the processes that survived even SIGKILL."""
    import psutil
    import ray

    ray.shutdown()
    ours = ours + [p for p in psutil.Process().children(recursive=True) if p not in ours]
    _, alive = psutil.wait_procs(ours, timeout=30)
    for p in alive:  # idle workers can outlive shutdown on a loaded host: ours, by pid
        p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=10)
    for p in alive:
        p.kill()
    _, left = psutil.wait_procs(alive, timeout=10)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return left


def serving(prefix: str, port: int, ingress: str = "serve"):
    """A generator for a module fixture: a local cluster with Serve (``ingress``:
    its front door) on ``port`` of the loopback; yields its base URL, then
    shuts Serve down and checks that the cluster's processes end."""
    import psutil
    from ray import serve

    from encdec.serve_ray import start_serve

    temp_dir = start(prefix)
    ours = psutil.Process().children(recursive=True)
    try:
        with deadline(120, "serve.start"):
            start_serve("127.0.0.1", port, ingress)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception), deadline(60, "serve.shutdown"):
            serve.shutdown()
        stop(ours, temp_dir)

