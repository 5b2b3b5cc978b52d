"""The decoding engine: prefill, then one target forward per step, until a stop condition.

A step forwards the last committed token (plus, once speculation lands, the draft tokens)
through the target model, turns the logits into tokens and commits them to the request:

    schedule -> [drafter.propose] -> target forward -> sample / verify -> kv.truncate -> emit

This module implements plain autoregressive decoding (greedy and sampled) over one request at
a time; the forward already takes many query tokens at arbitrary positions with an explicit
mask and the KV cache rolls back, which is what verification needs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import torch

from tokenleap.engine.request import Request
from tokenleap.errors import TokenleapError
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, check_token_ids, make_generator, sample_next
from tokenleap.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenleap.types import RequestMetrics


class Engine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, max_model_len: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = min(max_model_len or model.max_context, model.max_context)
        self._ids = itertools.count()

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> Request:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise TokenleapError("the prompt is empty")
        check_token_ids(prompt_ids, self.model.config.vocab_size)
        if len(prompt_ids) >= self.max_context:
            raise TokenleapError(
                f"the prompt has {len(prompt_ids)} tokens but the context length is {self.max_context}: "
                "no room left to generate"
            )
        metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_ids))
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt=prompt,
            prompt_ids=prompt_ids,
            params=params,
            generator=make_generator(params.seed),
            detok=IncrementalDetokenizer(self.tokenizer),
            kv=self.model.new_kv_cache(self.max_context),
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_context=self.max_context,
            metrics=metrics,
        )

    def prefill(self, req: Request) -> None:
        """Run the prompt; sample the first token from the last prompt position."""
        t0 = time.perf_counter()
        ids = torch.tensor(req.prompt_ids, dtype=torch.long)
        out = self.model.forward(ids, torch.arange(len(ids)), req.kv)
        logits = self.model.compute_logits(out.hidden, [len(ids) - 1])[0]
        req.append_tokens([sample_next(logits, req.params, req.generator)])
        req.metrics.prefill_seconds = time.perf_counter() - t0
        req.metrics.first_token_time = time.time()

    def step(self, req: Request) -> None:
        """One target forward: the last committed token in, the next token out."""
        t0 = time.perf_counter()
        last = req.output_ids[-1]
        pos = req.kv.length
        out = self.model.forward(torch.tensor([last]), torch.tensor([pos]), req.kv)
        logits = self.model.compute_logits(out.hidden)[0]
        req.append_tokens([sample_next(logits, req.params, req.generator)])
        req.metrics.num_forward_passes += 1
        req.metrics.decode_seconds += time.perf_counter() - t0

    def stream(self, req: Request) -> Iterator[str]:
        """Run a request to completion, yielding text deltas as they become final."""
        try:
            self.prefill(req)
            delta = req.take_delta()
            if delta:
                yield delta
            while not req.finished:
                self.step(req)
                delta = req.take_delta()
                if delta:
                    yield delta
        finally:
            req.metrics.finished_time = time.time()
            req.kv.free()

    def run(self, req: Request) -> Request:
        for _ in self.stream(req):
            pass
        return req
