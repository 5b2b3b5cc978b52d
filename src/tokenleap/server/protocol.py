"""OpenAI wire protocol: request bodies (pydantic) and response / stream-chunk builders.

Request models follow OpenAI's `CreateChatCompletionRequest` and `CreateCompletionRequest` (its
published OpenAPI spec) plus vLLM's sampling extensions (`top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`, `guided_*`, `structured_outputs`) and tokenleap's own `speculative` and
`json_schema_mode`. An explicit JSON null means "unset" everywhere, as the spec's nullable fields
and the clients and proxies that send them mean it. Every spec field is honoured, accepted because
it cannot change the answer (`metadata`, `user`, `safety_identifier`, `prompt_cache_*`,
`service_tier`, `prediction`), or refused with a 400 naming it unless it holds its neutral value
(`REFUSED`: audio, web search, reasoning, ...), so a client is never silently given something other
than what it asked for. Bodies are validated strictly from JSON (a string where a number belongs is
an error, not a coercion). Unknown extra fields are ignored, as vLLM does. Python's JSON reader
accepts `NaN` and `Infinity`; a number field holding one is a validation error.

Responses are plain dicts in the shapes of the spec's `CreateChatCompletionResponse`,
`CreateChatCompletionStreamResponse` and `CreateCompletionResponse` (`refusal`, a string
`system_fingerprint`, `usage` with its details, finite log-probabilities), plus a `speculative`
field with the request's speculation statistics.
"""

from __future__ import annotations

import math
import time
import uuid
from abc import ABC, abstractmethod
from importlib import metadata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from tokenleap.types import CompletionOutput, Logprob, RequestOutput

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null means the field is unset (its default)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _method_options_schema(schema: dict[str, Any]) -> None:
    """The per-request schema's method options, from the method records (methods a request may
    pick that have options of their own, registered ones included), at each schema generation."""
    from tokenleap.drafters.server_schema import options_json_schema, request_methods

    schema.setdefault("properties", {}).update(options_json_schema())
    allowed = request_methods()
    schema["properties"].get("method", {})["description"] = (
        f"none, or a method a request may pick: {', '.join(allowed)}, or a chain of them (a+b)")


class SpeculativeOverride(_Strict):
    """Per-request speculation: `{"method": "none"}` turns it off; any other method (with the
    engine-wide controls below, and the options of the methods a request may pick, from the
    method records: `prompt_lookup_max`, `ngram_size_n`, `suffix_decoding_*`, ...) replaces the
    server's default config for this request."""

    model_config = ConfigDict(
        strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra=_method_options_schema
    )
    _method_options: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _split_method_options(cls, data: Any, handler: Any) -> Any:
        """Options of per-request methods (method records) are taken out before the strict
        field validation, held to their per-request limits here and checked by the method's
        options when the config is built."""
        options: dict[str, Any] = {}
        if isinstance(data, dict):
            from tokenleap.drafters.server_schema import check_request_options, per_request_options

            names = per_request_options()
            options = {k: v for k, v in data.items() if k in names and v is not None}
            data = {k: v for k, v in data.items() if k not in names}
            check_request_options(options)
        model = handler(data)
        model._method_options = options
        return model

    method: str
    num_speculative_tokens: int | None = None
    draft_min: int | None = Field(None, ge=0)
    adaptive: bool | None = None
    sampled_tree: str | None = None  # "full" | "first-path": how a sampled request verifies a tree draft
    acceptance: str | None = None  # "exact" | "typical-lossy" (Medusa's typical acceptance: not lossless)
    typical_threshold: float | None = Field(None, ge=0, le=1)
    typical_alpha: float | None = Field(None, ge=0, le=1)

    def knobs(self) -> dict[str, Any]:
        """The fields the client set, without `method`."""
        return self.model_dump(exclude_none=True, exclude={"method"})

    def method_options(self) -> dict[str, Any]:
        """The options of method records the client set (top-level keys, as in speculative_config)."""
        return dict(self._method_options)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted; tokenleap never pads its chunks


