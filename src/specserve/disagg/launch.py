"""Start a disaggregated deployment: Ray, the worker actors, and the router in front of them.

On one machine `launch()` starts a local Ray instance (no set-up needed); with `ray_address`
it joins an existing cluster and Ray places the actors on its nodes (see docs/disaggregation.md).
The router it builds can restart a worker that dies: `launch()` keeps how it started each one.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.config import SchedulerConfig, SpecConfig
from specserve.disagg.kv_transfer import LAYER_STARTS
from specserve.disagg.router import DisaggFrontend, DisaggRouter, WorkerHandle
from specserve.disagg.worker import ROLES, EngineWorkerActor
from specserve.engine.engine import RequestPreparer
from specserve.errors import ConfigError

logger = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join a Ray cluster at `address` (or $RAY_ADDRESS, Ray's own convention), or start a private
    local one: never a cluster that `ray start` left running on this machine, which a bare
    ray.init() would join (and then refuse num_cpus)."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 configure_logging=False)


def start_worker(role: str, index: int, model: str, engine_kwargs: dict[str, Any], *,
                 transfer_timeout_s: float = 60.0, cpus: list[int] | None = None,
                 scheduling_strategy: Any = None, kv_layer_start: str = "all") -> Any:
    """Create one worker actor (returns its handle at once; the model loads in the background)."""
    import ray

    # No task events: the router polls every worker ~20 times a second, and Ray's GCS keeps an
    # event record per call (a 30-minute soak grew its RSS by 150 MB).
    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 64, "name": None, "max_restarts": 0,
                            "enable_task_events": False}
    if scheduling_strategy is not None:
        opts["scheduling_strategy"] = scheduling_strategy
    actor_cls = ray.remote(EngineWorkerActor)
    return actor_cls.options(**opts).remote(role, model, engine_kwargs, f"{role}-{index}",
                                             transfer_timeout_s, cpus, kv_layer_start)


@dataclass(frozen=True)
class WorkerSpec:
    """How one worker actor is started, kept so that a dead worker can be started again."""

    role: str
    index: int
    model: str
    engine_kwargs: dict[str, Any]
    transfer_timeout_s: float = 60.0
    cpus: list[int] | None = None
    scheduling_strategy: Any = None
    kv_layer_start: str = "all"  # decode workers: DecodeConnector.layer_start

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown worker role {self.role!r}; use prefill or decode.")
        if self.kv_layer_start not in LAYER_STARTS:
            raise ConfigError(f"unknown --kv-layer-start {self.kv_layer_start!r}; use {' or '.join(LAYER_STARTS)}.")

    @property
    def name(self) -> str:
        """The worker's name (the same after a restart)."""
        return f"{self.role}-{self.index}"

    def start(self) -> Any:
        """Create the actor (returns at once; the model loads in the background)."""
        return start_worker(
            self.role,
            self.index,
            self.model,
            self.engine_kwargs,
            transfer_timeout_s=self.transfer_timeout_s,
            cpus=self.cpus,
            scheduling_strategy=self.scheduling_strategy,
            kv_layer_start=self.kv_layer_start,
        )


def connect(model: str, actors: list[Any], *, transport: str = "auto", transfer_timeout_s: float = 60.0,
            max_waiting: int = 256, local_prefill_tokens: int = 32, metrics: Any = None,
            on_output: Any = None, restart: Callable[[str], Any] | None = None,
            max_restarts: int = 3) -> DisaggRouter:
    """Wait for the workers to load, check they can pair, and build the router and its front-end.

    restart(name), if given, starts a fresh actor for the dead worker of that name.
    """
    import ray

    from specserve.models.bundled import resolve_model
    from specserve.models.loader import load_model_metadata

    infos = ray.get([a.info.remote() for a in actors])
    workers = [WorkerHandle(a, info) for a, info in zip(actors, infos, strict=True)]
    decode = [w for w in workers if w.role == "decode"]
    if not decode or len(decode) == len(workers):
        raise ConfigError("need at least one prefill and one decode worker (--prefill-workers, --decode-workers).")
    arch, tokenizer = load_model_metadata(resolve_model(model))
    max_len = min(w.info["max_model_len"] for w in workers)
    capacity = min(w.info["capacity_tokens"] for w in workers)
    preparer = RequestPreparer(tokenizer, arch.vocab_size, max_len, capacity)
    spec = decode[0].info["spec"]
    config = types.SimpleNamespace(
        spec=SpecConfig(method=spec["method"], policy=spec["policy"], num_spec_tokens=spec["num_spec_tokens"],
                        draft_model="<decode workers>" if spec["method"] == "draft" else None),
        scheduler=SchedulerConfig(max_num_seqs=sum(w.info["max_num_seqs"] for w in decode)),
    )
    frontend = DisaggFrontend(model, preparer, config, any(w.info["has_proposer"] for w in decode),
                              precision=decode[0].info.get("precision"))
    if metrics is not None:
        for w in workers:
            metrics.worker_alive.labels(w.role, w.name).set(1)
    return DisaggRouter(frontend, workers, transport=transport, transfer_timeout_s=transfer_timeout_s,
                        max_waiting=max_waiting, local_prefill_tokens=local_prefill_tokens, metrics=metrics,
                        on_output=on_output, restart=restart, max_restarts=max_restarts)


