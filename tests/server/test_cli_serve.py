"""`tokenleap serve`: clear errors with exit status 2 before any model load, and a real server
process that answers with its flags' speculation and shuts down cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tokenleap.cli import main
from tokenleap.server import bind_socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_in_use_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
        assert time.monotonic() - t0 < 5  # refused before loading the model
    finally:
        sock.close()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["serve", "--max-queue", "-1"], "max_queue must be >= 0"),
        (["serve", "--timeout", "0"], "timeout must be > 0"),
        (["serve", "--port", "70000"], "port must be in [0, 65535]"),
        (["serve", "--max-num-speculative-tokens", "65"], "max_num_speculative_tokens must be in [1, 64]"),
        (
            ["serve", "--spec-type", "ngram", "--draft-max", "8", "--max-num-speculative-tokens", "4"],
            "is below --draft-max (8)",
        ),
        (["serve", "--host", "no-such-host.invalid"], "cannot resolve host"),
        (["serve", "--port", "0", "--spec-type", "bogus"], "unknown speculative method 'bogus'"),
        (["serve", "--port", "0", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_max_num_seqs_is_the_one_name_of_the_running_request_bound() -> None:
    """One name for the running-request bound, vLLM's: `--max-num-seqs` / `max_num_seqs` (as
    `LLM(max_num_seqs=...)`); the pre-release `--max-batch` is gone (a usage error)."""
    from tokenleap.cli import build_parser
    from tokenleap.server import ServerConfig

    args = build_parser().parse_args(["serve", "--max-num-seqs", "8"])
    assert ServerConfig(max_num_seqs=args.max_num_seqs).max_num_seqs == 8
    assert build_parser().parse_args(["serve"]).max_num_seqs == ServerConfig().max_num_seqs == 16
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-batch", "8"])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_process(sig: signal.Signals) -> None:
    port = _free_port()
    env = {**os.environ, "TOKENLEAP_API_KEY": "k3y", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tokenleap.cli", "serve", "--port", str(port), "--spec-type", "ngram", "--draft-max",
            "4", "--log-level", "warning", "--metrics-api-key-required"
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from the environment
        assert httpx.get(url + "/metrics").status_code == 401  # --metrics-api-key-required
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k3y"}, timeout=60,
                       json={"prompt": "a b c d a b c d a b c d", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        assert r.json()["speculative"]["method"] == "ngram"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "server stopped" in err and "Traceback" not in err
