"""Prometheus metrics of the server, in their own registry (prometheus_client)."""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine.engine import LLMEngine
from specserve.outputs import RequestOutput
from specserve.spec.policy import StepTimer

RECENT_REQUESTS = 200  # finished requests kept for /stats
SERIES_POINTS = 600  # sampled gauge points kept for /stats (10 minutes at one per second)
SERIES_EVERY_S = 1.0

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

# Request classes (the `request_class` a client may set): a label on the per-class series. The
# first MAX_REQUEST_CLASSES distinct names keep their own series, later ones fold into "other",
# so clients cannot grow the label set without bound.
DEFAULT_REQUEST_CLASS = "default"
OTHER_REQUEST_CLASS = "other"
MAX_REQUEST_CLASSES = 32
MAX_TAGGED_REQUESTS = 65_536  # request id -> class entries kept for requests not yet finished
CLASS_WINDOW = 100  # finished requests per class behind the per-class gauges
BASELINE_MARKS = 16_384  # engine steps remembered to find the batch a request decoded at


class RequestClasses:
    """Request id -> class label for the per-class metrics, with the number of labels capped."""

    def __init__(self, max_classes: int = MAX_REQUEST_CLASSES, max_tagged: int = MAX_TAGGED_REQUESTS) -> None:
        self.max_classes = max_classes
        self.max_tagged = max_tagged
        self.known: set[str] = {DEFAULT_REQUEST_CLASS}
        self._by_request: collections.OrderedDict[str, str] = collections.OrderedDict()

    def label(self, request_class: str | None) -> str:
        """The label a class name is exported under ("other" once the cap is reached)."""
        name = request_class or DEFAULT_REQUEST_CLASS
        if name not in self.known:
            if len(self.known) >= self.max_classes - 1:  # keep one label for "other"
                return OTHER_REQUEST_CLASS
            self.known.add(name)
        return name

    def tag(self, request_ids: Iterable[str], request_class: str | None) -> None:
        """Remember the class of requests about to be submitted (the oldest tags go past the bound:
        requests that never finished, e.g. refused with 429)."""
        label = self.label(request_class)
        for rid in request_ids:
            self._by_request[rid] = label
            if len(self._by_request) > self.max_tagged:
                self._by_request.popitem(last=False)

    def pop(self, request_id: str) -> str:
        """The class of a finished request (the default one when it was never tagged)."""
        return self._by_request.pop(request_id, DEFAULT_REQUEST_CLASS)


