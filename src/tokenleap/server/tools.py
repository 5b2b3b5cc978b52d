"""Tool calling for `/v1/chat/completions` (OpenAI `tools` / `tool_choice`), Hermes style.

The tools reach the model through its chat template when the template renders them (it reads a
`tools` variable); otherwise as a Hermes-format system message (NousResearch's Hermes 2 Pro
function-calling prompt, also what vLLM's `hermes` tool parser reads): the function signatures in
`<tools></tools>`, and each call answered as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

The answer is generated under a grammar (llguidance Lark with `%json` schemas): "required", one
or more calls whose `name` is a declared function and whose `arguments` follow its `parameters`
schema; a named function, one call of it; "auto", free text that never contains `<tool_call>`, or
text followed by such calls. So calls always parse and are valid, exactly as any structured output,
with or without speculation. The arguments' schemas are read as `structured.py` reads any JSON
schema (strictly by default: no undeclared property, bounded whitespace), so a call closes. "none"
ignores the tools; `{"type": "allowed_tools", ...}` narrows the callable functions (the prompt still
lists them all); `parallel_tool_calls: false` allows one call at most. A `response_format` /
`guided_*` constraint given with "auto" wins (the tools are then only parsed); with "required" or a
named function, 400. A message with calls is answered with `tool_calls` (arguments as a JSON
string) and finish reason "tool_calls"; the deprecated `functions` / `function_call` with
`message.function_call` and "function_call". An answer cut by `max_tokens` inside a call keeps
finish reason "length" and never shows the unfinished call's text as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenleap.errors import TokenleapError
from tokenleap.structured import StructuredOutputsParams, json_grammar_schema

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. "
    "You may call one or more functions to assist with the user query. Don't make assumptions about what values to "
    "plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function call return "
    "a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolPlan:
    """What a request's `tools` / `tool_choice` mean for its prompt, constraint and answer."""

    functions: tuple[Function, ...]
    choice: str  # "auto" | "required" | "named" | "none"
    named: str | None = None
    allowed: tuple[str, ...] | None = None  # allowed_tools: the functions a call may name (None: all)
    parallel: bool = True  # parallel_tool_calls: more than one call per answer
    json_mode: str = "strict"  # how the arguments' schemas are read (structured.py)
    legacy: bool = False  # the deprecated functions / function_call: answered with message.function_call

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def callable(self) -> list[Function]:
        """The functions a call may name."""
        if self.choice == "named":
            return [f for f in self.functions if f.name == self.named]
        return [f for f in self.functions if self.allowed is None or f.name in self.allowed]

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call's `{"name": ..., "arguments": ...}` object."""
        alternatives = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in self.callable()]
        schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        return json_grammar_schema(schema, self.json_mode)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of the answer (None for "none"): "required", one or more calls (one without
        parallel calls); a named function, one call of it; "auto", either text that never contains
        `<tool_call>`, or text followed by one or more calls (the tag's `suffix` rule: no
        backtracking)."""
        if not self.active:
            return None
        schema = json.dumps(self.call_schema())
        call = f'call: "<tool_call>\\n" %json {schema} "\\n</tool_call>"\n'
        more = "call*" if self.parallel else ""
        if self.choice == "auto":
            lark = ("start: PLAIN | text body " + more + "\n"
                    "PLAIN: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
                    'text[suffix="<tool_call>"]: /(.|\\n)*/\n'
                    f'body: "\\n" %json {schema} "\\n</tool_call>"\n' + call)
        else:
            lark = f"start: call{'+' if self.choice == 'required' and self.parallel else ''}\n" + call
        return StructuredOutputsParams(grammar=lark)

    def messages(self, conversation: list[dict[str, Any]], template_has_tools: bool) -> list[dict[str, Any]]:
        """The conversation with the tools described in a system message (templates that do not
        render `tools` themselves)."""
        if not self.active or template_has_tools:
            return conversation
        listing = "\n".join(json.dumps(f.as_tool()) for f in self.functions)
        system = HERMES_SYSTEM.format(tools=listing)
        if conversation and conversation[0]["role"] == "system":
            return [{"role": "system", "content": system + "\n\n" + conversation[0]["content"]}, *conversation[1:]]
        return [{"role": "system", "content": system}, *conversation]

    def tools(self) -> list[dict[str, Any]]:
        return [f.as_tool() for f in self.functions]


def plan_tools(tools: list[Any] | None, tool_choice: str | dict[str, Any] | None, *, parallel: bool = True,
               json_mode: str = "strict", legacy: bool = False) -> ToolPlan:
    """Check `tools` and `tool_choice` (TokenleapError, with the offending field, on bad input)."""
    funcs: list[Function] = []
    for i, t in enumerate(tools or []):
        if isinstance(t, dict) and t.get("type") == "custom":
            raise TokenleapError(f"tools[{i}]: custom tools are not supported by this server (only type 'function')")
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise TokenleapError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise TokenleapError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}"
            )
        if any(f.name == name for f in funcs):
            raise TokenleapError(f"tools[{i}]: duplicate function name {name!r}")
        params = fn.get("parameters")
        # OpenAI: no parameters, no arguments
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise TokenleapError(f"tools[{i}].function.parameters must be a JSON schema object")
        desc = fn.get("description", "")
        funcs.append(Function(name, desc if isinstance(desc, str) else "", params))
    choice, named, allowed = _choice(tool_choice, funcs)
    if choice in ("required", "named") and not funcs:
        raise TokenleapError(f"tool_choice {choice!r} needs tools")
    plan = ToolPlan(tuple(funcs), choice, named, allowed, parallel and not legacy, json_mode, legacy)
    for f in funcs:  # a bad parameters schema is a 400 now, not a failure mid-generation
        try:
            StructuredOutputsParams(
                json={"type": "object", "properties": {"arguments": f.parameters}},
                json_mode=json_mode,  # type: ignore[arg-type]  # a str here; StructuredOutputsParams checks its value
            )
        except TokenleapError as exc:
            raise TokenleapError(f"tool {f.name!r}: {exc}") from None
    return plan


def _named(spec: Any) -> str | None:
    """The function a `{"type": "function", "function": {"name": ...}}` (or `{"type": "function",
    "name": ...}`) names."""
    if not isinstance(spec, dict) or spec.get("type") != "function":
        return None
    fn = spec.get("function")
    name = fn.get("name") if isinstance(fn, dict) else spec.get("name")
    return name if isinstance(name, str) else None


def _choice(
    tool_choice: str | dict[str, Any] | None, funcs: list[Function]
) -> tuple[str, str | None, tuple[str, ...] | None]:
    """(choice, named function, allowed functions) of a `tool_choice`."""
    names = {f.name for f in funcs}
    if tool_choice is None:
        return ("auto" if funcs else "none"), None, None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise TokenleapError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}"
            )
        return tool_choice, None, None
    kind = tool_choice.get("type")
    if kind == "custom":
        raise TokenleapError("tool_choice: custom tools are not supported by this server (only type 'function')")
    if kind == "allowed_tools":
        spec = tool_choice.get("allowed_tools")
        mode = spec.get("mode") if isinstance(spec, dict) else None
        listed = spec.get("tools") if isinstance(spec, dict) else None
        if mode not in ("auto", "required") or not isinstance(listed, list):
            raise TokenleapError('tool_choice allowed_tools must be {"mode": "auto" | "required", "tools": [...]}')
        allowed = tuple(dict.fromkeys(_named(t) for t in listed))
        if not allowed or None in allowed:
            raise TokenleapError(
                'tool_choice allowed_tools.tools must list {"type": "function", "function": {"name": ...}} entries'
            )
        unknown = [n for n in allowed if n not in names]
        if unknown:
            raise TokenleapError(f"tool_choice allowed_tools names {unknown[0]!r}, which is not among the tools")
        return mode, None, allowed  # type: ignore[return-value]  # mode is 'auto' / 'required' and no name is None: both checked above
    named = _named(tool_choice)
    if named is None:
        raise TokenleapError('a named tool_choice must be {"type": "function", "function": {"name": ...}}')
    if named not in names:
        raise TokenleapError(f"tool_choice names {named!r}, which is not among the tools")
    return "named", named, None


def legacy_tools(
    functions: list[Any], function_call: str | dict[str, Any] | None
) -> tuple[list[Any], str | dict[str, Any] | None]:
    """The deprecated `functions` / `function_call` as `tools` / `tool_choice`."""
    tools = [{"type": "function", "function": f} for f in functions]
    if isinstance(function_call, dict):
        return tools, {"type": "function", "function": {"name": function_call.get("name")}}
    return tools, function_call


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, OpenAI `tool_calls`) from a Hermes-style answer.
    Blocks that are not a JSON call of a declared function are left in the content; an unfinished
    call (the answer was cut) is dropped with everything after it."""
    if not plan.active:
        return text, []
    first, calls = _calls(text, plan)
    if not calls:
        cut = text.find(_OPEN)
        if cut < 0:
            return text, []
        return (text[:cut].strip() or None), []
    content = text[:first].strip()
    return (content or None), calls