# OpenAI fields tokenleap cannot honour: (field, its neutral values, why). A request holding
# anything else there is refused with a 400 naming the field.
REFUSED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("logit_bias", (None, {}), "logit_bias is not supported by this server"),
    ("audio", (None,), "audio output is not supported by this server"),
    ("modalities", (None, [], ["text"]), "only text output is supported: modalities must be null or [\"text\"]"),
    ("web_search_options", (None,), "web search is not supported by this server"),
    ("reasoning_effort", (None, "none"), "this model does not reason: reasoning_effort must be null or \"none\""),
    ("verbosity", (None, "medium"), "verbosity is not supported by this server: it must be null or \"medium\""),
    ("moderation", (None,), "moderation is not supported by this server"),
    ("store", (None, False), "stored completions are not supported by this server: store must be null or false"),
    ("suffix", (None, ""), "suffix (insertion) is not supported by this server"),
)


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    speculative: SpeculativeOverride | None = None
    json_schema_mode: Literal["strict", "lenient"] | None = None  # tokenleap: how JSON schemas are read (structured.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_tokens: int | None = None  # vLLM's extension
    include_stop_str_in_output: bool | None = None  # vLLM's extension
    guided_json: str | dict[str, Any] | None = None  # vLLM's extensions: structured output
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's current spelling
    skip_special_tokens: bool | None = None  # vLLM's extension
    # accepted, and cannot change the answer
    user: str | None = None
    # refused unless neutral (REFUSED)
    logit_bias: dict[str, float] | None = None

    def stops(self) -> list[str]:
        """The stop strings (an empty string can never end anything: dropped)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def constraint(self, json_mode: str = "strict") -> dict[str, Any] | None:
        """The structured-output constraint as `StructuredOutputsParams` fields (None: free text);
        `json_mode` is the server's reading of JSON schemas unless the request names its own."""
        given: dict[str, Any] = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                                   ("choice", self.guided_choice),
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
                if not isinstance(spec, dict):
                    raise ValueError(
                        "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
                    )
                schema = spec.get("schema")
                if schema is None:
                    given["json_object"] = True  # the spec lets the schema out: any JSON object
                elif isinstance(schema, dict):
                    given["json"] = schema
                else:
                    raise ValueError("response_format json_schema.schema must be a JSON schema object")
            else:
                raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        if not given:
            return None
        given.setdefault("json_mode", self.json_schema_mode or json_mode)
        return given

    def refusals(self) -> list[tuple[str, str]]:
        """(field, message) for each set field whose value tokenleap cannot honour."""
        out = []
        for name, neutral, why in REFUSED:
            if name in type(self).model_fields and getattr(self, name) not in neutral:
                out.append((name, f"{why}; send null or leave {name} out"))
        return out


class ContentPart(_Strict):
    """A message content part; only text (and an assistant's refusal) can reach this model."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None  # an assistant's earlier refusal
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (server/tools.py renders them)
    function_call: dict[str, Any] | None = None  # the same, deprecated
    tool_call_id: str | None = None  # a tool result's call
    audio: dict[str, Any] | None = None  # an assistant's earlier audio answer: refused

    def text(self, where: str) -> str:
        """The message's text (ValueError, naming `where`, for parts this server cannot read)."""
        if self.audio is not None:
            raise ValueError(f"{where}.audio: audio is not supported by this server")
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type == "text" and part.text is not None:
                texts.append(part.text)
            elif part.type == "refusal" and part.refusal is not None and self.role == "assistant":
                texts.append(part.refusal)
            else:
                raise ValueError(
                    f"{where}.content[{j}]: content parts of type {part.type!r} are not supported by this server "
                    "(text only)"
                )
        return "".join(texts)

    def calls(self) -> list[dict[str, Any]] | None:
        """An assistant's earlier calls, the deprecated `function_call` included."""
        if self.function_call is not None:
            return [*(self.tool_calls or []), {"type": "function", "function": self.function_call}]
        return self.tool_calls


