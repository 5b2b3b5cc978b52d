"""The tiny random Llama used across the tests (a module with a unique name, so tests import it
directly; `from conftest import ...` would pick whichever conftest loaded first)."""

from __future__ import annotations

import torch

from tokenleap.models.config import ModelConfig

# Sizes satisfy the kernels' constraints: every linear's input width (hidden, heads * head_dim,
# intermediate) is a multiple of 32 and head_dim is 16, 32, 64 or 128.
TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=128,
    tie_word_embeddings=False,
)


def make_tiny_weights(config: ModelConfig = TINY_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under tokenleap's canonical names, scaled so logits are spread."""
    g = torch.Generator().manual_seed(seed)
    d, f = config.hidden_size, config.intermediate_size

    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w: dict[str, torch.Tensor] = {"embed": rnd(config.vocab_size, d), "norm": 1.0 + rnd(d, std=0.1)}
    if not config.tie_word_embeddings:
        w["lm_head"] = rnd(config.vocab_size, d, std=d**-0.5)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = 1.0 + rnd(d, std=0.1)
        w[p + "mlp_norm"] = 1.0 + rnd(d, std=0.1)
        w[p + "q"] = rnd(config.q_size, d, std=d**-0.5)
        w[p + "k"] = rnd(config.kv_size, d, std=d**-0.5)
        w[p + "v"] = rnd(config.kv_size, d, std=d**-0.5)
        w[p + "o"] = rnd(d, config.q_size, std=config.q_size**-0.5)
        w[p + "gate"] = rnd(f, d, std=d**-0.5)
        w[p + "up"] = rnd(f, d, std=d**-0.5)
        w[p + "down"] = rnd(d, f, std=f**-0.5)
    return w