def _calls(text: str, plan: ToolPlan) -> tuple[int, list[dict[str, Any]]]:
    """(where the first valid call block starts, the calls)."""
    names = {f.name for f in plan.functions}
    calls: list[dict[str, Any]] = []
    first = None
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        first = m.start() if first is None else first
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return (len(text) if first is None else first), calls


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template reads the `tools` variable."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def render_message(role: str, content: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """One chat message as the template takes it, Hermes style: `developer` is `system`, an
    assistant's earlier calls become `<tool_call>` blocks after its text, a tool result a user
    turn in `<tool_response>` tags (templates without a `tool` role render it)."""
    if role == "developer":
        return {"role": "system", "content": content}
    if role in ("tool", "function"):  # "function": the deprecated spelling
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if role == "assistant" and tool_calls:
        blocks = []
        for c in tool_calls:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass  # not JSON: shown to the model as the string it is
            blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>")
        content = "\n".join(([content] if content else []) + blocks)
    return {"role": role, "content": content}


def encode_chat(tokenizer: Any, conversation: list[dict[str, Any]], plan: ToolPlan) -> list[int]:
    """Prompt ids: the template renders the tools itself when it reads `tools`, else they go in a
    Hermes system message."""
    if not plan.active:
        return tokenizer.apply_chat_template(conversation, True)
    hf = tokenizer.hf
    if template_renders_tools(getattr(hf, "chat_template", None)):
        text = hf.apply_chat_template(conversation, tools=plan.tools(), add_generation_prompt=True, tokenize=False)
        return list(hf.encode(text, add_special_tokens=False))
    return tokenizer.apply_chat_template(plan.messages(conversation, False), True)


def with_tool_calls(response: dict[str, Any], plan: ToolPlan) -> dict[str, Any]:
    """A chat completion body with its answers' `<tool_call>` blocks as OpenAI `tool_calls`."""
    if not plan.active:
        return response
    for choice in response.get("choices", []):
        message = choice["message"]
        content, calls = parse_tool_calls(message.get("content") or "", plan)
        message["content"] = content
        if calls and plan.legacy:
            message["function_call"] = calls[0]["function"]
        elif calls:
            message["tool_calls"] = calls
        if calls and choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "function_call" if plan.legacy else "tool_calls"
    return response


