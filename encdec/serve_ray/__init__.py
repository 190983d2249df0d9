"""``encdec serve MODEL --ray --replicas N``: ``encdec serve`` on Ray Serve.

Each of N ``EngineReplica``s is one ``AsyncLLMEngine`` inside the very app
``encdec serve`` runs (``app_from_args``), and is itself the ingress deployment:
Serve's HTTP proxy hands each request and WebSocket straight to a replica, one
Ray hop, so the routes, validation and error JSON are ``encdec serve``'s by
construction (``replica_app`` wraps the app). Routing is Serve's proxy's: of two
replicas picked at random, the one with fewer requests in flight (power of two
choices). A Realtime WebSocket is one call for its whole life, so it stays on the
replica that took it.

``/metrics`` on any replica is every live replica's metrics, each sample with a
``replica`` label: replicas push their exposition to a named board actor each
second, and one silent for 10 s is left out.

Faults: a replica that dies fails the requests it held with a 503 in OpenAI's
error shape naming it (a stream already started ends with an error event); an API
request its replica had barely taken is sent once more; both done by a middleware in
Serve's proxy (``proxy_errors``), which needs its environment
variable in the proxy's process (``serve_ray`` sets it for the cluster it
starts or joins). Serve starts a new replica; the other replicas keep serving.

``--ingress haproxy`` puts Serve's HAProxy ingress in front instead of its
Python proxy: each replica serves HTTP itself and HAProxy forwards to it, no Ray
call on the request path (``encdec.serve_ray.ingress``, which says what changes).

``--disaggregate encoders=E,decoders=D`` puts the encoder passes on E encoder
workers and makes the D replicas decoder engines fed by them
(``encdec.serve_ray.disaggregate``).

Ray Serve is the ``serve-ray`` extra, imported only here and only when used.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

logger = logging.getLogger("encdec")

EXTRA = "encdec[serve-ray]"
APP_NAME = "encdec"
PUSH_SECONDS = 1.0  # how often a replica sends its metrics to the board
STREAM_COALESCE_SECONDS = 0.02  # a streamed answer's pieces go to Serve's proxy at most this often


def _ray() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ImportError(f"encdec serve --ray needs Ray Serve: pip install '{EXTRA}' ({e})") from e
    return ray, serve


class EngineReplica:
    """One engine inside ``encdec serve``'s app, served to Serve's proxy as the
    ingress (``__serve_build_asgi_app__``: the app wrapped by ``ReplicaApp``)."""

    async def __init__(self, args: argparse.Namespace, encoders: Any = None) -> None:
        """``encoders``: the encoder workers' handle (``--disaggregate``): this
        replica's engine is then a ``DecoderEngine`` they feed."""
        _, serve = _ray()
        from encdec.entrypoints.openai.api_server import app_from_args
        from encdec.serve_ray.disaggregate import DecoderEngine, TransferCollector
        from encdec.serve_ray.replica_app import ReplicaApp

        self.replica = serve.get_replica_context().replica_id.unique_id
        # loads the model: a bad one fails the deployment
        self.server_app = app_from_args(args, engine_cls=DecoderEngine) if encoders else app_from_args(args)
        if encoders:
            server = self.server_app.state.server
            server.engine.encoders = encoders
            server.metrics.registry.register(TransferCollector(server.engine.transfers, server.model_name))
        self._lifespan = self.server_app.router.lifespan_context(self.server_app)
        await self._lifespan.__aenter__()  # starts the engine thread on this event loop
        self._board: Any = None
        self._pusher = asyncio.create_task(self._push_metrics())
        self.replica_app = ReplicaApp(self.server_app, self.replica, max_body=_max_body(args),
                                      read_timeout=args.body_read_timeout, body_timeout=args.body_timeout,
                                      metrics=self._merged_metrics, on_shutdown=self._shutdown,
                                      coalesce=STREAM_COALESCE_SECONDS)

    def __serve_build_asgi_app__(self) -> Any:
        return self.replica_app

    def _metrics_text(self) -> bytes:
        return self.server_app.state.server.metrics.render()

    async def _push_metrics(self) -> None:
        from encdec.serve_ray.board import metrics_board

        while True:
            try:
                self._board = self._board or metrics_board()
                await self._board.put.remote(self.replica, self._metrics_text())
            except Exception as e:  # the board's owner died: the next round makes another
                logger.warning("metrics push failed: %s", e)
                self._board = None
            await asyncio.sleep(PUSH_SECONDS)

    async def _merged_metrics(self) -> bytes:
        """Every live replica's metrics (this one's as of now), labelled by replica."""
        from encdec.entrypoints.openai.asgi_relay import merge_metrics
        from encdec.serve_ray.board import metrics_board
        from encdec.serve_ray.replica_app import STALE_SECONDS

        texts: dict[str, bytes] = {}
        try:
            self._board = self._board or metrics_board()
            texts = await self._board.snapshot.remote(STALE_SECONDS)
        except Exception as e:  # the board is being replaced: this replica's own, for now
            logger.warning("metrics board unavailable: %s", e)
            self._board = None
        texts[self.replica] = self._metrics_text()
        return merge_metrics(texts)

    async def _shutdown(self) -> None:
        self._pusher.cancel()
        await self._lifespan.__aexit__(None, None, None)  # drains and stops the engine

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine thread has stopped."""
        engine = self.server_app.state.server.engine
        if not engine.is_running:
            raise RuntimeError(f"the engine is not running: {engine.error!r}")


def _max_body(args: argparse.Namespace) -> int:
    """The largest body any route reads: an audio upload plus its form fields."""
    return int(args.max_audio_mb * (1 << 20)) + (64 << 10)


# Serve's processes (proxy and controller through the controller's environment; replicas and
# workers through their own): the proxy calls replicas, and a decoder replica its encoder
# workers, over gRPC rather than as Ray actor tasks (a streamed answer's messages cost the
# proxy and the replica far less CPU each; an encoder output travels in the reply), and
# each process runs the user's code and the router on its main event loop (by default each
# has a thread of its own, and every ASGI message and routing decision crosses threads).
# The controller's loop (replica states, health, routing tables) runs every 0.5 s, not
# 0.1 s: 2-3% of a core less, and a dead replica is still replaced within a second of
# Serve noticing (health checks every 5 s; a replica's death is seen by its callers at once).
# Also: no access log line per request (a line costs the replica a write and Ray's log
# monitor a read and a publish); warnings and errors are still logged.
SERVE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
             "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
REPLICA_LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


def _actor_options(cpus: float, gpus: float) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": cpus, "runtime_env": {"env_vars": dict(SERVE_ENV)}}
    if gpus:
        options["num_gpus"] = gpus
    return options


def _replica_deployment(args: argparse.Namespace) -> Any:
    """N engine replicas; with ``--disaggregate``, D decoder engines bound to E encoder workers."""
    _, serve = _ray()
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    encoders, replicas = None, args.replicas
    if args.disaggregate:
        from encdec.serve_ray.disaggregate import encoder_worker_class, parse_disaggregate

        split = parse_disaggregate(args.disaggregate)
        if args.replicas != 1:
            raise ValueError("--replicas and --disaggregate both set the engine count: give it as "
                             f"--disaggregate encoders=E,decoders=D alone (got --replicas {args.replicas})")
        options = _actor_options(args.replica_cpus if split.encoder_cpus is None else split.encoder_cpus,
                                 args.replica_gpus if split.encoder_gpus is None else split.encoder_gpus)
        encoders = serve.deployment(encoder_worker_class(), name="EncoderWorker", num_replicas=split.encoders,
                                    ray_actor_options=options, health_check_period_s=5,
                                    logging_config=REPLICA_LOGGING,
                                    max_ongoing_requests=256).bind(args)
        replicas = split.decoders
    return serve.deployment(serve.ingress()(EngineReplica), name="EngineReplica", num_replicas=replicas,
                            ray_actor_options=_actor_options(args.replica_cpus, args.replica_gpus),
                            logging_config=REPLICA_LOGGING,
                            health_check_period_s=5,
                            max_ongoing_requests=256).bind(args, encoders)


def build_application(args: argparse.Namespace) -> Any:
    """The Serve application for ``encdec serve``'s parsed flags (``--ray``)."""
    from encdec.entrypoints.openai.api_server import check_server_flags
    from encdec.serve_ray.ingress import check_ingress

    check_server_flags(args)  # a bad flag fails here, not in every replica
    check_ingress(getattr(args, "ingress", "serve"))
    return _replica_deployment(args)


