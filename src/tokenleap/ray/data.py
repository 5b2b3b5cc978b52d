"""Batch inference with Ray Data: `build_processor(...)` returns a processor that maps a dataset
of prompts through tokenleap engines, in the shape of vLLM's Ray Data LLM API
(`build_llm_processor`): `processor(ds)` is `ds.map_batches(...)` over a pool of actors, each
holding one `tokenleap.LLM` (with its speculative config) and running `LLM.generate` (raw
prompts) or `LLM.chat` (conversations) on each batch. Ray schedules the actors on every node of
the cluster; each actor's torch and kernel threads are `threads_per_actor`.

Each output row is its input row plus `generated_text`, `generated_token_ids`,
`num_generated_tokens` and `finish_reason`: the fields of `LLM.generate`'s output, and with
greedy sampling the same tokens (speculation never changes greedy output; a request's rows are
computed the same whatever it is batched with).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenleap.config import DEFAULT_MODEL
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams


class _Generator:
    """A Ray Data actor: one engine, one batch at a time."""

    def __init__(
        self, llm_kwargs: dict[str, Any], params: SamplingParams, threads: int, column: str, chat: bool
    ) -> None:
        import torch

        from tokenleap.llm import LLM

        torch.set_num_threads(threads)  # before the load: the kernels size their pool from it
        self.llm = LLM(**llm_kwargs)
        self.params, self.column, self.chat = params, column, chat

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.column not in batch:
            raise TokenleapError(f"the dataset has no {self.column!r} column (columns: {', '.join(batch)})")
        items = [_plain(x) for x in batch[self.column]]
        if self.chat:
            outs = self.llm.chat(items, self.params, use_tqdm=False)
        else:
            outs = self.llm.generate(items, self.params, use_tqdm=False)
        firsts = [o.outputs[0] for o in outs]
        ids = np.empty(len(firsts), dtype=object)
        ids[:] = [list(c.token_ids) for c in firsts]
        return {**batch,
                "generated_text": np.array([c.text for c in firsts], dtype=object),
                "generated_token_ids": ids,
                "num_generated_tokens": np.array([len(c.token_ids) for c in firsts], dtype=np.int64),
                "finish_reason": np.array([c.finish_reason or "" for c in firsts], dtype=object)}


def _plain(x: Any) -> Any:
    """A dataset cell as LLM takes it: numpy arrays of token ids or messages become lists."""
    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, np.integer):
        return int(x)
    return x


@dataclass(frozen=True)
class Processor:
    """`processor(ds)`: the dataset with generated columns (lazy, as Ray Data is)."""

    llm_kwargs: dict[str, Any]
    sampling_params: SamplingParams
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 16
    threads_per_actor: int = 1
    prompt_column: str = "prompt"
    chat: bool = False
    map_kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, ds: Any) -> Any:
        return ds.map_batches(
            _Generator,
            fn_constructor_kwargs={
                "llm_kwargs": self.llm_kwargs,
                "params": self.sampling_params,
                "threads": self.threads_per_actor,
                "column": self.prompt_column,
                "chat": self.chat,
            },
            concurrency=self.concurrency,
            batch_size=self.batch_size,
            num_cpus=self.threads_per_actor,
            batch_format="numpy",
            **self.map_kwargs,
        )


def build_processor(
    model: str = DEFAULT_MODEL,
    *,
    speculative_config: dict[str, Any] | None = None,
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    llm_kwargs: Mapping[str, Any] | None = None,
    concurrency: int | tuple[int, int] = 1,
    batch_size: int = 16,
    threads_per_actor: int = 1,
    prompt_column: str = "prompt",
    chat: bool = False,
    **map_kwargs: Any,
) -> Processor:
    """A Ray Data processor running `tokenleap.LLM(model, speculative_config=..., **llm_kwargs)`
    on `concurrency` actors (an int, or (min, max) to autoscale) over batches of `batch_size`
    rows; `prompt_column` holds raw prompts (text or token ids), or conversations with `chat=True`."""
    if batch_size < 1:
        raise TokenleapError(f"batch_size must be >= 1, got {batch_size}")
    if threads_per_actor < 1:
        raise TokenleapError(f"threads_per_actor must be >= 1, got {threads_per_actor}")
    params = (
        sampling_params
        if isinstance(sampling_params, SamplingParams)
        else SamplingParams(**dict(sampling_params or {}))
    )
    kwargs = {**dict(llm_kwargs or {}), "model": model, "speculative_config": speculative_config}
    return Processor(kwargs, params, concurrency, batch_size, threads_per_actor, prompt_column, chat, dict(map_kwargs))
