"""Drafter protocol, registry and check_drafter; a user's custom drafter plugged into tokenleap.LLM end to end."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import tokenleap
from tokenleap import SpecConfig
from tokenleap.bench import default_spec_bench
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Draft, Drafter, DrafterRegistry, DraftRequest, StatelessDrafter, check_drafter
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams
from tokenleap.types import RequestOutput

SPEC_BENCH = default_spec_bench()  # ../shared/bench beside the checkout, else the shipped subset
VOCAB = 49152  # SmolLM2


class FullDrafter:
    """A user object with the four protocol methods and nothing else (no tokenleap base class)."""

    def begin(self, request: DraftRequest) -> None: ...
    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        return Draft()
    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None: ...
    def end(self, request_id: str) -> None: ...


class NoAcceptOrEnd:
    def begin(self, request: DraftRequest) -> None: ...
    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        return Draft()


class NotCallable(FullDrafter):
    propose = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- fast: registry, protocol


def test_registry_unknown_name_lists_known_names() -> None:
    registry = default_registry()
    with pytest.raises(TokenleapError, match="'lookahead'") as err:
        registry.create("lookahead", SpecConfig("ngram"))
    message = str(err.value)
    assert registry.names(), "the default registry is empty"
    for name in registry.names():
        assert name in message


def test_default_registry_has_builtin_methods_and_is_fresh() -> None:
    a, b = default_registry(), default_registry()
    assert {"ngram", "custom"} <= set(a.names())
    a.register("mine", lambda config, **_: FullDrafter())
    assert "mine" in a.names() and "mine" not in b.names()  # no shared module-level state


def test_registry_create_passes_config_and_context() -> None:
    seen: dict[str, Any] = {}

    def factory(config: Any, **context: Any) -> Drafter:
        seen.update(config=config, **context)
        return FullDrafter()

    registry = DrafterRegistry()
    registry.register("x", factory)
    drafter = registry.create("x", "cfg", target="T", tokenizer="tok")
    assert isinstance(drafter, FullDrafter)
    assert seen == {"config": "cfg", "target": "T", "tokenizer": "tok"}
    assert registry.names() == ["x"]


def test_registry_creates_ngram_with_configured_sizes() -> None:
    drafter = default_registry().create("ngram", SpecConfig("ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    assert isinstance(drafter, NgramDrafter)
    assert (drafter.n_min, drafter.n_max) == (2, 3)


def test_check_drafter_names_missing_methods() -> None:
    with pytest.raises(TokenleapError, match="NoAcceptOrEnd") as err:
        check_drafter(NoAcceptOrEnd())
    message = str(err.value)
    assert "accept" in message and "end" in message
    assert "begin" not in message.split("lacks")[-1].split("of the")[0]  # only the missing ones are named
    assert "Drafter protocol" in message


def test_check_drafter_rejects_non_callable_and_plain_objects() -> None:
    with pytest.raises(TokenleapError, match="propose"):
        check_drafter(NotCallable())
    with pytest.raises(TokenleapError, match="begin, propose, accept, end"):
        check_drafter(object())


def test_check_drafter_returns_a_valid_object_itself() -> None:
    obj = FullDrafter()
    assert check_drafter(obj) is obj


def test_custom_method_goes_through_check_drafter() -> None:
    obj = FullDrafter()
    assert default_registry().create("custom", SpecConfig("custom", drafter=obj)) is obj
    with pytest.raises(TokenleapError, match="lacks method"):
        default_registry().create("custom", SpecConfig("custom", drafter=NoAcceptOrEnd()))


def test_draft_defaults_to_an_empty_deterministic_chain() -> None:
    draft = Draft()
    assert len(draft) == 0 and draft.tokens == [] and draft.parents is None and draft.probs is None
    assert len(Draft([4, 5, 6])) == 3


def test_stateless_drafter_lifecycle_is_a_no_op() -> None:
    drafter = NgramDrafter()
    assert isinstance(drafter, StatelessDrafter)
    request = DraftRequest("r", [1, 2], SamplingParams(), torch.Generator())
    assert drafter.begin(request) is None
    assert drafter.accept("r", [1], 1) is None
    assert drafter.end("r") is None


def test_builtin_drafter_satisfies_the_protocol() -> None:
    drafter = NgramDrafter()
    assert isinstance(drafter, Drafter)
    assert check_drafter(drafter) is drafter


# --------------------------------------------------------------------------- slow: custom drafter end to end


class UserDrafter:
    """A user's drafter: proposals come from a swappable strategy; the lifecycle is recorded."""

    def __init__(self) -> None:
        self.strategy: Callable[[list[int], list[int], int], Draft] = lambda prompt, output, k: Draft()
        self.prompts: dict[str, list[int]] = {}
        self.log: list[tuple[Any, ...]] = []

    def begin(self, request: DraftRequest) -> None:
        self.prompts[request.request_id] = list(request.prompt_ids)
        self.log.append(("begin", request.request_id))

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        prompt = self.prompts[request_id]
        tokens = list(tokens)
        assert tokens[: len(prompt)] == prompt
        draft = self.strategy(prompt, tokens[len(prompt) :], max_tokens)
        self.log.append(("propose", request_id, len(tokens), max_tokens, len(draft)))
        return draft

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        self.log.append(("accept", request_id, list(tokens), num_accepted))

    def end(self, request_id: str) -> None:
        self.prompts.pop(request_id)
        self.log.append(("end", request_id))

    def reset(self, strategy: Callable[[list[int], list[int], int], Draft]) -> None:
        self.strategy = strategy
        self.log.clear()


