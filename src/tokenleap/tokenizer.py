"""Tokenizer, chat template and incremental (streaming) detokenization.

Tokenization is Hugging Face `tokenizers` through transformers' tokenizer classes, built from a
GGUF file's embedded vocabulary, merges and chat template (the class `AutoTokenizer` would pick,
found from the architecture: `convert_gguf`; converted once, then cached as a regular tokenizer
folder), or from a model folder. Streaming uses the two-offset incremental
detokenizer of Hugging Face TGI / vLLM: decode a window of recent tokens and emit only text
that is complete, so a multi-byte character split across tokens is never printed half-formed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenleap.errors import TokenleapError
from tokenleap.paths import cache_dir, source_identity, still_current

logger = logging.getLogger(__name__)


class Tokenizer:
    """Thin wrapper over a Hugging Face fast tokenizer."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = {int(t) for t in extra_eos_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_gguf(cls, path: Path, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        """The file's tokenizer, converted once and cached: by the file's identity (path, size,
        mtime), and by the content of its `tokenizer.*` metadata, so that another file of the
        same model (another quantization) reuses the conversion (2.6 s for Gemma 3's 262k
        tokens; 12-25 s through AutoTokenizer) at the cost of one metadata read."""
        stat = path.stat()
        root = cache_dir() / "tokenizers"
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
        ref = root / f"{key}.ref"  # names the content folder this file's tokenizer is in
        named = _ref_folder(ref) if ref.is_file() else None
        for folder in (root / key, root / named if named else None):  # (an older cache: a folder per file)
            if folder is not None and (folder / "tokenizer_config.json").exists():
                try:
                    os.utime(ref if named else folder)  # most recently used (prune_tokenizer_cache keeps those)
                except OSError:  # a read-only cache
                    pass
                return cls(load_saved(folder), extra_eos_ids)
        from tokenleap.models.gguf_file import GgufFile

        fields = GgufFile(path).fields  # read once: the digest and the conversion's architecture
        shared = root / f"content-{_tokenizer_digest(fields)}"
        if (shared / "tokenizer_config.json").exists():
            hf = load_saved(shared)
        else:
            logger.info("converting the tokenizer of %s (once; cached in %s)", path.name, shared)
            _save_atomically(convert_gguf(path, fields), shared)
            hf = load_saved(shared)  # as every later load builds it
        tmp = ref.with_name(ref.name + f".tmp{os.getpid()}")
        tmp.write_text(shared.name + "\n" + json.dumps(source_identity(path)) + "\n")
        os.replace(tmp, ref)
        try:
            for gone in prune_tokenizer_cache(root, ref):
                logger.info(
                    "removed cached tokenizer %s (its GGUF is gone or changed, or unused for longest)", gone.name
                )
        except OSError:  # pruning only saves space
            pass
        return cls(hf, extra_eos_ids)

    @classmethod
    def from_folder(cls, folder: Path, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(folder)), extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise TokenleapError(
                "this model has no chat template: give it a plain prompt "
                "(generate() with a string; on the command line, --raw)"
            )
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenleapError(f"each chat message needs 'role' and 'content', got {m!r}")
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
        return list(self.hf.encode(text, add_special_tokens=False))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_ids)
        prefix = self._tok.decode(self.token_ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self.token_ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self._tok.decode(self.token_ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self.token_ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


TOKENIZER_CACHE_KEEP = 8  # GGUF files whose converted tokenizer stays cached beside the one in use
_CONVERSION_GRACE_S = 3600  # a converted folder younger than this may be another process's, not yet named by a ref


def _ref_folder(ref: Path) -> str:
    """The converted folder a ref names (its first line)."""
    lines = ref.read_text().splitlines()
    return lines[0].strip() if lines else ""


def _ref_is_stale(ref: Path) -> bool:
    """Whether a ref's GGUF is gone or changed (refs from before sources were recorded: never)."""
    lines = ref.read_text().splitlines()
    if len(lines) < 2:
        return False
    try:
        return not still_current(json.loads(lines[1]))
    except ValueError:  # not JSON
        return True


