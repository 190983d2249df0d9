"""``encdec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

One ``AsyncLLMEngine`` per app; handlers only validate, submit and format, so
the event loop stays free while the engine thread steps. Errors use OpenAI's
``{"error": {"message", "type", "param", "code"}}``; none of them reaches the
engine thread, so a bad request never stops the server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

import encdec
from encdec import configure_cpu_runtime
from encdec.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from encdec.entrypoints.openai.cli_args import engine_args_from
from encdec.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from encdec.entrypoints.openai.protocol import APIError, CompletionRequest
from encdec.entrypoints.openai.serving_completion import CompletionServer
from encdec.entrypoints.openai.sse import SSEResponse

logger = logging.getLogger("encdec")
_START = time.time()  # "created" of /v1/models


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.response_body(), status_code=e.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's errors -> one sentence that names the fields."""
    parts, first = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "form")]
        name = ".".join(loc) or "body"
        first = first or (loc[0] if loc else None)
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported field {name!r}")
        else:
            parts.append(f"{name}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", first


class ServerState:
    """What the handlers share: the engine, the formatters, the options."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics, *,
                 api_key: str | None, max_audio_bytes: int, model_path: str):
        self.engine = engine
        self.model_name = model_name
        self.model_path = model_path
        self.metrics = metrics
        self.api_key = api_key
        self.max_audio_bytes = max_audio_bytes
        self.completions = CompletionServer(engine, model_name)
        self.transcriptions = None
        try:
            from encdec.entrypoints.openai.serving_transcription import TranscriptionServer
        except ImportError:  # the engine-agnostic transcription job is not in this build
            TranscriptionServer = None
        if TranscriptionServer is not None and TranscriptionServer.supports(engine):
            self.transcriptions = TranscriptionServer(engine, model_name, metrics)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.model_path):
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", type="not_found_error")


def build_app(engine: AsyncLLMEngine, *, model_name: str, model_path: str | None = None,
              api_key: str | None = None, max_audio_mb: float = 25.0,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The app around a built (not started) engine; the app's lifespan starts and
    drains it. ``metrics`` must be the one given to the engine as ``on_step``."""
    metrics = metrics or ServerMetrics(model_name)
    state = ServerState(engine, model_name, metrics, api_key=api_key,
                        max_audio_bytes=int(max_audio_mb * (1 << 20)),
                        model_path=model_path or model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="encdec", version=encdec.__version__, lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return _error(APIError(400, message, param=param))

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return _error(APIError(503, str(e), type="service_unavailable"))

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(APIError(401, "missing or wrong API key: send "
                                       "'Authorization: Bearer <key>'", type="authentication_error"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return _error(APIError(503, f"the engine is not running: {engine.error!r}",
                               type="service_unavailable"))

    @app.get("/version")
    async def version() -> dict:
        return {"version": encdec.__version__}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(_START), "owned_by": "encdec",
            "root": state.model_path, "parent": None}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        state.check_model(req.model)
        result = await state.completions.create(req, raw.is_disconnected)
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result)

    async def audio(raw: Request, task: str) -> Response:
        if state.transcriptions is None:
            raise APIError(400, f"model `{model_name}` takes no audio: /v1/audio needs a Whisper model",
                           param="model")
        return await state.transcriptions.handle(raw, task, state)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(raw: Request) -> Response:
        return await audio(raw, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(raw: Request) -> Response:
        return await audio(raw, "translate")

    return app



def serve(args: argparse.Namespace) -> int:
    """Build the engine (errors show before the port opens), then run uvicorn until
    SIGINT/SIGTERM; uvicorn stops accepting, finishes the requests in flight
    (drain), and the app's lifespan stops the engine thread."""
    import uvicorn

    engine_args = engine_args_from(args)
    configure_cpu_runtime(engine_args.num_threads)  # a server owns its process: full CPU speed
    model_name = args.served_model_name or args.model
    metrics = ServerMetrics(model_name)
    engine = AsyncLLMEngine.from_engine_args(engine_args, on_step=metrics.record_step)
    app = build_app(engine, model_name=model_name, model_path=args.model, api_key=args.api_key,
                    max_audio_mb=args.max_audio_mb, metrics=metrics)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=60, access_log=False)
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal to the handler in
    # place before it started: make that one a no-op, so a drained server exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    return 0

