"""When to speculate and how far: K per request per step from a measured cost model.

Speculating K tokens for a request whose drafts are accepted with (per-position) rates
a_1, a_2, ... yields 1 + E(K) tokens per target step, E(K) = sum_{m<=K} prod_{j<=m} a_j
(the geometric model (1 - b^(K+1)) / (1 - b) when every a_j = b). It costs the verify of K
more tokens in the target pass plus the drafting. The policy greedily adds draft tokens
(one request, one position at a time) while the batch's expected tokens per second rises:

    throughput = sum_i (1 + E_i(k_i)) / (T_target(n + sum_i D_i(k_i)) + T_draft(batch) * max_i D_i(k_i))

T_target(n) is the target forward time for n tokens in a step, T_draft the time of one draft
pass, both measured at start-up and refined online. K is a cap: D_i(k) is the expected number
of drafts the proposer delivers when asked for k (a draft model that stops at an unsure token,
`draft_p_min`, or a prompt lookup with a short match deliver fewer), learned per position like
the acceptance, and E_i(k) counts only delivered positions. Hard limits follow the reference
thresholds: speculate at batch <= on_batch, never at batch >= off_batch, only priority
requests between.

A proposer with state (a draft model's own KV cache) must first catch up on what a request
generated while it did not draft, and on its prompt the first time: one pass over all of those
tokens that stalls the whole batch. That one-off cost is charged spread over the steps the
request has left (its max_tokens): a request near its end, or with a long prompt and a short
answer, does not start drafting. (Measured on a 2-vCPU Zen 4 EPYC, Qwen2.5-Coder 1.5B + 0.5B
draft, batch 8 x 32 tokens: before this, the periodic probe below made all eight requests catch
up on their prompts in one 0.67 s draft pass, 0.87x plain.)

A position's acceptance is only learned when it is drafted, so an estimate that one unlucky
rejection pushed below the break-even point would never be corrected: the policy stops
drafting there and the estimate stays stale. Two things keep the estimates honest: a new
request starts from the acceptance pooled over earlier requests (not a fixed prior), and a
request held below K = num_spec_tokens drafts one position more every PROBE_EVERY steps. A
request held at K = 0 probes only where drafting would pay for it with the pooled acceptance
(catch-up included): at a batch size where speculation loses for a typical request, probing
would buy nothing but its cost.
(Measured on a 2-vCPU Xeon, Qwen2.5-Coder 1.5B + 0.5B draft, coding prompts: before this the
policy settled on K = 1 for most steps, 26.2 tok/s; a fixed K = 3 gave 28.6.)

The pooled acceptance is itself learned only from requests that draft, so once earlier text
pushed it below break-even no later request drafted and nothing corrected it: the model's
drafts stayed off for whatever text came next. So a request none of whose model drafts has been
verified yet probes one draft from its first decode step where drafting would pay for it once
that one draft were accepted, and such a request learns from its first verifies as a running
mean with its pooled start counted as one observation (as a copy's estimate does): an accepted
probe lifts its estimate halfway to 1, where it drafts on, and a few rejected drafts stop it.
(Qwen2.5-Coder 1.5B + 0.5B draft, 2-vCPU Zen 4, batch 1: after eight answers sampled at
temperature 1.3 the pooled first-position acceptance stood at 0.2, and in 2 of 5 runs the next
eight greedy coding answers drafted in 2-15 of ~120 steps each, 36-40 tok/s, where the same
answers on a fresh engine ran at 52-60 tok/s with ~3.5 tokens a step. One hard coding answer
can do it too: it left the pool at 0.68, where that phase's costs said a draft does not pay,
and the next four answers drafted in 3-5 of 126 steps.)

A step whose drafts were all accepted says nothing about the position past them: that position
is censored, and its estimate stays wherever it last was (at first the prior). In a run where
the target copies its context (an edit of the prompt's code) every step is accepted whole, so
the estimates of the positions the cost model already affords climb to 1 while the next one
never moves, and K stays where it started. So a request whose last verify accepted every draft
it tested also tests the next position, unless that position was tested within the last
RUN_PROBE_STALE steps (then its estimate is current, and the cost model's answer stands): in a
copy run K grows by one a step. (Qwen2.5-Coder 1.5B, prompt lookup, edit prompts, Zen 5: K
stayed at 4-5 through runs of full acceptances, the 6th position's estimate still the prior.)

A hybrid proposer (`--spec-copy`) copies where a request's context has a match and drafts with
a model elsewhere. The two sources are accepted very differently (a copy run: nearly always or
not at all; a model: a steady fraction), so the policy keeps an estimate per source for each
request, and one pooled per source; a copied draft makes no draft pass and is charged none.
The proposer says before K is chosen which requests it could copy for; `prefer_copy` keeps the
copy where its estimate promises at least the model's tokens per second (a request's first
offered copy is taken, and a copy declined PROBE_EVERY times in a row, so its estimate is
measured and stays current), and the model drafts for the rest. (SmolLM2-sized steps aside, Qwen 1.5B + 0.5B draft on prose prompts, Zen 5: copying
wherever a 3-token tail matched gave 1.68 tokens per step against the draft's own 1.83.)
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specserve.config import SpecConfig
from specserve.ops.calc import cut_largest_first, draft_rows_beside_prompt
from specserve.request import Request
from specserve.spec.tree import DraftTree

EWMA = 0.15  # weight of the newest observation in acceptance and timing estimates
# The context T(n) is timed at (ModelRunner.time_decode_step's default): a query row's attention
# over more keys than this is what SpecPolicy.pair_s charges on top of T(n).
TIMED_CONTEXT = 32

PHASE_EWMA = 0.1  # share of a step-time measurement's ratio to the estimate that moves the read's phase (or a point)
KNEE = 1.2  # a step within this factor of the smallest measured one's time is the weights' read (StepTimer)
# A step up to the knee raises the phase only this far above the arithmetic under it (with
# 5% noise, steps at the arithmetic itself pushed the phase up and a point past the knee).
READ_EVIDENCE = 1.1
PHASE_RANGE = (0.25, 4.0)  # the phase never leaves this range, whatever a stalled step measured
# StepTimer: the median of the last READ_BOUND_WINDOW larger steps' times, each over the read's
# point, bounds the phase from above (any step reads all the weights). One step alone bounding it
# biased a noisy near-flat curve: SmolLM2's 3-5 ms steps, 15% noise, read T(3) / T(1) 1.05 where
# it is 1.03, and prompt lookup drafted half its nodes.
READ_BOUND_WINDOW = 9
POOLED_EWMA = 0.05  # the same for the acceptance pooled over requests (a new request's prior)
SCORE_EWMA = 0.1  # weight of the newest verify in a request's score calibration
SCORE_PRIOR_WEIGHT = 2.0  # the pooled calibration counts as this many predicted acceptances
PRUNE_MIN_GAIN = 0.01  # prune() never weighs nodes with a smaller chance to be accepted
TREE_NODES_PER_K = 2  # a tree may hold this many nodes per draft position the chain model affords
PROBE_EVERY = 16  # re-try k=1 (or k+1) this often for a request the cost model held back
COPY_TRIALS = 1  # a request's first offered copies taken whatever the estimates (prefer_copy)
# A scored proposer's probe costs its proposal and pruning only (prune() keeps only nodes that pay): a request
# held back probes as often as keeps its probes within this share of its part of the step.
PROBE_SHARE = 0.02
RUN_PROBE_STALE = 4  # after a wholly accepted draft, test the next position unless tested this recently
NEVER = -(1 << 30)  # AcceptanceStats.tested of a position not tested yet
CATCHUP_FREE = 2  # tokens a drafting request's proposer processes every step anyway (not a catch-up)
# A catch-up is charged over the steps a request is expected to have left: its max_tokens still to
# go, or less where the last LENGTH_WINDOW finished requests' answers say so (at least
# LENGTH_MIN of them; see SpecPolicy.tokens_left).
LENGTH_WINDOW = 64
LENGTH_MIN = 8
# SpecPolicy.draft_scale: the median of the last DRAFT_SCALE_WINDOW ratios of measured drafting
# seconds to predicted ones (each kept within DRAFT_SCALE_RANGE), the window starting with
# DRAFT_SCALE_PRIOR ratios of 1.0. A first use of a shape is an outlier the median ignores: the
# first batch-2 and batch-4 passes of a Qwen 0.5B draft took 62 and 116 ms against 8-16.
DRAFT_SCALE_WINDOW = 9
DRAFT_SCALE_RANGE = (0.5, 4.0)
DRAFT_SCALE_PRIOR = 2
# The rate guard (RateGuard): speculation is held off at a batch size where its measured tokens
# per second fall below GUARD_MARGIN of plain decoding's, measured at that size within
# GUARD_FRESH_S (GUARD_FRESH_LONG_S where speculation leads by GUARD_CLEAR or more; an older
# plain rate is measured again with one plain step). Held off, it is tried again after
# GUARD_RETRY_S or GUARD_RETRY_STEPS plain steps at that size, whichever comes first (both
# doubling while trials fail, up to GUARD_RETRY_MAX_S / _STEPS), or once the batch's requests
# turned over (RateGuard.new_request), for GUARD_TRIAL steps.
GUARD_MARGIN = 0.95
GUARD_MIN_CYCLES = 8  # speculating steps measured before the guard judges
# Speculating steps hold it off only where their rate is below the margin by more than this
# many standard errors of that rate (StepSums.rate_error), whatever the steps' noise says the
# true rate may be; a trial after a hold is judged on its rate alone. (Lookahead on coding
# prompts, Qwen2.5-Coder 1.5B on `auto`, 2-vCPU Xeon: an answer's first 8 steps accepted one
# draft token, 26.2 tok/s against a 27.7 plain probe, and the hold that followed ran the next
# 64 steps plain: 8 prompts 1.26x plain with two such holds, 1.29x without the guard.)
GUARD_Z = 1.0
# Each rate is tokens over seconds, both summed with these decays per step: speculating steps
# over ~20 (a catch-up pass weighs as what it is, one step's cost spread over the steps it
# serves; over ~5, the catch-ups of requests starting together held batch 2 off where it ran
# 1.05x), plain ones, steady and mostly single probes, over ~5.
GUARD_SPEC_DECAY = 0.95
GUARD_PLAIN_DECAY = 0.8
GUARD_FRESH_S = 2.0
GUARD_FRESH_LONG_S = 8.0
GUARD_CLEAR = 1.3
GUARD_RETRY_S = 3.0
GUARD_RETRY_MAX_S = 60.0
GUARD_RETRY_STEPS = 64
GUARD_RETRY_MAX_STEPS = 1280
GUARD_MAX_DOUBLINGS = 5  # arrivals that end a hold: the batch size, doubled per failed trial up to 2^5 times
GUARD_COPY_TRIALS = 2  # failed trials in a row after which copyable text no longer ends a hold
GUARD_TRIAL = 4


def tree_depth(nodes: int) -> int:
    """How deep a tree drafter fed one level per pass may grow a tree of `nodes` nodes: the chain
    K the budget was sized from (choose() gives TREE_NODES_PER_K nodes per position the chain
    model affords). The rest of the budget goes to width: alternatives that cost no pass."""
    return max(1, -(-nodes // TREE_NODES_PER_K))


def ewma(old: float | None, new: float, weight: float) -> float:
    """An exponentially weighted mean's next value (the first measurement: itself)."""
    return new if old is None else (1 - weight) * old + weight * new


