"""Drafters: the protocol, the method records of the built-in methods, one module per family.

Every method is a `MethodRecord` (`methods.py`) defined beside its drafter and listed once in
`builtin.py`; users add theirs with `tokenleap.register_method` or the `tokenleap.methods` entry
point group (`registry.py`). `SpecConfig` (`spec.py`) is validated against them, and the drafter
registry (`default_registry`), the method names and aliases, the CLI's flags and help
(`cli_flags.py`), the server's per-request schema (`server_schema.py`) and the docs' table
(`docs_table.py`) are derived from them. Draft models are loaded once per registry
(`LoadedModels`), whatever the number of drafters that use them.
"""

from __future__ import annotations

from tokenleap.drafters.base import Draft, Drafter, DrafterRegistry, DraftRequest, check_drafter
from tokenleap.drafters.builtin import BUILTIN_METHODS
from tokenleap.drafters.draft_model import DraftModelDrafter, LoadedModels
from tokenleap.drafters.methods import MethodRecord
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.drafters.registry import default_registry, method_fields, register_method
from tokenleap.drafters.spec import CONTROL_FIELDS, SpecConfig, drafter_key

__all__ = [
    "BUILTIN_METHODS", "CONTROL_FIELDS", "method_fields", "DraftModelDrafter", "Draft", "Drafter", "DraftRequest",
    "DrafterRegistry", "LoadedModels", "MethodRecord", "NgramDrafter", "SpecConfig", "default_registry", "drafter_key",
    "check_drafter", "register_method"
]
