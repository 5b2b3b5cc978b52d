"""Token-tree drafts through the engine on the real model: greedy output equals plain decoding,
the KV cache keeps only the accepted path, sampled requests verify the whole tree (or, with
`sampled_tree="first-path"`, its first path)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import tokenleap
from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "List the first ten prime numbers, then explain what a prime number is."}]


class DecoyTreeDrafter(StatelessDrafter):
    """Knows the plain answer; proposes a tree whose first branch is wrong (a decoy token and
    its child) and whose second branch is the next 3 true tokens, with a repeated sibling."""

    name = "decoy-tree"

    def __init__(self, prompt_len: int, answer: Sequence[int]) -> None:
        self.prompt_len, self.answer = prompt_len, list(answer)
        self.trees = 0

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        done = len(tokens) - self.prompt_len
        truth = self.answer[done : done + 3]
        if len(truth) < 3:
            return Draft()
        self.trees += 1
        decoy = (truth[0] + 1) % 49152
        # nodes: 0 decoy, 1 decoy's child, 2 truth[0], 3 truth[1] (child of 2), 4 truth[0] again
        # (a repeated root sibling, no children), 5 truth[2] (child of 3)
        return Draft([decoy, truth[1], truth[0], truth[1], truth[0], truth[2]], [-1, 0, -1, 2, -1, 3])


def test_tree_drafts_give_plain_output_in_fewer_forwards() -> None:
    plain_llm = tokenleap.LLM()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = plain_llm.chat(PROMPT, params, use_tqdm=False)[0]
    answer = list(plain.outputs[0].token_ids)
    drafter = DecoyTreeDrafter(len(plain.prompt_token_ids), answer)
    spec_llm = tokenleap.LLM(
        speculative_config={"method": "custom", "drafter": drafter, "adaptive": False, "num_speculative_tokens": 8}
    )
    out = spec_llm.chat(PROMPT, params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == answer
    stats = out.metrics.spec
    assert drafter.trees > 5
    # every tree holds the next 3 true tokens on its second branch: 4 tokens per forward
    assert out.metrics.num_forward_passes <= 1 + -(-64 // 4) + 2
    assert stats.num_accepted_tokens >= 3 * (drafter.trees - 1)
    # positions count tree depth (3 at most here), not nodes
    assert stats.drafted_per_position[0] == stats.num_drafts and len(stats.drafted_per_position) == 3


def test_sampled_requests_verify_the_whole_tree_or_its_first_path() -> None:
    """The first path is the decoy: with `sampled_tree="first-path"` nothing is accepted from it
    (2 positions reached); the full tree accepts from the second branch (3 positions). Both
    runs are well formed and seeded runs repeat."""
    plain = tokenleap.LLM().chat(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )[0]
    drafter = DecoyTreeDrafter(len(plain.prompt_token_ids), list(plain.outputs[0].token_ids))
    params = SamplingParams(temperature=0.7, max_tokens=32, seed=5, ignore_eos=True)
    accepted = {}
    for mode in ("first-path", "full"):
        llm = tokenleap.LLM(speculative_config={"method": "custom", "drafter": drafter, "adaptive": False,
                                                "num_speculative_tokens": 8, "sampled_tree": mode})
        a = llm.chat(PROMPT, params, use_tqdm=False)[0]
        b = llm.chat(PROMPT, params, use_tqdm=False)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 32
        depth = len(a.metrics.spec.drafted_per_position)
        assert 0 < depth <= 2 if mode == "first-path" else depth == 3
        accepted[mode] = a.metrics.spec.num_accepted_tokens
    assert accepted["full"] > accepted["first-path"]


def test_malformed_tree_is_a_clear_error() -> None:
    class Bad(StatelessDrafter):
        name = "bad-tree"

        def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
            return Draft([1, 2], [1, -1])

    llm = tokenleap.LLM(speculative_config={"method": "custom", "drafter": Bad()})
    with pytest.raises(TokenleapError, match="malformed tree"):
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
