"""When to speculate and how far: K per request per step from a measured cost model.

Speculating K tokens for a request whose drafts are accepted with (per-position) rates
a_1, a_2, ... yields 1 + E(K) tokens per target step, E(K) = sum_{m<=K} prod_{j<=m} a_j
(the geometric model (1 - b^(K+1)) / (1 - b) when every a_j = b). It costs the verify of K
more tokens in the target pass plus the drafting. The policy greedily adds draft tokens
(one request, one position at a time) while the batch's expected tokens per second rises:

    throughput = sum_i (1 + E_i(k_i)) / (T_target(n + sum_i k_i) + T_draft(k_max, batch))

T_target(n) is the target forward time for n tokens in a step, T_draft the drafting time,
both measured at start-up and refined online. Hard limits follow the reference thresholds:
speculate at batch <= on_batch, never at batch >= off_batch, only priority requests between.

A position's acceptance is only learned when it is drafted, so an estimate that one unlucky
rejection pushed below the break-even point would never be corrected: the policy stops
drafting there and the estimate stays stale. Two things keep the estimates honest: a new
request starts from the acceptance pooled over earlier requests (not a fixed prior), and a
request held below K = num_spec_tokens drafts one position more every PROBE_EVERY steps.
(Measured on a 2-vCPU Xeon, Qwen2.5-Coder 1.5B + 0.5B draft, coding prompts: before this the
policy settled on K = 1 for most steps, 26.2 tok/s; a fixed K = 3 gave 28.6.)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.config import SpecConfig
from specserve.request import Request

EWMA = 0.15  # weight of the newest observation in acceptance and timing estimates
POOLED_EWMA = 0.05  # the same for the acceptance pooled over requests (a new request's prior)
PROBE_EVERY = 16  # re-try k=1 (or k+1) this often for a request the cost model held back


class StepTimer:
    """Forward time as a function of tokens in the step, piecewise linear over measured points."""

    def __init__(self, points: dict[int, float] | None = None) -> None:
        self.points: dict[int, float] = dict(points or {})

    def observe(self, n: int, seconds: float) -> None:
        """Fold one measurement of an n-token step into the estimate at n (EWMA)."""
        if n <= 0 or seconds <= 0:
            return
        old = self.points.get(n)
        self.points[n] = seconds if old is None else (1 - EWMA) * old + EWMA * seconds

    def __call__(self, n: int) -> float:
        """Estimated seconds for a step of n tokens."""
        if not self.points:
            return 1.0  # unknown: a flat cost, i.e. verifying extra tokens looks free
        xs = sorted(self.points)
        if n <= xs[0]:
            return self.points[xs[0]]
        if n >= xs[-1]:
            if len(xs) == 1:
                return self.points[xs[0]] * n / xs[0]
            x0, x1 = xs[-2], xs[-1]
            slope = (self.points[x1] - self.points[x0]) / (x1 - x0)
            return self.points[x1] + slope * (n - x1)
        i = bisect.bisect_left(xs, n)
        x0, x1 = xs[i - 1], xs[i]
        w = (n - x0) / (x1 - x0)
        return (1 - w) * self.points[x0] + w * self.points[x1]


@dataclass
class AcceptanceStats:
    """Online per-position acceptance estimate of one request."""

    rates: list[float]
    steps_off: int = 0  # steps with k = 0 since the last probe
    steps_short: int = 0  # steps with 0 < k < max since the last probe of one position more

    def update(self, num_draft: int, num_accepted: int, weight: float = EWMA) -> None:
        """Position j was tested iff j < num_draft and every earlier draft was accepted."""
        for j in range(min(num_draft, num_accepted + 1, len(self.rates))):
            hit = 1.0 if j < num_accepted else 0.0
            self.rates[j] = (1 - weight) * self.rates[j] + weight * hit

    def expected_accepted(self, k: int) -> float:
        """E(k): expected accepted drafts out of k."""
        total, run = 0.0, 1.0
        for j in range(k):
            run *= self.rates[j]
            total += run
        return total


@dataclass
class SpecPolicy:
    """Chooses K per request each step; switchable at run time (the feature flag)."""

    config: SpecConfig
    target_time: StepTimer = field(default_factory=StepTimer)
    draft_time: StepTimer = field(default_factory=StepTimer)  # seconds per draft pass, by batch size
    draft_cost_is_per_token: bool = True  # model drafts: one pass per draft position
    prior_acceptance: float = 0.7
    enabled: bool = True
    _stats: dict[str, AcceptanceStats] = field(default_factory=dict)
    _pooled: AcceptanceStats | None = None

    @property
    def pooled(self) -> AcceptanceStats:
        """Per-position acceptance over all requests so far: where a new request's estimate starts."""
        if self._pooled is None:
            self._pooled = AcceptanceStats([self.prior_acceptance] * self.config.num_spec_tokens)
        return self._pooled

    def stats(self, request_id: str) -> AcceptanceStats:
        """The request's acceptance estimate (created on first use, from the pooled one)."""
        st = self._stats.get(request_id)
        if st is None:
            st = self._stats[request_id] = AcceptanceStats(list(self.pooled.rates))
        return st

    def forget(self, request_id: str) -> None:
        """Drop a finished request's estimate."""
        self._stats.pop(request_id, None)

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """Record a verify result."""
        if num_draft > 0:
            self.stats(request_id).update(num_draft, num_accepted)
            self.pooled.update(num_draft, num_accepted, POOLED_EWMA)

    def choose(self, requests: Sequence[Request], num_other_tokens: int = 0) -> list[int]:
        """K for each request (0 = no speculation this step).

        `requests` are the decoding requests of the next step; num_other_tokens counts prompt
        tokens the step will also carry (they make the verify tokens relatively cheaper).
        """
        kmax = self.config.num_spec_tokens
        n = len(requests)
        if not self.enabled or self.config.policy == "off" or n == 0:
            return [0] * n
        if self.config.policy == "always":  # every request, whatever the batch size
            return [0 if r.sampling_params.speculative is False else kmax for r in requests]
        eligible = [self._eligible(r, n) for r in requests]
        return self._cost_model_choice(requests, eligible, num_other_tokens)

    def _eligible(self, req: Request, batch: int) -> bool:
        if req.sampling_params.speculative is False:
            return False
        if batch >= self.config.off_batch:
            return False
        if batch > self.config.on_batch:
            return req.priority < 0
        return True

    def _cost_model_choice(self, requests: Sequence[Request], eligible: list[bool], other: int) -> list[int]:
        """Maximise expected tokens per second of the step over the K of every request.

        The draft pass has a fixed cost shared by everyone who speculates, so the objective is
        not concave in one request's K: adding a single draft position to a batch of 8 can look
        like a loss while drafting for all 8 is a clear win. Search therefore starts from the
        best uniform K (0..kmax for every eligible request) and then moves one draft position at
        a time, adding or removing wherever that raises the rate, until nothing does.
        """
        kmax = self.config.num_spec_tokens
        n = len(requests)
        stats = [self.stats(r.request_id) for r in requests]
        # gains[i][k] = expected accepted tokens of request i with k drafts (tabulated once).
        gains = [[st.expected_accepted(k) for k in range(kmax + 1)] for st in stats]
        verify = n + other

        def rate(tokens: float, drafted: int, k_max: int, n_spec: int) -> float:
            return tokens / self._cost(verify + drafted, k_max, n_spec)

        ks, best = [0] * n, rate(n, 0, 0, 0)
        idx = [i for i in range(n) if eligible[i]]
        for k in range(1, kmax + 1) if idx else ():
            r = rate(n + sum(gains[i][k] for i in idx), k * len(idx), k, len(idx))
            if r > best:
                ks, best = [k if eligible[i] else 0 for i in range(n)], r
        # Running totals make each candidate move O(1); the k-histogram gives the max K.
        tokens = n + sum(gains[i][k] for i, k in enumerate(ks))
        drafted, n_spec = sum(ks), sum(1 for k in ks if k)
        hist = [0] * (kmax + 1)
        for k in ks:
            hist[k] += 1
        for _ in range(2 * n * kmax):  # each move strictly improves the rate; this bounds the loop
            move = None
            top = max((k for k in range(kmax + 1) if hist[k]), default=0)
            for i in range(n):
                if not eligible[i]:
                    continue
                for new in (ks[i] + 1, ks[i] - 1):
                    if not 0 <= new <= kmax:
                        continue
                    old = ks[i]
                    # Raising past the top, or lowering the only request at the top by one, moves
                    # the max K to `new`; any other move leaves it where it is.
                    new_top = new if new > top or (old == top and hist[old] == 1) else top
                    r = rate(tokens + gains[i][new] - gains[i][old], drafted + new - old, new_top,
                             n_spec + (new > 0) - (old > 0))
                    if r > best * (1 + 1e-9) and (move is None or r > move[2]):
                        move = (i, new, r)
            if move is None:
                break
            i, new, best = move
            old = ks[i]
            tokens += gains[i][new] - gains[i][old]
            drafted += new - old
            n_spec += (new > 0) - (old > 0)
            hist[old] -= 1
            hist[new] += 1
            ks[i] = new
        # Give held-back requests an occasional probe one position further, so an estimate
        # that fell below break-even can recover (switched off: k = 1; short: k + 1).
        for i, st in enumerate(stats):
            if eligible[i] and ks[i] == 0:
                st.steps_off += 1
                if st.steps_off >= PROBE_EVERY:
                    ks[i], st.steps_off = 1, 0
                continue
            st.steps_off = 0
            if eligible[i] and ks[i] < kmax:
                st.steps_short += 1
                if st.steps_short >= PROBE_EVERY:
                    ks[i], st.steps_short = ks[i] + 1, 0
            else:
                st.steps_short = 0
        return ks

    def _cost(self, num_tokens: int, k_max: int, num_spec_reqs: int) -> float:
        t = self.target_time(num_tokens)
        if k_max and num_spec_reqs:
            per_pass = self.draft_time(num_spec_reqs)
            t += per_pass * (k_max if self.draft_cost_is_per_token else 1)
        return t
