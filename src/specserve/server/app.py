"""The OpenAI-compatible HTTP API on FastAPI: completions, chat, streaming, metrics, admin."""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import html
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.engine import LLMEngine, PreparedRequest
from specserve.errors import ConfigError, InvalidRequestError, SpecServeError
from specserve.llm import _nth_sample_params
from specserve.models.chat import ChatError, render_chat
from specserve.models.tokenizer import Tokenizer
from specserve.models.tools import CallStream, check_tools, forced_calls, forced_schema, parse_calls
from specserve.outputs import RequestOutput
from specserve.sampling_params import (
    SamplingParams,
    StructuredOutput,
    structured_output_from_openai,
)
from specserve.server.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    EngineStoppedError,
    RequestStream,
)
from specserve.server.metrics import ServerMetrics, TokenClock
from specserve.server.middleware import AccessGate, body_too_large
from specserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SpeculationToggle,
    TokenizeRequest,
    TopLogprob,
    UsageInfo,
    error_body,
    new_id,
)
from specserve.server.responses import (
    ResponseEvents,
    ResponsesRequest,
    response_body,
    response_param,
    to_chat,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = 1
# Default --max-request-bytes. The largest body worth reading is a prompt that fills the context:
# 8192 tokens (the default context cap) of SmolLM2's or Qwen2.5's longest token (81 characters),
# JSON-escaped at up to 6 bytes a character, is 4 MiB; 8 MiB adds room for chat framing and a
# structured-output schema (at most 1 MiB). Ordinary text is ~4 bytes a token: 32k tokens, 128 KiB.
DEFAULT_MAX_REQUEST_BYTES = 8 << 20

T = TypeVar("T")


class APIError(Exception):
    """An error with an HTTP status and OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """OpenAI's error JSON of it (what a stream's error event carries)."""
        return error_body(self.message, self.type, self.param, self.code)


def _error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                    code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def longest_token_chars(tokenizer: Tokenizer) -> int | None:
    """Most characters one token of the vocabulary stands for, or None when the tokenizer
    normalizes text first (a normalizer may drop characters, so no bound follows).

    Every character of a text starts inside some token, and a token decodes alone to at least as
    many characters as start inside it (a split UTF-8 sequence decodes to U+FFFD), so a text of
    c characters is at least c / longest tokens long."""
    backend = tokenizer.backend
    if backend.normalizer is not None:
        return None
    vocab = range(backend.get_vocab_size(with_added_tokens=True))
    return max(map(len, backend.decode_batch([[i] for i in vocab], skip_special_tokens=False)), default=None)


class OpenAIServer:
    """Request handling between the HTTP routes and the AsyncEngine."""

    def __init__(self, engine: LLMEngine | None, served_model_name: str, max_waiting: int = 256,
                 drain_timeout_s: float = 30.0, api_key: str | None = None,
                 router_factory: Callable[[ServerMetrics], Any] | None = None, protect_metrics: bool = False,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if protect_metrics and not api_key:
            raise ConfigError("protect_metrics puts /metrics and the docs behind the API key; give an api_key too.")
        if max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes={max_request_bytes} is too small for any request; use at least 1024.")
        self.model_name = served_model_name
        self.metrics = ServerMetrics(served_model_name)
        if router_factory is not None:
            # Disaggregated: a router over prefill and decode workers stands in for the engine thread.
            self.async_engine = router_factory(self.metrics)
            self.engine = self.async_engine.engine
        else:
            assert engine is not None
            self.engine = engine
            self.async_engine = AsyncEngine(engine, max_waiting, on_step=self.metrics.on_step,
                                            on_output=self.metrics.on_finished)
        self.drain_timeout_s = drain_timeout_s
        self.api_key = api_key
        self.protect_metrics = protect_metrics
        self.max_request_bytes = max_request_bytes
        self.tokenizer = self.engine.tokenizer
        self.draining = False
        self._drain_task: asyncio.Future[None] | None = None
        # The most tokens one request may reach, prompt and output: the context window, or the
        # whole KV cache when that is smaller (a longer request could only be cut short).
        preparer = self.engine.preparer
        self.max_request_tokens = preparer.max_request_tokens
        # A prompt of more characters than this is certainly too long: refused before tokenizing.
        self.token_chars = longest_token_chars(self.tokenizer) if self.tokenizer is not None else None
        self.max_prompt_chars = self.max_request_tokens * self.token_chars if self.token_chars else None
        self._token_texts: dict[int, str] = {}
        self._token_raw: dict[int, bytes] = {}

    async def drain(self) -> None:
        """Stop admitting (new API requests get 503 + Retry-After; the listener stays open), let
        in-flight requests finish for up to drain_timeout_s, then abort the rest: their responses
        still end properly, a stream with a final event and [DONE]. Idempotent."""
        if self._drain_task is None:
            self.draining = True
            self._drain_task = asyncio.ensure_future(self.async_engine.shutdown(self.drain_timeout_s))
        await asyncio.shield(self._drain_task)

    # ------------------------------------------------------------------ validation
    def serves(self, model: str) -> bool:
        """Whether `model` names this server's model (its served name or the engine's)."""
        return model in (self.model_name, self.engine.model_name)

    def model_card(self) -> ModelCard:
        """The card /v1/models lists and /v1/models/{model} returns."""
        return ModelCard(id=self.model_name, max_model_len=self.engine.max_model_len,
                         precision=getattr(self.engine, "precision", None))

    def _check_model(self, model: str | None) -> None:
        if model is not None and not self.serves(model):
            raise APIError(400, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def _check_admissible(self, num_sequences: int) -> None:
        """A request of more engine requests (prompts x n) than the server holds at once could never
        be admitted: 400, not 429 + Retry-After, which would invite endless retries."""
        capacity = self.async_engine.capacity
        if num_sequences > capacity:
            raise APIError(400, f"This request asks for {num_sequences} sequences (prompts x n) but this server holds "
                           f"at most {capacity} at once (--max-num-seqs + --max-waiting); send fewer prompts or a "
                           "smaller n per request.", param="n")

    def _check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a prompt with too many characters to fit in any request."""
        if self.max_prompt_chars is None or len(text) <= self.max_prompt_chars:
            return
        assert self.token_chars is not None
        raise APIError(400, f"The prompt has {len(text):,} characters, so at least {-(-len(text) // self.token_chars):,} "
                       f"tokens (one token of this model spans at most {self.token_chars} characters), but a request "
                       f"holds at most {self.max_request_tokens:,} tokens. Shorten the prompt.",
                       param=param, code="context_length_exceeded")

    @staticmethod
    def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (JSON object keys are strings) as token id -> bias."""
        if not raw:
            return None
        out: dict[int, float] = {}
        for key, value in raw.items():
            if not key.isascii() or not key.isdigit() or len(key) > 12:
                raise APIError(400, f"logit_bias keys must be token ids (e.g. \"50256\"), got {key[:40]!r}.",
                               param="logit_bias")
            out[int(key)] = value
        return out

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                         logprobs: bool, top_logprobs: int = 0, prompt_logprobs: int | None = None) -> SamplingParams:
        logit_bias = self._logit_bias(req.logit_bias)
        try:
            return SamplingParams(
                # Without max_tokens, _prepare sizes it later (at least min_tokens).
                max_tokens=max_tokens if max_tokens is not None else max(1, req.min_tokens),
                min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                top_k=req.top_k or 0,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids or [],
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                prompt_logprobs=prompt_logprobs,
                reference_text=req.reference_text,
                speculative=req.speculative,
                logit_bias=logit_bias,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                structured_output=structured_output_from_openai(
                    req.response_format, guided_json=req.guided_json, guided_regex=req.guided_regex,
                    guided_grammar=req.guided_grammar, guided_choice=req.guided_choice,
                ),
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from e

    def _prepare(self, prompts: list[str | list[int]], base: SamplingParams, n: int, priority: int,
                 max_tokens: int | None, default_max_tokens: int | None = None, prompt_param: str = "prompt",
                 ) -> tuple[list[PreparedRequest], list[int]]:
        """Tokenize (once per prompt) and validate every (prompt, sample) pair; all or nothing.

        A request must fit whole, prompt plus max_tokens, in one request's room (context window and
        KV cache): one that cannot is refused here, before any work, instead of being preempted
        over and over and cut short with finish_reason 'length'. Without max_tokens a request gets
        default_max_tokens (None: as many as fit), capped at what fits, as vLLM does."""
        prepared: list[PreparedRequest] = []
        prompt_lens: list[int] = []
        arrival = time.perf_counter()
        for prompt in prompts:
            tokens: str | list[int] = prompt
            for j in range(n):
                params = base if n == 1 else _nth_sample_params(base, j)
                try:  # prompt + max_tokens is checked below, where an omitted max_tokens is sized
                    p = self.engine.prepare_request(tokens, params, priority=priority, arrival_time=arrival,
                                                    check_max_tokens=False)
                except SpecServeError as e:  # the field at fault where the error names one, else the prompt
                    raise APIError(400, str(e), param=getattr(e, "param", None) or prompt_param) from e
                if isinstance(prompt, str):  # the other samples reuse the first one's token ids
                    tokens, p = p.request.prompt_token_ids, p._replace(prompt=prompt)
                if base.reference_token_ids is None and base.reference_text:  # and its reference's
                    base = replace(base, reference_token_ids=p.request.sampling_params.reference_token_ids)
                num_prompt = p.request.num_prompt_tokens
                room = self.max_request_tokens - num_prompt
                if max_tokens is None:
                    want = room if default_max_tokens is None else min(default_max_tokens, room)
                    if base.min_tokens > room:
                        raise APIError(400, f"min_tokens={base.min_tokens} does not fit: the prompt has {num_prompt} "
                                       f"tokens and a request holds at most {self.max_request_tokens}.",
                                       param="min_tokens", code="context_length_exceeded")
                    want = max(want, base.min_tokens)
                    p.request.sampling_params = replace(p.request.sampling_params, max_tokens=want)
                elif max_tokens > room:
                    raise self._too_long(num_prompt, max_tokens)
                prepared.append(p)
            prompt_lens.append(prepared[-1].request.num_prompt_tokens)
        return prepared, prompt_lens

    def _too_long(self, num_prompt: int, max_tokens: int) -> APIError:
        err = self.engine.preparer.too_long(num_prompt, max_tokens)
        return APIError(400, f"{err} (leave max_tokens out to get as many as fit)", param="max_tokens",
                        code="context_length_exceeded")

    def _submit(self, prepared: list[PreparedRequest]) -> RequestStream:
        try:
            return self.async_engine.submit(prepared)
        except EngineOverloadedError as e:
            raise APIError(429, str(e), type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineStoppedError as e:
            raise APIError(503, str(e), type_="service_unavailable", code="draining",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e

    def _failure(self, finals: Iterable[RequestOutput]) -> APIError | None:
        """The error for answers the server could not finish, else None: cut short by a drain, or
        ended by a failure the engine names. Their partial output is no answer. A retryable one (a
        disaggregated router's: no decode worker left, workers that kept failing) is a 503 with
        Retry-After, as a drain's; a model step's exception a 500."""
        finals = list(finals)
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.draining and any(o.outputs[0].finish_reason == "abort" for o in finals):
            return APIError(503, f"The server shut down before this request finished (its drain timeout is "
                                 f"{self.drain_timeout_s:g} s); retry it on another replica or after the restart.",
                            "service_unavailable", code="draining", headers=retry)
        failed = next((o for o in finals if o.error), None)
        if failed is None:
            return None
        if not failed.retryable:
            return APIError(500, f"The model failed on this request: {failed.error}.", "server_error", code="model_error")
        return APIError(503, f"The server could not finish this request: {failed.error}.", "service_unavailable",
                        code="worker_failed", headers=retry)

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        """POST /v1/completions."""
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported by specserve; remove it.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be omitted); specserve returns every sample.",
                           param="best_of")
        prompts = _normalize_prompts(req.prompt)
        self._check_admissible(len(prompts) * req.n)
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_prompt_chars(prompt, "prompt")
        # max_tokens 0 with echo scores the prompt (lm-eval-harness, vLLM): one token is generated
        # and left out of the answer.
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt).",
                           param="max_tokens")
        max_tokens = 1 if prompt_only else req.max_tokens
        scored = req.echo and req.logprobs is not None  # the echoed prompt comes with its logprobs
        base = self._sampling_params(req, max_tokens, logprobs=req.logprobs is not None,
                                     top_logprobs=req.logprobs or 0, prompt_logprobs=req.logprobs if scored else None)
        prepared, prompt_lens = await run_in_threadpool(self._prepare, prompts, base, req.n, req.priority,
                                                        max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        self.metrics.tag_requests([p.request.request_id for p in prepared], req.request_class)
        stream = self._submit(prepared)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._stream_completion(stream, req, prepared, prompt_lens, include_usage, prompt_only))
        finals = await self._collect(stream, http)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            ids, lps, tops = ([], [], []) if prompt_only else (c.token_ids, _last(c.logprobs, len(c.token_ids)),
                                                               _last(c.top_logprobs, len(c.token_ids)))
            text = "" if prompt_only else c.text
            if req.echo:
                text = (prepared[i].prompt or self._decode(out.prompt_token_ids)) + text
                if scored:
                    ids = out.prompt_token_ids + ids
                    lps = (out.prompt_logprobs or []) + lps
                    tops = (out.prompt_top_logprobs or []) + tops
            choices.append(CompletionChoice(
                index=i, text=text, finish_reason=_finish(c.finish_reason), stop_reason=c.stop_reason,
                logprobs=(self._completion_logprobs(ids, lps, tops, req.logprobs, text,
                                                    as_ids=req.return_tokens_as_token_ids)
                          if req.logprobs is not None else None),
            ))
        body = CompletionResponse(model=self.model_name, choices=choices, usage=self._usage(prompt_lens, finals, prompt_only))
        return JSONResponse(body.model_dump())

    async def _stream_completion(self, stream: RequestStream, req: CompletionRequest,
                                 prepared: list[PreparedRequest], prompt_lens: list[int],
                                 include_usage: bool, prompt_only: bool = False) -> AsyncIterator[str]:
        rid = new_id("cmpl")  # as a response's own (a random id, unique across restarts)
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        clock = TokenClock()
        scored = req.echo and req.logprobs is not None
        try:
            if req.echo and not scored:  # the prompt at once; scored, it goes with its logprobs after prefill
                for i, p in enumerate(prepared):
                    chunk = CompletionResponse(id=rid, created=created, model=self.model_name,
                                               choices=[CompletionChoice(
                                                   index=i, text=p.prompt or self._decode(p.request.prompt_token_ids))])
                    yield _event(chunk.model_dump())
            echoed: set[int] = set()
            runs: dict[int, _Offsets] = collections.defaultdict(_Offsets)  # text_offset per choice
            async for idx, out in stream:
                c = out.outputs[0]
                if scored and idx not in echoed:
                    echoed.add(idx)
                    text = prepared[idx].prompt or self._decode(out.prompt_token_ids)
                    lp = self._completion_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                   out.prompt_top_logprobs, req.logprobs or 0, text, runs[idx],
                                                   as_ids=req.return_tokens_as_token_ids)
                    yield _event(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[
                        CompletionChoice(index=idx, text=text, logprobs=lp)]).model_dump())
                self._tick(clock, c.delta_token_ids)
                if prompt_only:  # the one generated token stays out of the answer
                    c = replace(c, delta_text="", delta_token_ids=[])
                if not c.delta_text and not out.finished and req.logprobs is None:
                    continue
                lp = None
                if req.logprobs is not None and c.logprobs is not None:
                    n_new = len(c.delta_token_ids)
                    lp = self._completion_logprobs(c.delta_token_ids, _last(c.logprobs, n_new),
                                                   _last(c.top_logprobs, n_new), req.logprobs, run=runs[idx],
                                                   as_ids=req.return_tokens_as_token_ids)
                ended = out.finished and not out.error  # (a failed one ends with the error event instead)
                choice = CompletionChoice(index=idx, text=c.delta_text, logprobs=lp,
                                          finish_reason=_finish(c.finish_reason) if ended else None,
                                          stop_reason=c.stop_reason if ended else None)
                if out.finished:
                    finals[idx] = out
                yield _event(CompletionResponse(id=rid, created=created, model=self.model_name,
                                                choices=[choice]).model_dump())
            if (failure := self._failure(finals.values())) is not None:
                yield _event(failure.body())
            if include_usage and not any(o.error for o in finals.values()):
                usage = self._usage(prompt_lens, [finals[i] for i in sorted(finals)], prompt_only)
                yield _event(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                                usage=usage).model_dump())
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            stream.abort()
            raise
        except EngineStoppedError as e:
            yield _event(error_body(str(e), "service_unavailable"))
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()  # no-op when everything finished; frees KV at once on disconnect

    # ------------------------------------------------------------------ chat
    async def _render_chat(self, req: ChatCompletionRequest | TokenizeRequest,
                           tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation through the model's chat template (models.chat.render_chat; its errors
        are the client's: 400), with `tools` (models.tools.check_tools' form)."""
        assert req.messages is not None
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer, hence no chat template; use /v1/completions.")
        messages = [m.model_dump(include={"role", "content", "name", "tool_calls", "tool_call_id"}, exclude_none=True)
                    for m in req.messages]  # text parts and calls as dicts
        try:
            prompt = await run_in_threadpool(partial(
                render_chat, self.tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs,
                tools=tools))
        except ChatError as e:
            raise APIError(400, str(e), param=e.param) from e
        self._check_prompt_chars(prompt, "messages")
        return prompt

    # ------------------------------------------------------------------ tokenizer endpoints
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """POST /tokenize: the ids a completion (prompt) or chat (messages) request would feed."""
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give a prompt or messages (one of them).", param="prompt")
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer; send token ids to the completions endpoint.")
        if req.messages is not None:
            text, special = await self._render_chat(req, _ToolUse.of(req).tools), False
        else:
            text, special = req.prompt, req.add_special_tokens
            self._check_prompt_chars(text, "prompt")
        ids = await run_in_threadpool(self.tokenizer.encode, text, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """POST /detokenize: the text of token ids (special tokens spelled out)."""
        self._check_model(req.model)
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer.")
        vocab = self.engine.preparer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab}).", param="tokens")
        return {"prompt": await run_in_threadpool(self.tokenizer.decode, req.tokens, False)}

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        """POST /v1/chat/completions."""
        self._check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
        self._check_admissible(req.n)
        calls = _ToolUse.of(req)
        prompt = await self._render_chat(req, calls.tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        base = self._sampling_params(req, max_tokens, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0)
        if calls.schema is not None:  # tool_choice required or named: the output is held to the calls' schema
            if base.structured_output is not None:
                raise APIError(400, "tool_choice required or a named tool fixes the output's form; leave out "
                               "response_format and the guided_* fields.", param="tool_choice")
            try:
                schema = replace(StructuredOutput.json(calls.schema), param="tools")
            except InvalidRequestError as e:
                raise APIError(400, f"The tools' parameters are not a usable JSON schema: {e}", param="tools") from e
            try:
                base = replace(base, structured_output=schema)
            except InvalidRequestError as e:  # a field a held output cannot go with (ignore_eos)
                raise APIError(400, str(e), param=e.param) from e
        prepared, prompt_lens = await run_in_threadpool(self._prepare, [prompt], base, req.n, req.priority,
                                                        max_tokens, prompt_param="messages")
        self.metrics.tag_requests([p.request.request_id for p in prepared], req.request_class)
        stream = self._submit(prepared)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._stream_chat(stream, req, prepared, prompt_lens, include_usage, calls))
        finals = await self._collect(stream, http)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            content, made = calls.read(c.text)
            choices.append(ChatChoice(
                index=i, message=ChatResponseMessage(content=content, tool_calls=[m.as_openai() for m in made] or None),
                finish_reason=calls.finish(_finish(c.finish_reason), made),
                stop_reason=c.stop_reason,
                logprobs=(self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, req.top_logprobs or 0,
                                              as_ids=req.return_tokens_as_token_ids)
                          if req.logprobs else None),
            ))
        body = ChatCompletionResponse(model=self.model_name, choices=choices,
                                      usage=self._usage(prompt_lens, finals))
        return JSONResponse(body.model_dump())

    async def responses(self, req: ResponsesRequest, http: Request) -> Response:
        """POST /v1/responses: asked and answered through the chat completions path
        (specserve.server.responses); errors name the Responses request's fields."""
        try:
            chat_req = ChatCompletionRequest.model_validate(to_chat(req))
        except ValidationError as e:  # (the chat request's own checks: the same 400 as its route gives)
            errs = e.errors()
            raise APIError(400, "Invalid request: " + "; ".join(_error_parts(errs)),
                           param=response_param(_error_param(errs))) from None
        try:
            resp = await self.chat(chat_req, http)
        except APIError as e:
            raise APIError(e.status, e.message, e.type, response_param(e.param), e.code, e.headers) from e
        if not req.stream:
            if resp.status_code != 200:  # (the client left)
                return resp
            return JSONResponse(response_body(req, self.model_name, json.loads(resp.body)))
        return _sse(self._stream_response(resp, req))

    async def _stream_response(self, resp: StreamingResponse, req: ResponsesRequest) -> AsyncIterator[str]:
        events = ResponseEvents(req, self.model_name)
        chunks = resp.body_iterator
        try:
            yield events.start()
            async for text in chunks:
                for line in str(text).split("\n"):  # (SSE's lines; splitlines() also splits at U+2028 in the JSON)
                    if line.startswith("data: ") and line != "data: [DONE]" and (out := events.feed(json.loads(line[6:]))):
                        yield out
            yield events.finish()
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]  # (aborts the request if the client left)

    async def _stream_chat(self, stream: RequestStream, req: ChatCompletionRequest,
                           prepared: list[PreparedRequest], prompt_lens: list[int],
                           include_usage: bool, calls: _ToolUse) -> AsyncIterator[str]:
        rid = new_id("chatcmpl")
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        clock = TokenClock()
        readers = [calls.stream() for _ in prepared]  # per choice: what of its text may stream now

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return _event(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices,
                                              usage=usage).model_dump(exclude_none=False))

        try:
            for i in range(len(prepared)):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for idx, out in stream:
                c = out.outputs[0]
                self._tick(clock, c.delta_token_ids)
                # A token whose text is held back (a partial character, a possible stop string)
                # still has a logprob entry: it goes out now, with empty content.
                with_logprobs = req.logprobs and c.logprobs is not None and bool(c.delta_token_ids)
                text = readers[idx].feed(c.delta_text or "")
                if text or with_logprobs:
                    lp = None
                    if with_logprobs:
                        n_new = len(c.delta_token_ids)
                        lp = self._chat_logprobs(c.delta_token_ids, _last(c.logprobs, n_new),
                                                 _last(c.top_logprobs, n_new), req.top_logprobs or 0,
                                                 as_ids=req.return_tokens_as_token_ids)
                    yield chunk([ChatChunkChoice(index=idx, delta=DeltaMessage(content=text), logprobs=lp)])
                if out.finished:
                    finals[idx] = out
                    if out.error:  # it ends with the error event: no finish, no calls read from part of a text
                        continue
                    rest, made = readers[idx].finish()
                    if rest:
                        yield chunk([ChatChunkChoice(index=idx, delta=DeltaMessage(content=rest))])
                    if made:
                        yield chunk([ChatChunkChoice(index=idx, delta=DeltaMessage(
                            tool_calls=[m.as_openai(k) for k, m in enumerate(made)]))])
                    yield chunk([ChatChunkChoice(index=idx, delta=DeltaMessage(),
                                                 finish_reason=calls.finish(_finish(c.finish_reason), made),
                                                 stop_reason=c.stop_reason)])
            if (failure := self._failure(finals.values())) is not None:
                yield _event(failure.body())
            if include_usage and not any(o.error for o in finals.values()):
                yield chunk([], self._usage(prompt_lens, [finals[i] for i in sorted(finals)]))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            stream.abort()
            raise
        except EngineStoppedError as e:
            yield _event(error_body(str(e), "service_unavailable"))
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()

    # ------------------------------------------------------------------ helpers
    async def _collect(self, stream: RequestStream, http: Request) -> list[RequestOutput] | None:
        """Wait for every request of a non-streaming call; abort all if the client leaves."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for idx, out in stream:
                if out.finished:
                    finals[idx] = out

        async def watch() -> None:
            while not await http.is_disconnected():
                await asyncio.sleep(0.25)

        main = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            stream.abort()
            main.cancel()
            watcher.cancel()
            raise
        watcher.cancel()
        if main not in done:
            stream.abort()
            main.cancel()
            return None
        exc = main.exception()
        if exc is not None:
            if isinstance(exc, EngineStoppedError):
                raise APIError(503, str(exc), type_="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
            raise exc
        outs = [finals[i] for i in sorted(finals)]
        if (failure := self._failure(outs)) is not None:  # partial output is no answer
            raise failure
        return outs

    def _tick(self, clock: TokenClock, new_ids: list[int]) -> None:
        if new_ids:
            gap = clock.tick()
            if gap is not None:
                self.metrics.observe_token_event(gap, len(new_ids))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _token_text(self, tid: int) -> str:
        if self.tokenizer is None:
            return f"<{tid}>"
        text = self._token_texts.get(tid)
        if text is None:
            text = self._token_texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text

    def _token_bytes(self, tid: int) -> bytes:
        if self.tokenizer is None:
            return self._token_text(tid).encode("utf-8")
        raw = self._token_raw.get(tid)
        if raw is None:
            raw = self._token_raw[tid] = self.tokenizer.token_bytes(tid)
        return raw

    def _text_offsets(self, ids: list[int], text: str | None = None, run: _Offsets | None = None) -> list[int]:
        """Where each token's text starts, in characters: the tokens' bytes decoded in order, so
        a token that holds part of a character starts where that character does (before, each
        such token counted its U+FFFD and the offsets ran past the text). A special token counts
        its spelling where `text` holds it there (an echoed prompt that spelled it), else nothing
        (output text leaves special tokens out). `run` carries the count across a stream's
        chunks, so streamed offsets are from the start of the choice's text, as vLLM's are."""
        special = self.tokenizer.special_token_ids if self.tokenizer is not None else frozenset()
        run = run if run is not None else _Offsets()
        offsets = []
        for t in ids:
            offsets.append(run.at)
            if t in special:
                spelled = self._token_text(t)
                run.at += len(spelled) if text is not None and text.startswith(spelled, run.at) else 0
            else:
                run.at += len(run.decoder.decode(self._token_bytes(t)))
        return offsets

    def _token_name(self, tid: int, as_ids: bool) -> str:
        """How a logprobs block names a token: its text, or (vLLM's return_tokens_as_token_ids)
        "token_id:N", which a client maps back to the id whatever the text (two ids may spell one)."""
        return f"token_id:{tid}" if as_ids else self._token_text(tid)

    def _completion_logprobs(self, ids: list[int], lps: list[float | None] | None,
                             tops: list[list[tuple[int, float]] | None] | None, k: int,
                             text: str | None = None, run: _Offsets | None = None,
                             as_ids: bool = False) -> CompletionLogprobs:
        """Legacy block: every token's text, logprob and offset in `text` (the text the tokens
        spell; see _text_offsets), and with k > 0 its k likeliest as {text: logprob}."""
        tokens = [self._token_name(t, as_ids) for t in ids]
        offsets = self._text_offsets(ids, text, run)
        top = None
        if k:  # None where there is nothing to rank (an echoed prompt's first token)
            top = [None if pairs is None else {self._token_name(tid, as_ids): _finite(v) for tid, v in pairs}
                   for pairs in _last(tops, len(ids))]
        token_lps = [None if v is None else _finite(v) for v in _last(lps, len(ids))]
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=top,
                                  text_offset=offsets)

    def _chat_logprobs(self, ids: list[int], lps: list[float | None] | None,
                       tops: list[list[tuple[int, float]] | None] | None, k: int,
                       as_ids: bool = False) -> ChatLogprobs:
        """Chat block: every token's text, logprob and bytes, with its k likeliest alternatives."""
        content = []
        for t, lp, pairs in zip(ids, _last(lps, len(ids)), _last(tops, len(ids))):
            text = self._token_name(t, as_ids)
            # bytes: the token's own (OpenAI's), which a client joins to rebuild characters split
            # over tokens; the text of such a token alone is U+FFFD
            alternatives = [TopLogprob(token=self._token_name(tid, as_ids), logprob=_finite(v),
                                       bytes=list(self._token_bytes(tid)))
                            for tid, v in (pairs or [])[:k]]
            content.append(ChatLogprobToken(token=text, logprob=_finite(lp) if lp is not None else 0.0,
                                            bytes=list(self._token_bytes(t)), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    @staticmethod
    def _usage(prompt_lens: list[int], finals: list[RequestOutput], prompt_only: bool = False) -> UsageInfo:
        """Token counts; prompt_only: the generated token was left out of the answer (echo, max_tokens 0)."""
        prompt = sum(prompt_lens)
        completion = 0 if prompt_only else sum(o.metrics.num_generated_tokens for o in finals)
        n_per_prompt = max(1, len(finals) // max(1, len(prompt_lens)))
        cached = sum(o.metrics.num_cached_prompt_tokens for o in finals[::n_per_prompt])
        spec = {key: sum(int(o.metrics.extra.get(counter) or 0) for o in finals) for key, counter in
                (("verify_steps", "num_spec_steps"), ("draft_tokens", "num_draft_tokens"),
                 ("accepted_tokens", "num_accepted_tokens"))}
        # Target passes after the one that wrote the first token: (completion_tokens - 1) / decode_steps
        # is the request's tokens per decode step.
        spec["decode_steps"] = sum(max(0, int(o.metrics.extra.get("num_target_steps") or 0) - 1) for o in finals)
        details = {"accepted_prediction_tokens": spec["accepted_tokens"],
                   "rejected_prediction_tokens": spec["draft_tokens"] - spec["accepted_tokens"]}
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details={"cached_tokens": cached}, completion_tokens_details=details,
                         speculation=spec if spec["verify_steps"] else None)


class _Offsets:
    """A choice's running text offset over its tokens (OpenAIServer._text_offsets)."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.at = 0


class _ToolUse:
    """A chat request's tools (models.tools): how they enter the prompt and the sampling, and how
    each choice's text becomes content and calls."""

    def __init__(self, tools: list[dict[str, Any]], choice: Any, parallel: bool) -> None:
        self.tools, self.choice = tools or None, choice
        self.names = [t["function"]["name"] for t in tools]
        self.schema = forced_schema(tools, choice, parallel) if tools else None

    @classmethod
    def of(cls, req: ChatCompletionRequest | TokenizeRequest) -> _ToolUse:
        choice = getattr(req, "tool_choice", None)
        if choice is None:
            choice = "auto" if req.tools else "none"  # (OpenAI's default)
        elif not isinstance(choice, str):
            choice = choice.model_dump()
        try:
            tools = check_tools([t.model_dump() for t in req.tools or ()], choice)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from e
        return cls(tools, choice, getattr(req, "parallel_tool_calls", True))

    @property
    def parsing(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def read(self, text: str) -> tuple[str | None, list[Any]]:
        """(content, calls) of a finished choice's text."""
        if not self.parsing:
            return text, []
        if self.schema is None:
            return parse_calls(text, self.names)
        made = forced_calls(text, self.choice)
        return (None, made) if made else (text, [])

    def stream(self) -> _CallReader:
        return _CallReader(self)

    def finish(self, reason: str | None, made: list[Any]) -> str | None:
        """finish_reason: "tool_calls" where the model chose to call (OpenAI's "stop" for a named tool)."""
        if made and reason == "stop" and not isinstance(self.choice, dict):
            return "tool_calls"
        return reason


class _CallReader:
    """One streamed choice's text through its _ToolUse: content as it may go out, calls at the end."""

    def __init__(self, use: _ToolUse) -> None:
        self.use = use
        self.free = CallStream(use.names) if use.parsing and use.schema is None else None
        self.text = ""  # a forced call's output, kept for the end

    def feed(self, delta: str) -> str:
        if not self.use.parsing:  # (every chat stream without tools: nothing kept)
            return delta
        if self.free is not None:
            return self.free.feed(delta)
        self.text += delta
        return ""

    def finish(self) -> tuple[str, list[Any]]:
        if self.free is not None:
            return self.free.finish()
        if not self.use.parsing:
            return "", []
        content, made = self.use.read(self.text)
        return content or "", made


def _normalize_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; send a string, a list of strings or token ids.", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return list(prompt)


def _last(values: list[T] | None, n: int) -> list[T | None]:
    """The entries of an output's last n tokens, None where it carries fewer (or none at all)."""
    have = values[max(len(values) - n, 0):] if values is not None and n else []
    return [None] * (n - len(have)) + have


MIN_LOGPROB = -9999.0  # what a masked token's -inf logprob is sent as (JSON has no infinity; vLLM's value)


def _finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token a grammar, min_tokens or top-k masked) and NaN as MIN_LOGPROB."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _finish(reason: str | None) -> str | None:
    return {"abort": "abort", "error": "error"}.get(reason or "", reason)


def _error_parts(errs: list[Any]) -> list[str]:
    """A pydantic validation's first errors as "field: why" (the body's own root left out)."""
    parts = []
    for e in errs[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return parts


def _error_param(errs: list[Any]) -> str | None:
    """The field a client should look at: the first error's, with the part our own checks name
    in their context."""
    if not errs:
        return None
    loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
    named = (errs[0].get("ctx") or {}).get("param")
    return ".".join(loc + [str(named)]) if named else (loc[0] if loc else None)


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI application around an OpenAIServer."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.async_engine.start(asyncio.get_running_loop())
        yield
        await server.drain()

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    # Pure ASGI (see specserve.server.middleware): never add an @app.middleware("http") here.
    app.add_middleware(AccessGate, api_key=server.api_key, protect_metrics=server.protect_metrics,
                       is_draining=lambda: server.draining, retry_after_s=RETRY_AFTER_S,
                       max_body_bytes=server.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        parts = _error_parts(errs)
        if errs and errs[0].get("type") == "json_invalid":  # its loc is a byte offset, not a field
            return _error_response(400, f"Invalid request: the body is not valid JSON ({errs[0].get('msg', '')} at "
                                   f"character {errs[0].get('loc', ('', '?'))[-1]}).")
        if errs and tuple(errs[0].get("loc", ())) == ("body",) and errs[0].get("type") in ("model_attributes_type",
                                                                                              "dict_type"):
            return _error_response(400, "Invalid request: the body must be a JSON object, sent with "
                                   "'Content-Type: application/json'.")
        return _error_response(400, "Invalid request: " + "; ".join(parts), param=_error_param(errs))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 413:
            return JSONResponse(body_too_large(server.max_request_bytes), status_code=413)
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(exc.status_code, str(exc.detail), type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(500, f"Internal error: {type(exc).__name__}", "server_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await server.responses(body, request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        return _error_response(404, f"No response {response_id!r}: responses are not stored here (store has no "
                               "effect); keep the answer the POST returned.", "not_found_error", "response_id")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[server.model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> Response:
        """OpenAI's retrieve-model (client.models.retrieve): this server's card, or 404."""
        if not server.serves(model):
            return _error_response(404, f"The model '{model}' does not exist; this server serves '{server.model_name}'.",
                                   "not_found_error", param="model", code="model_not_found")
        return JSONResponse(server.model_card().model_dump())

    @app.get("/version")
    async def version() -> dict[str, str]:
        from specserve import __version__

        return {"version": __version__}

    @app.get("/ping")
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        return await health()

    @app.post("/ping")
    async def ping_post() -> Response:  # (its own name: one OpenAPI operation id per method)
        return await health()

    @app.head("/health", include_in_schema=False)  # load balancers' probes
    async def health_head() -> Response:
        return await health()

    @app.get("/health")
    async def health() -> Response:
        ae = server.async_engine
        report = getattr(ae, "health", None)
        if report is not None:  # disaggregated: the router says which workers are alive, and what that means
            body = report()
            return JSONResponse(body, status_code=200 if body["status"] in ("ok", "degraded") else 503)
        if not ae.is_alive:
            return _error_response(503, f"engine not running: {ae.error or 'stopped'}", "service_unavailable")
        status = "ok" if ae.accepting else "draining"
        return JSONResponse({"status": status, "in_flight": ae.num_in_flight},
                            status_code=200 if ae.accepting else 503)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        from importlib.resources import files

        page = files("specserve.server").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("__MODEL__", html.escape(server.model_name, quote=True)))

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Recent requests and sampled gauges for the web page (JSON)."""
        snap = server.metrics.snapshot()
        eng = server.engine
        snap["speculation"] = {"enabled": bool(getattr(eng, "speculation_enabled", False)), "method": eng.config.spec.method}
        if hasattr(eng, "describe"):
            snap["engine"] = eng.describe()
        return snap

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/speculation")
    async def get_speculation() -> dict[str, Any]:
        eng = server.engine
        return {"enabled": eng.speculation_enabled, "method": eng.config.spec.method,
                "policy": eng.config.spec.policy, "num_spec_tokens": eng.config.spec.num_spec_tokens,
                "drafter_memory_bytes": getattr(eng, "drafter_memory_bytes", 0),
                "drafter_released": getattr(eng, "drafter_released", False)}

    @app.post("/admin/speculation")
    async def set_speculation(body: SpeculationToggle) -> dict[str, Any]:
        if body.enabled and not server.engine.can_speculate:
            raise APIError(400, "This server was started without a proposer; restart it with --spec-method.")
        server.async_engine.set_speculation(body.enabled)
        return {"enabled": body.enabled}

    return app
