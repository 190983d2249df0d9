"""The web page ``encdec serve`` shows at ``/`` (off with ``--no-ui``) and the two
small JSON routes it needs beside the OpenAI ones.

The page is plain HTML, CSS and ES modules in ``ui/`` (shipped in the wheel; no
build step, nothing fetched from elsewhere at run time). It talks to the same
endpoints any client uses (``/v1/audio/*``, ``/v1/realtime``, ``/v1/completions``)
and to:

- ``GET /ui/status``: the model, device, precision, queue and KV use (the
  ``/metrics`` gauges), whether an API key is needed, and which panels the model
  serves (``transcribe`` and ``live`` for Whisper, ``text`` otherwise) with the
  language codes: a multilingual Whisper's, or a translation family's tokenizer's, and
  whether ``vad_filter`` can run (``vad``: the ``vad`` extra is installed). Open, as ``/metrics`` is.
- ``POST /ui/translation-prompt``: ``{text, src_lang, tgt_lang}`` -> the token ids
  ``LLM.translate`` would send (``encdec.translation``), for the page to pass to
  ``/v1/completions`` (a browser cannot tokenize). It takes the API key as
  ``/v1`` does.

Only the files listed in ``UI_FILES`` are served, so no path reaches outside ``ui/``.
"""
from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from encdec.entrypoints.openai.protocol import APIError
from encdec.entrypoints.openai.serving_transcription import vad_installed

UI_FILES = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "transcribe.js": "text/javascript; charset=utf-8",
    "live.js": "text/javascript; charset=utf-8",
    "pcm-worklet.js": "text/javascript; charset=utf-8",
    "text.js": "text/javascript; charset=utf-8",
}
_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:num_requests_swapped": "swapped", "vllm:kv_cache_usage_perc": "kv_cache_usage"}


def _ui_file(name: str) -> bytes:
    return resources.files("encdec.entrypoints.openai").joinpath("ui", name).read_bytes()


def _gauges(metrics: Any) -> dict[str, float]:
    """The queue and KV gauges, as ``/metrics`` shows them (last engine step)."""
    out = {}
    for family in metrics.registry.collect():
        key = _GAUGES.get(family.name)
        if key is not None and family.samples:
            out[key] = family.samples[0].value
    return out


def _translation_languages(engine: Any) -> dict[str, Any] | None:
    """The language codes a translation family's tokenizer knows, as the pickers list
    them: NLLB/M2M100/mBART source and target codes (M2M100's bare ``de`` rather than
    ``__de__``), Marian's ``>>xx<<`` targets; None for a family without codes."""
    from encdec.translation import TRANSLATION_FAMILIES, language_table

    family = getattr(engine.hf_config, "model_type", None)
    if family not in TRANSLATION_FAMILIES or family == "t5":
        return None
    tok = engine.tokenizer
    if family == "marian":
        targets = sorted(t[2:-2] for t in tok.get_vocab() if t.startswith(">>") and t.endswith("<<"))
        return {"family": family, "source": [], "target": targets}
    codes = sorted(language_table(tok))
    if family == "m2m_100":
        bare = [c for c in codes if not c.startswith("__")]
        codes = bare or [c.strip("_") for c in codes]
    return {"family": family, "source": codes, "target": codes}


def _whisper_languages(engine: Any) -> list[str]:
    """A Whisper model's language codes (``de``, not ``<|de|>``); none for an English-only one."""
    from encdec.models.whisper_tokens import WhisperSpecialTokens

    tokens = WhisperSpecialTokens.of(engine.generation_config)
    return sorted(t.strip("<|>") for t in tokens.lang_to_id) if tokens.is_multilingual else []


def describe(state: Any) -> dict[str, Any]:
    """``GET /ui/status``'s body."""
    engine = state.engine
    core = engine.engine  # the LLMEngine the async engine steps
    precision = core.model_config.dtype
    quantization = getattr(core.args, "quantization", None)
    audio = state.transcriptions is not None
    return {
        "model": state.model_name, "root": state.model_path, "architecture": core.model_config.architecture,
        "device": str(core.worker.device), "precision": precision + (f" + {quantization}" if quantization else ""),
        "engine_running": engine.is_running, **_gauges(state.metrics),
        "api_key_required": state.api_key is not None,
        "panels": ["transcribe", "live"] if audio else ["text"],
        "max_audio_mb": state.max_audio_bytes / (1 << 20),
        "translation": None if audio else _translation_languages(engine),
        "speech_languages": _whisper_languages(engine) if audio else None,  # [] for an English-only model
        "vad": audio and vad_installed(),  # the transcription form's vad_filter can run
    }


def _translation_prompt(engine: Any, body: Any) -> dict[str, Any]:
    from encdec.translation import translation_prompts

    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object {text, src_lang, tgt_lang}")
    unknown = sorted(set(body) - {"text", "src_lang", "tgt_lang"})
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r}", param=unknown[0])
    text = body.get("text")
    if not isinstance(text, str) or not text.strip():
        raise APIError(400, "text must be a non-empty string", param="text")
    try:
        plan = translation_prompts(text, hf_config=engine.hf_config, tokenizer=engine.tokenizer,
                                   src_lang=body.get("src_lang") or None, tgt_lang=body.get("tgt_lang") or None)
    except (ValueError, TypeError) as e:
        param = str(e).split("=", 1)[0] if str(e).startswith(("src_lang=", "tgt_lang=")) else None
        raise APIError(400, str(e), param=param) from None
    (prompt,) = plan.prompts
    dec = prompt["decoder_prompt"]
    return {"prompt": prompt["encoder_prompt"]["prompt_token_ids"],
            "decoder_prompt": None if dec is None else dec["prompt_token_ids"],
            "forced_bos_token_id": plan.forced_bos_token_id}


def add_ui_routes(app: FastAPI, state: Any, authorized: Callable[[Request, str], bool]) -> None:
    """``/`` and ``/ui/*`` on ``app``; ``authorized(request, key)`` is ``/v1``'s key check."""

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(_ui_file("index.html"), media_type=UI_FILES["index.html"],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/ui/status")
    async def status() -> dict[str, Any]:
        return describe(state)

    @app.post("/ui/translation-prompt")
    async def translation_prompt(request: Request) -> dict[str, Any]:
        if state.api_key is not None and not authorized(request, state.api_key):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error")
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON") from None
        return _translation_prompt(state.engine, body)

    @app.get("/ui/{name}", include_in_schema=False)
    async def ui_file(name: str) -> Response:
        if name not in UI_FILES:
            raise APIError(404, f"Invalid URL (GET /ui/{name})", type="not_found_error")
        return Response(_ui_file(name), media_type=UI_FILES[name], headers={"Cache-Control": "no-cache"})