def _questions() -> list[str]:
    if not SPEC_BENCH.is_file():
        pytest.skip("Spec-Bench questions not present")
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    picked = [next(r for r in rows if r["category"] == c)["turns"][0] for c in ("coding", "qa")]
    return picked


@pytest.fixture(scope="module")
def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in _questions()]


@pytest.fixture(scope="module")
def plain_llm() -> tokenleap.LLM:
    return tokenleap.LLM(dtype="bfloat16")


@pytest.fixture(scope="module")
def user_drafter() -> UserDrafter:
    return UserDrafter()


@pytest.fixture(scope="module")
def custom_llm(user_drafter: UserDrafter) -> tokenleap.LLM:
    # fixed draft length (no adaptive controller), so acceptance statistics are deterministic
    return tokenleap.LLM(dtype="bfloat16", speculative_config={"method": "custom", "drafter": user_drafter,
                                                               "num_speculative_tokens": 8, "adaptive": False})


GREEDY_48 = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def plain_outputs(plain_llm: tokenleap.LLM, conversations: list[list[dict[str, str]]]) -> list[RequestOutput]:
    return [plain_llm.chat(conv, GREEDY_48, use_tqdm=False)[0] for conv in conversations]


def _continuation(reference: list[int], pad_to: int | None = None) -> Callable[[list[int], list[int], int], Draft]:
    """Propose the reference output's next tokens (padded with junk to pad_to tokens if given)."""

    def strategy(prompt: list[int], output: list[int], k: int) -> Draft:
        assert output == reference[: len(output)], "the speculative output left the reference"
        tokens = reference[len(output) : len(output) + (pad_to or k)]
        if pad_to is not None:
            tokens += [17] * (pad_to - len(tokens))
        return Draft(tokens)

    return strategy