class RecentMedian:
    """The median of the last `window` measurements (None before the first): an estimate that
    one outlier cannot move, where an EWMA keeps a first-use cost or a pause for many steps."""

    def __init__(self, window: int) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    @property
    def full(self) -> bool:
        """Whether `window` measurements are in."""
        return len(self._recent) == self._recent.maxlen

    def add(self, x: float) -> float:
        """Fold in one measurement; the new median."""
        self._recent.append(x)
        s = sorted(self._recent)  # (statistics.median's arithmetic, without its checks: every verify step adds two)
        m = len(s) // 2
        self.value = s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2
        return self.value


@dataclass
class StepSums:
    """Decode steps' tokens and seconds as decayed sums (each step's weight multiplied by the
    decay at every later step), so their rate is tokens over seconds (a slow step weighs by its
    time), with what that rate's standard error needs: the same sums of the squared weights
    times t^2, t*s and s^2."""

    tokens: float = 0.0
    seconds: float = 0.0
    tt: float = 0.0
    ts: float = 0.0
    ss: float = 0.0

    def fold(self, tokens: float, seconds: float, decay: float = 1.0) -> StepSums:
        """Decay what is in, add one step; returns self."""
        d2 = decay * decay
        self.tokens, self.seconds = decay * self.tokens + tokens, decay * self.seconds + seconds
        self.tt, self.ts, self.ss = d2 * self.tt + tokens * tokens, d2 * self.ts + tokens * seconds, d2 * self.ss + seconds * seconds
        return self

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def rate_error(self) -> float:
        """The standard error of the rate R = sum(w t) / sum(w s) as an estimate of the steps'
        mean rate (the ratio estimator's delta method): sqrt(sum(w^2 (t - R s)^2)) / sum(w s).
        Steps that all make the same tokens in the same time have none."""
        r = self.rate
        return math.sqrt(max(0.0, self.tt - 2.0 * r * self.ts + r * r * self.ss)) / self.seconds


@dataclass
class _Rates:
    """Measured decode steps at one batch size, speculating and plain (RateGuard)."""

    spec: StepSums | None = None  # the speculating steps
    spec_n: int = 0  # speculating steps folded into `spec` since it was last judged anew
    spec_at: float = -math.inf  # clock of the last speculating step
    plain: StepSums | None = None
    plain_at: float = -math.inf  # clock of the last plain step
    held_since: float | None = None  # speculation held off since (clock)
    retry_s: float = 0.0  # how long it stays held off this time
    held_steps: int = 0  # plain steps at this size since it was held off
    retry_steps: int = 1 << 62  # how many of them it stays held off this time (at most)
    arrivals: int = 0  # requests that arrived since it was held off, or since its trial began (see RateGuard.new_request)
    failed_trials: int = 0  # trials in a row that held it off again
    copy_steps: int = 0  # held steps in a row whose text a copy carries (see RateGuard.copy_resumes)
    trial_left: int = 0  # speculating steps of a trial still to come
    trial: StepSums | None = None  # the steps of the trial under way

    @staticmethod
    def rate(sums: StepSums | None) -> float | None:
        return None if sums is None else sums.rate

    def waiting(self, now: float) -> bool:
        """Held off, and neither its seconds nor its plain steps have run out."""
        return self.held_since is not None and now - self.held_since < self.retry_s and self.held_steps < self.retry_steps