class PlainBaseline:
    """Seconds a plain (non-speculative) decode step takes at the batch a request decoded at.

    The source is the engine's own cost model: the speculation policy's StepTimer, forward time
    by tokens in the step, timed at start-up (`profile_costs`) and refined from every step. A
    plain decode step of b requests carries b tokens, so it costs T(b). The batch a request ran
    at is the time-average of the number of decoding requests over its decode window, kept here
    as a running integral sampled once per engine step. Nothing is reported until the engine has
    timed a one-token step (T(1)): extrapolating from prompt chunks would invent a baseline. The
    timer holds forward time only, so scheduling and sampling overhead make a plain request read
    slightly below 1x.
    """

    def __init__(self, max_marks: int = BASELINE_MARKS) -> None:
        self.timer: StepTimer | None = None
        self._times: collections.deque[float] = collections.deque(maxlen=max_marks)
        self._areas: collections.deque[float] = collections.deque(maxlen=max_marks)  # integral of batch dt
        self._batch = 0

    def observe(self, now: float, num_decoding: int, timer: StepTimer) -> None:
        """An engine step ended at `now` with num_decoding requests decoding."""
        self.timer = timer
        area = self._area_at(now) if self._times else 0.0
        self._times.append(now)
        self._areas.append(area)
        self._batch = num_decoding

    def _area_at(self, t: float) -> float:
        """Integral of the decoding batch size from the first mark to t (clamped to the marks kept)."""
        times, areas = self._times, self._areas
        if t >= times[-1]:
            return areas[-1] + self._batch * (t - times[-1])
        i = bisect.bisect_right(times, t)  # deque indexing is O(n) in the middle; n is bounded
        if i == 0:
            return areas[0]
        t0, a0, t1, a1 = times[i - 1], areas[i - 1], times[i], areas[i]
        return a0 + (a1 - a0) * (t - t0) / (t1 - t0) if t1 > t0 else a1

    def step_seconds(self, start: float, end: float) -> float | None:
        """T(mean decoding batch over [start, end]), or None without a measured one-token step."""
        timer = self.timer
        if timer is None or 1 not in timer.points or not self._times or end <= start:
            return None
        batch = max(1.0, (self._area_at(end) - self._area_at(start)) / (end - start))
        return timer(batch)


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
        self.drafter_bytes = Gauge("specserve_drafter_memory_bytes", "Bytes of drafter weights and KV cache "
                                   "loaded (0 once released while speculation is off).", labels, registry=r)
        self.suffix_tokens = Gauge("specserve_suffix_cache_tokens", "Tokens of finished requests' outputs (each "
                                   "after its prompt's last 32 tokens) kept to draft later requests from "
                                   "(--suffix-cache-requests).", labels, registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Generated tokens.", labels, registry=r)
        self.requests = Counter("specserve_requests", "Finished requests by reason.", ["model", "finish_reason"],
                                registry=r)
        self.preemptions = Counter("specserve_preemptions", "Requests preempted for KV memory.", labels, registry=r)
        self.drafts = Counter("specserve_spec_drafts", "Verify steps that checked drafts.", labels, registry=r)
        self.guard_holds = Counter("specserve_spec_guard_holds", "Times the adaptive policy held speculation off at "
                                   "a batch size where its measured tokens/s fell below 0.95x plain decoding's.",
                                   labels, registry=r)
        self.guard_probes = Counter("specserve_spec_guard_plain_probes", "Decode steps run plain to re-measure "
                                    "plain decoding's tokens/s beside speculation's.", labels, registry=r)
        self.draft_scale = Gauge("specserve_spec_draft_time_scale", "Drafting's measured seconds over the cost "
                                 "model's prediction (recent median), by drafting requests (batch: 1-7, then the "
                                 "power of two starting each bucket); scales the predicted drafting time.",
                                 ["model", "batch"], registry=r)
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
        # Per request class (the request body's `request_class`), observed when a request finishes.
        cl = ["model", "request_class"]
        self.class_draft_tokens = Counter("specserve_request_draft_tokens", "Draft tokens (tree nodes) verified "
                                          "for finished requests, by request class.", cl, registry=r)
        self.class_accepted_tokens = Counter("specserve_request_accepted_tokens", "Draft tokens accepted for "
                                             "finished requests, by request class (over "
                                             "specserve_request_draft_tokens: the acceptance rate).", cl, registry=r)
        self.class_acceptance = Gauge("specserve_acceptance_rate", "Accepted over verified draft tokens of the "
                                      f"class's last {CLASS_WINDOW} finished requests (absent when none drafted).",
                                      cl, registry=r)
        self.class_tokens_per_s = Gauge("specserve_effective_tokens_per_second", "Tokens per second a request "
                                        f"receives after its first, over the class's last {CLASS_WINDOW} requests.",
                                        cl, registry=r)
        self.class_speedup = Gauge("specserve_effective_speedup", "Effective tokens/s over the plain-decoding "
                                   "baseline: the engine's measured forward time of a plain step at the batch the "
                                   "requests decoded at (absent until the engine has timed a one-token step).",
                                   cl, registry=r)
        tl = ["model", "tier"]
        self.tier_hits = Counter("specserve_kv_tier_hit_blocks", "Prefix blocks found in a lower tier of the "
                                 "prefix cache (host memory, disk, the deployment's remote store) and loaded back.", tl, registry=r)
        self.tier_hit_bytes = Counter("specserve_kv_tier_hit_bytes", "KV bytes loaded back from a lower tier.",
                                      tl, registry=r)
        self.tier_load_s = Counter("specserve_kv_tier_load_seconds", "Time spent finding, reading and verifying "
                                   "blocks of a lower tier.", tl, registry=r)
        self.tier_used = Gauge("specserve_kv_tier_used_bytes", "Bytes a lower tier holds.", tl, registry=r)
        self.tier_corrupt = Counter("specserve_kv_tier_corrupt_blocks", "Lower-tier blocks that failed verification "
                                    "(skipped and deleted, never served).", labels, registry=r)
        self.tier_layer_steps = Counter("specserve_kv_tier_layer_wise_steps", "Steps whose disk-tier hits loaded layer "
                                        "by layer beside the forward (--kv-tier-load).", labels, registry=r)
        self.tier_requeued = Counter("specserve_kv_tier_requeued_requests", "Requests sent back to the queue because "
                                     "a lower-tier block they read failed verification mid-step (they recompute it).",
                                     labels, registry=r)
        self.classes = RequestClasses()
        self.baseline = PlainBaseline()
        # Per class: (drafted, accepted, decode tokens, decode seconds, plain seconds or None) per request.
        self._class_window: dict[str, collections.deque[tuple[int, int, int, float, float | None]]] = {}
        self._last: dict[str, float] = {}  # "<engine>:<figure>" -> the cumulative value counted so far
        self._workers: dict[str, tuple[str, dict[str, Any]]] = {}  # disaggregated: name -> (role, last totals)
        self._lock = threading.Lock()
        # Rolling windows for the web page (/stats): recent requests and sampled engine gauges.
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_REQUESTS)
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES_POINTS)
        self._sample: tuple[float, float, float, float] | None = None  # (time, generated, drafted, accepted)

    def _inc_to(self, key: str, counter: Counter, value: float, **labels: str) -> None:
        """Advance a counter to a cumulative engine value (key names the engine and the figure)."""
        prev = self._last.get(key, 0.0)
        if value > prev:
            counter.labels(model=self.model, **labels).inc(value - prev)
            self._last[key] = value

    def on_step(self, engine: LLMEngine) -> None:
        """Refresh gauges and engine-side counters (called by the engine thread)."""
        with self._lock:
            m = self.model
            totals = engine_totals(engine)
            self._count("", totals, spec=True)
            self._set_load([totals], [])
            self.baseline.observe(time.perf_counter(), sum(1 for r in engine.scheduler.running if r.is_decoding),
                                  engine.policy.target_time)
            for batch, scale in engine.policy.draft_scales().items():
                self.draft_scale.labels(m, str(batch)).set(scale)

    def on_worker(self, role: str, name: str, totals: dict[str, Any] | None) -> None:
        """A disaggregated worker's totals (`engine_totals`, in its load report): the deployment's
        figures under the co-located names. Tokens and speculation come from decode workers (a
        prefill worker's one-token requests are no answers), preemptions and tiers from every
        worker; running requests and KV blocks are the decode workers', waiting requests include
        the prompts queued or in prefill on prefill workers. None: the worker is gone."""
        with self._lock:
            if totals is None:
                self._workers.pop(name, None)
                self._last = {k: v for k, v in self._last.items() if not k.startswith(f"{name}:")}
                return
            self._workers[name] = (role, totals)
            self._count(f"{name}:", totals, spec=role == "decode")
            self._set_load([t for r, t in self._workers.values() if r == "decode"],
                           [t for r, t in self._workers.values() if r != "decode"])

    def _count(self, src: str, t: dict[str, Any], spec: bool) -> None:
        """Advance the counters from one engine's cumulative totals (src: which engine)."""
        inc = lambda key, counter, **labels: self._inc_to(src + key, counter, t[key], **labels)  # noqa: E731
        inc("preemptions", self.preemptions)
        tiers = t.get("kv_tier")
        if tiers is not None:
            self._inc_to(src + "tier_corrupt", self.tier_corrupt, tiers["corrupt_blocks"])
            inc("layer_wise_loads", self.tier_layer_steps)
            inc("failed_load_requeues", self.tier_requeued)
            for tier in ("host", "disk", "remote"):
                if f"{tier}_hits" not in tiers:
                    continue
                self._inc_to(f"{src}tier_hits_{tier}", self.tier_hits, tiers[f"{tier}_hits"], tier=tier)
                self._inc_to(f"{src}tier_bytes_{tier}", self.tier_hit_bytes, tiers[f"{tier}_hit_bytes"], tier=tier)
                self._inc_to(f"{src}tier_load_{tier}", self.tier_load_s, tiers[f"{tier}_load_s"], tier=tier)
        if not spec:
            return
        inc("prompt_tokens", self.prompt_tokens)
        inc("generated_tokens", self.generation_tokens)
        inc("num_drafts", self.drafts)
        inc("guard_holds", self.guard_holds)
        inc("guard_probes", self.guard_probes)
        inc("num_draft_tokens", self.draft_tokens)
        inc("num_accepted_tokens", self.accepted_tokens)
        for phase in ("draft", "verify", "decode"):
            inc(f"{phase}_time_s", self.spec_time, phase=phase)
        for length, n in enumerate(t["accepted_lengths"]):
            key = f"{src}len{length}"
            for _ in range(int(n - self._last.get(key, 0))):
                self.accepted_len.labels(self.model).observe(length)
            self._last[key] = max(n, self._last.get(key, 0))
        for j, (d, a) in enumerate(zip(t["drafted_per_position"], t["accepted_per_position"])):
            self._inc_to(f"{src}dpos{j}", self.drafted_pos, d, position=str(j))
            self._inc_to(f"{src}apos{j}", self.accepted_pos, a, position=str(j))

    def _set_load(self, holders: list[dict[str, Any]], others: list[dict[str, Any]]) -> None:
        """Gauges summed over engines: requests and KV of those that hold answers' KV (`holders`);
        waiting requests add every request of the `others` (prefill workers: prompts not yet with
        a decode worker); the prefix cache and the tiers' sizes over all of them."""
        m = self.model
        every = holders + others
        total = lambda key, of=holders: sum(t[key] for t in of)  # noqa: E731
        blocks, used = total("kv_blocks"), total("kv_used_blocks")
        usage_ratio = used / max(blocks, 1)
        self.running.labels(m).set(total("running"))
        self.waiting.labels(m).set(total("waiting", every) + total("running", others))
        self.kv_used.labels(m).set(used)
        self.kv_free.labels(m).set(blocks - used)
        self.kv_usage.labels(m).set(usage_ratio)
        queried = total("prefix_queried_tokens", every)
        self.hit_rate.labels(m).set(total("prefix_hit_tokens", every) / queried if queried else 0.0)
        self.spec_enabled.labels(m).set(1 if any(t["spec_enabled"] for t in holders) else 0)
        self.drafter_bytes.labels(m).set(total("drafter_bytes"))
        self.suffix_tokens.labels(m).set(total("suffix_tokens"))
        for tier in ("host", "disk", "remote"):
            held = [t["kv_tier"][f"{tier}_used_bytes"] for t in every if f"{tier}_used_bytes" in (t.get("kv_tier") or {})]
            if held:
                self.tier_used.labels(m, tier).set(sum(held))
        self._sample_series(holders, usage_ratio)

    def _sample_series(self, holders: list[dict[str, Any]], usage_ratio: float) -> None:
        """Every SERIES_EVERY_S: tokens/s and acceptance since the last sample, KV usage, queue."""
        now = time.time()
        total = lambda key: float(sum(t[key] for t in holders))  # noqa: E731
        cur = (now, total("generated_tokens"), total("num_draft_tokens"), total("num_accepted_tokens"))
        prev = self._sample
        if prev is not None and now - prev[0] < SERIES_EVERY_S:
            return
        self._sample = cur
        if prev is None:
            return
        dt = max(now - prev[0], 1e-9)
        drafted = cur[2] - prev[2]
        self.series.append({
            "t": now, "tokens_per_s": max(cur[1] - prev[1], 0.0) / dt, "kv_usage": usage_ratio,
            "acceptance": (cur[3] - prev[3]) / drafted if drafted > 0 else None,
            "running": int(total("running")), "waiting": int(total("waiting")),
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
        self._observe_class(out)

    def tag_requests(self, request_ids: Iterable[str], request_class: str | None) -> None:
        """Label requests about to be submitted with the client's request class (HTTP thread)."""
        with self._lock:
            self.classes.tag(request_ids, request_class)

    def _observe_class(self, out: RequestOutput) -> None:
        """Per-class acceptance and effective decode rate of a finished request."""
        m = out.metrics
        now = time.perf_counter()  # on_finished runs right after the step that finished the request
        with self._lock:
            cls = self.classes.pop(out.request_id)
            drafted, accepted = int(m.extra.get("num_draft_tokens") or 0), int(m.extra.get("num_accepted_tokens") or 0)
            decode_tokens = m.num_generated_tokens - 1
            decode_s = m.tpot_s * decode_tokens if m.tpot_s is not None and decode_tokens > 0 else 0.0
            plain_s = None
            if decode_s > 0:
                step_s = self.baseline.step_seconds(now - decode_s, now)
                plain_s = None if step_s is None else step_s * decode_tokens  # one token per plain step
            window = self._class_window.setdefault(cls, collections.deque(maxlen=CLASS_WINDOW))
            window.append((drafted, accepted, max(decode_tokens, 0), decode_s, plain_s))
            sum_drafted, sum_accepted = sum(w[0] for w in window), sum(w[1] for w in window)
            sum_tokens, sum_s = sum(w[2] for w in window), sum(w[3] for w in window)
            timed_s = sum(w[3] for w in window if w[4] is not None)
            plain_total_s = sum(w[4] for w in window if w[4] is not None)
        labels = {"model": self.model, "request_class": cls}
        self.class_draft_tokens.labels(**labels).inc(drafted)
        self.class_accepted_tokens.labels(**labels).inc(accepted)
        _set_or_remove(self.class_acceptance, labels, sum_accepted / sum_drafted if sum_drafted else None)
        _set_or_remove(self.class_tokens_per_s, labels, sum_tokens / sum_s if sum_s > 0 else None)
        _set_or_remove(self.class_speedup, labels, plain_total_s / timed_s if timed_s > 0 else None)

    def observe_token_event(self, gap_s: float, num_tokens: int) -> None:
        """A streamed event carrying num_tokens new tokens arrived gap_s after the previous one."""
        if num_tokens > 0:
            per = gap_s / num_tokens
            for _ in range(num_tokens):
                self.itl.labels(self.model).observe(per)

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)


def _set_or_remove(gauge: Gauge, labels: dict[str, str], value: float | None) -> None:
    """Set a labelled gauge, or drop its series when there is no value (a stale one would mislead)."""
    if value is not None:
        gauge.labels(**labels).set(value)
    else:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels.values())


