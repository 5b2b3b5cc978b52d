"""Per-request speculation on a server: the cost curve is measured once, when the server starts
(even without speculation by default), for the largest draft cap a request may ask for; a request
above that cap is a 400, and serving never measures again (tiny model: fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenleap import LLM
from tokenleap.errors import TokenleapError
from tokenleap.server import BackgroundServer, ServerConfig
from tokenleap.server.app import create_app


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    import tokenleap.engine.engine as engine_module
    import tokenleap.engine.speculation as speculation

    caps: list[int] = []
    real = engine_module.cached_cost_curve

    def spy(model: Any, cap: int, *args: Any, **kwargs: Any) -> Any:
        caps.append(cap)
        return real(model, cap, *args, **kwargs)

    monkeypatch.setattr(speculation, "cache_dir", lambda: tmp_path)  # no curve from an earlier run on disk
    monkeypatch.setattr(engine_module, "cached_cost_curve", spy)
    return caps


def _complete(url: str, **speculative: Any) -> httpx.Response:
    body = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if speculative:
        body["speculative"] = speculative
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_curve_measured_at_start_without_speculation(tiny_hf_folder: Path, measured: list[int]) -> None:
    llm = LLM(str(tiny_hf_folder), dtype="float32")  # no speculation by default
    with BackgroundServer(llm, ServerConfig(port=0, log_level="warning")) as srv:
        assert measured == [16]  # before any request: the largest cap a request may ask for
        assert _complete(srv.url).status_code == 200
        for spec in ({"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 16},
                     {"method": "suffix", "num_speculative_tokens": 3, "draft_min": 2}):
            r = _complete(srv.url, **spec)
            assert r.status_code == 200, r.text
        r = _complete(srv.url, method="ngram", num_speculative_tokens=17)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "num_speculative_tokens must be <= 16" in err["message"] and err["param"] == "speculative"
        assert measured == [16]  # never measured while serving


def test_a_larger_cap_is_measured_at_start(tiny_hf_folder: Path, measured: list[int]) -> None:
    llm = LLM(str(tiny_hf_folder), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    with BackgroundServer(llm, ServerConfig(port=0, log_level="warning", max_num_speculative_tokens=24)) as srv:
        assert measured == [24]
        assert _complete(srv.url, method="ngram", num_speculative_tokens=24).status_code == 200
        assert _complete(srv.url, method="suffix").status_code == 200  # the server's cap (4), not 16
        assert _complete(srv.url, method="ngram", num_speculative_tokens=25).status_code == 400
    assert measured == [24]
    with BackgroundServer(llm, ServerConfig(port=0, log_level="warning")) as srv:  # the server's cap: 4
        assert _complete(srv.url, method="ngram", num_speculative_tokens=5).status_code == 400
        assert _complete(srv.url, method="ngram", num_speculative_tokens=4).status_code == 200
    assert measured == [24]  # the curve measured before covers it


def test_cap_below_the_servers_own_is_refused(tiny_hf_folder: Path) -> None:
    with pytest.raises(TokenleapError, match="max_num_speculative_tokens must be in"):
        ServerConfig(max_num_speculative_tokens=65)
    llm = LLM(
        str(tiny_hf_folder),
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 8, "adaptive": False},
    )
    with pytest.raises(TokenleapError, match="below the server's own draft cap"):
        create_app(llm, ServerConfig(max_num_speculative_tokens=4))


def test_per_request_tree_and_acceptance_keys(tiny_hf_folder: Path) -> None:
    """A sampled request may pick ngram-tree, how its trees are verified and the opt-in lossy
    rule; a bad value is a 400 naming the key."""
    llm = LLM(str(tiny_hf_folder), dtype="float32")
    with BackgroundServer(llm, ServerConfig(port=0, log_level="warning")) as srv:
        for spec in ({"method": "ngram-tree", "sampled_tree": "first-path"}, {"method": "ngram-tree"},
                     {"method": "ngram-tree", "acceptance": "typical-lossy", "typical_threshold": 0.2}):
            body = {
                "prompt": [5, 6, 7, 5, 6, 7, 5, 6, 7], "max_tokens": 6, "temperature": 0.8, "seed": 1,
                "ignore_eos": True, "speculative": spec
            }
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        r = _complete(srv.url, method="ngram-tree", acceptance="typical")
        assert r.status_code == 400 and "acceptance must be one of" in r.json()["error"]["message"]
