"""Request state: stop strings, stop tokens, EOS, max_tokens, context length, and streamed text deltas."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import pytest

from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request, StopHoldback, _stop_prefix_holdback
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer

EOS = 2
PROMPT = [10, 11, 12]  # valid ids for the tiny model (vocab 256)
TEXT = "The capital of France is Paris. It is known for the Eiffel Tower and great food."


@pytest.fixture
def engine(tiny_model: LlamaModel, tokenizer: Tokenizer) -> Engine:
    """The tiny model with the real tokenizer: requests are fed real token ids by hand."""
    return Engine(tiny_model, tokenizer)


def _request(engine: Engine, **params: object) -> Request:
    return engine.add_request(PROMPT, SamplingParams(**params))  # type: ignore[arg-type]


def _feed_one_by_one(req: Request, ids: list[int]) -> list[str]:
    deltas = []
    for tok in ids:
        if req.finished:
            break
        req.append_tokens([tok])
        deltas.append(req.take_delta())
    return deltas


def test_stop_string_cuts_text(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    req = _request(engine, max_tokens=100, stop=["Eiffel"])
    kept = req.append_tokens(ids)
    assert req.finish_reason == "stop"
    assert req.stop_reason == "Eiffel"
    assert req.text == "The capital of France is Paris. It is known for the "
    assert kept < len(ids)  # tokens after the stop are dropped
    assert req.output_ids == ids[:kept]
    assert tokenizer.decode(req.output_ids).startswith(req.text + "Eiffel")
    out = req.to_output()
    assert out.finished and out.outputs[0].text == req.text and out.outputs[0].stop_reason == "Eiffel"


def test_stop_string_spanning_tokens_and_earliest_wins(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    # "Paris. It" spans several tokens; "great" comes later in the text but is listed first
    req = _request(engine, max_tokens=100, stop=["great", "is. It"])
    _feed_one_by_one(req, ids)
    assert (req.finish_reason, req.stop_reason) == ("stop", "is. It")
    assert req.text == "The capital of France is Par"


def test_stop_string_found_when_tokens_fed_one_at_a_time(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    a = _request(engine, max_tokens=100, stop=["Tower"])
    a.append_tokens(ids)
    b = _request(engine, max_tokens=100, stop=["Tower"])
    _feed_one_by_one(b, ids)
    assert a.text == b.text == "The capital of France is Paris. It is known for the Eiffel "
    assert a.output_ids == b.output_ids


@pytest.mark.parametrize("stop", [["Eiffel Tower"], ["Paris!", "Tower"], ["is known for the Eiffel"], ["zzz"]])
def test_streamed_deltas_concatenate_to_final_text(engine: Engine, tokenizer: Tokenizer, stop: list[str]) -> None:
    ids = tokenizer.encode(TEXT + " Paris is lovely.") + [EOS]
    req = _request(engine, max_tokens=100, stop=stop)
    emitted = ""
    snapshots = []
    for tok in ids:
        if req.finished:
            break
        req.append_tokens([tok])
        emitted += req.take_delta()
        snapshots.append(emitted)
    assert req.finished
    assert emitted == req.text
    # what was shown at any moment is a prefix of the final text: a stop string (even part of
    # one) that is later cut from the text was never shown
    assert all(req.text.startswith(shown) for shown in snapshots)
    assert all(s not in emitted for s in stop)
    assert req.take_delta() == ""


def test_partial_stop_string_is_held_back_then_released(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Paris. Paris is nice")
    req = _request(engine, max_tokens=100, stop=["Paris is great"])
    shown = []
    checked = False
    for tok in ids:
        req.append_tokens([tok])
        shown.append(req.take_delta())
        if req.text.endswith("Paris is"):
            # "Paris is" could still become the stop string: not shown yet
            assert "".join(shown) == "Paris. "
            checked = True
    assert checked and not req.finished
    req.append_tokens([EOS])
    assert req.finish_reason == "stop"
    assert "".join(shown) + req.take_delta() == "Paris. Paris is nice"


def test_max_tokens_gives_length(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    req = _request(engine, max_tokens=5)
    kept = req.append_tokens(ids)
    assert kept == 5
    assert req.finish_reason == "length" and req.stop_reason is None
    assert req.output_ids == ids[:5]
    assert req.text == tokenizer.decode(ids[:5])
    assert req.metrics.num_generation_tokens == 5


def test_eos_ends_with_stop(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello there")
    req = _request(engine, max_tokens=50)
    kept = req.append_tokens(ids + [EOS] + ids)
    assert kept == len(ids) + 1  # the EOS is consumed, nothing after it
    assert req.finish_reason == "stop" and req.stop_reason is None
    assert req.output_ids == ids  # EOS is not part of the output
    assert req.text == "Hello there"


def test_ignore_eos(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello there")
    req = _request(engine, max_tokens=len(ids) + 3, ignore_eos=True)
    req.append_tokens(ids + [EOS])
    assert not req.finished
    req.append_tokens(ids)
    assert req.finish_reason == "length"
    assert req.output_ids == ids + [EOS] + ids[:2]
    assert req.text.startswith("Hello there")


def test_stop_token_ids(engine: Engine, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    stop_tok = ids[4]
    req = _request(engine, max_tokens=100, stop_token_ids=[stop_tok])
    kept = req.append_tokens(ids)
    assert kept == 5
    assert req.finish_reason == "stop" and req.stop_reason == stop_tok
    assert req.output_ids == ids[:4]
    assert req.text == tokenizer.decode(ids[:4])


def test_context_full_gives_length(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    engine = Engine(tiny_model, tokenizer, max_model_len=8)
    req = _request(engine, max_tokens=100)
    kept = req.append_tokens(tokenizer.encode(TEXT))
    assert kept == 5 and req.num_tokens == 8
    assert req.finish_reason == "length"


def test_multibyte_text_streams_cleanly(engine: Engine, tokenizer: Tokenizer) -> None:
    text = "héllo 你好 🙂 done"
    req = _request(engine, max_tokens=100)
    deltas = _feed_one_by_one(req, tokenizer.encode(text) + [EOS])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == req.text == text


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello wor", ["world"], 3),
        ("hello w", ["world", "wx"], 1),
        ("hello", ["world"], 0),
        ("hello world", ["world"], 0),  # a complete stop string is not a *proper* prefix
        ("ab", ["abc", "b"], 2),
        ("", ["abc"], 0),
    ],
)
def test_stop_prefix_holdback(text: str, stops: list[str], expected: int) -> None:
    assert _stop_prefix_holdback(text, stops) == expected


# --------------------------------------------------------------------------- incremental hold-back


def _reference_holdback(text: str, stops: Sequence[str]) -> int:
    """The slow obvious definition: the longest suffix of `text` that is a proper prefix of a stop."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_incremental_holdback_matches_reference_on_random_texts() -> None:
    rng = random.Random(11)
    for _ in range(400):
        alphabet = "ab" if rng.random() < 0.5 else "abc "
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 5))]
        tracker = StopHoldback(stops)
        text = ""
        for _ in range(rng.randint(1, 30)):
            chunk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            text += chunk
            tracker.feed(chunk)
            assert tracker.held == _reference_holdback(text, stops), (text, stops)
            assert _stop_prefix_holdback(text, stops) == tracker.held


