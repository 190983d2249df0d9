"""``encdec serve --ray --ingress haproxy`` on a local Ray cluster (2 CPUs,
127.0.0.1, no dashboard): ``test_serve``'s checks run again behind Serve's HAProxy
ingress (the same test functions, collected here with this module's ``cluster``):
64 concurrent completions and 16 transcriptions equal offline ``LLM`` with both
replicas serving, ``encdec serve``'s error shapes, a stream, a Realtime session
through HAProxy; and disaggregated mode. Then what a killed replica does behind
HAProxy, which differs from Serve's proxy (no Python middleware sees the loss):
the streams it had started end cut short, a request it held unanswered is sent
again to the other replica (or gets HAProxy's bare 500, or a closed connection),
the other replica's requests complete, and the next requests succeed.

Skipped, saying why, without an HAProxy binary or a Ray without the ingress."""
from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from encdec.serve_ray.ingress import check_ingress  # noqa: E402

try:
    check_ingress("haproxy")
except ValueError as e:
    pytest.skip(f"no HAProxy ingress here: {e}", allow_module_level=True)

from tests.ray import local_cluster  # noqa: E402
from tests.ray.local_cluster import BART_KW, STEP_SECONDS, WHISPER_KW, deadline  # noqa: E402
from tests.ray.test_serve import (  # noqa: E402
    _complete_all,
    _deploy,
    _free_port,
    _prompts,
    _replica_actors,
    _wait_replicas_running,
    test_concurrent_completions_equal_offline_on_both_replicas,
    test_errors_keep_encdec_serve_shapes,
    test_stream_through_the_ingress,
)

# Collected here again, behind HAProxy (their fixtures resolve to this module's cluster),
# in the order of the names here: the BART app's tests, then the speech app's (imported
# at the end), as each app replaces the one before.
__all__ = ["whisper_llm", "test_concurrent_completions_equal_offline_on_both_replicas",
           "test_concurrent_transcriptions_equal_offline", "test_errors_keep_encdec_serve_shapes",
           "test_realtime_session_through_the_ingress", "test_stream_through_the_ingress"]

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster():
    """A quiet local cluster with Serve behind HAProxy on a free loopback port; yields
    its base URL. Teardown checks that all its processes exit."""
    yield from local_cluster.serving("encdec-haproxy-", _free_port(), "haproxy")


def _wait_routed(base: str, replicas: int, model: str) -> None:
    """Until HAProxy has routed to ``replicas`` replicas serving ``model``: Serve reports
    the app running when its replicas are, and HAProxy's configuration follows a moment
    later (Serve sends it the replicas' ports, and it reloads; until then the app
    deployed before may still answer)."""
    seen: set[str] = set()
    end = time.monotonic() + STEP_SECONDS
    while len(seen) < replicas:
        assert time.monotonic() < end, f"HAProxy routed to {seen} serving {model} in {STEP_SECONDS} s"
        r = httpx.get(base + "/v1/models", timeout=60)
        if r.status_code == 200 and r.json()["data"][0]["id"] == model:
            seen.add(r.headers["x-encdec-replica"])
        time.sleep(0.1)


@pytest.fixture(scope="module")
def bart_app(cluster, tiny_bart):
    _deploy(tiny_bart, "tiny-bart", BART_KW)
    _wait_routed(cluster, 2, "tiny-bart")
    return cluster


@pytest.fixture(scope="module")
def whisper_app(cluster, ct2_dir):
    _deploy(str(ct2_dir), "tiny.en", WHISPER_KW)
    _wait_routed(cluster, 2, "tiny.en")
    return cluster


async def _one(client, base: str, i: int, stream: bool, seen: dict) -> tuple:
    """A long completion (8 choices of 400 tokens); (replica, status, outcome) where
    the outcome is the last SSE line, the body, or the exception's class name. A
    stream's replica goes into ``seen`` as soon as its headers arrive."""
    body = {"model": "tiny-bart", "prompt": _prompts(8)[i % 8], "max_tokens": 400, "n": 8,
            "ignore_eos": True, "stream": stream}
    try:
        if not stream:
            r = await client.post(base + "/v1/completions", json=body)
            return r.headers.get("x-encdec-replica"), r.status_code, r.text
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            seen[i] = r.headers.get("x-encdec-replica")
            lines = [line async for line in r.aiter_lines() if line]
            return seen[i], r.status_code, lines[-1]
    except httpx.HTTPError as e:
        return seen.get(i), None, type(e).__name__


