"""tokenleap on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

Two deployments make the app (`deployment(...)`, composable into a user's own Serve app):

* `TokenleapEngine` (N replicas, or autoscaled): each loads the model (its torch and kernel
  threads sized by `RayServeConfig.threads`) and runs the single-process server's own FastAPI
  app (`tokenleap.server.create_app`) and engine loop in-process, so routes, validation, errors,
  streaming, the API key and the per-request `speculative` field are the single server's code.
  `forward` drives that ASGI app for one HTTP request and yields the response start, then the
  body chunks (SSE deltas as they are produced). Ray cancelling the call (the client went away)
  is an ASGI `http.disconnect`, which aborts the request in the engine as in the single server.
* `TokenleapIngress` (cheap, no CPUs reserved): reads the request, computes its affinity key
  (`router.affinity_key`) and calls `forward` on a replica chosen by `router.AffinityRouter`.
  A replica that dies before answering is retried on another (nothing was sent yet); one that
  dies mid-stream ends the stream with an OpenAI error event and `[DONE]` (a clean error, never
  a hang). `/metrics` merges every replica's metrics with a `replica` label
  (`tokenleap.ray.metrics`).

Replicas share drafter statistics through `tokenleap.ray.sharing` unless turned off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import MutableMapping
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenleap.drafters.base import GlobalStatistics
from tokenleap.ray.config import RayServeConfig
from tokenleap.ray.metrics import merge_metrics
from tokenleap.ray.router import AffinityRouter, affinity_key
from tokenleap.ray.sharing import Sharer, hub_actor
from tokenleap.server.config import ServerConfig
from tokenleap.server.errors import APIError
from tokenleap.server.handlers import read_body
from tokenleap.server.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

_RETRIES = 2  # tries on other replicas when a replica dies before it answered
REPLICA_HEADER = "x-tokenleap-replica"  # on every response: the replica that answered
STATS_PATH = "/v1/tokenleap/replica"


class EngineReplica:
    """One engine replica (see the module docstring)."""

    def __init__(self, llm_kwargs: dict[str, Any], server: ServerConfig, cfg: RayServeConfig) -> None:
        import torch

        from tokenleap.llm import LLM
        from tokenleap.server.app import create_app

        torch.set_num_threads(cfg.threads())  # before the model load: the kernels size their pool from it
        self.llm = LLM(**llm_kwargs)
        self.app = create_app(self.llm, server)
        self.state = self.app.state.tokenleap
        self.state.loop.start()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # not inside Serve (tests of the class itself)
            self.replica_id = f"local-{id(self):x}"
        metrics = self.state.metrics
        self.sharer = Sharer(
            hub_actor(cfg.app_name, cfg.share_queue),
            self.replica_id,
            self.state.loop,
            share=cfg.share_stats,
            period=cfg.share_period,
            metrics_text=lambda: metrics.render().decode(),
        )
        self.sharer.start()

    async def forward(self, key: str | None, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes) -> Any:
        """Run one HTTP request through the app: yields {"status", "headers"}, then body chunks.
        `key` is only read by the router. `GET /v1/tokenleap/replica` answers this replica's
        `stats()` (behind the API key), so operators and tests can see where a key lands."""
        if path == STATS_PATH:
            async for item in self._stats_response(headers):
                yield item
            return
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": query.encode(),
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {}}
        messages: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await messages.put(None)

        task = asyncio.ensure_future(run())
        try:
            while True:
                msg = await messages.get()
                if msg is None:
                    break
                if msg["type"] == "http.response.start":
                    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    yield {"status": msg["status"], "headers": out + [(REPLICA_HEADER, self.replica_id)]}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield bytes(msg["body"])
                    if not msg.get("more_body", False):
                        break
        finally:
            gone.set()  # the handler sees a disconnect and aborts the request (a no-op once finished)
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()

    async def _stats_response(self, headers: list[tuple[str, str]]) -> Any:
        key = self.state.config.api_key
        auth = dict((k.lower(), v) for k, v in headers).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if key is not None and not (
            scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
        ):
            status, body = (
                401,
                APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                ).body(),
            )
        else:
            status, body = 200, self.stats()
        yield {"status": status, "headers": [("content-type", "application/json"), (REPLICA_HEADER, self.replica_id)]}
        yield json.dumps(body).encode()

    def stats(self) -> dict[str, Any]:
        """This replica's identity and sharing counters, and its drafters' global statistics."""
        sizes = {}
        for d in self.llm.engine.drafters():
            if isinstance(d, GlobalStatistics):
                sizes[d.name] = d.global_size()
        loop = self.state.loop
        return {
            "replica": self.replica_id, "actor": ray.get_runtime_context().get_actor_name(),
            "published": self.sharer.num_published, "ingested": self.sharer.num_ingested,
            "skipped": self.sharer.num_skipped, "cached_outputs": sizes, "live": loop.num_live, "added": loop.num_added,
            "freed": loop.num_freed
        }

    def pull(self) -> int:
        """Pull others' answers now (tests); returns how many were queued for the engine thread."""
        return self.sharer.pull_once()

    def check_health(self) -> None:
        if not self.state.loop.alive:
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:
        sharer, state = getattr(self, "sharer", None), getattr(self, "state", None)
        if sharer is not None:
            sharer.stop()
        if state is not None:
            state.loop.stop()


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, code=code).body(), status_code=status)


