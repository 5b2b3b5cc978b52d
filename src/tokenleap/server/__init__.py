"""OpenAI-compatible HTTP server for tokenleap (`tokenleap serve`).

`create_app(llm, config)` builds the FastAPI app (routes in `app`, request handling in
`handlers`, wire shapes in `protocol`); `loop.EngineLoop` owns the engine on one background
thread with continuous batching; `metrics.ServerMetrics` exposes vLLM-named Prometheus metrics;
`runner.serve` / `runner.BackgroundServer` run it under uvicorn. Needs the `server` extra
(fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations

from tokenleap.server.app import create_app
from tokenleap.server.config import ServerConfig
from tokenleap.server.runner import BackgroundServer, bind_socket, serve

__all__ = ["BackgroundServer", "ServerConfig", "bind_socket", "create_app", "serve"]
