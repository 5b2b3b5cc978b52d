"""Frozen, validated configuration records (engine settings).

Every user-settable option lands in one of these dataclasses, validated in `__post_init__` with
a `TokenleapError` that names the option and the allowed values. The CLI and the library build
the same records, so both reject the same bad input with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenleap.errors import TokenleapError
from tokenleap.models.registry import DEFAULT_MODEL

DTYPE_NAMES = ("bfloat16", "float32")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "auto": "bfloat16"}


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # default: the model's own context length
    use_kernels: bool = True  # tokenleap's row-invariant CPU kernels (else torch ops)

    def __post_init__(self) -> None:
        dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dtype not in DTYPE_NAMES:
            raise TokenleapError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise TokenleapError(f"max_model_len must be >= 2, got {self.max_model_len}")
