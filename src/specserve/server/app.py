"""The OpenAI-compatible HTTP API on FastAPI: completions, chat, streaming, metrics, admin."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.engine import LLMEngine, PreparedRequest
from specserve.errors import InvalidRequestError, SpecServeError
from specserve.llm import _nth_sample_params
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams, structured_output_from_openai
from specserve.server.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    EngineStoppedError,
    RequestStream,
)
from specserve.server.metrics import ServerMetrics, TokenClock
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
    ModelCard,
    ModelList,
    SpeculationToggle,
    UsageInfo,
    error_body,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error with an HTTP status and OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                    code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class OpenAIServer:
    """Request handling between the HTTP routes and the AsyncEngine."""

    def __init__(self, engine: LLMEngine | None, served_model_name: str, max_waiting: int = 256,
                 drain_timeout_s: float = 30.0, api_key: str | None = None,
                 router_factory: Callable[[ServerMetrics], Any] | None = None) -> None:
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
        self.tokenizer = self.engine.tokenizer

    # ------------------------------------------------------------------ validation
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine.model_name):
            raise APIError(400, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    @staticmethod
    def _check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported by specserve; remove it.", param="logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise APIError(400, f"{name} other than 0 is not supported by specserve; remove it.", param=name)

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                         logprobs: bool) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else 1,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                seed=req.seed,
                stop=req.stop,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                reference_text=req.reference_text,
                speculative=req.speculative,
                structured_output=structured_output_from_openai(
                    req.response_format, guided_json=req.guided_json, guided_regex=req.guided_regex,
                    guided_grammar=req.guided_grammar, guided_choice=req.guided_choice,
                ),
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e)) from e

    def _prepare(self, prompts: list[str | list[int]], base: SamplingParams, n: int, priority: int,
                 max_tokens: int | None) -> tuple[list[PreparedRequest], list[int]]:
        """Tokenize + validate every (prompt, sample) pair; all or nothing."""
        prepared: list[PreparedRequest] = []
        prompt_lens: list[int] = []
        arrival = time.perf_counter()
        for prompt in prompts:
            for j in range(n):
                params = base if n == 1 else _nth_sample_params(base, j)
                try:
                    p = self.engine.prepare_request(prompt, params, priority=priority, arrival_time=arrival)
                except SpecServeError as e:
                    raise APIError(400, str(e), param="prompt") from e
                room = self.engine.max_model_len - p.request.num_prompt_tokens
                if max_tokens is None:
                    p.request.sampling_params = replace(p.request.sampling_params, max_tokens=room)
                elif max_tokens > room:
                    raise APIError(
                        400,
                        f"This model's maximum context length is {self.engine.max_model_len} tokens; the prompt "
                        f"has {p.request.num_prompt_tokens} and max_tokens asks for {max_tokens}. Reduce the "
                        "prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
                prepared.append(p)
            prompt_lens.append(prepared[-1].request.num_prompt_tokens)
        return prepared, prompt_lens

    def _submit(self, prepared: list[PreparedRequest]) -> RequestStream:
        try:
            return self.async_engine.submit(prepared)
        except EngineOverloadedError as e:
            raise APIError(429, str(e), type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineStoppedError as e:
            raise APIError(503, str(e), type_="service_unavailable", code="draining") from e

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        """POST /v1/completions."""
        self._check_model(req.model)
        self._check_unsupported(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported by specserve; remove it.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be omitted); specserve returns every sample.",
                           param="best_of")
        prompts = _normalize_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        base = self._sampling_params(req, max_tokens, logprobs=req.logprobs is not None)
        prepared, prompt_lens = await run_in_threadpool(self._prepare, prompts, base, req.n, req.priority, max_tokens)
        stream = self._submit(prepared)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._stream_completion(stream, req, prepared, prompt_lens, include_usage))
        finals = await self._collect(stream, http)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            text = c.text
            if req.echo:
                text = (prepared[i].prompt or self._decode(out.prompt_token_ids)) + text
            choices.append(CompletionChoice(
                index=i, text=text, finish_reason=_finish(c.finish_reason), stop_reason=c.stop_reason,
                logprobs=self._completion_logprobs(c.token_ids, c.logprobs) if req.logprobs is not None else None,
            ))
        body = CompletionResponse(model=self.model_name, choices=choices,
                                  usage=self._usage(prompt_lens, finals))
        return JSONResponse(body.model_dump())

    async def _stream_completion(self, stream: RequestStream, req: CompletionRequest,
                                 prepared: list[PreparedRequest], prompt_lens: list[int],
                                 include_usage: bool) -> AsyncIterator[str]:
        rid = f"cmpl-{prepared[0].request.request_id}"
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        clock = TokenClock()
        try:
            if req.echo:
                for i, p in enumerate(prepared):
                    chunk = CompletionResponse(id=rid, created=created, model=self.model_name,
                                               choices=[CompletionChoice(index=i, text=p.prompt or "")])
                    yield _event(chunk.model_dump())
            async for idx, out in stream:
                c = out.outputs[0]
                self._tick(clock, c.delta_token_ids)
                if not c.delta_text and not out.finished and req.logprobs is None:
                    continue
                lp = None
                if req.logprobs is not None and c.logprobs is not None:
                    n_new = len(c.delta_token_ids)
                    lp = self._completion_logprobs(c.delta_token_ids, c.logprobs[len(c.logprobs) - n_new:])
                choice = CompletionChoice(index=idx, text=c.delta_text, logprobs=lp,
                                          finish_reason=_finish(c.finish_reason) if out.finished else None,
                                          stop_reason=c.stop_reason if out.finished else None)
                if out.finished:
                    finals[idx] = out
                yield _event(CompletionResponse(id=rid, created=created, model=self.model_name,
                                                choices=[choice]).model_dump())
            if include_usage:
                usage = self._usage(prompt_lens, [finals[i] for i in sorted(finals)])
                yield _event(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                                usage=usage).model_dump())
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            stream.abort()
            raise
        except EngineStoppedError as e:
            yield _event(error_body(str(e), "service_unavailable"))
        finally:
            stream.abort()  # no-op when everything finished; frees KV at once on disconnect

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        """POST /v1/chat/completions."""
        self._check_model(req.model)
        self._check_unsupported(req)
        if req.tools:
            raise APIError(400, "tools are not supported by specserve yet; remove them.", param="tools")
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer, hence no chat template; use /v1/completions.")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in req.messages]
        try:
            prompt = await run_in_threadpool(self.tokenizer.apply_chat_template, messages, req.add_generation_prompt)
        except SpecServeError as e:
            raise APIError(400, str(e), param="messages") from e
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception in jinja) are client errors
            raise APIError(400, f"The chat template rejected these messages: {e}", param="messages") from e
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        base = self._sampling_params(req, max_tokens, logprobs=req.logprobs)
        prepared, prompt_lens = await run_in_threadpool(self._prepare, [prompt], base, req.n, req.priority, max_tokens)
        stream = self._submit(prepared)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._stream_chat(stream, req, prepared, prompt_lens, include_usage))
        finals = await self._collect(stream, http)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            choices.append(ChatChoice(
                index=i, message=ChatResponseMessage(content=c.text), finish_reason=_finish(c.finish_reason),
                stop_reason=c.stop_reason,
                logprobs=self._chat_logprobs(c.token_ids, c.logprobs) if req.logprobs else None,
            ))
        body = ChatCompletionResponse(model=self.model_name, choices=choices,
                                      usage=self._usage(prompt_lens, finals))
        return JSONResponse(body.model_dump())

    async def _stream_chat(self, stream: RequestStream, req: ChatCompletionRequest,
                           prepared: list[PreparedRequest], prompt_lens: list[int],
                           include_usage: bool) -> AsyncIterator[str]:
        rid = f"chatcmpl-{prepared[0].request.request_id}"
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        clock = TokenClock()

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return _event(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices,
                                              usage=usage).model_dump(exclude_none=False))

        try:
            for i in range(len(prepared)):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for idx, out in stream:
                c = out.outputs[0]
                self._tick(clock, c.delta_token_ids)
                if not c.delta_text and not out.finished:
                    continue
                lp = None
                if req.logprobs and c.logprobs is not None:
                    n_new = len(c.delta_token_ids)
                    lp = self._chat_logprobs(c.delta_token_ids, c.logprobs[len(c.logprobs) - n_new:])
                if c.delta_text or lp is not None:
                    yield chunk([ChatChunkChoice(index=idx, delta=DeltaMessage(content=c.delta_text), logprobs=lp)])
                if out.finished:
                    finals[idx] = out
                    yield chunk([ChatChunkChoice(index=idx, delta=DeltaMessage(),
                                                 finish_reason=_finish(c.finish_reason))])
            if include_usage:
                yield chunk([], self._usage(prompt_lens, [finals[i] for i in sorted(finals)]))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            stream.abort()
            raise
        except EngineStoppedError as e:
            yield _event(error_body(str(e), "service_unavailable"))
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
                raise APIError(503, str(exc), type_="service_unavailable")
            raise exc
        return [finals[i] for i in sorted(finals)]

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
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _completion_logprobs(self, ids: list[int], lps: list[float] | None) -> CompletionLogprobs:
        tokens = [self._token_text(t) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(lps or [None] * len(ids)),
                                  top_logprobs=None, text_offset=offsets)

    def _chat_logprobs(self, ids: list[int], lps: list[float] | None) -> ChatLogprobs:
        content = []
        for t, lp in zip(ids, lps or [0.0] * len(ids)):
            text = self._token_text(t)
            content.append(ChatLogprobToken(token=text, logprob=lp, bytes=list(text.encode("utf-8"))))
        return ChatLogprobs(content=content)

    @staticmethod
    def _usage(prompt_lens: list[int], finals: list[RequestOutput]) -> UsageInfo:
        prompt = sum(prompt_lens)
        completion = sum(o.metrics.num_generated_tokens for o in finals)
        n_per_prompt = max(1, len(finals) // max(1, len(prompt_lens)))
        cached = sum(o.metrics.num_cached_prompt_tokens for o in finals[::n_per_prompt])
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details={"cached_tokens": cached})


def _normalize_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; send a string, a list of strings or token ids.", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return list(prompt)


def _finish(reason: str | None) -> str | None:
    return {"abort": "abort", "error": "error"}.get(reason or "", reason)


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
        await server.async_engine.shutdown(server.drain_timeout_s)

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan)
    app.state.server = server

    @app.middleware("http")
    async def auth(request: Request, call_next):  # noqa: ANN001, ANN202
        if server.api_key and request.url.path.startswith(("/v1", "/admin")):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given, f"Bearer {server.api_key}"):
                return _error_response(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                                       "authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        parts = []
        for e in errs[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
        param = None
        if errs:
            loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
            param = loc[0] if loc else None
        return _error_response(400, "Invalid request: " + "; ".join(parts), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=server.model_name, max_model_len=server.engine.max_model_len)
        return ModelList(data=[card]).model_dump()

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
                "policy": eng.config.spec.policy, "num_spec_tokens": eng.config.spec.num_spec_tokens}

    @app.post("/admin/speculation")
    async def set_speculation(body: SpeculationToggle) -> dict[str, Any]:
        if body.enabled and server.engine.proposer is None:
            raise APIError(400, "This server was started without a proposer; restart it with --spec-method.")
        server.async_engine.set_speculation(body.enabled)
        return {"enabled": body.enabled}

    return app
