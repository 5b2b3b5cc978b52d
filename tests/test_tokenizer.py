"""Tokenizer from the GGUF, chat template, and incremental detokenization of multi-byte text."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenleap.errors import TokenleapError
from tokenleap.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "héllo 你好 🙂 done"


def test_encode_decode_round_trip(tokenizer: Tokenizer) -> None:
    for text in ("Hello, world!", MULTIBYTE, "  leading spaces and\nnewlines\t", "1234 + 5678 = 6912"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == frozenset({2})


def test_extra_eos_ids(model_path: Path) -> None:
    tok = Tokenizer.from_gguf(model_path, extra_eos_ids=[0, 7])
    assert tok.eos_token_ids == frozenset({0, 2, 7})


def test_multibyte_characters_span_several_tokens(tokenizer: Tokenizer) -> None:
    """Precondition of the streaming test: some tokens are partial UTF-8 sequences."""
    ids = tokenizer.encode(MULTIBYTE)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def _stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in ids]
    return deltas, detok.flush()


@pytest.mark.parametrize("text", [MULTIBYTE, "🙂🙂🙂", "日本語のテキストです。", "naïve café — ok"])
def test_incremental_detokenizer_never_emits_replacement_chars(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    deltas, tail = _stream(tokenizer, ids)
    for i, delta in enumerate(deltas):
        assert "\ufffd" not in delta, f"delta {i} {delta!r} splits a character"
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert tail == ""  # nothing incomplete at the end of well-formed text


def test_incremental_detokenizer_flush_returns_held_back_bytes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # some prefix ends in the middle of a character
    partial = ids[: cuts[0]]
    deltas, tail = _stream(tokenizer, partial)
    assert "\ufffd" not in "".join(deltas)
    assert tail != ""
    assert "".join(deltas) + tail == tokenizer.decode(partial)


def test_incremental_detokenizer_chunks(tokenizer: Tokenizer) -> None:
    """Pushing several ids at once gives the same text as one at a time."""
    ids = tokenizer.encode("A longer sentence, with 你好 and 🙂, to be streamed in uneven chunks.")
    detok = IncrementalDetokenizer(tokenizer)
    out = []
    i = 0
    for size in (1, 3, 2, 5, 1, 4, 100):
        out.append(detok.push(ids[i : i + size]))
        i += size
    out.append(detok.flush())
    assert "".join(out) == tokenizer.decode(ids)


def test_chat_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids = tokenizer.apply_chat_template(messages)
    text = tokenizer.hf.decode(ids)  # keep the special tokens
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    without = tokenizer.hf.decode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    assert "<|im_start|>assistant" not in without
    # the special markers are single tokens, not spelled out
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3


@pytest.mark.parametrize("bad", [[{"content": "hi"}], [{"role": "user"}], ["hello"]])
def test_chat_template_bad_messages(tokenizer: Tokenizer, bad: list) -> None:
    with pytest.raises(TokenleapError, match="role.*content"):
        tokenizer.apply_chat_template(bad)


def test_no_chat_template() -> None:
    tok = Tokenizer(SimpleNamespace(chat_template=None, eos_token_id=None))
    assert tok.eos_token_ids == frozenset()
    with pytest.raises(TokenleapError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_another_file_of_the_same_model_reuses_the_conversion(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The converted tokenizer is cached by the file and by its tokenizer's content: a second
    file with the same `tokenizer.*` metadata (another quantization) is not converted again."""
    import logging
    import os
    import shutil

    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "cache"))
    copies = []
    for name in ("a.gguf", "b.gguf"):
        dst = tmp_path / name
        try:
            os.link(model_path, dst)  # same bytes, another path
        except OSError:
            shutil.copyfile(model_path, dst)
        copies.append(dst)
    with caplog.at_level(logging.INFO, logger="tokenleap.tokenizer"):
        first = Tokenizer.from_gguf(copies[0])
        second = Tokenizer.from_gguf(copies[1])
        again = Tokenizer.from_gguf(copies[1])
    assert sum("converting the tokenizer" in r.getMessage() for r in caplog.records) == 1
    text = "Speculative decoding, losslessly: ¿sí? 東京"
    assert first.encode(text) == second.encode(text) == again.encode(text)
    names = sorted(p.name for p in (tmp_path / "cache" / "tokenizers").iterdir())
    assert (
        len(names) == 3
        and sum(n.startswith("content-") for n in names) == 1
        and sum(n.endswith(".ref") for n in names) == 2
    ), names


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_the_conversion_saves_what_autotokenizer_saves(model: str, tmp_path: Path) -> None:
    """`convert_gguf` (the class from the architecture, not from AutoTokenizer's full metadata
    parse) gives the tokenizer `AutoTokenizer.from_pretrained(gguf_file=)` gives, on the three
    architectures' real files (llama: TokenizersBackend, gemma3: GemmaTokenizer, qwen2:
    Qwen2Tokenizer): the same class and the same saved folder, byte for byte."""
    from transformers import AutoTokenizer

    from tokenleap.errors import ModelNotFoundError
    from tokenleap.models.registry import resolve
    from tokenleap.tokenizer import convert_gguf

    try:
        path = resolve(model).path
    except ModelNotFoundError as exc:  # the Qwen pair's chunk packages (scripts/setup.sh installs them)
        pytest.skip(str(exc))
    ours, auto = convert_gguf(path), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(auto)
    ours.save_pretrained(tmp_path / "ours")
    auto.save_pretrained(tmp_path / "auto")
    names = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert "tokenizer.json" in names and sorted(p.name for p in (tmp_path / "ours").iterdir()) == names
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "auto" / name).read_bytes(), name


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_cached_folder_loads_as_autotokenizer_loads_it(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load_saved` builds the cached tokenizer folder directly (the fast path of every load):
    on the real models it is the tokenizer `AutoTokenizer.from_pretrained` makes of that folder
    (ids with and without special tokens, decoded text with and without them, special ids,
    vocabulary size, chat template), and a first load (the conversion) gives what later ones do."""
    from transformers import AutoTokenizer

    from tokenleap.models.registry import resolve
    from tokenleap.tokenizer import load_saved

    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "cache"))
    path = resolve(model).path
    first, later = Tokenizer.from_gguf(path), Tokenizer.from_gguf(path)
    (folder,) = [p for p in (tmp_path / "cache" / "tokenizers").iterdir() if p.name.startswith("content-")]
    direct, auto = load_saved(folder), AutoTokenizer.from_pretrained(str(folder))
    specials = [t for t in auto.all_special_tokens][:8] + [str(auto.convert_ids_to_tokens(len(auto) - 1))]
    texts = [
        MULTIBYTE,
        "Speculative decoding, losslessly: ¿sí? 東京\n\n  code:\tx = [1, 2]",
        " ".join(specials) + " tail",
    ]
    for text in texts:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert direct.encode(text, add_special_tokens=special) == ids, (text, special)
            assert (
                first.hf.encode(text, add_special_tokens=special)
                == later.hf.encode(text, add_special_tokens=special)
                == ids
            )
            for skip in (True, False):
                assert direct.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert (direct.bos_token_id, direct.eos_token_id, direct.pad_token_id, len(direct)) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
        len(auto),
    )
    assert sorted(direct.all_special_ids) == sorted(auto.all_special_ids)
    assert direct.chat_template == auto.chat_template  # (the Gemma 3 270M file has none)
    if auto.chat_template:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
        assert direct.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
            auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert first.apply_chat_template(messages) == later.apply_chat_template(messages)


def test_the_tokenizer_cache_drops_what_no_file_uses(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ref whose GGUF is gone is dropped at the next conversion, then the converted folder no
    ref names (once older than the grace period); refs beyond the limit go oldest first; the
    file in use keeps its tokenizer."""
    import os
    import shutil

    from tokenleap.tokenizer import prune_tokenizer_cache

    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "tokenizers"
    gone = tmp_path / "gone.gguf"
    shutil.copyfile(model_path, gone)
    Tokenizer.from_gguf(gone)
    (old_folder,) = list(root.glob("content-*"))
    os.utime(old_folder, (1, 1))  # converted long ago
    gone.unlink()
    os.rename(old_folder, root / "content-0000000000000000")  # as if it were another tokenizer's
    for ref in root.glob("*.ref"):  # and the ref names that folder
        lines = ref.read_text().splitlines()
        ref.write_text("\n".join(["content-0000000000000000", *lines[1:]]) + "\n")
    Tokenizer.from_gguf(model_path)  # converts again (the old folder's name no longer matches) and prunes
    names = sorted(p.name for p in root.iterdir())
    assert len(names) == 2 and "content-0000000000000000" not in names, names
    keep = next(root.glob("*.ref"))
    for i in range(5):  # refs of files still there, used at different times
        ref = root / f"{i:016x}.ref"
        ref.write_text(keep.read_text())
        os.utime(ref, (1000 + i, 1000 + i))
    removed = prune_tokenizer_cache(root, keep, limit=2)
    assert sorted(p.name for p in removed) == [f"{i:016x}.ref" for i in range(3)]
    assert Tokenizer.from_gguf(model_path).encode("hello") == Tokenizer.from_folder(
        next(root.glob("content-*"))
    ).encode("hello")
