"""A discrete-event simulator of a specserve deployment, for planning (`specserve plan`).

What it models, each piece as specserve does it:

- a **router** sends each request to a co-located engine (the one with the fewest unfinished
  requests) or, disaggregated, to a prefill worker (fewest prompt tokens pending) and a decode
  worker (most free KV); as `disagg/router.py`, prompts shorter than `local_prefill_tokens`
  are prefilled on their decode worker;
- every **engine** is specserve's scheduler (`engine/scheduler.py`): continuous batching over
  a token budget per step, running requests first in order (a decode takes its token plus its
  drafts, drafts dropped where the budget runs out, a prompt in progress its next chunk), then
  waiting requests admitted FCFS while budget, `max_num_seqs` and KV memory allow; chunked
  prefill shares steps with decodes. KV is reserved for a request's prompt and output when it
  is admitted (the real scheduler allocates as it goes and preempts; a plan should not rely on
  preemption);
- a **KV transfer** of a prompt's m = n - 1 tokens (`disagg/kv_transfer.py`) moves
  m * kv_bytes_per_token over the link; with layer pipelining each chunk streams out layer by
  layer while the next layer computes, so after the prefill only one layer's share of the last
  chunk is left, unless the link fell behind (`calc.transfer_time`). The decode worker then
  computes the last prompt token and samples the first output token in an ordinary step;
- **speculation** by the adaptive policy's rule in simplified form (`spec/policy.py`): each
  step, among the decoding requests whose class drafts with per-token acceptance a > 0, the K
  in 1..k and the requests that draft with the most expected tokens per second, sum_i E_i(K) /
  (T(step with K drafts each) + T_draft(K)), E(K) = (1 - a^(K+1)) / (1 - a); speculate when
  that beats plain decoding by more than `threshold`. As the engine's policy decides per
  request, the requests whose drafts gain the most tokens per verified row draft, as many as
  raise the step's rate (requests alike together), so one with little acceptance does not hold
  back one that copies its answer. A request whose trace gives its own K (a replayed request's
  measured drafts per verify step) drafts that many whenever it drafts: a copy of an earlier
  answer runs longer than the policy's K. A request (or class) with a draft share f < 1 has a
  draft in only that share of the steps it would draft in, drawn each step: prompt lookup
  drafts where its text matches and decodes plainly elsewhere, which costs less than drafting
  every step at the lower acceptance that yields the same tokens. A verified draft keeps its first j tokens with
  probability a^j (1 - a) (j < K), all K with a^K, plus one token from the target. While
  speculation is on, every step also pays what the policy and a model-free proposer cost
  (`CostModel.spec_step_s`), drafting or not: the real policy runs every step; a step that
  verifies drafts also pays `CostModel.spec_verify_s` (a model-free proposer's proposals, the
  draft tree, the verification outside the forward). A step that also carries prompt tokens keeps
  only the drafts that add at most PROMPT_DRAFT_SHARE to its time, the largest cut first, as the
  engine's policy keeps them (a prompt's first token waits for its whole step).

- **the front end**: a request reaches the engine `CostModel.request_overhead_s` after it
  arrives (HTTP or an in-process driver, chat template, tokenizing, streaming the first chunk
  back; the median of the lone requests a profile timed that way, 0 on paper), or
  `CostModel.busy_request_overhead_s` after it where its co-located engine is at work then
  (in-process, the lone requests' time is an engine at rest waking up);
- **workers sharing a machine**: a disaggregated worker's step that starts while another
  worker is computing takes `CostModel.co_run_slowdown(role, batch)` times as long (measured by
  `specserve profile` where the workers share a host's memory and cores; 1 on paper);
- **the relay**: a disaggregated decode worker's step pays what relaying its outputs through
  the router costs (`CostModel.step_s(shape, "decode")`), and a request reaches its worker
  `CostModel.disagg_request_overhead_s` later (the calls between router and workers; both
  measured by `specserve profile --disagg`, 0 on paper).

Step times come from a `CostModel` (`ops/costmodel.py`). Deterministic: one seed gives one
run. Pure Python: no torch.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specserve.errors import SpecServeError
from specserve.ops.calc import (
    cut_largest_first,
    draft_rows_beside_prompt,
    expected_tokens,
    transfer_time,
)
from specserve.ops.costmodel import CostModel, StepShape


class SimulationError(SpecServeError, ValueError):
    """A simulation input cannot be simulated; the message says which and why."""


# ---------------------------------------------------------------------- workload
class SLO(NamedTuple):
    """Latency targets of one request: time to first token and time per output token after it."""

    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a request with these latencies is within the targets."""
        return ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


