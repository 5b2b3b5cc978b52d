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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenleap.config import DEFAULT_DRAFT_TOKENS
from tokenleap.drafters.options import builtin_option_names, merge_options, split_options
from tokenleap.drafters.registry import members
from tokenleap.drafters.server_schema import server_side_methods
from tokenleap.drafters.spec import SpecConfig
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM, merge_samples
from tokenleap.sampling import MAX_N, SamplingParams, check_token_ids
from tokenleap.server.config import ServerConfig
from tokenleap.server.errors import APIError, bad_request
from tokenleap.server.loop import EngineLoop, Job, QueueFull, RequestHandle, ServerClosed, sample_jobs
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
from tokenleap.server.tools import encode_chat, legacy_tools, plan_tools, tool_formatter
from tokenleap.structured import StructuredOutputsParams
from tokenleap.types import CompletionOutput, RequestOutput

M = TypeVar("M", bound=BaseModel)
_T = TypeVar("_T")
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
    too_big = APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large"
    )
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
    refused = body.refusals()
    if refused:
        raise APIError(400, refused[0][1], param=refused[0][0])
    if body.stream_options is not None and body.stream_options.include_usage and not body.stream:
        raise APIError(400, "stream_options.include_usage is only allowed with stream=true", param="stream_options")
    try:
        num_logprobs = body.num_logprobs()
    except ValueError as exc:
        raise APIError(400, str(exc), param="top_logprobs") from None
    ctx = state.max_context
    if prompt_len >= ctx:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens but the context length is {ctx}: no room left to generate",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    room = ctx - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
        )
    stops = body.stops()
    if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stops):
        raise APIError(
            400, f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each", param="stop"
        )
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
        constraint = body.constraint(state.config.json_schema_mode)
        if constraint is not None:
            optional["structured_outputs"] = StructuredOutputsParams(**constraint)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="response_format") from None
    except TokenleapError as exc:
        raise APIError(400, str(exc), param="response_format") from None
    optional |= {
        k: getattr(body, k)
        for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_tokens", "include_stop_str_in_output", "skip_special_tokens"
        )
        if getattr(body, k) is not None
    }
    if optional.get("top_p") == 0:  # OpenAI's range is [0, 1]: 0 keeps only the most likely token
        optional["top_p"] = 1e-12
    try:
        return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=tuple(stops or ()),
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, **optional)
    except TokenleapError as exc:
        raise bad_request(exc) from None


