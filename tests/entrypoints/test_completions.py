"""``/v1/completions`` through the official ``openai`` client equals ``LLM.generate``."""
from __future__ import annotations

import asyncio

import pytest

from encdec import SamplingParams
from encdec.inputs import ExplicitEncoderDecoderPrompt, TokensPrompt

from .conftest import API_KEY

PROMPTS = ["The rain in Spain falls mainly on the plain.", "Paged attention keeps the cache in blocks."]
IDS = {"return_tokens_as_token_ids": True}  # logprob tokens as "token_id:N": exact ids back


def token_ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def check_choice(choice, ref, *, logprobs: bool = True) -> None:
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    if logprobs:
        assert token_ids(choice.logprobs) == ref.token_ids
        want = [lps[t].logprob for t, lps in zip(ref.token_ids, ref.logprobs)]
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)


def test_greedy_logprobs_match_generate(client, bart_llm):
    resp = client.completions.create(model="tiny-bart", prompt=PROMPTS[0], max_tokens=12,
                                     temperature=0, logprobs=2, extra_body=IDS)
    ref = bart_llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, logprobs=2),
                            use_tqdm=False)[0]
    check_choice(resp.choices[0], ref.outputs[0])
    assert all(len(top) >= 2 for top in resp.choices[0].logprobs.top_logprobs)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) + len(ref.encoder_prompt_token_ids)


def test_n2_seed_stop_and_prompt_list(client, bart_llm):
    ref_text = bart_llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0),
                                 use_tqdm=False)[0].outputs[0].text
    stop = ref_text[3:6]  # a stop string that occurs in the greedy output
    sp = SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=7, stop=[stop], logprobs=0)
    refs = bart_llm.generate(PROMPTS, sp, use_tqdm=False)
    resp = client.completions.create(model="tiny-bart", prompt=PROMPTS, n=2, max_tokens=10,
                                     temperature=0.9, seed=7, stop=[stop], logprobs=0, extra_body=IDS)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c in resp.choices:
        check_choice(c, refs[c.index // 2].outputs[c.index % 2])
    assert any(c.finish_reason == "stop" for c in resp.choices)


VLLM_EXTRAS = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, min_tokens=3, ignore_eos=True,
                   stop_token_ids=[7], bad_words=["rain"], skip_special_tokens=True,
                   vllm_xargs={"note": 1})


def test_vllm_extras_and_decoder_prompt(client, bart_llm):
    sp = SamplingParams(max_tokens=9, temperature=0.7, seed=3, logprobs=1, top_k=5, min_p=0.05,
                        repetition_penalty=1.3, min_tokens=3, ignore_eos=True, stop_token_ids=[7],
                        bad_words=["rain"], extra_args={"note": 1})
    for dec in ("The", [2, 0, 100, 101]):
        dec_prompt = dec if isinstance(dec, str) else TokensPrompt(prompt_token_ids=dec)
        ref = bart_llm.generate(ExplicitEncoderDecoderPrompt(encoder_prompt=PROMPTS[0],
                                                             decoder_prompt=dec_prompt),
                                sp, use_tqdm=False)[0]
        resp = client.completions.create(
            model="tiny-bart", prompt=PROMPTS[0], max_tokens=9, temperature=0.7, seed=3, logprobs=1,
            extra_body={**IDS, **VLLM_EXTRAS, "decoder_prompt": dec})
        check_choice(resp.choices[0], ref.outputs[0])
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) + len(ref.encoder_prompt_token_ids)


def test_token_id_prompt(client, bart_llm):
    ids = [0, 100, 200, 300, 2]
    ref = bart_llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=6, temperature=0),
                            use_tqdm=False)[0]
    resp = client.completions.create(model="tiny-bart", prompt=ids, max_tokens=6, temperature=0)
    assert resp.choices[0].text == ref.outputs[0].text


def collect_stream(chunks) -> dict[int, dict]:
    got: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            g = got.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None, "chunks": 0})
            assert g["finish"] is None, "no chunk after a choice finished"
            g["text"] += c.text
            g["chunks"] += 1
            if c.logprobs is not None:
                g["ids"] += token_ids(c.logprobs)
                g["lps"] += c.logprobs.token_logprobs
            g["finish"] = c.finish_reason
    got["usage"] = usage
    return got


