"""benchmarks/make_gguf.py: a random-weight F16 GGUF that tokenleap's loader and tokenizer read."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tokenleap.models.loaders import load_gguf
from tokenleap.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def make_gguf(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("make_gguf")


@pytest.fixture(scope="module")
def tiny(make_gguf: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-F16.gguf"
    return make_gguf.write_f16(make_gguf.SHAPES["tiny-llama"], path, seed=0, progress=False)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> tuple[Any, dict[str, Any]]:
    return load_gguf(tiny)  # its config comes from read_gguf_config (one parse of the file for both tests)


def test_config_read_back(loaded: tuple[Any, dict[str, Any]]) -> None:
    config = loaded[0]
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "llama",
        256,
        2,
        4,
        2,
    )
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (512, 49152 + 64, 64)
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_theta == 100000.0


def test_tokenizer_encodes_and_decodes(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path))
    tok = Tokenizer.from_gguf(tiny)
    assert tok.vocab_size == 49152 + 64
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"
    assert tok.encode("<|reserved_0|>") == [49152]  # the padding is control tokens, each one token


def test_weights_have_the_shapes(loaded: tuple[Any, dict[str, Any]]) -> None:
    weights = loaded[1]
    assert weights["embed"].shape == (49152 + 64, 256) and "lm_head" not in weights
    assert weights["layers.1.q"].shape == (256, 256) and weights["layers.1.k"].shape == (128, 256)
    assert weights["layers.0.down"].shape == (256, 512) and weights["layers.0.gate"].shape == (512, 256)
    assert float(weights["norm"].min()) == float(weights["norm"].max()) == 1.0
    assert 0.015 < float(weights["layers.0.up"].std()) < 0.025


def test_real_shapes_tensor_lists(make_gguf: ModuleType) -> None:
    names = {s.name: s for s in make_gguf.tensor_specs(make_gguf.SHAPES["llama-3.1-8b"])}
    assert names["output.weight"].shape == (128256, 4096) and names["rope_freqs.weight"].shape == (64,)
    assert names["blk.31.attn_k.weight"].shape == (1024, 4096) and names["blk.0.ffn_down.weight"].shape == (4096, 14336)
    qwen = {s.name for s in make_gguf.tensor_specs(make_gguf.SHAPES["qwen2.5-1.5b"])}
    assert "blk.27.attn_v.bias" in qwen and "output.weight" not in qwen and "rope_freqs.weight" not in qwen
    factors = make_gguf.llama3_rope_factors(make_gguf.SHAPES["llama-3.2-1b"])
    assert factors.shape == (32,) and factors[0] == 1.0 and factors[-1] == 32.0  # fast pairs kept, slow ones x32


# --- Gemma 3: the tensors and keys of llama.cpp's gemma3 loader (src/models/gemma3.cpp), Gemma 3's tokenizer

GEMMA3 = "gemma3"


@pytest.fixture(scope="module")
def tiny_gemma3(make_gguf: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3-F16.gguf"
    return make_gguf.write_f16(make_gguf.SHAPES["tiny-gemma3"], path, seed=0, progress=False)


@pytest.fixture(scope="module")
def gemma3_reader(tiny_gemma3: Path) -> Any:
    import gguf

    return gguf.GGUFReader(str(tiny_gemma3))  # gguf-py's own reader, not make_gguf's read_fields


def _key(template: str) -> str:
    return template.format(arch=GEMMA3)


def test_gemma3_keys_llama_cpp_reads(gemma3_reader: Any) -> None:
    import gguf

    keys = gguf.Keys
    fields = {k: f.contents() for k, f in gemma3_reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    expected = {
        keys.General.ARCHITECTURE: "gemma3",
        _key(keys.LLM.CONTEXT_LENGTH): 8192,
        _key(keys.LLM.EMBEDDING_LENGTH): 128,
        _key(keys.LLM.BLOCK_COUNT): 7,
        _key(keys.LLM.FEED_FORWARD_LENGTH): 256,
        _key(keys.Attention.HEAD_COUNT): 2,
        _key(keys.Attention.HEAD_COUNT_KV): 1,
        _key(keys.Attention.KEY_LENGTH): 64,
        _key(keys.Attention.VALUE_LENGTH): 64,
        _key(keys.Attention.SLIDING_WINDOW): 16,
        _key(keys.Rope.FREQ_BASE): 1000000.0,
        _key(keys.Rope.FREQ_BASE_SWA): 10000.0,
    }
    assert {k: fields.get(k) for k in expected} == expected
    assert fields[_key(keys.Attention.LAYERNORM_RMS_EPS)] == pytest.approx(1e-6)
    # as the converter writes a Gemma 3 1B config: no rope scaling, final_logit_softcapping null, and no
    # sliding_window_pattern (llama.cpp's gemma3 loader then takes its 5:1 default)
    for absent in (keys.Rope.SCALING_TYPE, keys.LLM.FINAL_LOGIT_SOFTCAPPING, keys.Attention.SLIDING_WINDOW_PATTERN):
        assert _key(absent) not in fields
    assert gemma3_reader.fields["tokenizer.ggml.model"].contents() == "llama"  # Gemma 3's SentencePiece
    assert len(gemma3_reader.fields["tokenizer.ggml.tokens"].contents()) == 262144
    assert gemma3_reader.fields["tokenizer.ggml.bos_token_id"].contents() == 2


def test_gemma3_tensors_llama_cpp_loads(gemma3_reader: Any) -> None:
    import gguf

    per_layer = [
        gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GEMMA3] if "{bid}" in gguf.TENSOR_NAMES[t]
    ]
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"{n.format(bid=i)}.weight" for i in range(7) for n in per_layer
    }
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in gemma3_reader.tensors}
    assert set(tensors) == expected  # output.weight: tied, llama.cpp duplicates token_embd
    assert tensors["token_embd.weight"] == ((128, 262144), "F16")  # GGUF order: columns first
    assert tensors["blk.6.attn_q.weight"] == ((128, 128), "F16") and tensors["blk.6.attn_k.weight"] == (
        (128, 64),
        "F16",
    )
    assert tensors["blk.0.attn_q_norm.weight"] == ((64,), "F32") and tensors["blk.0.post_ffw_norm.weight"] == (
        (128,),
        "F32",
    )
    norm = next(t for t in gemma3_reader.tensors if t.name == "blk.3.post_attention_norm.weight")
    assert float(norm.data.min()) == float(norm.data.max()) == 1.0  # the multiplier itself (HF's 1 + w, w = 0)


def test_gemma3_loaded_by_tokenleap(make_gguf: ModuleType, tiny_gemma3: Path) -> None:
    """tokenleap reads the file as Gemma 3 and runs it on its kernels: finite logits, and a
    5-row forward (a speculative verify) bit-identical to 5 single-row forwards past the window.
    (The tokenizer is the 270M GGUF's, copied verbatim; converting it takes tens of seconds.)"""
    import torch

    from tokenleap.kernels import load_kernels
    from tokenleap.models.llama import LlamaModel

    config, weights = load_gguf(tiny_gemma3, keep_quantized=True)
    window = make_gguf.SHAPES["tiny-gemma3"].sliding_window
    assert (config.architecture, config.hidden_size, config.num_layers, config.head_dim, config.vocab_size) == (
        "gemma3",
        128,
        7,
        64,
        262144,
    )
    assert config.tie_word_embeddings and config.qk_norm and config.post_norms and config.sliding_window == 16
    assert config.sliding_layers == tuple(window.is_local(i) for i in range(7)) == (True,) * 5 + (False, True)
    assert (config.rope_theta, config.rope_local_theta, config.embed_scale) == (
        1000000.0,
        10000.0,
        pytest.approx(128**0.5),
    )
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("tokenleap's kernels are not built here")
    model = LlamaModel(config, weights, torch.bfloat16, kernels)
    assert model.kernels is not None and model.kernel_attention  # tokenleap's kernels, not torch's fallback
    prompt = [2, 9259, 1902, 563, 496]  # <bos> and four ids
    kv = model.new_kv_cache(64)
    logits = model.compute_logits(model.forward(torch.tensor(prompt), torch.arange(len(prompt)), kv).hidden)
    ids, steps = list(prompt), []
    for _ in range(20):  # greedy, one row at a time, past the 16-token window
        assert torch.isfinite(logits[-1]).all()
        ids.append(int(logits[-1].argmax()))
        steps.append(logits[-1])
        logits = model.compute_logits(model.forward(torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), kv).hidden)
    kv = model.new_kv_cache(64)
    model.forward(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), kv)
    rows = []
    for start in range(len(prompt) - 1, len(ids) - 1, 5):  # verify-sized chunks of the same tokens
        chunk = ids[start : start + 5]
        rows.append(
            model.compute_logits(model.forward(torch.tensor(chunk), torch.arange(start, start + len(chunk)), kv).hidden)
        )
    assert torch.equal(torch.cat(rows), torch.stack(steps))


