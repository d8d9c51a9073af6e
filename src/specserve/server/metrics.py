"""Prometheus metrics of the server, in their own registry (prometheus_client)."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine.engine import LLMEngine
from specserve.outputs import RequestOutput

RECENT_REQUESTS = 200  # finished requests kept for /stats
SERIES_POINTS = 600  # sampled gauge points kept for /stats (10 minutes at one per second)
SERIES_EVERY_S = 1.0

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Histograms, gauges and counters updated from the engine thread and the HTTP layer."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model"]
        self.model = model_name
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Arrival to first output token.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", labels,
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Gap between streamed token events divided by the tokens they carry.", labels,
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("specserve_request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("specserve_num_requests_running", "Requests holding KV blocks.", labels, registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests queued.", labels, registry=r)
        self.kv_used = Gauge("specserve_kv_blocks_used", "KV blocks held by requests or the prefix cache.",
                             labels, registry=r)
        self.kv_free = Gauge("specserve_kv_blocks_free", "KV blocks available (cached ones included).",
                             labels, registry=r)
        self.kv_usage = Gauge("specserve_kv_cache_usage_ratio", "Used over total KV blocks.", labels, registry=r)
        self.hit_rate = Gauge("specserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache "
                              "over prompt tokens looked up.", labels, registry=r)
        self.spec_enabled = Gauge("specserve_speculation_enabled", "1 when speculation may run.", labels,
                                  registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Generated tokens.", labels, registry=r)
        self.requests = Counter("specserve_requests", "Finished requests by reason.", ["model", "finish_reason"],
                                registry=r)
        self.preemptions = Counter("specserve_preemptions", "Requests preempted for KV memory.", labels, registry=r)
        self.drafts = Counter("specserve_spec_drafts", "Verify steps that checked drafts.", labels, registry=r)
        self.draft_tokens = Counter("specserve_spec_draft_tokens", "Draft tokens (tree nodes) verified; "
                                    "over specserve_spec_drafts: nodes per step.", labels, registry=r)
        self.accepted_len = Histogram("specserve_spec_accepted_length", "Draft tokens accepted per verify step.",
                                      labels, buckets=tuple(range(0, 17)), registry=r)
        self.accepted_tokens = Counter("specserve_spec_accepted_tokens", "Draft tokens accepted.", labels,
                                       registry=r)
        self.drafted_pos = Counter("specserve_spec_drafted_per_position", "Verify steps whose draft reached each "
                                   "depth (a chain's position).",
                                   ["model", "position"], registry=r)
        self.accepted_pos = Counter("specserve_spec_accepted_per_position", "Verify steps that accepted a draft "
                                    "node at each depth (acceptance by depth: over drafted_per_position).",
                                    ["model", "position"], registry=r)
        self.spec_time = Counter("specserve_spec_time_seconds", "Engine time by phase (draft, verify, decode).",
                                 ["model", "phase"], registry=r)
        self._last: dict[str, float] = {}
        self._last_pos: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        # Rolling windows for the web page (/stats): recent requests and sampled engine gauges.
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_REQUESTS)
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES_POINTS)
        self._sample: tuple[float, float, float, float] | None = None  # (time, generated, drafted, accepted)

    def _inc_to(self, key: str, counter: Counter, value: float, **labels: str) -> None:
        """Advance a counter to a cumulative engine value."""
        prev = self._last.get(key, 0.0)
        if value > prev:
            counter.labels(model=self.model, **labels).inc(value - prev)
            self._last[key] = value

    def on_step(self, engine: LLMEngine) -> None:
        """Refresh gauges and engine-side counters (called by the engine thread)."""
        with self._lock:
            m = self.model
            usage = engine.kv_manager.usage()
            self.running.labels(m).set(engine.scheduler.num_running)
            self.waiting.labels(m).set(engine.scheduler.num_waiting)
            self.kv_used.labels(m).set(usage.num_used_blocks)
            self.kv_free.labels(m).set(usage.num_free_blocks)
            self.kv_usage.labels(m).set(usage.num_used_blocks / max(usage.num_blocks, 1))
            self._sample_series(engine, usage.num_used_blocks / max(usage.num_blocks, 1))
            self.hit_rate.labels(m).set(usage.prefix_hit_rate)
            self.spec_enabled.labels(m).set(1 if engine.speculation_enabled else 0)
            c = engine.spec_counters
            self._inc_to("prompt", self.prompt_tokens, engine.num_prompt_tokens)
            self._inc_to("gen", self.generation_tokens, engine.num_generated_tokens)
            self._inc_to("preempt", self.preemptions, engine.scheduler.num_preemptions)
            self._inc_to("drafts", self.drafts, c["num_drafts"])
            self._inc_to("draft_tokens", self.draft_tokens, c["num_draft_tokens"])
            self._inc_to("accepted", self.accepted_tokens, c["num_accepted_tokens"])
            for phase, key in (("draft", "draft_time_s"), ("verify", "verify_time_s"), ("decode", "decode_time_s")):
                self._inc_to(f"time_{phase}", self.spec_time, c[key], phase=phase)
            for length, n in enumerate(engine.accepted_length_counts):
                prev = self._last_pos.get(("len", length), 0)
                for _ in range(n - prev):
                    self.accepted_len.labels(m).observe(length)
                self._last_pos[("len", length)] = n
            for j, (d, a) in enumerate(zip(engine.drafted_per_position, engine.accepted_per_position)):
                self._inc_to(f"dpos{j}", self.drafted_pos, d, position=str(j))
                self._inc_to(f"apos{j}", self.accepted_pos, a, position=str(j))

    def _sample_series(self, engine: LLMEngine, usage_ratio: float) -> None:
        """Every SERIES_EVERY_S: tokens/s and acceptance since the last sample, KV usage, queue."""
        now = time.time()
        c = engine.spec_counters
        cur = (now, float(engine.num_generated_tokens), float(c["num_draft_tokens"]), float(c["num_accepted_tokens"]))
        prev = self._sample
        if prev is not None and now - prev[0] < SERIES_EVERY_S:
            return
        self._sample = cur
        if prev is None:
            return
        dt = max(now - prev[0], 1e-9)
        drafted = cur[2] - prev[2]
        self.series.append({
            "t": now, "tokens_per_s": (cur[1] - prev[1]) / dt, "kv_usage": usage_ratio,
            "acceptance": (cur[3] - prev[3]) / drafted if drafted else None,
            "running": engine.scheduler.num_running, "waiting": engine.scheduler.num_waiting,
        })

    def snapshot(self) -> dict[str, Any]:
        """Recent requests and sampled gauges, for the web page's charts."""
        with self._lock:
            return {"model": self.model, "requests": list(self.recent), "series": list(self.series)}

    def on_finished(self, out: RequestOutput) -> None:
        """Observe a finished request's latencies (engine thread)."""
        m = out.metrics
        label = self.model
        x = m.extra
        with self._lock:
            self.recent.append({
                "t": time.time(), "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "tokens": m.num_generated_tokens,
                "acceptance": x.get("acceptance_rate"), "mean_accepted_len": x.get("mean_accepted_len"),
                "finish_reason": out.finish_reason,
            })
        self.requests.labels(model=label, finish_reason=out.finish_reason or "unknown").inc()
        if m.ttft_s is not None:
            self.ttft.labels(label).observe(m.ttft_s)
        if m.tpot_s is not None:
            self.tpot.labels(label).observe(m.tpot_s)
        if m.e2e_s is not None:
            self.e2e.labels(label).observe(m.e2e_s)
        if m.queue_s is not None:
            self.queue.labels(label).observe(m.queue_s)

    def observe_token_event(self, gap_s: float, num_tokens: int) -> None:
        """A streamed event carrying num_tokens new tokens arrived gap_s after the previous one."""
        if num_tokens > 0:
            per = gap_s / num_tokens
            for _ in range(num_tokens):
                self.itl.labels(self.model).observe(per)

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)


