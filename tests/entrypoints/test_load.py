"""Bounded loopback load: 200 streaming completion clients, 20 transcription clients, 50
clients that hang up mid-stream; outputs exact, 0 errors, blocks freed, counters exact."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from encdec import SamplingParams

from .conftest import API_KEY

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def prompts(n: int) -> list[str]:
    words = "rain spain plain fox dog cache block batch token model text audio".split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 9)) + f" {i}" for i in range(n)]


async def stream_completion(client: httpx.AsyncClient, body: dict, *, hang_up: bool = False) -> dict:
    text, usage, finish = "", None, None
    async with client.stream("POST", "/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
            if hang_up and text:
                return {}
    return {"text": text, "usage": usage, "finish": finish}


def test_200_streaming_clients_50_hang_ups_and_exact_counters(bart_server, bart_llm):
    ps = prompts(200)
    max_tokens = [8 + i % 17 for i in range(200)]
    refs = bart_llm.generate(ps, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                  for m in max_tokens], use_tqdm=False)
    before = bart_server.metrics()

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=bart_server.v1, headers=AUTH, limits=limits,
                                     timeout=httpx.Timeout(180.0)) as client:
            body = lambda i: {"model": "tiny-bart", "prompt": ps[i], "max_tokens": max_tokens[i],  # noqa: E731
                              "temperature": 0, "ignore_eos": True,
                              "stream_options": {"include_usage": True}}
            return await asyncio.wait_for(asyncio.gather(*(stream_completion(client, body(i))
                                                           for i in range(200))), 150)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert [r["text"] for r in results] == [r.outputs[0].text for r in refs]
    assert all(r["finish"] == "length" for r in results)
    assert [r["usage"]["completion_tokens"] for r in results] == max_tokens
    after = bart_server.metrics()

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:generation_tokens_total{}") == sum(max_tokens)
    assert delta("vllm:prompt_tokens_total{}") == sum(r["usage"]["prompt_tokens"] for r in results)
    assert delta("vllm:request_success_total{finished_reason=length}") == 200
    assert delta("vllm:request_success_total{finished_reason=abort}") == 0
    assert delta("vllm:e2e_request_latency_seconds_count{}") == 200
    assert delta("vllm:time_to_first_token_seconds_count{}") == 200
    assert delta("vllm:inter_token_latency_seconds_count{}") == sum(max_tokens) - 200
    assert elapsed < 150

    # 50 clients hang up after their first text; every block comes back.
    async def hang_ups():
        async with httpx.AsyncClient(base_url=bart_server.v1, headers=AUTH, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as client:
            body = {"model": "tiny-bart", "prompt": "The rain in Spain", "max_tokens": 240,
                    "temperature": 0, "ignore_eos": True}
            await asyncio.gather(*(stream_completion(client, body, hang_up=True) for _ in range(50)))

    asyncio.run(hang_ups())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = bart_server.metrics()
        if m["vllm:kv_cache_usage_perc{}"] == 0 and m["vllm:num_requests_running{}"] == 0:
            break
        time.sleep(0.2)
    m = bart_server.metrics()
    assert m["vllm:kv_cache_usage_perc{}"] == 0
    assert m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
    aborted = m["vllm:request_success_total{finished_reason=abort}"] - after["vllm:request_success_total{finished_reason=abort}"]
    finished = m["vllm:request_success_total{finished_reason=length}"] - after["vllm:request_success_total{finished_reason=length}"]
    assert aborted + finished == 50 and aborted >= 45  # a hang-up can lose the race to the last token


def test_20_concurrent_transcription_clients(whisper_server, whisper_llm):
    from openai import AsyncOpenAI

    from encdec.transcription import format_transcription

    from .conftest import SPEECH

    clips = [SPEECH / f"s{i:02d}.wav" for i in range(20)]
    refs = whisper_llm.transcribe([str(c) for c in clips], use_tqdm=False)
    before = whisper_server.metrics()

    async def main():
        async with AsyncOpenAI(base_url=whisper_server.v1, api_key="x", max_retries=0, timeout=180) as client:
            async def one(i, clip):
                data = (clip.name, clip.read_bytes())
                if i % 2:  # half stream, half plain text
                    events = [e async for e in await client.audio.transcriptions.create(
                        model="tiny.en", file=data, stream=True)]
                    assert "".join(e.delta for e in events[:-1]) == events[-1].text
                    return events[-1].text + "\n"
                return await client.audio.transcriptions.create(model="tiny.en", file=data,
                                                                response_format="text")
            return await asyncio.wait_for(asyncio.gather(*(one(i, c) for i, c in enumerate(clips))), 170)

    assert asyncio.run(main()) == [format_transcription(r, "txt") for r in refs]
    after = whisper_server.metrics()
    seconds = after["encdec:audio_seconds_transcribed_total{}"] - before["encdec:audio_seconds_transcribed_total{}"]
    assert seconds == pytest.approx(sum(r.duration for r in refs), abs=1e-3)
    stops = after["vllm:request_success_total{finished_reason=stop}"] - before["vllm:request_success_total{finished_reason=stop}"]
    assert stops == 20  # one 30 s window per clip, each ended by <|endoftext|>
    assert after["vllm:kv_cache_usage_perc{}"] == 0