class TokenRange(NamedTuple):
    """A token count: fixed (lo == hi) or drawn uniformly from [lo, hi]."""

    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        """One count."""
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a workload mix."""

    name: str
    share: float  # fraction of the requests
    prompt_tokens: TokenRange
    output_tokens: TokenRange
    acceptance: float = 0.0  # per-token acceptance of its drafts (0: speculation never pays)
    slo: SLO | None = None  # None: the deployment-wide SLO
    draft_share: float = 1.0  # fraction of decode steps its proposer drafts in (prompt lookup: where it matches)

    def __post_init__(self) -> None:
        if not self.name:
            raise SimulationError("a request class needs a name.")
        if not self.share > 0:
            raise SimulationError(f"class {self.name}: share must be > 0, got {self.share}.")
        for what, r in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= r.lo <= r.hi:
                raise SimulationError(f"class {self.name}: {what} must be >= 1 (and lo <= hi), got {tuple(r)}.")
        if not 0.0 <= self.acceptance <= 1.0:
            raise SimulationError(f"class {self.name}: acceptance must lie in [0, 1], got {self.acceptance}.")
        if not 0.0 < self.draft_share <= 1.0:
            raise SimulationError(f"class {self.name}: draft_share must lie in (0, 1], got {self.draft_share}.")


class TraceRequest(NamedTuple):
    """One request to replay: when it arrives and how much work it brings."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    request_class: str = "default"
    acceptance: float = 0.0  # per-token acceptance of its drafts
    cached_tokens: int = 0  # prompt tokens a prefix cache already holds (not computed again)
    spec_k: int = 0  # drafts per verify step of its own (a replayed request's measured K); 0: the policy's K
    draft_share: float = 1.0  # fraction of its decode steps in which its proposer finds a draft


@dataclass(frozen=True)
class Workload:
    """Poisson arrivals at `rate` requests per second, each of a class drawn by share."""

    rate: float
    classes: tuple[RequestClass, ...]

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise SimulationError(f"rate must be > 0 requests per second, got {self.rate}.")
        if not self.classes:
            raise SimulationError("a workload needs at least one request class.")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise SimulationError(f"request class names must be unique, got {names}.")

    def trace(self, num_requests: int, seed: int = 0) -> list[TraceRequest]:
        """num_requests requests: exponential gaps at `rate`, classes and token counts drawn by `seed`."""
        if num_requests < 1:
            raise SimulationError(f"simulate at least one request, got {num_requests}.")
        rng = random.Random(seed)
        total = sum(c.share for c in self.classes)
        out, t = [], 0.0
        for _ in range(num_requests):
            t += rng.expovariate(self.rate)
            pick, acc = rng.random() * total, 0.0
            cls = self.classes[-1]
            for c in self.classes:
                acc += c.share
                if pick < acc:
                    cls = c
                    break
            out.append(TraceRequest(t, cls.prompt_tokens.sample(rng), cls.output_tokens.sample(rng), cls.name,
                                    cls.acceptance, draft_share=cls.draft_share))
        return out


# ---------------------------------------------------------------------- deployment
@dataclass(frozen=True)
class SpecSetting:
    """Speculation in the simulated engines."""

    k: int = 0  # most draft tokens per request per step; 0: no speculation
    threshold: float = 1.0  # speculate only when the step's expected speedup exceeds this

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= 32:
            raise SimulationError(f"K must be a whole number in [0, 32], got {self.k!r}.")
        if not self.threshold > 0:
            raise SimulationError(f"the speculation threshold must be > 0, got {self.threshold}.")

    @property
    def label(self) -> str:
        """'off' or 'K<=4 >1.2x'."""
        return "off" if self.k == 0 else f"K<={self.k} >{self.threshold:g}x"


