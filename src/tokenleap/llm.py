"""Offline facade in the shape of vLLM's `LLM`: `LLM(model=...).generate(prompts, params)`.

`generate` takes raw prompts (strings or token-id lists); `chat` applies the model's chat
template to one conversation or a list of them; `stream` yields text deltas of one request as
they are produced. Each returns vLLM-shaped `RequestOutput`s with timing metrics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from tqdm.auto import tqdm

from tokenleap.config import EngineConfig, SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Drafter
from tokenleap.engine.engine import Engine
from tokenleap.engine.request import Request
from tokenleap.errors import TokenleapError
from tokenleap.models.loading import DTYPES, load_model
from tokenleap.models.registry import DEFAULT_MODEL, resolve
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer
from tokenleap.types import RequestOutput

Prompt = Union[str, Sequence[int]]
Message = dict[str, str]


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
    ) -> None:
        self.config = EngineConfig(
            model=model, dtype=dtype, max_model_len=max_model_len, use_kernels=use_kernels, quantization=quantization
        )
        self.spec_config = SpecConfig.from_dict(speculative_config)
        self.source = resolve(self.config.model)
        self.model, self.tokenizer = load_model(
            self.source, DTYPES[self.config.dtype], use_kernels=use_kernels, quantization=self.config.quantization
        )
        registry = default_registry()

        def make_drafter(spec: SpecConfig) -> Drafter:
            return registry.create(spec.method, spec, target=self.model, tokenizer=self.tokenizer, target_path=self.source.path)

        self.drafter = make_drafter(self.spec_config) if self.spec_config is not None else None
        self.engine = Engine(
            self.model, self.tokenizer, self.config.max_model_len, self.spec_config, self.drafter, drafter_factory=make_drafter
        )

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
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

    def _run_all(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        outputs = []
        for req in tqdm(requests, desc="generating", disable=not use_tqdm or len(requests) < 2):
            outputs.append(self.engine.run(req).to_output())
        return outputs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete raw prompts (no chat template)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = self._params_for(sampling_params, len(prompts))
        requests = []
        for prompt, p in zip(prompts, params):
            text, ids = self._encode(prompt)
            requests.append(self.engine.add_request(ids, p, prompt=text))
        return self._run_all(requests, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or a list of conversations."""
        if not messages:
            raise TokenleapError("no messages given")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params = self._params_for(sampling_params, len(conversations))
        requests = []
        for conv, p in zip(conversations, params):
            ids = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt)  # type: ignore[arg-type]
            requests.append(self.engine.add_request(ids, p, prompt=self.tokenizer.decode(ids)))
        return self._run_all(requests, use_tqdm)

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