MORE_STREAMS = 8  # the most streams opened after the first 8, one at a time, to reach the second replica


async def _streams_on_both(client, base: str, tasks: dict, streamed: set, seen: dict) -> None:
    """Until streams have started on both replicas. HAProxy balances by least
    connections, so 8 requests sent at once alternate between the replicas in the
    order they arrive, and when that order is 0, 1, 2, ... every stream (the even
    ones) lands on one replica. While every started stream is on one replica,
    another stream is opened once those have started (leastconn sends it to the
    replica with fewer), up to ``MORE_STREAMS``; bounded in time too."""
    end = time.monotonic() + STEP_SECONDS
    while len(set(seen.values())) < 2:
        assert time.monotonic() < end and not all(t.done() for t in tasks.values()), \
            f"streams did not start on both replicas: {seen}"
        if streamed <= set(seen) and len(streamed) < 4 + MORE_STREAMS:
            i = len(tasks)
            streamed.add(i)
            tasks[i] = asyncio.ensure_future(_one(client, base, i, True, seen))
        await asyncio.sleep(0.02)


def test_killed_replica_behind_haproxy(bart_app):
    """8 long requests, streamed and not, over both replicas (more streams, one at a
    time, until streams run on both); the replica of the first stream is killed
    once streams have started on both. Its started streams end cut short (an
    incomplete body: no error event, no Python in between), its unanswered
    requests are sent to the other replica, or get HAProxy's 500, or (a request
    HAProxy had sent on a kept-alive connection to it) a connection closed without
    an answer, which clients retry; the other replica's streams complete; Serve
    restarts it and the next requests succeed."""
    actors = _replica_actors()
    seen: dict[int, str] = {}  # stream -> the replica that answered its headers
    streamed = set(range(0, 8, 2))

    async def main() -> tuple[str, dict]:
        async with httpx.AsyncClient(timeout=STEP_SECONDS) as client:
            tasks = {i: asyncio.ensure_future(_one(client, bart_app, i, i in streamed, seen)) for i in range(8)}
            await _streams_on_both(client, bart_app, tasks, streamed, seen)
            victim = seen[min(seen)]
            await asyncio.to_thread(ray.kill, actors[victim], no_restart=True)
            return victim, dict(zip(tasks, await asyncio.gather(*tasks.values())))

    with deadline(STEP_SECONDS, "requests with a replica killed"):
        victim, results = asyncio.run(main())
    streams = [r for i, r in results.items() if i in streamed]
    plain = [r for i, r in results.items() if i not in streamed]
    assert any(r[2] == "RemoteProtocolError" for r in streams), f"no stream of {victim} was cut: {results}"
    for replica, status, outcome in streams:
        if replica == victim:  # cut short, or ended before the kill
            assert outcome in ("RemoteProtocolError", "data: [DONE]"), results
        else:
            assert (status, outcome) == (200, "data: [DONE]"), results
    for replica, status, outcome in plain:  # sent again and answered, or one of HAProxy's two failures
        assert (status == 200 and replica != victim and '"text"' in outcome) or \
            (status, outcome) in ((500, "Internal Server Error"), (None, "RemoteProtocolError")), results
    _wait_replicas_running(2, STEP_SECONDS)
    with deadline(STEP_SECONDS, "requests after the restart"):
        after = asyncio.run(_complete_all(bart_app, _prompts(8), max_tokens=8, temperature=0.0))
    assert not [r for r in after if isinstance(r, BaseException)], after
    assert victim not in _replica_actors()


def test_disaggregated_behind_haproxy_equals_offline(cluster, tiny_bart):
    """1 encoder worker + 1 decoder engine behind HAProxy: completions equal offline
    (the encoder calls go between replicas as behind Serve's proxy)."""
    from tests.ray.test_disaggregate import _check_completions
    from tests.ray.test_disaggregate import _deploy as _deploy_split

    _deploy_split(cluster, tiny_bart, "tiny-bart-split", BART_KW, 1, 1)
    _wait_routed(cluster, 1, "tiny-bart-split")
    assert len(_check_completions(cluster, tiny_bart, "tiny-bart-split", 8)) == 8  # and each equal offline


from tests.ray.test_serve import (  # noqa: E402 - after the BART app's tests (see __all__)
    test_concurrent_transcriptions_equal_offline,
    test_realtime_session_through_the_ingress,
    whisper_llm,
)