@pytest.mark.slow
def test_perfect_custom_drafter_is_always_accepted(
    custom_llm: tokenleap.LLM,
    user_drafter: UserDrafter,
    conversations: list[list[dict[str, str]]],
    plain_outputs: list[RequestOutput],
) -> None:
    for conv, plain in zip(conversations, plain_outputs):
        reference = plain.outputs[0].token_ids
        user_drafter.reset(_continuation(reference))
        out = custom_llm.chat(conv, GREEDY_48, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference
        assert out.outputs[0].text == plain.outputs[0].text
        assert out.outputs[0].finish_reason == plain.outputs[0].finish_reason
        stats = out.metrics.spec
        assert stats.num_draft_tokens > 0
        assert stats.acceptance_rate == 1.0
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert out.metrics.mean_acceptance_length > 4.0  # ~9 tokens per forward with 8-token drafts

        # lifecycle: begin once, end once, one accept per target step, tokens in order
        log = user_drafter.log
        assert [e[0] for e in log].count("begin") == 1 and log[0][0] == "begin"
        assert log[-1][0] == "end" and [e[0] for e in log].count("end") == 1
        accepts = [e for e in log if e[0] == "accept"]
        assert len(accepts) == out.metrics.num_forward_passes
        committed = [t for e in accepts for t in e[2]]
        assert committed[: len(reference) - 1] == reference[1:]
        assert all(e[3] == len(e[2]) - 1 for e in accepts)  # all drafted tokens accepted + one more
        proposes = [e for e in log if e[0] == "propose"]
        assert proposes[0][2] == len(out.prompt_token_ids) + 1  # context = prompt + first token
        assert all(1 <= e[3] <= 8 for e in proposes)


@pytest.mark.slow
def test_garbage_custom_drafter_keeps_output_with_low_acceptance(
    custom_llm: tokenleap.LLM,
    user_drafter: UserDrafter,
    conversations: list[list[dict[str, str]]],
    plain_outputs: list[RequestOutput],
) -> None:
    rng = random.Random(0)
    user_drafter.reset(lambda prompt, output, k: Draft([rng.randrange(1000, VOCAB) for _ in range(k)]))
    for conv, plain in zip(conversations, plain_outputs):
        out = custom_llm.chat(conv, GREEDY_48, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert out.outputs[0].text == plain.outputs[0].text
        stats = out.metrics.spec
        assert stats.num_draft_tokens >= 8 * 10
        assert stats.acceptance_rate < 0.1
        if out.outputs[0].finish_reason == "length":
            assert out.metrics.num_generation_tokens - 1 == out.metrics.num_forward_passes + stats.num_accepted_tokens


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 20])
def test_overlong_drafts_are_cut_to_the_budget(
    custom_llm: tokenleap.LLM,
    user_drafter: UserDrafter,
    conversations: list[list[dict[str, str]]],
    plain_outputs: list[RequestOutput],
    max_tokens: int,
) -> None:
    reference = plain_outputs[0].outputs[0].token_ids
    assert len(reference) >= 20
    user_drafter.reset(_continuation(reference, pad_to=31))  # ignores max_tokens
    out = custom_llm.chat(conversations[0], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[:max_tokens]
    assert out.outputs[0].finish_reason == "length"
    stats = out.metrics.spec
    assert (
        stats.num_draft_tokens == stats.num_accepted_tokens == max(0, max_tokens - 1 - out.metrics.num_forward_passes)
    )
    proposes = [e for e in user_drafter.log if e[0] == "propose"]
    assert all(e[4] == 31 and e[3] < 31 for e in proposes)  # every proposal was longer than its budget
    assert all(len(e[2]) <= e[3] + 1 for e in user_drafter.log if e[0] == "accept")


@pytest.mark.slow
def test_stop_inside_an_accepted_draft_counts_only_committed_tokens(
    custom_llm: tokenleap.LLM,
    user_drafter: UserDrafter,
    conversations: list[list[dict[str, str]]],
    plain_outputs: list[RequestOutput],
) -> None:
    """The first step accepts an 8-token draft, but a stop token sits at its j-th token: the tokens
    after it are never emitted, so they must not count as committed (accepted) tokens either."""
    reference = plain_outputs[0].outputs[0].token_ids
    j = next(i for i in range(3, 8) if reference[i] not in reference[:i])
    user_drafter.reset(_continuation(reference))
    params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=(reference[j],))
    out = custom_llm.chat(conversations[0], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[:j]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", reference[j])
    m = out.metrics
    assert m.num_forward_passes == 1
    assert m.num_decode_tokens == j  # reference[1..j]: the stop token is committed, nothing after it
    assert m.num_decode_tokens == m.num_forward_passes + m.spec.num_accepted_tokens
    assert m.mean_acceptance_length == j


@pytest.mark.slow
def test_empty_custom_drafter_reproduces_plain_sampling(
    custom_llm: tokenleap.LLM,
    user_drafter: UserDrafter,
    plain_llm: tokenleap.LLM,
    conversations: list[list[dict[str, str]]],
) -> None:
    user_drafter.reset(lambda prompt, output, k: Draft())
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=32)
    spec = custom_llm.chat(conversations[1], params, use_tqdm=False)[0]
    plain = plain_llm.chat(conversations[1], params, use_tqdm=False)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.metrics.spec.num_draft_tokens == 0


