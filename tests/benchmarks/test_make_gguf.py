"""benchmarks/make_gguf.py: a random-weight F16 GGUF that tokenleap's loader and tokenizer read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenleap.models.loaders import load_gguf
from tokenleap.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def make_gguf(load_benchmark):  # type: ignore[no-untyped-def]
    return load_benchmark("make_gguf")


@pytest.fixture(scope="module")
def tiny(make_gguf, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-F16.gguf"
    return make_gguf.write_f16(make_gguf.SHAPES["tiny-llama"], path, seed=0, progress=False)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> tuple[Any, dict[str, Any]]:
    return load_gguf(tiny)  # its config comes from read_gguf_config (one parse of the file for both tests)


def test_config_read_back(loaded: tuple[Any, dict[str, Any]]) -> None:
    config = loaded[0]
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == ("llama", 256, 2, 4, 2)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (512, 49152 + 64, 64)
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_theta == 100000.0


def test_tokenizer_encodes_and_decodes(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path))
    tok = Tokenizer.from_gguf(tiny)
    assert tok.vocab_size == 49152 + 64
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"
    assert tok.encode("<|reserved_0|>") == [49152]  # the padding is control tokens, each one token


def test_weights_have_the_shapes(loaded: tuple[Any, dict[str, Any]]) -> None:
    weights = loaded[1]
    assert weights["embed"].shape == (49152 + 64, 256) and "lm_head" not in weights
    assert weights["layers.1.q"].shape == (256, 256) and weights["layers.1.k"].shape == (128, 256)
    assert weights["layers.0.down"].shape == (256, 512) and weights["layers.0.gate"].shape == (512, 256)
    assert float(weights["norm"].min()) == float(weights["norm"].max()) == 1.0
    assert 0.015 < float(weights["layers.0.up"].std()) < 0.025


def test_real_shapes_tensor_lists(make_gguf) -> None:  # type: ignore[no-untyped-def]
    names = {s.name: s for s in make_gguf.tensor_specs(make_gguf.SHAPES["llama-3.1-8b"])}
    assert names["output.weight"].shape == (128256, 4096) and names["rope_freqs.weight"].shape == (64,)
    assert names["blk.31.attn_k.weight"].shape == (1024, 4096) and names["blk.0.ffn_down.weight"].shape == (4096, 14336)
    qwen = {s.name for s in make_gguf.tensor_specs(make_gguf.SHAPES["qwen2.5-1.5b"])}
    assert "blk.27.attn_v.bias" in qwen and "output.weight" not in qwen and "rope_freqs.weight" not in qwen
    factors = make_gguf.llama3_rope_factors(make_gguf.SHAPES["llama-3.2-1b"])
    assert factors.shape == (32,) and factors[0] == 1.0 and factors[-1] == 32.0  # fast pairs kept, slow ones x32
