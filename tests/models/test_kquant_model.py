"""A Llama model in the layout of a Q4_K_M file (Q4_K linears, Q6_K for a layer's V and down and
for the tied token table), as llama.cpp's `llama-quantize` writes it: the weights stay in the
file's bytes, the Q4_K QK + Q6_K V layer is one two-format stack, the token table is never
decoded whole, and the exactness contract holds (a 6-row forward equals 6 one-row forwards bit for
bit; the one-call fused layers equal the per-call loop)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenleap.kernels import QuantWeight, load_kernels
from tokenleap.models.gguf_file import GgufFile
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import load_gguf

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K


def _blocks(qtype: gguf.GGMLQuantizationType, out_dim: int, in_dim: int, rng: np.random.Generator) -> np.ndarray:
    """Random superblocks with small f16 scales (every sub-scale and quant bit random)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(out_dim, in_dim // block, nbytes), dtype=np.uint8)
    scale = lambda hi: (rng.random((out_dim, in_dim // block, 1)) * hi).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q4_K:
        raw[..., 0:2], raw[..., 2:4] = scale(0.004), scale(0.004)
    else:
        raw[..., 208:210] = scale(0.001)
    return raw.reshape(out_dim, -1)


def write_q4_k_m(path: Path, seed: int = 0) -> Path:
    """A tiny Llama GGUF with Q4_K_M's type mix: layer 0 has the "more bits" Q6_K V and down."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    hd = HIDDEN // HEADS

    def quant(name: str, qtype: gguf.GGMLQuantizationType, out_dim: int, in_dim: int) -> None:
        w.add_tensor(name, _blocks(qtype, out_dim, in_dim, rng), raw_dtype=qtype)

    quant("token_embd.weight", Q6_K, VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        more = Q6_K if i == 0 else Q4_K
        quant(f"blk.{i}.attn_q.weight", Q4_K, HEADS * hd, HIDDEN)
        quant(f"blk.{i}.attn_k.weight", Q4_K, KV_HEADS * hd, HIDDEN)
        quant(f"blk.{i}.attn_v.weight", more, KV_HEADS * hd, HIDDEN)
        quant(f"blk.{i}.attn_output.weight", Q4_K, HIDDEN, HEADS * hd)
        quant(f"blk.{i}.ffn_gate.weight", Q4_K, INTER, HIDDEN)
        quant(f"blk.{i}.ffn_up.weight", Q4_K, INTER, HIDDEN)
        quant(f"blk.{i}.ffn_down.weight", more, HIDDEN, INTER)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_q4_k_m(tmp_path_factory.mktemp("kquant") / "tiny-Q4_K_M.gguf")


def test_the_gguf_file_reads_as_gguf_py_does(q4_k_m: Path) -> None:
    ours, theirs = GgufFile(q4_k_m), gguf.GGUFReader(str(q4_k_m))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist(), a.name
        assert np.array_equal(
            np.asarray(a.data).reshape(-1).view(np.uint8), np.asarray(b.data).reshape(-1).view(np.uint8)
        ), a.name


def test_q4_k_m_model_keeps_the_files_bytes_and_the_exactness_contract(q4_k_m: Path) -> None:
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no tokenleap kernels on this machine")
    config, weights = load_gguf(q4_k_m, keep_quantized=True)
    model = LlamaModel(config, weights, torch.bfloat16, kernels)
    assert model.fused is not None and model.quantization == "gguf"
    qkv0, qkv1 = model.layers[0].wqkv.weight, model.layers[1].wqkv.weight
    assert isinstance(qkv0, QuantWeight) and isinstance(qkv1, QuantWeight)
    assert (qkv0.name, qkv0.split, qkv1.name, qkv1.split) == ("Q4_K+Q6_K", 256 + 128, "Q4_K", 0)
    reader = GgufFile(q4_k_m)
    linear_bytes = sum(t.data.nbytes for t in reader.tensors if t.tensor_type in (Q4_K, Q6_K))
    assert model.weight_bytes_per_token() == linear_bytes  # the linears and the tied head, in the file's bytes
    assert "embed" not in vars(model)  # the token table was never decoded whole

    ids = torch.tensor([1, 5, 9, 300, 7, 42])
    kv = model.new_kv_cache(16)
    together = model.compute_logits(model.forward(ids, torch.arange(6), kv).hidden)
    assert torch.isfinite(together).all()
    kv = model.new_kv_cache(16)
    singles = torch.cat(
        [model.compute_logits(model.forward(ids[i : i + 1], torch.tensor([i]), kv).hidden) for i in range(6)]
    )
    assert torch.equal(together, singles)
    fused, model.fused = model.fused, None  # the per-call loop
    try:
        kv = model.new_kv_cache(16)
        assert torch.equal(model.compute_logits(model.forward(ids, torch.arange(6), kv).hidden), together)
    finally:
        model.fused = fused
    # the token table's rows as the dense table holds them (decoded on demand)
    dense = model.embed
    assert torch.equal(model.embed_tokens(ids), dense[ids].float())
