"""Logits processors that depend on the generated context: vLLM's penalties and `min_tokens`;
and the log-probabilities reported per output token.

Applied to the raw target logits before any sampling or verification, in vLLM v1's order:
`min_tokens` (EOS and `stop_token_ids` masked until that many tokens are out), then the
repetition penalty (Keskar et al., 2019, "CTRL": over prompt and output, a positive logit is
divided by the penalty and a negative one multiplied), then frequency and presence penalties
(OpenAI's: over the output only, `logit -= frequency * count + presence * (count > 0)`).

Losslessness under speculation: the rows of a verify forward are the logits at successive
positions, and each row gets exactly the processing plain decoding would give that position: its
context is the committed output plus the draft tokens on the path to that row (a chain's prefix,
a tree node's ancestors). So greedy speculation still equals plain decoding with the same
penalties, and sampled verification compares against the same processed target distribution.

Logprobs follow vLLM's default (`raw_logprobs`): the log-softmax of the raw target logits of the
row that produced a token, whether the token came from a draft or was sampled. A token accepted
from a draft gets the same figure as the plain decode of that position (the rows are bit-identical).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from tokenleap.sampling import SamplingParams
from tokenleap.types import Logprob


def needs_processing(params: SamplingParams) -> bool:
    """Whether `process_rows` changes anything for these parameters."""
    return (params.min_tokens > 0 or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def row_prefixes(draft: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """For each verify row (row 0: after the last committed token; row i: after draft node i-1),
    the draft tokens that precede it: a chain's first i tokens, or a tree node's ancestors and
    itself, root first."""
    if parents is None:
        return [list(draft[:i]) for i in range(len(draft) + 1)]
    out: list[list[int]] = [[]]
    for i in range(len(draft)):
        p = parents[i]
        out.append((out[p + 1] if p >= 0 else []) + [draft[i]])
    return out


def process_rows(
    logits: torch.Tensor,  # [rows, V] fp32
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    prefixes: Sequence[Sequence[int]],  # per row: draft tokens after `output_ids` (see row_prefixes)
    stop_ids: Collection[int],  # EOS ids (unless ignore_eos) and stop_token_ids
) -> torch.Tensor:
    """The processed logits (a new tensor; `logits` is left alone)."""
    if not needs_processing(params):
        return logits
    rows, vocab = logits.shape
    out = logits.float().clone()
    base_out = (
        torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        if output_ids
        else torch.zeros(vocab, dtype=torch.long)
    )
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    if prompt_ids:
        in_prompt[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
    mask_ids = torch.tensor(sorted(t for t in stop_ids if 0 <= t < vocab), dtype=torch.long)
    for r in range(rows):
        prefix = list(prefixes[r])
        row = out[r]
        if params.min_tokens and len(output_ids) + len(prefix) < params.min_tokens and len(mask_ids):
            row[mask_ids] = float("-inf")
        counts = base_out
        if prefix:
            counts = base_out + torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=vocab)[:vocab]
        if params.repetition_penalty != 1.0:
            seen = in_prompt | (counts > 0)
            penalised = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            row -= params.frequency_penalty * counts.float() + params.presence_penalty * (counts > 0).float()
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top: int, decode: Callable[[int], str]
) -> list[dict[int, Logprob]]:
    """For each row of raw `logits` `[m, V]` and the token chosen from it: that token's
    log-probability and rank under the row's log-softmax, and the `top` likeliest tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: list[dict[int, Logprob]] = []
    for i, tok in enumerate(token_ids):
        row = lp[i]
        chosen = float(row[tok])
        entry = {int(tok): Logprob(chosen, int((row > row[tok]).sum()) + 1, decode(int(tok)))}
        if top:
            values, ids = torch.topk(row, top)
            for r, (v, t) in enumerate(zip(values.tolist(), ids.tolist())):
                if t not in entry:
                    entry[t] = Logprob(v, r + 1, decode(t))
        out.append(entry)
    return out
