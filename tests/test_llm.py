"""The LLM facade: vLLM-shaped outputs from generate / chat / stream, batched generation (equal to
one-at-a-time, bounded running set, lazy requests, streaming results), determinism, seeds, and
user errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import tokenleap
from tokenleap import LLM, SamplingParams, TokenleapError
from tokenleap.engine.request import Request
from tokenleap.engine.speculation import CostCurve
from tokenleap.errors import ModelNotFoundError
from tokenleap.kernels import CpuKernels
from tokenleap.kv.cache import KVCache
from tokenleap.models.base import ModelOutput
from tokenleap.models.llama import ROW_PATH_MAX_ROWS
from tokenleap.types import CompletionOutput, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny_llm(tiny_hf_folder: Path) -> LLM:
    """The tiny random model behind the real facade, with a 32-token context."""
    return LLM(str(tiny_hf_folder), dtype="float32", max_model_len=32)


# --------------------------------------------------------------------------- outputs


@pytest.mark.slow
def test_generate_returns_vllm_shaped_outputs(llm: LLM) -> None:
    prompt = "The capital of France is"
    outs = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert isinstance(outs, list) and len(outs) == 1
    out = outs[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == prompt
    assert out.prompt_token_ids == llm.get_tokenizer().encode(prompt)
    assert len(out.outputs) == 1
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput) and c.index == 0
    assert isinstance(c.text, str) and c.text.strip()
    assert all(isinstance(t, int) for t in c.token_ids) and 0 < len(c.token_ids) <= 12
    assert c.finish_reason in ("stop", "length")
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    assert "Paris" in c.text
    m = out.metrics
    assert m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.num_generation_tokens == len(c.token_ids)
    assert m.prefill_seconds > 0 and m.tokens_per_second > 0
    assert m.first_token_time is not None and m.finished_time is not None


@pytest.mark.slow
def test_generate_many_prompts_in_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("Water boils at a temperature of")
    prompts = ["One, two, three, four,", ids]
    params = [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=0.0, max_tokens=3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["One, two, three, four,", None]
    assert outs[1].prompt_token_ids == ids
    assert len(outs[1].outputs[0].token_ids) <= 3
    assert outs[0].request_id != outs[1].request_id
    # token-id prompts and text prompts are the same thing
    single = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == outs[1].outputs[0].token_ids


@pytest.mark.slow
def test_chat_one_and_many_conversations(llm: LLM) -> None:
    conv = [{"role": "user", "content": "What is the capital of Italy? Answer in one word."}]
    one = llm.chat(conv, GREEDY, use_tqdm=False)
    assert len(one) == 1
    assert one[0].outputs[0].text.strip()
    assert "<|im_start|>assistant" not in one[0].outputs[0].text
    assert one[0].prompt_token_ids == llm.chat_token_ids(conv)
    many = llm.chat([conv, [{"role": "user", "content": "Say hello."}]], GREEDY, use_tqdm=False)
    assert len(many) == 2
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids


@pytest.mark.slow
def test_greedy_is_deterministic(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompt = "Once upon a time, in a small village,"
    a = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text


@pytest.mark.slow
def test_seeded_sampling_reproducible_and_seeds_differ(llm: LLM) -> None:
    prompt = "Write a sentence about a cat:"

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


@pytest.mark.slow
def test_stream_matches_final_output(llm: LLM) -> None:
    chunks = list(llm.stream("List three colours:", SamplingParams(temperature=0.0, max_tokens=12)))
    assert chunks[-1].finished and chunks[-1].output is not None
    assert not any(c.finished for c in chunks[:-1])
    text = "".join(c.text for c in chunks)
    assert text == chunks[-1].output.outputs[0].text
    assert len(chunks) > 2  # streamed, not one blob


@pytest.mark.slow
def test_stop_string_through_llm(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[","])
    out = llm.generate("Apples, pears, plums, cherries, and grapes are all", params, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop" and out.stop_reason == ",":
        assert "," not in out.text
    else:  # the model never wrote a comma: then the whole output is comma-free too
        assert "," not in llm.get_tokenizer().decode(out.token_ids)


# --------------------------------------------------------------------------- batching


class LiveCounter:
    """Counts the engine's requests holding a KV cache (added, not yet finished)."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.added = 0
        self.peak = 0


