"""EngineConfig: dtype aliases and validation."""

from __future__ import annotations

import pytest

from tokenleap.config import EngineConfig
from tokenleap.errors import TokenleapError
from tokenleap.models.registry import DEFAULT_MODEL


def test_defaults() -> None:
    cfg = EngineConfig()
    assert (cfg.model, cfg.dtype, cfg.max_model_len, cfg.use_kernels) == (DEFAULT_MODEL, "bfloat16", None, True)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("bf16", "bfloat16"), ("auto", "bfloat16"), ("bfloat16", "bfloat16"), ("fp32", "float32"), ("float", "float32"), ("float32", "float32")],
)
def test_dtype_aliases(given: str, canonical: str) -> None:
    assert EngineConfig(dtype=given).dtype == canonical


@pytest.mark.parametrize("dtype", ["float16", "int8", "", "BF16"])
def test_bad_dtype(dtype: str) -> None:
    with pytest.raises(TokenleapError, match="dtype must be one of bfloat16, float32"):
        EngineConfig(dtype=dtype)


@pytest.mark.parametrize("n", [1, 0, -5])
def test_bad_max_model_len(n: int) -> None:
    with pytest.raises(TokenleapError, match="max_model_len must be >= 2"):
        EngineConfig(max_model_len=n)


def test_frozen() -> None:
    cfg = EngineConfig(max_model_len=2)
    with pytest.raises(AttributeError):
        cfg.dtype = "float32"  # type: ignore[misc]
