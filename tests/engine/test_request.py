"""Request state: stop strings, stop tokens, EOS, max_tokens, context length, and streamed text deltas."""

from __future__ import annotations

import pytest

from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request, _stop_prefix_holdback
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
