"""`tokenleap serve --stats` (ServerConfig.log_requests): each finished request's log carries
llama.cpp's statistics lines, the method's and one per chain member (tiny model: fast)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from tokenleap import LLM
from tokenleap.server import BackgroundServer, ServerConfig


def test_finished_requests_log_llama_cpp_statistics_per_member(
    tiny_hf_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenleap.server")
    llm = LLM(
        str(tiny_hf_folder),
        dtype="float32",
        speculative_config={"method": "ngram-simple+ngram", "num_speculative_tokens": 4},
    )
    with BackgroundServer(llm, ServerConfig(port=0, log_level="warning", log_requests=True)) as srv:
        body = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    for name in ("ngram_simple\\+ngram", "ngram_simple", "ngram"):
        assert re.search(rf": statistics {name}: #calls\(b,g,a\) = 1 \d+ \d+, #gen drafts = \d+", text), (name, text)
