"""Frozen, validated configuration (engine settings) and the engine-wide constants.

Every user-settable engine option lands in `EngineConfig`, validated in `__post_init__` with a
`TokenleapError` that names the option and the allowed values. The CLI and the library build the
same records, so both reject the same bad input with the same message. This module is the ground
floor: it imports nothing of the package but `errors`, so every layer may read it. Speculative
decoding's record, `SpecConfig`, is validated against the method records and lives beside them
(`tokenleap.drafters.spec`; public as `tokenleap.SpecConfig`), reading its limits from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenleap.errors import TokenleapError

DEFAULT_MODEL = "smollm2-135m-instruct"  # a name of models/registry.py's REGISTRY
DTYPE_NAMES = ("bfloat16", "float32")
DEFAULT_MAX_NUM_SEQS = 16  # requests running (holding a KV cache) at once: LLM and server alike (vLLM's name)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "auto": "bfloat16"}


KV_CACHE_DTYPES = ("auto", "bf16", "q8_0")
KV_CACHE_ALIASES = {"f16": "bf16", "bfloat16": "bf16", "q8": "q8_0"}  # llama.cpp's default f16: our 16-bit cache


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # default: the model's own context length
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # LLM.generate: requests running (holding a KV cache) at once
    use_kernels: bool = True  # tokenleap's row-invariant CPU kernels (else torch ops)
    # "gguf": keep a GGUF file's blocks quantized in the formats the kernels read (`kernels.FORMATS`;
    # vLLM's spelling); "none": dequantize to `dtype`; None (default, as vLLM: the checkpoint's own
    # quantization): "gguf" for a GGUF file in bfloat16 on the kernels, else dequantize
    # (`models.loading.resolve_quantization`)
    quantization: str | None = None
    # the KV cache: "auto" (bf16 on the kernels' blocked attention, else fp32), "bf16" or
    # "q8_0" (ggml's q8_0, 0.53x the bytes; llama.cpp's --cache-type-k/-v q8_0); vLLM's name
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.quantization in ("auto", ""):
            object.__setattr__(self, "quantization", None)
        if self.quantization not in (None, "gguf", "none"):
            raise TokenleapError(
                f"quantization must be 'gguf', 'none' or None (the file's own), got {self.quantization!r}"
            )
        dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dtype not in DTYPE_NAMES:
            raise TokenleapError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        kv = KV_CACHE_ALIASES.get(str(self.kv_cache_dtype), str(self.kv_cache_dtype))
        if kv not in KV_CACHE_DTYPES:
            raise TokenleapError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        object.__setattr__(self, "kv_cache_dtype", kv)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise TokenleapError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise TokenleapError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")


SAMPLED_TREE_MODES = ("full", "first-path")  # how sampled requests verify a token tree (both lossless)
ACCEPTANCE_RULES = ("exact", "typical-lossy")  # sampled requests; "typical-lossy" changes the output distribution
# llama.cpp's --draft-max 64; k + 1 verify rows go through `forward_batch`, row-invariant at any row count
MAX_DRAFT_TOKENS = 64
DEFAULT_DRAFT_TOKENS = 16  # the default draft length cap
