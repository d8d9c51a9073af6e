"""Tool calling in OpenAI's form: tools into the prompt, tool calls out of the model's text.

The prompt side. A chat template that knows tools (Qwen2.5's, Llama-3.1's, Hermes') gets them as
transformers passes them: `tools` a list of {"type": "function", "function": {...}}, an assistant
turn's `tool_calls` with `arguments` as an object (the JSON string a client sends is parsed, as
vLLM does), a `tool` turn's `tool_call_id`. A template that never mentions tools (SmolLM2's) would
drop them silently, so the conversation is written for it in the Hermes convention Qwen2.5 uses:
the tools' JSON in a system message, earlier calls as <tool_call> blocks, tool results as user
turns in <tool_response> blocks.

The output side, by `tool_choice`:
- "auto": the model writes text; each <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  block naming a given tool becomes a call, the text outside the blocks stays content. A block that
  does not parse (or names no given tool) is left in the content: nothing the model wrote is lost.
- "required": the output is constrained (specserve.sampling.grammar) to a JSON array of
  {"name": one of the tools, "arguments": that tool's parameters schema}, one item when
  `parallel_tool_calls` is false; every item is a call.
- {"type": "function", "function": {"name": N}}: constrained to N's parameters schema; the output
  is that call's arguments.
- "none": no call is parsed (the tools still reach the template, as with vLLM and OpenAI).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specserve.errors import InvalidRequestError

# What json.loads raises on text that is not JSON, and on JSON nested past Python's recursion limit
# (RecursionError is no ValueError: such an argument string or model output was a 500).
NOT_JSON = (ValueError, RecursionError)

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape ({"id", "type", "function": {"name", "arguments"}}; `index` in a stream)."""
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, param: str = "tools") -> list[dict[str, Any]]:
    """The tools as templates take them ({"type": "function", "function": {name, description?,
    parameters?}}), checked: names unique and OpenAI-shaped, parameters an object schema, a
    tool_choice that names a given tool, or asks for a call only when there are tools."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), Mapping):
            raise InvalidRequestError(f"{param}[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}.",
                                      param=f"{param}[{i}]")
        fn = dict(tool["function"])
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{param}[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}.",
                                      param=f"{param}[{i}].function.name")
        if any(t["function"]["name"] == name for t in out):
            raise InvalidRequestError(f"{param}[{i}]: two tools are named {name!r}.", param=f"{param}[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidRequestError(f"{param}[{i}].function.parameters must be a JSON schema object.",
                                      param=f"{param}[{i}].function.parameters")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    names = [t["function"]["name"] for t in out]
    if isinstance(tool_choice, Mapping):
        want = tool_choice["function"]["name"]
        if want not in names:
            raise InvalidRequestError(f"tool_choice names {want!r}, which is not among the tools {names}.", param="tool_choice")
    elif tool_choice in ("auto", "required") and not out:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools.", param="tool_choice")
    return out


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    return dict(tool["function"].get("parameters") or {"type": "object"})


def forced_schema(tools: Sequence[Mapping[str, Any]], tool_choice: Any, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the output is held to: the named tool's parameters, or for "required" an
    array of {"name", "arguments"} items over the tools (one item without parallel calls); None
    when the model chooses (auto / none)."""
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice != "required":
        return None
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice: Any) -> list[ToolCall] | None:
    """The calls in a constrained output (see forced_schema), or None when it does not parse (an
    output cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except NOT_JSON:
        return None
    if isinstance(tool_choice, Mapping):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False), new_call_id())]
    if not isinstance(value, list):
        return None
    return [ToolCall(v["name"], json.dumps(v["arguments"], ensure_ascii=False), new_call_id())
            for v in value if isinstance(v, dict) and isinstance(v.get("name"), str) and "arguments" in v]


def parse_calls(text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a freely written output: each <tool_call> block holding JSON
    {"name": a given tool, "arguments": an object (or its JSON text)} becomes a call; the rest of
    the text is the content (None when only whitespace is left beside calls). Without such
    blocks, an output that is nothing but such an object, a list of them or several one after
    another (bare, or alone in a ``` / ```json fence: Llama-3.1's form, and how Qwen2.5-Coder
    answers) is the calls."""
    whole = _whole_output_calls(text, names)
    if whole:
        return None, whole
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        call = _block_call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept)
    if calls and not content.strip():
        return None, calls
    return content, calls