def _reference_deltas(req: Request, tokens: list[int]) -> tuple[list[str], str]:
    """Stream `tokens` token by token, computing each delta the way take_delta did before it
    was incremental (rescanning every stop string at every step)."""
    deltas, emitted = [], 0
    for tok in tokens:
        if req.finished:
            break
        req.append_tokens([tok])
        end = len(req.text)
        if not req.finished and req.params.stop:
            end -= _reference_holdback(req.text, req.params.stop)
        deltas.append(req.text[emitted:end] if end > emitted else "")
        emitted = max(emitted, end)
    return deltas, req.text


def test_streamed_deltas_equal_the_rescanning_ones_on_random_stops(engine: Engine, tokenizer: Tokenizer) -> None:
    rng = random.Random(5)
    text = TEXT + " Paris, Paris: the city of light. It is, it is, it is known. " * 3
    ids = tokenizer.encode(text)
    for _ in range(60):
        stops = []
        for _ in range(rng.randint(1, 4)):
            a = rng.randrange(len(text) - 2)
            stop = text[a : a + rng.randint(1, 14)]
            if rng.random() < 0.3:
                stop += "#"  # never completes: only held back
            stops.append(stop)
        new = _request(engine, max_tokens=200, stop=stops)
        old = _request(engine, max_tokens=200, stop=stops)
        got = _feed_one_by_one(new, ids)
        expected, final = _reference_deltas(old, ids)
        assert got == expected, stops
        assert new.text == final and new.stop_reason == old.stop_reason and new.output_ids == old.output_ids


def _lines_executed(fn: Callable[[], Any]) -> int:
    """Python lines run by `fn` (with C calls counted too): a deterministic measure of work."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_holdback_work_per_step_does_not_grow_with_the_stop_strings(engine: Engine, tokenizer: Tokenizer) -> None:
    """16 stop strings of 1000 characters cost a streamed step about what 16 short ones do:
    the hold-back reads each new character once, it does not rescan every stop string."""
    ids = tokenizer.encode(TEXT * 4)

    def run(stop_len: int) -> int:
        rng = random.Random(0)
        stops = ["".join(rng.choice("xyz") for _ in range(stop_len)) for _ in range(16)]
        req = _request(engine, max_tokens=500, stop=stops)
        req.append_tokens(ids[:1])
        req.take_delta()  # set-up cost (once per request) left out

        def steps() -> None:
            for tok in ids[1:]:
                req.append_tokens([tok])
                req.take_delta()

        return _lines_executed(steps)

    short, long = run(4), run(1000)
    assert long < 2 * short, (short, long)