def speculative(state: ServerState, override: SpeculativeOverride | None) -> SpecConfig | bool:
    """The request's speculation: True (the server's default), False (off) or an override."""
    if override is None:
        return True
    method = override.method.strip().lower()
    if method in ("none", "off"):
        return False
    knobs = override.knobs()
    default = state.llm.engine.spec
    if override.method_options():  # methods' own options (method records): {method: {option: value}} over the server's
        options, rest = split_options(method, override.method_options())
        # a built-in method's option: checked and dropped, as in the library
        foreign = sorted(set(rest) - builtin_option_names())
        if foreign:
            raise APIError(
                400, f"speculative method {method!r} has no option(s) {', '.join(foreign)}", param="speculative"
            )
        knobs["method_options"] = merge_options(default.method_options if default is not None else None, options)
        knobs.update(rest)
    cap = state.max_draft_tokens
    if knobs.get("num_speculative_tokens", 0) > cap:  # its cost curve was not measured: refuse
        raise APIError(
            400,
            f"num_speculative_tokens must be <= {cap} on this server (its --max-num-speculative-tokens), "
            f"got {knobs['num_speculative_tokens']}",
            param="speculative",
        )
    knobs.setdefault(
        "num_speculative_tokens",
        default.num_speculative_tokens if default is not None else min(cap, DEFAULT_DRAFT_TOKENS),
    )
    spec = None
    if default is not None:  # the same method as the server's: start from the server's settings
        try:
            candidate = dataclasses.replace(default, method=method, **knobs)
            if candidate.method == default.method and candidate.chain == default.chain:
                spec = candidate
        except TokenleapError:
            spec = None
    if spec is None:
        parts = set(members(method))
        if parts & server_side_methods():  # need objects or files only the server's operator may choose
            raise APIError(
                400,
                f"speculative method {method!r} is not available per request on this server (a draft model "
                "is chosen when the server starts: --spec-type draft-model --model-draft ...)",
                param="speculative",
            )
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
    tools, tool_choice, legacy = body.tools, body.tool_choice, False
    if body.functions is not None or body.function_call is not None:  # deprecated: tools too when both are given
        legacy = tools is None and tool_choice is None
        more, choice = legacy_tools(body.functions or [], body.function_call)
        tools, tool_choice = (tools or []) + more, (tool_choice if tool_choice is not None else choice)
    json_mode = body.json_schema_mode or state.config.json_schema_mode
    try:
        plan = plan_tools(tools, tool_choice, parallel=body.parallel_tool_calls, json_mode=json_mode, legacy=legacy)
    except TokenleapError as exc:
        about_tools = str(exc).startswith(("tools[", "tool '")) or tool_choice in (None, "auto", "none")
        param = ("functions" if legacy else "tools") if about_tools else ("function_call" if legacy else "tool_choice")
        raise bad_request(exc, param) from None
    try:
        conversation = body.conversation()
    except (ValueError, TokenleapError) as exc:
        raise APIError(400, str(exc), param="messages") from None
    try:
        ids = await run_in_threadpool(encode_chat, state.llm.tokenizer, conversation, plan)
    except TokenleapError as exc:
        raise bad_request(exc, "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, len(ids), state)
    tool_constraint = plan.constraint()
    if tool_constraint is not None and not (plan.choice == "auto" and params.structured_outputs is not None):
        if params.structured_outputs is not None:
            raise APIError(
                400,
                "tool_choice 'required' or a named function cannot be combined with response_format or guided_*",
                param="tool_choice",
            )
        params = dataclasses.replace(params, structured_outputs=tool_constraint)
    spec = speculative(state, body.speculative)
    request_id = new_id("chatcmpl")
    fmt_args = (request_id, body.model or state.model_name, _method_name(state, spec), params.logprobs or 0)
    fmt_kwargs: dict[str, Any] = {"service_tier": body.service_tier}
    fmt = (
        tool_formatter(ChatFormatter, plan, *fmt_args, **fmt_kwargs)
        if plan.active
        else ChatFormatter(*fmt_args, **fmt_kwargs)
    )
    jobs = [Job(request_id, ids, params, spec)]
    return await _run(
        request, state, jobs, fmt, body.stream, bool(body.stream_options and body.stream_options.include_usage)
    )


async def completions(request: Request, state: ServerState) -> Response:
    body = parse_body(await read_body(request, state.config.max_request_bytes), CompletionRequest)
    check_model(state, body.model)
    prompts = body.prompts()
    if not 1 <= body.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    best_of = body.best_of if body.best_of not in (None, 0) else body.n
    if best_of < body.n or best_of > MAX_N:
        raise APIError(400, f"best_of must be in [n, {MAX_N}] (n = {body.n}), got {body.best_of}", param="best_of")
    if best_of > body.n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed", param="best_of")
    if len(prompts) * best_of > MAX_N:
        raise APIError(
            400, f"at most {MAX_N} completions per request: {len(prompts)} prompts x {best_of} each", param="prompt"
        )
    tok = state.llm.tokenizer
    ids_list: list[list[int]] = []
    for p in prompts:
        ids = [] if p is None else (await run_in_threadpool(tok.encode, p) if isinstance(p, str) else list(p))
        ids = ids or [_document_start(tok.hf)]  # no prompt (or one that is no tokens): a new document
        try:
            check_token_ids(ids, state.llm.model.config.vocab_size)
        except TokenleapError as exc:
            raise bad_request(exc, "prompt") from None
        ids_list.append(ids)
    longest = max(len(ids) for ids in ids_list)
    scoring = body.max_tokens == 0  # OpenAI: with echo, the prompt alone
    params = sampling_params(body, 1 if scoring else body.max_tokens, longest, state)
    best_of = body.n if scoring else best_of
    if best_of > body.n:
        params = dataclasses.replace(params, n=best_of, logprobs=params.logprobs or 0)  # ranked by mean log-probability
    spec = speculative(state, body.speculative)
    request_id = new_id("cmpl")
    texts = [p if isinstance(p, str) else ("" if p is None else tok.decode(p)) for p in prompts]
    echo = tuple(t for t in texts for _ in range(body.n)) if body.echo else ()
    fmt = CompletionFormatter(
        request_id, body.model or state.model_name, _method_name(state, spec), body.logprobs or 0, echo=echo
    )
    fmt.prompt_tokens = sum(len(ids) for ids in ids_list)
    # one per prompt, of params.n samples (one prefill each)
    jobs = [
        Job(
            f"{request_id}-p{i}" if len(prompts) > 1 else request_id,
            ids,
            params,
            spec,
            prompt=text if isinstance(prompts[i], str) else None,
        )
        for i, (ids, text) in enumerate(zip(ids_list, texts))
    ]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if scoring:
        outs = [RequestOutput(j.request_id, j.prompt, j.prompt_ids, [CompletionOutput(0, "", [], "length")], True)
                for job in jobs for j in sample_jobs(job)]
        return _answer(fmt, outs, body.stream, include_usage)
    if best_of > body.n:
        collected = await _collect_all(request, state, jobs)
        if collected is None:
            return Response(status_code=499)
        return JSONResponse(fmt.response(_merge(_best(collected, best_of, body.n, body.logprobs is not None))))
    return await _run(request, state, jobs, fmt, body.stream, include_usage)


def _document_start(hf: Any) -> int:
    """The token a prompt-less completion starts from: the document separator OpenAI names
    (`<|endoftext|>`) where the vocabulary has it, else BOS, else EOS."""
    sep = hf.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(sep, int) and sep != hf.unk_token_id:
        return sep
    return hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id


def _best(outs: list[RequestOutput], best_of: int, n: int, keep_logprobs: bool) -> list[RequestOutput]:
    """best_of: per prompt, the n samples of highest mean log-probability per token, in that order."""
    kept = []
    for k in range(0, len(outs), best_of):
        group = outs[k : k + best_of]
        group.sort(key=lambda o: -(o.outputs[0].cumulative_logprob or 0.0) / max(1, len(o.outputs[0].token_ids)))
        kept += group[:n]
    if not keep_logprobs:
        for o in kept:
            o.outputs[0].logprobs = None
            o.outputs[0].cumulative_logprob = None
    return kept


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """The engine requests' answers as one, each its choice in order."""
    for i, o in enumerate(outs):
        o.outputs[0].index = i
    return merge_samples(outs)


def _answer(fmt: Formatter, outs: list[RequestOutput], stream: bool, include_usage: bool) -> Response:
    """An answer known without running the engine (max_tokens 0)."""
    merged = _merge(outs)
    if not stream:
        return JSONResponse(fmt.response(merged))

    async def chunks() -> AsyncIterator[str]:
        for i, o in enumerate(outs):
            f = copy.copy(fmt)
            f.choice = i
            for c in [*f.first_chunks(), *f.final_chunks(o)]:
                for choice in c.get("choices", []):
                    choice["index"] = i
                if include_usage:
                    c.setdefault("usage", None)
                yield _data(c)
        if include_usage:
            yield _data(fmt.usage_chunk(merged))
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _submit_all(state: ServerState, jobs: list[Job]) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for job in jobs:  # a job's samples share one prefill (the scheduler forks its KV cache)
            handles += state.loop.submit_samples(job, asyncio.get_running_loop())
    except (QueueFull, ServerClosed) as exc:
        for h in handles:
            h.abort()
        raise APIError(429 if isinstance(exc, QueueFull) else 503, str(exc)) from None
    return handles


async def _collect_all(request: Request, state: ServerState, jobs: list[Job]) -> list[RequestOutput] | None:
    """Every sample's answer, job by job (None: the client went away)."""
    handles = _submit_all(state, jobs)
    try:
        outs = await _until_disconnect(request, asyncio.gather(*(_collect(h) for h in handles)))
    finally:
        for h in handles:
            h.abort()  # a no-op once finished; frees the requests on a disconnect or cancellation
    return None if outs is None else list(outs)


async def _run(
    request: Request, state: ServerState, jobs: list[Job], fmt: Formatter, stream: bool, include_usage: bool
) -> Response:
    """Run the engine requests of one answer (n samples, several prompts: one choice each, in
    order); streamed, their chunks interleave as they come, each with its choice index, and one
    usage chunk over them all ends the stream."""
    if len(jobs) == 1 and jobs[0].params.n == 1 and not stream:
        outs = await _collect_all(request, state, jobs)
        return Response(status_code=499) if outs is None else JSONResponse(fmt.response(outs[0]))
    if stream:
        handles = _submit_all(state, jobs)
        if len(handles) == 1:
            content = _sse(handles[0], fmt, include_usage)
        else:
            content = _sse_samples(handles, fmt, include_usage)

        def abort_all() -> None:
            for h in handles:
                h.abort()

        return AbortingStreamingResponse(content, on_close=abort_all, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outs = await _collect_all(request, state, jobs)
    if outs is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(fmt.response(_merge(outs)))


async def _collect(handle: RequestHandle) -> RequestOutput:
    while True:
        ev = await handle.events.get()
        if ev.kind == "done":
            assert ev.output is not None
            return ev.output
        if ev.kind == "error":
            raise APIError(ev.status, ev.message)


async def _until_disconnect(request: Request, work: Awaitable[_T]) -> _T | None:
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
        f.choice = i
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
            yield _data(fmt.usage_chunk(merge_samples(sorted(outs, key=lambda o: o.outputs[0].index))))
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
