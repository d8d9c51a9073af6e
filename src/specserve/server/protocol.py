"""OpenAI-compatible request and response bodies (pydantic), plus specserve's extras.

Extras accepted in the body (the OpenAI client's `extra_body`): `top_k`, `speculative`,
`priority` (lower is served first; < 0 marks a priority request that may speculate at
medium batch sizes), `reference_text` (text the output tracks, which prompt lookup drafts
from; chat also takes OpenAI's `prediction`), and vLLM's `ignore_eos`,
`min_tokens`, `stop_token_ids`, `include_stop_str_in_output`, `return_tokens_as_token_ids`,
`repetition_penalty`, `min_p` and
structured-output extras `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice` (OpenAI's
`response_format` json_object / json_schema is standard).

A declared field sent as null takes its default (`"stream": null` streams nothing; a required
field such as `messages` is still refused). Nothing is silently ignored: a field this module
does not declare is refused with a 400 that names it, unless it is null or one of the values
below that ask for nothing (clients such as LangChain send some of them at their defaults):

- both endpoints: `store` false, `metadata` {}, `service_tier` "auto" / "default", `functions` [],
  `function_call` "none", `modalities` ["text"]; vLLM's `use_beam_search` false, `length_penalty` 1,
  `skip_special_tokens` true; completions also `tools` [], `tool_choice` "none",
  `parallel_tool_calls` true / false (chat implements tools: models.tools);
- a chat message: `refusal`, `audio`, `function_call` only as null;
- `stream_options`: `include_obfuscation` true / false (there is nothing to pad).

Declared fields that specserve does not implement (`suffix`,
`best_of` other than n) are refused by the server. Every string, object key included, must be
valid Unicode: JSON's \\ud800-\\udfff escapes can encode lone surrogates, which are refused
with a 400 that names the field (see `find_invalid_text`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specserve.sampling_params import MIN_REPETITION_PENALTY

MAX_N = 16
MAX_STOP = 16


def new_id(prefix: str) -> str:
    """A response id: the prefix and 24 random hex digits (OpenAI's shape)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _printable(text: str) -> str:
    """`text` safe to put in a response: lone surrogates written as \\udXXX escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_valid_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 text holds one
        return False
    return True


def find_invalid_text(value: Any) -> str | None:
    """Path (`messages[0].content`) of the first string or object key in a parsed JSON value that
    is not valid Unicode, or None. Iterative: JSON nesting must not exhaust Python's stack."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _is_valid_text(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, sub in item.items():
                name = f"{path}.{_printable(str(key))}" if path else _printable(str(key))
                if isinstance(key, str) and not _is_valid_text(key):
                    return name
                stack.append((sub, name))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
    return None


def refuse_invalid_text(data: Any) -> Any:
    """`data` unchanged, or a 400 naming the first string or key in it that is not valid Unicode
    (a request body's validator, before any field is read: text that cannot be encoded fails
    later, when the answer that echoes it is written)."""
    path = find_invalid_text(data)
    if path is not None:
        raise PydanticCustomError(
            "invalid_unicode",
            "{param} is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff "
            "escape); send text that encodes as UTF-8",
            {"param": path},
        )
    return data


def _same(value: Any, allowed: Any) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    if isinstance(value, (int, float)) and isinstance(allowed, (int, float)):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


class _Body(BaseModel):
    """A request body or a part of one: an undeclared field is refused unless it is null or one of
    the values its `NOOP_VALUES` entry lists (values that ask for nothing). A declared optional
    field sent as null takes its default: the OpenAI API documents `n`, `stream`, `echo` and chat
    `logprobs` as nullable, and clients that serialise every field send them so."""

    model_config = ConfigDict(extra="allow")
    NOOP_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or all(v is not None for v in data.values()):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Body:
        refused: list[tuple[str, str]] = []  # (field, why)
        for name, value in (self.model_extra or {}).items():
            allowed = self.NOOP_VALUES.get(name)
            if value is None or (allowed is not None and any(_same(value, a) for a in allowed)):
                continue
            why = "unknown field" if allowed is None else f"only {' or '.join(map(repr, allowed))} or null is accepted"
            refused.append((_printable(name), why))
        if refused:
            raise PydanticCustomError(
                "unsupported_field",
                "unsupported field(s): {fields}; leave them out of the request",
                {"fields": ", ".join(f"{name} ({why})" for name, why in refused), "param": refused[0][0]},
            )
        return self


class StreamOptions(_Body):
    """`stream_options` of the OpenAI API."""

    NOOP_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {"include_obfuscation": (True, False)}
    include_usage: StrictBool = False


# OpenAI and vLLM fields specserve does not implement, at the values that ask for nothing.
_NOOP_SAMPLING_VALUES: dict[str, tuple[Any, ...]] = {
    "store": (False,), "metadata": ({},), "service_tier": ("auto", "default"), "tools": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (True, False), "functions": ([],),
    "function_call": ("none",), "modalities": (["text"],),
    "use_beam_search": (False,), "length_penalty": (1.0,), "skip_special_tokens": (True,),
}


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    NOOP_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = _NOOP_SAMPLING_VALUES

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0: only with echo (score the prompt)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=2.0)  # vLLM's extra
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's extra
    user: str | None = None
    # specserve extras
    top_k: StrictInt | None = Field(default=None, ge=-1, le=1 << 30)
    speculative: StrictBool | None = None
    priority: StrictInt = Field(default=0, ge=-1000, le=1000)
    reference_text: str | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)  # vLLM's: no EOS, stop token or stop string before this many
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: ids that end the output like EOS
    include_stop_str_in_output: StrictBool = False  # vLLM's
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: logprobs name tokens "token_id:N", never ambiguous text
    # The label of this request's series in /metrics (acceptance, effective tokens/s by class).
    request_class: str = Field(default="default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    # Structured output (specserve.sampling.grammar): OpenAI's response_format, or vLLM's extras.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif isinstance(v, str) and not v:
            raise ValueError("stop sequence must be non-empty")
        return v

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        return refuse_invalid_text(data)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)