def start_serve(host: str, port: int, ingress: str = "serve") -> None:
    """Start Serve on the cluster ``ray`` is connected to, with HTTP on
    ``host``:``port`` through ``ingress`` (``encdec.serve_ray.ingress``: Serve's
    Python proxy, with what the replicas need of it, ``proxy_errors``; or HAProxy),
    and no per-request access log (a log line per request costs the proxy and the
    replica CPU the engines need). A Serve already running keeps its options."""
    _, serve = _ray()
    from encdec.serve_ray.ingress import ingress_env
    from encdec.serve_ray.proxy_errors import proxy_env

    # HAProxy mode has no Python proxy on the request path: the middleware would only wrap
    # each replica's own server (Serve applies the proxy's middlewares there too)
    env = {**SERVE_ENV, **(ingress_env(ingress) if ingress != "serve" else proxy_env())}
    serve.start(http_options={"host": host, "port": port},
                controller_options={"runtime_env": {"env_vars": env}},
                logging_config=REPLICA_LOGGING)


def build(config: dict[str, Any]) -> Any:
    """``serve run encdec.serve_ray:build model=MODEL replicas=2 ...``: the keys are
    ``encdec serve``'s flags without the dashes (``num_threads=1``); a flag with
    no value takes ``true``. ``disaggregate`` is ``"encoders=E,decoders=D"`` or
    ``{"encoders": E, "decoders": D}``."""
    from encdec.entrypoints.openai.cli_args import add_server_args

    config = dict(config)
    if "model" not in config:
        raise ValueError("the application's args need 'model' (a hub id or checkpoint directory)")
    argv = [str(config.pop("model"))]
    split = config.get("disaggregate")
    if isinstance(split, dict):
        config["disaggregate"] = ",".join(f"{k}={v}" for k, v in split.items())
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is not False and str(value).lower() != "false":
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="encdec serve")
    add_server_args(parser)
    args = parser.parse_args(argv)
    args.ray = True
    return build_application(args)