class Prediction(_Strict):
    """Predicted output: it can only make an answer faster, never different, so it is accepted."""

    type: Literal["content"]
    content: str | list[ContentPart]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # deprecated: tools
    function_call: str | dict[str, Any] | None = None  # deprecated: tool_choice
    response_format: dict[str, Any] | None = None
    # accepted, and cannot change the answer
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None  # answered "default": the only tier there is
    prediction: Prediction | None = None
    # refused unless neutral (REFUSED)
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    moderation: dict[str, Any] | None = None
    store: bool = False

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None when not asked; else the top count (0: the token's own)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them (`developer` is OpenAI's new `system`);
        ValueError for content this server cannot read."""
        from tokenleap.server.tools import render_message

        return [render_message(m.role, m.text(f"messages[{i}]"), m.calls()) for i, m in enumerate(self.messages)]


Prompt = str | list[int]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None  # null: a new document
    max_tokens: int = 16  # OpenAI's and vLLM's default for completions; 0 (with echo) scores the prompt only
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # 0 and 1 (and null) mean n
    suffix: str | None = None  # refused unless empty (REFUSED)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[Prompt | None]:
        """Each prompt (a batch holds several); None where a prompt is empty or absent: the model
        then writes from the start of a new document."""
        p = self.prompt
        if p is None or isinstance(p, str) or (p and isinstance(p[0], int)):
            one: list[Any] = [p]
        else:
            one = list(p) or [None]
        return [q if q else None for q in one]

    def refusals(self) -> list[tuple[str, str]]:
        out = super().refusals()
        if self.echo and self.logprobs is not None:
            out.append(
                (
                    "echo",
                    "echo with logprobs is not supported by this server (prompt log-probabilities are not computed)",
                )
            )
        return out


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _version() -> str:
    try:
        return metadata.version("tokenleap")
    except metadata.PackageNotFoundError:
        return "0"


SYSTEM_FINGERPRINT = f"tokenleap-{_version()}"
LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but rules out (JSON has no -inf)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


def usage(out: RequestOutput, prompt_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI `CompletionUsage` (`prompt_tokens`: the request's, when it held several prompts)."""
    prompt = len(out.prompt_token_ids) if prompt_tokens is None else prompt_tokens
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


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
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e[t]), "top_logprobs": [item(lp) for lp in _top(e, top)]} for t, e in zip(c.token_ids, c.logprobs)
        ],
        "refusal": None,
    }


def completion_logprobs(c: CompletionOutput, top: int) -> dict[str, Any] | None:
    """OpenAI (legacy) completions `logprobs`: tokens, their log-probabilities, top dicts, offsets."""
    if c.logprobs is None:
        return None
    tokens = [e[t].decoded_token or "" for t, e in zip(c.token_ids, c.logprobs)]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e[t].logprob) for t, e in zip(c.token_ids, c.logprobs)],
        "top_logprobs": [{(lp.decoded_token or ""): _finite(lp.logprob) for lp in _top(e, top)} for e in c.logprobs],
        "text_offset": offsets,
    }


class Formatter(ABC):
    """Builds one endpoint's response body and stream chunks for one request."""

    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, spec_method: str | None, top_logprobs: int = 0, *,
                 service_tier: str | None = None, echo: tuple[str, ...] = ()) -> None:
        self.id = request_id
        self.top = top_logprobs
        self.model = model
        self.created = now()
        self.spec_method = spec_method
        self.service_tier = service_tier  # sent when the request named one
        self.echo = echo  # completions' echo: each choice's prompt text
        self.choice = 0  # the choice this copy streams (server/handlers.py copies one per engine request)
        self.prompt_tokens: int | None = None  # several prompts: their tokens together

    def _head(self, obj: str) -> dict[str, Any]:
        head = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        if self.service_tier is not None:
            head["service_tier"] = "default"
        return head

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
        return {**self._head(self.chunk_object_name), "choices": [], "usage": usage(out, self.prompt_tokens)}

    @abstractmethod
    def response(self, out: RequestOutput) -> dict[str, Any]: ...


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.chunk_object_name), "choices": [choice]}

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": "", "refusal": None}, None)]

    def delta_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def final_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = self._chunk({}, out.outputs[0].finish_reason)
        chunk["choices"][0]["logprobs"] = chat_logprobs(out.outputs[0], self.top)  # streamed: every token's, here
        chunk["speculative"] = speculative_stats(out, self.spec_method)
        return chunk

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": chat_logprobs(c, self.top), "finish_reason": c.finish_reason} for c in out.outputs]
        return {
            **self._head(self.object_name),
            "choices": choices,
            "usage": usage(out, self.prompt_tokens),
            "speculative": speculative_stats(out, self.spec_method),
        }


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.chunk_object_name), "choices": [choice]}

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk(self.echo[self.choice], None)] if self.echo and self.echo[self.choice] else []

    def delta_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(text, None)

    def final_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = self._chunk("", out.outputs[0].finish_reason)
        chunk["choices"][0]["logprobs"] = completion_logprobs(out.outputs[0], self.top)  # streamed: every token's, here
        chunk["speculative"] = speculative_stats(out, self.spec_method)
        return chunk

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "text": (self.echo[c.index] if self.echo else "") + c.text,
                    "logprobs": completion_logprobs(c, self.top),
                    "finish_reason": c.finish_reason} for c in out.outputs]
        return {
            **self._head(self.object_name),
            "choices": choices,
            "usage": usage(out, self.prompt_tokens),
            "speculative": speculative_stats(out, self.spec_method),
        }