@dataclass(frozen=True)
class Deployment:
    """Workers and their scheduler settings: co-located engines, or prefill + decode pools."""

    colocated: int = 1  # engines that prefill and decode (0 when disaggregated)
    prefill: int = 0  # prefill workers
    decode: int = 0  # decode workers
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunk size)
    max_num_seqs: int = 64
    spec: SpecSetting = field(default_factory=SpecSetting)
    layer_pipelining: bool = True  # stream each layer's KV while the next computes
    local_prefill_tokens: int = 32  # disaggregated: shorter prompts prefill on their decode worker

    def __post_init__(self) -> None:
        counts = (self.colocated, self.prefill, self.decode)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
            raise SimulationError(f"worker counts must be whole numbers >= 0, got {counts}.")
        if not ((self.colocated >= 1 and self.prefill == self.decode == 0)
                or (self.colocated == 0 and self.prefill >= 1 and self.decode >= 1)):
            raise SimulationError("give co-located engines (colocated >= 1), or prefill >= 1 and decode >= 1 "
                                  f"workers with colocated = 0; got {counts}.")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise SimulationError("max_num_batched_tokens and max_num_seqs must be >= 1.")

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on separate workers."""
        return self.prefill > 0

    @property
    def label(self) -> str:
        """'2 co-located' or '1P:3D'."""
        return f"{self.prefill}P:{self.decode}D" if self.disaggregated else f"{self.colocated} co-located"


# ---------------------------------------------------------------------- results
class RequestResult(NamedTuple):
    """What one simulated request saw."""

    request_class: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None  # None for a one-token answer
    e2e_s: float


class SimResult(NamedTuple):
    """Every request's latencies (in trace order) and the engines' step counts."""

    requests: tuple[RequestResult, ...]
    duration_s: float  # first arrival to last finish
    num_steps: int
    num_spec_steps: int  # steps that verified drafts


# ---------------------------------------------------------------------- the simulation
_ARRIVAL, _STEP_END, _KV_READY, _FRONT_END = 0, 1, 2, 3


class _Req:
    """A request's progress through the simulated workers."""

    __slots__ = ("trace", "index", "computed", "target", "generated", "first_s", "last_s", "finish_s",
                 "kv_tokens", "link_done_s", "decode_worker")

    def __init__(self, trace: TraceRequest, index: int) -> None:
        self.trace = trace
        self.index = index
        self.computed = 0  # tokens with KV on the worker now holding it
        self.target = 0  # tokens to compute before sampling (the prompt, or m on a prefill worker)
        self.generated = 0
        self.first_s = self.last_s = self.finish_s = math.nan
        self.kv_tokens = 0  # KV reserved on the current worker
        self.link_done_s = 0.0  # disaggregated: when the KV sent so far has arrived
        self.decode_worker: _Engine | None = None


class _Step(NamedTuple):
    start_s: float
    decodes: list[tuple[_Req, int]]  # (request, draft tokens)
    chunks: list[tuple[_Req, int]]  # (request, prompt tokens)


