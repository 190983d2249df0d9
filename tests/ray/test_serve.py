"""``encdec serve --ray`` on a local Ray cluster (2 CPUs, 127.0.0.1, no dashboard):
the official ``openai`` client against the Ray Serve ingress with 2 engine
replicas gets what offline ``LLM`` gives; both replicas serve; a Realtime session
works through the ingress; a replica killed mid-load fails only its own requests
(503 in OpenAI's error shape) and the next requests succeed.

One cluster and one Serve instance serve the module; each model's app replaces
the previous one (2 CPUs hold one pair of engines). Everything runs under a
deadline, since the machine is shared and slow at times."""
from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from encdec import LLM, SamplingParams  # noqa: E402
from encdec.serve_ray import APP_NAME, build  # noqa: E402
from tests.ray import local_cluster  # noqa: E402
from tests.ray.local_cluster import BART_KW, SPEECH, STEP_SECONDS, WHISPER_KW, deadline  # noqa: E402

pytestmark = [pytest.mark.ray]

MODEL = "tiny-bart"  # the served name of the BART app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ingress", ["serve", "haproxy"])
def test_cli_serves_and_stops_on_sigint(tiny_bart, tmp_path, ingress):
    """``encdec serve MODEL --ray [--ingress haproxy]`` (its own local cluster, in a
    subprocess) answers a completion, and SIGINT stops it with exit status 0 (it runs
    before this module's cluster starts)."""
    import subprocess
    import sys

    from encdec.serve_ray.ingress import check_ingress

    try:
        check_ingress(ingress)
    except ValueError as e:
        pytest.skip(f"no HAProxy ingress here: {e}")
    port, log = _free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "encdec.entrypoints.cli", "serve", tiny_bart, "--ray",
                                 "--replicas", "1", "--port", str(port), "--num-threads", "1", "--ingress", ingress,
                                 "--kv-cache-memory", str(BART_KW["kv_cache_memory"]), "--swap-space", "0.05"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        end = time.monotonic() + STEP_SECONDS
        while time.monotonic() < end and proc.poll() is None:
            if "replica(s) of" in log.read_text():  # printed once deployed
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"not healthy: {log.read_text()[-2000:]}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        assert client.completions.create(model=tiny_bart, prompt="hello", max_tokens=4).choices[0].text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster():
    """A quiet local cluster with Serve on a free loopback port; yields its base URL.
    Teardown checks that all its processes exit."""
    yield from local_cluster.serving("encdec-serve-", _free_port())


def _deploy(model: str, served_name: str, kv: dict) -> None:
    """``model`` on 2 replicas (1 CPU and 1 torch thread each) behind the ingress
    (bodies up to 1 MiB of audio); replaces the app deployed before."""
    app = build({"model": model, "replicas": 2, "num_threads": 1, "served_model_name": served_name,
                 "max_audio_mb": 1, "kv_cache_memory": kv["kv_cache_memory"], "swap_space": kv["swap_space"]})
    with deadline(STEP_SECONDS, f"deploying {served_name}"):
        serve.run(app, name=APP_NAME, route_prefix="/")


