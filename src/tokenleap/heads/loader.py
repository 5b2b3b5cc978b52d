"""One loader for every EAGLE head layout a path can hold (the layouts are sniffed, not named):
a llama.cpp eagle3 GGUF file (`eagle3_gguf.py`), an EAGLE-3 directory (the reference,
vLLM-speculators or SpecForge layout: `eagle3.py`), or an EAGLE-1/2 directory (`fc` over 2H, no
`hidden_norm`: `eagle1.py`). It sits above the head formats it chooses between, so no format
module imports another's loader. MTP layers (`mtp.load_mtp`, read from the target's own folder)
and Medusa heads (`medusa.load_medusa`) are named by their method and load by their own module.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import DraftHead
from tokenleap.heads.eagle1 import Eagle1Head, is_eagle1_layout
from tokenleap.heads.eagle3 import eagle3_head
from tokenleap.heads.eagle3_gguf import load_eagle3_gguf
from tokenleap.models.base import CausalLM

logger = logging.getLogger(__name__)


def load_eagle3(path: str | Path, target: CausalLM) -> DraftHead:
    """Load an EAGLE head for `target`, with checks: an eagle3 `.gguf` file, or a directory
    (config.json + *.safetensors) holding an EAGLE-3 head or an EAGLE-1/2 one (`fc` over 2H, no
    `hidden_norm`)."""
    folder = Path(path).expanduser()
    if folder.is_file() and folder.suffix == ".gguf":  # llama.cpp's eagle3 GGUF
        return load_eagle3_gguf(folder, target)
    if not folder.is_dir():
        raise TokenleapError(
            f"EAGLE-3 head {str(path)!r} is not a directory (config.json + model.safetensors) or an eagle3 .gguf file"
        )
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
        return head1
    return eagle3_head(raw, weights, target, folder)
