"""Running the app under uvicorn: in the foreground (`serve`, the CLI) or on a background
thread (`BackgroundServer`, tests and benchmarks).

The listening socket is bound before anything else, so a port in use is a clear error rather
than a traceback after a model load. Shutdown is graceful, as uvicorn does it: on SIGINT or
SIGTERM the server stops accepting connections and new requests (503), gives in-flight requests
`shutdown_timeout` seconds to finish, cancels the rest, and the app's lifespan then stops the
engine loop, which frees every request still holding a cache.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM
from tokenleap.server.app import create_app
from tokenleap.server.config import ServerConfig
from tokenleap.server.handlers import ServerState


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise TokenleapError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = "; the port is in use (pick another with --port)" if exc.errno == errno.EADDRINUSE else ""
        raise TokenleapError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine loop to refuse new requests on the first signal and
    returning normally after a signal-initiated shutdown (uvicorn re-raises the signal)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.loop.drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _uvicorn_config(llm: LLM, config: ServerConfig, access_log: bool) -> tuple[uvicorn.Config, ServerState]:
    app = create_app(llm, config)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=access_log,
                        timeout_graceful_shutdown=config.shutdown_timeout,  # type: ignore[arg-type]  # uvicorn annotates int | None; a float timeout works
                        lifespan="on", server_header=False)
    return uv, app.state.tokenleap


def serve(llm: LLM, config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT / SIGTERM (in the main thread)."""
    sock = sock or bind_socket(config.host, config.port)
    uv, state = _uvicorn_config(llm, config, access_log=True)
    server = _Server(uv, state)
    try:
        server.run(sockets=[sock])
    finally:
        state.loop.stop()  # after a forced exit uvicorn skips the lifespan shutdown
        sock.close()


class BackgroundServer:
    """A server on a background thread at `url` (tests, benchmarks); `stop()` shuts it down."""

    def __init__(self, llm: LLM, config: ServerConfig | None = None, startup_timeout: float = 60.0) -> None:
        config = config or ServerConfig(port=0, log_level="warning")
        self.sock = bind_socket(config.host, config.port)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        uv, self.state = _uvicorn_config(llm, config, access_log=False)
        self.server = _Server(uv, self.state)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="tokenleap-http", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self, timeout: float = 60.0) -> None:
        self.state.loop.drain()
        self.server.should_exit = True
        self.thread.join(timeout)
        self.state.loop.stop()
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
