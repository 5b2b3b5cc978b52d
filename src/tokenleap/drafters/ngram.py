"""Prompt lookup decoding (Saxena, 2023; vLLM's `ngram` method).

Find the most recent earlier occurrence of the context's last n tokens, for n from
`prompt_lookup_max` down to `prompt_lookup_min`, and propose the tokens that followed it. The
search is one vectorized pass over the context per n (linear time per step); the suffix itself
is never its own match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.drafters.methods import MethodRecord, option, options_of
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig


def longest_suffix_match(tokens: np.ndarray, n_min: int, n_max: int) -> tuple[int, int] | None:
    """(start of the continuation, n) for the longest suffix n-gram seen earlier, most recent
    occurrence first; None when no n in [n_min, n_max] matches."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0..L-n-1
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            return int(hits[-1]) + n, n
    return None


class NgramDrafter(StatelessDrafter):
    name: ClassVar[str] = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(tokens) < 2:
            return Draft()
        arr = np.asarray(tokens, dtype=np.int64)
        match = longest_suffix_match(arr, self.n_min, self.n_max)
        if match is None:
            return Draft()
        start, _ = match
        return Draft(arr[start : start + max_tokens].tolist())


@dataclass(frozen=True)
class NgramOptions:
    """Prompt lookup's options (methods `ngram` and `ngram-tree`)."""

    prompt_lookup_min: int = option(1, help="shortest n-gram looked up", flags=("--prompt-lookup-min",), request_max=64)
    prompt_lookup_max: int = option(4, help="longest n-gram looked up", flags=("--spec-ngram-size-n",), request_max=64)

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise TokenleapError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )


def _build(config: SpecConfig, **_: Any) -> NgramDrafter:
    opts = options_of(config, "ngram", NgramOptions)
    return NgramDrafter(opts.prompt_lookup_min, opts.prompt_lookup_max)


METHOD = MethodRecord(
    "ngram", _build, "prompt lookup: the longest suffix match in prompt + output (vLLM)", options=NgramOptions,
    aliases=("prompt-lookup", "prompt_lookup"),
)
