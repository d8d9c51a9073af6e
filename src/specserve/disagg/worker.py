"""Prefill and decode workers: an engine, its connector and the thread that drives them.

`WorkerCore` is plain Python (tests drive two of them in one process); `EngineWorkerActor`
is the same thing as a Ray actor, one process per worker, placed and supervised by Ray.

A prefill worker runs each request's first m = n - 1 tokens (the last prompt token is left to
the decode worker) and streams their KV out layer by layer; its reply is sent when the
transfer is complete. A decode worker queues a request whose first m tokens arrive from a
prefill worker, then decodes it like any other. With a draft model on the decode workers, the
prefill workers hold the same draft (its speculation policy off) and send the draft's prompt
KV too, so the decode worker's draft does not recompute it (see `docs/disaggregation.md`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, replace
from typing import Any

from specserve.disagg.kv_transfer import (
    DecodeConnector,
    KVTransferError,
    PrefillConnector,
    TransferDescriptor,
    draft_kv_layout_of,
    kv_layout_of,
    open_receiver,
    prefill_budget_s,
    travelling_drafter,
)
from specserve.engine.engine import LLMEngine, PreparedRequest, build_off_thread
from specserve.errors import ConfigError
from specserve.outputs import RequestOutput
from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.server.async_engine import take_commands
from specserve.server.metrics import engine_totals

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


def engine_fingerprint(engine: LLMEngine) -> dict[str, Any]:
    """What must agree between a prefill and a decode worker for their KV to be interchangeable."""
    cfg = engine.config
    return {
        "model": cfg.model.model,
        "layout": asdict(kv_layout_of(engine)),
        "quantization": cfg.model.quantization,
        "kv_cache_dtype": cfg.cache.kv_cache_dtype,
        "vocab_size": engine.arch.vocab_size,
        "tokenizer": engine.tokenizer.fingerprint() if engine.tokenizer is not None else None,
    }


def draft_kv_fingerprint(engine: LLMEngine) -> dict[str, Any] | None:
    """What must agree between two workers for one's drafter prompt KV to serve the other's
    drafter (None: this engine's proposer keeps no KV that could travel)."""
    layout = draft_kv_layout_of(engine)
    if layout is None:
        return None
    drafter = travelling_drafter(engine)
    spec = engine.config.spec
    return {"layout": asdict(layout), "method": spec.method,
            "model": spec.draft_model, "num_layers": spec.draft_num_layers, **drafter.prompt_kv_identity()}


def drafts_for_decode(engine: LLMEngine) -> bool:
    """A prefill worker's engine holds a draft only to compute its prompt KV for decode workers."""
    return engine.config.spec.policy == "off" and draft_kv_layout_of(engine) is not None


def check_pairable(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Refuse a prefill/decode pair whose KV or tokens would not mean the same thing."""
    bad = [k for k in ("model", "layout", "quantization", "kv_cache_dtype", "vocab_size", "tokenizer")
           if prefill["fingerprint"].get(k) != decode["fingerprint"].get(k)]
    if bad:
        details = "; ".join(f"{k}: prefill {prefill['fingerprint'].get(k)!r} vs decode {decode['fingerprint'].get(k)!r}"
                            for k in bad)
        raise ConfigError(
            f"prefill worker {prefill['name']} and decode worker {decode['name']} cannot pair ({details}); "
            "start both pools with the same model, dtype, quantization and KV-cache settings."
        )
    if prefill.get("speculation", "none") != "none" and not prefill.get("drafts_for_decode"):
        raise ConfigError(
            f"prefill worker {prefill['name']} was configured with speculation ({prefill['speculation']}); "
            "speculation runs on decode workers only."
        )


class WorkerCore:
    """One engine, one role, one engine thread; every public method is thread-safe."""

    def __init__(self, role: str, engine: LLMEngine, name: str = "", transfer_timeout_s: float = 60.0,
                 kv_layer_start: str = "all") -> None:
        if role not in ROLES:
            raise ConfigError(f"unknown worker role {role!r}; use prefill or decode.")
        if role == "prefill" and engine.proposer is not None and not drafts_for_decode(engine):
            raise ConfigError("speculation runs on decode workers only; start prefill workers without it "
                              "(or with the decode workers' draft model and spec policy 'off': it then "
                              "computes the draft's prompt KV for them).")
        self.role = role
        self.name = name or f"{role}-{os.getpid()}"
        self.engine = engine
        self.transfer_timeout_s = transfer_timeout_s
        self.connector: PrefillConnector | DecodeConnector
        if role == "prefill":
            self.connector = PrefillConnector(engine)
        else:
            self.connector = DecodeConnector(engine, transfer_timeout_s, kv_layer_start)
        engine.attach_connector(self.connector)
        self._draft_kv = draft_kv_fingerprint(engine)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._outbox: list[RequestOutput] = []
        self._cv = threading.Condition()
        self._prefills: dict[str, Any] = {}  # prefill: request id -> _Outgoing
        self._stop = threading.Event()
        self.error: str | None = None
        self.paused = False  # tests: a worker that stops stepping (a hang)
        # Hashes of cached prefix blocks this worker's pool dropped since the last report: the
        # router's prefix index forgets them, so it never sends a "full hit" to a worker that
        # would recompute the whole prompt.
        self._evicted: collections.deque[int] = collections.deque()
        engine.kv_manager.pool.on_evict = lambda h: self._evicted.append(h.value)
        self._thread = threading.Thread(target=self._run, name=f"specserve-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        """Role, identity and the settings a router checks before pairing workers."""
        eng = self.engine
        return {
            "name": self.name,
            "role": self.role,
            "pid": os.getpid(),
            "fingerprint": engine_fingerprint(eng),
            "speculation": eng.config.spec.method,
            "block_size": eng.config.cache.block_size,
            "num_blocks": eng.kv_manager.num_blocks,
            "max_model_len": eng.max_model_len,
            "capacity_tokens": eng.kv_manager.capacity_tokens,
            "max_num_seqs": eng.config.scheduler.max_num_seqs,
            "spec": {"method": eng.config.spec.method, "policy": eng.config.spec.policy,
                     "num_spec_tokens": eng.config.spec.num_spec_tokens},
            "has_proposer": eng.can_speculate,
            "precision": eng.precision,
            "drafts_for_decode": self.role == "prefill" and drafts_for_decode(eng),
            # The draft prompt KV this worker sends (prefill) or takes (decode); the router sends
            # it between two workers whose fingerprints agree.
            "draft_kv": self._draft_kv,
            # The prefix cache's disk tier (its fingerprinted folder), shared by every worker given
            # the same --kv-disk-dir on this host: the deployment's KV store.
            "kv_store": str(tiers.disk.dir) if (tiers := eng.kv_manager.tiers) is not None and tiers.disk is not None
            else None,
            # The deployment's block store across hosts (--kv-store-gib), by actor name, and the
            # fingerprint its records of this model carry.
            "kv_remote": eng.config.cache.kv_remote_store if tiers is not None and tiers.remote is not None else None,
            "kv_fingerprint": tiers.fingerprint if tiers is not None else None,
        }

    def stats(self) -> dict[str, Any]:
        """Load figures the router routes by."""
        eng = self.engine
        sched = eng.scheduler
        totals = engine_totals(eng)  # the server's /metrics sums these over workers
        return {
            "name": self.name,
            "role": self.role,
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "pending_tokens": sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting + sched.running),
            "kv_free_blocks": eng.kv_manager.num_free_blocks,
            "kv_total_blocks": eng.kv_manager.num_blocks,
            "num_steps": eng.num_steps,
            "spec_enabled": eng.speculation_enabled,
            "alive": self.error is None and self._thread.is_alive(),
            "error": self.error,  # why the engine loop stopped: the router replaces such a worker
            "evicted": self._take_evicted(),
            "kv_tier": totals["kv_tier"],  # (read once: the tiers' stats take their locks)
            "engine": totals,
        }

    def _take_evicted(self) -> list[int]:
        out = []
        with contextlib.suppress(IndexError):  # the engine thread appends while this drains
            while True:
                out.append(self._evicted.popleft())
        return out

    # ------------------------------------------------------------------ prefill role
    def prefill(self, request_id: str, token_ids: list[int], desc: TransferDescriptor,
                priority: int = 0) -> dict[str, Any]:
        """Compute KV of token_ids and send it through desc; return when it has all been sent.
        The prompt queues on this worker by its request's priority (lower first), then arrival."""
        req = Request(request_id, token_ids, SamplingParams(max_tokens=1, temperature=0.0), priority=priority)
        done = threading.Event()
        holder: dict[str, Any] = {}
        t0 = time.perf_counter()
        self._commands.put(("prefill", (req, desc, done, holder)))
        if not done.wait(prefill_budget_s(self.transfer_timeout_s, desc)):
            self.abort([request_id])
            raise KVTransferError(f"{self.name}: prefill of {request_id} did not finish in time")
        t = holder.get("transfer")
        if holder.get("error") or t is None:
            raise KVTransferError(f"{self.name}: {holder.get('error', 'prefill failed')}")
        if not t.done.wait(self.transfer_timeout_s):
            raise KVTransferError(f"{self.name}: the KV of {request_id} was not all sent in {self.transfer_timeout_s:g} s")
        if t.error:
            raise KVTransferError(f"{self.name}: {t.error}")
        return {
            "worker": self.name,
            "num_tokens": len(token_ids),
            "num_cached_tokens": max(req.num_cached_tokens, 0),
            "wall_s": time.perf_counter() - t0,
            "send_s": t.stats.send_s,
            "bytes": t.stats.bytes,
            "draft_bytes": t.stats.draft_bytes,
            "draft_compute_s": t.stats.draft_compute_s,
        }

    # ------------------------------------------------------------------ decode role
    def add_decode(self, request: Request, desc: TransferDescriptor | None, emitted_chars: int = 0) -> None:
        """Queue a request; with desc its first desc.num_tokens tokens' KV arrives from a prefill worker.

        The receiving channel exists when this returns, so the prefill may start right away.
        """
        channel = draft_channel = None
        if desc is not None:
            channel = open_receiver(desc)
            self.connector.channels[desc.transfer_id] = channel  # type: ignore[union-attr]
            if desc.draft is not None and self._draft_kv is not None:
                draft_channel = open_receiver(desc.draft)
                self.connector.channels[desc.draft.transfer_id] = draft_channel  # type: ignore[union-attr]
        self._commands.put(("decode", (request, desc, (channel, draft_channel), emitted_chars)))

    def receive_kv(self, transfer_id: str, layer: int, start: int, parts: list[Any]) -> None:
        """Cross-host transport: one (layer, token range) of a transfer arrives (its KV parts)."""
        ch = self.connector.channels.get(transfer_id)  # type: ignore[union-attr]
        if ch is not None and ch.data is not None:
            ch.receive(layer, start, parts)  # type: ignore[attr-defined]

    def wants_kv(self, transfer_id: str) -> bool:
        """Cross-host transport: whether this worker still takes that transfer's KV (a draft's
        transfer it dropped, say because its request ended, is cancelled)."""
        return transfer_id in self.connector.channels  # type: ignore[union-attr]

    def finish_kv(self, transfer_id: str, ok: bool) -> None:
        """Cross-host transport: the sender is done (or gave up)."""
        from specserve.disagg.kv_transfer import STATUS_DONE, STATUS_FAILED

        ch = self.connector.channels.get(transfer_id)  # type: ignore[union-attr]
        if ch is not None and ch.data is not None:
            ch.set_status(STATUS_DONE if ok else STATUS_FAILED)

    def poll(self, timeout_s: float = 0.05) -> tuple[list[RequestOutput], dict[str, Any]]:
        """Outputs since the last poll (waits up to timeout_s for one), plus load and transfer stats."""
        with self._cv:
            if not self._outbox:
                self._cv.wait(timeout_s)
            outs, self._outbox = self._outbox, []
        st = self.stats()
        if isinstance(self.connector, DecodeConnector):
            st["transfers"] = [asdict(t) | {"overlap": t.overlap} for t in self.connector.take_stats()]
            st["draft_transfers"] = [asdict(t) for t in self.connector.take_draft_stats()]
        return outs, st

    # ------------------------------------------------------------------ both
    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (takes effect before the next step)."""
        self._commands.put(("abort", list(request_ids)))

    def set_speculation(self, enabled: bool) -> None:
        """Switch speculation at run time (decode workers)."""
        self._commands.put(("spec", bool(enabled)))

    def check_integrity(self) -> bool:
        """KV bookkeeping of this worker's caches, checked on the engine thread."""
        box: dict[str, Any] = {}
        done = threading.Event()
        self._commands.put(("check", (box, done)))
        if not done.wait(30):
            raise TimeoutError(f"{self.name}: engine thread did not answer")
        if "error" in box:
            raise box["error"]
        return True

    def shutdown(self) -> None:
        """Stop the engine thread."""
        self._stop.set()
        self._commands.put(("noop", None))
        self._thread.join(10)

    # ------------------------------------------------------------------ engine thread
    def _handle(self, cmd: str, arg: Any) -> None:
        eng = self.engine
        if cmd == "prefill":
            req, desc, done, holder = arg
            try:
                holder["transfer"] = self.connector.add(req, desc)  # type: ignore[union-attr, arg-type]
                eng.add_prepared(PreparedRequest(req, None, 0))
                self._prefills[req.request_id] = (done, holder)
            except Exception as exc:  # noqa: BLE001 - report to the caller
                holder["error"] = f"{type(exc).__name__}: {exc}"
                holder.setdefault("transfer", None)
                done.set()
        elif cmd == "decode":
            req, desc, (channel, draft_channel), emitted = arg
            try:
                if desc is not None:
                    self.connector.add(req, desc, channel, draft_channel)  # type: ignore[call-arg, arg-type]
                eng.add_prepared(PreparedRequest(req, None, 0, emitted))
            except Exception as exc:  # noqa: BLE001 - the router gets an error output
                if desc is not None:
                    self.connector.request_finished(req)  # type: ignore[union-attr]  # what add() took on
                    for d, ch in ((desc, channel), (desc.draft, draft_channel)):
                        # Channels add() never took on are still only registered here.
                        if d is not None and self.connector.channels.pop(d.transfer_id, None) is not None:  # type: ignore[union-attr]
                            ch.close()
                req.error = f"{type(exc).__name__}: {exc}"
                self._emit([_error_output(req)])
        elif cmd == "abort":
            self._emit(eng.abort_request(arg))
            for rid in arg:
                entry = self._prefills.pop(rid, None)
                if entry is not None:
                    entry[1]["error"] = "aborted"
                    entry[0].set()
        elif cmd == "spec":
            eng.set_speculation(arg)
        elif cmd == "check":
            box, done = arg
            try:
                eng.check_integrity()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            done.set()

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if self.role == "prefill":
            for out in outputs:
                if out.finished:
                    entry = self._prefills.pop(out.request_id, None)
                    if entry is not None:
                        if out.error or out.finish_reason == "abort":
                            entry[1]["error"] = out.error or "aborted"
                        entry[0].set()
            return
        outputs = [replace(o, prompt_token_ids=[]) for o in outputs]  # the router has the prompt
        if outputs:
            with self._cv:
                self._outbox.extend(outputs)
                self._cv.notify_all()

    def _run(self) -> None:
        eng = self.engine
        idle_work = False
        while not self._stop.is_set():
            try:
                busy = eng.has_unfinished_requests() and not self.paused
                # Running requests: take what is queued. Only transfers in flight: poll them every
                # millisecond. Idle: sleep until a command arrives (only look while idle work remains).
                timeout = None if busy and eng.scheduler.running else 0.001 if busy else 0.0 if idle_work else 0.2
                for cmd in take_commands(self._commands, timeout):
                    self._handle(*cmd)
                if eng.has_unfinished_requests() and not self.paused:
                    self._emit(eng.step())
                    idle_work = False
                else:
                    idle_work = eng.idle_work()
            except Exception as exc:  # noqa: BLE001 - a broken engine: fail loudly, stop
                logger.exception("%s: engine loop crashed", self.name)
                self.error = f"{type(exc).__name__}: {exc}"
                return


def _error_output(req: Request) -> RequestOutput:
    from specserve.outputs import CompletionOutput, RequestMetrics

    return RequestOutput(req.request_id, None, [], [CompletionOutput(0, "", [], finish_reason="error")],
                         True, RequestMetrics(), error=req.error)


def prefill_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """LLM(...) arguments of a prefill worker: no speculation, but with a draft model or an
    EAGLE / MTP head on the decode workers the same drafter, its policy off, to compute its
    prompt KV for them (a prefill pool given spec_method='none' of its own skips that: decode
    workers' draft models then recompute it, and heads draft from their first step's features
    without the prompt's)."""
    method = engine_kwargs.get("spec_method")
    if engine_kwargs.get("draft_model") and method in (None, "draft", "eagle", "mtp"):
        # (nothing joins drafts here: a prefill worker never drafts)
        return {**engine_kwargs, "spec_method": method or "draft", "spec_policy": "off", "profile_spec_costs": False,
                "spec_release_after_s": None, "spec_join": "none"}
    return without_speculation(engine_kwargs)


def without_speculation(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """LLM(...) arguments of an engine that does not speculate: the drafter's settings dropped."""
    kwargs = {k: v for k, v in engine_kwargs.items()
              if k not in ("draft_model", "draft_num_layers", "draft_quantization", "draft_vocab_size", "draft_p_min",
                           "spec_copy", "spec_copy_min_match", "spec_join")}
    return {**kwargs, "spec_method": "none"}


def build_worker(role: str, model: str, engine_kwargs: dict[str, Any], name: str,
                 transfer_timeout_s: float = 60.0, cpus: list[int] | None = None,
                 kv_layer_start: str = "all") -> WorkerCore:
    """Load the model and start a worker (in this process)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    from specserve import LLM

    kwargs = prefill_engine_kwargs(engine_kwargs) if role == "prefill" else engine_kwargs
    llm = build_off_thread(LLM, model, **kwargs)  # the engine thread below steps it
    return WorkerCore(role, llm.engine, name, transfer_timeout_s, kv_layer_start)


class EngineWorkerActor:
    """A worker as a Ray actor (wrap with ray.remote): the same methods, in its own process."""

    def __init__(self, role: str, model: str, engine_kwargs: dict[str, Any], name: str,
                 transfer_timeout_s: float = 60.0, cpus: list[int] | None = None, kv_layer_start: str = "all") -> None:
        logging.basicConfig(level=logging.WARNING)
        self.core = build_worker(role, model, engine_kwargs, name, transfer_timeout_s, cpus, kv_layer_start)

    def info(self) -> dict[str, Any]:
        """See WorkerCore.info; adds the Ray node this actor runs on."""
        import ray

        return self.core.info() | {"node_id": ray.get_runtime_context().get_node_id()}

    def stats(self) -> dict[str, Any]:
        """See WorkerCore.stats."""
        return self.core.stats()

    def prefill(self, request_id: str, token_ids: list[int], desc: TransferDescriptor,
                priority: int = 0) -> dict[str, Any]:
        """See WorkerCore.prefill."""
        return self.core.prefill(request_id, token_ids, desc, priority)

    def add_decode(self, request: Request, desc: TransferDescriptor | None, emitted_chars: int = 0) -> None:
        """See WorkerCore.add_decode."""
        self.core.add_decode(request, desc, emitted_chars)

    def receive_kv(self, transfer_id: str, layer: int, start: int, parts: list[Any]) -> None:
        """See WorkerCore.receive_kv."""
        self.core.receive_kv(transfer_id, layer, start, parts)

    def wants_kv(self, transfer_id: str) -> bool:
        """See WorkerCore.wants_kv."""
        return self.core.wants_kv(transfer_id)

    def finish_kv(self, transfer_id: str, ok: bool) -> None:
        """See WorkerCore.finish_kv."""
        self.core.finish_kv(transfer_id, ok)

    def poll(self, timeout_s: float = 0.05) -> tuple[list[RequestOutput], dict[str, Any]]:
        """See WorkerCore.poll."""
        return self.core.poll(timeout_s)

    def abort(self, request_ids: list[str]) -> None:
        """See WorkerCore.abort."""
        self.core.abort(request_ids)

    def set_speculation(self, enabled: bool) -> None:
        """See WorkerCore.set_speculation."""
        self.core.set_speculation(enabled)

    def check_integrity(self) -> bool:
        """See WorkerCore.check_integrity."""
        return self.core.check_integrity()

    def pause(self, paused: bool = True) -> None:
        """Tests: stop (or resume) stepping, as a hung worker would."""
        self.core.paused = paused

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()
