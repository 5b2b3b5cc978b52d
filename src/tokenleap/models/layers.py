"""Building blocks of the Llama family shared by the runtime (`models.llama`) and the torch target
of training (`train.torch_target`): the rotary tables."""

from __future__ import annotations

import math

import torch

from tokenleap.models.config import ModelConfig, RopeScaling


def rope_tables(config: ModelConfig, theta: float, positions: int, *, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[positions, head_dim]` (half-split layout) as transformers computes them:
    float32 `inv_freq = 1 / theta ** (2i / d)`, scaled per Llama 3.x (`rope_scaling`), divided
    by GGUF's `rope_freqs` and by a linear scaling factor when `scaled`, angles = float32
    position * inv_freq."""
    hd = config.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if scaled and config.rope_scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling)
    if scaled and config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if scaled and config.rope_linear_factor != 1.0:
        inv_freq = inv_freq / config.rope_linear_factor
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.x rope scaling (transformers' `_compute_llama3_parameters`): long wavelengths
    divided by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
