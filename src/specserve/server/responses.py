"""OpenAI's Responses API (POST /v1/responses) on the chat completions path.

A Responses request is a conversation (`instructions`, then `input`: a string or a list of
messages, function calls and their outputs) with sampling fields under other names
(`max_output_tokens`, `text.format`, flat function `tools`). `to_chat` writes it as a chat
completions request, so the chat template, tool calling, structured output, speculation and
every check of that path apply unchanged; `response_body` and `ResponseEvents` write the chat
path's answer back as a Response object or as its typed stream events (`response.created`, ...,
`response.output_text.delta`, ..., `response.completed`). Responses are not stored: a
`previous_response_id` is refused (send the whole conversation as `input`, as with chat
completions), and `store` asks for nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from specserve.server.protocol import ToolFunction, _Body, refuse_invalid_text

# Fields of the Responses API specserve does not implement, at the values that ask for nothing.
_NOOP_RESPONSE_VALUES: dict[str, tuple[Any, ...]] = {
    "store": (False, True), "truncation": ("disabled",), "include": ([],), "service_tier": ("auto", "default"),
    "background": (False,), "reasoning": ({},), "stream_options": ({},),
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class InputText(_Body):
    """A text part of an input message (`output_text` in an earlier assistant turn sent back)."""

    NOOP_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {"annotations": ([],), "logprobs": ([],)}
    type: Literal["input_text", "output_text"]
    text: str


class _Item(_Body):
    """An input item; an earlier response's output item sent back keeps its id and status."""

    id: str | None = None
    status: str | None = None


class InputMessage(_Item):
    """A message of the conversation; `developer` is a system message."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        """The message's text (its parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    """A call an earlier assistant turn made (sent back with its output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_Item):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(ToolFunction):
    """A function the model may call (the Responses API's flat form of a chat tool's function)."""

    type: Literal["function"]


class FunctionChoice(_Body):
    """tool_choice {"type": "function", "name": ...}: call this tool."""

    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """text.format: plain text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        """json_schema without `schema` would constrain nothing; OpenAI refuses it too."""
        if self.type == "json_schema" and self.schema_ is None:
            raise PydanticCustomError("missing_schema", 'format json_schema needs "schema": the JSON Schema the '
                                      "output must validate against", {"param": "schema"})
        return self


class TextConfig(_Body):
    """`text`: the output's format."""

    NOOP_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {"verbosity": ("medium",)}
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    NOOP_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = _NOOP_RESPONSE_VALUES
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    # specserve's and vLLM's extras, as on chat completions
    seed: StrictInt | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    speculative: StrictBool | None = None
    priority: StrictInt = 0
    request_class: str = "default"

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:  # metadata and text.format are echoed back: a lone
        return refuse_invalid_text(data)  # surrogate there failed the answer after its tokens (a 500)

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        """An input item without `type` is a message (the API's easy input message)."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            items = [({"type": "message", **item} if isinstance(item, dict) and "type" not in item else item)
                     for item in data["input"]]
            data = {**data, "input": items}
        return data

    @model_validator(mode="after")
    def _no_stored_responses(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise PydanticCustomError("unsupported_field", "responses are not stored here, so previous_response_id cannot "
                                      "be followed; send the whole conversation as `input`",
                                      {"param": "previous_response_id"})
        return self


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request body that asks for the same answer."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # the calls of one turn, in order
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls,
        "priority": req.priority, "request_class": req.request_class,
    }
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "speculative", "user"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str)
                               else {"type": "function", "function": {"name": req.tool_choice.name}})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.schema_}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


# The chat request's fields as the Responses request names them (an error's `param`).
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


def response_param(param: str | None) -> str | None:
    """The Responses field behind a chat request's field named in an error."""
    if param is None:
        return None
    head, sep, rest = param.partition(".")
    bracket = head.find("[")
    key = head if bracket < 0 else head[:bracket]
    mapped = _PARAMS.get(key)
    return param if mapped is None else mapped + head[len(key):] + sep + rest


class _Shell:
    """The fields every Response object of one request repeats."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id, self.created = _id("resp"), int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             incomplete: str | None = None) -> dict[str, Any]:
        """The Response object with this status, output items and usage."""
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
        tool_choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else req.tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage.get("prompt_tokens", 0), "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage.get("total_tokens", 0)}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
            "name": fn.get("name", ""), "arguments": fn.get("arguments", "{}"), "status": status}


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of an answer that finished for this chat finish_reason."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)


def response_body(req: ResponsesRequest, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The Response object of a chat completion's body (one choice)."""
    shell = _Shell(req, model)
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    status, incomplete = _status(choice.get("finish_reason"))
    calls = msg.get("tool_calls") or []
    output = []
    if msg.get("content") or not calls:
        output.append(_message(_id("msg"), msg.get("content") or "", status))
    output += [_call(c) for c in calls]
    return shell.body(status, output, _usage(chat.get("usage")), incomplete)


class ResponseEvents:
    """The Responses stream's events, written from a chat completion stream's chunks: `feed`
    each chunk (its JSON), and `finish` at its end; each returns the SSE text to send."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.shell = _Shell(req, model)
        self.seq = 0
        self.text: list[str] = []
        self.msg_id: str | None = None
        self.calls: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed = False

    def _event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> str:
        """response.created and response.in_progress."""
        body = self.shell.body("in_progress", [], None)
        return self._event("response.created", response=body) + self._event("response.in_progress", response=body)

    def _open_message(self) -> str:
        self.msg_id = _id("msg")
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return (self._event("response.output_item.added", output_index=0, item=item)
                + self._event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                              part=part))

    def feed(self, chunk: dict[str, Any]) -> str:
        """One chat completion chunk (or the error body a stream may end with)."""
        if "error" in chunk:
            self.failed = True
            err = chunk["error"] or {}
            return self._event("error", code=err.get("code") or err.get("type"), message=err.get("message", ""),
                               param=err.get("param"))
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        out = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.msg_id is None:
                    out.append(self._open_message())
                self.text.append(delta["content"])
                out.append(self._event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                       content_index=0, delta=delta["content"], logprobs=[]))
            self.calls += delta.get("tool_calls") or []
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return "".join(out)

    def finish(self) -> str:
        """The end of the stream: the items' done events and response.completed (or .incomplete)."""
        if self.failed:
            return ""
        status, incomplete = _status(self.finish_reason)
        out, output = [], []
        if self.msg_id is None and not self.calls:
            out.append(self._open_message())
        if self.msg_id is not None:
            text = "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": []}
            item = _message(self.msg_id, text, status)
            out.append(self._event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                                   text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=self.msg_id, output_index=0,
                                   content_index=0, part=part))
            out.append(self._event("response.output_item.done", output_index=0, item=item))
            output.append(item)
        for call in self.calls:
            index = len(output)
            item = _call(call)
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"}))
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"]))
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
            output.append(item)
        body = self.shell.body(status, output, self.usage, incomplete)
        out.append(self._event("response.incomplete" if incomplete else "response.completed", response=body))
        return "".join(out)