def test_spm_vocabulary_padded_as_the_converter_pads(make_gguf: ModuleType) -> None:
    """Gemma 3 4B's 262208 tokens: the 262144 of tokenizer.model, its added `<image_soft_token>`,
    then `_create_vocab_sentencepiece`'s padding."""
    import gguf

    shape = make_gguf.SHAPES["gemma3-4b"]
    writer = gguf.GGUFWriter(None, shape.arch)
    make_gguf.add_tokenizer(writer, make_gguf.default_tokenizer_source(shape), shape.vocab, shape.added_tokens)
    kv = writer.kv_data[0]
    tokens, types, scores = (kv[f"tokenizer.ggml.{k}"].value for k in ("tokens", "token_type", "scores"))
    assert len(tokens) == len(types) == len(scores) == 262208
    assert (tokens[262144], types[262144], scores[262144]) == (
        "<image_soft_token>",
        int(gguf.TokenType.CONTROL),
        -1000.0,
    )
    assert tokens[262143] != "[PAD262143]" and tokens[262145] == "[PAD262145]" and tokens[-1] == "[PAD262207]"
    assert types[-1] == int(gguf.TokenType.UNUSED) and scores[-1] == -10000.0
    assert kv["tokenizer.ggml.bos_token_id"].type == gguf.GGUFValueType.UINT32  # types copied, not guessed


