"""`SpecConfig`: a request's or an engine's speculative decoding settings, validated against the
method records (vLLM's `speculative_config` dict, as a frozen record).

It sits beside the records it checks a method and its options against (`registry.py`,
`options.py`), above the engine-wide constants of `tokenleap.config`; the engine, the library, the
CLI and the server import it from here (the public name is `tokenleap.SpecConfig`). An engine
keeps one drafter per `drafter_key`: the method, the config fields it reads (`method_fields()`,
each record's `fields`: `method_options` for a method with options, `chain`, `drafter`) and its
options, so configs that differ only in per-request controls (`CONTROL_FIELDS`) or in other
methods' options share a drafter and its state across requests; a user's drafter object is keyed
by identity.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenleap.config import ACCEPTANCE_RULES, DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SAMPLED_TREE_MODES
from tokenleap.drafters.methods import CHAIN_SEPARATOR, OPTIONS_FIELD
from tokenleap.drafters.options import (
    builtin_option_names,
    flat_options,
    merge_options,
    normalize_options,
    option_owners,
    unknown_keys_note,
)
from tokenleap.drafters.registry import all_methods, canonical, find, get, method_names, split_chain, unknown_method
from tokenleap.errors import TokenleapError

# Per-request controls the engine itself reads never make a new drafter. tests/drafters/test_keys.py
# checks that every SpecConfig field is claimed by a method's `fields` or here, and that the
# factories read nothing else: a new field must be listed under the methods that read it.
CONTROL_FIELDS = (
    "num_speculative_tokens", "draft_min", "adaptive", "sampled_tree", "acceptance", "typical_threshold",
    "typical_alpha"
)
_NOT_CHAINED = ("chain", "custom")  # methods a chain may not list


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
    # draft length cap (llama.cpp: --draft-max; adaptive drafting picks within it)
    num_speculative_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_min: int = 0  # drafts shorter than this are not verified (llama.cpp: --draft-min)
    drafter: object | None = None  # a user object implementing the Drafter protocol ("custom")
    adaptive: bool = True  # choose each step's draft length from the cost curve and acceptance
    # method "chain": these methods in order, the first that proposes wins (draftless ones before a draft model)
    chain: tuple[str, ...] = ()
    sampled_tree: str = "full"  # sampled requests verify a tree draft: "full" (every branch, lossless) or "first-path"
    # sampled requests: "exact" (lossless) or "typical-lossy" (Medusa's typical acceptance, NOT lossless)
    acceptance: str = "exact"
    typical_threshold: float = 0.09  # typical-lossy: accept x when p(x) > min(threshold, alpha * exp(-H(p)))
    typical_alpha: float = 0.3
    # each used method's own options: ((method, options dataclass instance), ...) for the method
    # or a chain's members; given as {method: {option: value}}, defaults filled in
    method_options: tuple[tuple[str, Any], ...] = ()

    def __init__(
        self,
        method: str,
        num_speculative_tokens: int = DEFAULT_DRAFT_TOKENS,
        draft_min: int = 0,
        *,
        drafter: object | None = None,
        adaptive: bool = True,
        chain: tuple[str, ...] | str = (),
        sampled_tree: str = "full",
        acceptance: str = "exact",
        typical_threshold: float = 0.09,
        typical_alpha: float = 0.3,
        method_options: Any = (),
        **options: Any,
    ) -> None:
        """`**options`: methods' options by their flat names (`prompt_lookup_max=3`), laid over
        `method_options`."""
        values = {
            "method": method, "num_speculative_tokens": num_speculative_tokens, "draft_min": draft_min,
            "drafter": drafter, "adaptive": adaptive, "chain": chain, "sampled_tree": sampled_tree,
            "acceptance": acceptance, "typical_threshold": typical_threshold, "typical_alpha": typical_alpha,
            "method_options": method_options
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate(options)

    def _validate(self, flat: dict[str, Any]) -> None:
        method = str(self.method).strip().lower()
        if "," in method:  # llama.cpp's list of types ("ngram-mod,draft-mtp"): a chain as "ngram-mod+draft-mtp"
            method = CHAIN_SEPARATOR.join(split_chain(method))
        method = canonical(method)
        if CHAIN_SEPARATOR in method:  # "suffix+ngram": a chain, the first that proposes wins
            object.__setattr__(self, "chain", tuple(method.split(CHAIN_SEPARATOR)))
            method = "chain"
        object.__setattr__(self, "method", method)

        record = find(method)
        if record is None:
            raise unknown_method(self.method)
        if not 1 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise TokenleapError(
                f"num_speculative_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_speculative_tokens}"
            )
        if not 0 <= self.draft_min <= self.num_speculative_tokens:
            raise TokenleapError(f"draft_min must be in [0, num_speculative_tokens], got {self.draft_min}")
        if isinstance(self.chain, str):
            object.__setattr__(self, "chain", tuple(m.strip() for m in self.chain.split(",") if m.strip()))
        object.__setattr__(self, "chain", tuple(canonical(m) for m in self.chain))
        if method == "chain":
            names = method_names()
            bad = [m for m in self.chain if m not in names or m in _NOT_CHAINED]
            if not self.chain or bad:
                raise TokenleapError(
                    f"method 'chain' needs 'chain': a list of methods from "
                    f"{', '.join(m for m in names if m not in _NOT_CHAINED)}"
                    + (f"; not allowed: {', '.join(bad)}" if bad else "")
                )
        involved = self.chain if method == "chain" else (method,)
        given: Any = self.method_options
        if flat:
            given = merge_options(given, flat_options(CHAIN_SEPARATOR.join(involved), flat))
        object.__setattr__(self, "method_options", normalize_options(involved, given))
        # eagle3 without a model: the head shipped for the target
        if record.needs_model and not getattr(self.options_for(method), "model", None):
            raise TokenleapError(
                f"method {method!r} needs {record.needs_model}: speculative_config['model'] (CLI: --model-draft)"
            )
        if self.sampled_tree not in SAMPLED_TREE_MODES:
            raise TokenleapError(
                f"sampled_tree must be one of {', '.join(SAMPLED_TREE_MODES)}, got {self.sampled_tree!r}"
            )
        if self.acceptance not in ACCEPTANCE_RULES:
            raise TokenleapError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {self.acceptance!r}")
        if not (0.0 <= self.typical_threshold <= 1.0 and 0.0 <= self.typical_alpha <= 1.0):
            raise TokenleapError(
                f"typical_threshold and typical_alpha must be in [0, 1], "
                f"got {self.typical_threshold} and {self.typical_alpha}"
            )
        if method == "custom" and self.drafter is None:
            raise TokenleapError("method 'custom' needs a drafter object: speculative_config['drafter']")

    if not TYPE_CHECKING:  # the library's own code reads options objects (typed); users may read the flat names

        def __getattr__(self, name: str) -> Any:
            """A method option by its flat name (`config.prompt_lookup_max`): the config's method's
            (or the first chain member's that has it), else the built-in option's default."""
            if name.startswith("_") or OPTIONS_FIELD not in self.__dict__:
                raise AttributeError(name)
            for _, opts in self.__dict__[OPTIONS_FIELD]:
                if any(f.name == name for f in dataclasses.fields(opts)):
                    return getattr(opts, name)
            for record in all_methods():
                if record.option_field(name) is not None:
                    return getattr(record.default_options(), name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{unknown_keys_note([name])}")

    def drafter_key(self) -> tuple[Hashable, ...]:
        """What identifies the drafter serving this config (`drafter_key`). The engine keys its
        drafters by it, so configs that differ only in per-request controls share one."""
        return drafter_key(self)

    def options_for(self, method: str | None = None) -> Any:
        """The options of `method` (default: this config's), an instance of its record's options
        dataclass; None for a method without options of its own."""
        name = self.method if method is None else canonical(method)
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
        # methods' own options, as top-level keys (any built-in method's, as when SpecConfig held them all)
        if set(raw) - known:
            known |= set(option_owners(str(raw.get("method", "")))) | builtin_option_names()
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TokenleapError(
                f"unknown speculative_config key(s): {', '.join(unknown)}{unknown_keys_note(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**raw)  # type: ignore[arg-type]  # the keys are checked above, the values by __post_init__
        except TypeError as exc:
            raise TokenleapError(f"bad speculative_config: {exc}") from exc


def drafter_key(config: SpecConfig) -> tuple[Hashable, ...]:
    """What identifies the drafter serving `config`: its method, the fields the method reads
    and its options. A user's drafter object ("custom") is keyed by identity; a chain by its
    members' keys."""
    if config.method == "custom":
        return ("custom", id(config.drafter))  # the engine keeps the object alive with its drafter
    if config.method == "chain":
        return ("chain", *(drafter_key(dataclasses.replace(config, method=m)) for m in config.chain))
    record = get(config.method)
    key: tuple[Hashable, ...] = (config.method, *(getattr(config, f) for f in record.fields if f != OPTIONS_FIELD))
    if record.options is not None:
        key = (*key, config.options_for(config.method))
    return key


def infer_method(model: str) -> str:
    """vLLM's rule for a `speculative_config` with a `model` and no `method`: an EAGLE-3, EAGLE or
    Medusa head when its config.json's architectures (else its name) say so, else a draft model."""
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


__all__ = ["CONTROL_FIELDS", "SpecConfig", "drafter_key", "infer_method"]