class Ingress:
    """The HTTP entry (see the module docstring)."""

    def __init__(self, engine: Any, server: ServerConfig, cfg: RayServeConfig) -> None:
        self.engine = engine
        self.server = server
        self.hub = hub_actor(cfg.app_name, cfg.share_queue)

    def _authorized(self, request: Request) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            if self.server.metrics_api_key_required and not self._authorized(request):
                return _error(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
                )
            texts = await self.hub.all_metrics.remote()
            return Response(merge_metrics(texts), media_type=CONTENT_TYPE)
        try:
            body = await read_body(request, self.server.max_request_bytes)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        headers = list(request.headers.items())
        key = affinity_key(path, request.headers, body)
        call = (key, request.method, path, request.url.query, headers, body)
        gen, start = None, None
        for attempt in range(_RETRIES + 1):
            gen = self.engine.options(stream=True).forward.remote(*call)
            try:
                start = await gen.__anext__()
                break
            except ray.exceptions.RayActorError as exc:
                logger.warning("replica died before answering (%s); %s", type(exc).__name__,
                               "retrying on another" if attempt < _RETRIES else "giving up")
                if attempt < _RETRIES:
                    await asyncio.sleep(0.5 * (attempt + 1))  # time for the router to drop the dead replica
            except StopAsyncIteration:
                return _error(500, "internal server error: the replica sent no response")
            except Exception as exc:
                logger.error("forwarding failed: %s", exc)
                return _error(503, "no engine replica could take the request")
        if start is None or gen is None:
            return _error(503, "the engine replicas serving this request died; try again")
        out_headers = {k: v for k, v in start["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        sse = "text/event-stream" in out_headers.get("content-type", "")
        return StreamingResponse(_relay(gen, sse), status_code=start["status"], headers=out_headers)


async def _relay(gen: Any, sse: bool) -> Any:
    """The replica's body chunks; a replica dying mid-stream ends an SSE stream with an error
    event and [DONE] (a whole-body response is cut, which the client sees as an error)."""
    try:
        async for chunk in gen:
            yield chunk
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("the replica failed mid-response: %s", type(exc).__name__)
        if sse:
            err = APIError(503, "the engine replica serving this request failed; try again").body()
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        gen.cancel()


def deployment(model: str | None = None, *, speculative_config: dict[str, Any] | None = None,
               llm_kwargs: dict[str, Any] | None = None, server: ServerConfig | None = None,
               config: RayServeConfig | None = None) -> Any:
    """A bound Ray Serve application (ingress + engine replicas) to `serve.run` or compose.
    `llm_kwargs` are `tokenleap.LLM`'s arguments (`model` / `speculative_config` fill them in)."""
    server = server or ServerConfig()
    cfg = config or RayServeConfig()
    kwargs = dict(llm_kwargs or {})
    if model is not None:
        kwargs["model"] = model
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    # threads fixed here (the driver's machine) so that every replica reserves what it uses
    cfg = dataclasses.replace(cfg, threads_per_replica=cfg.threads())
    autoscaling = cfg.autoscaling_config()
    scaling: dict[str, Any] = {"autoscaling_config": autoscaling} if autoscaling else {}
    engine = serve.deployment(
        EngineReplica, name="TokenleapEngine",
        num_replicas="auto" if autoscaling else cfg.replicas,
        **scaling,
        max_ongoing_requests=cfg.max_ongoing_requests or server.max_num_seqs + server.max_queue,
        ray_actor_options={"num_cpus": cfg.threads_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter),  # type: ignore[arg-type]  # Ray annotates **kwargs: dict[str, Any]; the field takes a class
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=server.shutdown_timeout,
    )
    ingress = serve.deployment(Ingress, name="TokenleapIngress", num_replicas=1, max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(kwargs, server, cfg), server, cfg)  # type: ignore[attr-defined]  # Ray annotates serve.deployment as the decorator; given the class it returns a Deployment


def start(app: Any, server: ServerConfig, cfg: RayServeConfig, *, blocking: bool = False) -> str:
    """Connect to (or start) Ray, start Serve's HTTP proxy on server.host:port and run `app`;
    returns the base URL."""
    if not ray.is_initialized():
        local: dict[str, Any] = {}
        if cfg.ray_address is None:  # a local instance: room for every replica even on a small machine
            most = cfg.max_replicas if cfg.max_replicas is not None else cfg.replicas
            local["num_cpus"] = max(os.cpu_count() or 1, most * cfg.threads())
        ray.init(address=cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=server.log_level in ("debug", "trace"), **local)
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=blocking)
    host = server.host if ":" not in server.host else f"[{server.host}]"
    return f"http://{host}:{server.port}"


def wait_ready(url: str, timeout: float = 300.0) -> None:
    """Wait until the ingress answers /health with 200 (every replica loaded its model)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy within {timeout:.0f} s")


def run_until_signal(app: Any, server: ServerConfig, cfg: RayServeConfig, on_ready: Any = None) -> None:
    """`start` the app, wait until it is healthy (`on_ready(url)`), serve until SIGINT / SIGTERM,
    then delete the app (and shut down the Ray instance this started, if it started one)."""
    import signal
    import threading

    started_ray = not ray.is_initialized() and cfg.ray_address is None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = start(app, server, cfg)
        wait_ready(url)
        if on_ready is not None:
            on_ready(url)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.delete(cfg.app_name)
            ray.kill(hub_actor(cfg.app_name, cfg.share_queue))  # the app's shared answers go with it
            if started_ray:
                serve.shutdown()
                ray.shutdown()
        except Exception as exc:
            logger.warning("shutting down Ray Serve: %s", exc)