class _Engine:
    """One worker's scheduler and its step loop."""

    def __init__(self, sim: _Simulation, role: str) -> None:
        self.sim = sim
        self.role = role  # "colocated", "prefill" or "decode"
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.busy = False
        self.kv_used = 0
        self.kv_promised = 0  # decode worker: KV of requests whose transfer is under way
        self.pending_tokens = 0  # prefill worker: prompt tokens routed here and not yet computed

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running here."""
        return len(self.waiting) + len(self.running)

    def kick(self, now: float) -> None:
        """Start a step if idle and there is work that fits."""
        if self.busy or not (self.running or self.waiting):
            return
        step = self._schedule(now)
        if not step.decodes and not step.chunks:
            return
        sim = self.sim
        drafts = [d for _, d in step.decodes if d]
        shape = StepShape(
            len(step.decodes), sum(1 + d for _, d in step.decodes),
            sum(r.trace.prompt_tokens + r.generated for r, _ in step.decodes),
            max((r.trace.prompt_tokens + r.generated for r, _ in step.decodes), default=0),
            tuple((n, r.computed) for r, n in step.chunks),
        )
        dt = sim.cost.step_s(shape, self.role) + (sim.cost.draft_s(len(drafts), max(drafts)) if drafts else 0.0)
        if sim.deployment.spec.k and self.role != "prefill":
            dt += sim.cost.spec_step_s(shape.num_seqs)  # the policy runs every step while speculation is on
        if drafts:
            dt += sim.cost.spec_verify_s(len(step.decodes))
        if self.role != "colocated" and any(e.busy for e in sim.workers if e is not self):
            dt *= sim.cost.co_run_slowdown(self.role, shape.num_seqs)  # another worker computes beside this one
        sim.num_steps += 1
        sim.num_spec_steps += bool(drafts)
        self.busy = True
        sim.push(now + dt, _STEP_END, (self, step))

    def _schedule(self, now: float) -> _Step:
        d = self.sim.deployment
        budget = d.max_num_batched_tokens
        k, drafting = self._choose_k() if d.spec.k and self.role != "prefill" else (0, frozenset())
        decodes: list[tuple[_Req, int]] = []
        chunks: list[tuple[_Req, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.computed < r.target:
                n = min(r.target - r.computed, budget)
                chunks.append((r, n))
                budget -= n
            else:
                # Never draft past the last token the request may produce; drop drafts that do not fit.
                own = _own_k(r, k) if r in drafting and self.sim.finds_draft(r.trace) else 0
                drafts = min(own, r.trace.output_tokens - r.generated - 1, budget - 1)
                decodes.append((r, drafts))
                budget -= 1 + drafts
        capacity = self.sim.cost.kv_capacity_tokens
        while self.waiting and budget > 0 and len(self.running) < d.max_num_seqs:
            r = self.waiting[0]
            if self.kv_used + r.kv_tokens > capacity:
                break
            self.waiting.popleft()
            self.kv_used += r.kv_tokens
            self.running.append(r)
            n = min(r.target - r.computed, budget)
            chunks.append((r, n))
            budget -= n
        if chunks and any(dr for _, dr in decodes):
            decodes = self._cap_for_prompts(decodes, chunks)
        return _Step(now, decodes, chunks)

    def _cap_for_prompts(self, decodes: list[tuple[_Req, int]], chunks: list[tuple[_Req, int]]) -> list[tuple[_Req, int]]:
        """The drafts of a step that carries prompt tokens, cut (the largest first) to what adds at
        most PROMPT_DRAFT_SHARE to its time without them, as the engine's policy cuts them
        (`SpecPolicy.cap_for_prompts`): a prompt's first token waits for its whole step."""
        cost, role = self.sim.cost, self.role
        context = sum(r.trace.prompt_tokens + r.generated for r, _ in decodes)
        longest = max(r.trace.prompt_tokens + r.generated for r, _ in decodes)
        prompt = tuple((n, r.computed) for r, n in chunks)

        def step_s(rows: int) -> float:  # the drafts' rows in all (the step's cost counts only those)
            return cost.step_s(StepShape(len(decodes), len(decodes) + rows, context, longest, prompt), role)

        ds = [dr for _, dr in decodes]
        kept = cut_largest_first(ds, draft_rows_beside_prompt(step_s, sum(ds)))
        return [(r, dr) for (r, _), dr in zip(decodes, kept)]

    def _choose_k(self) -> tuple[int, frozenset[_Req]]:
        """The policy's K for this step's decodes and the requests that draft (see the module
        docstring)."""
        sim = self.sim
        spec = sim.deployment.spec
        decoding = [r for r in self.running if r.computed >= r.target]
        eligible = [r for r in decoding if r.trace.acceptance > 0 and r.trace.output_tokens - r.generated > 1]
        if not eligible:
            return 0, frozenset()
        budget = sim.deployment.max_num_batched_tokens
        pending = sum(r.target - r.computed for r in self.running if r.computed < r.target)
        other = min(pending, max(0, budget - len(decoding)))
        prefill = ((other, 0),) if other else ()
        n = len(decoding)
        context = sum(r.trace.prompt_tokens + r.generated for r in decoding)
        longest = max(r.trace.prompt_tokens + r.generated for r in decoding)
        # Requests alike (same acceptance, own K and draft share) draft together, as the policy
        # treats them alike. A group drafting in a share f of its steps adds f of its rows and
        # of its expected extra tokens.
        groups: dict[tuple[float, int, float], list[_Req]] = {}
        for r in eligible:
            groups.setdefault((r.trace.acceptance, r.trace.spec_k, r.trace.draft_share), []).append(r)
        gains = {key: sim.expected(key[0], max(spec.k, key[1])) for key in groups}

        def rate(k: int, members: Sequence[tuple[float, int, float]]) -> float:
            """Expected tokens per second of the step when the groups `members` draft (own K, or k)."""
            rows, tokens, requests, kmax = 0.0, 0.0, 0, 0
            for key in members:
                kr, size, share = key[1] or k, len(groups[key]), key[2]
                rows += kr * size * share
                tokens += (gains[key][kr] - 1) * size * share
                requests += size
                kmax = max(kmax, kr)
            shape = StepShape(n, n + round(rows), context, longest, prefill)
            extra = sim.cost.draft_s(requests, kmax) + sim.cost.spec_verify_s(n) if members else 0.0
            return (n + tokens) / (sim.cost.step_s(shape, self.role) + extra)

        plain = best = rate(0, ())
        best_k, best_set = 0, ()
        for k in range(1, spec.k + 1):
            # The groups whose drafts gain the most tokens per verified row first; the best prefix drafts.
            order = sorted(groups, key=lambda key: (1 - gains[key][key[1] or k]) / (key[1] or k))
            for j in range(1, len(order) + 1):
                if (v := rate(k, order[:j])) > best:
                    best, best_k, best_set = v, k, order[:j]
        drafting = frozenset(r for key in best_set for r in groups[key])
        return (best_k, drafting) if best > spec.threshold * plain else (0, frozenset())

    def end_step(self, now: float, step: _Step) -> None:
        """Apply a finished step: prompt progress, first tokens, accepted drafts, finished requests."""
        sim = self.sim
        self.busy = False
        done: list[_Req] = []
        for r, n in step.chunks:
            r.computed += n
            if self.role == "prefill":
                self.pending_tokens -= n
                sim.stream_kv(r, n, step.start_s, now, last=r.computed >= r.target)
                if r.computed >= r.target:
                    done.append(r)
            elif r.computed >= r.target:
                r.generated = 1
                r.first_s = r.last_s = now
                if r.generated >= r.trace.output_tokens:
                    done.append(r)
        for r, drafts in step.decodes:
            accepted = sim.accepted(r.trace.acceptance, drafts)
            r.generated = min(r.generated + 1 + accepted, r.trace.output_tokens)
            r.last_s = now
            if r.generated >= r.trace.output_tokens:
                done.append(r)
        if done:
            gone = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in gone]
            for r in done:
                self.kv_used -= r.kv_tokens
                if self.role != "prefill":
                    r.finish_s = now
        self.kick(now)


