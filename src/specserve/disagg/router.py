"""The router (global scheduler) of disaggregated serving, behind the same interface as AsyncEngine.

For each request it picks a decode worker (most free KV blocks) and, unless the decode worker
already caches the whole prompt or the prompt is short (`local_prefill_tokens`), a prefill worker (longest prefix in the global prefix index,
then shortest pending-token queue, among workers with KV room); opens a transfer between them
(shared memory on one host, Ray's object store across hosts), starts the prefill, and relays
the decode worker's outputs to the HTTP stream.

Faults: every worker is a Ray actor; a dead actor makes its calls raise, a hung one makes them
time out. A request whose decode worker dies is resumed: its prompt plus the tokens already
streamed are re-prefilled and decoding continues on a healthy worker (greedy output is the
same as without the failure; seeded sampling too, since randomness is keyed by position).
A failed prefill or transfer is retried on another prefill worker. When no worker of a role
is left the request ends with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.disagg.kv_transfer import KVLayout, TransferDescriptor, new_transfer_id
from specserve.disagg.worker import check_pairable
from specserve.engine.engine import PreparedRequest, RequestPreparer
from specserve.kv_cache.block_pool import hash_block_tokens
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.request import Request
from specserve.server.async_engine import EngineOverloadedError, EngineStoppedError, RequestStream

logger = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    """The router's view of one worker actor."""

    actor: Any
    info: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)
    alive: bool = True
    pending_tokens: int = 0  # prefill: tokens the router sent and has not heard back about
    reserved_blocks: int = 0  # decode: blocks promised to requests not yet reported in stats
    num_failures: int = 0

    @property
    def name(self) -> str:
        """Worker name."""
        return self.info["name"]

    @property
    def role(self) -> str:
        """prefill or decode."""
        return self.info["role"]

    @property
    def node_id(self) -> str | None:
        """Ray node the worker runs on."""
        return self.info.get("node_id")

    @property
    def free_blocks(self) -> int:
        """Free KV blocks by the last report, minus what the router has routed there since."""
        return self.stats.get("kv_free_blocks", self.info["num_blocks"]) - self.reserved_blocks


@dataclass
class _Job:
    """One engine request as the router tracks it across attempts."""

    request: Request  # the original: prompt, params, priority, arrival
    prompt: str | None
    stream: RequestStream
    index: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    emitted_chars: int = 0
    internal_id: str | None = None
    worker: WorkerHandle | None = None
    attempts: int = 0
    finished: bool = False
    aborted: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_at: float | None = None
    routed_at: float | None = None

    @property
    def rid(self) -> str:
        """The client-facing request id."""
        return self.request.request_id


class DisaggFrontend:
    """What the HTTP layer needs from an 'engine' in disaggregated mode: tokenizer, limits, config."""

    def __init__(self, model_name: str, preparer: RequestPreparer, config: Any, has_proposer: bool) -> None:
        self.model_name = model_name
        self.preparer = preparer
        self.tokenizer = preparer.tokenizer
        self.max_model_len = preparer.max_model_len
        self.config = config
        self.proposer = object() if has_proposer else None
        self.speculation_enabled = has_proposer

    def prepare_request(self, prompt: Any, params: Any = None, *, request_id: str | None = None,
                        priority: int = 0, arrival_time: float | None = None, index: int = 0) -> PreparedRequest:
        """Tokenize and validate (as LLMEngine.prepare_request)."""
        import uuid

        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        return self.preparer.prepare(prompt, params, request_id=rid, priority=priority,
                                     arrival_time=arrival_time, index=index)