def worker_specs(model: str, engine_kwargs: dict[str, Any], num_prefill: int = 1, num_decode: int = 1, *,
                 ray_address: str | None = None, transfer_timeout_s: float = 60.0,
                 threads_per_worker: int | None = None, pin_cpus: bool = False,
                 role_engine_kwargs: dict[str, dict[str, Any]] | None = None,
                 kv_layer_start: str = "all") -> dict[str, WorkerSpec]:
    """How each worker of a deployment starts, by name; ConfigError for settings that cannot run.

    role_engine_kwargs: per role ("prefill", "decode"), engine settings that override
    engine_kwargs on that pool's workers (each pool tuned on its own: a prefill pool wants a
    large token budget, a decode pool many sequences)."""
    roles = role_engine_kwargs or {}
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ConfigError(f"role_engine_kwargs takes 'prefill' and 'decode', got {sorted(unknown)}.")
    if num_prefill < 1 or num_decode < 1:
        raise ConfigError("--disagg needs --prefill-workers >= 1 and --decode-workers >= 1.")
    ncpu = os.cpu_count() or 1
    total = num_prefill + num_decode
    kwargs = dict(engine_kwargs)
    if threads_per_worker is not None or kwargs.get("num_threads") is None:
        kwargs["num_threads"] = threads_per_worker or max(1, ncpu // total)
    specs = {}
    for i, role in enumerate(["prefill"] * num_prefill + ["decode"] * num_decode):
        cpus = [i % ncpu] if pin_cpus and not ray_address else None
        index = i if role == "prefill" else i - num_prefill
        # On a cluster, spread the workers over the nodes; locally they all share this host.
        strategy = "SPREAD" if ray_address else None
        spec = WorkerSpec(role, index, model, kwargs | roles.get(role, {}), transfer_timeout_s, cpus, strategy,
                          kv_layer_start)
        specs[spec.name] = spec
    return specs


def launch(model: str, engine_kwargs: dict[str, Any], num_prefill: int = 1, num_decode: int = 1, *,
           ray_address: str | None = None, transport: str = "auto", transfer_timeout_s: float = 60.0,
           threads_per_worker: int | None = None, pin_cpus: bool = False, max_waiting: int = 256,
           local_prefill_tokens: int = 32, metrics: Any = None, on_output: Any = None,
           max_restarts: int = 3, role_engine_kwargs: dict[str, dict[str, Any]] | None = None,
           kv_layer_start: str = "all", kv_store_gib: float = 0.0) -> DisaggRouter:
    """Start Ray (or join it), the deployment's KV block store across hosts (kv_store_gib > 0),
    the worker actors (`worker_specs`), and the router (which restarts dead workers)."""
    from specserve.kv_cache.remote import STORE_NAME, start_kv_store

    if not kv_store_gib >= 0:
        raise ConfigError(f"kv_store_gib must be >= 0 (0: no KV store across hosts), got {kv_store_gib}.")
    if kv_store_gib > 0:
        engine_kwargs = {**engine_kwargs, "kv_remote_store": STORE_NAME}
    specs = worker_specs(model, engine_kwargs, num_prefill, num_decode, ray_address=ray_address,
                         transfer_timeout_s=transfer_timeout_s, threads_per_worker=threads_per_worker,
                         pin_cpus=pin_cpus, role_engine_kwargs=role_engine_kwargs, kv_layer_start=kv_layer_start)
    init_ray(ray_address)
    if kv_store_gib > 0:
        start_kv_store(int(kv_store_gib * (1 << 30)))
    actors = [spec.start() for spec in specs.values()]
    return connect(model, actors, transport=transport, transfer_timeout_s=transfer_timeout_s,
                   max_waiting=max_waiting, local_prefill_tokens=local_prefill_tokens, metrics=metrics,
                   on_output=on_output, restart=lambda name: specs[name].start(), max_restarts=max_restarts)


class DisaggClient:
    """Drive a router from synchronous code (tests, benchmarks): its event loop runs in a thread."""

    def __init__(self, router: DisaggRouter) -> None:
        import asyncio
        import threading

        self.router = router
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="specserve-router", daemon=True)
        self._thread.start()
        self.call(self._start())

    async def _start(self) -> None:
        import asyncio

        self.router.start(asyncio.get_running_loop())

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the router's loop and wait for its result."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def request(self, prompt: Any, params: Any, on_output: Any = None) -> Any:
        """One request, as a coroutine on the client's loop (`call` runs it from other threads):
        its final RequestOutput; on_output(out) sees every output on the way."""
        p = self.router.engine.prepare_request(prompt, params)
        stream = self.router.submit([p])
        final = None
        async for _, out in stream:
            if on_output is not None:
                on_output(out)
            if out.finished:
                final = out
        return final

    async def _many(self, prompts: list[Any], params: Any, on_output: Any = None) -> list[Any]:
        import asyncio

        plist = params if isinstance(params, list) else [params] * len(prompts)
        return list(await asyncio.gather(*(self.request(p, sp, on_output) for p, sp in zip(prompts, plist))))

    def generate(self, prompts: list[Any], params: Any, timeout: float | None = 600, on_output: Any = None) -> list[Any]:
        """Submit every prompt at once; the final RequestOutput of each, in order."""
        return self.call(self._many(prompts, params, on_output), timeout)

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Drain the router, check worker integrity, stop the loop."""
        try:
            self.call(self.router.shutdown(drain_timeout_s), timeout=drain_timeout_s + 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
