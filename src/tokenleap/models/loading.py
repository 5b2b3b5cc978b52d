"""Load a resolved model source into a runnable model and its tokenizer."""

from __future__ import annotations

import logging

import torch

from tokenleap.kernels import load_kernels
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import load_gguf, load_hf_folder
from tokenleap.models.registry import ModelSource
from tokenleap.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def load_model(source: ModelSource, dtype: torch.dtype, *, use_kernels: bool = True) -> tuple[LlamaModel, Tokenizer]:
    if source.kind == "gguf":
        config, weights = load_gguf(source.path)
        tokenizer = Tokenizer.from_gguf(source.path)
    else:
        config, weights = load_hf_folder(source.path)
        tokenizer = Tokenizer.from_folder(source.path)
    kernels = load_kernels() if use_kernels else None
    model = LlamaModel(config, weights, dtype, kernels)
    logger.info("loaded %s: %d layers, %.0fM parameters, %s", source.name, config.num_layers, config.num_parameters() / 1e6, dtype)
    return model, tokenizer
