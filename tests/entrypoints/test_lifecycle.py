"""Disconnects abort, SIGTERM drains, a dead engine thread shows on /health."""
from __future__ import annotations

import json
import signal
import time

import httpx

from .conftest import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "tiny-bart", "prompt": "The rain in Spain", "max_tokens": 240, "temperature": 0,
        "ignore_eos": True, "stream": True}


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_disconnect_mid_stream_aborts_and_frees_blocks(bart_server):
    before = bart_server.metrics()
    n = 8
    for _ in range(n):
        with httpx.stream("POST", bart_server.v1 + "/completions", json=LONG, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # one chunk, then hang up
    idle = lambda: (lambda m: m["vllm:kv_cache_usage_perc{}"] == 0 and  # noqa: E731
                    m["vllm:num_requests_running{}"] == 0)(bart_server.metrics())
    assert wait_for(idle)
    after = bart_server.metrics()
    key = "vllm:request_success_total{finished_reason=abort}"
    assert after[key] - before[key] == n
    generated = after["vllm:generation_tokens_total{}"] - before["vllm:generation_tokens_total{}"]
    assert generated < n * 240  # stopped early, not run to the end
    ok = httpx.post(bart_server.v1 + "/completions", json={**LONG, "stream": False, "max_tokens": 3},
                    headers=AUTH, timeout=60)
    assert ok.status_code == 200


def test_sigterm_drains_in_flight_requests(tiny_bart, tmp_path):
    """SIGTERM while a request streams: it runs to its end, then the server exits 0.
    The signal goes once the first chunk arrived (the request is running: polling
    the running gauge could miss a request this model finishes in ~0.1 s)."""
    server = start_server(tiny_bart, tmp_path / "log", "--kv-cache-memory", str(64 << 20),
                          "--swap-space", "0.05", "--served-model-name", "tiny-bart")
    try:
        body = {**LONG, "max_tokens": 200, "stream_options": {"include_usage": True}}
        chunks = []
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            chunks.append(next(lines))
            server.proc.send_signal(signal.SIGTERM)
            chunks += list(lines)
        assert chunks[-1] == "data: [DONE]"
        events = [json.loads(c[len("data: "):]) for c in chunks[:-1]]
        assert events[-1]["usage"]["completion_tokens"] == 200  # finished, not cut off
        assert "".join(c["text"] for e in events for c in e["choices"])
        assert server.proc.wait(timeout=60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)


def test_health_503_when_engine_thread_dies(tiny_bart):
    from fastapi.testclient import TestClient

    from encdec.engine.arg_utils import EngineArgs
    from encdec.engine.async_llm_engine import AsyncLLMEngine
    from encdec.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(tiny_bart, kv_cache_memory=8 << 20, swap_space=0.01))

    def broken_step():
        raise RuntimeError("simulated device fault")

    engine.engine.step = broken_step  # the engine thread's next step fails
    with TestClient(build_app(engine, model_name="m")) as client:
        assert client.get("/health").status_code == 200
        resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 503 and "simulated device fault" in resp.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "simulated device fault" in health.json()["error"]["message"]
        resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 503