def _own_k(r: _Req, k: int) -> int:
    """Drafts for request r in a step where the policy drafts k per request (0: none)."""
    return 0 if k <= 0 or r.trace.acceptance <= 0 else (r.trace.spec_k or k)


class _Simulation:
    """Event loop, router and shared state of one run."""

    def __init__(self, deployment: Deployment, cost: CostModel, seed: int) -> None:
        self.deployment = deployment
        self.cost = cost
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.num_steps = self.num_spec_steps = 0
        self._expected: dict[float, list[float]] = {}
        if deployment.disaggregated:
            if cost.link_gb_s is None:
                raise SimulationError(f"{cost.description} gives no KV transfer bandwidth, so a disaggregated "
                                      "deployment cannot be simulated; plan co-located engines or profile the link.")
            self.prefill = [_Engine(self, "prefill") for _ in range(deployment.prefill)]
            self.decode = [_Engine(self, "decode") for _ in range(deployment.decode)]
        else:
            self.prefill = []
            self.decode = [_Engine(self, "colocated") for _ in range(deployment.colocated)]
        self.workers = self.prefill + self.decode

    def push(self, t: float, kind: int, payload: Any) -> None:
        """Schedule an event."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def expected(self, acceptance: float, upto: int) -> list[float]:
        """E(K) for K = 0..upto (at least) at this acceptance (cached)."""
        table = self._expected.setdefault(acceptance, [])
        table.extend(expected_tokens(acceptance, k) for k in range(len(table), upto + 1))
        return table

    def finds_draft(self, trace: TraceRequest) -> bool:
        """Whether the request's proposer has a draft this step (always for a model drafter; prompt
        lookup only where its text matches, a share of the steps)."""
        return trace.draft_share >= 1.0 or self.rng.random() < trace.draft_share

    def accepted(self, acceptance: float, drafts: int) -> int:
        """Draft tokens a verify keeps: the first j with probability a^j (1 - a), all with a^K."""
        if drafts <= 0 or acceptance <= 0:
            return 0
        if acceptance >= 1:
            return drafts
        u = 1.0 - self.rng.random()  # (0, 1]: log(u) / log(a) is geometric, P(>= j) = a^j
        return min(drafts, int(math.log(u) / math.log(acceptance)))

    # -- the router
    def route(self, r: _Req, now: float) -> None:
        """Send an arriving request to its worker(s)."""
        t = r.trace
        capacity = self.cost.kv_capacity_tokens
        r.kv_tokens = t.prompt_tokens + t.output_tokens
        if r.kv_tokens > capacity:
            raise SimulationError(f"a request of {t.prompt_tokens} prompt + {t.output_tokens} output tokens "
                                  f"needs more KV than a worker holds ({capacity} tokens); plan larger workers.")
        m = t.prompt_tokens - 1  # tokens whose KV a prefill worker sends
        cached = min(t.cached_tokens, m)
        # Decode workers by the most KV room, counting transfers under way (as the router does).
        decode = max(self.decode, key=lambda e: capacity - e.kv_used - e.kv_promised)
        if not self.deployment.disaggregated or m < max(1, self.deployment.local_prefill_tokens):
            engine = decode if self.deployment.disaggregated else min(self.decode, key=lambda e: e.num_unfinished)
            r.computed, r.target = cached, t.prompt_tokens
            engine.waiting.append(r)
            engine.kick(now)
            return
        decode.kv_promised += r.kv_tokens
        r.decode_worker = decode
        prefill = min(self.prefill, key=lambda e: e.pending_tokens)
        r.computed, r.target = cached, m
        r.kv_tokens = m
        prefill.pending_tokens += m - cached
        prefill.waiting.append(r)
        prefill.kick(now)

    def stream_kv(self, r: _Req, tokens: int, start_s: float, end_s: float, last: bool) -> None:
        """A prefill chunk of `tokens` ran over [start_s, end_s]: move its KV (see the module docstring)."""
        cost = self.cost
        bw = cost.link_gb_s
        assert bw is not None
        if self.deployment.layer_pipelining:
            tt = transfer_time(tokens * cost.kv_bytes_per_token, bw, cost.num_layers,
                               (end_s - start_s) / cost.num_layers)
            r.link_done_s = max(end_s + tt.exposed_s, r.link_done_s + tt.total_s)
        elif last:
            r.link_done_s = end_s + transfer_time(r.target * cost.kv_bytes_per_token, bw).total_s
        if last:
            self.push(r.link_done_s, _KV_READY, r)

    def kv_arrived(self, r: _Req, now: float) -> None:
        """The whole prompt's KV is on the decode worker: it computes the last prompt token next."""
        engine = r.decode_worker
        assert engine is not None
        t = r.trace
        r.kv_tokens = t.prompt_tokens + t.output_tokens
        engine.kv_promised -= r.kv_tokens
        r.computed, r.target = t.prompt_tokens - 1, t.prompt_tokens
        engine.waiting.append(r)
        engine.kick(now)

    def run(self, trace: Sequence[TraceRequest]) -> SimResult:
        """Replay the trace to the end."""
        reqs = [_Req(t, i) for i, t in enumerate(trace)]
        for r in reqs:
            if r.trace.prompt_tokens < 1 or r.trace.output_tokens < 1:
                raise SimulationError(f"request {r.index}: prompt and output need >= 1 token each, "
                                      f"got {r.trace.prompt_tokens} and {r.trace.output_tokens}.")
            # The front end's own time per request (HTTP, chat template, tokenizing, the first
            # chunk's way back) before the engine sees it: 0 unless measured behind the server;
            # disaggregated, also the calls between the router and the workers (profile's relay).
            # Co-located, what it costs depends on whether the engine is at work on arrival.
            if self.deployment.disaggregated:
                local = r.trace.prompt_tokens - 1 < max(1, self.deployment.local_prefill_tokens)
                self.push(r.trace.arrival_s + self.cost.request_overhead_s + self.cost.disagg_request_overhead_s(local),
                          _ARRIVAL, r)
            else:
                self.push(r.trace.arrival_s, _FRONT_END, r)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == _ARRIVAL:
                self.route(payload, now)
            elif kind == _FRONT_END:
                idle = min(e.num_unfinished for e in self.decode) == 0
                self.push(now + (self.cost.request_overhead_s if idle else self.cost.busy_request_overhead_s),
                          _ARRIVAL, payload)
            elif kind == _STEP_END:
                engine, step = payload
                engine.end_step(now, step)
            else:
                self.kv_arrived(payload, now)
        results = []
        for r in reqs:
            t = r.trace
            tpot = (r.last_s - r.first_s) / (r.generated - 1) if r.generated > 1 else None
            results.append(RequestResult(t.request_class, t.arrival_s, t.prompt_tokens, t.output_tokens,
                                         r.first_s - t.arrival_s, tpot, r.finish_s - t.arrival_s))
        first = min((t.arrival_s for t in trace), default=0.0)
        last = max((r.finish_s for r in reqs), default=first)
        return SimResult(tuple(results), last - first, self.num_steps, self.num_spec_steps)


