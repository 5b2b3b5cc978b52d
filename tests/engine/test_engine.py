"""Engine: request validation, greedy / sampled decoding loop, context limit, streaming and metrics (tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer

PROMPT = [17, 42, 99, 5, 200]


@pytest.fixture
def engine(tiny_model: LlamaModel, tokenizer: Tokenizer) -> Engine:
    return Engine(tiny_model, tokenizer)


def test_add_request_rejects_bad_prompts(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    engine = Engine(tiny_model, tokenizer, max_model_len=16)
    assert engine.max_context == 16
    params = SamplingParams()
    with pytest.raises(TokenleapError, match="empty"):
        engine.add_request([], params)
    with pytest.raises(TokenleapError, match="out of range"):
        engine.add_request([1, 256], params)
    with pytest.raises(TokenleapError, match="out of range"):
        engine.add_request([-1], params)
    with pytest.raises(TokenleapError, match="16 tokens but the context length is 16"):
        engine.add_request(list(range(16)), params)
    req = engine.add_request(list(range(15)), params)  # one slot left: fine
    assert req.max_context == 16


def test_max_model_len_capped_by_model(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    assert Engine(tiny_model, tokenizer, max_model_len=10_000).max_context == tiny_model.max_context == 128
    assert Engine(tiny_model, tokenizer).max_context == 128


def test_request_ids_are_unique(engine: Engine) -> None:
    ids = {engine.add_request(PROMPT, SamplingParams()).request_id for _ in range(5)}
    assert len(ids) == 5
    assert engine.add_request(PROMPT, SamplingParams(), request_id="mine").request_id == "mine"


def _naive_greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    """Recompute the whole sequence from scratch for every token: no cache reuse at all."""
    seq = list(prompt)
    for _ in range(n):
        kv = model.new_kv_cache()
        hidden = model.forward(torch.tensor(seq), torch.arange(len(seq)), kv).hidden
        seq.append(int(model.compute_logits(hidden, [len(seq) - 1])[0].argmax()))
    return seq[len(prompt) :]


def test_greedy_decoding_matches_naive_recompute(engine: Engine, tiny_model: LlamaModel, kernels: CpuKernels) -> None:
    """Exact with the row-invariant kernels: a multi-row forward computes each row as one row does."""
    req = engine.run(engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    assert req.finish_reason == "length"
    assert len(req.output_ids) == 20
    assert req.output_ids == _naive_greedy(tiny_model, PROMPT, 20)
    assert len(set(req.output_ids)) > 3  # not a degenerate constant output


def test_chunked_prefill(tiny_model: LlamaModel, tokenizer: Tokenizer, kernels: CpuKernels) -> None:
    """The prompt runs in `prefill_chunk`-token pieces at fixed offsets; greedy output is still
    the naive recompute's (the tiny prompt fits the row-invariant path in every chunk)."""
    engine = Engine(tiny_model, tokenizer, prefill_chunk=4)
    prompt = PROMPT * 2
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    engine.begin(req)
    lengths = []
    while not engine.prefill_step(req):
        lengths.append(req.kv.length)
        assert not req.output_ids
    assert lengths == list(range(4, len(prompt), 4))
    assert req.kv.length == len(prompt) and len(req.output_ids) == 1 and req.metrics.prefill_seconds > 0
    while not req.finished:
        engine.step(req)
    engine.finish(req)
    assert req.output_ids == _naive_greedy(tiny_model, prompt, 10)
    with pytest.raises(TokenleapError, match="prefill_chunk"):
        Engine(tiny_model, tokenizer, prefill_chunk=0)