class ContentPart(_Body):
    """A text part of a chat message (images are not supported)."""

    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    """The function a tool call names, and its arguments as JSON text."""

    name: str
    arguments: str = "{}"


class ToolCallBody(_Body):
    """A call an assistant turn made (sent back in a conversation)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    """One message of a conversation (an assistant's may carry tool_calls, a tool's the
    tool_call_id it answers)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None  # (models.chat checks who carries what, naming the message)


class ToolFunction(_Body):
    """A function the model may call: name, description, parameters (a JSON schema)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    """An entry of `tools` (functions are the only kind)."""

    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(_Body):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this tool."""

    class Name(_Body):
        name: str

    type: Literal["function"]
    function: Name


class _ChatTemplateFields(_Body):
    """How messages go through the chat template (chat completions and /tokenize)."""

    add_generation_prompt: StrictBool = True
    # vLLM's: continue the last (assistant) message instead of opening a new turn (needs
    # add_generation_prompt false); extra variables for the chat template (e.g. a template's switch).
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


class Prediction(_Body):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat in large part (the file
    being edited). specserve drafts from it (as `reference_text`); the output is the model's
    own either way, and usage counts the accepted and rejected prediction tokens."""

    type: Literal["content"]
    content: str | list[ContentPart]

    @property
    def text(self) -> str:
        """The predicted text (a list of text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    prediction: Prediction | None = None
    # Tool calling (models.tools): the tools, whether and which to call, several calls per turn.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _prediction_is_the_reference(self) -> ChatCompletionRequest:
        if self.prediction is not None:
            if self.reference_text is not None:
                raise ValueError("send the expected text as `prediction` or as `reference_text`, not both")
            self.reference_text = self.prediction.text
        return self


class UsageInfo(BaseModel):
    """Token counts of a response.

    `completion_tokens_details` carries OpenAI's predicted-output counters for the speculative
    drafts: `accepted_prediction_tokens` (draft tokens the target accepted, part of the
    completion) and `rejected_prediction_tokens` (draft tokens it verified and rejected).
    `speculation` (specserve's, null when the request never verified a draft) adds the verify
    steps: `verify_steps` target passes that checked a draft, `draft_tokens` nodes verified,
    `accepted_tokens` of them accepted and kept (a stop inside a step drops the rest),
    `decode_steps` target passes after the first token; tokens per decode step =
    (completion_tokens - 1) / decode_steps.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None
    speculation: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs block: per token its text, logprob, and (with `logprobs: k`)
    the k most likely tokens as {text: logprob}."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None  # None at an echoed prompt's first token
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Response of /v1/completions (also each streamed chunk, object 'text_completion')."""

    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position (chat `top_logprobs`)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(BaseModel):
    """One token's logprob in a chat response, with the `top_logprobs` most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs block."""

    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message (tool_calls: OpenAI's {"id", "type", "function": {"name", "arguments"}})."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Response of /v1/chat/completions."""

    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """Incremental message of a streamed chat chunk."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # whole calls, with their index, once the output ends

    @model_serializer(mode="wrap")
    def _calls_only_where_made(self, handler: Any) -> dict[str, Any]:
        """A delta names tool_calls only in the chunk that carries them (as OpenAI's chunks)."""
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of /v1/models."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    max_model_len: int | None = None
    # specserve's: the resolved quantization, dtype and kv_cache_dtype its tokens are computed in
    # (`specserve audit --url` computes its reference the same way)
    precision: dict[str, str] | None = None


class ModelList(BaseModel):
    """Response of /v1/models."""

    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(_ChatTemplateFields):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template, to token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # as a chat request's: they are part of its prompt
    add_special_tokens: StrictBool = True  # a prompt's (the chat template writes its own)


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = None
    tokens: list[StrictInt]


class SpeculationToggle(BaseModel):
    """Body of POST /admin/speculation."""

    model_config = ConfigDict(extra="forbid")
    enabled: StrictBool


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error JSON shape (text that could not be encoded is escaped: an error always renders)."""
    return {"error": {"message": _printable(message), "type": type_,
                      "param": None if param is None else _printable(param), "code": code}}