def prune_tokenizer_cache(root: Path, keep: Path, limit: int = TOKENIZER_CACHE_KEEP) -> list[Path]:
    """Drop the refs of GGUF files that are gone or changed (a deleted clone, a temporary copy),
    then all but the `limit` most recently used others (with the older cache's per-file folders),
    then every converted folder no ref names any more (unless younger than an hour: another
    process may have converted it and not yet written its ref). `keep` (a ref) stays. Returns
    what was removed."""
    removed: list[Path] = []
    entries: list[Path] = []
    for entry in root.iterdir():
        if entry == keep or ".tmp" in entry.name or entry.name.startswith("content-"):
            continue
        if entry.suffix == ".ref":
            (removed if _ref_is_stale(entry) else entries).append(entry)
        elif entry.is_dir():
            entries.append(entry)  # an older cache's folder for one file
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    removed += entries[limit:]
    for entry in removed:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    named = {_ref_folder(r) for r in root.glob("*.ref")}
    now = time.time()
    for folder in root.glob("content-*"):
        if (
            folder.name not in named
            and ".tmp" not in folder.name
            and now - folder.stat().st_mtime > _CONVERSION_GRACE_S
        ):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


# GGUF `general.architecture` -> the model type transformers' GGUF loader gives its config
# (`load_gguf_checkpoint`: gemma3's text model is "gemma3_text"; a llama file named exactly
# "mistral" is "mistral"): the architectures tokenleap runs
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def convert_gguf(path: Path, fields: dict[str, Any] | None = None) -> Any:
    """The GGUF's tokenizer as `AutoTokenizer.from_pretrained(folder, gguf_file=name)` builds it,
    without the parse it does first only to pick the class: gguf-py's reader over every metadata
    array (for Gemma 3's 262k tokens ~20 of a 25 s conversion; transformers' own fast reader covers
    only a few architectures' configs so far). The class comes from the architecture's config
    class through AutoTokenizer's mapping (its last rule, the one a GGUF folder reaches), and the
    class then reads the vocabulary with transformers' fast reader. Other architectures, or a
    folder with its own tokenizer_config.json, go through AutoTokenizer
    (tests/test_tokenizer.py: the same files on the real models). `fields`: the file's metadata,
    where the caller has read it."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from tokenleap.models.gguf_file import GgufFile

    if fields is None:
        fields = GgufFile(path).fields
    model_type = _MODEL_TYPES.get(str(fields.get("general.architecture")))
    if model_type == "llama" and fields.get("general.name") == "mistral":
        model_type = "mistral"
    if model_type is None or (path.parent / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    found: Any = TOKENIZER_MAPPING.get(type(AutoConfig.for_model(model_type)), TokenizersBackend)
    if not hasattr(found, "from_pretrained"):  # a transformers whose mapping holds something else
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return found.from_pretrained(str(path.parent), gguf_file=path.name)


def _tokenizer_digest(fields: dict[str, Any]) -> str:
    """A digest of a GGUF's tokenizer: its `tokenizer.*` metadata and architecture (`fields`: the
    file's metadata)."""
    wanted = {k: v for k, v in fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    return hashlib.sha256(json.dumps(wanted, sort_keys=True, default=str).encode()).hexdigest()[:16]


# tokenizer_config.json keys that describe the saved folder, not arguments of the tokenizer
_FOLDER_KEYS = frozenset(
    {"tokenizer_class", "backend", "is_local", "local_files_only", "auto_map", "added_tokens_decoder"}
)


def load_saved(folder: Path) -> Any:
    """A tokenizer folder this module saved (tokenizer.json, tokenizer_config.json, maybe
    chat_template.jinja) as transformers' `TokenizersBackend` over its tokenizer.json, built
    directly. `AutoTokenizer.from_pretrained` gives the same tokenizer (the same ids, text,
    special tokens and chat template: tests/test_tokenizer.py) in 2.6 s instead of 0.7-0.9 s
    for a large vocabulary: it deep-copies one AddedToken object per added token (6,384 in
    Gemma 3's, 79,104 padding tokens in the 1B-8B benchmark shapes') and imports the Auto
    registry (1.2 s more). Anything else (a folder without tokenizer.json) goes through it."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    kwargs = {k: v for k, v in config.items() if k not in _FOLDER_KEYS}
    template = folder / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text(encoding="utf-8")
    return TokenizersBackend(tokenizer_file=str(tokenizer_json), name_or_path=str(folder), **kwargs)


def _save_atomically(hf: Any, folder: Path) -> None:
    """Save a tokenizer folder whole or not at all (concurrent processes may race)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    hf.save_pretrained(str(tmp))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