@pytest.mark.slow
def test_probabilistic_custom_drafter_runs_and_is_reproducible(
    custom_llm: tokenleap.LLM,
    user_drafter: UserDrafter,
    plain_llm: tokenleap.LLM,
    conversations: list[list[dict[str, str]]],
) -> None:
    top = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)

    def make_strategy(seed: int) -> Callable[[list[int], list[int], int], Draft]:
        g = torch.Generator().manual_seed(seed)

        def strategy(prompt: list[int], output: list[int], k: int) -> Draft:
            # q for the first draft token: the target's own top-20 next-token distribution at
            # this point (mixed with 0.1 uniform), so acceptance never hangs on one lucky draw
            # (a q aimed at the greedy reference accepted nothing once the sampled output left
            # that reference at its first token); later tokens: q peaked on token 17, rarely
            # accepted. The tokens really are drawn from q, as losslessness requires.
            n = min(k, 4)
            probs = torch.full((n, VOCAB), 0.1 / VOCAB)
            nxt = (
                plain_llm.generate({"prompt_token_ids": prompt + output}, top, use_tqdm=False)[0].outputs[0].logprobs[0]
            )
            p = torch.tensor([lp.logprob for lp in nxt.values()]).softmax(0)
            probs[0, list(nxt)] += 0.9 * p
            probs[1:, 17] += 0.9
            tokens = [int(torch.multinomial(probs[i], 1, generator=g)) for i in range(n)]
            return Draft(tokens, None, probs)

        return strategy

    params = SamplingParams(temperature=0.7, seed=7, max_tokens=24)
    runs = []
    for _ in range(2):
        user_drafter.reset(make_strategy(99))
        runs.append(custom_llm.chat(conversations[1], params, use_tqdm=False)[0])
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
    out = runs[0]
    assert len(out.outputs[0].token_ids) == 24 or out.outputs[0].finish_reason == "stop"
    stats = out.metrics.spec
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


def test_drafters_declare_their_capabilities() -> None:
    """What the engine, the chain and Ray ask of a drafter is a declared protocol in base.py,
    not a probe by attribute name (issue 23 item 2)."""
    from tokenleap.drafters import base
    from tokenleap.drafters.chain import ChainDrafter
    from tokenleap.drafters.ngram import NgramDrafter
    from tokenleap.drafters.ngram_cache import NgramCacheDrafter
    from tokenleap.drafters.ngram_mod import NgramModDrafter
    from tokenleap.drafters.suffix import SuffixDrafter

    suffix, mod, cache, ngram = SuffixDrafter(), NgramModDrafter(3, 1 << 10), NgramCacheDrafter(), NgramDrafter()
    assert isinstance(suffix, base.LearnsAcrossRequests) and isinstance(suffix, base.GlobalStatistics)
    assert suffix.global_size() == len(suffix.global_tree)
    assert isinstance(mod, base.SharedStore) and mod.shared_store is mod.pool
    assert isinstance(cache, base.SharedStore) and cache.shared_store is cache.dynamic
    assert not isinstance(ngram, base.LearnsAcrossRequests) and not isinstance(suffix, base.SharedStore)
    chain = ChainDrafter([ngram, suffix])
    assert isinstance(chain, base.WeighsCost) and isinstance(chain, base.LearnsAcrossRequests)
    assert base.draft_cost_of(ngram) == 0.0 and base.hidden_layers_of(ngram) == () and base.hidden_layers_of(None) == ()
