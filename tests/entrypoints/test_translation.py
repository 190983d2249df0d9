"""NLLB with a target-language control token, three ways in: ``LLM.translate``,
``encdec generate --src-lang --tgt-lang`` and ``/v1/completions`` with a
``decoder_prompt`` of ``[</s>, <tgt>]``; each equals HF's
``generate(forced_bos_token_id=<tgt>)`` on the same random checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from encdec import SamplingParams
from encdec.sampling_params import BeamSearchParams

from .conftest import API_KEY, REPO, start_server, stop_server

TEXTS = ["The rain in Spain falls mainly on the plain.", "Paged attention keeps the cache in blocks."]
MAX_NEW = 16


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    from transformers import M2M100ForConditionalGeneration

    from encdec import LLM
    from encdec.testing import make_random_nllb

    path = make_random_nllb(str(tmp_path_factory.mktemp("nllb")), seed=5)
    llm = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01)
    tok = llm.get_tokenizer()
    return path, llm, M2M100ForConditionalGeneration.from_pretrained(path).eval(), tok


def _hf(hf, tok, text: str, tgt: int, **kwargs) -> list[int]:
    enc = tok(text).input_ids  # the tokenizer's src_lang (eng_Latn): "eng_Latn text </s>"
    with torch.inference_mode():
        g = hf.generate(torch.tensor([enc]), forced_bos_token_id=tgt, **kwargs)
    return g[0].tolist()


def test_translate_matches_hf_forced_bos(nllb):
    _, llm, hf, tok = nllb
    tgt = tok.convert_tokens_to_ids("deu_Latn")
    greedy = llm.translate(TEXTS, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                           src_lang="eng_Latn", tgt_lang="deu_Latn", use_tqdm=False)
    beams = llm.translate(TEXTS, BeamSearchParams(4, MAX_NEW), src_lang="eng_Latn", tgt_lang="deu_Latn",
                          use_tqdm=False)
    for text, g, b in zip(TEXTS, greedy, beams):
        assert g.prompt_token_ids == [2, tgt]
        assert [2, tgt] + g.outputs[0].token_ids == _hf(hf, tok, text, tgt, num_beams=1,
                                                        max_new_tokens=MAX_NEW + 1)
        ref = _hf(hf, tok, text, tgt, num_beams=4, max_length=MAX_NEW + 2)
        ours = [2, tgt] + b.outputs[0].token_ids
        assert ref[:len(ours)] == ours and all(t == 1 for t in ref[len(ours):])
    with pytest.raises(ValueError, match="tgt_lang='xx_Yyyy'"):
        llm.translate(TEXTS, src_lang="eng_Latn", tgt_lang="xx_Yyyy", use_tqdm=False)


def test_cli_src_and_tgt_lang(nllb):
    path, llm, _, _ = nllb
    ref = llm.translate(TEXTS, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        src_lang="eng_Latn", tgt_lang="fra_Latn", use_tqdm=False)
    run = subprocess.run([sys.executable, "-m", "encdec.entrypoints.cli", "generate", *TEXTS, "--model", path,
                          "--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn", "--beam-width", "1", "--temperature", "0",
                          "--max-tokens", str(MAX_NEW), "--json", "--quiet", "--kv-cache-memory", "16MiB"],
                         capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [o["outputs"][0]["token_ids"] for o in lines] == [r.outputs[0].token_ids for r in ref]
    bad = subprocess.run([sys.executable, "-m", "encdec.entrypoints.cli", "generate", "x", "--model", path,
                          "--tgt-lang", "fra_Latn", "--decoder-prompt", "y"],
                         capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert bad.returncode == 2 and "not both" in bad.stderr


def test_completions_decoder_prompt_matches_hf(nllb, tmp_path):
    from openai import OpenAI

    path, _, hf, tok = nllb
    tgt = tok.convert_tokens_to_ids("deu_Latn")
    server = start_server(path, tmp_path / "server.log", "--api-key", API_KEY,
                          "--served-model-name", "nllb", "--kv-cache-memory", "16MiB")
    try:
        client = OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
        for text in TEXTS:
            resp = client.completions.create(
                model="nllb", prompt=tok(text).input_ids, max_tokens=MAX_NEW, temperature=0,
                logprobs=0, extra_body={"decoder_prompt": [2, tgt], "return_tokens_as_token_ids": True})
            ids = [int(t.removeprefix("token_id:")) for t in resp.choices[0].logprobs.tokens]
            assert [2, tgt] + ids == _hf(hf, tok, text, tgt, num_beams=1, max_new_tokens=MAX_NEW + 1)
    finally:
        stop_server(server)
