"""OpenAI wire protocol: request bodies (pydantic) and response / stream-chunk builders.

Request models follow OpenAI's Chat Completions and (legacy) Completions APIs plus vLLM's
sampling extensions (`top_k`, `min_p`, `stop_token_ids`, `ignore_eos`) and tokenleap's own
per-request `speculative` override. Bodies are validated strictly from JSON (a string where a
number belongs is an error, not a coercion); fields OpenAI defines but tokenleap does not
implement are accepted only at their neutral value, so a client is never silently given
something other than what it asked for. Unknown extra fields are ignored, as vLLM does. Python's
JSON reader accepts `NaN` and `Infinity`; a number field holding one is a validation error.

Responses are plain dicts in the shapes the official `openai` client parses: ids `chatcmpl-...`
/ `cmpl-...`, `object`, `created`, `model`, `choices`, `usage`, and a `speculative` field with
the request's speculation statistics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tokenleap.types import CompletionOutput, Logprob, RequestOutput

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class SpeculativeOverride(BaseModel):
    """Per-request speculation: `{"method": "none"}` turns it off; any other method (with the
    knobs below) replaces the server's default config for this request."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    method: str
    num_speculative_tokens: Optional[int] = None
    draft_min: Optional[int] = Field(None, ge=0)
    adaptive: Optional[bool] = None
    prompt_lookup_min: Optional[int] = Field(None, ge=1, le=64)
    prompt_lookup_max: Optional[int] = Field(None, ge=1, le=64)
    ngram_size_n: Optional[int] = Field(None, ge=1, le=64)
    ngram_size_m: Optional[int] = Field(None, ge=1, le=64)
    ngram_min_hits: Optional[int] = Field(None, ge=1, le=1024)
    suffix_decoding_max_tree_depth: Optional[int] = Field(None, ge=1, le=256)
    suffix_decoding_max_spec_factor: Optional[float] = Field(None, ge=0, le=64)
    suffix_decoding_min_token_prob: Optional[float] = None
    sampled_tree: Optional[str] = None  # "full" | "first-path": how a sampled request verifies a tree draft
    acceptance: Optional[str] = None  # "exact" | "typical-lossy" (Medusa's typical acceptance: not lossless)
    typical_threshold: Optional[float] = Field(None, ge=0, le=1)
    typical_alpha: Optional[float] = Field(None, ge=0, le=1)

    def knobs(self) -> dict[str, Any]:
        """The fields the client set, without `method`."""
        return self.model_dump(exclude_none=True, exclude={"method"})


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    n: int = 1
    speculative: Optional[SpeculativeOverride] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # vLLM's extension
    min_tokens: Optional[int] = None  # vLLM's extension
    include_stop_str_in_output: Optional[bool] = None  # vLLM's extension
    guided_json: Optional[Union[str, dict[str, Any]]] = None  # vLLM's extensions: structured output
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None  # vLLM's current spelling
    skip_special_tokens: Optional[bool] = None  # vLLM's extension
    # OpenAI fields accepted only at their neutral value
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def constraint(self) -> dict[str, Any] | None:
        """The structured-output constraint as `StructuredOutputsParams` fields (None: free text)."""
        given = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                                   ("grammar", self.guided_grammar)) if v is not None}
        if self.structured_outputs:
            given.update(self.structured_outputs)
        fmt = getattr(self, "response_format", None)
        if fmt and fmt.get("type") != "text":
            kind = fmt.get("type")
            if kind == "json_object":
                given["json_object"] = True
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
                given["json"] = spec["schema"]
            else:
                raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        return given or None

    def unsupported(self) -> list[str]:
        """Names of set fields whose values tokenleap does not implement."""
        bad = []
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls (server/tools.py renders them)
    tool_call_id: Optional[str] = None  # a tool result's call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> list[str]:
        return super().unsupported()  # tools / tool_choice: server/tools.py

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None when not asked; else the top count (0: the token's own)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them (`developer` is OpenAI's new `system`)."""
        from tokenleap.server.tools import render_message

        return [render_message(m.role, m.text(), m.tool_calls) for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's and vLLM's default for completions
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.best_of not in (None, 1):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(out: RequestOutput) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculative_stats(out: RequestOutput, method: str | None) -> dict[str, Any]:
    """The request's speculation statistics (vLLM's / llama.cpp's counters)."""
    m = out.metrics
    s = m.spec
    return {
        "method": method,
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 4),
        "mean_acceptance_length": round(m.mean_acceptance_length, 4),
        "num_forward_passes": m.num_forward_passes,
        "acceptance_rate_per_position": [round(r, 4) for r in s.acceptance_rate_per_position()],
    }


def _top(entry: dict[int, Logprob], top: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]


def chat_logprobs(c: CompletionOutput, top: int) -> dict[str, Any] | None:
    """OpenAI chat `logprobs`: per token its text, log-probability, UTF-8 bytes and the top ones."""
    if c.logprobs is None:
        return None

    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e[t]), "top_logprobs": [item(lp) for lp in _top(e, top)]} for t, e in zip(c.token_ids, c.logprobs)],
            "refusal": None}


def completion_logprobs(c: CompletionOutput, top: int) -> dict[str, Any] | None:
    """OpenAI (legacy) completions `logprobs`: tokens, their log-probabilities, top dicts, offsets."""
    if c.logprobs is None:
        return None
    tokens = [e[t].decoded_token or "" for t, e in zip(c.token_ids, c.logprobs)]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)],
            "top_logprobs": [{(lp.decoded_token or ""): lp.logprob for lp in _top(e, top)} for e in c.logprobs],
            "text_offset": offsets}


class Formatter(ABC):
    """Builds one endpoint's response body and stream chunks for one request."""

    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, spec_method: str | None, top_logprobs: int = 0) -> None:
        self.id = request_id
        self.top = top_logprobs
        self.model = model
        self.created = now()
        self.spec_method = spec_method

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    @abstractmethod
    def delta_chunk(self, text: str) -> dict[str, Any] | None: ...  # None: nothing to send yet

    @abstractmethod
    def final_chunk(self, out: RequestOutput) -> dict[str, Any]: ...

    def final_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """What a stream sends when the request ends (before the usage chunk)."""
        return [self.final_chunk(out)]

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return {**self._head(self.chunk_object_name), "choices": [], "usage": usage(out)}

    @abstractmethod
    def response(self, out: RequestOutput) -> dict[str, Any]: ...


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.chunk_object_name), "system_fingerprint": None, "choices": [choice]}

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def final_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = self._chunk({}, out.outputs[0].finish_reason)
        chunk["choices"][0]["logprobs"] = chat_logprobs(out.outputs[0], self.top)  # streamed: every token's, here
        chunk["speculative"] = speculative_stats(out, self.spec_method)
        return chunk

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": chat_logprobs(c, self.top),
                    "finish_reason": c.finish_reason} for c in out.outputs]
        return {
            **self._head(self.object_name),
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage(out),
            "speculative": speculative_stats(out, self.spec_method),
        }


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.chunk_object_name), "system_fingerprint": None, "choices": [choice]}

    def delta_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(text, None)

    def final_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = self._chunk("", out.outputs[0].finish_reason)
        chunk["choices"][0]["logprobs"] = completion_logprobs(out.outputs[0], self.top)  # streamed: every token's, here
        chunk["speculative"] = speculative_stats(out, self.spec_method)
        return chunk

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "text": c.text, "logprobs": completion_logprobs(c, self.top), "finish_reason": c.finish_reason}
                   for c in out.outputs]
        return {
            **self._head(self.object_name),
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage(out),
            "speculative": speculative_stats(out, self.spec_method),
        }