_OPEN = "<tool_call>"


def _held(text: str) -> int:
    """Characters at the end of `text` that could begin `<tool_call>`."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0


def tool_formatter(base: type, plan: ToolPlan, *args: Any, **kwargs: Any) -> Any:
    """A chat formatter (`base`: protocol.ChatFormatter) whose answers carry `tool_calls`. Streamed,
    text is sent as content until a `<tool_call>` may begin; the calls follow in one delta at the
    end (OpenAI's `tool_calls` delta shape, arguments whole), then the finish chunk."""

    class ToolChatFormatter(base):
        def __init__(self) -> None:
            super().__init__(*args, **kwargs)
            self._text = ""
            self._sent = 0

        def response(self, out: Any) -> dict[str, Any]:
            return with_tool_calls(super().response(out), plan)

        def delta_chunk(self, text: str) -> dict[str, Any] | None:
            self._text += text
            cut = self._text.find(_OPEN)
            end = cut if cut >= 0 else len(self._text) - _held(self._text)
            if end <= self._sent:
                return None
            delta, self._sent = self._text[self._sent : end], end
            return super().delta_chunk(delta)

        def final_chunks(self, out: Any) -> list[dict[str, Any]]:
            text = out.outputs[0].text
            first, calls = _calls(text, plan)
            if not calls and _OPEN in text:
                first = text.index(_OPEN)  # an unfinished call: never content
            chunks = []
            rest = text[self._sent : first]  # content not sent yet (all of it when there is no call)
            if rest:
                chunks.append(super().delta_chunk(rest))
            final = super().final_chunk(out)
            if calls:
                delta = ({"function_call": calls[0]["function"]} if plan.legacy
                         else {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                chunks.append(self._chunk(delta, None))
                if final["choices"][0]["finish_reason"] == "stop":
                    final["choices"][0]["finish_reason"] = "function_call" if plan.legacy else "tool_calls"
            return [*chunks, final]

    return ToolChatFormatter()
