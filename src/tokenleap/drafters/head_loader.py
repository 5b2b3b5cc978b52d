"""One loader for every draft-head layout a path can hold (the layouts are sniffed, not named):
a llama.cpp eagle3 GGUF file, an EAGLE-3 directory (the reference, vLLM-speculators or SpecForge
layout), or an EAGLE-1/2 directory (`fc` over 2H, no `hidden_norm`: `eagle1.Eagle1Head`). It
sits above the head formats it chooses between, so no format module imports another's loader.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from tokenleap.drafters.eagle1 import Eagle1Head, is_eagle1_layout
from tokenleap.drafters.eagle3 import _SPECULATORS_RENAMES, Eagle3Head, _config_from_json
from tokenleap.drafters.eagle3_gguf import load_eagle3_gguf
from tokenleap.errors import TokenleapError

logger = logging.getLogger(__name__)


def load_eagle3(path: str | Path, target: Any) -> Eagle3Head:
    """Load an EAGLE-3 head directory (config.json + *.safetensors) for `target`, with checks;
    an EAGLE-1/2 head (`fc` over 2H, no `hidden_norm`) loads as `eagle1.Eagle1Head`."""
    folder = Path(path).expanduser()
    if folder.is_file() and folder.suffix == ".gguf":  # llama.cpp's eagle3 GGUF
        return load_eagle3_gguf(folder, target)
    if not folder.is_dir():
        raise TokenleapError(f"EAGLE-3 head {str(path)!r} is not a directory (config.json + model.safetensors) or an eagle3 .gguf file")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise TokenleapError(f"EAGLE-3 head {folder} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise TokenleapError(f"EAGLE-3 head {cfg_file} is not valid JSON: {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TokenleapError(f"EAGLE-3 head {folder} has no *.safetensors weights")
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    if "transformer_layer_config" not in raw and is_eagle1_layout(weights, int(raw.get("hidden_size", 0) or 0)):
        head1 = Eagle1Head(raw, weights, target)
        logger.info("EAGLE-1/2 head %s: features = the target's final hidden states, full vocabulary (%d)", folder,
                    head1.config.vocab_size)
        return head1  # type: ignore[return-value]  # an Eagle1Head serves wherever an Eagle3Head does (duck-typed: no head protocol yet)
    config, dialect = _config_from_json(raw, target.config.num_layers)
    if dialect == "speculators" or any(k.startswith("layers.0.") for k in weights):
        renamed = {}
        for k, t in weights.items():
            for old, new in _SPECULATORS_RENAMES:
                if k.startswith(old):
                    k = new + k[len(old) :]
            renamed[k] = t
        weights = renamed
    head = Eagle3Head(config, weights, target)
    logger.info(
        "EAGLE-3 head %s (%s layout): aux layers %s (inputs of those target layers), draft vocabulary %d of %d",
        folder, dialect, list(config.aux_layers), config.draft_vocab_size, config.vocab_size,
    )
    return head