def serve_ray(args: argparse.Namespace) -> int:
    """Join the cluster at ``RAY_ADDRESS`` (or start a local one), deploy, and
    serve on ``--host``/``--port`` until SIGINT/SIGTERM."""
    import signal
    import time

    ray, serve = _ray()
    application = build_application(args)  # flag errors before any process starts
    if not ray.is_initialized():
        import os

        # a cluster of our own (no RAY_ADDRESS) runs without Ray's dashboard: its processes
        # cost CPU the engines need; a cluster joined keeps whatever it runs
        local = {} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}
        ray.init(configure_logging=False, **local)
    # set after ray.init (which sets its own); a signal while deploying stops once deployed
    stopping: list[int] = []  # a flag only: a lock taken in a handler can deadlock its own thread
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    start_serve(args.host, args.port, getattr(args, "ingress", "serve"))
    serve.run(application, name=APP_NAME, route_prefix="/")
    what = (f"{args.replicas} replica(s)" if not args.disaggregate
            else f"disaggregated ({args.disaggregate}): decoder replica(s)")
    print(f"encdec serve --ray: {what} of {args.model} on http://{args.host}:{args.port}", flush=True)
    while not stopping:
        time.sleep(0.2)
    serve.delete(APP_NAME)
    serve.shutdown()
    return 0
