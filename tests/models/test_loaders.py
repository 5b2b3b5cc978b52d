"""Weight loaders: GGUF metadata and tensors, Hugging Face folders (round trip through transformers), and their
errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenleap.errors import ModelNotFoundError, TokenleapError
from tokenleap.kernels import load_kernels
from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import load_gguf, load_hf_folder, read_hf_config, unpermute_rope

# --------------------------------------------------------------------------- GGUF


@pytest.mark.slow
def test_gguf_config_of_smollm2(weights: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    config, _ = weights
    assert config.architecture == "llama"
    assert config.num_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_heads == 9
    assert config.num_kv_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.rope_theta == pytest.approx(100000.0)
    assert config.max_position == 8192
    assert 130e6 < config.num_parameters() < 140e6  # "135M"


@pytest.mark.slow
def test_gguf_weights_canonical_names_and_shapes(weights: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    config, w = weights
    assert "lm_head" not in w  # tied
    assert w["embed"].shape == (49152, 576)
    assert w["norm"].shape == (576,)
    expected = {
        "attn_norm": (576,),
        "mlp_norm": (576,),
        "q": (576, 576),
        "k": (192, 576),
        "v": (192, 576),
        "o": (576, 576),
        "gate": (1536, 576),
        "up": (1536, 576),
        "down": (576, 1536),
    }
    for i in (0, 29):
        for name, shape in expected.items():
            t = w[f"layers.{i}.{name}"]
            assert t.shape == shape, name
            assert t.dtype == torch.float32
            assert torch.isfinite(t).all()
    assert len(w) == 2 + 30 * len(expected)


def testunpermute_rope_inverts_llama_cpp_permute() -> None:
    """llama.cpp's converter permutes Q/K rows as below; the loader must undo it exactly."""

    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for n_heads, head_dim in ((9, 64), (3, 64), (4, 32)):
        w = rng.standard_normal((n_heads * head_dim, 48)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rope(permuted, n_heads), w)
        b = rng.standard_normal(n_heads * head_dim).astype(np.float32)  # 1-D (a bias)
        np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(b, n_heads), n_heads), b)


def test_gguf_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", [b"", b"this is not a gguf file at all\n" * 10], ids=["empty", "text"])
def test_gguf_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(content)
    with pytest.raises(TokenleapError, match="not a readable GGUF file"):
        load_gguf(path)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenleapError, match="phi3.*not supported"):
        load_gguf(path)


def test_gguf_missing_metadata_is_named(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenleapError, match="gemma3.attention.head_count"):
        load_gguf(path)


# --------------------------------------------------------------------------- Hugging Face folders


def _save_tiny_hf(folder: Path, arch: str, tied: bool) -> torch.nn.Module:
    """A tiny random transformers model saved as config.json + model.safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=32, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    # transformers initialises with std 0.02 (near-uniform logits); spread the weights out.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(folder), safe_serialization=True)
    assert list(folder.glob("*.safetensors"))
    return model


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", False)], ids=["llama", "llama-tied", "qwen2-bias"]
)
def test_hf_folder_round_trip_matches_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    ref_model = _save_tiny_hf(tmp_path, arch, tied)
    config, w = load_hf_folder(tmp_path)
    assert config.architecture == arch
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (2, 64, 4, 2)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (32 if arch == "llama" else 16, 128, 256)
    assert config.rope_theta == pytest.approx(50000.0)
    assert config.tie_word_embeddings is tied
    assert ("lm_head" in w) is (not tied)
    assert ("layers.0.q_bias" in w) is (arch == "qwen2")

    kernels = load_kernels() if config.head_dim % 16 == 0 else None  # the kernels need head_dim % 16 == 0
    model = LlamaModel(config, w, torch.float32, kernels)
    g = torch.Generator().manual_seed(1)
    for n in (40, 7):  # batch path (prefill) and row path
        ids = torch.randint(0, 256, (n,), generator=g)
        kv = model.new_kv_cache()
        logits = model.compute_logits(model.forward(ids, torch.arange(n), kv).hidden)
        with torch.inference_mode():
            ref = ref_model(ids.unsqueeze(0)).logits[0]
        assert ref.abs().max() > 1.0  # logits are not all ~0
        diff = (logits - ref).abs().max().item()
        assert diff < 1e-4, f"{arch} n={n}: max abs diff {diff}"


def test_hf_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_hf_folder(tmp_path)


def test_hf_folder_without_safetensors(tmp_path: Path) -> None:
    _save_tiny_hf(tmp_path, "llama", False)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        load_hf_folder(tmp_path)


def _write_config(folder: Path, **overrides: object) -> None:
    raw = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    raw.update(overrides)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))


def test_hf_config_defaults(tmp_path: Path) -> None:
    _write_config(tmp_path, num_key_value_heads=None)
    config = read_hf_config(tmp_path)
    assert config.num_kv_heads == 4  # absent -> multi-head attention
    assert config.head_dim == 16  # hidden / heads
    assert config.rope_theta == 10000.0
    assert config.tie_word_embeddings is False


def test_hf_config_unsupported_architecture(tmp_path: Path) -> None:
    _write_config(tmp_path, model_type="gemma3")
    with pytest.raises(TokenleapError, match="'gemma3' is not supported"):
        read_hf_config(tmp_path)


def test_hf_config_rope_scaling_rejected(tmp_path: Path) -> None:
    _write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 8.0})
    with pytest.raises(TokenleapError, match="rope scaling 'yarn' is not supported"):
        read_hf_config(tmp_path)
    _write_config(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})  # incomplete
    with pytest.raises(TokenleapError, match="low_freq_factor"):
        read_hf_config(tmp_path)


def test_hf_config_missing_field_is_a_tokenleap_error(tmp_path: Path) -> None:
    """A config.json without a required field (not a Llama-family model folder) is a user error:
    it must raise TokenleapError naming the file, not a bare KeyError."""
    _write_config(tmp_path, hidden_size=None)
    with pytest.raises(TokenleapError, match="config.json"):
        read_hf_config(tmp_path)