@contextmanager
def count_live(llm: LLM, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int | None = None) -> Iterator[LiveCounter]:
    """Instrument `llm.engine` (add_request / finish) for the duration; optionally run with
    another `max_num_seqs`."""
    counter = LiveCounter()
    engine = llm.engine
    add, finish = engine.add_request, engine.finish

    def counting_add(*args: object, **kwargs: object) -> Request:
        req = add(*args, **kwargs)  # type: ignore[arg-type]
        counter.live.add(req.request_id)
        counter.added += 1
        counter.peak = max(counter.peak, len(counter.live))
        return req

    def counting_finish(req: Request, reason: str | None = None) -> None:
        finish(req, reason)
        counter.live.discard(req.request_id)

    with monkeypatch.context() as m:
        m.setattr(engine, "add_request", counting_add)
        m.setattr(engine, "finish", counting_finish)
        if max_num_seqs is not None:
            m.setattr(llm, "config", dataclasses.replace(llm.config, max_num_seqs=max_num_seqs))
        yield counter


def _tiny_prompts(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[(5 * i + 11 * j) % 240 + 10 for j in range(3 + (i * 7) % 20)] for i in range(n)]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=2 + i % 5, ignore_eos=True) if i % 4 == 3
        else SamplingParams(temperature=0.0, max_tokens=1 + (i * 5) % 9, ignore_eos=i % 2 == 0)
        for i in range(n)
    ]
    return prompts, params


