"""Configuration records: SpecConfig.from_dict validation and EngineConfig dtype handling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenleap import SpecConfig
from tokenleap.config import DEFAULT_MODEL, MAX_DRAFT_TOKENS, EngineConfig
from tokenleap.errors import TokenleapError


class _Drafter:
    def begin(self, request: Any) -> None: ...
    def propose(self, request_id: str, tokens: Any, max_tokens: int) -> Any: ...
    def accept(self, request_id: str, tokens: Any, num_accepted: int) -> None: ...
    def end(self, request_id: str) -> None: ...


# --------------------------------------------------------------------------- SpecConfig


@pytest.mark.parametrize("raw", [None, {}, {"method": "none"}, {"method": "None"}, {"method": "off"}])
def test_no_speculation(raw: dict[str, Any] | None) -> None:
    assert SpecConfig.from_dict(raw) is None


def test_ngram_alone_gets_defaults() -> None:
    spec = SpecConfig.from_dict({"method": "ngram"})
    assert spec is not None
    assert spec.method == "ngram"
    assert spec.num_speculative_tokens == 16
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 4)
    assert spec.draft_min == 0
    assert spec.model is None and spec.drafter is None


def test_full_ngram_config() -> None:
    spec = SpecConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "draft_min": 2}
    )
    assert spec == SpecConfig("ngram", num_speculative_tokens=5, draft_min=2, prompt_lookup_min=2, prompt_lookup_max=3)


@pytest.mark.parametrize(
    ("alias", "method"), [("prompt_lookup", "ngram"), ("prompt-lookup", "ngram"), ("draft_model", "draft-model")]
)
def test_method_aliases(alias: str, method: str) -> None:
    spec = SpecConfig.from_dict({"method": alias, "model": "some-draft"})
    assert spec is not None and spec.method == method


def test_from_dict_does_not_mutate_its_input() -> None:
    raw = {"method": "ngram", "num_speculative_tokens": 3}
    SpecConfig.from_dict(raw)
    assert raw == {"method": "ngram", "num_speculative_tokens": 3}


def test_unknown_key_is_named() -> None:
    with pytest.raises(TokenleapError, match="num_spec_tokens") as err:
        SpecConfig.from_dict({"method": "ngram", "num_spec_tokens": 4})
    assert "num_speculative_tokens" in str(err.value)  # the known keys are listed


@pytest.mark.parametrize("k", [0, -1, MAX_DRAFT_TOKENS + 1, 99])
def test_num_speculative_tokens_out_of_range(k: int) -> None:
    with pytest.raises(TokenleapError, match="num_speculative_tokens"):
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})


@pytest.mark.parametrize("k", [1, MAX_DRAFT_TOKENS])
def test_num_speculative_tokens_bounds_are_inclusive(k: int) -> None:
    spec = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})
    assert spec is not None and spec.num_speculative_tokens == k


def test_llama_cpp_draft_max_64_fits_and_65_is_refused() -> None:
    """llama.cpp's ngram-mod example (`--draft-min 48 --draft-max 64`) is a valid config; one
    token more is refused with the bound in the message."""
    spec = SpecConfig.from_dict(
        {"method": "ngram-mod", "ngram_size_n": 24, "draft_min": 48, "num_speculative_tokens": 64}
    )
    assert spec is not None and (spec.num_speculative_tokens, spec.draft_min) == (64, 48)
    with pytest.raises(TokenleapError, match=r"num_speculative_tokens must be in \[1, 64\], got 65"):
        SpecConfig.from_dict({"method": "ngram-mod", "num_speculative_tokens": 65})


def test_prompt_lookup_min_above_max() -> None:
    with pytest.raises(TokenleapError, match="prompt_lookup_min"):
        SpecConfig.from_dict({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3})


def test_prompt_lookup_min_zero() -> None:
    with pytest.raises(TokenleapError, match="prompt_lookup_min"):
        SpecConfig.from_dict({"method": "ngram", "prompt_lookup_min": 0})


def test_draft_min_above_num_speculative_tokens() -> None:
    with pytest.raises(TokenleapError, match="draft_min"):
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "draft_min": 4})


def test_draft_model_needs_a_model() -> None:
    with pytest.raises(TokenleapError, match="draft model"):
        SpecConfig.from_dict({"method": "draft-model"})
    spec = SpecConfig.from_dict({"method": "draft-model", "model": "smollm2-135m"})
    assert spec is not None and spec.model == "smollm2-135m"


def test_custom_needs_a_drafter() -> None:
    with pytest.raises(TokenleapError, match="drafter"):
        SpecConfig.from_dict({"method": "custom"})
    drafter = _Drafter()
    spec = SpecConfig.from_dict({"method": "custom", "drafter": drafter})
    assert spec is not None and spec.drafter is drafter


def test_unknown_method() -> None:
    with pytest.raises(TokenleapError, match="lookahead") as err:
        SpecConfig.from_dict({"method": "lookahead"})
    assert "ngram" in str(err.value)  # the allowed methods are listed


def test_missing_method() -> None:
    with pytest.raises(TokenleapError, match="method"):
        SpecConfig.from_dict({"num_speculative_tokens": 4})


def test_wrong_value_type_is_a_tokenleap_error() -> None:
    with pytest.raises(TokenleapError):
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": "four"})


def test_spec_config_is_frozen() -> None:
    spec = SpecConfig("ngram")
    with pytest.raises(AttributeError):
        spec.num_speculative_tokens = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- EngineConfig


def test_engine_config_defaults() -> None:
    cfg = EngineConfig()
    assert (cfg.model, cfg.dtype, cfg.max_model_len, cfg.use_kernels) == (DEFAULT_MODEL, "bfloat16", None, True)


@pytest.mark.parametrize(
    ("alias", "dtype"),
    [
        ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("auto", "bfloat16"), ("fp32", "float32"), ("float", "float32"),
        ("float32", "float32")
    ],
)
def test_dtype_aliases(alias: str, dtype: str) -> None:
    assert EngineConfig(dtype=alias).dtype == dtype


@pytest.mark.parametrize("bad", ["float16", "fp16", "int8", "", "BF16"])
def test_bad_dtype(bad: str) -> None:
    with pytest.raises(TokenleapError, match="dtype must be one of bfloat16, float32"):
        EngineConfig(dtype=bad)


def test_kv_cache_dtype_names() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert [EngineConfig(kv_cache_dtype=n).kv_cache_dtype for n in ("f16", "bf16", "q8", "q8_0")] == [
        "bf16",
        "bf16",
        "q8_0",
        "q8_0",
    ]
    with pytest.raises(TokenleapError, match="kv_cache_dtype must be one of auto, bf16, q8_0, got 'q4_0'"):
        EngineConfig(kv_cache_dtype="q4_0")


@pytest.mark.parametrize("n", [1, 0, -5])
def test_bad_max_model_len(n: int) -> None:
    with pytest.raises(TokenleapError, match="max_model_len must be >= 2"):
        EngineConfig(max_model_len=n)


def test_smallest_max_model_len() -> None:
    assert EngineConfig(max_model_len=2).max_model_len == 2


def test_engine_config_is_frozen() -> None:
    cfg = EngineConfig(max_model_len=2)
    with pytest.raises(AttributeError):
        cfg.dtype = "float32"  # type: ignore[misc]


def test_engine_config_quantization() -> None:
    assert EngineConfig().quantization is None  # the file's own: decided at load (models.loading.resolve_quantization)
    assert EngineConfig(quantization="auto").quantization is None
    assert EngineConfig(quantization="gguf").quantization == "gguf"
    assert EngineConfig(quantization="none").quantization == "none"
    with pytest.raises(TokenleapError, match="quantization must be 'gguf', 'none' or None"):
        EngineConfig(quantization="awq")



def test_a_model_without_a_method_is_inferred_as_vllm_does(tmp_path: Path) -> None:
    import json

    from tokenleap import SpecConfig

    assert SpecConfig.from_dict({"model": "smollm2-135m-instruct"}).method == "draft-model"
    assert SpecConfig.from_dict({"model": "org/EAGLE3-LLaMA3.1-8B"}).method == "eagle3"
    assert SpecConfig.from_dict({"model": "yuhuili/EAGLE-Vicuna-7B"}).method == "eagle"
    assert SpecConfig.from_dict({"model": "FasterDecoding/medusa-vicuna-7b"}).method == "medusa"
    head = tmp_path / "my-head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert SpecConfig.from_dict({"model": str(head)}).method == "eagle3"
    with pytest.raises(TokenleapError, match="needs a 'method'"):
        SpecConfig.from_dict({"num_speculative_tokens": 4})
