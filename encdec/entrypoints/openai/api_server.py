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
import re
import signal
import time

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import encdec
from encdec import configure_cpu_runtime
from encdec.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from encdec.entrypoints.openai.cli_args import engine_args_from
from encdec.entrypoints.openai.http_limits import BodyLimits, header_timeout_protocol
from encdec.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from encdec.entrypoints.openai.protocol import APIError, CompletionRequest
from encdec.entrypoints.openai.serving_completion import CompletionServer
from encdec.entrypoints.openai.serving_transcription import TranscriptionServer
from encdec.entrypoints.openai.sse import SSEResponse

logger = logging.getLogger("encdec")
_START = time.time()  # "created" of /v1/models


# Room for a multipart body's boundaries and text fields beside an audio file of
# the largest allowed size; the body is refused once it grows past this.
FORM_ALLOWANCE = 64 << 10


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.response_body(), status_code=e.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's errors -> one 400 sentence that names the fields. For a body
    that is not JSON, the field is the last key before the break, if any (FastAPI
    gives the character offset where the field goes)."""
    parts, first = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return _json_error(err, exc.body if isinstance(exc.body, str) else "")
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "form")]
        name = ".".join(loc) or "body"
        first = first or (loc[0] if loc else None)
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported field {name!r}")
        else:
            parts.append(f"{name}: {err.get('msg')}")
    return APIError(400, "; ".join(parts) or "invalid request", param=first)


def _json_error(err: dict, body: str) -> APIError:
    where = err.get("loc", ("body", 0))[-1]
    reason = (err.get("ctx") or {}).get("error", "JSON decode error")
    keys = re.findall(r'"((?:[^"\\]|\\.)*)"\s*:', body[:where] if isinstance(where, int) else "")
    field = keys[-1] if keys else None
    after = f"after {field!r}, " if field else ""
    return APIError(400, f"the body is not valid JSON: {reason} ({after}at character {where})", param=field)


def _http_error(request: Request, e: StarletteHTTPException) -> APIError:
    """Starlette's own refusals (unknown path, wrong method, a body it cannot parse)."""
    if e.status_code == 404:
        return APIError(404, f"Invalid URL ({request.method} {request.url.path})", type="not_found_error")
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return APIError(405, f"{request.method} is not allowed on {request.url.path}"
                        + (f"; use {allowed}" if allowed else ""))
    return APIError(e.status_code, str(e.detail),
                    type="invalid_request_error" if e.status_code < 500 else "internal_error")


def _not_json(request: Request) -> APIError | None:
    """A JSON route's body sent under another content type (curl's ``-d`` sends
    form-urlencoded, some clients text/plain): FastAPI then validates the raw
    bytes, and its message ("Input should be a valid dictionary") hides the cause."""
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if request.method != "POST" or media == "application/json" or media.endswith("+json"):
        return None
    got = f"content-type {ctype!r}" if ctype else "no content-type"
    return APIError(400, f"the body must be JSON sent with 'Content-Type: application/json' (got {got})")


def _undecodable_body(e: StarletteHTTPException) -> APIError | None:
    """FastAPI's "There was an error parsing the body" for a JSON body that is not
    UTF-8 (RFC 8259: JSON between systems is UTF-8): say so, and where. The
    decoder's error is the exception's cause (the body is not read again)."""
    u = e.__cause__
    if e.status_code != 400 or not isinstance(u, UnicodeDecodeError):
        return None
    return APIError(400, f"the body is not UTF-8 text: byte 0x{u.object[u.start]:02x} at position "
                    f"{u.start} cannot be decoded (JSON must be sent as UTF-8)")


def _authorized(request: Request | WebSocket, api_key: str) -> bool:
    """``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 9110). A
    WebSocket may instead offer OpenAI's ``openai-insecure-api-key.<key>`` subprotocol:
    the one way a browser can send a key when it opens a WebSocket."""
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" and isinstance(request, WebSocket):
        offered = [p for p in request.scope.get("subprotocols", ()) if p.startswith(_KEY_SUBPROTOCOL)]
        scheme, token = "bearer", offered[0][len(_KEY_SUBPROTOCOL):] if offered else ""
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


_KEY_SUBPROTOCOL = "openai-insecure-api-key."


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
        self.transcriptions = (TranscriptionServer(engine, model_name, metrics)
                               if TranscriptionServer.supports(engine) else None)
        from encdec.entrypoints.openai.realtime import PartialBudget, RealtimeLimits

        self.partial_budget = PartialBudget()  # shared by every realtime session
        self.realtime_limits = RealtimeLimits()  # serve() sets the --realtime-* flags

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.model_path):
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", type="not_found_error")

    def max_body_bytes(self, path: str) -> int | None:
        """The largest body a route reads (audio uploads); None: no cap."""
        return self.max_audio_bytes + FORM_ALLOWANCE if path.startswith("/v1/audio/") else None