def test_batched_generate_is_bounded_lazy_and_equals_one_at_a_time(
    tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, params = _tiny_prompts(11)
    solo = [tiny_llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    with count_live(tiny_llm, monkeypatch, max_num_seqs=3) as counter:
        batch = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert counter.added == 11 and counter.peak == 3 and not counter.live
    assert [o.prompt_token_ids for o in batch] == prompts  # input order
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in solo]
    assert [o.outputs[0].finish_reason for o in batch] == [o.outputs[0].finish_reason for o in solo]
    assert all(o.finished for o in batch) and len({o.request_id for o in batch}) == 11


def test_generate_iter_streams_results_as_they_finish(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[20, 21, 22], [30, 31], [40, 41, 42, 43], [50]]
    params = [long, long, SamplingParams(temperature=0.0, max_tokens=1), long]
    with count_live(tiny_llm, monkeypatch, max_num_seqs=3) as counter:
        it = tiny_llm.generate_iter(prompts, params)
        assert counter.added == 0  # nothing runs before the first result is asked for
        index, out = next(it)
        assert index == 2 and out.prompt_token_ids == prompts[2] and len(out.outputs[0].token_ids) == 1
        assert counter.added < 4  # the last prompt's request does not exist yet
        rest = dict(it)
    assert sorted(rest) == [0, 1, 3] and all(rest[i].prompt_token_ids == prompts[i] for i in rest)
    assert not counter.live
    with count_live(tiny_llm, monkeypatch) as counter:  # stopping early frees the running requests
        it = tiny_llm.generate_iter(prompts, long)
        next(it)
        it.close()
    assert counter.added > 0 and not counter.live


def test_a_bad_prompt_among_many_fails_before_any_work(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    good = [5, 6, 7]
    with count_live(tiny_llm, monkeypatch) as counter:
        with pytest.raises(TokenleapError, match="prompt 1: the prompt is empty"):
            tiny_llm.generate([good, "", good], GREEDY, use_tqdm=False)
        with pytest.raises(TokenleapError, match="prompt 2: the prompt has 40 tokens but the context length is 32"):
            tiny_llm.generate([good, good, list(range(40))], GREEDY, use_tqdm=False)
        with pytest.raises(TokenleapError, match=r"prompt 1: token ids out of range"):
            list(tiny_llm.generate_iter([good, [1, 300]], GREEDY))
    assert counter.added == 0
    assert tiny_llm.generate([], GREEDY, use_tqdm=False) == []


def test_progress_bar_reports_tokens_per_second(tiny_llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    outs = tiny_llm.generate([[5, 6], [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(outs) == 2
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "tok/s" in err
    tiny_llm.generate([[5, 6], [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def suffix_llm() -> LLM:
    llm = LLM(speculative_config={"method": "suffix"}, max_num_seqs=4)
    # a fixed cost curve (rows nearly free, as measured here up to ~8) instead of half a minute of
    # timing on a loaded machine; drafting then does not depend on the machine's mood
    llm.engine._cost_curve = CostCurve(tuple(1.0 + 0.03 * (n - 1) for n in range(1, 129)))
    return llm


@pytest.mark.slow
@pytest.mark.parametrize("speculation", ["plain", "suffix"])
def test_batched_generate_equals_one_at_a_time_on_the_real_model(
    llm: LLM, questions: list[str], monkeypatch: pytest.MonkeyPatch, speculation: str, request: pytest.FixtureRequest
) -> None:
    """12 prompts of mixed lengths (chat-templated token ids and raw text), one sampling params
    each (greedy of several lengths, a stop string; seeded sampling without speculation): the
    batched outputs, in input order, are the one-at-a-time plain outputs, with at most
    `max_num_seqs` requests holding a cache."""
    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions[:6]]
    raw = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Dear Sir or Madam,", "Once upon a time",
           "The three primary colours are"]
    prompts: list[str | list[int]] = [p for pair in zip(chats, raw) for p in pair]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (i * 5) % 13) for i in range(12)]
    params[3] = SamplingParams(temperature=0.0, max_tokens=16, stop=[","])
    if speculation == "plain":  # seeded sampling is reproducible batched (drafters with cross-request state aside)
        params[5] = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12)
        params[8] = SamplingParams(temperature=1.0, seed=8, max_tokens=9, ignore_eos=True)
    solo = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    target = llm if speculation == "plain" else request.getfixturevalue("suffix_llm")
    with count_live(target, monkeypatch, max_num_seqs=4) as counter:
        batch = target.generate(prompts, params, use_tqdm=False)
    assert counter.added == 12 and counter.peak == 4 and not counter.live
    for i, (b, s) in enumerate(zip(batch, solo)):
        assert b.prompt_token_ids == s.prompt_token_ids and b.prompt == s.prompt, f"prompt {i} out of order"
        assert b.outputs[0].token_ids == s.outputs[0].token_ids, f"prompt {i} differs from its one-at-a-time output"
        assert b.outputs[0].text == s.outputs[0].text and b.outputs[0].finish_reason == s.outputs[0].finish_reason
    if speculation == "suffix":
        assert sum(o.metrics.spec.num_drafts for o in batch) > 0
    chat_batch = target.chat([[{"role": "user", "content": q}] for q in questions[:6]], params[0::2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in chat_batch] == [o.outputs[0].token_ids for o in solo[0::2]]


# --------------------------------------------------------------------------- errors


@pytest.mark.slow
def test_bad_inputs_on_the_real_model(llm: LLM) -> None:
    with pytest.raises(TokenleapError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(TokenleapError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(TokenleapError, match="context length is 8192"):
        llm.generate([[5] * 8192], GREEDY, use_tqdm=False)  # rejected before any compute
    with pytest.raises(TokenleapError, match="out of range"):
        llm.generate([[1, 49152]], GREEDY, use_tqdm=False)
    with pytest.raises(TokenleapError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TokenleapError, match="no messages"):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(TokenleapError, match="role.*content"):
        llm.chat([{"text": "hi"}], GREEDY, use_tqdm=False)
    with pytest.raises(TokenleapError, match="conversation 1: each chat message needs 'role' and 'content'"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"text": "hi"}]], GREEDY, use_tqdm=False)


def test_prompt_longer_than_max_model_len(tiny_llm: LLM) -> None:
    assert tiny_llm.engine.max_context == 32
    with pytest.raises(TokenleapError, match="40 tokens but the context length is 32"):
        tiny_llm.generate([list(range(40))], GREEDY, use_tqdm=False)
    out = tiny_llm.generate(
        [list(range(30))], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"temperature": -1.0}, "temperature")],
)
def test_bad_sampling_params(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(TokenleapError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": "no-such-model"}, ModelNotFoundError, "unknown model 'no-such-model'"),
        ({"model": "/nonexistent/model.gguf"}, ModelNotFoundError, "GGUF file not found"),
        ({"dtype": "float16"}, TokenleapError, "dtype must be one of"),
        ({"max_model_len": 1}, TokenleapError, "max_model_len must be >= 2"),
        ({"max_num_seqs": 0}, TokenleapError, "max_num_seqs must be an integer >= 1"),
        ({"speculative_config": {"method": "bogus"}}, TokenleapError, "unknown speculative method 'bogus'"),
    ],
)
def test_bad_llm_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        LLM(**kwargs)  # type: ignore[arg-type]


def test_public_api() -> None:
    for name in ("LLM", "SamplingParams", "EngineConfig", "TokenleapError", "RequestOutput", "CompletionOutput"):
        assert hasattr(tokenleap, name)
    assert issubclass(TokenleapError, ValueError)


# --------------------------------------------------------------------------- losslessness of verification


@pytest.mark.slow
def test_bf16_greedy_output_is_reproduced_by_chunked_verification(
    llm: LLM, questions: list[str], kernels: CpuKernels
) -> None:
    """Feed the engine's own bf16 greedy output back in chunks of 1..6 tokens (as a verifier with
    a perfect drafter would): every row's argmax must be the next generated token, so greedy
    speculative decoding can reproduce plain decoding exactly."""
    model = llm.model
    assert model.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for q_index, question in enumerate(questions[:3]):
        conv = [{"role": "user", "content": question}]
        out = llm.chat(conv, params, use_tqdm=False)[0]
        prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
        assert len(generated) == 24
        kv = model.new_kv_cache()
        hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), kv).hidden
        assert int(model.compute_logits(hidden, [len(prompt) - 1])[0].argmax()) == generated[0]
        i, size = 0, 1 + q_index  # different chunkings for different prompts
        while i < len(generated) - 1:
            chunk = generated[i : i + size]
            assert len(chunk) <= ROW_PATH_MAX_ROWS
            pos = torch.arange(kv.length, kv.length + len(chunk))
            logits = model.compute_logits(model.forward(torch.tensor(chunk), pos, kv).hidden)
            predicted = logits.argmax(-1).tolist()
            expected = generated[i + 1 : i + 1 + len(chunk)]
            assert predicted[: len(expected)] == expected, f"prompt {q_index}, tokens {i + 1}.."
            i += len(chunk)
            size = size % 6 + 1