def test_greedy_is_deterministic(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = engine.run(engine.add_request(PROMPT, params)).output_ids
    b = engine.run(engine.add_request(PROMPT, params)).output_ids
    assert a == b


def test_seeded_sampling(engine: Engine) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return engine.run(engine.add_request(PROMPT, params)).output_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_context_limit_ends_with_length(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    engine = Engine(tiny_model, tokenizer, max_model_len=12)
    req = engine.run(engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
    assert req.finish_reason == "length"
    assert req.num_tokens == 12
    assert len(req.output_ids) == 12 - len(PROMPT)


def test_prompt_filling_context_but_one(tiny_model: LlamaModel, tokenizer: Tokenizer) -> None:
    engine = Engine(tiny_model, tokenizer, max_model_len=40)
    prompt = [(7 * i) % 256 for i in range(39)]  # 39 tokens: prefill on the batch path
    req = engine.run(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    assert len(req.output_ids) == 1 and req.finish_reason == "length"


def test_stream_deltas_and_metrics(engine: Engine) -> None:
    req = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True))
    deltas = list(engine.stream(req))
    assert "".join(deltas) == req.text
    assert all(deltas)  # no empty deltas are yielded
    m = req.metrics
    assert m.num_prompt_tokens == len(PROMPT)
    assert m.num_generation_tokens == 15
    assert m.num_forward_passes == 14  # the first token comes from the prefill
    assert m.prefill_seconds > 0 and m.decode_seconds > 0
    assert m.first_token_time is not None and m.finished_time is not None
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert req.kv.length == 0  # the cache is released when the request ends
    out = req.to_output()
    assert out.finished and out.prompt_token_ids == PROMPT
    assert out.outputs[0].token_ids == req.output_ids and out.outputs[0].finish_reason == "length"


def test_kv_released_when_stream_abandoned(engine: Engine) -> None:
    req = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    stream = engine.stream(req)
    next(stream)
    assert req.kv.length > 0
    stream.close()
    assert req.kv.length == 0 and req.metrics.finished_time is not None


# --------------------------------------------------------------------------- cost curve


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """The caps the engine measures cost curves for (the real measurement runs: tiny model)."""
    import tokenleap.engine.engine as engine_module
    import tokenleap.engine.speculation as speculation

    caps: list[int] = []
    real = engine_module.cached_cost_curve

    def spy(model: LlamaModel, cap: int, *args: object, **kwargs: object) -> object:
        caps.append(cap)
        return real(model, cap, *args, **kwargs)

    monkeypatch.setattr(speculation, "cache_dir", lambda: tmp_path)  # no curve from an earlier run on disk
    monkeypatch.setattr(engine_module, "cached_cost_curve", spy)
    return caps


def test_cost_curve_is_measured_once_and_never_again_for_a_larger_cap(tiny_model: LlamaModel, tokenizer: Tokenizer,
                                                                     measured: list[int]) -> None:
    """The curve is measured on first need; a request with a larger cap later extrapolates it
    rather than stalling every running request for a new measurement."""
    from tokenleap import SpecConfig
    from tokenleap.drafters import default_registry

    registry = default_registry()
    engine = Engine(tiny_model, tokenizer, drafter_factory=lambda spec: registry.create(spec.method, spec))
    engine.add_request(PROMPT, SamplingParams(), speculative=SpecConfig(method="ngram", num_speculative_tokens=4))
    assert measured == [16]  # at least the default cap, so later requests rarely go past it
    curve = engine.cost_curve()
    for cap in (8, 24, 31):
        req = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6),
                                 speculative=SpecConfig(method="ngram", num_speculative_tokens=cap))
        engine.run(req)
    assert measured == [16] and engine.cost_curve() is curve
    assert curve.cost(31) >= curve.cost(16)  # past the measured rows: extrapolated
    engine.ensure_cost_curve(20)  # an explicit measurement for a larger cap (a server, at start)
    assert measured == [16, 20] and engine.cost_curve(31) is engine.ensure_cost_curve(12)


def test_steps_run_torch_single_threaded_beside_the_kernels(
    tiny_model: LlamaModel, tokenizer: Tokenizer, kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's torch ops (sampling, verification) run on one torch thread while the kernels'
    pool holds the cores (torch's OpenMP workers would spin beside it: decoding measured 2.2x
    slower when torch was imported before tokenleap), and the caller's setting comes back."""
    import tokenleap.engine.engine as engine_module

    seen: list[int] = []
    real_sample, real_verify = engine_module.sample_next, engine_module.verify_chain

    def sample(*args: object, **kwargs: object) -> int:
        seen.append(torch.get_num_threads())
        return real_sample(*args, **kwargs)  # type: ignore[arg-type]

    def verify(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return real_verify(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "sample_next", sample)
    monkeypatch.setattr(engine_module, "verify_chain", verify)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(tiny_model, tokenizer)
        req = engine.run(engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=4)))
        assert len(req.output_ids) == 4
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
