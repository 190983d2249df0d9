"""The web page's routes without a browser (``encdec.entrypoints.openai.ui_routes``):
``--no-ui``, the status of a text model, the translation prompt's checks and key,
and only the page's own files served. The page itself: test_browser.py."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def bart_engine(tiny_bart):
    from encdec.engine.arg_utils import EngineArgs
    from encdec.engine.async_llm_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(EngineArgs(tiny_bart, kv_cache_memory=8 << 20, swap_space=0.01))


def _client(engine, **kwargs):
    from fastapi.testclient import TestClient

    from encdec.entrypoints.openai.api_server import build_app

    return TestClient(build_app(engine, model_name="bart", **kwargs))  # routes only: the engine is not started


def test_no_ui_flag_leaves_the_page_out(bart_engine):
    from encdec.entrypoints.openai.cli_args import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    assert p.parse_args(["m", "--no-ui"]).no_ui is True and p.parse_args(["m"]).no_ui is False
    client = _client(bart_engine, ui=False)
    for path in ("/", "/ui/status", "/ui/app.js"):
        resp = client.get(path)
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


def test_status_and_files(bart_engine):
    client = _client(bart_engine, api_key="k")
    status = client.get("/ui/status").json()  # open, as /metrics is
    assert status["model"] == "bart" and status["panels"] == ["text"] and status["translation"] is None
    assert status["speech_languages"] is None and status["vad"] is False  # no transcription form
    assert status["api_key_required"] is True and status["device"] == "cpu" and status["precision"] == "float32"
    assert status["architecture"] == "BartForConditionalGeneration" and status["engine_running"] is False
    assert {"running", "waiting", "swapped", "kv_cache_usage"} <= set(status)
    index = client.get("/")
    assert index.status_code == 200 and '<script type="module" src="/ui/app.js">' in index.text
    from encdec.entrypoints.openai.ui_routes import UI_FILES

    for name, ctype in UI_FILES.items():
        resp = client.get(f"/ui/{name}")
        assert resp.status_code == 200 and resp.headers["content-type"] == ctype and resp.content
    for bad in ("missing.js", "..%2F__init__.py", "%2e%2e%2fapi_server.py"):
        assert client.get(f"/ui/{bad}").status_code == 404


def test_translation_prompt_checks_and_key(bart_engine):
    client = _client(bart_engine, api_key="k")
    body = {"text": "hi", "src_lang": "en", "tgt_lang": "de"}
    resp = client.post("/ui/translation-prompt", json=body)
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    auth = {"Authorization": "Bearer k"}
    resp = client.post("/ui/translation-prompt", json=body, headers=auth)
    assert resp.status_code == 400 and "this checkpoint is 'bart'" in resp.json()["error"]["message"]
    resp = client.post("/ui/translation-prompt", json={**body, "texts": ["x"]}, headers=auth)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "texts"
    resp = client.post("/ui/translation-prompt", json={**body, "text": " "}, headers=auth)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "text"
    resp = client.post("/ui/translation-prompt", content=b"[1", headers={**auth, "Content-Type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


def test_translation_prompt_is_translates_prompt(tmp_path):
    """The ids the page sends for NLLB are ``LLM.translate``'s prompt."""
    from fastapi.testclient import TestClient

    from encdec.engine.arg_utils import EngineArgs
    from encdec.engine.async_llm_engine import AsyncLLMEngine
    from encdec.entrypoints.openai.api_server import build_app
    from encdec.testing import make_random_nllb
    from encdec.translation import translation_prompts

    path = make_random_nllb(str(tmp_path / "nllb"), seed=5)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(path, kv_cache_memory=8 << 20, swap_space=0.01))
    client = TestClient(build_app(engine, model_name="nllb"))
    status = client.get("/ui/status").json()
    assert status["panels"] == ["text"] and status["translation"]["family"] == "m2m_100"
    assert "eng_Latn" in status["translation"]["source"] and "deu_Latn" in status["translation"]["target"]
    got = client.post("/ui/translation-prompt", json={"text": "The rain.", "src_lang": "eng_Latn",
                                                      "tgt_lang": "deu_Latn"}).json()
    plan = translation_prompts("The rain.", hf_config=engine.hf_config, tokenizer=engine.tokenizer,
                               src_lang="eng_Latn", tgt_lang="deu_Latn")
    (want,) = plan.prompts
    assert got == {"prompt": want["encoder_prompt"]["prompt_token_ids"],
                   "decoder_prompt": want["decoder_prompt"]["prompt_token_ids"],
                   "forced_bos_token_id": plan.forced_bos_token_id}
    resp = client.post("/ui/translation-prompt", json={"text": "x", "src_lang": "eng_Latn", "tgt_lang": "xx_Yyyy"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tgt_lang"


def test_page_ids_unique_and_every_control_labelled():
    """index.html: no id twice (the scripts find controls by id) and every input,
    select and textarea has a label (``for=`` its id, or wrapped in one)."""
    from html.parser import HTMLParser

    from encdec.entrypoints.openai.ui_routes import _ui_file

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids, self.label_for, self.controls, self.depth = [], set(), [], 0

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if "id" in a:
                self.ids.append(a["id"])
            if tag == "label":
                self.depth += 1
                if "for" in a:
                    self.label_for.add(a["for"])
            if tag in ("input", "select", "textarea"):
                self.controls.append((a.get("id"), self.depth > 0))

        def handle_endtag(self, tag):
            if tag == "label":
                self.depth -= 1

    page = Page()
    page.feed(_ui_file("index.html").decode())
    assert len(page.ids) == len(set(page.ids)), sorted(i for i in page.ids if page.ids.count(i) > 1)
    unlabelled = [cid for cid, wrapped in page.controls if not wrapped and cid not in page.label_for]
    assert page.controls and not unlabelled, unlabelled
