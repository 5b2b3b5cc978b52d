"""Offline facade in the shape of vLLM's `LLM`: `LLM(model=...).generate(prompts, params)`.

`generate` takes raw prompts (strings, token-id lists, or vLLM's prompt dicts
`{"prompt": text}` / `{"prompt_token_ids": ids}`); `chat` applies the model's chat
template to one conversation or a list of them; `stream` yields text deltas of one request as
they are produced. Each returns vLLM-shaped `RequestOutput`s with timing metrics.

Many prompts run with continuous batching (`engine.scheduler.BatchScheduler`, the offline
driver of the one scheduler, which the server uses too): at most `max_num_seqs` requests at
once, each created (and its KV cache allocated) only when it joins, prompts prefilled in chunks
between batched decode steps, a prompt's `n` samples from one prefill, finished requests freed
at once.
All prompts are checked before any work starts. `generate_iter` / `chat_iter` yield
`(index, output)` pairs as requests finish; `generate` / `chat` return outputs in input order.
A request's tokens are those it gets alone (see `BatchScheduler`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from tokenleap.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_MODEL, EngineConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Drafter
from tokenleap.drafters.spec import SpecConfig
from tokenleap.engine.engine import Engine
from tokenleap.engine.scheduler import BatchJob, BatchScheduler
from tokenleap.errors import TokenleapError
from tokenleap.models.loading import DTYPES, load_model
from tokenleap.models.registry import resolve
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer
from tokenleap.types import RequestOutput

# text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}
Prompt = str | Sequence[int] | dict[str, Any]
Message = dict[str, str]
Conversations = Sequence[Message] | Sequence[Sequence[Message]]  # one conversation or several
ParamsArg = SamplingParams | Sequence[SamplingParams] | None  # one for all prompts, or one per prompt


@dataclass(frozen=True)
class StreamChunk:
    text: str  # new text since the previous chunk
    finished: bool
    output: RequestOutput | None = None  # set on the last chunk


class LLM:
    """Load a model once, then generate from many prompts."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        speculative_config: dict[str, Any] | None = None,
        use_kernels: bool = True,
        quantization: str | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.config = EngineConfig(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            use_kernels=use_kernels,
            quantization=quantization,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.spec_config = SpecConfig.from_dict(speculative_config)
        self.source = resolve(self.config.model)
        self.model, self.tokenizer = load_model(
            self.source, DTYPES[self.config.dtype], use_kernels=use_kernels, quantization=self.config.quantization,
            kv_cache_type=self.config.kv_cache_dtype,
        )
        registry = default_registry()

        def make_drafter(spec: SpecConfig) -> Drafter:
            return registry.create(spec.method, spec, target=self.model, tokenizer=self.tokenizer,
                                   target_path=self.source.path, target_name=self.source.name)

        self.drafter = make_drafter(self.spec_config) if self.spec_config is not None else None
        self.engine = Engine(self.model, self.tokenizer, self.config.max_model_len, self.spec_config, self.drafter,
                             drafter_factory=make_drafter)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown:
                raise TokenleapError(
                    f"unsupported prompt key(s) {unknown}: a prompt dict has 'prompt' or 'prompt_token_ids'"
                )
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise TokenleapError("'prompt_token_ids' must be a list of integers")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return self._encode(prompt["prompt"])
            raise TokenleapError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of integers)")
        if isinstance(prompt, str):
            if not prompt:
                raise TokenleapError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _params_for(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise TokenleapError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _check_all(self, items: Sequence[Any], what: str, make: Callable[[Any, SamplingParams], BatchJob],
                   params: list[SamplingParams]) -> list[BatchJob]:
        """Build and check every job before any runs; a bad one names its index."""
        jobs = []
        for i, (item, p) in enumerate(zip(items, params)):
            try:
                job = make(item, p)
                self.engine.check_prompt(job.prompt_ids)
            except TokenleapError as exc:
                if len(items) == 1:
                    raise
                raise type(exc)(f"{what} {i}: {exc}") from exc
            jobs.append(job)
        return jobs

    def _prompt_jobs(self, prompts: Prompt | Sequence[Prompt], sampling_params: ParamsArg) -> list[BatchJob]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = self._params_for(sampling_params, len(batch))

        def make(prompt: Prompt, p: SamplingParams) -> BatchJob:
            text, ids = self._encode(prompt)
            return BatchJob(ids, p, text)

        return self._check_all(batch, "prompt", make, params)

    def _chat_jobs(
        self, messages: Conversations, sampling_params: ParamsArg, add_generation_prompt: bool
    ) -> list[BatchJob]:
        if not messages:
            raise TokenleapError("no messages given")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params = self._params_for(sampling_params, len(conversations))

        def make(conv: Sequence[Message], p: SamplingParams) -> BatchJob:
            ids = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt)
            return BatchJob(ids, p, self.tokenizer.decode(ids))

        return self._check_all(conversations, "conversation", make, params)

    def _run(self, jobs: list[BatchJob], use_tqdm: bool) -> Iterator[tuple[int, RequestOutput]]:
        """Run `jobs` with continuous batching, yielding `(index, output)` as each finishes; a
        progress bar with output tokens/s when `use_tqdm` and there is more than one job."""
        scheduler = BatchScheduler(self.engine, jobs, self.config.max_num_seqs)
        pending: dict[int, list[RequestOutput]] = {}  # samples of prompts with n > 1 done so far
        bar = tqdm(total=len(jobs), desc="Processed prompts", unit="req", disable=not use_tqdm or len(jobs) < 2)
        start = last = time.perf_counter()
        try:
            while not scheduler.done:
                finished = scheduler.step()
                now = time.perf_counter()
                if finished or now - last > 0.5:
                    last = now
                    bar.set_postfix_str(
                        f"output {scheduler.num_output_tokens / (now - start):.1f} tok/s", refresh=False
                    )
                    bar.update(
                        sum(1 for _, r in finished if r.params.n == 1)
                        + sum(1 for _, r in finished if r.params.n > 1 and r.sample_index == 0)
                    )
                for index, req in finished:
                    family = pending.setdefault(index, [])
                    family.append(req.to_output())
                    if len(family) == req.params.n:  # every sample of the prompt is done
                        del pending[index]
                        yield index, merge_samples(family)
        finally:
            scheduler.close()
            bar.close()

    def _run_all(self, jobs: list[BatchJob], use_tqdm: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(jobs)
        for index, out in self._run(jobs, use_tqdm):
            outputs[index] = out
        done = [out for out in outputs if out is not None]
        assert len(done) == len(jobs)  # _run yields every index once
        return done

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete raw prompts (no chat template), batched; outputs in input order.
        `sampling_params`: one for all prompts or one per prompt."""
        return self._run_all(self._prompt_jobs(prompts, sampling_params), use_tqdm)

    def generate_iter(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """As `generate`, but yield `(index into prompts, output)` as each request finishes
        (completion order). Every prompt is checked now, before anything runs; stopping the
        iteration early frees the running requests."""
        return self._run(self._prompt_jobs(prompts, sampling_params), use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or a list of conversations, batched;
        outputs in input order."""
        return self._run_all(self._chat_jobs(messages, sampling_params, add_generation_prompt), use_tqdm)

    def chat_iter(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """As `chat`, yielding `(index, output)` as each conversation's answer finishes."""
        return self._run(self._chat_jobs(messages, sampling_params, add_generation_prompt), use_tqdm)

    def chat_token_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.tokenizer.apply_chat_template(list(messages), True)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Generate for one prompt (text or token ids), yielding text as it is produced."""
        text, ids = self._encode(prompt)
        req = self.engine.add_request(ids, sampling_params or SamplingParams(), prompt=text)
        for delta in self.engine.stream(req):
            yield StreamChunk(delta, False)
        yield StreamChunk("", True, req.to_output())


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def merge_samples(samples: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples (n > 1) as one output: completions by sample index, summed counters."""
    if len(samples) == 1:
        return samples[0]
    samples = sorted(samples, key=lambda o: o.outputs[0].index)
    first = samples[0]
    m = dataclasses.replace(first.metrics, spec=dataclasses.replace(first.metrics.spec))
    for o in samples[1:]:
        m.num_generation_tokens += o.metrics.num_generation_tokens
        m.num_forward_passes += o.metrics.num_forward_passes
        m.num_decode_tokens += o.metrics.num_decode_tokens
        m.decode_seconds += o.metrics.decode_seconds
        m.finished_time = max(m.finished_time or 0.0, o.metrics.finished_time or 0.0) or None
        s = o.metrics.spec
        m.spec.num_drafts += s.num_drafts
        m.spec.num_draft_tokens += s.num_draft_tokens
        m.spec.num_accepted_tokens += s.num_accepted_tokens
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, [o.outputs[0] for o in samples],
                         all(o.finished for o in samples), m)