def _metric_by_replica(base: str, name: str) -> dict[str, float]:
    """``name``'s samples summed per ``replica`` label (the ingress's merged /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def _wait_served(base: str, name: str, total: float) -> dict[str, float]:
    """Per-replica counts once the board shows ``total`` (replicas push each second)."""
    for _ in range(40):
        counts = _metric_by_replica(base, name)
        if sum(counts.values()) >= total:
            return counts
        time.sleep(0.5)
    return counts


def _prompts(n: int) -> list[str]:
    words = ("rain spain plain fox dog encoder decoder summary token batch cache block "
             "speech text numbers Ada Alan 1984 42 pages memory").split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 23)) for i in range(n)]


@pytest.fixture(scope="module")
def bart_app(cluster, tiny_bart):
    _deploy(tiny_bart, "tiny-bart", BART_KW)
    return cluster


async def _complete_all(base: str, prompts: list[str], **kw) -> list:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        async def one(prompt):
            raw = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, **kw)
            return raw.headers.get("x-encdec-replica"), raw.parse()

        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)


@pytest.mark.parametrize("n", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_concurrent_completions_equal_offline_on_both_replicas(bart_app, tiny_bart, n):
    prompts = _prompts(n)
    llm = LLM(tiny_bart, num_threads=1, **BART_KW)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16),
                                                    use_tqdm=False)]
    before = sum(_metric_by_replica(bart_app, "vllm:request_success_total").values())
    with deadline(STEP_SECONDS, f"{n} completions"):
        results = asyncio.run(_complete_all(bart_app, prompts, max_tokens=16, temperature=0.0))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert [r[1].choices[0].text for r in results] == want
    counts = _wait_served(bart_app, "vllm:request_success_total", before + n)
    assert sum(counts.values()) == before + n
    assert len({r[0] for r in results}) == 2 and len([c for c in counts.values() if c > 0]) == 2, counts


def test_errors_keep_encdec_serve_shapes(bart_app):
    r = httpx.post(bart_app + "/v1/completions", content=b"x", timeout=60)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.get(bart_app + "/v1/nothere", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(bart_app + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(bart_app + "/v1/models", timeout=60).json()["data"][0]["id"] == "tiny-bart"
    r = httpx.post(bart_app + "/v1/completions", content=b"x" * (2 << 20), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_stream_through_the_ingress(bart_app):
    client = openai.OpenAI(base_url=bart_app + "/v1", api_key="none", max_retries=0, timeout=60)
    prompt = _prompts(3)[2]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0)
    with deadline(STEP_SECONDS, "a stream"):
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, stream=True)]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text


def _replica_actors() -> dict[str, object]:
    """The EngineReplica actors by replica id (the ``x-encdec-replica`` header)."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if "#EngineReplica#" in name:
            out[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=entry["namespace"])
    return out