def test_gemma3_real_shapes(make_gguf: ModuleType) -> None:
    import gguf

    one, four = make_gguf.SHAPES["gemma3-1b"], make_gguf.SHAPES["gemma3-4b"]
    specs = {s.name: s for s in make_gguf.tensor_specs(four)}
    assert "output.weight" not in specs and specs["token_embd.weight"].shape == (262208, 2560)
    assert specs["blk.33.attn_q.weight"].shape == (2048, 2560) and specs["blk.33.attn_k.weight"].shape == (1024, 2560)
    assert specs["blk.0.attn_k_norm.weight"].shape == (256,) and specs["blk.0.ffn_down.weight"].shape == (2560, 10240)
    assert sum(math.prod(s.shape) for s in make_gguf.tensor_specs(one)) == 999_885_952  # Gemma 3 1B's parameter count
    writer = gguf.GGUFWriter(None, four.arch)
    make_gguf.add_metadata(writer, four)
    kv = {k: v.value for k, v in writer.kv_data[0].items()}
    assert kv[_key(gguf.Keys.Rope.SCALING_TYPE)] == "linear" and kv[_key(gguf.Keys.Rope.SCALING_FACTOR)] == 8.0
    assert (kv[_key(gguf.Keys.Attention.SLIDING_WINDOW)], kv[_key(gguf.Keys.LLM.CONTEXT_LENGTH)]) == (1024, 131072)
    assert sum(four.sliding_window.is_local(i) for i in range(34)) == 29  # 5 global layers: 5, 11, ..., 29


# --- Mistral 7B v0.3: the llama architecture with Mistral's v3 SentencePiece vocabulary (32768)


def test_sentencepiece_model_as_the_converter_writes_it(make_gguf: ModuleType, tmp_path: Path) -> None:
    import gguf
    from transformers.utils import sentencepiece_model_pb2_new as sp_pb2

    model = sp_pb2.ModelProto()
    piece = sp_pb2.ModelProto.SentencePiece
    for text, kind, score in (
        ("<unk>", piece.UNKNOWN, 0.0), ("<s>", piece.CONTROL, 0.0), ("</s>", piece.CONTROL, 0.0),
        ("[REF]", piece.USER_DEFINED, 0.0), ("<0x00>", piece.BYTE, 0.0), ("▁the", piece.NORMAL, -1.5)
    ):
        model.pieces.add(piece=text, type=kind, score=score)
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model.SerializeToString())
    fields = {f.key: f for f in make_gguf.tokenizer_fields(path)}
    assert fields["tokenizer.ggml.model"].value == "llama" and fields["tokenizer.ggml.tokens"].value[-1] == "▁the"
    types = gguf.TokenType
    assert fields["tokenizer.ggml.token_type"].value == [
        types.UNKNOWN, types.CONTROL, types.CONTROL, types.NORMAL, types.BYTE, types.NORMAL
    ]
    assert (
        fields["tokenizer.ggml.scores"].value[-1] == -1.5
        and fields["tokenizer.ggml.scores"].sub_type == gguf.GGUFValueType.FLOAT32
    )
    assert (fields["tokenizer.ggml.bos_token_id"].value, fields["tokenizer.ggml.eos_token_id"].value) == (1, 2)
    assert fields["tokenizer.ggml.bos_token_id"].type == gguf.GGUFValueType.UINT32


def test_mistral_shape(make_gguf: ModuleType) -> None:
    shape = make_gguf.SHAPES["mistral-7b"]
    specs = {s.name: s for s in make_gguf.tensor_specs(shape)}
    assert shape.arch == "llama" and shape.tokenizer == "mistral-v3" and "rope_freqs.weight" not in specs
    assert specs["output.weight"].shape == (32768, 4096) and specs["blk.31.attn_v.weight"].shape == (1024, 4096)
    assert sum(math.prod(s.shape) for s in specs.values()) == 7_248_023_552  # Mistral 7B v0.3's parameter count


def test_mistral_vocabulary(make_gguf: ModuleType) -> None:
    import importlib.util

    if importlib.util.find_spec(make_gguf.MISTRAL_TOKENIZER_MODULE) is None:
        pytest.skip("mistral-common (the v3 SentencePiece model's package) is not installed")
    fields = {
        f.key: f.value
        for f in make_gguf.tokenizer_fields(make_gguf.default_tokenizer_source(make_gguf.SHAPES["mistral-7b"]))
    }
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 32768 and tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[771] == "<0x00>"
    assert tokens[23325] == "▁Hello"  # v0.1's 22557 moved up by the 768 control tokens of v0.3