def test_vllm_prompt_dicts_stop_strings_and_special_tokens(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The capital of France is")
    p = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The capital of France is"}, ids], p, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    with pytest.raises(TokenleapError, match="unsupported prompt key"):
        llm.generate({"prompt_ids": ids}, p, use_tqdm=False)
    with pytest.raises(TokenleapError, match="list of integers"):
        llm.generate({"prompt_token_ids": "abc"}, p, use_tqdm=False)
    text = outs[0].outputs[0].text
    stop = text.strip().split()[0]  # a word the greedy answer contains
    cut = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, stop=[stop]), use_tqdm=False
    )[0]
    kept = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(temperature=0, max_tokens=8, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == cut.outputs[0].text + stop
    # the chat end token: without skipping special tokens it shows in the text (stop_token_ids
    # would end the request on it, so generate past it as a plain token with ignore_eos)
    chat_ids = llm.chat_token_ids([{"role": "user", "content": "Say OK."}])
    eos = sorted(llm.tokenizer.eos_token_ids)[0]
    forced = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    raw = llm.generate([chat_ids], dataclasses.replace(forced, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    clean = llm.generate([chat_ids], forced, use_tqdm=False)[0].outputs[0]
    assert raw.token_ids == clean.token_ids and eos in raw.token_ids  # the answer ends, then a new turn starts
    special = llm.tokenizer.hf.convert_ids_to_tokens(eos)
    assert special in raw.text and special not in clean.text


def test_parallel_sampling_shares_the_prefill_and_equals_separate_seeded_requests(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = ["Once upon a time", "Write a haiku about rain."]
    params = SamplingParams(n=3, temperature=0.8, max_tokens=12, seed=5, logprobs=1)
    prefill_rows: list[int] = []
    real = llm.model.forward

    def counting(input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, *a: Any, **k: Any) -> ModelOutput:
        if int(positions[0]) == 0:
            prefill_rows.append(int(input_ids.shape[0]))
        return real(input_ids, positions, kv, *a, **k)

    monkeypatch.setattr(llm.model, "forward", counting)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(prefill_rows) == 2  # one prefill per prompt, not per sample
    monkeypatch.undo()
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
        for i, c in enumerate(out.outputs):
            alone = llm.generate([prompt], dataclasses.replace(params, n=1, seed=5 + i), use_tqdm=False)[0].outputs[0]
            assert c.token_ids == alone.token_ids and c.text == alone.text and c.logprobs == alone.logprobs
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # sampled apart
    # with speculation (which draws its own random numbers: other texts, same distribution), and
    # fewer seats than samples in all: still sample i == a request seeded seed + i alone
    spec = LLM(speculative_config={"method": "ngram"}, max_num_seqs=4)
    out = spec.generate(prompts[:1], params, use_tqdm=False)[0]
    for i, c in enumerate(out.outputs):
        alone = spec.generate(prompts[:1], dataclasses.replace(params, n=1, seed=5 + i), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
    with pytest.raises(TokenleapError, match="n must be"):
        SamplingParams(n=0)
