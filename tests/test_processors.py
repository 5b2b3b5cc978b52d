"""Context processors (penalties, min_tokens) against independent references, vLLM v1's sampler
order, and losslessness with them: greedy speculation equals plain decoding on the real model,
sampled speculation keeps the processed target distribution (chi-squared, tiny model)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from sampling_stats import exact_joint, first_three, fit_pvalue
from tokenleap import LLM, SpecConfig
from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.models.llama import LlamaModel
from tokenleap.processors import needs_processing, process_rows, row_prefixes
from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.tokenizer import Tokenizer


def _reference(
    logits: list[float], params: SamplingParams, prompt: Sequence[int], output: Sequence[int], stop_ids: set[int]
) -> list[float]:
    """One row, element by element, straight from the definitions."""
    out = list(logits)
    if len(output) < params.min_tokens:
        for t in stop_ids:
            out[t] = -math.inf
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        c = list(output).count(t)
        out[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return out


def test_rows_match_the_reference_along_a_chain_and_a_tree() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 3
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                            min_tokens=4, max_tokens=10)
    prompt, output, stop = [1, 2, 3], [4, 4, 5], {0, 7}
    for draft, parents in (([4, 6, 6], None), ([6, 4, 9], [-1, -1, 1])):
        prefixes = row_prefixes(draft, parents)
        got = process_rows(logits, params, prompt, output, prefixes, stop)
        for r, prefix in enumerate(prefixes):
            ref = _reference(logits[r].tolist(), params, prompt, output + prefix, stop)
            assert torch.allclose(got[r], torch.tensor(ref), atol=1e-6), (draft, parents, r)
    assert row_prefixes([6, 4, 9], [-1, -1, 1]) == [[], [6], [4], [4, 9]]
    assert not needs_processing(SamplingParams()) and needs_processing(SamplingParams(min_tokens=1))


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=g) * 2
    prompt, output = [3, 9, 9, 14], [20, 3, 41]
    params = SamplingParams(repetition_penalty=1.7)
    got = process_rows(logits, params, prompt, output, [[]], set())
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(got, ref, atol=1e-6)


def test_min_p_applies_before_top_p_as_in_vllm() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = logits_to_probs(logits, SamplingParams(min_p=0.3, top_p=0.75))[0]
    # min-p first drops 0.1 (< 0.3 * 0.4); top-p over the renormalised [0.44, 0.33, 0.22] keeps two.
    # (top-p first would keep three: the old order)
    assert (probs > 0).tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
        {"repetition_penalty": float("nan")}, {"min_tokens": -1}, {"min_tokens": 20, "max_tokens": 10}
    ],
)
def test_bad_values_are_clear_errors(bad: dict) -> None:
    with pytest.raises(TokenleapError):
        SamplingParams(**bad)


def test_greedy_speculation_with_penalties_is_plain_decoding(llm: LLM) -> None:
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    prompts = ["List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,", "Write a short poem about the sea."]
    for extra in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.8, "frequency_penalty": 0.4}, {"min_tokens": 40}):
        params = SamplingParams(temperature=0.0, max_tokens=48, **extra)
        a = llm.generate(prompts, params, use_tqdm=False)
        b = spec.generate(prompts, params, use_tqdm=False)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids, extra
        if "min_tokens" in extra:
            assert all(len(x.outputs[0].token_ids) >= 40 for x in a)
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
        # they did something
        assert any(p.outputs[0].token_ids != x.outputs[0].token_ids for p, x in zip(plain, a)), extra
    assert sum(o.metrics.spec.num_accepted_tokens for o in b) > 0


class Table(StatelessDrafter):
    """Proposes a fixed continuation per generated prefix (a deterministic draft)."""

    name = "table"

    def __init__(self, prompt_len: int, table: dict[tuple[int, ...], list[int]]) -> None:
        self.prompt_len, self.table = prompt_len, table

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        return Draft(self.table.get(tuple(tokens[self.prompt_len :]), [])[:max_tokens])


def test_sampled_speculation_with_penalties_keeps_the_distribution(
    tiny_model: LlamaModel, tokenizer: Tokenizer
) -> None:
    prompt = [17, 42, 99, 5, 200]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=8, ignore_eos=True, repetition_penalty=1.5,
                            presence_penalty=1.0, frequency_penalty=0.5)

    def probs(ctx: list[int]) -> torch.Tensor:
        kv = tiny_model.new_kv_cache(64)
        ids = prompt + ctx
        out = tiny_model.forward(torch.tensor(ids), torch.arange(len(ids)), kv)
        raw = tiny_model.compute_logits(out.hidden, [len(ids) - 1])[0].tolist()
        kv.free()
        return logits_to_probs(torch.tensor([_reference(raw, params, prompt, ctx, set())]), params)[0].double()

    joint = exact_joint(probs)
    # after the first token (sampled at prefill), draft the likeliest two next tokens, so drafts get accepted
    table: dict[tuple[int, ...], list[int]] = {}
    for (a, b, c), pr in joint.items():
        if (a,) not in table or joint[(a, *table[(a,)])] < pr:
            table[(a,)] = [b, c]
    drafter = Table(len(prompt), table)
    engine = Engine(
        tiny_model,
        tokenizer,
        spec=SpecConfig(method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=2),
        drafter=drafter,
    )
    counts = dict.fromkeys(joint, 0)
    n, accepted = 1500, 0
    for seed in range(n):
        out, acc = first_three(engine, prompt, params, seed)
        assert out in counts, f"an impossible output {out}"
        counts[out] += 1
        accepted += acc
    pvalue, report = fit_pvalue(counts, joint)
    assert pvalue >= 1e-3, report
    assert accepted > 0.2 * n


def test_logprobs_of_drafted_tokens_equal_plain_decoding(llm: LLM) -> None:
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=3)
    prompt = "List: a b c a b c a b c a b c"
    a = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    b = out.outputs[0]
    assert out.metrics.spec.num_accepted_tokens > 3 and a.token_ids == b.token_ids
    assert len(b.logprobs) == len(b.token_ids)
    for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs):
        assert x == y  # bit-identical rows: same figures, ranks and texts
        assert x[t].rank == 1 and len(x) == 3  # greedy: the chosen token is the top one
    assert b.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(b.token_ids, b.logprobs)))
    assert llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].logprobs is None


def test_token_logprobs_reference() -> None:
    from tokenleap.processors import token_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 1.0]])
    got = token_logprobs(logits, [2, 1], 2, str)
    lp = torch.log_softmax(logits, dim=-1)
    assert set(got[0]) == {2, 0, 1} and got[0][2].rank == 3 and got[0][2].logprob == pytest.approx(float(lp[0, 2]))
    assert set(got[1]) == {1, 3} and got[1][1].rank == 1 and got[1][3].rank == 2 and got[1][3].decoded_token == "3"