def simulate(trace: Sequence[TraceRequest], deployment: Deployment, cost: CostModel, seed: int = 0) -> SimResult:
    """Run the trace through the deployment with step times from `cost`; `seed` draws draft acceptance."""
    return _Simulation(deployment, cost, seed).run(trace)


# ---------------------------------------------------------------------- summaries
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, interpolating linearly between ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class LatencySummary(NamedTuple):
    """Percentiles of a set of requests' latencies and how many met their SLO."""

    requests: int
    within_slo: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None

    @classmethod
    def of(cls, results: Sequence[RequestResult], slos: Mapping[str, SLO]) -> LatencySummary:
        """The summary of these results (each judged by its class's SLO)."""
        ttft = [r.ttft_s for r in results]
        tpot = [r.tpot_s for r in results if r.tpot_s is not None]
        e2e = [r.e2e_s for r in results]
        good = sum(1 for r in results if slos[r.request_class].met(r.ttft_s, r.tpot_s))
        return cls(len(results), good, percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50),
                   percentile(tpot, 99), percentile(e2e, 50), percentile(e2e, 99))


@dataclass(frozen=True)
class Summary:
    """A run's latency percentiles overall and per class, throughput and goodput within the SLO."""

    overall: LatencySummary
    by_class: dict[str, LatencySummary]
    duration_s: float
    output_tokens_per_s: float
    goodput_req_s: float  # requests within their SLO per second of the run
    slo_attainment: float  # share of requests within their SLO
    spec_step_fraction: float  # share of steps that verified drafts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"overall": self.overall._asdict(), "by_class": {k: v._asdict() for k, v in self.by_class.items()},
                "duration_s": self.duration_s, "output_tokens_per_s": self.output_tokens_per_s,
                "goodput_req_s": self.goodput_req_s, "slo_attainment": self.slo_attainment,
                "spec_step_fraction": self.spec_step_fraction}


def summarize(result: SimResult, slo: SLO | Mapping[str, SLO]) -> Summary:
    """Percentiles, throughput and goodput of a run; `slo` one for all or one per request class."""
    classes = list(dict.fromkeys(r.request_class for r in result.requests))
    slos = {c: slo for c in classes} if isinstance(slo, SLO) else dict(slo)
    missing = [c for c in classes if c not in slos]
    if missing:
        raise SimulationError(f"no SLO for request class(es) {', '.join(missing)}; give one per class or a global one.")
    overall = LatencySummary.of(result.requests, slos)
    by_class = {c: LatencySummary.of([r for r in result.requests if r.request_class == c], slos) for c in classes}
    duration = max(result.duration_s, 1e-9)
    return Summary(
        overall, by_class, result.duration_s,
        sum(r.output_tokens for r in result.requests) / duration,
        overall.within_slo / duration,
        overall.within_slo / max(overall.requests, 1),
        result.num_spec_steps / max(result.num_steps, 1),
    )
