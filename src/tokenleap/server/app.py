"""The OpenAI-compatible HTTP app: `create_app(llm, config)` builds a FastAPI application.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE streaming or whole answers),
GET /v1/models, GET /health (never behind the API key), GET /metrics (Prometheus text; behind the
key only with `metrics_api_key_required`, as vLLM leaves it open for scrapers). The
app owns its engine loop thread (started and stopped by the ASGI lifespan) and its metrics
registry; nothing is global, so several apps can live in one process (one engine each: an
engine is single-threaded and must not be served by two live apps at once). Every error a
client can cause is a 4xx with an OpenAI error body; anything else is a 500 without a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenleap._version import __version__
from tokenleap.config import DEFAULT_DRAFT_TOKENS
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM
from tokenleap.server import handlers
from tokenleap.server.config import ServerConfig
from tokenleap.server.errors import APIError
from tokenleap.server.handlers import ServerState
from tokenleap.server.loop import EngineLoop
from tokenleap.server.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)


def _aliases(llm: LLM, served: str) -> frozenset[str]:
    names = {served, llm.config.model, llm.source.name, Path(llm.source.path).name, Path(llm.source.path).stem}
    return frozenset(n for n in names if n) | frozenset(n.lower() for n in names if n)


def _draft_cap(llm: LLM, config: ServerConfig) -> int:
    """The largest draft length cap a request may ask for."""
    own = llm.engine.spec.num_speculative_tokens if llm.engine.spec is not None else None
    cap = config.max_num_speculative_tokens or own or DEFAULT_DRAFT_TOKENS
    if own is not None and cap < own:
        raise TokenleapError(
            f"max_num_speculative_tokens ({cap}) is below the server's own draft cap ({own}, --draft-max)"
        )
    return cap


def create_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `llm` (its engine, tokenizer and default speculative config)."""
    config = config or ServerConfig()
    served = config.served_model_name or llm.config.model
    draft_cap = _draft_cap(llm, config)
    holder: dict[str, EngineLoop] = {}
    metrics = ServerMetrics(
        served, running=lambda: holder["loop"].num_running, waiting=lambda: holder["loop"].num_waiting
    )
    loop = holder["loop"] = EngineLoop(llm.engine, metrics, max_num_seqs=config.max_num_seqs,
                                       max_queue=config.max_queue, timeout=config.timeout,
                                       log_requests=config.log_requests, cost_curve_cap=draft_cap)
    state = ServerState(llm, config, loop, metrics, served, _aliases(llm, served), int(time.time()), draft_cap)
    llm.engine.max_drafters = config.max_spec_configs  # per-request configs keep at most this many drafters

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(
        title="tokenleap", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.tokenleap = state

    async def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(
                401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    auth = [Depends(require_key)]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, "internal server error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {"status": "ok" if loop.accepting else ("draining" if loop.alive else "down"),
                                "running": loop.num_running, "waiting": loop.num_waiting, "live": loop.num_live,
                                "speculative": metrics.speculation()}
        return JSONResponse(body, status_code=200 if loop.alive else 503)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def model(model: str) -> dict[str, Any]:
        handlers.check_model(state, model)
        return _model_card(state)

    @app.get("/metrics", dependencies=auth if config.metrics_api_key_required else [])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Response:
        return await handlers.chat_completions(request, state)

    @app.post("/v1/completions", dependencies=auth)
    async def complete(request: Request) -> Response:
        return await handlers.completions(request, state)

    return app


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tokenleap",
            "root": state.llm.config.model, "parent": None, "max_model_len": state.max_context}
