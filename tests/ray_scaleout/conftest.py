"""Ray scale-out fixtures: one local Ray instance on loopback for the session, and on it the
tokenleap Serve app (2 engine replicas of 1 thread each over the real default model, suffix
speculation, statistics sharing on, an API key) behind Serve's HTTP proxy on a free port."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from tokenleap.ray.config import RayServeConfig  # noqa: E402
from tokenleap.server.config import ServerConfig  # noqa: E402

MODEL = "smollm2-135m-instruct"
API_KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, address="local", log_to_driver=False,
             runtime_env={"env_vars": {"OMP_WAIT_POLICY": "passive"}})
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_server(ray_cluster: None) -> Iterator[str]:
    from tokenleap.ray.serve import deployment, start, wait_ready

    server = ServerConfig(
        host="127.0.0.1", port=_free_port(), api_key=API_KEY, log_level="warning", max_request_bytes=64 * 1024
    )
    cfg = RayServeConfig(replicas=2, threads_per_replica=1, share_period=0.2)
    url = start(deployment(MODEL, speculative_config={"method": "suffix"}, server=server, config=cfg), server, cfg)
    wait_ready(url)
    yield url


def replica_of(url: str, session: str) -> str:
    """The replica a session id is routed to."""
    r = httpx.get(
        url + "/v1/tokenleap/replica", headers={**AUTH, "x-session-id": session}, timeout=30
    ).raise_for_status()
    return r.json()["replica"]


def sessions_on_each_replica(url: str, n: int = 2, tries: int = 64) -> dict[str, str]:
    """replica id -> a session id routed to it (one per replica, `n` replicas)."""
    found: dict[str, str] = {}
    tag = uuid.uuid4().hex[:8]  # fresh keys: the router remembers where a key went last
    for i in range(tries):
        session = f"probe-{tag}-{i}"
        found.setdefault(replica_of(url, session), session)
        if len(found) == n:
            return found
    raise AssertionError(f"sessions reached only {len(found)} replicas")


def replica_stats(url: str, session: str) -> dict:
    return (
        httpx.get(url + "/v1/tokenleap/replica", headers={**AUTH, "x-session-id": session}, timeout=30)
        .raise_for_status()
        .json()
    )


T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float = 60.0, every: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(every)
