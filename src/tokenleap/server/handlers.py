"""Request handling for /v1/chat/completions and /v1/completions, shared by both endpoints.

A request goes: read the body (size-limited) -> validate it (`protocol`) -> check the model
name -> tokenize (chat template or raw prompt) off the event loop -> build `SamplingParams` and
the speculative config (library validation, `TokenleapError` -> 400) -> submit to the engine
loop (queue full -> 429) -> stream SSE chunks or wait for the whole answer. Whatever ends the
response early (a disconnect, a cancelled task, an error) aborts the request, and the engine
loop frees it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenleap.config import DEFAULT_DRAFT_TOKENS, SpecConfig
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM, merge_samples
from tokenleap.sampling import MAX_N, SamplingParams, check_token_ids
from tokenleap.server.tools import encode_chat, plan_tools, tool_formatter
from tokenleap.structured import StructuredOutputsParams
from tokenleap.server.config import ServerConfig
from tokenleap.server.errors import APIError, bad_request
from tokenleap.server.loop import EngineLoop, Job, QueueFull, RequestHandle, ServerClosed
from tokenleap.server.metrics import ServerMetrics
from tokenleap.server.protocol import (
    ChatCompletionRequest,
    ChatFormatter,
    CompletionFormatter,
    CompletionRequest,
    Formatter,
    SpeculativeOverride,
    new_id,
)
from tokenleap.types import RequestOutput

M = TypeVar("M", bound=BaseModel)
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 1000, 1024  # each is checked at every new token


@dataclass
class ServerState:
    """Everything the routes need: one per app."""

    llm: LLM
    config: ServerConfig
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    aliases: frozenset[str]
    created: int
    max_draft_tokens: int  # the largest num_speculative_tokens a request may ask for

    @property
    def max_context(self) -> int:
        return self.llm.engine.max_context


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_big
        except ValueError:
            raise APIError(400, "bad Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        loc = [str(p) for p in first["loc"]]
        where = ".".join(loc) or "body"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise APIError(400, f"{where}: {first['msg']}{more}", param=loc[0] if loc else None) from None


def check_model(state: ServerState, name: str | None) -> None:
    if name is None or name in state.aliases or name.lower() in state.aliases:
        return
    raise APIError(404, f"The model `{name}` does not exist; this server serves `{state.model_name}`", param="model",
                   code="model_not_found")


def sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, prompt_len: int,
                    state: ServerState) -> SamplingParams:
    if not 1 <= body.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    bad = body.unsupported()
    if bad:
        raise APIError(400, f"not supported by this server: {', '.join(bad)}", param=bad[0])
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    try:
        num_logprobs = body.num_logprobs()
    except ValueError as exc:
        raise APIError(400, str(exc), param="top_logprobs") from None
    ctx = state.max_context
    if prompt_len >= ctx:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the context length is {ctx}: no room left to generate",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    room = ctx - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                       "Please reduce the length of the prompt or max_tokens.", param="max_tokens")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stops):
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each", param="stop")
    if len(body.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    if body.stop_token_ids:
        try:
            check_token_ids(body.stop_token_ids, state.llm.model.config.vocab_size)
        except TokenleapError as exc:
            raise bad_request(exc, "stop_token_ids") from None
    optional: dict[str, Any] = {"logprobs": num_logprobs} if num_logprobs is not None else {}
    optional["n"] = body.n
    try:
        constraint = body.constraint()
        if constraint is not None:
            optional["structured_outputs"] = StructuredOutputsParams(**constraint)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="response_format") from None
    except TokenleapError as exc:
        raise APIError(400, str(exc), param="response_format") from None
    optional |= {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                              "repetition_penalty", "min_tokens", "include_stop_str_in_output", "skip_special_tokens")
                if getattr(body, k) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=body.stop, stop_token_ids=tuple(body.stop_token_ids or ()),
                              ignore_eos=body.ignore_eos, **optional)
    except TokenleapError as exc:
        raise bad_request(exc) from None


_SERVER_SIDE_METHODS = {"custom", "draft-model", "eagle3", "eagle", "medusa", "chain"}  # need objects or files only the server's operator may choose


def speculative(state: ServerState, override: SpeculativeOverride | None) -> SpecConfig | bool:
    """The request's speculation: True (the server's default), False (off) or an override."""
    if override is None:
        return True
    method = override.method.strip().lower()
    if method in ("none", "off"):
        return False
    knobs = override.knobs()
    default = state.llm.engine.spec
    cap = state.max_draft_tokens
    if knobs.get("num_speculative_tokens", 0) > cap:  # its cost curve was not measured: refuse
        raise APIError(400, f"num_speculative_tokens must be <= {cap} on this server (its --max-num-speculative-tokens), "
                       f"got {knobs['num_speculative_tokens']}", param="speculative")
    knobs.setdefault("num_speculative_tokens", default.num_speculative_tokens if default is not None else min(cap, DEFAULT_DRAFT_TOKENS))
    spec = None
    if default is not None:  # the same method as the server's: start from the server's settings
        try:
            candidate = dataclasses.replace(default, method=method, **knobs)
            if candidate.method == default.method and candidate.chain == default.chain:
                spec = candidate
        except TokenleapError:
            spec = None
    if spec is None:
        parts = {p.strip().replace("_", "-") for p in method.split("+")}
        if parts & _SERVER_SIDE_METHODS:
            raise APIError(400, f"speculative method {method!r} is not available per request on this server (a draft model "
                           "is chosen when the server starts: --spec-type draft-model --model-draft ...)", param="speculative")
        try:
            spec = SpecConfig.from_dict({"method": method, **knobs})
        except TokenleapError as exc:
            raise bad_request(exc, "speculative") from None
    assert spec is not None
    return True if spec == default else spec


def _method_name(state: ServerState, spec: SpecConfig | bool) -> str | None:
    if spec is False:
        return None
    s = state.llm.engine.spec if spec is True else spec
    if s is None or isinstance(s, bool):
        return None
    return "+".join(s.chain) if s.method == "chain" else s.method


async def chat_completions(request: Request, state: ServerState) -> Response:
    body = parse_body(await read_body(request, state.config.max_request_bytes), ChatCompletionRequest)
    check_model(state, body.model)
    try:
        plan = plan_tools(body.tools, body.tool_choice)
    except TokenleapError as exc:
        raise bad_request(exc, "tool_choice" if body.tool_choice not in (None, "auto", "none") else "tools") from None
    try:
        ids = await run_in_threadpool(encode_chat, state.llm.tokenizer, body.conversation(), plan)
    except TokenleapError as exc:
        raise bad_request(exc, "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, len(ids), state)
    tool_constraint = plan.constraint()
    if tool_constraint is not None and not (plan.choice == "auto" and params.structured_outputs is not None):
        if params.structured_outputs is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with response_format or guided_*",
                           param="tool_choice")
        params = dataclasses.replace(params, structured_outputs=tool_constraint)
    spec = speculative(state, body.speculative)
    request_id = new_id("chatcmpl")
    fmt_args = (request_id, body.model or state.model_name, _method_name(state, spec), params.logprobs or 0)
    fmt = tool_formatter(ChatFormatter, plan, *fmt_args) if plan.active else ChatFormatter(*fmt_args)
    return await _run(request, state, Job(request_id, ids, params, spec), fmt, body.stream,
                      bool(body.stream_options and body.stream_options.include_usage))


async def completions(request: Request, state: ServerState) -> Response:
    body = parse_body(await read_body(request, state.config.max_request_bytes), CompletionRequest)
    check_model(state, body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"batched prompts are not supported: send one prompt per request (got {len(prompt)})", param="prompt")
        prompt = prompt[0]  # type: ignore[assignment]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    text = prompt if isinstance(prompt, str) else None
    ids = await run_in_threadpool(state.llm.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)  # type: ignore[arg-type]
    try:
        check_token_ids(ids, state.llm.model.config.vocab_size)
    except TokenleapError as exc:
        raise bad_request(exc, "prompt") from None
    params = sampling_params(body, body.max_tokens, len(ids), state)
    spec = speculative(state, body.speculative)
    request_id = new_id("cmpl")
    fmt = CompletionFormatter(request_id, body.model or state.model_name, _method_name(state, spec), params.logprobs or 0)
    return await _run(request, state, Job(request_id, ids, params, spec, prompt=text), fmt, body.stream,
                      bool(body.stream_options and body.stream_options.include_usage))


async def _run(request: Request, state: ServerState, job: Job, fmt: Formatter, stream: bool, include_usage: bool) -> Response:
    if job.params.n > 1:
        return await _run_samples(request, state, job, fmt, stream, include_usage)
    try:
        handle = state.loop.submit(job, asyncio.get_running_loop())
    except QueueFull as exc:
        raise APIError(429, str(exc)) from None
    except ServerClosed as exc:
        raise APIError(503, str(exc)) from None
    if stream:
        return AbortingStreamingResponse(_sse(handle, fmt, include_usage), on_close=handle.abort, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        out = await _until_disconnect(request, _collect(handle))
    finally:
        handle.abort()  # a no-op once finished; frees the request on a disconnect or cancellation
    if out is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(fmt.response(out))


async def _run_samples(request: Request, state: ServerState, job: Job, fmt: Formatter, stream: bool, include_usage: bool) -> Response:
    """n > 1: the samples as separate engine requests (sample i seeded seed + i, as the library
    does), batched by the engine loop, answered together with one choice each; streamed, their
    chunks interleave as they come, each with its choice index."""
    p = job.params
    handles: list[RequestHandle] = []
    try:
        for i in range(p.n):
            params = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i)
            handles.append(state.loop.submit(dataclasses.replace(job, request_id=f"{job.request_id}-{i}", params=params),
                                             asyncio.get_running_loop()))
    except (QueueFull, ServerClosed) as exc:
        for h in handles:
            h.abort()
        raise APIError(429 if isinstance(exc, QueueFull) else 503, str(exc)) from None
    if stream:
        def abort_all() -> None:
            for h in handles:
                h.abort()

        return AbortingStreamingResponse(_sse_samples(handles, fmt, include_usage), on_close=abort_all, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        outs = await _until_disconnect(request, asyncio.gather(*(_collect(h) for h in handles)))
    finally:
        for h in handles:
            h.abort()
    if outs is None:
        return Response(status_code=499)
    for i, o in enumerate(outs):
        o.outputs[0].index = i
    return JSONResponse(fmt.response(merge_samples(list(outs))))


async def _collect(handle: RequestHandle) -> RequestOutput:
    while True:
        ev = await handle.events.get()
        if ev.kind == "done":
            assert ev.output is not None
            return ev.output
        if ev.kind == "error":
            raise APIError(ev.status, ev.message)


async def _until_disconnect(request: Request, work: Any) -> RequestOutput | None:
    """Run `work` unless the client disconnects first (then None)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    return None


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(handle: RequestHandle, fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
    def chunk(c: dict[str, Any]) -> str:
        if include_usage:  # OpenAI: "usage": null on every chunk, the counts on a last, choice-less one
            c.setdefault("usage", None)
        return _data(c)

    for c in fmt.first_chunks():
        yield chunk(c)
    while True:
        ev = await handle.events.get()
        if ev.kind == "delta":
            delta = fmt.delta_chunk(ev.text)
            if delta is not None:  # a formatter may hold text back (tool calls)
                yield chunk(delta)
        elif ev.kind == "done":
            assert ev.output is not None
            for c in fmt.final_chunks(ev.output):
                yield chunk(c)
            if include_usage:
                yield chunk(fmt.usage_chunk(ev.output))
            break
        else:
            yield _data(APIError(ev.status, ev.message).body())
            break
    yield "data: [DONE]\n\n"


async def _sse_samples(handles: list[RequestHandle], fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
    """The n samples' streams as one: each sample's chunks (from its own copy of the formatter)
    with its choice index, in arrival order; one usage chunk over all samples at the end."""
    queue: asyncio.Queue[tuple[str | None, RequestOutput | None]] = asyncio.Queue()

    def put(i: int, c: dict[str, Any]) -> None:
        for choice in c.get("choices", []):
            choice["index"] = i
        if include_usage:
            c.setdefault("usage", None)
        queue.put_nowait((_data(c), None))

    async def pump(i: int, handle: RequestHandle) -> None:
        f = copy.copy(fmt)  # a formatter may hold per-answer state (tool calls)
        out = None
        try:
            for c in f.first_chunks():
                put(i, c)
            while True:
                ev = await handle.events.get()
                if ev.kind == "delta":
                    delta = f.delta_chunk(ev.text)
                    if delta is not None:
                        put(i, delta)
                elif ev.kind == "done":
                    assert ev.output is not None
                    out = ev.output
                    out.outputs[0].index = i
                    for c in f.final_chunks(out):
                        put(i, c)
                    break
                else:
                    queue.put_nowait((_data(APIError(ev.status, ev.message).body()), None))
                    break
        finally:
            queue.put_nowait((None, out))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    outs: list[RequestOutput] = []
    try:
        left = len(handles)
        while left:
            text, out = await queue.get()
            if text is not None:
                yield text
                continue
            left -= 1
            if out is not None:
                outs.append(out)
        if include_usage and len(outs) == len(handles):
            yield _data(fmt.usage_chunk(merge_samples(outs)))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that calls `on_close` however it ends (finished, client gone,
    task cancelled), so the engine frees the request."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
