"""OpenAI-compatible request and response bodies (pydantic), plus specserve's extras.

Extras accepted in the body (the OpenAI client's `extra_body`): `top_k`, `speculative`,
`priority` (lower is served first; < 0 marks a priority request that may speculate at
medium batch sizes), `reference_text` (for the reference proposer), `ignore_eos`, and vLLM's
structured-output extras `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice` (OpenAI's
`response_format` json_object / json_schema is standard).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_N = 16
MAX_STOP = 16


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class StreamOptions(BaseModel):
    """`stream_options` of the OpenAI API."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
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
    user: str | None = None
    # specserve extras
    top_k: StrictInt | None = Field(default=None, ge=-1, le=1 << 30)
    speculative: StrictBool | None = None
    priority: StrictInt = Field(default=0, ge=-1000, le=1000)
    reference_text: str | None = None
    ignore_eos: StrictBool = False
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


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)


class ContentPart(BaseModel):
    """A text part of a chat message (images are not supported)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs block (chosen tokens only)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
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

    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprobToken(BaseModel):
    """One token's logprob in a chat response."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs block."""

    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message."""

    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Response of /v1/chat/completions."""

    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """Incremental message of a streamed chat chunk."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


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


class ModelList(BaseModel):
    """Response of /v1/models."""

    object: str = "list"
    data: list[ModelCard]


class SpeculationToggle(BaseModel):
    """Body of POST /admin/speculation."""

    model_config = ConfigDict(extra="forbid")
    enabled: StrictBool


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