def _wait_replicas_running(n: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app = serve.status().applications.get(APP_NAME)
        dep = app and app.deployments.get("EngineReplica")
        if dep and dep.status == "HEALTHY" and dep.replica_states.get("RUNNING", 0) == n:
            return
        time.sleep(0.5)
    raise TimeoutError(f"EngineReplica not back to {n} running replicas in {seconds} s")


def _in_flight(actor) -> int:
    """Requests the replica holds now (Serve's own count, the one its router reads)."""
    return ray.get(actor.get_num_ongoing_requests.remote(), timeout=60)


async def _until(condition, seconds: float, what: str) -> None:
    """Poll the async ``condition()`` until it holds; TimeoutError past ``seconds``."""
    end = time.monotonic() + seconds
    while not await condition():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {seconds} s")
        await asyncio.sleep(0.05)


async def _load(base: str, victim: str, actor) -> tuple[float, int, list, list]:
    """8 clients sending long completions back to back. Once both replicas have
    answered and ``victim`` holds requests, it is killed; the load goes on until
    the other replica has answered a request sent after the kill. Returns the
    kill's time, the requests the victim held just before, the answers (sent,
    done, replica, completion) and the errors (done, error)."""
    prompts, answers, errors, held = _prompts(64), [], [], [0]
    stop = asyncio.Event()
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        async def worker(i: int) -> None:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    raw = await client.completions.with_raw_response.create(
                        model=MODEL, prompt=prompts[i % 64], max_tokens=120 + i % 120, temperature=0.0, n=4,
                        extra_body={"ignore_eos": True})
                    answers.append((sent, time.monotonic(), raw.headers.get("x-encdec-replica"), raw.parse()))
                except openai.APIError as e:
                    errors.append((time.monotonic(), e))
                i += 8

        async def both_answered() -> bool:
            return len({a[2] for a in answers}) == 2 or bool(errors)

        async def victim_busy() -> bool:
            held[0] = await asyncio.to_thread(_in_flight, actor)
            return held[0] >= 1

        async def survivor_answered() -> bool:
            return any(sent > killed_at and replica != victim for sent, _, replica, _ in answers)

        workers = [asyncio.ensure_future(worker(i)) for i in range(8)]
        try:
            await _until(both_answered, STEP_SECONDS, "both replicas answering")
            await _until(victim_busy, STEP_SECONDS, f"replica {victim} holding requests")
            killed_at = time.monotonic()
            await asyncio.to_thread(ray.kill, actor, no_restart=True)
            await _until(survivor_answered, STEP_SECONDS, "the other replica answering after the kill")
        finally:
            stop.set()
            await asyncio.gather(*workers)
    return killed_at, held[0], answers, errors


def test_killed_replica_fails_only_its_requests(bart_app):
    """Load on both replicas; one replica is killed while it holds requests: those
    are 503s in OpenAI's shape naming it, the other replica's go on (it answers
    requests sent after the kill); Serve restarts it and the next requests succeed.
    Every wait is on a condition, with a deadline (the host may be loaded)."""
    actors = _replica_actors()
    victim = sorted(actors)[0]
    with deadline(STEP_SECONDS, "load with a replica killed"):
        killed_at, held, answers, errors = asyncio.run(_load(bart_app, victim, actors[victim]))
    timeline = sorted([(round(t - killed_at, 2), r) for _, t, r, _ in answers]
                      + [(round(t - killed_at, 2), repr(e)) for t, e in errors])
    assert errors, f"no request was lost: {victim} held {held} when killed: {timeline}"
    for _, e in errors:
        assert isinstance(e, openai.APIStatusError) and e.status_code == 503, timeline
        assert e.body["type"] == "service_unavailable" and f"replica {victim} " in e.body["message"], e.body
    assert all(len(c.choices[0].text) > 0 for *_, c in answers)
    _wait_replicas_running(2, STEP_SECONDS)
    with deadline(STEP_SECONDS, "requests after the restart"):
        after = asyncio.run(_complete_all(bart_app, _prompts(8), max_tokens=8, temperature=0.0))
    assert not [r for r in after if isinstance(r, BaseException)], after
    assert victim not in _replica_actors()


@pytest.fixture(scope="module")
def whisper_app(cluster, ct2_dir):
    _deploy(str(ct2_dir), "tiny.en", WHISPER_KW)
    return cluster


@pytest.fixture(scope="module")
def whisper_llm(ct2_dir):
    return LLM(str(ct2_dir), num_threads=1, **WHISPER_KW)


@pytest.mark.parametrize("n", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_concurrent_transcriptions_equal_offline(whisper_app, whisper_llm, n):
    paths = sorted(SPEECH.glob("s*.wav"))[:n]
    assert len(paths) == n
    want = [o.text for o in whisper_llm.transcribe([str(p) for p in paths], use_tqdm=False)]

    async def main():
        async with openai.AsyncOpenAI(base_url=whisper_app + "/v1", api_key="none", max_retries=0,
                                      timeout=180) as client:
            return await asyncio.gather(*(client.audio.transcriptions.create(
                model="tiny.en", file=(p.name, p.read_bytes())) for p in paths))

    with deadline(STEP_SECONDS, f"{n} transcriptions"):
        got = asyncio.run(main())
    assert [t.text for t in got] == want


def _pcm16(wav: np.ndarray) -> bytes:
    return (np.clip(wav, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()


def test_realtime_session_through_the_ingress(whisper_app, whisper_llm):
    """A manual-commit session: the committed turn's text is LLM.transcribe's of the same samples."""
    import soundfile as sf

    wav, rate = sf.read(SPEECH / "s00.wav", dtype="float32")
    pcm = _pcm16(wav)
    (want,) = whisper_llm.transcribe(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0, use_tqdm=False)
    client = openai.OpenAI(base_url=whisper_app + "/v1", api_key="none", max_retries=0, timeout=120)
    done = "conversation.item.input_audio_transcription.completed"
    with deadline(STEP_SECONDS, "a realtime session"), \
            client.realtime.connect(model="tiny.en", extra_query={"intent": "transcription"}) as conn:
        assert conn.recv().type == "session.created"
        conn.send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": rate}, "transcription": {"model": "tiny.en"},
            "turn_detection": None}}}})
        for i in range(0, len(pcm), 3200):
            conn.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 3200]).decode()})
        conn.send({"type": "input_audio_buffer.commit"})
        events = []
        while not events or events[-1].type not in (done, "error",
                                                    "conversation.item.input_audio_transcription.failed"):
            events.append(conn.recv())
    assert events[-1].type == done, [e.type for e in events]
    assert events[-1].transcript == want.text
