"""Drafts of 64 tokens (llama.cpp's `--draft-max 64`, the ngram-mod example of its docs) on the
real model: 65 verify rows in one forward, greedy output token for token the plain output, in
bf16 and fp32, whether the whole draft is right or some of it is wrong."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import tokenleap
from tokenleap.config import MAX_DRAFT_TOKENS
from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


class Replay(StatelessDrafter):
    """Drafts the known greedy answer's next tokens, the whole budget; with `wrong_every`, the
    token at every answer position p with p % wrong_every == wrong_every // 2 is replaced by
    another one (so drafts are cut there and the rest of them rejected)."""

    name = "replay"

    def __init__(self, prompt_len: int, answer: Sequence[int], wrong_every: int = 0) -> None:
        self.prompt_len, self.answer, self.wrong_every = prompt_len, list(answer), wrong_every
        self.lengths: list[int] = []

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        done = len(tokens) - self.prompt_len
        draft = self.answer[done : done + max_tokens]
        if self.wrong_every:
            w = self.wrong_every
            draft = [(t + 1) % 49152 if (done + i) % w == w // 2 else t for i, t in enumerate(draft)]
        self.lengths.append(len(draft))
        return Draft(draft)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("wrong_every", [0, 23], ids=["all-right", "partly-wrong"])
def test_64_token_drafts_give_plain_output(dtype: str, wrong_every: int) -> None:
    assert MAX_DRAFT_TOKENS == 64
    plain = tokenleap.LLM(dtype=dtype).chat(PROMPT, PARAMS, use_tqdm=False)[0]
    answer = list(plain.outputs[0].token_ids)
    assert len(answer) == 200
    drafter = Replay(len(plain.prompt_token_ids), answer, wrong_every)
    spec = tokenleap.LLM(dtype=dtype, speculative_config={"method": "custom", "drafter": drafter, "adaptive": False,
                                                          "num_speculative_tokens": 64})
    out = spec.chat(PROMPT, PARAMS, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == answer
    stats = out.metrics.spec
    assert max(drafter.lengths) == 64 and len(stats.drafted_per_position) == 64  # full 64-token drafts were verified
    if wrong_every:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert out.metrics.num_forward_passes >= 200 // wrong_every
    else:
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # every drafted token was right
        assert out.metrics.num_forward_passes <= 1 + -(-200 // 65) + 1  # 65 tokens a forward
