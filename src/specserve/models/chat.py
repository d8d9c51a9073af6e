"""Chat messages to one prompt string: the same checks and rendering for the server and the LLM API.

Messages follow OpenAI's form (as vLLM's `LLM.chat` takes them): a role among ROLES, content as
a string, a list of text parts ({"type": "text", "text": ...}) or None, an optional name. The
`developer` role (OpenAI's newer name for system) reaches the template as `system`, which is the
role chat templates know. A bad message raises ChatError naming the field (`messages[2].role`),
so the server answers 400 and the Python API raises before anything is scheduled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from specserve.errors import InvalidRequestError, SpecServeError
from specserve.models.tools import NOT_JSON, as_plain_chat, template_mentions_tools

ROLES = ("system", "user", "assistant", "developer", "tool")
_TEMPLATE_OWNED = {"messages", "add_generation_prompt", "chat_template", "tools"}


class ChatError(InvalidRequestError):
    """A conversation that cannot become a prompt; `param` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def message_text(content: Any, where: str) -> str:
    """A message's text: the string, or its text parts concatenated (None: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatError(f"{at} is a {kind!r} part; only text parts ({{'type': 'text', 'text': ...}}) "
                                "are supported.", param=at)
            if not isinstance(part.get("text"), str):
                raise ChatError(f"{at}.text must be a string.", param=f"{at}.text")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatError(f"{where}.content must be a string, a list of text parts or null, got "
                    f"{type(content).__name__}.", param=f"{where}.content")


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Checked messages as the chat template takes them: role (developer as system), text, name."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}.", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}.role is {role!r}; it must be one of {', '.join(ROLES)}.", param=f"{where}.role")
        msg = {"role": "system" if role == "developer" else role, "content": message_text(m.get("content"), where)}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ChatError(f"{where}.name must be a string.", param=f"{where}.name")
            if name:
                msg["name"] = name
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant":
                raise ChatError(f"{where} is a {role} message; only assistant messages carry tool_calls.",
                                param=f"{where}.tool_calls")
            msg["tool_calls"] = _template_calls(calls, f"{where}.tool_calls")
        call_id = m.get("tool_call_id")
        if call_id is not None:
            if role != "tool" or not isinstance(call_id, str):
                raise ChatError(f"{where}.tool_call_id must be a string, on a tool message.", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _template_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as templates read them: `arguments` an object (a client sends
    its JSON text, which is parsed, as vLLM does)."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatError(f"{where} must be a list of tool calls.", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatError(f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}.",
                            param=at)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except NOT_JSON:
                raise ChatError(f"{at}.function.arguments is not JSON text.", param=f"{at}.function.arguments") from None
        if not isinstance(args, Mapping):
            raise ChatError(f"{at}.function.arguments must be a JSON object.", param=f"{at}.function.arguments")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": dict(args)}})
    return out


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,  # noqa: ANN001
                continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                chat_template: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The conversation through the model's chat template (or `chat_template`).

    With continue_final_message the text stops where the last message's content ends (as
    transformers' and vLLM's), so the model continues that message instead of opening a turn.
    `tools` (models.tools.check_tools' form) reach a template that reads them; for one that does
    not, tools, calls and results are written into the messages (models.tools.as_plain_chat)."""
    if tokenizer is None:
        raise ChatError("This model has no tokenizer, hence no chat template; send a prompt or token ids instead.")
    msgs = template_messages(messages)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ChatError(f"chat_template_kwargs must map names to values, got {type(chat_template_kwargs).__name__}.",
                        param="chat_template_kwargs")
    kwargs = dict(chat_template_kwargs or {})
    taken = sorted(set(kwargs) & _TEMPLATE_OWNED)
    if taken:
        raise ChatError(f"chat_template_kwargs may not set {taken}: they have their own fields.",
                        param="chat_template_kwargs")
    if tools or any("tool_calls" in m or "tool_call_id" in m for m in msgs):
        source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not template_mentions_tools(source):
            msgs = as_plain_chat(msgs, tools or ())
        elif tools:
            kwargs["tools"] = [dict(t) for t in tools]
    final = msgs[-1]["content"].strip()
    if continue_final_message and (add_generation_prompt or not final):
        raise ChatError("continue_final_message continues the last message: it needs add_generation_prompt "
                        "false and a last message with text.", param="continue_final_message")
    try:
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt, **kwargs)
    except SpecServeError as e:
        raise ChatError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception in jinja) are the caller's
        raise ChatError(f"The chat template rejected these messages: {e}") from e
    if continue_final_message:
        at = prompt.rfind(final)
        if at < 0:
            raise ChatError("The chat template does not write the last message's text as it is, so it "
                            "cannot be continued.", param="continue_final_message")
        prompt = prompt[: at + len(final)]
    return prompt
