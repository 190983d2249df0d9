"""``encdec serve MODEL --ray --replicas N``: ``encdec serve`` on Ray Serve.

An ingress deployment (no CPU reserved) takes every HTTP request and WebSocket
and relays it, through a deployment handle, to one of N ``EngineReplica``s;
each replica is one ``AsyncLLMEngine`` inside the very app ``encdec serve``
runs (``app_from_args``), so the routes, validation and error JSON are the
same by construction (``asgi_relay``). Routing is Ray Serve's default: of two
replicas picked at random, the one with fewer requests in flight (power of two
choices), so a busy replica gets fewer new requests. A Realtime WebSocket is
one streaming call for its whole life, so it stays on the replica that took it;
its client events reach that replica through a small queue actor.

``/metrics`` on the ingress is every live replica's metrics, each sample with a
``replica`` label: replicas push their exposition to a named board actor each
second, and one silent for 10 s is left out.

Faults: a replica that dies fails the requests it held with a 503 in OpenAI's
error shape (a stream already started ends with an error event); Serve starts a
new replica, and the other replicas keep serving. A relayed request waits at
most ``ray_ingress.RELAY_IDLE_TIMEOUT`` seconds for the next piece of its answer.

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
STREAM_COALESCE_SECONDS = 0.02  # a streamed answer's pieces go to the ingress at most this often


def _ray() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ImportError(f"encdec serve --ray needs Ray Serve: pip install '{EXTRA}' ({e})") from e
    return ray, serve


class EngineReplica:
    """One engine inside ``encdec serve``'s app; the ingress calls ``http`` and
    ``websocket`` (streaming) through a deployment handle."""

    async def __init__(self, args: argparse.Namespace, encoders: Any = None) -> None:
        """``encoders``: the encoder workers' handle (``--disaggregate``): this
        replica's engine is then a ``DecoderEngine`` they feed."""
        _, serve = _ray()
        from encdec.entrypoints.openai.api_server import app_from_args
        from encdec.serve_ray.disaggregate import DecoderEngine, TransferCollector

        self.replica = serve.get_replica_context().replica_id.unique_id
        # loads the model: a bad one fails the deployment
        self.app = app_from_args(args, engine_cls=DecoderEngine) if encoders else app_from_args(args)
        if encoders:
            server = self.app.state.server
            server.engine.encoders = encoders
            server.metrics.registry.register(TransferCollector(server.engine.transfers, server.model_name))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread on this event loop
        self._pusher = asyncio.create_task(self._push_metrics())

    async def _push_metrics(self) -> None:
        from encdec.entrypoints.openai.ray_ingress import metrics_board

        board = None
        while True:
            try:
                board = board or metrics_board()
                await board.put.remote(self.replica, self.app.state.server.metrics.render())
            except Exception as e:  # the board's owner died: the next round makes another
                logger.warning("metrics push failed: %s", e)
                board = None
            await asyncio.sleep(PUSH_SECONDS)

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine thread has stopped."""
        engine = self.app.state.server.engine
        if not engine.is_running:
            raise RuntimeError(f"the engine is not running: {engine.error!r}")

    async def http(self, scope: dict, body: bytes):
        """The app's messages for one request in lists (``run_asgi``), after one
        naming this replica, sent at once (so the ingress can say which replica a
        lost request was on, and retries only a request no replica took). Once a
        stream's body has started, each
        next list waits ``STREAM_COALESCE_SECONDS``, so the tokens made meanwhile
        cross as one list: each list costs two Ray hops (here to the ingress, the
        ingress to Serve's proxy), about 1.5 ms of CPU on the 2-core host where it
        was measured (``benchmarks.serve_hops``)."""
        from encdec.entrypoints.openai.asgi_relay import body_receive, run_asgi

        yield [{"type": "relay.replica", "replica": self.replica}]
        async for messages in run_asgi(self.app, scope, body_receive(body), self.replica):
            yield messages
            last = messages[-1]
            if last["type"] == "http.response.body" and last.get("more_body"):
                await asyncio.sleep(STREAM_COALESCE_SECONDS)  # run_asgi queues what comes meanwhile

    async def websocket(self, scope: dict, inbox: Any):
        from encdec.entrypoints.openai.asgi_relay import run_asgi

        async def receive() -> dict:
            return await inbox.get_async()

        yield [{"type": "relay.replica", "replica": self.replica}]
        async for messages in run_asgi(self.app, scope, receive, self.replica):
            yield messages


def _actor_options(cpus: float, gpus: float) -> dict[str, float]:
    options = {"num_cpus": cpus}
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
                                    max_ongoing_requests=256).bind(args)
        replicas = split.decoders
    return serve.deployment(EngineReplica, name="EngineReplica", num_replicas=replicas,
                            ray_actor_options=_actor_options(args.replica_cpus, args.replica_gpus),
                            health_check_period_s=5,
                            max_ongoing_requests=256).bind(args, encoders)


def build_application(args: argparse.Namespace) -> Any:
    """The Serve application for ``encdec serve``'s parsed flags (``--ray``)."""
    _, serve = _ray()
    from encdec.entrypoints.openai.api_server import check_server_flags
    from encdec.entrypoints.openai.ray_ingress import ingress_deployment

    check_server_flags(args)  # a bad flag fails here, not in every replica
    max_body = int(args.max_audio_mb * (1 << 20)) + (64 << 10)
    return ingress_deployment(serve).bind(_replica_deployment(args), max_body, args.body_timeout)


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
        ray.init(configure_logging=False)
    # set after ray.init (which sets its own); a signal while deploying stops once deployed
    stopping: list[int] = []  # a flag only: a lock taken in a handler can deadlock its own thread
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application, name=APP_NAME, route_prefix="/")
    what = (f"{args.replicas} replica(s)" if not args.disaggregate
            else f"disaggregated ({args.disaggregate}): decoder replica(s)")
    print(f"encdec serve --ray: {what} of {args.model} on http://{args.host}:{args.port}", flush=True)
    while not stopping:
        time.sleep(0.2)
    serve.delete(APP_NAME)
    serve.shutdown()
    return 0
