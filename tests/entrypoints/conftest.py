"""A real ``encdec serve`` in a subprocess on 127.0.0.1, killed by its pid at teardown."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-encdec-test"


@dataclass
class Server:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    model: str
    log: Path

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {"name{label=value,...}": value}, via prometheus' parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log: Path, *extra: str, timeout: float = 120.0) -> Server:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    f = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "encdec.entrypoints.cli", "serve", model, "--port", str(port),
         "--log-level", "warning", *extra],
        stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    f.close()
    server = Server(proc, f"http://127.0.0.1:{port}", model, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log.read_text()[-3000:]}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def bart_server(tiny_bart, tmp_path_factory):
    log = tmp_path_factory.mktemp("bart_server") / "server.log"
    server = start_server(tiny_bart, log, "--kv-cache-memory", str(64 << 20), "--swap-space", "0.05",
                          "--api-key", API_KEY, "--served-model-name", "tiny-bart",
                          "--header-read-timeout", "2", "--body-read-timeout", "3", "--body-timeout", "6")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def whisper_server(ct2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("whisper_server") / "server.log"
    server = start_server(str(ct2_dir), log, "--served-model-name", "tiny.en", "--max-audio-mb", "2",
                          "--kv-cache-memory", str(256 << 20), "--swap-space", "0.1")
    yield server
    stop_server(server)


@pytest.fixture()
def client(bart_server):
    from openai import OpenAI

    return OpenAI(base_url=bart_server.v1, api_key=API_KEY, max_retries=0, timeout=60)


SPEECH = REPO / "tests" / "data" / "speech"


@pytest.fixture(scope="session")
def whisper_llm(ct2_dir):
    from encdec import LLM

    return LLM(str(ct2_dir), kv_cache_memory=256 << 20, swap_space=0.1)


@pytest.fixture(scope="session")
def long_wav(tmp_path_factory) -> Path:
    """~45 s of speech (twelve clips with short pauses): more than one 30 s window."""
    import numpy as np
    import soundfile as sf

    parts = []
    for i in range(12):
        wav, sr = sf.read(SPEECH / f"s{i:02d}.wav", dtype="float32")
        parts += [wav, np.zeros(sr // 4, dtype=np.float32)]
    path = tmp_path_factory.mktemp("long") / "long.wav"
    sf.write(path, np.concatenate(parts), 16000, subtype="PCM_16")
    return path