def test_stream_matches_generate(client, bart_llm):
    text = bart_llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0),
                             use_tqdm=False)[0].outputs[0].text
    stop = text[5:9]
    sp = SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=11, stop=[stop], logprobs=1,
                        repetition_penalty=1.2)
    ref = bart_llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    stream = client.completions.create(
        model="tiny-bart", prompt=PROMPTS[0], n=2, max_tokens=16, temperature=0.8, seed=11,
        stop=[stop], logprobs=1, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={**IDS, "repetition_penalty": 1.2})
    chunks = list(stream)
    running = [c.usage.completion_tokens for c in chunks if c.choices]
    assert running == sorted(running) and running[0] >= 1  # usage in every chunk, growing
    got = collect_stream(chunks)
    for i in range(2):
        r = ref.outputs[i]
        assert got[i]["text"] == r.text
        assert got[i]["ids"] == r.token_ids
        assert got[i]["finish"] == r.finish_reason
        assert got[i]["lps"] == pytest.approx([lps[t].logprob for t, lps in zip(r.token_ids, r.logprobs)],
                                              abs=1e-4)
    assert got["usage"].completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    assert got[0]["chunks"] > 1  # streamed, not one chunk at the end


def test_async_client_concurrent_streams(bart_server, bart_llm):
    from openai import AsyncOpenAI

    prompts = [f"{p} number {i}" for i in range(6) for p in PROMPTS[:1]]
    refs = bart_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                             use_tqdm=False)

    async def one(client, prompt):
        text = ""
        stream = await client.completions.create(model="tiny-bart", prompt=prompt, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def main():
        async with AsyncOpenAI(base_url=bart_server.v1, api_key=API_KEY, max_retries=0) as client:
            non_stream = client.completions.create(model="tiny-bart", prompt=prompts[0], max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
            return await asyncio.gather(non_stream, *(one(client, p) for p in prompts))

    first, *texts = asyncio.run(main())
    assert first.choices[0].text == refs[0].outputs[0].text
    assert texts == [r.outputs[0].text for r in refs]


def test_models_version_health(bart_server):
    import httpx

    models = httpx.get(bart_server.v1 + "/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["tiny-bart"]
    assert httpx.get(bart_server.base + "/health").status_code == 200
    import encdec

    assert httpx.get(bart_server.base + "/version").json() == {"version": encdec.__version__}


def test_stream_prompt_list_with_decoder_prompt(client, bart_llm):
    """Several prompts in one streamed request (choices interleave), each with the decoder prompt."""
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    refs = bart_llm.generate([ExplicitEncoderDecoderPrompt(encoder_prompt=p, decoder_prompt=TokensPrompt(
        prompt_token_ids=[2, 0, 55])) for p in PROMPTS], sp, use_tqdm=False)
    got = collect_stream(client.completions.create(
        model="tiny-bart", prompt=PROMPTS, max_tokens=8, temperature=0, logprobs=0, stream=True,
        extra_body={**IDS, "decoder_prompt": [2, 0, 55]}))
    for i, ref in enumerate(refs):
        assert got[i]["ids"] == ref.outputs[0].token_ids and got[i]["text"] == ref.outputs[0].text


def test_encoder_cache_hits_reach_metrics(client, bart_server):
    """Several decoder prompts over one document: one encoder pass, the rest are
    hits, and /metrics counts them."""
    def value(name: str) -> float:
        return sum(v for k, v in bart_server.metrics().items() if k.startswith(name + "{"))

    q0, h0 = value("encdec:encoder_cache_queries_total"), value("encdec:encoder_cache_hits_total")
    doc = "Encoder decoder models read a document and write a summary of it, one token at a time."
    for decoder_prompt in ["", "Title", "Summary"]:
        client.completions.create(model=client.models.list().data[0].id, prompt=doc, max_tokens=4,
                                  temperature=0.0, extra_body={"decoder_prompt": decoder_prompt})
    assert value("encdec:encoder_cache_queries_total") - q0 == 3
    assert value("encdec:encoder_cache_hits_total") - h0 >= 2
