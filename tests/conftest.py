"""Shared fixtures: the real SmolLM2 model (loaded once per session), its tokenizer, transformers' reference,
and a tiny random Llama."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

# Before torch is imported: torch's OpenMP threads otherwise busy-wait between ops, and on a
# machine whose two cores are shared with other processes that makes every forward ~10x slower
# (measured: 1.2 s vs 0.17 s per fp32 token under load). Timing is never asserted; this only
# keeps the suite fast. An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import json
import warnings
from pathlib import Path

import pytest
import torch

from tokenleap import LLM
from tokenleap.bench import default_spec_bench
from tokenleap.config import DEFAULT_MODEL
from tokenleap.kernels import CpuKernels, load_kernels
from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel
from tokenleap.models.registry import resolve
from tokenleap.tokenizer import Tokenizer

SPEC_BENCH = default_spec_bench()  # ../shared/bench beside the checkout, else the shipped subset

# A few real English questions, used when the Spec-Bench file is not present on the machine.
_FALLBACK_QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Explain in simple terms how a rainbow forms.",
    "Write a short poem about the sea at night.",
    "Give three tips for staying focused while studying.",
    "How do vaccines help the immune system fight disease?",
    "Describe the water cycle for a ten-year-old.",
]


def _load_questions() -> list[str]:
    if not SPEC_BENCH.is_file():
        return list(_FALLBACK_QUESTIONS)
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    # One question from several different categories, short enough to keep the tests fast.
    picked: dict[str, str] = {}
    for row in rows:
        q = row["turns"][0]
        if row.get("category") not in picked and len(q) < 260:
            picked[row.get("category", str(len(picked)))] = q
    return list(picked.values())


@pytest.fixture(scope="session")
def questions() -> list[str]:
    """Real English prompts (Spec-Bench first turns, one per category)."""
    qs = _load_questions()
    assert len(qs) >= 5
    return qs


# --------------------------------------------------------------------------- real model


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = resolve(DEFAULT_MODEL).path
    assert path.is_file()
    return path


@pytest.fixture(scope="session")
def weights(model_path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from tokenleap.models.loaders import load_gguf

    return load_gguf(model_path)


@pytest.fixture(scope="session")
def kernels() -> CpuKernels:
    """The compiled row-invariant kernels; tests that need them skip on machines without."""
    k = load_kernels()
    if k is None:
        pytest.skip("tokenleap kernels unavailable (no C compiler or no AVX-512)")
    return k


@pytest.fixture(scope="session")
def kernel_attention(kernels: CpuKernels) -> Callable[..., torch.Tensor]:
    """`run_kernel_attention` bound to the kernels."""
    return functools.partial(run_kernel_attention, kernels)


def run_kernel_attention(
    kernels: CpuKernels,
    q: torch.Tensor,  # [rows, heads, hd]
    keys: torch.Tensor,  # [kv_heads, S, hd]: the whole cache, new rows' keys included
    values: torch.Tensor,
    write_slot: torch.Tensor,  # [rows]: each row's own slot (its k/v are keys/values there)
    slot_end: torch.Tensor | None = None,
    slot_off: torch.Tensor | None = None,
    slot_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`CpuKernels.attention` with identity rotary tables, so it computes plain attention of q
    over the given keys/values (each row re-writes its own slot with the same k/v)."""
    from tokenleap.kernels import RowPlan
    from tokenleap.kv.cache import KVCache

    rows, heads, hd = q.shape
    kv_heads, slots, _ = keys.shape
    kv = KVCache(1, kv_heads, hd, dtype=torch.float32, max_capacity=slots, initial_capacity=slots)
    kv.reserve(slots)
    kv.write(0, 0, keys, values)
    k_new = keys[:, write_slot].transpose(0, 1).reshape(rows, -1)
    v_new = values[:, write_slot].transpose(0, 1).reshape(rows, -1)
    qkv = torch.cat([q.reshape(rows, -1), k_new, v_new], dim=1)
    if slot_idx is not None:
        max_slots = int((slot_off[1:] - slot_off[:-1]).max())
    else:
        max_slots = int(slot_end.max())
    plan = RowPlan(
        positions=write_slot.to(torch.int64),
        kv_base=torch.full((rows,), kv.storage().data_ptr(), dtype=torch.int64),
        capacity=torch.full((rows,), kv.capacity, dtype=torch.int64),
        write_slot=write_slot.to(torch.int64),
        slot_end=slot_end,
        slot_off=slot_off,
        slot_idx=slot_idx,
        max_slots=-(-max_slots // 16) * 16,
    )
    cos, sin = torch.ones(slots, hd), torch.zeros(slots, hd)
    return kernels.attention(qkv, plan, 0, heads, kv_heads, hd, cos, sin)


@pytest.fixture(scope="session")
def model_fp32(weights: tuple[ModelConfig, dict[str, torch.Tensor]]) -> LlamaModel:
    config, w = weights
    return LlamaModel(config, w, torch.float32, load_kernels())


@pytest.fixture(scope="session")
def model_bf16(weights: tuple[ModelConfig, dict[str, torch.Tensor]]) -> LlamaModel:
    config, w = weights
    return LlamaModel(config, w, torch.bfloat16, load_kernels())


@pytest.fixture(scope="session")
def hf_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """transformers' own Llama on the same GGUF, in float32: the reference implementation."""
    pytest.importorskip("accelerate")
    from hf_reference import hf_causal_lm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_causal_lm(model_path, tmp_path_factory.mktemp("hf_reference"))


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The library as a user gets it: default model, bfloat16, kernels."""
    return LLM()


# --------------------------------------------------------------------------- tiny random model

from tiny_models import TINY_CONFIG, make_tiny_weights  # noqa: E402  (tests/tiny_models.py, importable by name)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return TINY_CONFIG


@pytest.fixture(scope="session")
def tiny_weights() -> dict[str, torch.Tensor]:
    return make_tiny_weights()


@pytest.fixture(scope="session")
def tiny_model(tiny_weights: dict[str, torch.Tensor]) -> LlamaModel:
    """2 layers, hidden 64, 4 heads / 2 KV heads of 32, vocab 256, fp32, with kernels when available."""
    return LlamaModel(TINY_CONFIG, tiny_weights, torch.float32, load_kernels())


@pytest.fixture(scope="session")
def tiny_model_bf16(tiny_weights: dict[str, torch.Tensor]) -> LlamaModel:
    return LlamaModel(TINY_CONFIG, tiny_weights, torch.bfloat16, load_kernels())


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., LlamaModel]:
    """Build a tiny model with chosen dtype / kernels / weights seed."""

    def build(dtype: torch.dtype = torch.float32, use_kernels: bool = True, seed: int = 0) -> LlamaModel:
        return LlamaModel(
            TINY_CONFIG, make_tiny_weights(TINY_CONFIG, seed), dtype, load_kernels() if use_kernels else None
        )

    return build


_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@pytest.fixture(scope="session")
def tiny_hf_folder(
    tmp_path_factory: pytest.TempPathFactory, tiny_weights: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> Path:
    """The tiny model written as a Hugging Face folder (config.json + safetensors) with the real
    SmolLM2 tokenizer beside it: a complete model `tokenleap.LLM` loads in well under a second."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tiny-llama")
    c = TINY_CONFIG
    tensors = {
        "model.embed_tokens.weight": tiny_weights["embed"],
        "model.norm.weight": tiny_weights["norm"],
        "lm_head.weight": tiny_weights["lm_head"],
    }
    for key, t in tiny_weights.items():
        if key.startswith("layers."):
            _, idx, short = key.split(".")
            tensors[f"model.layers.{idx}.{_HF_LAYER_NAMES[short]}.weight"] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.hf.save_pretrained(str(folder))
    return folder
