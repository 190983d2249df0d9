"""``encdec serve --ray --disaggregate encoders=E,decoders=D`` on a local Ray cluster
(2 CPUs, 127.0.0.1): encoder workers run the encoder passes, the decoder engine
takes their outputs through Ray's object store, and the official ``openai``
client gets what one offline ``LLM`` gives, for BART, T5 and Whisper (short clips
and a long-form file); a repeated input moves nothing (the encoder cache holds
it); an encoder worker killed under load costs no request more than a retry or a
503 naming the encoder worker, and nothing hangs."""
from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from encdec import LLM, SamplingParams  # noqa: E402
from encdec.serve_ray import APP_NAME, build, start_serve  # noqa: E402
from tests.ray import local_cluster  # noqa: E402
from tests.ray.local_cluster import BART_KW, SPEECH, STEP_SECONDS, WHISPER_KW, deadline  # noqa: E402

pytestmark = [pytest.mark.ray]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    import psutil

    temp_dir = local_cluster.start("encdec-disagg-")
    ours = psutil.Process().children(recursive=True)
    port = _free_port()
    try:
        with deadline(120, "serve.start"):
            start_serve("127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception), deadline(60, "serve.shutdown"):
            serve.shutdown()
        local_cluster.stop(ours, temp_dir)


def _deploy(base: str, model: str, name: str, kv: dict, encoders: int, decoders: int) -> str:
    """``model`` disaggregated (each worker and engine 0.5 CPU, 1 torch thread);
    replaces the app deployed before; the base URL."""
    app = build({"model": model, "disaggregate": {"encoders": encoders, "decoders": decoders},
                 "replica_cpus": 0.5, "num_threads": 1, "served_model_name": name, "max_audio_mb": 4,
                 "kv_cache_memory": kv["kv_cache_memory"], "swap_space": kv["swap_space"]})
    with deadline(STEP_SECONDS, f"deploying {name} ({encoders} + {decoders})"):
        serve.run(app, name=APP_NAME, route_prefix="/")
    return base


def _counter(base: str, name: str) -> float:
    """``name``'s samples summed over replicas (the ingress's merged /metrics), once pushed."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        total += sum(s.value for s in fam.samples if s.name == name)
    return total


def _wait_counter(base: str, name: str, at_least: float) -> float:
    for _ in range(40):  # replicas push their metrics each second
        value = _counter(base, name)
        if value >= at_least:
            return value
        time.sleep(0.5)
    return _counter(base, name)


def _prompts(n: int) -> list[str]:
    words = ("rain spain plain fox dog encoder decoder summary token batch cache block "
             "speech text numbers Ada Alan 1984 42 pages memory").split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 23)) for i in range(n)]


async def _complete_all(base: str, model: str, prompts: list[str]) -> list:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(client.completions.create(model=model, prompt=p, max_tokens=16,
                                                                temperature=0.0) for p in prompts),
                                    return_exceptions=True)


def _check_completions(base: str, path: str, name: str, n: int) -> list[str]:
    """``n`` completions through the app equal offline; returns their texts."""
    prompts = _prompts(n)
    want = [o.outputs[0].text for o in LLM(path, num_threads=1, **BART_KW).generate(prompts, GREEDY,
                                                                                      use_tqdm=False)]
    with deadline(STEP_SECONDS, f"{n} completions"):
        got = asyncio.run(_complete_all(base, name, prompts))
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors[:3]
    assert [g.choices[0].text for g in got] == want
    return want


def test_bart_one_encoder_one_decoder_equal_offline_and_repeats_move_nothing(cluster, tiny_bart):
    base = _deploy(cluster, tiny_bart, "tiny-bart", BART_KW, 1, 1)
    _check_completions(base, tiny_bart, "tiny-bart", 16)
    moved = _wait_counter(base, "encdec:encoder_transfer_requests_total", 16)
    assert moved == 16 and _counter(base, "encdec:encoder_transfer_bytes_total") > 0
    skipped = _counter(base, "encdec:encoder_transfer_skipped_total")
    _check_completions(base, tiny_bart, "tiny-bart", 4)  # the first 4 again: cached cross tables
    assert _wait_counter(base, "encdec:encoder_transfer_skipped_total", skipped + 4) == skipped + 4
    assert _counter(base, "encdec:encoder_transfer_requests_total") == moved


@pytest.mark.slow  # BART's covers the Ray path; tests/engine/test_encoder_output covers T5's encoder output
def test_t5_one_encoder_one_decoder_equal_offline(cluster, tmp_path_factory):
    from encdec.testing import make_random_t5

    path = make_random_t5(str(tmp_path_factory.mktemp("t5")))
    base = _deploy(cluster, path, "tiny-t5", BART_KW, 1, 1)
    assert len(_check_completions(base, path, "tiny-t5", 8)) == 8
    assert _wait_counter(base, "encdec:encoder_transfer_requests_total", 8) == 8  # the encoder worker ran them


def _wav_bytes(wav: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, wav, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def whisper_app(cluster, ct2_dir):
    return _deploy(cluster, str(ct2_dir), "tiny.en", WHISPER_KW, 2, 1)


@pytest.fixture(scope="module")
def whisper_llm(ct2_dir):
    return LLM(str(ct2_dir), num_threads=1, **WHISPER_KW)


def _clips(n: int) -> list[np.ndarray]:
    """The first ``n`` shipped clips as they reach the server (16-bit WAV)."""
    import soundfile as sf

    return [np.frombuffer(_wav_bytes(sf.read(p, dtype="float32")[0])[44:], "<i2").astype(np.float32) / 32768.0
            for p in sorted(SPEECH.glob("s*.wav"))[:n]]


async def _transcribe_all(base: str, files: list[bytes]) -> list:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=240) as client:
        return await asyncio.gather(*(client.audio.transcriptions.create(
            model="tiny.en", file=(f"{i}.wav", f)) for i, f in enumerate(files)))


def test_whisper_two_encoders_one_decoder_short_and_long_form_equal_offline(whisper_app, whisper_llm):
    clips = _clips(12)
    long_form = np.concatenate(clips)
    assert len(long_form) > 30 * 16000
    audio = clips[:4] + [long_form]
    want = [t.text for t in whisper_llm.transcribe([(a, 16000) for a in audio], use_tqdm=False)]
    moved = _counter(whisper_app, "encdec:encoder_transfer_requests_total")
    with deadline(STEP_SECONDS, "transcriptions"):
        got = asyncio.run(_transcribe_all(whisper_app, [_wav_bytes(a) for a in audio]))
    assert [t.text for t in got] == want
    windows = _wait_counter(whisper_app, "encdec:encoder_transfer_requests_total", moved + 6) - moved
    assert windows >= 6  # 4 clips, and the long-form file's windows (2 or more)


def test_killed_encoder_worker_costs_a_retry_or_a_503_and_nothing_hangs(whisper_app, whisper_llm):
    """2 encoder workers + 1 decoder engine under load (8 clients transcribing clips
    back to back: an encoder call is nearly always in flight); one encoder worker is
    killed: every answer is the offline one, every failure a 503 naming the encoder
    worker, and the requests after it succeed."""
    clips = _clips(8)
    want = {i: t.text for i, t in enumerate(whisper_llm.transcribe([(c, 16000) for c in clips], use_tqdm=False))}
    files = [_wav_bytes(c) for c in clips]
    victim = _encoder_actors()[0]
    answers, errors = [], []

    async def main():
        stop = asyncio.Event()
        async with openai.AsyncOpenAI(base_url=whisper_app + "/v1", api_key="none", max_retries=0,
                                      timeout=240) as client:
            async def worker(i: int) -> None:
                while not stop.is_set():
                    try:
                        t = await client.audio.transcriptions.create(model="tiny.en", file=(f"{i}.wav", files[i]))
                        answers.append((i, t.text))
                    except openai.APIError as e:
                        errors.append(e)

            workers = [asyncio.ensure_future(worker(i)) for i in range(8)]
            while len(answers) < 4:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(ray.kill, victim, no_restart=True)
            await asyncio.sleep(3.0)
            stop.set()
            await asyncio.gather(*workers)

    retries = _counter(whisper_app, "encdec:encoder_transfer_retries_total")
    with deadline(STEP_SECONDS, "load with an encoder worker killed"):
        asyncio.run(main())
    for e in errors:
        assert isinstance(e, openai.APIStatusError) and e.status_code == 503, e
        assert e.body["type"] == "service_unavailable" and "encoder worker" in e.body["message"], e.body
    retried = _wait_counter(whisper_app, "encdec:encoder_transfer_retries_total", retries + 1) - retries
    assert errors or retried, "the kill hit no encoder call in flight"
    assert all(text == want[i] for i, text in answers), [(i, t, want[i]) for i, t in answers if t != want[i]]
    with deadline(STEP_SECONDS, "requests after the kill"):
        after = asyncio.run(_transcribe_all(whisper_app, files[:4]))
    assert [t.text for t in after] == [want[i] for i in range(4)]


def _encoder_actors() -> list:
    return [ray.get_actor(e["name"], namespace=e["namespace"])
            for e in ray.util.list_named_actors(all_namespaces=True) if "#EncoderWorker#" in e["name"]]


@pytest.mark.parametrize("split", ["encoders=0,decoders=1", "encoders=1", "decoders=1,encoders=x",
                                   "encoders=1,decoders=1,encoders=2", "workers=2", "encoders=1.5,decoders=1",
                                   "encoders=1,decoders=1,encoder_gpus=-1"])
def test_bad_disaggregate_spec_is_refused_before_deploying(tiny_bart, split):
    with pytest.raises(ValueError, match="--disaggregate must be 'encoders=E,decoders=D'"):
        build({"model": tiny_bart, "disaggregate": split})


def test_disaggregate_spec_parses():
    from encdec.serve_ray.disaggregate import Split, parse_disaggregate

    assert parse_disaggregate("decoders=1, encoders=2") == Split(2, 1)
    assert parse_disaggregate("encoders=2,decoders=1,encoder_gpus=0.5,encoder_cpus=2") == Split(2, 1, 2.0, 0.5)


def test_replicas_and_disaggregate_together_are_refused(tiny_bart):
    with pytest.raises(ValueError, match="--replicas and --disaggregate"):
        build({"model": tiny_bart, "disaggregate": "encoders=1,decoders=2", "replicas": 2})