def build_app(engine: AsyncLLMEngine, *, model_name: str, model_path: str | None = None,
              api_key: str | None = None, max_audio_mb: float = 25.0,
              metrics: ServerMetrics | None = None, body_read_timeout: float = 30.0,
              body_timeout: float = 300.0, ui: bool = True) -> FastAPI:
    """The app around a built (not started) engine; the app's lifespan starts and
    drains it. ``metrics`` must be the one given to the engine as ``on_step``.
    ``body_read_timeout``: the longest wait for the next piece of a request body;
    ``body_timeout``: the longest a whole body may take, from the end of its headers;
    ``ui``: the web page at ``/`` (``ui_routes``)."""
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
    _add_error_handlers(app)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1") and not _authorized(request, api_key):
            return _error(APIError(401, "missing or wrong API key: send "
                                   "'Authorization: Bearer <key>'", type="authentication_error"))
        return await call_next(request)

    app.add_middleware(BodyLimits, read_timeout=body_read_timeout, body_timeout=body_timeout,
                       max_bytes=state.max_body_bytes)
    _add_routes(app, state)
    if ui:  # the web page at / (encdec.entrypoints.openai.ui_routes); --no-ui leaves it out
        from encdec.entrypoints.openai.ui_routes import add_ui_routes

        add_ui_routes(app, state, _authorized)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, pydantic's, starlette's, and the unexpected."""

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(_not_json(request) or _validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        response = _error(_undecodable_body(e) or _http_error(request, e))
        response.headers.update(e.headers or {})  # 405's Allow (RFC 9110: a 405 must list the methods)
        return response

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return _error(APIError(503, str(e), type="service_unavailable"))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error in a request handler")
        return _error(APIError(500, f"internal error: {type(e).__name__}", type="internal_error"))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine, model_name = state.engine, state.model_name

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
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

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

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        from encdec.entrypoints.openai.realtime import RealtimeSession, refuse_handshake

        try:
            _check_realtime(ws, state)
        except APIError as e:  # refused before the handshake completes, in OpenAI's error shape
            await refuse_handshake(ws, _error(e), f"{e.status} {e.message}")
            return
        # a browser that offered subprotocols (its API key) must get one of them back
        await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", ()) else None)
        await RealtimeSession(ws, engine, served_model=model_name, metrics=state.metrics,
                              budget=state.partial_budget, limits=state.realtime_limits).serve()

    @app.websocket("/{path:path}")
    async def unknown_websocket(ws: WebSocket, path: str) -> None:
        """Any other WebSocket path: a 404 that names the one that exists (starlette's
        default is a bare 403, which reads as an auth failure)."""
        from encdec.entrypoints.openai.realtime import refuse_handshake

        error = APIError(404, f"Invalid URL (WebSocket /{path}): the WebSocket endpoint is /v1/realtime",
                         type="not_found_error")
        await refuse_handshake(ws, _error(error), f"404 {error.message}")


def _check_realtime(ws: WebSocket, state: ServerState) -> None:
    """The API key and model as on the other routes; a transcription intent; a Whisper model."""
    if state.api_key is not None and not _authorized(ws, state.api_key):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       type="authentication_error")
    intent = ws.query_params.get("intent")
    if intent != "transcription":
        raise APIError(400, f"this server runs transcription sessions only: connect with "
                       f"intent=transcription (got {intent!r})", param="intent")
    state.check_model(ws.query_params.get("model"))
    if state.transcriptions is None:
        raise APIError(400, f"model `{state.model_name}` takes no audio: realtime transcription needs "
                       "a Whisper model", param="model")


def check_server_flags(args: argparse.Namespace) -> tuple:
    """``encdec serve``'s flags checked without loading anything: (RealtimeLimits, EngineArgs)."""
    from encdec.entrypoints.openai.realtime_protocol import RealtimeLimits

    realtime_limits = RealtimeLimits(args.realtime_max_turn_seconds, args.realtime_idle_timeout,
                                     args.realtime_max_session_seconds)
    for flag in ("header_read_timeout", "body_read_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    return realtime_limits, engine_args_from(args)


def app_from_args(args: argparse.Namespace, *, engine_cls: type[AsyncLLMEngine] = AsyncLLMEngine) -> FastAPI:
    """``encdec serve``'s app from its parsed flags: the engine is built (a bad
    flag or model fails here, before any port opens) but not started; the app's
    lifespan starts it. ``encdec serve --ray`` builds one per engine replica
    (``engine_cls``: a decoder engine fed by encoder workers with ``--disaggregate``)."""
    realtime_limits, engine_args = check_server_flags(args)
    configure_cpu_runtime(engine_args.num_threads)  # a server owns its process: full CPU speed
    model_name = args.served_model_name or args.model
    metrics = ServerMetrics(model_name)
    engine = engine_cls.from_engine_args(engine_args, on_step=metrics.record_step)
    app = build_app(engine, model_name=model_name, model_path=args.model, api_key=args.api_key,
                    max_audio_mb=args.max_audio_mb, metrics=metrics,
                    body_read_timeout=args.body_read_timeout, body_timeout=args.body_timeout,
                    ui=not args.no_ui)
    app.state.server.realtime_limits = realtime_limits
    return app


def serve(args: argparse.Namespace) -> int:
    """Build the engine (errors show before the port opens), then run uvicorn until
    SIGINT/SIGTERM; uvicorn stops accepting, finishes the requests in flight
    (drain), and the app's lifespan stops the engine thread. (``--ray`` runs the
    same app on Ray Serve: ``encdec.serve_ray``.)"""
    import uvicorn

    from encdec.entrypoints.openai.realtime_protocol import WS_MAX_MESSAGE_BYTES

    app = app_from_args(args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=60, access_log=False, ws_max_size=WS_MAX_MESSAGE_BYTES,
                            http=header_timeout_protocol(args.header_read_timeout))
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal to the handler in
    # place before it started: make that one a no-op, so a drained server exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    return 0