class TokenClock:
    """Tracks the time of a stream's previous token event for inter-token latency."""

    def __init__(self) -> None:
        self.last: float | None = None

    def tick(self) -> float | None:
        """Seconds since the previous tick (None on the first)."""
        now = time.perf_counter()
        gap = None if self.last is None else now - self.last
        self.last = now
        return gap


class DisaggMetrics:
    """Per-role worker gauges and KV-transfer figures of a disaggregated server."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        wl = ["role", "worker"]
        self.worker_running = Gauge("specserve_worker_requests_running", "Requests running on a worker.", wl, registry=r)
        self.worker_waiting = Gauge("specserve_worker_requests_waiting", "Requests queued on a worker.", wl, registry=r)
        self.worker_kv_free = Gauge("specserve_worker_kv_blocks_free", "Free KV blocks on a worker.", wl, registry=r)
        self.worker_kv_total = Gauge("specserve_worker_kv_blocks_total", "KV blocks of a worker.", wl, registry=r)
        self.worker_alive = Gauge("specserve_worker_alive", "1 while the worker answers.", wl, registry=r)
        self.transfer_bytes = Counter("specserve_kv_transfer_bytes", "KV bytes moved from prefill to decode workers.",
                                      registry=r)
        self.transfers = Counter("specserve_kv_transfers", "KV transfers by outcome.", ["outcome"], registry=r)
        self.transfer_time = Histogram("specserve_kv_transfer_seconds",
                                       "KV transfer time by phase: send (prefill side), load (decode side), "
                                       "exposed (prefill done -> KV complete on the decode worker).",
                                       ["phase"], buckets=TOKEN_BUCKETS + (10.0,), registry=r)
        self.transfer_overlap = Histogram("specserve_kv_transfer_overlap_ratio",
                                          "Fraction of each transfer's decode-side load done while the prefill "
                                          "was still computing (layer streaming).",
                                          buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0), registry=r)
        self.prefill_time = Histogram("specserve_prefill_seconds", "Prefill worker time per request (incl. sending).",
                                      buckets=LATENCY_BUCKETS, registry=r)

    def observe_worker(self, role: str, name: str, stats: dict) -> None:
        """A worker's load report."""
        self.worker_running.labels(role, name).set(stats.get("running", 0))
        self.worker_waiting.labels(role, name).set(stats.get("waiting", 0))
        self.worker_kv_free.labels(role, name).set(stats.get("kv_free_blocks", 0))
        self.worker_kv_total.labels(role, name).set(stats.get("kv_total_blocks", 0))
        self.worker_alive.labels(role, name).set(1 if stats.get("alive", True) else 0)

    def worker_gone(self, role: str, name: str) -> None:
        """A worker died: drop its load gauges (they would stay frozen at its last report), mark it dead."""
        for gauge in (self.worker_running, self.worker_waiting, self.worker_kv_free, self.worker_kv_total):
            with contextlib.suppress(KeyError):  # never reported (prometheus_client < 0.21 raises)
                gauge.remove(role, name)
        self.worker_alive.labels(role, name).set(0)

    def observe_transfer(self, rec: dict) -> None:
        """One finished transfer, as reported by its decode worker."""
        self.transfers.labels("ok" if rec.get("ok") else "failed").inc()
        self.transfer_bytes.inc(rec.get("bytes", 0))
        self.transfer_time.labels("load").observe(rec.get("load_s", 0.0))
        self.transfer_time.labels("exposed").observe(rec.get("exposed_s", 0.0))
        self.transfer_overlap.observe(rec.get("overlap", 0.0))

    def observe_prefill(self, rec: dict) -> None:
        """One finished prefill, as reported by its prefill worker."""
        self.transfer_time.labels("send").observe(rec.get("send_s", 0.0))
        self.prefill_time.observe(rec.get("wall_s", 0.0))