_FENCED = re.compile(r"^```(?:json)?\s*\n(.*)\n\s*```$", re.DOTALL)
# The start of an output that may be a whole-output call (see parse_calls): undecided, then held.
_MAY_FENCE = re.compile(r"^`{0,3}$|^```j?s?o?n?$|^```(?:json)?\s*$")
_CALL_START = re.compile(r"^(?:```(?:json)?\s*)?[\[{]")


def _whole_output_calls(text: str, names: Sequence[str]) -> list[ToolCall] | None:
    body = text.strip()
    fenced = _FENCED.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if body[:1] not in ("{", "["):
        return None
    items: list[Any] = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):  # one value, or objects one after another (newlines or ';' between: Llama-3.1's parallel calls)
        try:
            value, at = decoder.raw_decode(body, at)
        except NOT_JSON:
            return None
        items += value if isinstance(value, list) and not items else [value]
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    calls = [_value_call(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _block_call(body: str, names: Sequence[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except NOT_JSON:
        return None
    return _value_call(value, names)


def _value_call(value: Any, names: Sequence[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments' JSON text
        try:
            args = json.loads(args)
        except NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False), new_call_id())


class CallStream:
    """Streams a freely written output's content while holding back what may be a tool call: text
    from a <tool_call> on (and a tail that could begin one) waits for the end, where
    `finish` parses it as parse_calls does."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.held = False  # a <tool_call> opened, or the output may be one JSON call: nothing more streams
        self.opening = True  # nothing decided yet about a whole-output call
        self.spoke = False  # content other than whitespace has been streamed

    def feed(self, delta: str) -> str:
        """The content that can go out now."""
        self.text += delta
        if self.held:
            return ""
        if self.opening:
            start = self.text.lstrip()
            if _CALL_START.match(start):
                self.held = True
                return ""
            if _MAY_FENCE.match(start):
                return ""
            self.opening = False
        at = self.text.find(TOOL_OPEN, self.sent)
        if at >= 0:
            self.held = True
            return self._send(at)
        safe = len(self.text)
        for k in range(min(len(TOOL_OPEN) - 1, len(self.text) - self.sent), 0, -1):
            if TOOL_OPEN.startswith(self.text[-k:]):
                safe -= k
                break
        return self._send(safe)

    def _send(self, end: int) -> str:
        """The text up to end as content; whitespace before any other content waits (beside calls
        alone it is no content: parse_calls' rule)."""
        out = self.text[self.sent : end]
        if not self.spoke and not out.strip():
            return ""
        self.spoke, self.sent = True, end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet streamed, the calls) once the output is complete."""
        # The whole text's content: whitespace after the last call is content beside what was
        # streamed, though alone it would be none. What streamed is always its beginning.
        content, calls = parse_calls(self.text, self.names)
        return (content or "")[self.sent :], calls


# ----------------------------------------------------------------------------- the prompt side
def template_mentions_tools(source: str | None) -> bool:
    """Whether a chat template reads `tools` (else they would be dropped without a word)."""
    return bool(source) and re.search(r"\btools\b", source) is not None


def hermes_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools for a template that does not take them: the Hermes / Qwen2.5 convention."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn's earlier calls as <tool_call> blocks (for a template without tools)."""
    return "\n".join(f'{TOOL_OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)}\n{TOOL_CLOSE}'
                     for c in calls)


def as_plain_chat(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tools, calls and results written as text, for a template that knows none of them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(x for x in (m["content"], call_text(m["tool_calls"])) if x)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        text = hermes_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
