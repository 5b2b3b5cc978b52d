"""Frozen, validated configuration records (engine settings).

Every user-settable option lands in one of these dataclasses, validated in `__post_init__` with
a `TokenleapError` that names the option and the allowed values. The CLI and the library build
the same records, so both reject the same bad input with the same message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenleap.errors import TokenleapError
from tokenleap.models.registry import DEFAULT_MODEL

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
            raise TokenleapError(f"quantization must be 'gguf', 'none' or None (the file's own), got {self.quantization!r}")
        dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dtype not in DTYPE_NAMES:
            raise TokenleapError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        kv = KV_CACHE_ALIASES.get(str(self.kv_cache_dtype), str(self.kv_cache_dtype))
        if kv not in KV_CACHE_DTYPES:
            raise TokenleapError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        object.__setattr__(self, "kv_cache_dtype", kv)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise TokenleapError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise TokenleapError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")


def canonical_method(name: str) -> str:
    """A method's own name for any of its spellings (aliases, llama.cpp's underscores), from
    the method records; an unknown name unchanged."""
    from tokenleap.drafters import methods

    return methods.canonical(name)


SAMPLED_TREE_MODES = ("full", "first-path")  # how sampled requests verify a token tree (both lossless)
ACCEPTANCE_RULES = ("exact", "typical-lossy")  # sampled requests; "typical-lossy" changes the output distribution
MAX_DRAFT_TOKENS = 64  # llama.cpp's --draft-max 64; k + 1 verify rows go through `forward_batch`, row-invariant at any row count
DEFAULT_DRAFT_TOKENS = 16  # the default draft length cap


@dataclass(frozen=True, init=False)
class SpecConfig:
    """Speculative decoding settings, named as in vLLM's `speculative_config` dict.

    The fields are the engine-wide controls, which apply whatever the method: the draft length cap
    and floor, adaptive drafting, how sampled requests verify trees and accept tokens. Each
    method's own options (prompt lookup's n-gram sizes, suffix trees' limits, the draft model or
    head and its tree shape, ...) are a frozen dataclass declared with the method's record
    (`tokenleap.drafters.methods.MethodRecord.options`) and held in `method_options`, one instance
    per method the config uses, defaults filled in. They are given as `speculative_config`'s flat
    keys (`{"method": "ngram", "prompt_lookup_max": 3}`), as keyword arguments here
    (`SpecConfig("ngram", prompt_lookup_max=3)`) or as `method_options={method: {option: value}}`;
    a built-in option of a method the config does not use is validated and dropped. Reading
    `config.prompt_lookup_max` gives the option of the config's method (or the first chain member
    that has it), else the option's default; `options_for(method)` gives the options object.
    """

    method: str
    num_speculative_tokens: int = DEFAULT_DRAFT_TOKENS  # draft length cap (llama.cpp: --draft-max; adaptive drafting picks within it)
    draft_min: int = 0  # drafts shorter than this are not verified (llama.cpp: --draft-min)
    drafter: object | None = None  # a user object implementing the Drafter protocol ("custom")
    adaptive: bool = True  # choose each step's draft length from the cost curve and acceptance
    chain: tuple[str, ...] = ()  # method "chain": these methods in order, the first that proposes wins (draftless ones before a draft model)
    sampled_tree: str = "full"  # sampled requests verify a tree draft: "full" (every branch, lossless) or "first-path"
    acceptance: str = "exact"  # sampled requests: "exact" (lossless) or "typical-lossy" (Medusa's typical acceptance, NOT lossless)
    typical_threshold: float = 0.09  # typical-lossy: accept x when p(x) > min(threshold, alpha * exp(-H(p)))
    typical_alpha: float = 0.3
    # each used method's own options: ((method, options dataclass instance), ...) for the method
    # or a chain's members; given as {method: {option: value}}, defaults filled in
    method_options: tuple[tuple[str, Any], ...] = ()

    def __init__(self, method: str, num_speculative_tokens: int = DEFAULT_DRAFT_TOKENS, draft_min: int = 0, *, drafter: object | None = None,
                 adaptive: bool = True, chain: tuple[str, ...] | str = (), sampled_tree: str = "full", acceptance: str = "exact",
                 typical_threshold: float = 0.09, typical_alpha: float = 0.3, method_options: Any = (), **options: Any) -> None:
        """`**options`: methods' options by their flat names (`prompt_lookup_max=3`), laid over
        `method_options`."""
        values = {"method": method, "num_speculative_tokens": num_speculative_tokens, "draft_min": draft_min, "drafter": drafter,
                  "adaptive": adaptive, "chain": chain, "sampled_tree": sampled_tree, "acceptance": acceptance,
                  "typical_threshold": typical_threshold, "typical_alpha": typical_alpha, "method_options": method_options}
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate(options)

    def _validate(self, flat: dict[str, Any]) -> None:
        from tokenleap.drafters import methods

        method = str(self.method).strip().lower()
        if "," in method:  # llama.cpp's list of types ("ngram-mod,draft-mtp"): a chain as "ngram-mod+draft-mtp"
            method = "+".join(methods.split_chain(method))
        method = canonical_method(method)
        if "+" in method:  # "suffix+ngram": a chain, the first that proposes wins
            object.__setattr__(self, "chain", tuple(method.split("+")))
            method = "chain"
        object.__setattr__(self, "method", method)

        record = methods.find(method)
        if record is None:
            raise methods.unknown_method(self.method)
        if not 1 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise TokenleapError(f"num_speculative_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_speculative_tokens}")
        if not 0 <= self.draft_min <= self.num_speculative_tokens:
            raise TokenleapError(f"draft_min must be in [0, num_speculative_tokens], got {self.draft_min}")
        if isinstance(self.chain, str):
            object.__setattr__(self, "chain", tuple(m.strip() for m in self.chain.split(",") if m.strip()))
        object.__setattr__(self, "chain", tuple(canonical_method(m) for m in self.chain))
        if method == "chain":
            names = methods.method_names()
            bad = [m for m in self.chain if m not in names or m in ("chain", "custom")]
            if not self.chain or bad:
                raise TokenleapError(
                    f"method 'chain' needs 'chain': a list of methods from {', '.join(m for m in names if m not in ('chain', 'custom'))}"
                    + (f"; not allowed: {', '.join(bad)}" if bad else "")
                )
        involved = self.chain if method == "chain" else (method,)
        given: Any = self.method_options
        if flat:
            given = methods.merge_options(given, methods.flat_options("+".join(involved), flat))
        object.__setattr__(self, "method_options", methods.normalize_options(involved, given))
        if record.needs_model and not getattr(self.options_for(method), "model", None):  # eagle3 without a model: the head shipped for the target
            raise TokenleapError(f"method {method!r} needs {record.needs_model}: speculative_config['model'] (CLI: --model-draft)")
        if self.sampled_tree not in SAMPLED_TREE_MODES:
            raise TokenleapError(f"sampled_tree must be one of {', '.join(SAMPLED_TREE_MODES)}, got {self.sampled_tree!r}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise TokenleapError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {self.acceptance!r}")
        if not (0.0 <= self.typical_threshold <= 1.0 and 0.0 <= self.typical_alpha <= 1.0):
            raise TokenleapError(
                f"typical_threshold and typical_alpha must be in [0, 1], got {self.typical_threshold} and {self.typical_alpha}"
            )
        if method == "custom" and self.drafter is None:
            raise TokenleapError("method 'custom' needs a drafter object: speculative_config['drafter']")

    if not TYPE_CHECKING:  # the library's own code reads options objects (typed); users and old code may read the flat names

        def __getattr__(self, name: str) -> Any:
            """A method option by its flat name (`config.prompt_lookup_max`): the config's method's
            (or the first chain member's that has it), else the built-in option's default."""
            if name.startswith("_") or "method_options" not in self.__dict__:
                raise AttributeError(name)
            from tokenleap.drafters import methods

            for _, opts in self.__dict__["method_options"]:
                if any(f.name == name for f in dataclasses.fields(opts)):
                    return getattr(opts, name)
            for record in methods.all_methods():
                for f in record.option_fields:
                    if f.name == name:
                        return getattr(record.default_options(), name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def drafter_key(self) -> tuple[Hashable, ...]:
        """What identifies the drafter serving this config: its method, the fields the method
        reads and its options (`tokenleap.drafters.methods.drafter_key`). The engine keys its
        drafters by it, so configs that differ only in per-request controls share one."""
        from tokenleap.drafters.methods import drafter_key

        return drafter_key(self)

    def options_for(self, method: str | None = None) -> Any:
        """The options of `method` (default: this config's), an instance of its record's options
        dataclass; None for a method without options of its own."""
        name = self.method if method is None else canonical_method(method)
        return next((opts for m, opts in self.method_options if m == name), None)

    @classmethod
    def from_dict(cls, raw: dict[str, object] | None) -> SpecConfig | None:
        """Build from a vLLM-style dict; None, {} or {"method": "none"} mean no speculation."""
        if not raw:
            return None
        raw = dict(raw)
        if "method" not in raw and raw.get("model"):
            raw["method"] = infer_method(str(raw["model"]))  # as vLLM: a model without a method
        if str(raw.get("method", "")).lower() in ("none", "off", ""):
            if "method" not in raw:
                raise TokenleapError("speculative_config needs a 'method' (or a draft 'model')")
            return None
        known = set(cls.__dataclass_fields__)
        if set(raw) - known:  # methods' own options, as top-level keys (any built-in method's, as when SpecConfig held them all)
            from tokenleap.drafters import methods

            known |= set(methods.option_owners(str(raw.get("method", "")))) | methods.builtin_option_names()
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TokenleapError(f"unknown speculative_config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**raw)  # type: ignore[arg-type]  # the keys are checked above, the values by __post_init__
        except TypeError as exc:
            raise TokenleapError(f"bad speculative_config: {exc}") from exc


def infer_method(model: str) -> str:
    """vLLM's rule for a `speculative_config` with a `model` and no `method`: an EAGLE-3, EAGLE or
    Medusa head when its config.json's architectures (else its name) say so, else a draft model."""
    import json
    from pathlib import Path

    text = model.lower()
    cfg = Path(model).expanduser() / "config.json"
    if cfg.is_file():
        try:
            raw = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError):
            raw = {}
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        text = " ".join(str(a) for a in archs).lower() if isinstance(archs, list) and archs else text
        if isinstance(raw, dict) and raw.get("speculators_model_type") == "eagle3":
            return "eagle3"
    if "eagle3" in text or "eagle-3" in text:
        return "eagle3"
    if "eagle" in text:
        return "eagle"
    if "medusa" in text:
        return "medusa"
    return "draft-model"
