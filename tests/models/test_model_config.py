"""ModelConfig: validation of architecture hyper-parameters and derived sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenleap.errors import TokenleapError
from tokenleap.models.config import ModelConfig


def test_derived_sizes(tiny_config: ModelConfig) -> None:
    assert tiny_config.q_size == 4 * 32
    assert tiny_config.kv_size == 2 * 32


@pytest.mark.parametrize("tied", [False, True])
def test_num_parameters_counts_every_weight(
    tiny_config: ModelConfig, tiny_weights: dict[str, torch.Tensor], tied: bool
) -> None:
    config = dataclasses.replace(tiny_config, tie_word_embeddings=tied)
    weights = {k: v for k, v in tiny_weights.items() if not (tied and k == "lm_head")}
    assert config.num_parameters() == sum(t.numel() for t in weights.values())


def test_bytes_per_token(tiny_config: ModelConfig, tiny_weights: dict[str, torch.Tensor]) -> None:
    # every weight except the embedding table (a decode step reads one row of it), LM head in full
    streamed = sum(t.numel() for k, t in tiny_weights.items() if k != "embed")
    assert tiny_config.bytes_per_token(2) == 2 * streamed


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architecture": "phi3"}, "'phi3' is not supported"), ({"activation": "relu"}, "activation 'relu'"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 31}, "head_dim must be even"),
    ],
)
def test_invalid_configs(tiny_config: ModelConfig, changes: dict[str, object], message: str) -> None:
    with pytest.raises(TokenleapError, match=message):
        dataclasses.replace(tiny_config, **changes)
