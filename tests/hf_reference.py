"""transformers' own model on a GGUF file, the reference the model tests compare against.

transformers reads a GGUF's metadata through `gguf.GGUFReader` twice (once for the config, once
for the weights), and that reader builds a numpy view per entry of every array: Gemma 3's
262k-token vocabulary (tokens, scores, types) took 34 of a 48 s load. A model fed token ids never
uses those arrays, so the reference loads a copy of the file without them (`{arch}.vocab_size`
set in their place, the count transformers would otherwise take from the token list); the
weights, the config's keys and transformers' own dequantization are the file's.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from tokenleap.models.gguf_file import GgufFile, _Cursor

_DROPPED = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def without_tokenizer_arrays(src: Path, dst: Path) -> Path:
    """Copy GGUF `src` to `dst` byte for byte, less the tokenizer's arrays, plus `{arch}.vocab_size`."""
    meta = GgufFile(src)
    arch = meta.fields["general.architecture"]
    vocab = len(meta.fields["tokenizer.ggml.tokens"])
    buf = src.read_bytes()
    cur = _Cursor(buf, 4)
    version, n_tensors, n_fields = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    kept: list[bytes] = []
    for _ in range(n_fields):
        start = cur.pos
        key = cur.string()
        cur.value(cur.scalar("<I"))
        if key not in _DROPPED and key != f"{arch}.vocab_size":
            kept.append(buf[start : cur.pos])
    kept.append(_string(f"{arch}.vocab_size") + struct.pack("<II", 4, vocab))
    infos_start = cur.pos
    for _ in range(n_tensors):
        cur.string()
        dims = cur.scalar("<I")
        cur.pos += 8 * dims + 4 + 8  # dimensions, type, offset
    align = int(meta.fields.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + buf[infos_start : cur.pos]
    dst.write_bytes(head + bytes(-len(head) % align) + buf[data_start:])
    return dst


def hf_causal_lm(gguf_path: Path, work_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model for `gguf_path` (through a copy in `work_dir`), in eval mode."""
    from transformers import AutoModelForCausalLM

    copy = without_tokenizer_arrays(gguf_path, work_dir / gguf_path.name)
    return AutoModelForCausalLM.from_pretrained(str(work_dir), gguf_file=copy.name, dtype=dtype).eval()
