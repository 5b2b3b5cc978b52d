"""tests/hf_reference.py: the reference's GGUF copy keeps every weight and key but the tokenizer's arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hf_reference import without_tokenizer_arrays
from tokenleap.models.gguf_file import GgufFile


def test_the_copy_keeps_the_weights_and_every_key_but_the_token_arrays(model_path: Path, tmp_path: Path) -> None:
    src = GgufFile(model_path)
    copy = GgufFile(without_tokenizer_arrays(model_path, tmp_path / model_path.name))
    assert [t.name for t in copy.tensors] == [t.name for t in src.tensors]
    assert all(
        a.tensor_type == b.tensor_type and a.shape == b.shape and np.array_equal(a.data, b.data)
        for a, b in zip(src.tensors, copy.tensors)
    )
    arch = src.fields["general.architecture"]
    dropped = set(src.fields) - set(copy.fields)
    assert dropped and dropped <= {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    }
    assert copy.fields[f"{arch}.vocab_size"] == len(src.fields["tokenizer.ggml.tokens"])
    assert all(copy.fields[k] == v for k, v in src.fields.items() if k not in dropped)
