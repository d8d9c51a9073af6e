"""The router (global scheduler) of disaggregated serving, behind the same interface as AsyncEngine.

For each request it picks a decode worker (most free KV blocks) and, unless the decode worker
already caches the whole prompt, the prompt is short (`local_prefill_tokens`) or the request
asks for prompt logprobs (the prompt's own rows, which a prefill worker does not send), a prefill
worker (longest prefix in the global prefix index,
then shortest pending-token queue, among workers with KV room); opens a transfer between them
(shared memory on one host, Ray's object store across hosts), starts the prefill, and relays
the decode worker's outputs to the HTTP stream.

Faults: every worker is a Ray actor; a dead actor makes its calls raise, a hung one makes them
time out, and prefill workers (which relay no outputs) answer a heartbeat. A request whose
decode worker dies is resumed: its prompt plus the tokens already streamed are re-prefilled and
decoding continues on a healthy worker (greedy output is the same as without the failure;
seeded sampling too, since randomness is keyed by position). A failed prefill or transfer is
retried on another prefill worker, and with no healthy prefill worker left the decode worker
prefills the prompt itself (a decode worker is a full engine), so losing the prefill pool
degrades latency, not service. A dead worker is forgotten by the prefix index, its gauges are
dropped, the shared-memory files of its transfers are deleted, and, given a `restart` function,
a fresh worker is started in its place. Only when no decode worker is left (or coming back)
are requests refused, with a message that says so; `health()` tells which case holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.disagg.kv_transfer import (
    ChannelFiles,
    KVLayout,
    TransferDescriptor,
    new_transfer_id,
    prefill_budget_s,
)
from specserve.disagg.worker import check_pairable
from specserve.engine.engine import PreparedRequest, RequestPreparer
from specserve.kv_cache.block_pool import hash_block_tokens
from specserve.kv_cache.tiers import block_file_name
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
    restarts: int = 0  # fresh workers started in this worker's place since its budget was last renewed
    started: float = field(default_factory=time.monotonic)  # when this actor was handed to the router
    restarting: bool = False  # dead, and a replacement is being started
    cause: str | None = None  # why it died

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

    def describe(self) -> dict[str, Any]:
        """This worker as /health shows it."""
        out: dict[str, Any] = {"name": self.name, "role": self.role, "alive": self.alive}
        out["state"] = "alive" if self.alive else "restarting" if self.restarting else "dead"
        out["restarts"] = self.restarts
        if not self.alive and self.cause:
            out["error"] = self.cause
        return out


@dataclass
class _Job:
    """One engine request as the router tracks it across attempts."""

    request: Request  # the original: prompt, params, priority, arrival
    prompt: str | None
    stream: RequestStream
    index: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    emitted_chars: int = 0
    internal_id: str | None = None
    worker: WorkerHandle | None = None
    prefill_worker: WorkerHandle | None = None  # while its prefill runs there
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

    def __init__(self, model_name: str, preparer: RequestPreparer, config: Any, has_proposer: bool,
                 precision: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.precision = precision  # the decode workers' (LLMEngine.precision): they sample
        self.preparer = preparer
        self.tokenizer = preparer.tokenizer
        self.max_model_len = preparer.max_model_len
        self.config = config
        self.can_speculate = has_proposer
        self.speculation_enabled = has_proposer

    def prepare_request(self, prompt: Any, params: Any = None, *, request_id: str | None = None,
                        priority: int = 0, arrival_time: float | None = None, index: int = 0,
                        check_max_tokens: bool = True) -> PreparedRequest:
        """Tokenize and validate (as LLMEngine.prepare_request)."""
        import uuid

        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        return self.preparer.prepare(prompt, params, request_id=rid, priority=priority, arrival_time=arrival_time,
                                     index=index, check_max_tokens=check_max_tokens)


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
        restart: Callable[[str], Any] | None = None,
        max_restarts: int = 3,
        restart_timeout_s: float = 300.0,
        heartbeat_s: float = 0.5,
        restart_renew_s: float = 600.0,
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
        # The KV store every worker shares (their disk tier's folder on this host), if they do:
        # a prompt whose full blocks are all there needs no prefill worker, its decode worker
        # loads them (verified) instead.
        stores = {w.info.get("kv_store") for w in workers}
        self.kv_store: str | None = stores.pop() if len(stores) == 1 else None
        # The store across hosts (--kv-store-gib), when every worker writes to and reads from it.
        remotes = {(w.info.get("kv_remote"), w.info.get("kv_fingerprint")) for w in workers}
        remote = remotes.pop() if len(remotes) == 1 else (None, None)
        self.remote_store: Any = None
        self.remote_fingerprint: str | None = remote[1]
        if remote[0] is not None:
            from specserve.kv_cache.remote import find_kv_store

            self.remote_store = find_kv_store(remote[0])
        self.capacity = sum(w.info.get("max_num_seqs", 64) for w in self.decode) + max_waiting
        self.metrics = metrics
        self.on_output = on_output
        # restart(name) starts a fresh worker actor under a dead worker's name (see launch.py);
        # without it a dead worker stays dead and the others cover for it.
        self.restart = restart
        self.max_restarts = max_restarts
        self.restart_timeout_s = restart_timeout_s
        # A worker that served this long before it died gets its full restart budget back (as
        # Kubernetes resets a pod's crash back-off after ten minutes up): the budget stops a
        # worker that keeps crashing, not the fourth unrelated crash in a server's life.
        self.restart_renew_s = restart_renew_s
        self.heartbeat_s = heartbeat_s
        self.channel_files = ChannelFiles()
        self._jobs: dict[str, _Job] = {}
        self._by_internal: dict[str, _Job] = {}
        self._prefix_index: dict[int, set[str]] = {}  # block hash -> workers that computed it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.accepting = True
        self.last_step_time = time.time()
        self.transfers: list[dict[str, Any]] = []  # completed transfer records (bench, metrics)
        self.draft_transfers: list[dict[str, Any]] = []  # the drafts' prompt KV, likewise
        self.prefills: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start one output poller per decode worker and one heartbeat per prefill worker on `loop`."""
        self._loop = loop
        for w in self.decode:
            self._spawn(self._poll(w))
        for w in self.prefill:
            self._spawn(self._watch(w))

    def _spawn(self, coro: Any) -> asyncio.Task:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def is_alive(self) -> bool:
        """True while a decode worker is alive or being restarted (prefill workers are optional)."""
        return self.error is None

    @property
    def error(self) -> str | None:
        """Why the router cannot serve at all (None while it can)."""
        if any(w.alive or w.restarting for w in self.decode):
            return None
        causes = "; ".join(f"{w.name}: {w.cause}" for w in self.decode)
        return f"every decode worker died ({causes}); restart the server"

    @property
    def status(self) -> str:
        """ok, degraded (some workers are down and the rest cover for them), draining, or stopped."""
        if self.error is not None:
            return "stopped"
        if not self.accepting:
            return "draining"
        return "ok" if all(w.alive for w in self.prefill + self.decode) else "degraded"

    def health(self) -> dict[str, Any]:
        """What /health reports: the status, what a degraded state means for requests, every worker."""
        body: dict[str, Any] = {"status": self.status, "in_flight": self.num_in_flight}
        down = [w for w in self.prefill + self.decode if not w.alive]
        if self.error is not None:
            body["error"] = self.error
        elif down:
            body["degraded"] = self._degraded_reason(down)
        body["workers"] = [w.describe() for w in self.prefill + self.decode]
        return body

    def _degraded_reason(self, down: list[WorkerHandle]) -> str:
        def names(ws: list[WorkerHandle]) -> str:
            return ", ".join(f"{w.name} ({'restarting' if w.restarting else 'dead'})" for w in ws)

        reasons = []
        dead_prefill = [w for w in down if w.role == "prefill"]
        dead_decode = [w for w in down if w.role == "decode"]
        if dead_prefill and len(dead_prefill) == len(self.prefill):
            why = "decode workers prefill prompts themselves"
            reasons.append(f"prefill pool down ({names(dead_prefill)}): {why}")
        elif dead_prefill:
            why = "the other prefill workers take their prompts"
            reasons.append(f"{names(dead_prefill)} down: {why}")
        if dead_decode:
            reasons.append(f"{names(dead_decode)} down: requests run on the other decode workers")
        return "; ".join(reasons)

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
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:  # let them unwind (their finally blocks release channel files)
            await asyncio.wait(tasks, timeout=5.0)
        self.channel_files.release_all()
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
        if not self.accepting:
            raise EngineStoppedError("The server is shutting down; retry on another replica.")
        if not any(w.alive for w in self.decode):
            why = self._no_decode_message()
            raise EngineStoppedError(f"The server has no live workers: {why}.")
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
            for w in (job.worker, job.prefill_worker):  # no one computes for a client that left
                if w is not None and job.internal_id is not None and w.alive:
                    w.actor.abort.remote([job.internal_id])
            self._finish(job, "abort", None)

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation on every decode worker."""
        for w in self.decode:
            if w.alive:
                w.actor.set_speculation.remote(enabled)
        self.engine.speculation_enabled = bool(enabled) and self.engine.can_speculate

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

    async def _stored(self, hashes: list[int]) -> bool:
        """Every full block of the prompt is in a KV store every worker shares: their disk tier's
        folder on this host (as far as a file says), or the store across hosts (as far as its
        index says). Its decode worker then loads them, each verified, instead of a prefill."""
        if not hashes:
            return False
        if self.kv_store is not None and all(os.path.exists(os.path.join(self.kv_store, block_file_name(h)))
                                             for h in hashes):
            return True
        if self.remote_store is None:
            return False
        try:
            held = await asyncio.wait_for(self.remote_store.held.remote(self.remote_fingerprint, hashes), 5.0)
        except Exception as exc:  # noqa: BLE001 - an unreachable store: prefill as usual
            logger.warning("KV store unreachable (%s); prefilling", exc)
            return False
        return held == len(hashes)

    def _forget(self, hashes: Iterable[int], name: str) -> None:
        """A worker's pool dropped these blocks: it no longer holds those prefixes."""
        index = self._prefix_index
        for h in hashes:
            names = index.get(h)
            if names is not None:
                names.discard(name)
                if not names:
                    del index[h]

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

    @staticmethod
    def _draft_descriptor(pre: WorkerHandle, dec: WorkerHandle, transport: str, tokens: list[int],
                          m: int, receiver: Any, queued: int = 0) -> TransferDescriptor | None:
        """The drafter's prompt KV travels too when both workers hold the same drafter (with the
        token after the m that travel: a feature drafter's last slot needs it)."""
        fp = dec.info.get("draft_kv")
        if fp is None or pre.info.get("draft_kv") != fp:
            return None
        return TransferDescriptor(new_transfer_id(), transport, m, KVLayout(**fp["layout"]), receiver=receiver,
                                  next_token=tokens[m], queued_tokens=queued)

    def _no_decode_message(self) -> str:
        restarting = [w.name for w in self.decode if w.restarting]
        if restarting:
            return f"no decode worker is alive ({', '.join(restarting)} restarting); retry in a few seconds"
        return "no decode worker is alive; restart the server or add decode workers"

    # ------------------------------------------------------------------ one request
    async def _drive(self, job: _Job) -> None:
        try:
            await self._drive_attempts(job)
        except Exception as exc:  # noqa: BLE001 - never leave a client hanging
            logger.exception("router failed on %s", job.rid)
            self._finish(job, "error", f"router error: {type(exc).__name__}: {exc}")

    async def _drive_attempts(self, job: _Job) -> None:
        bad_prefill: set[str] = set()  # prefill workers that failed this request without dying
        while not job.finished and not job.aborted:
            if job.attempts >= self.max_attempts:
                self._finish(job, "error", f"gave up after {job.attempts} attempts (workers kept failing)")
                return
            job.attempts += 1
            tokens = job.request.prompt_token_ids + job.output_ids
            m = len(tokens) - 1
            hashes = self._hashes(tokens[:m])
            dec, full_hit = self.pick_decode(hashes)
            if dec is None and any(w.restarting for w in self.decode):
                # Every decode worker is down and one is being restarted: wait for it (a try that
                # never started counts as none), as a request arriving now would.
                job.attempts -= 1
                await self._decode_back(job)
                continue
            if dec is None:
                self._finish(job, "error", self._no_decode_message())
                return
            # Prompt logprobs need every prompt row's logits: the decode worker (a full engine)
            # computes the whole prompt, cached prefixes aside, as a co-located server does.
            need_prefill = (m > 0 and m >= self.local_prefill_tokens and not full_hit
                            and job.request.sampling_params.prompt_logprobs is None
                            and not await self._stored(hashes))
            # No healthy prefill worker (all dead, restarting, or failed on this request): the
            # decode worker prefills the prompt itself.
            if job.aborted:  # its client left while the store was asked
                return
            pre = self.pick_prefill(hashes, m, bad_prefill) if need_prefill else None
            desc = None
            if pre is not None:
                transport = self._transport_for(pre, dec)
                receiver = dec.actor if transport == "ray" else None
                # Counted on its prefill worker at once (before any await), so prompts arriving
                # together see each other queued ahead and spread over the prefill pool.
                queued, pre.pending_tokens = pre.pending_tokens, pre.pending_tokens + m
                desc = TransferDescriptor(new_transfer_id(), transport, m, self.layout, receiver=receiver,
                                          draft=self._draft_descriptor(pre, dec, transport, tokens, m, receiver, queued),
                                          queued_tokens=queued)
                self.channel_files.track(desc, pre.name, dec.name)
            try:
                ok = await self._start_attempt(job, tokens, hashes, dec, pre, desc, bad_prefill)
            finally:
                # The prefill has ended: no one opens its channel by name again.
                if desc is not None:
                    self.channel_files.release(desc)
                if pre is not None:
                    pre.pending_tokens -= m
            if ok:
                await job.changed.wait()
                # Woken: finished, aborted, or lost (its decode worker died / its transfer failed).

    async def _decode_back(self, job: _Job) -> None:
        """Wait until a decode worker is alive, none is being restarted any more, or the job ended."""
        while not (job.finished or job.aborted or any(w.alive for w in self.decode)
                   or not any(w.restarting for w in self.decode)):
            await asyncio.sleep(0.05)

    async def _start_attempt(
        self,
        job: _Job,
        tokens: list[int],
        hashes: list[int],
        dec: WorkerHandle,
        pre: WorkerHandle | None,
        desc: TransferDescriptor | None,
        bad_prefill: set[str],
    ) -> bool:
        """Queue one attempt on its decode worker and run its prefill; False when it must be retried."""
        import ray

        m = len(tokens) - 1
        internal = f"{job.rid}#{job.attempts}"
        req = self._attempt_request(job, internal)
        if job.internal_id is not None:  # an earlier attempt's (lost with its worker or transfer)
            self._by_internal.pop(job.internal_id, None)
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
            return False
        if job.aborted:
            # Its client left while the worker queued it: the abort sent then may have reached the
            # worker's engine thread first (the actor serves calls on many threads), and the request
            # would decode to max_tokens for nobody. Sent again, it comes after the request; no prefill.
            dec.reserved_blocks -= blocks
            self._by_internal.pop(internal, None)
            with contextlib.suppress(Exception):
                dec.actor.abort.remote([internal])
            return False
        job.routed_at = time.perf_counter()
        if pre is None:
            dec.reserved_blocks -= blocks
            self._index(hashes, dec.name)
            return True
        job.prefill_worker = pre
        # The prefill (its queue included), then the rest of its KV sent: the worker's two waits.
        budget = prefill_budget_s(self.transfer_timeout_s, desc) + self.transfer_timeout_s
        try:
            ref = pre.actor.prefill.remote(internal, tokens[:m], desc, job.request.priority)
            st = await asyncio.wait_for(asyncio.wrap_future(ref.future()), budget)
        except Exception as exc:  # noqa: BLE001 - dead, hung, or a failed transfer
            if isinstance(exc, ray.exceptions.RayActorError):
                self._worker_failed(pre, exc)
            elif job.aborted:  # its client left: the decode side closed the channel, nothing failed
                logger.debug("prefill of %s on %s ended by abort: %s", internal, pre.name, exc)
            else:
                pre.num_failures += 1
                bad_prefill.add(pre.name)
                why = (f"no answer within {budget:.1f} s" if isinstance(exc, TimeoutError)
                       else f"{type(exc).__name__}: {exc}")  # a timeout's own message is empty
                logger.warning("prefill of %s on %s failed: %s", internal, pre.name, why)
                with contextlib.suppress(Exception):
                    pre.actor.abort.remote([internal])
            self._by_internal.pop(internal, None)
            with contextlib.suppress(Exception):
                dec.actor.abort.remote([internal])
            return False
        finally:
            dec.reserved_blocks -= blocks
            job.prefill_worker = None
        st["decode_worker"] = dec.name
        st["transport"] = desc.transport if desc else None
        self.prefills.append(st)
        if self.metrics is not None:
            self.metrics.observe_prefill(st)
        self._index(hashes, pre.name, dec.name)
        return True

    def _attempt_request(self, job: _Job, internal: str) -> Request:
        orig = job.request
        req = Request(internal, orig.prompt_token_ids, orig.sampling_params, eos_token_ids=orig.eos_token_ids,
                      priority=orig.priority, arrival_time=None)
        if job.output_ids:
            # Everything already streamed goes with it, so the resumed request reports every
            # token's logprob and top_logprobs (not just those sampled after the move).
            req.append_output_tokens(list(job.output_ids), list(job.logprobs) if job.logprobs else None,
                                     list(job.top_logprobs) if job.top_logprobs else None)
        return req

    # ------------------------------------------------------------------ worker failure
    def _worker_failed(self, w: WorkerHandle, exc: BaseException) -> None:
        """A worker died: move its requests, forget its cache, drop its gauges and files, restart it."""
        if not w.alive:
            return
        w.alive = False
        w.cause = _describe(exc)
        logger.error("worker %s failed (%s); its requests move to other workers", w.name, w.cause)
        for job in list(self._jobs.values()):
            if job.worker is w and not job.finished:
                job.changed.set()
        self._forget([h for h, names in self._prefix_index.items() if w.name in names], w.name)
        self.channel_files.release_worker(w.name)
        if self.metrics is not None:
            self.metrics.worker_gone(w.role, w.name)
        if w.restarts and time.monotonic() - w.started >= self.restart_renew_s:
            logger.info("worker %s ran %.0f s since its last restart: its restart budget is renewed",
                        w.name, time.monotonic() - w.started)
            w.restarts = 0
        if self.restart is not None and self.accepting and w.restarts < self.max_restarts:
            w.restarting = True
            self._spawn(self._restart(w))

    async def _restart(self, dead: WorkerHandle) -> None:
        """Start fresh workers in a dead one's place until one loads and pairs (or restarts run out)."""
        pool = self.prefill if dead.role == "prefill" else self.decode
        try:
            for n in range(dead.restarts, self.max_restarts):
                await asyncio.sleep(min(2.0**n - 1, 30.0))  # 0, 1, 3, 7 ... s between tries
                try:
                    fresh = await self._start_replacement(dead)
                except Exception as exc:  # noqa: BLE001 - e.g. a model that fails to load: try again
                    logger.error("restart %d of %s failed: %s", n + 1, dead.name, _describe(exc))
                    dead.restarts = n + 1
                    continue
                fresh.restarts = n + 1
                pool[pool.index(dead)] = fresh
                logger.warning("worker %s restarted (restart %d)", fresh.name, fresh.restarts)
                if self.metrics is not None:
                    self.metrics.worker_alive.labels(fresh.role, fresh.name).set(1)
                if fresh.role == "decode":
                    if self.engine.can_speculate:
                        fresh.actor.set_speculation.remote(self.engine.speculation_enabled)
                    self._spawn(self._poll(fresh))
                else:
                    self._spawn(self._watch(fresh))
                return
            logger.error("worker %s stays down after %d restarts", dead.name, dead.restarts)
        finally:
            dead.restarting = False

    async def _start_replacement(self, dead: WorkerHandle) -> WorkerHandle:
        """One restart: a new actor under the dead worker's name, loaded and checked against its peers."""
        import ray

        assert self.restart is not None
        actor = await asyncio.to_thread(self.restart, dead.name)
        try:
            info = await asyncio.wait_for(actor.info.remote(), self.restart_timeout_s)
            for peer in self.decode if dead.role == "prefill" else self.prefill:
                pair = (info, peer.info) if dead.role == "prefill" else (peer.info, info)
                check_pairable(*pair)
        except BaseException:
            ray.kill(actor)
            raise
        return WorkerHandle(actor, info)

    # ------------------------------------------------------------------ outputs
    async def _poll(self, w: WorkerHandle) -> None:
        """Relay a decode worker's outputs and load reports until it dies."""
        while w.alive:
            try:
                outs, st = await w.actor.poll.remote(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor is gone
                self._worker_failed(w, exc)
                return
            self.last_step_time = time.time()
            for rec in st.get("transfers", ()):
                rec["decode_worker"] = w.name
                self.transfers.append(rec)
                if self.metrics is not None:
                    self.metrics.observe_transfer(rec)
            for rec in st.get("draft_transfers", ()):
                rec["decode_worker"] = w.name
                self.draft_transfers.append(rec)
                if self.metrics is not None:
                    self.metrics.observe_draft_transfer(rec)
            for out in outs:
                self._on_output(out)
            self._observe(w, st)

    async def _watch(self, w: WorkerHandle) -> None:
        """Heartbeat of a prefill worker (it relays no outputs): its load report, until it dies."""
        while w.alive:
            try:
                st = await w.actor.stats.remote()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor is gone
                self._worker_failed(w, exc)
                return
            self._observe(w, st)
            await asyncio.sleep(self.heartbeat_s)

    def _observe(self, w: WorkerHandle, st: dict[str, Any]) -> None:
        if not w.alive:
            return  # a report that raced the worker's death
        if st.get("error"):  # the actor answers but its engine loop crashed: replace it
            import ray

            self._worker_failed(w, RuntimeError(f"engine loop crashed: {st['error']}"))
            with contextlib.suppress(Exception):
                ray.kill(w.actor)
            return
        w.stats = st
        self._forget(st.get("evicted", ()), w.name)
        if self.metrics is not None:
            self.metrics.observe_worker(w.role, w.name, st)

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
        job.top_logprobs = list(c.top_logprobs) if c.top_logprobs is not None else None
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
                            RequestMetrics(e2e_s=now - job.request.times.arrival), error=error,
                            retryable=error is not None)
        self._close(job)
        if error:
            logger.error("%s: %s", job.rid, error)
        if self.on_output is not None:
            with contextlib.suppress(Exception):
                self.on_output(out)
        self._post(job, out)


def _describe(exc: BaseException) -> str:
    """An exception in one line (Ray's actor errors run to many)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