class DisaggRouter:
    """Routes requests over prefill and decode workers; the server talks to it like an AsyncEngine."""

    def __init__(
        self,
        frontend: DisaggFrontend,
        workers: list[WorkerHandle],
        *,
        transport: str = "auto",
        transfer_timeout_s: float = 60.0,
        max_waiting: int = 256,
        max_attempts: int = 4,
        local_prefill_tokens: int = 32,
        metrics: Any = None,
        on_output: Any = None,
    ) -> None:
        self.engine = frontend  # the name the HTTP layer uses
        self.prefill = [w for w in workers if w.role == "prefill"]
        self.decode = [w for w in workers if w.role == "decode"]
        if not self.prefill or not self.decode:
            raise ValueError("disaggregated serving needs at least one prefill and one decode worker")
        for p in self.prefill:
            for d in self.decode:
                check_pairable(p.info, d.info)
        if transport not in ("auto", "shm", "ray"):
            raise ValueError(f"unknown KV transport {transport!r}; use auto, shm or ray")
        self.transport = transport
        self.transfer_timeout_s = transfer_timeout_s
        self.max_attempts = max_attempts
        # Prompts this short are prefilled by their decode worker: a few tokens cost it about one
        # decode step, far less than waiting behind a long prompt on a prefill worker.
        self.local_prefill_tokens = local_prefill_tokens
        self.block_size = self.decode[0].info["block_size"]
        self.layout = KVLayout(**self.decode[0].info["fingerprint"]["layout"])
        self.capacity = sum(w.info.get("max_num_seqs", 64) for w in self.decode) + max_waiting
        self.metrics = metrics
        self.on_output = on_output
        self._jobs: dict[str, _Job] = {}
        self._by_internal: dict[str, _Job] = {}
        self._prefix_index: dict[int, set[str]] = {}  # block hash -> workers that computed it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.accepting = True
        self.error: str | None = None
        self.last_step_time = time.time()
        self.transfers: list[dict[str, Any]] = []  # completed transfer records (bench, metrics)
        self.prefills: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start one output poller per decode worker on `loop`."""
        self._loop = loop
        for w in self.decode:
            self._spawn(self._poll(w))

    def _spawn(self, coro: Any) -> asyncio.Task:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def is_alive(self) -> bool:
        """True while a prefill and a decode worker are alive."""
        return any(w.alive for w in self.decode) and any(w.alive for w in self.prefill) and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._jobs)

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, drain, abort leftovers, check every worker's KV integrity."""
        self.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._jobs and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        if self._jobs:
            self.abort(list(self._jobs))
            await asyncio.sleep(0.2)
        ok = await self.check_integrity()
        for task in list(self._tasks):
            task.cancel()
        logger.info("disaggregated shutdown: KV integrity %s on every live worker", "holds" if ok else "VIOLATED")

    async def check_integrity(self) -> bool:
        """Check KV bookkeeping on every live worker (raises nothing; logs violations)."""
        ok = True
        for w in self.prefill + self.decode:
            if not w.alive:
                continue
            try:
                await w.actor.check_integrity.remote()
            except Exception as exc:  # noqa: BLE001 - report every worker
                logger.error("%s: KV integrity: %s", w.name, exc)
                ok = False
        return ok

    # ------------------------------------------------------------------ requests
    def submit(self, prepared: list[PreparedRequest]) -> RequestStream:
        """Start routing each request; returns the stream their outputs arrive on."""
        if not self.accepting or not self.is_alive:
            raise EngineStoppedError("The server is shutting down or has no live workers; retry later.")
        if len(self._jobs) + len(prepared) > self.capacity:
            raise EngineOverloadedError(
                f"{len(self._jobs)} requests are in flight and the router holds at most {self.capacity}; "
                "retry after a short wait."
            )
        stream = RequestStream(self, [p.request.request_id for p in prepared])  # type: ignore[arg-type]
        for p in prepared:
            job = _Job(p.request, p.prompt, stream, stream.choice_index[p.request.request_id])
            self._jobs[job.rid] = job
            self._spawn(self._drive(job))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests wherever they are."""
        for rid in request_ids:
            job = self._jobs.get(rid)
            if job is None or job.finished:
                continue
            job.aborted = True
            if job.worker is not None and job.internal_id is not None and job.worker.alive:
                job.worker.actor.abort.remote([job.internal_id])
            self._finish(job, "abort", None)

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation on every decode worker."""
        for w in self.decode:
            if w.alive:
                w.actor.set_speculation.remote(enabled)
        self.engine.speculation_enabled = bool(enabled) and self.engine.proposer is not None

    # ------------------------------------------------------------------ routing
    def _hashes(self, tokens: list[int]) -> list[int]:
        out, parent = [], None
        for i in range(len(tokens) // self.block_size):
            parent = hash_block_tokens(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            out.append(parent.value)
        return out

    def _matched(self, hashes: list[int], name: str) -> int:
        n = 0
        for h in hashes:
            if name not in self._prefix_index.get(h, ()):
                break
            n += 1
        return n

    def _index(self, hashes: list[int], *names: str) -> None:
        for h in hashes:
            self._prefix_index.setdefault(h, set()).update(names)

    def pick_decode(self, hashes: list[int]) -> tuple[WorkerHandle | None, bool]:
        """(worker, full prefix hit): a worker caching every full block of the prompt, else most free blocks."""
        live = [w for w in self.decode if w.alive]
        if not live:
            return None, False
        if hashes:
            full = [w for w in live if self._matched(hashes, w.name) == len(hashes)]
            if full:
                return max(full, key=lambda w: w.free_blocks), True
        return max(live, key=lambda w: w.free_blocks), False

    def pick_prefill(self, hashes: list[int], num_tokens: int, exclude: set[str]) -> WorkerHandle | None:
        """Longest cached prefix first, then the shortest pending-token queue, among workers with room."""
        live = [w for w in self.prefill if w.alive and w.name not in exclude]
        if not live:
            return None
        need = -(-num_tokens // self.block_size)
        roomy = [w for w in live if w.info["num_blocks"] >= need] or live
        return max(roomy, key=lambda w: (self._matched(hashes, w.name), -w.pending_tokens))

    def _transport_for(self, pre: WorkerHandle, dec: WorkerHandle) -> str:
        if self.transport != "auto":
            return self.transport
        return "shm" if pre.node_id == dec.node_id else "ray"

    # ------------------------------------------------------------------ one request
    async def _drive(self, job: _Job) -> None:
        try:
            await self._drive_attempts(job)
        except Exception as exc:  # noqa: BLE001 - never leave a client hanging
            logger.exception("router failed on %s", job.rid)
            self._finish(job, "error", f"router error: {type(exc).__name__}: {exc}")

    async def _drive_attempts(self, job: _Job) -> None:
        import ray

        bad_prefill: set[str] = set()
        while not job.finished and not job.aborted:
            if job.attempts >= self.max_attempts:
                self._finish(job, "error", f"gave up after {job.attempts} attempts (workers kept failing)")
                return
            job.attempts += 1
            tokens = job.request.prompt_token_ids + job.output_ids
            m = len(tokens) - 1
            hashes = self._hashes(tokens[:m])
            dec, full_hit = self.pick_decode(hashes)
            if dec is None:
                self._finish(job, "error", "no decode worker is alive; restart the server or add decode workers")
                return
            need_prefill = m > 0 and m >= self.local_prefill_tokens and not full_hit
            pre = self.pick_prefill(hashes, m, bad_prefill) if need_prefill else None
            if need_prefill and pre is None:
                self._finish(job, "error", "no healthy prefill worker is left; restart the server or add prefill workers")
                return
            internal = f"{job.rid}#{job.attempts}"
            desc = None
            if pre is not None:
                transport = self._transport_for(pre, dec)
                desc = TransferDescriptor(new_transfer_id(), transport, m, self.layout,
                                          receiver=dec.actor if transport == "ray" else None)
            req = self._attempt_request(job, internal)
            job.internal_id, job.worker = internal, dec
            self._by_internal[internal] = job
            job.changed.clear()
            blocks = -(-len(tokens) // self.block_size)
            dec.reserved_blocks += blocks
            try:
                await dec.actor.add_decode.remote(req, desc, job.emitted_chars)
            except Exception as exc:  # noqa: BLE001 - a dead or broken decode worker
                dec.reserved_blocks -= blocks
                self._worker_failed(dec, exc)
                continue
            job.routed_at = time.perf_counter()
            if pre is not None:
                pre.pending_tokens += m
                try:
                    ref = pre.actor.prefill.remote(internal, tokens[:m], desc)
                    budget = self.transfer_timeout_s + 0.05 * m
                    st = await asyncio.wait_for(asyncio.wrap_future(ref.future()), budget)
                except Exception as exc:  # noqa: BLE001 - dead, hung, or a failed transfer
                    pre.pending_tokens -= m
                    dec.reserved_blocks -= blocks
                    if isinstance(exc, ray.exceptions.RayActorError):
                        self._worker_failed(pre, exc)
                    else:
                        pre.num_failures += 1
                        bad_prefill.add(pre.name)
                        logger.warning("prefill of %s on %s failed: %s", internal, pre.name, exc)
                        with contextlib.suppress(Exception):
                            pre.actor.abort.remote([internal])
                    self._by_internal.pop(internal, None)
                    with contextlib.suppress(Exception):
                        dec.actor.abort.remote([internal])
                    continue
                pre.pending_tokens -= m
                st["decode_worker"] = dec.name
                st["transport"] = desc.transport if desc else None
                self.prefills.append(st)
                if self.metrics is not None:
                    self.metrics.observe_prefill(st)
                self._index(hashes, pre.name, dec.name)
            else:
                self._index(hashes, dec.name)
            dec.reserved_blocks -= blocks
            await job.changed.wait()
            # Woken: finished, aborted, or lost (its decode worker died / its transfer failed).

    def _attempt_request(self, job: _Job, internal: str) -> Request:
        orig = job.request
        req = Request(internal, orig.prompt_token_ids, orig.sampling_params, eos_token_ids=orig.eos_token_ids,
                      priority=orig.priority, arrival_time=None)
        if job.output_ids:
            req.append_output_tokens(list(job.output_ids), list(job.logprobs) if job.logprobs else None)
        return req

    def _worker_failed(self, w: WorkerHandle, exc: BaseException) -> None:
        if w.alive:
            logger.error("worker %s failed (%s: %s); its requests move to other workers", w.name,
                         type(exc).__name__, exc)
        w.alive = False
        for job in list(self._jobs.values()):
            if job.worker is w and not job.finished:
                job.changed.set()
        if self.metrics is not None:
            self.metrics.worker_alive.labels(role=w.role, worker=w.name).set(0)

    # ------------------------------------------------------------------ outputs
    async def _poll(self, w: WorkerHandle) -> None:
        while w.alive:
            try:
                outs, st = await w.actor.poll.remote(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor is gone
                self._worker_failed(w, exc)
                return
            w.stats = st
            self.last_step_time = time.time()
            for rec in st.get("transfers", ()):
                rec["decode_worker"] = w.name
                self.transfers.append(rec)
                if self.metrics is not None:
                    self.metrics.observe_transfer(rec)
            if self.metrics is not None:
                self.metrics.observe_worker(w.role, w.name, st)
            for out in outs:
                self._on_output(out)

    def _on_output(self, out: RequestOutput) -> None:
        job = self._by_internal.get(out.request_id)
        if job is None or job.finished or job.internal_id != out.request_id:
            return  # an earlier attempt of a resumed request, or already closed
        c = out.outputs[0]
        if out.finished and out.error and out.error.startswith("KVTransferError"):
            logger.warning("%s: %s; re-prefilling", out.request_id, out.error)
            job.changed.set()
            return
        now = time.perf_counter()
        job.output_ids = list(c.token_ids)
        job.logprobs = list(c.logprobs) if c.logprobs is not None else None
        job.emitted_chars += len(c.delta_text)
        if job.first_token_at is None and c.token_ids:
            job.first_token_at = now
        relayed = replace(out, request_id=job.rid, prompt=job.prompt,
                          prompt_token_ids=job.request.prompt_token_ids,
                          outputs=[replace(c, index=job.index)])
        if out.finished:
            relayed.metrics = self._metrics(job, out, now)
            self._close(job)
            if self.on_output is not None:
                with contextlib.suppress(Exception):
                    self.on_output(relayed)
        self._post(job, relayed)

    def _metrics(self, job: _Job, out: RequestOutput, now: float) -> RequestMetrics:
        """Latencies on the router's clock (workers may run on other hosts)."""
        arrival = job.request.times.arrival
        m = out.metrics
        n = len(job.output_ids)
        ttft = (job.first_token_at - arrival) if job.first_token_at is not None else None
        tpot = (now - job.first_token_at) / (n - 1) if job.first_token_at is not None and n > 1 else None
        extra = dict(m.extra) | {"attempts": job.attempts, "decode_worker": job.worker.name if job.worker else None}
        return replace(m, ttft_s=ttft, tpot_s=tpot, e2e_s=now - arrival,
                       queue_s=(job.routed_at - arrival) if job.routed_at else None,
                       num_prompt_tokens=len(job.request.prompt_token_ids), num_generated_tokens=n, extra=extra)

    def _post(self, job: _Job, out: RequestOutput | BaseException) -> None:
        item = out if isinstance(out, BaseException) else (job.index, out)
        job.stream.queue.put_nowait(item)  # type: ignore[arg-type]

    def _close(self, job: _Job) -> None:
        job.finished = True
        self._jobs.pop(job.rid, None)
        if job.internal_id is not None:
            self._by_internal.pop(job.internal_id, None)
        job.changed.set()

    def _finish(self, job: _Job, reason: str, error: str | None) -> None:
        """End a job from the router side (abort, or an error no worker can fix)."""
        if job.finished:
            return
        now = time.perf_counter()
        text = ""
        if self.engine.tokenizer is not None and job.output_ids:
            text = self.engine.tokenizer.decode(job.output_ids)
        c = CompletionOutput(job.index, text, list(job.output_ids), finish_reason=reason,
                             delta_text=text[job.emitted_chars:], delta_token_ids=[])
        out = RequestOutput(job.rid, job.prompt, job.request.prompt_token_ids, [c], True,
                            RequestMetrics(e2e_s=now - job.request.times.arrival), error=error)
        self._close(job)
        if error:
            logger.error("%s: %s", job.rid, error)
        if self.on_output is not None:
            with contextlib.suppress(Exception):
                self.on_output(out)
        self._post(job, out)