def engine_totals(engine: LLMEngine) -> dict[str, Any]:
    """An engine's cumulative counters and its load, as /metrics reads them: in the engine thread
    (co-located, `ServerMetrics.on_step`) or from a disaggregated worker's load report
    (`ServerMetrics.on_worker`, summed over workers). Plain numbers and lists: it crosses Ray."""
    c = engine.spec_counters
    usage = engine.kv_manager.usage()
    prefix = engine.kv_manager.prefix_cache
    tiers = engine.kv_manager.tiers
    return {
        "prompt_tokens": engine.num_prompt_tokens, "generated_tokens": engine.num_generated_tokens,
        "preemptions": engine.scheduler.num_preemptions,
        "num_drafts": c["num_drafts"], "num_draft_tokens": c["num_draft_tokens"],
        "num_accepted_tokens": c["num_accepted_tokens"],
        "draft_time_s": c["draft_time_s"], "verify_time_s": c["verify_time_s"], "decode_time_s": c["decode_time_s"],
        "guard_holds": engine.policy.guard.num_held, "guard_probes": engine.policy.guard.num_plain_probes,
        "accepted_lengths": list(engine.accepted_length_counts),
        "drafted_per_position": list(engine.drafted_per_position),
        "accepted_per_position": list(engine.accepted_per_position),
        "running": engine.scheduler.num_running, "waiting": engine.scheduler.num_waiting,
        "kv_blocks": usage.num_blocks, "kv_used_blocks": usage.num_used_blocks,
        "prefix_queried_tokens": prefix.num_queried_tokens, "prefix_hit_tokens": prefix.num_hit_tokens,
        "spec_enabled": bool(engine.speculation_enabled),
        "drafter_bytes": getattr(engine, "drafter_memory_bytes", 0),
        "suffix_tokens": getattr(engine, "suffix_cache_tokens", 0),
        "layer_wise_loads": getattr(engine.runner, "num_layer_wise_loads", 0),
        "failed_load_requeues": engine.num_failed_load_requeues,
        "kv_tier": tiers.stats() if tiers is not None else None,
    }


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

    def __init__(self, registry: CollectorRegistry, server: ServerMetrics | None = None) -> None:
        # The server's own metrics, which the workers' totals fill under the co-located names.
        self.server = server
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
        self.prefill_time = Histogram("specserve_prefill_seconds", "Prefill worker time per request (incl. sending), "
                                      "by prefill worker.", ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.draft_transfers = Counter("specserve_draft_kv_transfers",
                                       "Draft-model prompt KV sent by prefill workers, by outcome on the decode "
                                       "worker (arrived; request ended first; failed, stalled, no room: its draft "
                                       "recomputed it).", ["outcome"], registry=r)
        self.draft_transfer_bytes = Counter("specserve_draft_kv_transfer_bytes",
                                            "Draft-model KV bytes moved from prefill to decode workers.", registry=r)
        self.draft_kv_wait = Histogram("specserve_draft_kv_wait_seconds",
                                       "From a request's first decode step to its draft's prompt KV complete (it "
                                       "decodes without drafts meanwhile).", buckets=TOKEN_BUCKETS + (10.0,), registry=r)
        tl = [*wl, "tier"]
        self.tier_hits = Counter("specserve_worker_kv_tier_hit_blocks", "Prefix blocks a worker found in a lower tier "
                                 "(host memory, disk, the deployment's block store) and loaded back.", tl, registry=r)
        self.tier_hit_bytes = Counter("specserve_worker_kv_tier_hit_bytes", "KV bytes a worker loaded back from a "
                                      "lower tier.", tl, registry=r)
        self.tier_load_s = Counter("specserve_worker_kv_tier_load_seconds", "Time a worker spent finding, reading "
                                   "and verifying lower-tier blocks.", tl, registry=r)
        self.tier_corrupt = Counter("specserve_worker_kv_tier_corrupt_blocks", "Lower-tier blocks a worker refused "
                                    "(failed verification: skipped, never served).", wl, registry=r)
        self._tier_seen: dict[tuple[str, ...], float] = {}  # the cumulative figures each worker reported last

    def observe_worker(self, role: str, name: str, stats: dict) -> None:
        """A worker's load report."""
        if self.server is not None and stats.get("engine") is not None:
            self.server.on_worker(role, name, stats["engine"])
        self.worker_running.labels(role, name).set(stats.get("running", 0))
        self.worker_waiting.labels(role, name).set(stats.get("waiting", 0))
        self.worker_kv_free.labels(role, name).set(stats.get("kv_free_blocks", 0))
        self.worker_kv_total.labels(role, name).set(stats.get("kv_total_blocks", 0))
        self.worker_alive.labels(role, name).set(1 if stats.get("alive", True) else 0)
        tiers = stats.get("kv_tier") or {}
        self._advance(self.tier_corrupt, (role, name), tiers.get("corrupt_blocks"))
        for tier in ("host", "disk", "remote"):
            for counter, key in ((self.tier_hits, "hits"), (self.tier_hit_bytes, "hit_bytes"),
                                 (self.tier_load_s, "load_s")):
                self._advance(counter, (role, name, tier), tiers.get(f"{tier}_{key}"))

    def _advance(self, counter: Counter, labels: tuple[str, ...], total: float | None) -> None:
        """Move a counter to a worker's cumulative figure (a restarted worker counts from zero)."""
        if total is None:
            return
        key = (str(id(counter)), *labels)
        last = self._tier_seen.get(key, 0.0)
        delta = total - last if total >= last else total
        if delta > 0:
            counter.labels(*labels).inc(delta)
        self._tier_seen[key] = total

    def worker_gone(self, role: str, name: str) -> None:
        """A worker died: drop its load gauges (they would stay frozen at its last report), mark it dead."""
        if self.server is not None:
            self.server.on_worker(role, name, None)  # its replacement counts from zero
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

    def observe_draft_transfer(self, rec: dict) -> None:
        """One draft prompt-KV transfer, arrived or dropped, as reported by its decode worker."""
        self.draft_transfers.labels(rec.get("outcome") or ("arrived" if rec.get("ok") else "dropped")).inc()
        self.draft_transfer_bytes.inc(rec.get("bytes", 0))
        if rec.get("ok") and rec.get("draft_after_s") is not None:
            self.draft_kv_wait.observe(rec["draft_after_s"])

    def observe_prefill(self, rec: dict) -> None:
        """One finished prefill, as reported by its prefill worker."""
        self.transfer_time.labels("send").observe(rec.get("send_s", 0.0))
        self.prefill_time.labels(str(rec.get("worker", ""))).observe(rec.get("wall_s", 0.0))