class RateGuard:
    """Holds speculation off at a batch size where it measurably loses to plain decoding.

    The cost model predicts a step's tokens per second from the T(n) curve and the acceptance
    estimates; where either is off, nothing corrects it. (Qwen 1.5B + 0.5B draft at batch 4, 32
    tokens a request, 2-vCPU Zen 4: the model drafted K = 1-3 for one request of four, whose
    steps then took 43-58 ms for 5-6 tokens where plain ones took 30.5 ms for 4, after a 90 ms
    pass catching the drafter up on its prompt; runs at 0.92-0.95x plain.) The guard measures
    the outcome instead: per batch size, the tokens and seconds of whole decode steps with drafts
    (the drafting done for them included; a catch-up in it only as far as the cost model did not
    charge it, since that model weighed it when it chose to draft: Engine._account_cycle)
    and without, as decayed sums (GUARD_SPEC_DECAY, GUARD_PLAIN_DECAY). Plain steps are measured wherever they happen (the policy chose no drafts,
    speculation was off); once speculating steps have been measured, a plain rate older than
    GUARD_FRESH_S is measured again with one plain step (every GUARD_FRESH_LONG_S where
    speculation leads by GUARD_CLEAR: ~1 step in 200 at batch 1). When GUARD_MIN_CYCLES
    speculating steps are in and their rate falls below GUARD_MARGIN of plain's by more than
    GUARD_Z standard errors (a few steps' accepted lengths are noise, not the text's verdict),
    speculation is held off at that size; after GUARD_RETRY_S, or sooner after GUARD_RETRY_STEPS plain steps
    there, it is tried for GUARD_TRIAL steps, whose rate decides again (held off again, it waits
    twice as long, up to GUARD_RETRY_MAX_S / GUARD_RETRY_MAX_STEPS). (In seconds alone a fast
    model waited too long: SmolLM2 on 2 vCPUs makes ~300 steps a second, and one coding answer's
    stretch of 17 rejected copies in 20 steps held prompt lookup off for the next 900 steps, the
    other prompts' copies included: 1.0-1.11x plain where runs without a hold made 1.2x. The
    steps keep a slow model's wait: 64 of the Qwen 1.5B's ~45 ms steps are ~3 s.) Both
    rates are measured over the same seconds of the same machine, so a phase of its memory
    slows or speeds them alike: a speculating rate whose last step is more than GUARD_FRESH_S
    old starts again, as a stale plain rate is measured again. (Kept across a gap, a slow
    phase's speculating steps were judged against a fast phase's plain ones: bench/spec.py
    alternates a plain and a speculating run per prompt on one engine, and with prompt lookup
    on the Zen 4 the guard held speculation off at 36 against 43-47 tok/s, where it had measured
    36 against 29, through three coding prompts and the first edit prompt; that run's edit
    prompts made 1.4-1.9 tokens per step against 2.7 in a run of them alone.) The guard only
    removes drafts the cost model chose, never adds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rates: dict[int, _Rates] = {}
        self.num_held = 0  # times speculation was held off at some batch size
        self.num_plain_probes = 0  # steps run plain to measure the plain rate

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes share their rates from 8 up by powers of two (8-15, 16-31, ...)."""
        return batch if batch < 8 else 1 << (batch.bit_length() - 1)

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` decoding requests may carry the drafts the cost model chose."""
        r = self.rates.setdefault(self.bucket(batch), _Rates())
        now = self.clock()
        if r.trial_left > 0:
            r.trial_left -= 1
            return True
        if r.held_since is not None:
            if r.waiting(now):
                return False
            r.held_since, r.trial_left, r.trial, r.arrivals = None, GUARD_TRIAL - 1, StepSums(), 0
            return True
        if r.spec_n < GUARD_MIN_CYCLES:  # nothing to weigh the plain rate against yet
            return True
        spec, plain = r.rate(r.spec), r.rate(r.plain)
        leads = spec is not None and plain is not None and spec >= GUARD_CLEAR * plain
        if now - r.plain_at > (GUARD_FRESH_LONG_S if leads else GUARD_FRESH_S):
            r.plain_at = now  # (measured by the step; asked again only after another while)
            self.num_plain_probes += 1
            return False
        return True

    def new_request(self) -> None:
        """A request arrived. Where as many have arrived since a batch size was held off as that
        size holds (twice as many after each failed trial in a row, like the waits), what the
        guard measured there was other text (its copies, its draft's agreement): the hold ends at
        the next step, whose trial runs on the new text. (SmolLM2 with prompt lookup on coding
        prompts, batch 1: one answer with nothing to copy held speculation off, and the failed
        trials' doubled waits held it off through the next answers, which copied well: 1.07x
        plain where runs without a hold made 1.2x.) One arrival into a larger batch changes a part
        of its text: ending the hold then would try again at every arrival of a busy server; and
        where speculation loses whatever the text (SmolLM2's EAGLE head sampling at T 0.7), a
        trial at every request cost 5%: after failed trials the arrivals needed double, in a
        batch of several. Alone in its batch, an arrival is all new text and ends the hold
        whatever the failed trials: a new request whose estimate (the pooled one) says its
        drafts do not pay makes no more than its first probe there (SpecPolicy), so a trial on
        text that loses costs little. (Qwen2.5-Coder 1.5B + 0.5B draft, batch 1: eight answers
        sampled at temperature 1.3 left a hold after three failed trials, which held the next
        greedy coding answer's drafts off for all its 128 steps; the SmolLM2 head at T 0.7 ran
        0.979-1.032x plain in four runs with every arrival ending the hold, 0.960-1.019x in four
        before.)

        A trial under way when as many requests have arrived as its size holds starts again:
        its steps so far were of other text. (Qwen2.5-Coder 1.5B + 0.5B draft, batch 1: a trial
        begun on the last of eight answers sampled at temperature 1.3 ended on the first step of
        a greedy coding answer, failed on the earlier text's rate, and held the new answer's
        drafts off for all its 127 steps.)"""
        for size, r in self.rates.items():
            if r.trial is not None:  # (a trial and a hold never overlap: one counter serves both)
                r.arrivals += 1
                if r.arrivals >= size:
                    r.trial, r.trial_left, r.arrivals = StepSums(), GUARD_TRIAL, 0
            elif r.held_since is not None:
                r.arrivals += 1
                if r.arrivals >= (size << min(r.failed_trials, GUARD_MAX_DOUBLINGS) if size > 1 else 1):
                    r.held_steps = r.retry_steps

    def copy_resumes(self, batch: int, copyable: bool) -> bool:
        """A held step of `batch` requests, whose text a copy carries on or not (a request's last
        RESUME_MATCH tokens repeat earlier text: Proposer.copy_resumes). Copyable text is other
        text than the hold was measured on, as an arrival is: the hold ends (the trial runs this
        step) once so many held steps in a row were copyable, 1, or 2 after a failed trial;
        after GUARD_COPY_TRIALS failed trials in a row only the waits and arrivals end it (in a
        batch some request nearly always has a copyable tail: trials every few steps where
        drafting loses would cost what the hold saves). Returns whether it ended. (Qwen2.5-Coder 1.5B on `auto` adding docstrings to code,
        prompt lookup with the code as reference, 2-vCPU Xeon: the docstrings' rejected copies
        held speculation off, and the hold lasted through the 40 tokens of code after them, which
        then took 40 steps instead of 4; bench/spec.py's 8 edit prompts 2.15x plain, 2.38x with
        the hold ended there.)"""
        r = self.rates.get(self.bucket(batch))
        if r is None or r.trial_left > 0 or r.failed_trials >= GUARD_COPY_TRIALS or not r.waiting(self.clock()):
            return False
        r.copy_steps = r.copy_steps + 1 if copyable else 0
        if r.copy_steps < 1 << r.failed_trials:
            return False
        r.held_steps, r.copy_steps = r.retry_steps, 0
        return True

    def holds(self, batch: int) -> bool:
        """Whether speculation is held off at this batch size now, its retry not yet due: allows()
        would refuse any drafts. Asks without counting (allows() starts the trial when due)."""
        r = self.rates.get(self.bucket(batch))
        return r is not None and r.trial_left <= 0 and r.waiting(self.clock())

    def observe(self, batch: int, tokens: int, seconds: float, speculated: bool) -> None:
        """A decode step of `batch` requests made `tokens` tokens in `seconds` (the drafting done
        for it included)."""
        if batch <= 0 or tokens <= 0 or seconds <= 0:
            return
        r = self.rates.setdefault(self.bucket(batch), _Rates())
        now = self.clock()
        if not speculated:
            r.plain, r.plain_at = (r.plain or StepSums()).fold(tokens, seconds, GUARD_PLAIN_DECAY), now
            r.held_steps += 1
            return
        if r.trial is not None:
            r.trial.fold(tokens, seconds)
            if r.trial_left > 0:
                return
            r.spec, r.spec_n, r.trial, after_trial = r.trial, GUARD_MIN_CYCLES, None, True
        else:
            if now - r.spec_at > GUARD_FRESH_S:  # seconds old: maybe another phase of the machine's speed
                r.spec, r.spec_n = None, 0
            r.spec, r.spec_n, after_trial = (r.spec or StepSums()).fold(tokens, seconds, GUARD_SPEC_DECAY), r.spec_n + 1, False
        r.spec_at = now
        plain = r.rate(r.plain)
        judged = r.spec_n >= GUARD_MIN_CYCLES and plain is not None and now - r.plain_at <= GUARD_FRESH_LONG_S
        # (a trial tests a rate already measured losing: its own rate decides)
        spec = r.spec.rate + (0.0 if after_trial else GUARD_Z * r.spec.rate_error())
        if judged and spec < GUARD_MARGIN * plain:  # type: ignore[operator]
            r.failed_trials = r.failed_trials + 1 if after_trial else 0
            r.retry_s = min(2 * r.retry_s, GUARD_RETRY_MAX_S) if after_trial else GUARD_RETRY_S
            r.retry_steps = min(2 * r.retry_steps, GUARD_RETRY_MAX_STEPS) if after_trial else GUARD_RETRY_STEPS
            r.held_since, r.held_steps, r.spec_n, r.arrivals, r.copy_steps = now, 0, 0, 0, 0
            self.num_held += 1

    def summary(self) -> dict[int, dict[str, float | bool | None]]:
        """Per batch-size bucket: the measured rates and whether speculation is held off there."""
        return {b: {"spec_tokens_per_s": r.rate(r.spec), "plain_tokens_per_s": r.rate(r.plain),
                    "held": r.held_since is not None} for b, r in sorted(self.rates.items())}


class StepTimer:
    """Forward time as a function of tokens in the step: the measured points, read through the
    machine's current memory speed.

    A step reads the weights once whatever its size and multiplies them by every token in it: up
    to a knee its time is the read (flat), past the knee the arithmetic. A shared machine's memory
    speed moves between phases (10-50% within minutes on the VMs measured), and it moves the read
    alone: on a 2-vCPU Zen 4 the Qwen 1.5B's T(1) went from 29-32 ms to 20-22 ms between phases
    while T(9) stayed at 52-56 ms (T(9)/T(1) 1.6-1.8 -> 2.5-2.7). So `points` keep the curve as
    measured (at phase 1.0) and are read as

        T(n) = max(phase * M(n), C(n))

    M(n), the read: the points up to the knee (the first point and those after it within KNEE of
    it), flat past the knee. C(n), the arithmetic: the points past the knee, and below the first
    of them the least-squares line through those up to twice its size (no higher than the point
    there, so that at phase 1.0 T(n) is the measured curve). (The line through the first two
    alone took their noise for a slope: a start-up profile with T(7), T(8) = 46.5, 48.1 ms on the
    Zen 4 put the line at 36.7 ms for one token, above the read, and T(1) stayed at the profile's
    36.2 ms through a phase whose decode steps took 21-33; the fit over 7..14 says 5.6 ms a token.)
    The knee is where the measured shape put it (a profile, `calibrate`; or the points of a
    timer that learns in seconds, `observe`): what a step teaches later never moves it, so a
    point never changes from the read's units to seconds.
    Steps of the curve's first size (one token) move the phase; a larger size up to the knee
    learns whichever binds there now: where the read does, its own point against the phase;
    where the arithmetic under the read does (a fast phase), that size's own C(n) in seconds
    (`under_read`, in place of the line there); past the knee, its own estimate. Every step
    bounds the read from above (it reads all the weights): where the median of the last
    READ_BOUND_WINDOW larger steps runs faster than the phase's T(1), the phase falls, where no
    one-token step runs (batch 4) as anywhere. (The larger read-bound sizes used
    to move the phase both ways, but in a fast phase their arithmetic, hidden under the read in
    the profile, is what binds: a lookahead run, 93% 4-5 token steps and one 1-token step per
    request, read T(1) as 26.8 ms where it was ~23 and drafted too much. Phases last thousands of
    steps; one-token steps come at least once per request, the first after its prompt.) A curve
    with no point past its knee (a GPU's, flat far beyond the sizes measured) is all read and
    moves as a whole.

    One factor for the whole curve (before) made a fast phase's verifies look as cheap against a
    decode step as a slow phase's; the points' own slow share pulled the sizes that ran back and
    left the others (a 3000-step simulation of that Zen 4 curve under alternating phases: the
    worst size's error 15% at the median step, 4% now). What stays unseen until a size runs in
    a fast phase: the arithmetic under the read. The line below the knee is a floor; the Zen 4
    took 29 ms for 3 tokens in its fast phase, where the line says 21.

    Read as a whole, the curve never falls: T(n) is at least the estimate at any measured size
    below n. (Points learned in different phases, or noise past the knee, otherwise showed the
    policy a draft token that made the step faster.)
    """

    def __init__(self, points: dict[int, float] | None = None) -> None:
        self.points: dict[int, float] = dict(points or {})  # changed only through the methods below (answers are memoised)
        self.phase = 1.0  # the read's speed now against when the points were measured (time ratio)
        # (sorted points, knee index, C's line below the knee as (slope, intercept)), redone when points change
        self._shape: tuple[list[int], int, tuple[float, float] | None] | None = None
        self._shape_key: tuple[int, int] = (-1, -1)
        self._version = 0
        self._knee_size = self._find_knee()  # the largest size of the read, fixed by the measured shape
        # Seconds of sizes up to the knee whose steps measured the arithmetic under the read (a
        # fast phase's): C(n) there in place of the line.
        self.under_read: dict[int, float] = {}
        # Each size's (read, arithmetic) parts (_parts, the floor below folded in) since the points
        # last moved: the policy asks for the same few sizes several times a step (a batch-1
        # choice asked T(1) three times and T(1 + nodes) twice, a prune ~11 sizes), and the phase,
        # which every decode step moves, only scales the read part.
        self._memo: dict[float, tuple[float, float]] = {}
        self._memo_key: tuple[int, int] = (-1, -1)
        # The sizes and the running maxima of their parts (_floor_below), built as far as asked.
        self._rising: tuple[list[int], list[tuple[float, float]]] | None = None
        # The phases the latest steps larger than the first size would have if each read alone
        # (its time over the read's point): their median bounds the phase (READ_BOUND_WINDOW).
        self._read_bounds = RecentMedian(READ_BOUND_WINDOW)
        # The median of each larger size's last READ_BOUND_WINDOW steps, in seconds: what bounds
        # the estimates of the smaller sizes (_bound_smaller).
        self._size_bounds: dict[int, RecentMedian] = {}

    def calibrate(self, points: dict[int, float]) -> None:
        """Take freshly measured points (phase 1.0 from now on), keeping others not re-measured."""
        self.points.update(points)
        self.under_read.clear()
        self._read_bounds = RecentMedian(READ_BOUND_WINDOW)
        self._size_bounds = {}
        self.phase = 1.0
        self._version += 1
        self._knee_size = self._find_knee()

    def observe(self, n: int, seconds: float) -> None:
        """Fold one measurement of an n-token step into the estimate at n (EWMA); the shape
        (where the knee lies) follows the points, as a curve measured at one phase does."""
        if n <= 0 or seconds <= 0:
            return
        self.points[n] = ewma(self.points.get(n), seconds, EWMA)
        self._version += 1
        self._knee_size = self._find_knee()

    def _find_knee(self) -> int:
        """The last size of the first run of sizes within KNEE of the first point's time (0: no points)."""
        xs = sorted(self.points)
        if not xs:
            return 0
        first, knee = self.points[xs[0]], 0
        while knee + 1 < len(xs) and self.points[xs[knee + 1]] <= KNEE * first:
            knee += 1
        return xs[knee]

    def observe_scaled(self, n: int, seconds: float) -> None:
        """Fold one measurement of an n-token step into the curve: a one-token step (the curve's
        first size) into the phase; any other size up to the knee into its own point (against
        the phase) where the read binds at n, else into its arithmetic (under_read); past the
        knee, into the phase where the read binds there, else into its own point. Larger steps
        whose median runs faster than the read as estimated lower the phase first."""
        if n <= 0 or seconds <= 0:
            return
        if not self.points:
            self.observe(n, seconds)
            return
        xs, knee, _ = self._xs_knee()
        if n not in self.points:  # a size not measured yet: its own point, at phase 1.0 (the knee stays)
            if self._binds_read(n, xs, knee):
                self.points[n] = seconds / self.phase
            elif knee < len(xs) - 1 and n < xs[knee]:  # under the read: the read as estimated, the arithmetic measured
                self.points[n], self.under_read[n] = self._read(n, xs, knee), seconds
            else:
                self.points[n] = seconds
            self._version += 1
            return
        if n != xs[0]:
            # Any step reads all the weights: larger steps faster than the read as estimated bound
            # it (at batch 4 no one-token step comes to correct a phase read too slow, and T(1)
            # under every larger size showed their verifies as free: Qwen 1.5B on the Zen 4, a
            # restore read 36 ms where steps of 1-4 tokens took 30). Their median, not each one:
            # noise alone takes some steps of a near-flat curve below its read.
            bound = self._read_bounds.add(seconds / self.points[xs[0]])
            if self._read_bounds.full and bound < self.phase:
                self._move_phase(bound / self.phase)
        if n == xs[0]:
            # The one-token step, the phase's own measure: its time is the read unless the
            # arithmetic below it explains it (then the read is known only to be no slower: the
            # phase may fall, not rise).
            read = _interpolate(self.points, xs, n, 0, knee)
            arithmetic = self._arithmetic(n, xs, knee) if knee < len(xs) - 1 else 0.0
            if seconds > READ_EVIDENCE * arithmetic or self.phase * read > seconds:  # (not the arithmetic plus noise)
                self._move_phase(seconds / (self.phase * read))
        elif knee == len(xs) - 1 or n <= xs[knee]:
            # A larger size up to the knee measures whichever binds there now: the read (its own
            # point, against the phase) or the arithmetic under it (its own learned time, in
            # seconds). (Learned as the read, a fast phase's arithmetic-bound steps raised the
            # read's point by 1 / phase: Qwen 1.5B at batch 4 on the Zen 4, 4 tokens in 30.5 ms
            # at phase 0.55 read as 55 ms of read, and T(4) then stood above T(5).)
            read = self.phase * self._read(n, xs, knee)
            arithmetic = self._arithmetic(n, xs, knee) if knee < len(xs) - 1 else 0.0
            if read >= arithmetic:
                self.points[n] = ewma(self.points[n], seconds / self.phase, PHASE_EWMA)
            else:
                self.under_read[n] = ewma(arithmetic, seconds, PHASE_EWMA)
                if seconds < read:  # and the read is no slower than this step
                    self.points[n] = ewma(self.points[n], seconds / self.phase, PHASE_EWMA)
            self._version += 1
        elif self._binds_read(n, xs, knee):  # past the knee, in a phase slow enough for the read to bind
            self._move_phase(seconds / self(n))
        else:
            self.points[n] = ewma(self.points[n], seconds, PHASE_EWMA)
            self._version += 1
        if n != xs[0]:
            self._bound_smaller(n, seconds)
        # (The phase alone leaves the curve's shape, which _xs_knee caches, as it was: a decode
        # step, which moves only the phase, no longer has the next step re-sort the points.)

    def _bound_smaller(self, n: int, seconds: float) -> None:
        """A step of n tokens bounds the estimate of every measured size below n (bar the first,
        which the phase answers for): where the median of n's last READ_BOUND_WINDOW steps ran
        faster than such a size is estimated, that size's own values (its point, its arithmetic
        under the read) move a PHASE_EWMA share of the way down to it.

        A size's point up to the knee is kept against the phase, which the one-token steps set;
        where the one-row kernel's speed moved and the multi-row ones' did not, a point learned
        then is off by the phases' ratio once the phase moves back. Qwen 1.5B on the 2-vCPU Zen 4,
        after the multi-row prefetch distance changed (220a008): batch 1 and 2 runs left T(2) and
        T(3) at 45-48 ms, the curve's floor held T(4) and T(5) there through batch 4's runs whose
        4-token steps took 33-36 ms, a fifth token read as free, and the policy drafted with the
        draft model at batch 4 where it ran 0.79-0.94x plain. Nothing else corrects a size that
        no longer runs. The median, not each step: noise alone takes some steps of a near-flat
        curve below a smaller size's true time."""
        recent = self._size_bounds.get(n)
        if recent is None:
            recent = self._size_bounds[n] = RecentMedian(READ_BOUND_WINDOW)
        bound = recent.add(seconds)
        if not recent.full:
            return
        xs = self._xs_knee()[0]
        lowered = False
        for m in xs[1 : bisect.bisect_left(xs, n)]:
            est = self._estimate(m)
            if est <= bound:
                continue
            f = 1.0 + PHASE_EWMA * (bound / est - 1.0)
            self.points[m] *= f
            if m in self.under_read:
                self.under_read[m] *= f
            lowered = True
        if lowered:
            self._version += 1

    def _move_phase(self, ratio: float) -> None:
        """Move the phase a PHASE_EWMA share of the way to explaining a step `ratio` times its estimate."""
        self.phase = min(max(self.phase * (1.0 + PHASE_EWMA * (ratio - 1.0)), PHASE_RANGE[0]), PHASE_RANGE[1])

    def __call__(self, n: float) -> float:
        """Estimated seconds for a step of n tokens (n may be an expected, fractional count)."""
        if not self.points:
            return 1.0  # unknown: a flat cost, i.e. verifying extra tokens looks free
        key = (len(self.points), self._version)
        if key != self._memo_key:
            self._memo, self._memo_key, self._rising = {}, key, None
        parts = self._memo.get(n)
        if parts is None:
            (read, arithmetic), (read_below, arithmetic_below) = self._parts(n), self._floor_below(n)
            parts = self._memo[n] = (max(read, read_below), max(arithmetic, arithmetic_below))
        return max(self.phase * parts[0], parts[1])

    def floor(self, n: float) -> float:
        """A lower bound on the estimate at n and at every size above it: the most any measured
        size below n is estimated to take (the floor every larger size's estimate includes)."""
        if not self.points:
            return 1.0
        read, arithmetic = self._floor_below(n)
        return max(self.phase * read, arithmetic)

    def _floor_below(self, n: float) -> tuple[float, float]:
        """The parts of the most any measured size below n is estimated to take: a step of more
        tokens is never read as cheaper than one of fewer (noisy points past the knee, or a size
        learned in one phase beside one learned in another, would show the policy a draft token
        that saves time). The greatest read part and the greatest arithmetic part below n: the
        phase scales every read part alike, so the most of max(phase * read, arithmetic) over the
        sizes is max(phase * the greatest read, the greatest arithmetic) at any phase."""
        xs, rising = self._rising or (self._xs_knee()[0], [])
        i = bisect.bisect_left(xs, n)
        if len(rising) < i:  # built only as far as asked (most asks are small steps), on a copy
            rising = list(rising)  # (another thread may be reading the one it replaces)
            while len(rising) < i:
                read, arithmetic = self._parts(xs[len(rising)])
                if rising:
                    read, arithmetic = max(read, rising[-1][0]), max(arithmetic, rising[-1][1])
                rising.append((read, arithmetic))
            self._rising = (xs, rising)
        return rising[i - 1] if i > 0 else (0.0, 0.0)

    def _estimate(self, n: float) -> float:
        if not self.points:
            return 1.0  # unknown: a flat cost, i.e. verifying extra tokens looks free
        read, arithmetic = self._parts(n)
        return max(self.phase * read, arithmetic)

    def _parts(self, n: float) -> tuple[float, float]:
        """(read, arithmetic) with the estimate at n = max(phase * read, arithmetic): neither
        depends on the phase (points present)."""
        xs, knee, _ = self._xs_knee()
        if knee == len(xs) - 1:
            return _interpolate(self.points, xs, n), 0.0
        if n > xs[knee]:  # the arithmetic binds at phase 1.0 and below; the read only in a slow phase
            c = _interpolate(self.points, xs, n, knee, len(xs) - 1)
            return min(self.points[xs[knee]], c), c
        return self._read(n, xs, knee), self._arithmetic(n, xs, knee)

    def _xs_knee(self) -> tuple[list[int], int, tuple[float, float] | None]:
        """The sorted sizes, the index of the knee (the last size up to the measured shape's knee,
        _find_knee) and C's line below the knee (_line_below); the policy asks many times a step,
        points change rarely."""
        key = (len(self.points), self._version)
        if self._shape is None or key != self._shape_key:
            xs = sorted(self.points)
            knee = max(bisect.bisect_right(xs, self._knee_size) - 1, 0)
            self._shape, self._shape_key = (xs, knee, self._line_below(xs, knee)), key
        return self._shape

    def _line_below(self, xs: list[int], knee: int) -> tuple[float, float] | None:
        """(slope, intercept) of the arithmetic below the knee: the least-squares line through the
        points past it up to twice the first one's size (at least two of them), or through the
        origin and the first one where there is one alone or they slope down (noise). None
        without a point past the knee."""
        past = xs[knee + 1 :]
        if not past:
            return None
        x1 = past[0]
        fit = [x for x in past if x <= 2 * x1]
        fit = fit if len(fit) >= 2 else past[:2]
        if len(fit) >= 2:  # (past holds more than one point)
            mx = sum(fit) / len(fit)
            my = sum(self.points[x] for x in fit) / len(fit)
            slope = sum((x - mx) * (self.points[x] - my) for x in fit) / sum((x - mx) ** 2 for x in fit)
            if slope > 0:
                return slope, my - slope * mx
        return self.points[x1] / x1, 0.0

    def _read(self, n: float, xs: list[int], knee: int) -> float:
        """M(n) at phase 1.0: the points up to the knee, flat past it (never above C(n) there), and
        never below the first (a step of more tokens reads the same weights: a profile whose
        one-token time caught a slow moment, 36.2 ms against 31.5 for two, would otherwise make two
        tokens look cheaper than one)."""
        if n <= xs[knee]:
            return max(_interpolate(self.points, xs, n, 0, knee), self.points[xs[0]])
        return min(self.points[xs[knee]], self._arithmetic(n, xs, knee))

    def _arithmetic(self, n: float, xs: list[int], knee: int) -> float:
        """C(n): the points past the knee, joined to the knee point; below, their line."""
        if n > xs[knee]:
            return _interpolate(self.points, xs, n, knee, len(xs) - 1)
        # (The caller's _xs_knee() has just refreshed the shape; a point past the knee exists here.)
        # Where steps measured the arithmetic under the read, their times (between two sizes, the
        # two values joined); elsewhere the line.
        under = self.under_read
        lo, hi = math.floor(n), math.ceil(n)
        if not under or (lo not in under and hi not in under):
            return self._line(n, xs, knee)
        at_lo = under.get(lo) or self._line(lo, xs, knee)
        return at_lo + (n - lo) * ((under.get(hi) or self._line(hi, xs, knee)) - at_lo)

    def _line(self, n: float, xs: list[int], knee: int) -> float:
        """C's line below the knee at n, no higher than the read's points there."""
        slope, intercept = self._shape[2]  # type: ignore[index, misc]
        return min(max(slope * n + intercept, 0.0), _interpolate(self.points, xs, n, 0, knee))

    def _binds_read(self, n: float, xs: list[int], knee: int) -> bool:
        return knee == len(xs) - 1 or self.phase * self._read(n, xs, knee) >= self._arithmetic(n, xs, knee)


def _interpolate(points: dict[int, float], xs: list[int], n: float, lo: int = 0, hi: int = -1) -> float:
    """Piecewise linear through the points at the sorted sizes xs[lo..hi]: flat below the first,
    along the last segment past the last (proportional with one point)."""
    hi = len(xs) - 1 if hi < 0 else hi
    if n <= xs[lo]:
        return points[xs[lo]]
    if n >= xs[hi]:
        if hi == lo:
            return points[xs[lo]] * n / xs[lo]
        x0, x1 = xs[hi - 1], xs[hi]
        return points[x1] + (points[x1] - points[x0]) / (x1 - x0) * (n - x1)
    i = bisect.bisect_left(xs, n, lo, hi + 1)
    x0, x1 = xs[i - 1], xs[i]
    w = (n - x0) / (x1 - x0)
    return (1 - w) * points[x0] + w * points[x1]


@dataclass
class AcceptanceStats:
    """Online per-position estimates of one request.

    rates[j]: the chance that position j yields an accepted token given every earlier one did
    (the proposer delivered it and the target accepted it). reach[j]: the chance the proposer
    delivers position j when allowed to and it delivered j - 1 (a draft that stops at an unsure
    token, a lookup whose match is short); a step verifies, and pays for, only what is delivered.
    given[j]: the chance that position j is accepted given that it was delivered (verified) and
    every earlier one accepted: how prune() values a node already drafted.
    """

    rates: list[float]
    reach: list[float] = field(default_factory=list)
    given: list[float] = field(default_factory=list)
    asked: int = 0  # positions the proposal now being verified tests (see SpecPolicy.observe_proposal)
    depth_asked: int = 0  # tree proposers: the chain K the node budget was sized from
    probing: bool = False  # this step's K is a probe (prune() keeps its draft whole)
    run_probe: int = 0  # this step tests the position past a wholly accepted run: prune() keeps the main path this deep
    steps_off: int = 0  # steps with k = 0 since the last probe
    steps_short: int = 0  # steps with 0 < k < max since the last probe of one position more
    declined: int = 0  # a copy's estimate: copies declined in a row for the model's draft (see prefer_copy)
    trials: int = 0  # verifies of this request's drafts (of this source) folded in (see SpecPolicy.observe)
    learns_fast: bool = False  # started off below break-even: first verifies a running mean with the pooled start
    full_run: int = 0  # the last verify accepted all of its drafts, this many (0: it did not)
    # Score calibration (proposers whose scores predict acceptance): accepted drafts and the
    # scores' prediction of them, both decayed, over this request's verifies.
    score_accepted: float = 0.0
    score_predicted: float = 0.0
    drafted_yield: float | None = None  # accepted drafts per verified step (EWMA; None: not measured)
    drafted_nodes: float = 0.0  # draft nodes verified per such step (EWMA)
    tested: list[int] = field(default_factory=list)  # the policy step each position was last tested at

    def __post_init__(self) -> None:
        if not self.reach:
            self.reach = [1.0] * len(self.rates)
        if not self.given:
            self.given = list(self.rates)
        if not self.tested:
            self.tested = [NEVER] * len(self.rates)

    def update(self, num_asked: int, num_accepted: int, weight: float = EWMA) -> None:
        """Position j was tested iff j < num_asked and every earlier draft was accepted; an
        undelivered position counts as a miss."""
        _fold_run(self.rates, num_asked, num_accepted, weight)

    def update_given(self, verified: int, accepted: int, weight: float = EWMA) -> None:
        """A verify of drafts `verified` positions deep accepted `accepted` of them."""
        _fold_run(self.given, verified, accepted, weight)

    def update_scores(self, predicted: float, accepted: int, nodes: int, weight: float = SCORE_EWMA) -> None:
        """Fold one verify of `nodes` drafts into the score calibration (their summed scores
        against the drafts it accepted) and into the step's yield."""
        self.score_predicted = (1 - weight) * self.score_predicted + predicted
        self.score_accepted = (1 - weight) * self.score_accepted + accepted
        first = self.drafted_yield is None
        self.drafted_yield = ewma(self.drafted_yield, float(accepted), weight)
        self.drafted_nodes = float(nodes) if first else ewma(self.drafted_nodes, float(nodes), weight)

    def calibration(self, prior: float) -> float:
        """Accepted drafts per unit of score, shrunk towards `prior` while little is measured."""
        c = (self.score_accepted + SCORE_PRIOR_WEIGHT * prior) / (self.score_predicted + SCORE_PRIOR_WEIGHT)
        return min(max(c, 0.05), 4.0)

    def update_reach(self, k: int, num_proposed: int, weight: float = EWMA) -> None:
        """Asked for k tokens, got num_proposed: positions up to that one were each tried."""
        _fold_run(self.reach, k, num_proposed, weight)

    def expected_accepted(self, k: int) -> float:
        """E(k): expected accepted drafts when up to k are asked for."""
        return _expected_runs(self.rates, k)[k]

    def expected_proposed(self, k: int) -> float:
        """Expected drafts delivered (verified, and for a draft model: passes) out of k asked for."""
        return _expected_runs(self.reach, k)[k]

    def accepted_by_k(self, kmax: int) -> list[float]:
        """[E(0), ..., E(kmax)] in one pass."""
        return _expected_runs(self.rates, kmax)

    def proposed_by_k(self, kmax: int) -> list[float]:
        """expected_proposed(k) for k = 0..kmax in one pass."""
        return _expected_runs(self.reach, kmax)


def _fold_run(est: list[float], limit: int, run: int, weight: float) -> None:
    """EWMA-update per-position chances from one outcome: positions 0..run-1 succeeded and
    position `run` failed (if it is below `limit`, the positions that could be tried)."""
    for j in range(min(limit, run + 1, len(est))):
        est[j] = (1 - weight) * est[j] + weight * (1.0 if j < run else 0.0)


def _expected_runs(chances: list[float], kmax: int) -> list[float]:
    """Expected length of the run of successes among the first k positions, for k = 0..kmax,
    position j succeeding with chances[j] given every earlier one did."""
    out, total, run = [0.0], 0.0, 1.0
    for j in range(kmax):
        run *= chances[j]
        total += run
        out.append(total)
    return out


@dataclass
class SpecPolicy:
    """Chooses K per request each step; switchable at run time (the feature flag)."""

    config: SpecConfig
    target_time: StepTimer = field(default_factory=StepTimer)
    draft_time: StepTimer = field(default_factory=StepTimer)  # seconds per draft pass, by batch size
    draft_cost_is_per_token: bool = True  # model drafts: one pass per draft position
    prior_acceptance: float = 0.7
    catchup_s_per_token: float = 0.0  # seconds per token of a proposer catching a request up (0: free)
    enabled: bool = True
    trees: bool = False  # the proposer drafts trees: budgets are node counts, pruned after drafting
    # The proposer's tree scores predict acceptance (ProposerTraits.scores_predict_acceptance):
    # a request drafts its full node budget where its measured yield pays for the proposer's
    # time (_scored_choice), and prune() keeps the nodes whose calibrated score pays for
    # verifying them.
    scored: bool = False
    # Host seconds a step with drafts spends beyond one without (tree masks, verification,
    # bookkeeping), measured by the engine: what a scored proposer's first kept node also pays.
    verify_overhead_s: float = 0.0
    # Seconds of attention per (query row, key) pair beyond TIMED_CONTEXT keys, over the whole
    # stack (ModelRunner.time_attention_pairs; 0: not charged). A draft row attends over its
    # request's whole context, so a verify is flat only while contexts are short: the Qwen 1.5B's
    # T(9) / T(1) read 1.8 at 64 tokens of context, 3.2 at 2,048 and 4.3 at 8,000 (2-vCPU Zen 4),
    # and without this prompt lookup drafted at a 7,000-token context at 0.56-0.62x plain until the
    # rate guard held it.
    pair_s: float = 0.0
    propose_s: float = 0.0  # host seconds a scored proposer's proposal and its pruning take per request it drafts for (measured)
    free_prior: float = 0.5  # a copier's prior acceptance (drafts made without a draft pass)
    _stats: dict[tuple[str, bool], AcceptanceStats] = field(default_factory=dict)
    _pooled: AcceptanceStats | None = None
    _pooled_free: AcceptanceStats | None = None
    _step: int = 0  # choose() calls so far: the clock of AcceptanceStats.tested
    _lengths: deque[int] = field(default_factory=lambda: deque(maxlen=LENGTH_WINDOW))  # recent answers' tokens (tokens_left)
    _sorted_lengths: list[int] = field(default_factory=list)  # the same, sorted
    guard: RateGuard = field(default_factory=RateGuard)  # adaptive only: measured outcomes veto drafts
    # Drafting's measured seconds over the cost model's prediction, by the requests in the draft
    # passes (RateGuard.bucket; see observe_drafting).
    _draft_scale: dict[int, RecentMedian] = field(default_factory=dict)
    _draft_predicted: tuple[int, float] | None = None  # (bucket, unscaled seconds) of the last choice

    @property
    def pooled(self) -> AcceptanceStats:
        """Per-position acceptance over all requests so far: where a new request's estimate starts."""
        if self._pooled is None:
            self._pooled = AcceptanceStats([self.prior_acceptance] * self.config.num_spec_tokens)
        return self._pooled

    def pooled_for(self, free: bool) -> AcceptanceStats:
        """The pooled estimate of drafts made with a draft pass (free=False) or without (a copy)."""
        if not free:
            return self.pooled
        if self._pooled_free is None:
            self._pooled_free = AcceptanceStats([self.free_prior] * self.config.num_spec_tokens)
        return self._pooled_free

    def stats(self, request_id: str, free: bool = False) -> AcceptanceStats:
        """The request's acceptance estimate for drafts of one source (created on first use, from
        that source's pooled one)."""
        st = self._stats.get((request_id, free))
        if st is None:
            pooled = self.pooled_for(free)
            st = self._stats[(request_id, free)] = AcceptanceStats(list(pooled.rates), list(pooled.reach),
                                                                   list(pooled.given),
                                                                   drafted_yield=pooled.drafted_yield,
                                                                   drafted_nodes=pooled.drafted_nodes)
        return st

    def forget(self, request_id: str, generated: int | None = None) -> None:
        """Drop a finished request's estimates; `generated`, its answer's length in tokens, is
        remembered for tokens_left (None: a request that did not finish, e.g. aborted)."""
        self._stats.pop((request_id, False), None)
        self._stats.pop((request_id, True), None)
        if generated is not None and generated > 0:
            self._lengths.append(generated)
            self._sorted_lengths = sorted(self._lengths)

    def tokens_left(self, req: Request) -> int:
        """How many more tokens `req` is expected to generate: its max_tokens still to go, or,
        once LENGTH_MIN answers have finished, the median of what the recent answers longer than
        it is now went on for (the median length of them all where fewer than 3 are longer),
        whichever is smaller. A request sent without max_tokens may run to its context window
        (thousands of tokens) and end at its first stop after fifty: a drafter's catch-up on its
        prompt, charged over the window, looked free."""
        cap = max(1, req.sampling_params.max_tokens - req.num_output_tokens)
        lengths = self._sorted_lengths
        if len(lengths) < LENGTH_MIN:
            return cap
        done = req.num_output_tokens
        first = bisect.bisect_right(lengths, done)  # (sorted: the answers longer than this one so far)
        if len(lengths) - first >= 3:
            typical = statistics.median(lengths[first:]) - done
        else:
            typical = statistics.median(lengths)
        return max(1, min(cap, math.ceil(typical)))

    def observe_proposal(self, request_id: str, k: int, num_proposed: int, num_kept: int | None = None,
                         free: bool = False) -> None:
        """Record how deep a proposal asked for with budget k went (num_proposed positions), and
        how deep it stays after prune() (num_kept, default all of it).

        A position the proposer did not deliver is a miss (the chain model's rates are of
        delivered-and-accepted drafts); a position prune() cut was never tested and teaches
        nothing. Counting the cut ones as misses fed back on itself: the estimate past the kept
        depth fell at every step whose kept drafts were all accepted, and prune then kept even
        less (prompt lookup trees on edit prompts were held to depth 2, accepted 2 tokens per step
        at most, and ran at 1.56x plain where chains ran at 1.81x; Qwen 1.5B, Zen 5). For a
        tree, whose nodes may go to branches rather than depth, a proposal is short of what it
        was asked for only below the chain K its node budget was sized from."""
        if k <= 0:
            return
        st = self.stats(request_id, free)
        limit = min(k, st.depth_asked) if self.trees and st.depth_asked > 0 else k
        st.update_reach(limit, num_proposed)
        self.pooled_for(free).update_reach(limit, num_proposed, POOLED_EWMA)
        kept = num_proposed if num_kept is None else min(num_kept, num_proposed)
        st.asked = min(limit, num_proposed + 1) if kept == num_proposed else kept
        if num_proposed == 0:  # nothing to verify: position 0 missed now
            self.observe(request_id, 0, 0, free)

    def observe(self, request_id: str, num_draft: int, num_accepted: int, free: bool = False,
                predicted: float | None = None, nodes: int = 0) -> None:
        """Record a verify result (of a proposal of num_draft tokens, asked for as recorded by
        observe_proposal, else num_draft; free: a copied draft, see the module docstring;
        predicted: the verified tree's summed scores, for a proposer whose scores predict
        acceptance)."""
        st = self.stats(request_id, free)
        if predicted is not None and self.scored:
            st.update_scores(predicted, num_accepted, nodes)
            self.pooled_for(free).update_scores(predicted, num_accepted, nodes, POOLED_EWMA)
        if num_draft > 0 or st.asked > 0:
            asked = max(st.asked, num_draft)
            st.asked = 0
            st.trials += 1
            # A request's copies hold or fail as a whole (a copy run, or none), unlike a model's
            # steady fraction: its first verifies count as a running mean with the pooled guess
            # (one pseudo-observation), so one copy run tells, then the usual EWMA. So do a
            # model's for a request that started below break-even (see the module docstring).
            weight = max(EWMA, 1.0 / (st.trials + 1)) if free or st.learns_fast else EWMA
            st.update(asked, num_accepted, weight)
            self.pooled_for(free).update(asked, num_accepted, POOLED_EWMA)
            if num_draft > 0:
                st.update_given(num_draft, num_accepted, weight)
                self.pooled_for(free).update_given(num_draft, num_accepted, POOLED_EWMA)
            for j in range(min(asked, num_accepted + 1, len(st.tested))):
                st.tested[j] = self._step
            st.full_run = asked if num_accepted >= asked else 0

    def observe_nothing_drafted(self, request_id: str, free: bool = False) -> None:
        """A scored proposer drafted for the request but nothing was verified (no candidate, or
        prune kept none): a step of zero yield."""
        if self.scored:
            self.stats(request_id, free).update_scores(0.0, 0, 0)

    def choose(self, requests: Sequence[Request], num_other_tokens: int = 0,
               catchup: Sequence[int] | None = None, free: Sequence[bool] | None = None) -> list[int]:
        """K for each request (0 = no speculation this step).

        `requests` are the decoding requests of the next step; num_other_tokens counts prompt
        tokens the step will also carry (they make the verify tokens relatively cheaper);
        catchup[i] the tokens the proposer must process for request i before drafting for it
        (Proposer.catchup_tokens); free[i] that request i's draft will be copied, with no draft
        pass (Proposer.free_drafts).
        """
        kmax = self.config.num_spec_tokens
        n = len(requests)
        if not self.enabled or self.config.policy == "off" or n == 0:
            return [0] * n
        self._step += 1
        self._draft_predicted = None
        if self.config.policy == "always":  # every request, whatever the batch size
            ks = [0 if r.sampling_params.speculative is False else kmax for r in requests]
        elif self.scored and self.trees:
            # Which nodes pay is decided node by node in prune(); here only whether drafting for a
            # request at all pays for the proposer's own time.
            budget = max(kmax, self.config.max_draft_nodes)
            ks = [budget if d else 0 for d in self._scored_choice(requests, num_other_tokens, free or [False] * n)]
            return self._guarded(ks, num_other_tokens)
        else:
            eligible = [self._eligible(r, n) for r in requests]
            ks = self._guarded(self._cost_model_choice(requests, eligible, num_other_tokens, catchup or [0] * n,
                                                       free or [False] * n), num_other_tokens)
        if self.trees:
            for i, (r, k) in enumerate(zip(requests, ks)):
                self.stats(r.request_id, bool(free and free[i])).depth_asked = k
            # K says how deep speculation pays for a request (the chain model); a tree proposer
            # may draft twice that many nodes (alternatives where it is unsure, at most
            # max_draft_nodes) and prune() keeps those worth verifying.
            return [min(TREE_NODES_PER_K * k, max(k, self.config.max_draft_nodes)) for k in ks]
        return ks

    def cap_for_prompts(self, ks: list[int], num_prompt_tokens: int) -> list[int]:
        """ks (each request's draft rows: K, or a tree's node budget) cut, the largest first, to
        the rows a step carrying num_prompt_tokens prompt tokens may verify beside them: what
        adds at most PROMPT_DRAFT_SHARE to the predicted time of the step without drafts (the
        measured T(n)). A prompt's first token waits for its whole step, so another request's
        draft must not double it (a few prompt rows beside a 12-node tree), while a long chunk
        hides many rows. Unchanged without prompt tokens; policy 'always' is not cut."""
        drafted = sum(ks)
        if num_prompt_tokens <= 0 or not drafted or self.config.policy == "always":
            return ks
        base = len(ks) + num_prompt_tokens
        rows = draft_rows_beside_prompt(lambda r: self.target_time(base + r), drafted)
        if rows >= drafted:
            return ks
        self._draft_predicted = None  # drafting is not what the cost model priced: nothing to learn
        return cut_largest_first(ks, rows)

    def drafts_held(self, batch: int, num_other_tokens: int = 0) -> bool:
        """Whether choose() would return no drafts whatever the cost model chose: the rate guard
        holds a decode step of this batch size off (see _guarded), its retry not yet due. The
        engine then asks neither the copier nor the cost model."""
        return self.config.policy == "adaptive" and not num_other_tokens and self.guard.holds(batch)

    def _guarded(self, ks: list[int], num_other_tokens: int) -> list[int]:
        """The cost model's ks, or none where the rate guard holds a decode step's drafts off (a
        step with prompt tokens is not one it measures)."""
        if not any(ks) or num_other_tokens or self.guard.allows(len(ks)):
            return ks
        return [0] * len(ks)

    def prune(self, requests: Sequence[Request], drafts: dict[str, DraftTree], num_other_tokens: int = 0,
              free: Sequence[bool] | None = None) -> dict[str, DraftTree]:
        """Keep, across the batch, the draft nodes whose predicted acceptance pays for verifying
        them: nodes join in order of predicted acceptance (each tree as a prefix of its nodes,
        which proposers list best first, parents before children) while the step's expected
        tokens per second rises on the measured T(n) curve. Drafting is already paid for here,
        so only the verify cost counts. Under policy 'always' nothing is pruned."""
        if not drafts or self.config.policy == "always":
            return drafts
        gains: dict[str, list[float]] = {}
        copied = {r.request_id for i, r in enumerate(requests) if free and free[i]}
        for req in requests:
            tree = drafts.get(req.request_id)
            if tree is None or not tree.scores:
                continue
            st = self.stats(req.request_id, req.request_id in copied)
            # A probe's draft is verified whole: pruned by the very estimate the probe is there
            # to correct, it would teach nothing and the estimate would stay where it fell.
            if self.scored and self.trees:
                c = st.calibration(self.pooled_for(req.request_id in copied).calibration(1.0))
                gains[req.request_id] = [min(1.0, c * sc) for sc in tree.scores]
            elif not st.probing:
                gains[req.request_id] = self.node_gains(st, tree)
        if not gains:
            return drafts
        base = len(requests) + num_other_tokens + sum(len(t) for rid, t in drafts.items() if rid not in gains)
        # The nodes in order of gain; keep the prefix of that order with the best rate. (Not the
        # first node that fails to pay: the measured T(n) is not convex everywhere, e.g. a kernel
        # that handles 4 rows at once makes the third token dear and the fourth nearly free.)
        tokens, verify = float(len(requests)), base
        # Each kept node attends over its request's context (row_s); so does every decode row.
        row = {r.request_id: self.row_s(r) for r in requests}
        attn = sum(row.values()) + sum(row.get(rid, 0.0) * len(t) for rid, t in drafts.items() if rid not in gains)
        best, best_m = tokens / (self.target_time(verify) + attn), 0
        overhead = self.verify_overhead_s if self.scored else 0.0
        taken = dict.fromkeys(gains, 0)
        order: list[str] = []
        heap = [(-g[0], rid) for rid, g in gains.items()]
        heapq.heapify(heap)
        # The gains not taken yet: no longer prefix makes more tokens than these on top. With the
        # least the curve says any larger step takes (StepTimer.floor), they bound every longer
        # prefix's rate, and the walk stops where that bound is below the best: the prefix it
        # keeps is the same. (A verify step reshapes the curve, and the next prune's every size
        # was estimated anew: SmolLM2's 16-node copies, of which 0-4 are kept, spent 55-85 us here
        # between two ~4.5 ms forwards.)
        left = sum(max(g, 0.0) for gs in gains.values() for g in gs)
        while heap:
            neg, rid = heapq.heappop(heap)
            if neg > -PRUNE_MIN_GAIN:
                break  # the rest gain less still
            tokens, verify, attn, left = tokens - neg, verify + 1, attn + row[rid], left + neg
            order.append(rid)
            rate = tokens / (self.target_time(verify) + overhead + attn)
            if rate > best:
                best, best_m = rate, len(order)
            elif tokens + left < best * (self.target_time.floor(verify + 1) + overhead + attn) * (1.0 - 1e-9):
                break
            taken[rid] += 1
            if taken[rid] < len(gains[rid]):
                heapq.heappush(heap, (-gains[rid][taken[rid]], rid))
        keep = dict.fromkeys(gains, 0)
        for rid in order[:best_m]:
            keep[rid] += 1
        out = {rid: t for rid, t in drafts.items() if rid not in gains}
        for rid, n in keep.items():
            tree = drafts[rid]
            depth = self.stats(rid, rid in copied).run_probe
            if depth and tree.max_depth > 0:
                # A run probe: whatever pays, and the main path down to the tested position.
                main, node = [], -1
                while tree.children[node + 1] and len(main) < depth:
                    node = tree.children[node + 1][0]
                    main.append(node)
                out[rid] = tree.select(sorted(set(range(n)) | set(main)))
            elif n:
                out[rid] = tree.truncate(n)
        return out

    @staticmethod
    def node_gains(stats: AcceptanceStats, tree: DraftTree) -> list[float]:
        """Each node's chance to be accepted, from the request's learned per-depth acceptance of
        delivered nodes g_d and the proposer's scores (path scores: a child's score over its parent's is the
        proposer's conditional belief in it).

        The first child of a node (proposers list the best first) is accepted, given its parent
        was, with g_d (`given`): the acceptance of a node at that depth measured over the verifies
        that held one there. Not the chain model's r_d: that counts a position the proposer did
        not deliver as a miss (right for choosing K, a step gets only what is delivered), and a
        node in the tree was delivered. (With r_d, the 0.5B draft, which stops at an unsure token,
        had its main-path nodes at depth 3-5 accepted 95-100% of the times they were drafted, yet
        prune() cut most 5-deep main paths to 4: Qwen 1.5B, coding prompts, 3.30 tokens per step
        where the chain made 3.49. r_d over the delivery chance overstated it instead, since a
        draft delivers deeper after the sure tokens that are also accepted more often: SmolLM2's
        EAGLE head, adaptive, 1.14 -> 1.07 tokens per step.) The other children share the rest,
        1 - g_d, in proportion to their share of the belief the first child left:
        q(v) / (1 - q(first)).
        """
        rates = stats.given
        kids = tree.children
        gains = [0.0] * len(tree)

        def visit(parent: int, reach: float, depth: int) -> None:
            sibs = kids[parent + 1]
            if not sibs:
                return
            r = rates[depth] if depth < len(rates) else rates[-1]
            base = 1.0 if parent < 0 else tree.scores[parent]
            cond = [tree.scores[c] / base if base > 0 else 0.0 for c in sibs]
            left = max(1e-9, 1.0 - cond[0])
            for j, c in enumerate(sibs):
                gains[c] = reach * (r if j == 0 else (1.0 - r) * min(1.0, cond[j] / left))
                visit(c, gains[c], depth + 1)

        visit(-1, 1.0, 0)
        return gains

    def prefer_copy(self, requests: Sequence[Request], candidates: Sequence[bool]) -> list[bool]:
        """Of the requests a copier could draft for, those whose copy promises at least the
        model's draft: the better of each source's best rate alone (batch 1 costs; a copy makes
        no draft pass). A copy declined PROBE_EVERY times in a row is taken anyway, and so is
        the first one a request is offered (COPY_TRIALS): its estimate starts from the pooled
        one, which on a fresh engine is the prior, and a copy never taken is never measured (an
        edit request on a fresh engine copied once in 23 steps where it copied 13 times on
        another start, at 57-60 against 72-76 tokens/s: the model's prior rate had won in its
        phase). Under policy 'always' every copy is taken (nothing is weighed there)."""
        if self.config.policy == "always":
            return list(candidates)
        out = []
        for req, can in zip(requests, candidates):
            if not can:
                out.append(False)
                continue
            copy = self.stats(req.request_id, True)
            take = copy.trials < COPY_TRIALS or copy.declined + 1 >= PROBE_EVERY or (
                self._best_rate(copy, False) >= self._best_rate(self.stats(req.request_id), self.draft_cost_is_per_token))
            copy.declined = 0 if take else copy.declined + 1
            out.append(take)
        return out

    def _best_rate(self, st: AcceptanceStats, per_pass: bool) -> float:
        """Tokens per second of one request drafting alone at its best K under estimate st."""
        kmax = self.config.num_spec_tokens
        pass_s = self.draft_time(1) if per_pass else 0.0
        best = 1.0 / self.target_time(1)
        for gain, size in list(zip(st.accepted_by_k(kmax), st.proposed_by_k(kmax)))[1:]:
            best = max(best, (1.0 + gain) / (self.target_time(1 + size) + pass_s * size))
        return best

    def _scored_choice(self, requests: Sequence[Request], other: int, free: Sequence[bool]) -> list[bool]:
        """Which requests a scored proposer drafts for: those whose measured yield (accepted
        drafts per step, at the nodes they were verified with; the pooled one where the request
        has none) pays for the proposer's time and the verify, added best first while the step's
        expected tokens per second rises. Where no yield is measured yet a request drafts, and
        learns. A request held back probes (is drafted for, and prune() keeps what pays) every
        `_probe_interval` steps, so its yield stays current and a request whose text turns
        copyable (a retried ask reaching an earlier answer, an edit reaching the code it copies)
        is found within a few steps."""
        n = len(requests)
        verify = n + other
        interval = self._probe_interval(n, verify)
        rows = [self.row_s(r) for r in requests]  # a node's attention over its request's context
        attn = sum(rows)
        tokens, rate = float(n), n / (self.target_time(verify) + attn)
        stats = [self.stats(r.request_id, f) for r, f in zip(requests, free)]
        eligible = [self._eligible(r, n) for r in requests]
        measured = [st if st.drafted_yield is not None else self.pooled_for(f) for st, f in zip(stats, free)]
        out = [e and m.drafted_yield is None for e, m in zip(eligible, measured)]
        cands = sorted(((m.drafted_yield / (self.propose_s + self.target_time(verify + m.drafted_nodes)  # type: ignore[operator]
                                            - self.target_time(verify) + rows[i] * m.drafted_nodes + 1e-9), i)
                        for i, (e, m) in enumerate(zip(eligible, measured)) if e and not out[i]), reverse=True)
        drafted, extra_nodes = sum(out), 0.0
        for _, i in cands:
            y, nodes = measured[i].drafted_yield or 0.0, measured[i].drafted_nodes
            t = (self.target_time(verify + extra_nodes + nodes) + self.propose_s * (drafted + 1)
                 + (self.verify_overhead_s if drafted == 0 else 0.0) + attn + rows[i] * nodes)
            if (tokens + y) / t > rate:
                tokens, rate, drafted, extra_nodes = tokens + y, (tokens + y) / t, drafted + 1, extra_nodes + nodes
                attn += rows[i] * nodes
                out[i] = True
        for i, st in enumerate(stats):
            if out[i] or not eligible[i]:
                st.steps_off = 0
            else:
                st.steps_off += 1
                if st.steps_off >= interval:
                    out[i], st.steps_off = True, 0
        return out

    def _probe_interval(self, batch: int, verify_tokens: int) -> int:
        """Steps between a scored proposer's probes of a held-back request: its proposal's
        measured time (propose_s) spread over this many steps is PROBE_SHARE of the request's
        share of the step, at most PROBE_EVERY. (SmolLM2 float32 on one thread, prompt lookup:
        the pooled yield of short unrelated asks held a retried ask back for 16 steps, 21 target
        steps for 64 tokens of an answer it could copy; Qwen's 30 ms step probes every step.)"""
        share = PROBE_SHARE * self.target_time(verify_tokens) / max(batch, 1)
        if self.propose_s <= 0 or share <= 0:
            return 1
        return max(1, min(PROBE_EVERY, math.ceil(self.propose_s / share)))

    def _eligible(self, req: Request, batch: int) -> bool:
        if req.sampling_params.speculative is False:
            return False
        if batch >= self.config.off_batch:
            return False
        if batch > self.config.on_batch:
            return req.priority < 0
        return True

    def catchup_seconds(self, behind: int) -> float:
        """Seconds of catching the proposer up on `behind` tokens of a request, less the
        CATCHUP_FREE it processes every step anyway (0 where no catch-up cost was measured)."""
        return max(0, behind - CATCHUP_FREE) * self.catchup_s_per_token

    def _catchup_per_token(self, req: Request, behind: int) -> float:
        """Seconds of catching the proposer up on `behind` tokens of `req`, spread over the tokens
        it is expected to have left (tokens_left): a step of 1 + accepted tokens is charged that
        many times this."""
        once = self.catchup_seconds(behind)
        return once / self.tokens_left(req) if once > 0 else 0.0

    def _cost_model_choice(self, requests: Sequence[Request], eligible: list[bool], other: int,
                           catchup: Sequence[int], free: Sequence[bool]) -> list[int]:
        """Maximise expected tokens per second of the step over the K of every request.

        The draft pass has a fixed cost shared by everyone who speculates, so the objective is
        not concave in one request's K: adding a single draft position to a batch of 8 can look
        like a loss while drafting for all 8 is a clear win. Search therefore starts from the
        best uniform K (0..kmax for every eligible request) and then moves one draft position at
        a time, adding or removing wherever that raises the rate, until nothing does.

        K is a cap: a proposer may deliver fewer (see AcceptanceStats.reach), so the step's cost
        counts the expected delivered drafts, and the draft passes those of the longest request;
        a request that starts drafting adds its catch-up, spread over its remaining steps. A
        copied draft (free) is verified like any other but makes no draft pass and no catch-up.
        """
        kmax = self.config.num_spec_tokens
        n = len(requests)
        stats = [self.stats(r.request_id, f) for r, f in zip(requests, free)]
        # Tabulated once: expected accepted and expected delivered drafts of request i asking for k,
        # and the draft passes it needs (none for a copy).
        gains = [st.accepted_by_k(kmax) for st in stats]
        sizes = [st.proposed_by_k(kmax) for st in stats]
        walks = [[0.0] * (kmax + 1) if f else s for s, f in zip(sizes, free)]
        per_token = [0.0 if f else self._catchup_per_token(r, c) for r, c, f in zip(requests, catchup, free)]
        # A draft row's attention over its request's context (row_s) is charged with the request,
        # as its catch-up is; every request's own decode row pays it too (base).
        rows = [self.row_s(r) for r in requests]
        catch = [[0.0] + [t * (1.0 + g[k]) + w * z[k] for k in range(1, kmax + 1)]
                 for t, g, w, z in zip(per_token, gains, rows, sizes)]
        verify = n + other
        base = sum(rows)

        def rate(tokens: float, drafted: float, passes: float, n_spec: int, caught: float) -> float:
            return tokens / (self._cost(verify + drafted, passes, n_spec) + caught + base)

        ks, best = [0] * n, rate(n, 0, 0, 0, 0.0)
        idx = [i for i in range(n) if eligible[i]]
        modelled = [not f for f in free]  # requests in the draft passes when they draft
        for k in range(1, kmax + 1) if idx else ():
            r = rate(n + sum(gains[i][k] for i in idx), sum(sizes[i][k] for i in idx),
                     max(walks[i][k] for i in idx), sum(modelled[i] for i in idx), sum(catch[i][k] for i in idx))
            if r > best:
                ks, best = [k if eligible[i] else 0 for i in range(n)], r
        # Running totals make each candidate move O(1); the two largest pass counts give the
        # passes when any one request changes.
        tokens = n + sum(gains[i][k] for i, k in enumerate(ks))
        drafted = sum(sizes[i][k] for i, k in enumerate(ks))
        caught = sum(catch[i][k] for i, k in enumerate(ks))
        n_spec = sum(1 for i, k in enumerate(ks) if k and modelled[i])
        for _ in range(2 * n * kmax):  # each move strictly improves the rate; this bounds the loop
            order = sorted(range(n), key=lambda i: walks[i][ks[i]], reverse=True)[:2]
            first = walks[order[0]][ks[order[0]]]
            second = walks[order[1]][ks[order[1]]] if len(order) > 1 else 0.0
            move = None
            for i in idx:
                others = second if i == order[0] else first
                for new in (ks[i] + 1, ks[i] - 1):
                    if not 0 <= new <= kmax:
                        continue
                    old = ks[i]
                    r = rate(tokens + gains[i][new] - gains[i][old], drafted + sizes[i][new] - sizes[i][old],
                             max(others, walks[i][new]), n_spec + modelled[i] * ((new > 0) - (old > 0)),
                             caught + catch[i][new] - catch[i][old])
                    if r > best * (1 + 1e-9) and (move is None or r > move[2]):
                        move = (i, new, r)
            if move is None:
                break
            i, new, best = move
            old = ks[i]
            tokens += gains[i][new] - gains[i][old]
            drafted += sizes[i][new] - sizes[i][old]
            caught += catch[i][new] - catch[i][old]
            n_spec += modelled[i] * ((new > 0) - (old > 0))
            ks[i] = new
        # Give held-back requests an occasional probe one position further, so an estimate
        # that fell below break-even can recover (switched off: k = 1; short: k + 1). A request
        # at k = 0 probes only where a typical one (the pooled acceptance) would draft now, or,
        # where none of its model drafts was verified yet, where it would once one draft were
        # accepted (its estimate halfway from the pooled one to 1): see the module docstring.
        passes = max((walks[i][k] for i, k in enumerate(ks)), default=0.0)
        for i, st in enumerate(stats):
            st.probing, st.run_probe = False, 0
            if eligible[i] and ks[i] == 0:
                st.steps_off += 1
                first = st.trials == 0 and not free[i]
                if st.steps_off >= PROBE_EVERY or first:
                    pooled = self.pooled_for(free[i])
                    gain, size = pooled.expected_accepted(1), pooled.expected_proposed(1)
                    if first:  # (one position: E(1) is its acceptance)
                        gain = (gain + 1.0) / 2
                    walk = size * modelled[i]
                    cost = per_token[i] * (1.0 + gain) + rows[i] * size  # (catch-up 0 for a copy)
                    r = rate(tokens + gain, drafted + size, max(passes, walk), n_spec + modelled[i], caught + cost)
                    if r > best:
                        ks[i], st.steps_off, best, st.probing = 1, 0, r, True
                        tokens, drafted, caught = tokens + gain, drafted + size, caught + cost
                        n_spec, passes = n_spec + modelled[i], max(passes, walk)
                        st.learns_fast |= first
                continue
            st.steps_off = 0
            if eligible[i] and ks[i] < kmax:
                st.steps_short += 1
                run = st.full_run
                if 0 < run < kmax and ks[i] <= run and self._step - st.tested[run] >= RUN_PROBE_STALE:
                    ks[i] = st.run_probe = run + 1  # the position past a wholly accepted run
                elif st.steps_short >= PROBE_EVERY:
                    ks[i], st.steps_short, st.probing = ks[i] + 1, 0, True
            else:
                st.steps_short = 0
        n_spec = sum(1 for i, k in enumerate(ks) if k and modelled[i])
        passes = max((walks[i][k] for i, k in enumerate(ks) if modelled[i]), default=0.0)
        drafting = self._drafting_seconds(passes, n_spec)
        self._draft_predicted = (RateGuard.bucket(n_spec), drafting) if drafting > 0 else None
        return ks

    def observe_drafting(self, seconds: float) -> None:
        """Learn from what drafting for the last choice took (the proposal, passes and pruning,
        no catch-up): its ratio to the cost model's prediction, per number of requests in the
        draft passes, scales that prediction from then on (_cost).

        The draft timer learns a pass from the later passes of a proposal, one token a request,
        and the prediction takes the longest request's expected passes. A step's first pass also
        feeds each request its newest token and, where all its drafts were accepted, the last
        one; the step runs as many passes as its longest proposal, not the longest expected one;
        and admitting, sampling and pruning run on the host. At batch 1 the three add little; at
        batch 4 (Qwen 1.5B + 0.5B draft, 2-vCPU Zen 4) the first pass of 4-8 rows took 12-16 ms
        against 9.5 for four, drafting averaged 18.7 ms against 13.5 predicted, and the cost model
        drafted where it ran at 0.91x plain decoding's rate (0.88-0.96x over runs)."""
        predicted, self._draft_predicted = self._draft_predicted, None
        if predicted is None or seconds <= 0:
            return
        bucket, expected = predicted
        scale = self._draft_scale.get(bucket)
        if scale is None:
            scale = self._draft_scale[bucket] = RecentMedian(DRAFT_SCALE_WINDOW)
            for _ in range(DRAFT_SCALE_PRIOR):
                scale.add(1.0)
        scale.add(min(max(seconds / expected, DRAFT_SCALE_RANGE[0]), DRAFT_SCALE_RANGE[1]))

    def draft_scale(self, num_spec_reqs: int) -> float:
        """What drafting for num_spec_reqs requests measured against its prediction (1.0 unmeasured)."""
        scale = self._draft_scale.get(RateGuard.bucket(num_spec_reqs))
        return 1.0 if scale is None or scale.value is None else scale.value

    def draft_scales(self) -> dict[int, float]:
        """draft_scale() of every bucket measured (the smallest batch size of each)."""
        return {b: self.draft_scale(b) for b in sorted(self._draft_scale)}

    def _drafting_seconds(self, passes: float, num_spec_reqs: int) -> float:
        """The draft timer's seconds for `passes` draft passes over num_spec_reqs requests
        (a per-call proposer: one call), unscaled."""
        if passes <= 0 or not num_spec_reqs:
            return 0.0
        return self.draft_time(num_spec_reqs) * (passes if self.draft_cost_is_per_token else 1)

    def row_s(self, req: Request) -> float:
        """Seconds one more query row of `req` adds to a step for its attention over the keys of
        its context beyond what T(n) was timed with (pair_s)."""
        return self.pair_s * max(0, req.num_tokens - TIMED_CONTEXT) if self.pair_s else 0.0

    def attention_s(self, rows: Iterable[tuple[int, int]]) -> float:
        """Seconds a step's attention takes beyond T(n)'s: (query rows, keys before the first
        row) per request. T(n) was timed with its rows after TIMED_CONTEXT keys, each also seeing
        the rows before it, so each row here sees start + 1 - TIMED_CONTEXT keys more than its
        counterpart there (row_s's count for a decode row); the rows among themselves are in both."""
        if not self.pair_s:
            return 0.0
        return self.pair_s * sum(n * max(0, start + 1 - TIMED_CONTEXT) for n, start in rows)

    def _cost(self, num_tokens: float, passes: float, num_spec_reqs: int) -> float:
        """A step's predicted seconds: the verify forward over num_tokens and the drafting, as
        measured against its prediction at this many drafting requests (observe_drafting)."""
        t = self.target_time(num_tokens)
        drafting = self._drafting_seconds(passes, num_spec_reqs)
        if drafting:
            t += drafting * self.draft_scale(num_spec_reqs)
        return t
