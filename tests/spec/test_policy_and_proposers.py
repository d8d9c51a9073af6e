"""Adaptive policy (cost model + thresholds) and the model-free proposers, without a model."""

from __future__ import annotations

import math

import pytest

from specserve.config import SpecConfig
from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec.ngram import NgramProposer
from specserve.spec.policy import EWMA, LENGTH_MIN, AcceptanceStats, SpecPolicy, StepTimer
from specserve.spec.proposer import longest_suffix_match
from specserve.spec.reference import ReferenceProposer


def _req(rid, tokens, priority=0, **kw):
    return Request(rid, tokens, SamplingParams(**kw), priority=priority)


def _policy(target, draft, acceptance, policy="adaptive", per_token=True, **cfg):
    p = SpecPolicy(SpecConfig(method="ngram", policy=policy, num_spec_tokens=4, **cfg),
                   draft_cost_is_per_token=per_token, prior_acceptance=acceptance)
    p.target_time = StepTimer(target)
    p.draft_time = StepTimer(draft)
    return p


CHEAP_VERIFY = {1: 0.100, 2: 0.102, 4: 0.105, 8: 0.110, 16: 0.120, 32: 0.200, 64: 0.400, 128: 0.800}
COSTLY_VERIFY = {1: 0.100, 2: 0.200, 4: 0.400, 8: 0.800, 16: 1.600, 32: 3.2, 64: 6.4, 128: 12.8}


def test_expected_tokens_follow_geometric_model():
    st = AcceptanceStats([0.8] * 4)
    b = 0.8
    for k in range(5):
        geometric = (1 - b ** (k + 1)) / (1 - b)  # includes the bonus token
        assert abs(1 + st.expected_accepted(k) - geometric) < 1e-12


def test_cost_model_speculates_when_verify_is_cheap_and_drafts_good():
    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    assert p.choose([_req("a", [1, 2, 3])]) == [4]


def test_cost_model_declines_when_verify_costs_as_much_as_decoding():
    p = _policy(COSTLY_VERIFY, {1: 0.001}, acceptance=0.5)
    assert p.choose([_req("a", [1, 2, 3])]) == [0]


def test_cost_model_declines_expensive_draft_with_poor_acceptance():
    p = _policy(CHEAP_VERIFY, {1: 0.08}, acceptance=0.2)
    assert p.choose([_req("a", [1])]) == [0]
    good = _policy(CHEAP_VERIFY, {1: 0.02}, acceptance=0.9)
    assert good.choose([_req("a", [1])])[0] >= 3


def test_shared_draft_pass_cost_is_amortised_over_the_batch():
    """One draft pass costs the same for 1 or 8 requests: drafting for one alone loses, for all wins.

    A search that adds one draft position at a time stops at the first (losing) position; the
    policy must find the batch-wide optimum anyway.
    """
    target = {8: 0.30, 16: 0.33, 24: 0.36, 40: 0.42, 48: 0.45}
    draft = {1: 0.05, 8: 0.05}  # per draft pass (batched over requests)
    p = _policy(target, draft, acceptance=0.85, per_token=True)
    reqs = [_req(str(i), [1, 2, 3]) for i in range(8)]
    ks = p.choose(reqs)
    assert all(k >= 2 for k in ks), ks
    # And it is really better than not speculating under the same cost model.
    assert p._cost(8, 0, 0) / 8 > p._cost(8 + sum(ks), max(ks), 8) / (8 + sum(p.stats(str(i)).expected_accepted(k)
                                                                              for i, k in enumerate(ks)))


def test_requests_with_poor_acceptance_get_fewer_drafts_than_good_ones():
    p = _policy(CHEAP_VERIFY, {1: 0.01, 4: 0.01}, acceptance=0.8)
    good, bad = _req("g", [1, 2]), _req("b", [1, 2])
    p.stats("b").rates = [0.05] * 4
    kg, kb = p.choose([good, bad])
    assert kg == 4 and kb < kg


def test_online_acceptance_updates_switch_a_request_off():
    p = _policy(CHEAP_VERIFY, {1: 0.03}, acceptance=0.9)
    r = _req("a", [1])
    assert p.choose([r])[0] > 0
    for _ in range(40):
        p.observe("a", 4, 0)  # every first draft rejected
    assert p.choose([r]) == [0]
    assert p.stats("a").rates[0] < 0.05


def test_held_back_position_is_probed_and_recovers():
    """One unlucky rejection can push a position's estimate below break-even; the policy then
    stops drafting there and would never learn otherwise. A request held below K drafts one
    position more every PROBE_EVERY steps, and accepted probes bring K back up."""
    from specserve.spec.policy import PROBE_EVERY

    # Verify cost grows with tokens so that K = 2 pays only while position 2 is accepted often.
    target = {1: 0.045, 2: 0.049, 3: 0.053, 4: 0.057, 5: 0.061}
    p = _policy(target, {1: 0.015}, acceptance=0.86)
    r = _req("a", [1])
    p.stats("a").rates = [0.86, 0.55, 0.86, 0.86]  # position 2 looks poor
    ks = [p.choose([r])[0] for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [1] * (PROBE_EVERY - 1) and ks[-1] == 2  # held at 1, then one probe
    for _ in range(3):  # the probes' drafts are accepted
        p.observe("a", 2, 2)
    assert p.choose([r])[0] >= 2


def test_switched_off_request_probes_only_where_a_typical_request_would_draft():
    """A request held at K = 0 (its own estimate unlucky) probes every PROBE_EVERY steps while
    the pooled acceptance says drafting pays at this batch size; at a batch size where it does
    not (verify as dear as decoding), probing would only cost, and no probe is made."""
    from specserve.spec.policy import PROBE_EVERY

    p = _policy(CHEAP_VERIFY, {1: 0.01, 8: 0.01}, acceptance=0.9)
    r = _req("a", [1], max_tokens=1000)
    p.stats("a").rates, p.stats("a").trials = [0.01] * 4, 3  # measured, and unlucky
    ks = [p.choose([r])[0] for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [0] * (PROBE_EVERY - 1) and ks[-1] == 1

    p = _policy(COSTLY_VERIFY, {1: 0.01, 8: 0.01}, acceptance=0.9)
    reqs = [_req(str(i), [1], max_tokens=1000) for i in range(8)]
    for i in range(8):
        p.stats(str(i)).rates, p.stats(str(i)).trials = [0.01] * 4, 3
    steps = [p.choose(reqs) for _ in range(3 * PROBE_EVERY)]
    assert all(k == 0 for ks in steps for k in ks)


def test_a_pooled_acceptance_below_break_even_does_not_keep_new_requests_from_drafting():
    """The pooled acceptance is learned only from requests that draft. Once earlier text pushed
    it below break-even, a new request starting from it would never draft and the pool would
    never recover: a request none of whose drafts was verified probes one draft at its first
    step where drafting would pay once that draft were accepted, and learns from its first
    verifies as a running mean with its pooled start counted once. Accepted, it drafts on;
    rejected, it stays off and probes only as a measured request does. At a batch size where
    drafting would not pay even then, there is no probe."""
    from specserve.spec.policy import PROBE_EVERY

    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    p.pooled.rates[:] = [0.05] * 4  # what text sampled hot left behind
    good, bad = _req("good", [1], max_tokens=1000), _req("bad", [1], max_tokens=1000)
    assert p.choose([good]) == [1] and p.stats("good").probing  # not the pooled start's 0
    p.observe_proposal("good", 1, 1)
    p.observe("good", 1, 1)
    assert p.stats("good").rates[0] == pytest.approx(0.525)  # halfway from the pool to 1
    k = p.choose([good])[0]
    assert k >= 1 and not p.stats("good").probing  # drafting on
    p.observe_proposal("good", k, k)
    p.observe("good", k, k)
    assert p.stats("good").rates[0] == pytest.approx((0.05 + 2) / 3)  # a running mean still
    p.pooled.rates[:] = [0.05] * 4  # (the good request's verifies raised it)
    assert p.choose([bad]) == [1] and p.stats("bad").probing
    start = p.stats("bad").rates[0]
    assert start == pytest.approx(0.05)
    p.observe_proposal("bad", 1, 1)
    p.observe("bad", 1, 0)
    assert p.stats("bad").rates[0] == pytest.approx(start / 2)
    ks = [p.choose([bad])[0] for _ in range(PROBE_EVERY - 1)]
    assert ks == [0] * (PROBE_EVERY - 1)  # no second first probe

    costly = _policy(COSTLY_VERIFY, {1: 0.01, 8: 0.01}, acceptance=0.8)
    costly.pooled.rates[:] = [0.05] * 4
    reqs = [_req(str(i), [1], max_tokens=1000) for i in range(8)]
    assert all(k == 0 for _ in range(3) for k in costly.choose(reqs))
    # A request that started drafting from a pool above break-even learns at the usual rate.
    usual = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    k = usual.choose([_req("u", [1], max_tokens=1000)])[0]
    assert k > 1
    usual.observe_proposal("u", k, k)
    usual.observe("u", k, 0)
    assert usual.stats("u").rates[0] == pytest.approx(0.8 * (1 - EWMA))


def test_catch_up_is_charged_over_the_steps_a_request_has_left():
    """A draft model must first feed a request's backlog (its prompt, or what was generated while
    it did not draft). Spread over many remaining tokens that is cheap; for a request about to
    end it is not, and that request is not drafted for while a caught-up one still is."""
    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    p.catchup_s_per_token = 0.002
    long_run = _req("long", [1] * 500, max_tokens=1000)
    assert p.choose([long_run], catchup=[500])[0] > 0
    ending = _req("ending", [1] * 500, max_tokens=3)
    assert p.choose([ending], catchup=[500]) == [0]
    assert p.choose([ending], catchup=[1])[0] > 0  # caught up: drafting pays again
    free = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)  # no catch-up cost measured: as before
    assert free.choose([_req("e", [1] * 500, max_tokens=3)], catchup=[500])[0] > 0


def test_catch_up_is_charged_over_the_answer_a_request_is_expected_to_give():
    """A request sent without max_tokens may run to its context window and ends at its first stop:
    charged over the window, a drafter's catch-up on a long prompt looked free. Once answers have
    finished, it is charged over what the answers longer than this one so far went on for; never
    over more than max_tokens allows, and an abort's length is not an answer's."""
    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    p.catchup_s_per_token = 0.002
    window = _req("w", [1] * 2000, max_tokens=30000)
    assert p.tokens_left(window) == 30000
    assert p.choose([window], catchup=[2000])[0] > 0  # 4 s over 30000 tokens: free
    for i in range(LENGTH_MIN - 1):
        p.forget(f"done{i}", 20)
    p.forget("aborted", None)
    assert p.tokens_left(window) == 30000  # too few answers yet
    p.forget("last", 20)
    assert p.tokens_left(window) == 20
    assert p.choose([window], catchup=[2000]) == [0]  # 4 s over ~20 tokens: no
    assert p.choose([window], catchup=[1])[0] > 0  # caught up: drafting pays
    assert p.tokens_left(_req("short", [1], max_tokens=5)) == 5  # max_tokens still bounds it
    for i in range(3):
        p.forget(f"long{i}", 400)
    window.append_output_tokens([7] * 100)  # past every 20-token answer: what the long ones went on for
    assert p.tokens_left(window) == 300


def test_drafting_is_priced_as_measured_against_its_prediction_per_batch_size():
    """The draft timer prices one-token passes; a step's drafting also feeds each request's first
    pass its unseen tokens, runs as many passes as its longest proposal and works on the host.
    observe_drafting() learns measured over predicted drafting seconds per number of drafting
    requests (a recent median), and the cost model scales its prediction by it: drafting that pays as predicted
    at batch 4 stops once steps there measure 3x the prediction, while batch 1, measured as
    predicted, drafts on."""
    p = _policy({1: 0.030, 4: 0.035, 8: 0.050, 16: 0.090, 32: 0.180}, {1: 0.005, 4: 0.006}, acceptance=0.7)
    four = [_req(r, [1, 2, 3], max_tokens=1000) for r in "abcd"]
    one = [_req("e", [1, 2, 3], max_tokens=1000)]
    ks = p.choose(four)
    assert all(ks)
    _, predicted = p._draft_predicted
    assert abs(predicted - 0.006 * max(p.stats("a").proposed_by_k(4)[k] for k in ks)) < 1e-12
    steps = 0
    while any(p.choose(four)) and steps < 10:  # drafting at batch 4 measures 3x its prediction
        p.observe_drafting(3 * p._draft_predicted[1])
        steps += 1
        assert p.choose(one)[0] > 0  # batch 1 measures its prediction
        p.observe_drafting(p._draft_predicted[1])
    assert 0 < steps < 10 and p.draft_scale(4) > 1.5 and p.draft_scale(1) == 1.0
    assert p.choose(four) == [0] * 4 and p._draft_predicted is None
    assert p.choose(one)[0] > 0
    p.choose(four)
    before = p.draft_scales()
    p.observe_drafting(0.5)  # nothing was predicted (a step without drafts): nothing learned
    assert p.draft_scales() == before
    # A first use of a shape (a one-off 10x) moves nothing: the scale is a median.
    q = _policy({1: 0.030, 4: 0.035, 8: 0.050, 16: 0.090, 32: 0.180}, {1: 0.005, 4: 0.006}, acceptance=0.7)
    for ratio in (10, 1, 1, 1):
        assert all(q.choose(four))
        q.observe_drafting(ratio * q._draft_predicted[1])
    assert q.draft_scale(4) == 1.0


def test_new_requests_start_from_pooled_acceptance():
    """A new request's estimate starts where earlier requests left the pooled one, not at the
    fixed prior: after many requests with poor first drafts a newcomer is not speculated for
    beyond one probe of a single position (which, rejected, leaves it off)."""
    p = _policy(CHEAP_VERIFY, {1: 0.03}, acceptance=0.9)
    assert p.choose([_req("first", [1])])[0] > 0
    for i in range(200):
        p.observe(f"old{i}", 4, 0)
    assert p.pooled.rates[0] < 0.05
    assert p.stats("new").rates[0] < 0.05
    new = _req("new", [1])
    assert p.choose([new]) == [1]
    p.observe_proposal("new", 1, 1)
    p.observe("new", 1, 0)
    assert [p.choose([new])[0] for _ in range(8)] == [0] * 8


def test_undelivered_positions_count_as_misses():
    """K is a cap: asked for 4, a draft that stops at an unsure token delivers 2. The policy
    learns how often each position is delivered (reach) and counts an undelivered position as a
    miss of its success rate, so expected accepted and expected delivered drafts are both 2."""
    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    for _ in range(60):
        p.observe_proposal("a", 4, 2)
        p.observe("a", 2, 2)  # both delivered drafts accepted
    st = p.stats("a")
    assert st.rates[0] > 0.99 and st.rates[1] > 0.99 and st.rates[2] < 0.01
    assert st.reach[1] > 0.99 and st.reach[2] < 0.01
    assert abs(st.expected_proposed(4) - 2) < 0.01 and abs(st.expected_accepted(4) - 2) < 0.01
    # An empty proposal (a lookup that found nothing) is a miss at position 0, with nothing verified.
    for _ in range(60):
        p.observe_proposal("b", 4, 0)
    assert p.stats("b").rates[0] < 0.01 and p.stats("b").expected_proposed(4) < 0.01


def test_positions_the_policy_pruned_are_not_counted_as_misses():
    """prune() cuts a delivered draft to what pays to verify; the cut positions were never tested.
    Counting them as misses would lower the estimate past the kept depth at every fully accepted
    step, and prune would then keep less and less. Only the proposer's own shortfall is a miss;
    for a tree, only below the chain K its node budget was sized from."""
    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    for _ in range(60):
        p.observe_proposal("a", 4, 4, num_kept=2)  # delivered 4 deep, 2 kept
        p.observe("a", 2, 2)  # both accepted
    st = p.stats("a")
    assert st.rates[0] > 0.99 and st.rates[1] > 0.99
    assert st.rates[2:] == [0.8] * 2 and st.reach == [1.0] * 4  # untested: the prior stands
    for _ in range(60):  # kept all the proposer had, short of k: the next position is a miss
        p.observe_proposal("b", 4, 3, num_kept=3)
        p.observe("b", 3, 3)
    st = p.stats("b")
    assert st.rates[2] > 0.99 and st.rates[3] < 0.01 and st.reach[3] < 0.01 and st.reach[:3] == [1.0] * 3

    trees = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    trees.trees = True
    ks = trees.choose([_req("t", [1])])
    st = trees.stats("t")
    assert st.depth_asked > 0 and ks[0] >= st.depth_asked  # a node budget from the chain K
    for _ in range(60):  # a bushy tree as deep as the chain K: nothing undelivered
        trees.observe_proposal("t", ks[0], st.depth_asked)
        trees.observe("t", st.depth_asked, st.depth_asked)
    assert st.reach == [1.0] * len(st.reach)
    assert all(r > 0.99 for r in st.rates[: st.depth_asked]) and st.rates[st.depth_asked:] == [0.8] * (4 - st.depth_asked)


def test_a_wholly_accepted_run_tests_the_next_position():
    """A draft accepted whole leaves the position past it untested, so its estimate would stay at
    the prior however long the copy run lasts and K would never grow. The policy tests it next
    step (K grows by one a step through a run), but not where that position was tested within
    RUN_PROBE_STALE steps (its estimate is current) and not past num_spec_tokens. In a tree,
    prune() keeps whatever pays plus the main path down to the tested position."""
    from specserve.spec.policy import NEVER, RUN_PROBE_STALE
    from specserve.spec.tree import DraftTree

    target = {1: 0.045, 2: 0.049, 3: 0.053, 4: 0.057, 5: 0.065, 9: 0.09}
    p = SpecPolicy(SpecConfig(method="ngram", num_spec_tokens=8), draft_cost_is_per_token=False, prior_acceptance=0.5)
    p.target_time, p.draft_time = StepTimer(target), StepTimer({1: 0.0})
    r = _req("a", [1])
    st = p.stats("a")
    st.rates = [0.97, 0.97, 0.97] + [0.3] * 5
    assert p.choose([r]) == [3]  # what the cost model affords
    p.observe("a", 3, 3)  # accepted whole
    for k in (4, 5, 6):
        assert p.choose([r]) == [k] and st.run_probe == k
        p.observe("a", k, k)
    st.rates = [0.97, 0.97, 0.97] + [0.3] * 5
    assert p.choose([r]) == [7]  # the run goes on: the next position, whatever the cost model says
    p.observe("a", 7, 7)
    assert p.choose([r]) == [8]
    p.observe("a", 8, 8)  # at num_spec_tokens: nothing further to test
    st.rates = [0.97, 0.97, 0.97] + [0.3] * 5
    assert p.choose([r]) == [3] and st.run_probe == 0
    p.observe("a", 3, 3)  # accepted whole, but position 3 was tested two steps ago
    assert p.choose([r]) == [3]
    p.observe("a", 4, 3)  # position 3 tested now, and missed
    for _ in range(RUN_PROBE_STALE - 1):
        p.observe("a", 3, 3)
        assert p.choose([r]) == [3]
    p.observe("a", 3, 3)
    assert p.choose([r]) == [4]  # stale again: tested anew
    p.observe("a", 4, 1)  # a partial acceptance is no run
    assert p.choose([r]) == [3]

    p.trees = True
    st.rates = [0.97, 0.97, 0.97] + [0.3] * 5
    st.full_run, st.tested = 5, [NEVER] * 8
    budget = p.choose([r])[0]
    assert st.run_probe == 6 and budget >= 6
    # A chain of 8 with a sibling at every depth, scored so that prune alone keeps two or three nodes.
    parents, scores = [], []
    for d in range(8):
        main = len(parents) - 2 if d else -1
        parents += [main, main]
        scores += [0.97 ** (d + 1), 0.01]
    tree = DraftTree(tuple(range(16)), tuple(parents), scores=tuple(scores))
    kept = p.prune([r], {"a": tree})["a"]
    assert kept.max_depth == 6 and len(kept) < 16
    st.run_probe = 0
    assert p.prune([r], {"a": tree})["a"].max_depth < 6


def test_copied_drafts_are_charged_no_draft_pass_and_learned_apart():
    """A hybrid (--spec-copy) copies for requests whose context has a match and drafts with a
    model for the rest. A copy makes no draft pass, so where the model's passes are too dear to
    draft at all a copied request still drafts deep; and each source's acceptance is learned on
    its own (a copy run's says nothing of the model's)."""
    p = _policy(CHEAP_VERIFY, {1: 0.1, 2: 0.1}, acceptance=0.9)
    a, b = _req("a", [1]), _req("b", [1])
    assert p.choose([a, b]) == [0, 0]  # a pass costs a target step: the model does not pay
    assert p.choose([a, b], free=[True, False]) == [4, 0]
    for _ in range(30):
        p.observe_proposal("a", 4, 4, free=True)
        p.observe("a", 4, 0, free=True)  # copies rejected
    assert p.stats("a", free=True).rates[0] < 0.01
    assert p.stats("a").rates == [0.9] * 4 and p.pooled.rates == [0.9] * 4  # the model's untouched
    assert p.pooled_for(True).rates[0] < 0.5 and p.stats("c", free=True).rates[0] < 0.5  # a new request's copy prior
    p.forget("a")
    assert p.stats("a", free=True).rates[0] == p.pooled_for(True).rates[0]


def test_a_copy_is_preferred_only_where_it_promises_as_much_as_the_models_draft():
    """Where the copier has a match and the model drafts well for the request while its copies
    are mostly rejected (prose with a repeated phrase), the model drafts; a copy declined
    PROBE_EVERY times in a row is taken anyway so its estimate can recover; where copies are
    accepted (a copy run) the copy wins, having no draft pass to pay for."""
    from specserve.spec.policy import PROBE_EVERY

    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)
    r, s = _req("r", [1]), _req("s", [1])
    p.stats("r", free=True).rates = [0.1] * 4
    p.stats("s", free=True).rates = [0.99] * 4
    p.stats("r", free=True).trials = p.stats("s", free=True).trials = 1  # both measured (a first copy is a trial)
    picks = [p.prefer_copy([r, s], [True, True]) for _ in range(PROBE_EVERY)]
    assert [a for a, _ in picks] == [False] * (PROBE_EVERY - 1) + [True]
    assert all(b for _, b in picks)
    assert p.prefer_copy([r, s], [False, False]) == [False, False]  # no copy to be had


def test_a_requests_first_copy_is_tried_and_one_copy_run_decides():
    """On a fresh engine a copy's estimate is the prior (0.5 a position) and the model's 0.8: in a
    phase where draft passes are cheap the model's rate wins, and a copy never taken is never
    measured (an edit request copied once in 23 steps). The first copy a request is offered is
    taken; one copy run accepted whole then wins the next offers, one rejected loses them."""
    from specserve.spec.policy import COPY_TRIALS

    p = _policy(CHEAP_VERIFY, {1: 0.01}, acceptance=0.8)  # a pass a tenth of a target step
    good, bad = _req("good", [1]), _req("bad", [1])
    assert p._best_rate(p.stats("good", True), False) < p._best_rate(p.stats("good"), True)  # the prior loses
    assert COPY_TRIALS == 1 and p.prefer_copy([good, bad], [True, True]) == [True, True]
    for rid, accepted in (("good", 4), ("bad", 0)):
        p.observe_proposal(rid, 4, 4, free=True)
        p.observe(rid, 4, accepted, free=True)
    assert p.stats("good", True).rates[0] == pytest.approx(0.75)  # a mean with the prior, not a 15% step
    assert p.prefer_copy([good, bad], [True, True]) == [True, False]
    assert p.stats("good").trials == 0  # the model's estimate learns as before


def test_a_cap_the_proposer_rarely_fills_is_charged_only_what_it_delivers():
    """Same chance of an accepted token per position, but a draft that stops early about half the
    time after each token: the passes and verify tokens that do not happen are not charged, so
    asking for K = 4 pays where a draft that always delivered 4 would be held at 1."""
    target = {1: 0.045, 2: 0.049, 3: 0.053, 4: 0.057, 5: 0.061}
    always_full = _policy(target, {1: 0.015}, acceptance=0.9)
    always_full.stats("a").rates = [0.9, 0.5, 0.5, 0.5]
    assert always_full.choose([_req("a", [1])]) == [1]
    stops_early = _policy(target, {1: 0.015}, acceptance=0.9)
    st = stops_early.stats("a")
    st.rates, st.reach = [0.9, 0.5, 0.5, 0.5], [1.0, 0.55, 0.55, 0.55]
    assert stops_early.choose([_req("a", [1])]) == [4]


def test_a_step_carrying_a_prompt_keeps_only_drafts_that_add_a_tenth_to_its_time():
    """A prompt's first token waits for its whole step: drafts beside a short prompt are cut to
    what adds PROMPT_DRAFT_SHARE to the step's time without them (the largest request's first),
    beside a long chunk they cost little and stay, and without prompt tokens nothing changes."""
    from specserve.ops.calc import PROMPT_DRAFT_SHARE

    # A compute-bound curve: 5 ms plus 0.6 ms a row (SmolLM2 on two cores).
    linear = {n: 0.005 + 0.0006 * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)}
    p = _policy(linear, {1: 0.001}, acceptance=0.9)
    assert p.cap_for_prompts([12], 0) == [12]
    # 1 decode + 10 prompt rows: T(11) = 11.6 ms, a tenth of that is 1.9 rows.
    assert p.cap_for_prompts([12], 10) == [1]
    assert p.target_time(11 + 1) <= (1 + PROMPT_DRAFT_SHARE) * p.target_time(11) < p.target_time(11 + 2)
    assert p.cap_for_prompts([8, 3], 40) == [2, 3]  # T(42) = 30.2 ms: 5 rows, cut from the largest
    assert p.cap_for_prompts([12, 4], 500) == [12, 4]  # a 500-token chunk hides 16 rows
    assert p.cap_for_prompts([0, 0], 10) == [0, 0]
    always = _policy(linear, {1: 0.001}, acceptance=0.9, policy="always")
    assert always.cap_for_prompts([12], 10) == [12]
    # Drafting that ran for a cut choice is not what the cost model priced: nothing to learn from it.
    p.choose([_req("a", [1, 2, 3])])
    p.cap_for_prompts([12], 10)
    p.observe_drafting(0.5)
    assert p.draft_scales() == {}


def test_thresholds_batch_size_and_priority():
    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.9, on_batch=2, off_batch=4)
    reqs = [_req(f"r{i}", [1], priority=-1 if i == 0 else 0) for i in range(3)]
    ks = p.choose(reqs)  # batch 3: between the thresholds -> only the priority request
    assert ks[0] > 0 and ks[1] == ks[2] == 0
    reqs4 = [_req(f"s{i}", [1], priority=-1) for i in range(4)]
    assert p.choose(reqs4) == [0, 0, 0, 0]  # batch >= off_batch: never


def test_always_off_and_runtime_flag():
    reqs = [_req(f"r{i}", [1]) for i in range(40)]
    assert _policy(COSTLY_VERIFY, {}, 0.1, policy="always").choose(reqs) == [4] * 40
    assert _policy(CHEAP_VERIFY, {}, 0.9, policy="off").choose(reqs[:1]) == [0]
    p = _policy(CHEAP_VERIFY, {1: 0.001}, 0.9)
    assert p.choose([_req("x", [1], speculative=False)]) == [0]  # per-request opt-out
    p.enabled = False
    assert p.choose(reqs[:1]) == [0]


def test_step_timer_interpolates_and_learns():
    t = StepTimer({1: 0.1, 8: 0.8})
    assert abs(t(4) - (0.1 + 3 / 7 * 0.7)) < 1e-9
    assert abs(t(16) - 1.6) < 1e-9  # extrapolates along the last segment
    for _ in range(100):
        t.observe(8, 0.4)
    assert abs(t(8) - 0.4) < 1e-3


def test_longest_suffix_match_prefers_longest_and_latest():
    hay = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    draft, start = longest_suffix_match(hay, hay, 1, 3, 2, exclude_tail=True)
    assert draft == [7, 8] and start == 7  # latest earlier occurrence of [1, 2, 3]
    assert longest_suffix_match([5, 6], [1, 2], 1, 2, 3) == ([], -1)


def test_ngram_proposer_copies_from_context():
    prop = NgramProposer(1, 3)
    r = _req("a", [10, 11, 12, 13, 14, 99, 10, 11])
    out = prop.propose([r], [3])
    assert out["a"].token_ids == (12, 13, 14) and out["a"].dists is None and out["a"].is_chain
    assert prop.propose([_req("b", [1, 2, 3])], [3]) == {}


def test_ngram_may_draft_is_false_only_where_the_search_finds_nothing():
    """may_draft answers without a search (the engine then skips the step's choice and search):
    False only where the last token never occurred before it, in the text or the reference, and
    no earlier output shares the tail; it follows the text as it grows."""
    import random

    from specserve.spec.served import ServedOutputs

    rng = random.Random(0)
    for trial in range(300):
        served = ServedOutputs() if trial % 3 == 0 else None
        if served is not None:
            served.add([rng.randrange(12) for _ in range(30)])
        prop = NgramProposer(1, 3, served=served)
        ref = [rng.randrange(12) for _ in range(rng.randrange(0, 6))] if trial % 2 else None
        req = Request("a", [rng.randrange(12)], SamplingParams(reference_token_ids=ref))
        for _ in range(rng.randrange(1, 25)):
            may = prop.may_draft(req)
            assert may or not prop.propose([req], [4])
            req.append_output_tokens([rng.randrange(12)])
    prop = NgramProposer(1, 3)
    req = Request("b", [5, 6, 7], SamplingParams())
    assert not prop.may_draft(req)
    req.append_output_tokens([6])
    assert prop.may_draft(req) and prop.propose([req], [2])["b"].token_ids == (7, 6)
    assert NgramProposer(1, 3).may_draft(Request("c", [5, 6], SamplingParams(reference_token_ids=[9, 6, 4])))
    served = ServedOutputs()
    served.add([1, 2, 3, 4, 5, 6])  # an earlier answer: a request whose own text is new goes on with it
    prop = NgramProposer(1, 3, served=served)
    req = Request("d", [1, 2, 3, 4], SamplingParams())
    assert prop.may_draft(req) and prop.propose([req], [2])["d"].token_ids == (5, 6)


@pytest.mark.parametrize("filler", [0, 600])  # a short text is searched as a list, a long one as an array
def test_ngram_proposer_skips_occurrences_an_ending_id_follows(filler):
    """An occurrence of the tail that an ending id follows (EOS unless ignore_eos, stop ids) is not
    copied: accepted, the id adds no token. Where the longest tail has only such occurrences, a
    shorter tail's others are (a chat answer opening a code fence: the prompt's closing fence is
    followed by the end of the turn, "```" alone also matches its opening fence)."""
    eos, stop = 2, 3
    pad = list(range(1000, 1000 + filler))

    def draft(tokens, ngram_min=1, **kw):
        req = Request("a", pad + tokens, SamplingParams(**kw), eos_token_ids=frozenset({eos}))
        out = NgramProposer(ngram_min, 3).propose([req], [3])
        return out["a"].main_path_tokens() if out else None

    text = [5, 6, 7, eos, 8, 6, 7, 4, 40, 9, 5, 6, 7]  # [5, 6, 7] only before EOS; [6, 7] also before 4
    assert draft(text) == (4, 40, 9)
    assert draft(text, ignore_eos=True) == (eos, 8, 6)  # EOS is a token like any other
    assert draft([5, 6, 7, stop, 8, 6, 7, 4, 40, 9, 5, 6, 7], stop_token_ids=[stop]) == (4, 40, 9)
    mixed = [5, 6, 7, eos, 8, 5, 6, 7, 4, 40, 9, 5, 6, 7]  # the longest tail's other occurrence stays
    assert draft(mixed) == (4, 40, 9)
    assert draft([6, 7, eos, 9, 6, 7], ngram_min=2) is None  # no tail of >= 2 tokens goes on


def test_reference_method_is_prompt_lookup_over_the_reference():
    """`--spec-method reference` builds prompt lookup, which searches a request's reference before
    its prompt: it copies the reference where the output's tail matches it, picks it up again
    after an insertion, and copies the request's own text too. In front of a model drafter the
    reference-only copier stays first."""
    from specserve.config import CacheConfig, ModelConfig
    from specserve.spec.factory import ProposerContext, build_proposer

    ctx = ProposerContext(SpecConfig(method="reference"), ModelConfig(model="tiny"), CacheConfig(), 256, None, 100, 64)
    prop = build_proposer(ctx)
    assert isinstance(prop, NgramProposer)
    ref = [10, 11, 12, 13, 14, 15, 16, 17]
    r = _req("a", [1], reference_token_ids=ref)
    prop.add_request(r)
    r.append_output_tokens([10, 11, 12])  # copying
    assert prop.propose([r], [3])["a"].main_path_tokens() == (13, 14, 15)
    r.append_output_tokens([90, 91, 92])  # an insertion the reference does not have
    assert prop.propose([r], [3]) == {}
    r.append_output_tokens([13, 14])  # the output picked the reference up again
    assert prop.propose([r], [3])["a"].main_path_tokens() == (15, 16, 17)
    r.append_output_tokens([15, 16, 17, 90])  # its own text: the insertion, copied again
    assert prop.propose([r], [2])["a"].main_path_tokens() == (91, 92)
    assert SpecConfig(method="draft", draft_model="d").copiers == ("reference", "ngram")


def test_reference_proposer_follows_reference_in_order():
    ref = [5, 6, 7, 5, 6, 8, 9]
    prop = ReferenceProposer(None, 1, 2)
    r = _req("a", [1, 5, 6], reference_token_ids=ref)
    prop.add_request(r)
    assert prop.propose([r], [2])["a"].token_ids == (7, 5)
    r.append_output_tokens([7, 5, 6])  # output tracked the reference; cursor moves on
    assert prop.propose([r], [2])["a"].token_ids == (8, 9)
    prop.remove_request("a", finished=False)
    assert prop.live_request_ids() == ["a"]  # a preempted request keeps its reference
    prop.remove_request("a", finished=True)
    assert prop.live_request_ids() == []


def test_reference_tree_waits_out_a_divergence_and_resumes_at_the_anchor():
    """As a tree the reference proposer keeps an anchor where copying stopped. While the output
    departs from the reference and nothing in it matches, it drafts nothing (a guess every step
    of an insertion cost a verify each and dragged the policy's first-position estimate down:
    reference trees on edit prompts went from 71/38/93/73 target steps per prompt to 55/35/59/18,
    chains 54/33/59/19). With some tail match it offers the anchor's text beside the match's."""
    ref = [10, 11, 12, 13, 14, 15, 16, 17]
    prop = ReferenceProposer(None, 1, 2, tree=True)
    r = _req("a", [1], reference_token_ids=ref)
    prop.add_request(r)
    r.append_output_tokens([10, 11, 12])  # copying
    assert prop.propose([r], [3])["a"].main_path_tokens() == (13, 14, 15)
    r.append_output_tokens([90, 91])  # an insertion: nothing in the reference matches
    assert prop.propose([r], [3]) == {}
    r.append_output_tokens([11])  # a one-token match behind the anchor: not enough to move it
    draft = prop.propose([r], [6])["a"]
    firsts = {draft.token_ids[c] for c in draft.children[0]}
    assert draft.main_path_tokens()[0] == 13 and firsts == {12, 13}  # the anchor's text first, the match's beside it
    r.append_output_tokens([13])  # the output resumed at the anchor
    assert prop.propose([r], [3])["a"].main_path_tokens() == (14, 15, 16)


def test_lookahead_jacobi_window_and_pool():
    """The window takes the target's outputs shifted past what was emitted; the pool learns
    n-grams from the prompt, the output and the window's trajectory."""
    from specserve.engine.scheduler import SampledTokens
    from specserve.spec.lookahead import LookaheadProposer

    prop = LookaheadProposer(window=3, ngram=3)
    r = _req("a", [1, 2, 3, 1, 2, 4, 9])
    prop.add_request(r)
    st = prop._states["a"]
    assert st.pool[1] == {(2, 3): 1.0, (2, 4): 1.0} and st.window == [2, 4, 9]
    draft = prop.propose([r], [6])["a"]
    assert draft.match([2, 4, 9]) and sorted(draft.children[0], key=lambda c: draft.token_ids[c])  # window branch present
    # The target accepted y1 = 2, rejected y2 = 4 (emitting 5); its outputs along the window:
    # after 9 (root) -> 2, after 2 -> 5, after 4 -> 6, after 9 -> 7.
    path = draft.match([2, 4, 9])
    argmax = [0] * (len(draft) + 1)
    argmax[0] = 2
    for node, o in zip(path, [5, 6, 7]):
        argmax[node + 1] = o
    r.append_output_tokens([2, 5])
    prop.observe(r, draft, SampledTokens([2, 5], accepted_nodes=(path[0],), node_argmax=tuple(argmax)))
    assert st.window == [6, 7, 7]  # outputs past the two emitted tokens, padded with the last
    assert st.pool[2][(5, 6)] >= 1.0 and st.pool[4][(6, 7)] >= 1.0  # trajectory n-grams
    prop.remove_request("a")
    assert prop.live_request_ids() == []


def test_a_held_back_request_of_a_scored_proposer_probes_as_often_as_its_proposal_is_cheap():
    """A scored tree proposer (prompt lookup) holds back a request whose measured yield does not
    pay, and probes it (drafts, prune() keeping what pays) so that its text turning copyable is
    found: every step where proposing costs under PROBE_SHARE of the request's share of a step,
    more rarely where it costs more, never more rarely than every PROBE_EVERY steps."""
    import math

    from specserve.spec.policy import PROBE_EVERY, PROBE_SHARE

    def drafted(propose_s, batch, steps=3 * PROBE_EVERY):
        p = _policy(COSTLY_VERIFY, {1: 0.001}, acceptance=0.5)
        p.scored, p.trees, p.propose_s = True, True, propose_s
        reqs = [_req(str(i), [1]) for i in range(batch)]
        for i in range(batch):
            p.stats(str(i)).update_scores(4.0, 0, 4)  # drafts of 4 nodes that yielded nothing
        return [[k > 0 for k in p.choose(reqs)] for _ in range(steps)]

    for propose_s, batch in ((1e-4, 1), (0.01, 1), (0.01, 4), (1.0, 1)):  # intervals 1, 5, 5, 16
        interval = max(1, min(PROBE_EVERY, math.ceil(propose_s / (PROBE_SHARE * COSTLY_VERIFY[batch] / batch))))
        steps = drafted(propose_s, batch)
        for i in range(batch):
            probes = [s for s, d in enumerate(steps) if d[i]]
            assert probes == list(range(interval - 1, len(steps), interval)), (propose_s, batch, probes)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rate_guard_holds_speculation_off_where_it_measurably_loses():
    """The guard compares measured tokens per second of steps with and without drafts at a batch
    size: below GUARD_MARGIN of plain, speculation is held off there (choose() returns no drafts
    whatever the cost model says), retried after GUARD_RETRY_S for GUARD_TRIAL steps (twice as
    long after a failed trial), and resumes when a trial measures it ahead. Rates are tokens
    over seconds (one slow step weighs by its time, and widens the rate's error); other batch
    sizes are judged apart."""
    from specserve.spec import policy as P

    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    clock = p.guard.clock = _Clock()
    reqs = [_req(r, [1, 2, 3]) for r in "abcd"]
    assert all(p.choose(reqs))  # nothing measured: the cost model decides
    p.guard.observe(4, 4, 0.080, speculated=False)  # plain: 50 tok/s
    p.guard.observe(4, 5, 0.300, speculated=True)  # a catch-up pass: 16.7 tok/s
    for _ in range(P.GUARD_MIN_CYCLES - 2):
        p.guard.observe(4, 6, 0.150, speculated=True)  # 40 tok/s
        clock.t += 0.15
        assert all(p.choose(reqs))  # not judged before GUARD_MIN_CYCLES steps
    p.guard.observe(4, 6, 0.150, speculated=True)  # with the catch-up: ~37 tok/s, +- ~3
    assert p.guard.num_held == 1 and p.guard.summary()[4]["held"]
    assert p.guard.holds(4) and not p.guard.holds(1)  # (asking moves nothing)
    assert p.drafts_held(4) and not p.drafts_held(4, num_other_tokens=16)  # a step with prompt tokens is not held
    assert not any(p.choose(reqs))
    assert p.choose(reqs[:1]) == [4]  # batch 1 has its own rates
    clock.t += P.GUARD_RETRY_S / 2
    assert not any(p.choose(reqs)) and p.guard.holds(4)
    p.guard.observe(4, 4, 0.100, speculated=False)
    clock.t += P.GUARD_RETRY_S
    assert not p.guard.holds(4)  # the retry is due: allows() starts the trial
    for _ in range(P.GUARD_TRIAL):  # a trial that fails (30 tok/s): held off twice as long
        assert all(p.choose(reqs)) and not p.guard.holds(4)
        p.guard.observe(4, 3, 0.100, speculated=True)
    assert p.guard.num_held == 2 and not any(p.choose(reqs))
    clock.t += 1.5 * P.GUARD_RETRY_S
    assert not any(p.choose(reqs))
    p.guard.observe(4, 4, 0.100, speculated=False)
    clock.t += P.GUARD_RETRY_S
    for _ in range(P.GUARD_TRIAL):  # the next trial: this time drafts pay (50 tok/s)
        assert all(p.choose(reqs))
        p.guard.observe(4, 6, 0.120, speculated=True)
        clock.t += 0.12
    assert not p.guard.summary()[4]["held"] and p.guard.num_held == 2
    assert not any(p.choose(reqs)) and p.guard.num_plain_probes == 1  # the plain rate is GUARD_FRESH_S old
    p.guard.observe(4, 4, 0.100, speculated=False)
    assert all(p.choose(reqs))


def test_rate_guard_holds_only_where_the_loss_is_more_than_the_steps_noise():
    """A few steps' accepted lengths are noise: speculating steps hold speculation off only where
    their rate is below GUARD_MARGIN of plain's by more than GUARD_Z standard errors of it
    (StepSums.rate_error). Eight steps with one accepted draft token read 26.2 tok/s against a
    27.8 plain rate, below the margin but within one error: not held; the same steps going on
    with nothing accepted hold it off once the evidence is in; steps that lose alike every time
    (no noise) hold it off at GUARD_MIN_CYCLES, as before."""
    from specserve.spec import policy as P

    sums = P.StepSums()
    for _ in range(4):
        sums.fold(2, 0.05, 0.9)
    assert sums.rate == pytest.approx(40.0) and sums.rate_error() < 1e-6
    sums = P.StepSums().fold(3, 0.1).fold(1, 0.1)  # 20 tok/s from steps of 30 and 10
    assert sums.rate == pytest.approx(20.0) and sums.rate_error() == pytest.approx(math.sqrt(2) / 0.2)

    g = P.RateGuard(clock=_Clock())
    g.observe(1, 1, 0.036, speculated=False)  # plain: 27.8 tok/s
    for tokens in [2] + [1] * (P.GUARD_MIN_CYCLES - 1):
        g.observe(1, tokens, 0.043, speculated=True)
    rate, err = g.rates[1].spec.rate, g.rates[1].spec.rate_error()
    assert rate < P.GUARD_MARGIN / 0.036 < rate + P.GUARD_Z * err
    assert g.num_held == 0 and not g.holds(1)
    steps = 0
    while not g.num_held and steps < 50:
        g.observe(1, 1, 0.043, speculated=True)  # 23.3 tok/s
        steps += 1
    assert g.num_held == 1 and 1 <= steps < 20 and g.holds(1)

    g = P.RateGuard(clock=_Clock())
    g.observe(1, 1, 0.036, speculated=False)
    for _ in range(P.GUARD_MIN_CYCLES):
        assert g.num_held == 0
        g.observe(1, 1, 0.043, speculated=True)
    assert g.num_held == 1


def test_rate_guard_retries_after_so_many_plain_steps_and_when_a_request_arrives():
    """A fast model makes hundreds of steps a second: held off, speculation is tried again after
    GUARD_RETRY_STEPS plain steps at that batch size when they come before GUARD_RETRY_S (and
    after twice as many following a failed trial), not only after the seconds; and once as many
    requests arrived as the batch size holds (twice as many after each failed trial in a batch
    of several, where an arrival changes only a part of the text; alone, every arrival is all
    new text)."""
    from specserve.spec import policy as P

    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    clock = p.guard.clock = _Clock()
    reqs = [_req("a", [1, 2, 3])]
    p.guard.observe(1, 1, 0.003, speculated=False)  # plain: 333 tok/s
    for _ in range(P.GUARD_MIN_CYCLES):
        p.guard.observe(1, 1, 0.004, speculated=True)  # 250 tok/s: rejected copies
    assert p.guard.num_held == 1 and p.choose(reqs) == [0]
    for retry in (P.GUARD_RETRY_STEPS, 2 * P.GUARD_RETRY_STEPS):
        for _ in range(retry):
            assert p.guard.holds(1) and p.choose(reqs) == [0]
            p.guard.observe(1, 1, 0.003, speculated=False)
            clock.t += 0.003  # far from GUARD_RETRY_S
        assert not p.guard.holds(1)
        for _ in range(P.GUARD_TRIAL):  # a trial that fails
            assert p.choose(reqs) == [4]
            p.guard.observe(1, 1, 0.004, speculated=True)
    assert p.guard.num_held == 3 and p.guard.holds(1)
    assert p.guard.rates[1].retry_steps == 4 * P.GUARD_RETRY_STEPS
    # A new request is other text: alone in its batch, the next step tries after two failed
    # trials in a row too.
    p.guard.new_request()
    assert not p.guard.holds(1)
    for _ in range(P.GUARD_TRIAL):
        assert p.choose(reqs) == [4]
        p.guard.observe(1, 1, 0.004, speculated=True)
    assert p.guard.num_held == 4 and p.guard.rates[1].retry_steps == 8 * P.GUARD_RETRY_STEPS
    # In a batch of 4, once as many arrived as the batch holds, doubled for each failed trial in a row.
    p.guard.rates[4] = P._Rates(held_since=clock.t, retry_s=3600.0)  # batch 4, held off by a first judgement
    for _ in range(P.GUARD_RETRY_STEPS):  # (steps at batch 1 do not count at batch 4)
        p.guard.observe(1, 1, 0.003, speculated=False)
    for _ in range(3):
        p.guard.new_request()
        assert p.guard.holds(4)
    p.guard.new_request()
    assert not p.guard.holds(4)
    p.guard.rates[4] = P._Rates(held_since=clock.t, retry_s=3600.0, failed_trials=2)
    for _ in range(15):
        p.guard.new_request()
        assert p.guard.holds(4)
    p.guard.new_request()
    assert not p.guard.holds(4)


def test_a_rate_guard_trial_starts_again_on_the_text_of_new_requests():
    """A trial's verdict is on the text it measured: where as many requests arrive during one as
    its batch size holds, it starts again, so losing steps of the earlier text do not hold the
    new text's drafts off; a part of a larger batch arriving leaves the trial as it is."""
    from specserve.spec import policy as P

    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    clock = p.guard.clock = _Clock()
    reqs = [_req("a", [1, 2, 3])]
    p.guard.observe(1, 1, 0.003, speculated=False)  # plain: 333 tok/s
    for _ in range(P.GUARD_MIN_CYCLES):
        p.guard.observe(1, 1, 0.004, speculated=True)  # 250 tok/s
    assert p.guard.num_held == 1
    for _ in range(P.GUARD_RETRY_STEPS):
        p.guard.observe(1, 1, 0.003, speculated=False)
        clock.t += 0.003
    for _ in range(P.GUARD_TRIAL - 1):  # the trial's steps on the old text: losing (100 tok/s)
        assert p.choose(reqs) == [4]
        p.guard.observe(1, 1, 0.010, speculated=True)
    p.guard.new_request()  # the next answer: other text
    for _ in range(P.GUARD_TRIAL):  # a whole trial on it, which wins
        assert p.choose(reqs) == [4]
        p.guard.observe(1, 4, 0.006, speculated=True)  # 667 tok/s
    assert p.guard.num_held == 1 and not p.guard.holds(1) and p.choose(reqs) == [4]

    g = P.RateGuard(clock=_Clock())  # batch 4: one arrival is a part of the text
    g.rates[4] = P._Rates(trial=P.StepSums().fold(4, 0.1), trial_left=1)
    g.new_request()
    assert g.rates[4].trial_left == 1 and g.rates[4].trial.tokens == 4


def test_rate_guard_hold_ends_when_the_held_text_turns_copyable():
    """Held off, the guard is told each held step whether the text has turned to one a copy
    carries on (Proposer.copy_resumes): the first such step ends the hold (the trial runs that
    step); after a failed trial it takes two such steps in a row (a step that is not copyable
    starts the count again); after GUARD_COPY_TRIALS failed trials in a row copyable text ends
    no hold, the waits do. Outside a hold nothing changes."""
    from specserve.spec import policy as P

    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    clock = p.guard.clock = _Clock()
    reqs = [_req("a", [1, 2, 3])]
    assert not p.guard.copy_resumes(1, True)  # nothing held
    p.guard.observe(1, 1, 0.030, speculated=False)
    for _ in range(P.GUARD_MIN_CYCLES):
        p.guard.observe(1, 1, 0.040, speculated=True)  # rejected drafts: held off
    assert p.guard.num_held == 1 and p.drafts_held(1)
    assert not p.guard.copy_resumes(1, False) and p.guard.holds(1)
    assert p.guard.copy_resumes(1, True) and not p.guard.holds(1)

    def failed_trial():
        for _ in range(P.GUARD_TRIAL):
            assert p.choose(reqs) == [4]
            p.guard.observe(1, 1, 0.040, speculated=True)
            clock.t += 0.04

    failed_trial()
    assert p.guard.holds(1) and p.guard.rates[1].failed_trials == 1
    assert not p.guard.copy_resumes(1, True)
    assert not p.guard.copy_resumes(1, False)  # the run is broken: counted again from 0
    assert not p.guard.copy_resumes(1, True) and p.guard.holds(1)
    assert p.guard.copy_resumes(1, True) and not p.guard.holds(1)
    failed_trial()
    assert p.guard.rates[1].failed_trials == P.GUARD_COPY_TRIALS == 2
    for _ in range(100):
        assert not p.guard.copy_resumes(1, True) and p.guard.holds(1)
    clock.t += 4 * P.GUARD_RETRY_S  # the wait ends it
    assert not p.guard.holds(1)
    for _ in range(P.GUARD_TRIAL):  # this trial pays: speculation stays on
        assert p.choose(reqs) == [4]
        p.guard.observe(1, 8, 0.060, speculated=True)
        clock.t += 0.06
    assert not p.guard.holds(1) and not p.guard.copy_resumes(1, True) and p.guard.num_held == 3


def test_copiers_say_when_the_context_tail_repeats_earlier_text():
    """Proposer.copy_resumes: prompt lookup finds the last RESUME_MATCH tokens earlier in the
    request's own text or its reference, the reference copier in the reference; shorter repeats,
    and requests that opted out of speculation, do not count."""
    from specserve.spec.proposer import RESUME_MATCH

    code = list(range(100, 140))
    novel = list(range(200, 230))
    ng = NgramProposer()
    ref = ReferenceProposer(None)
    tail_of = lambda n: code[:n]  # noqa: E731 - the output re-emitting the first n tokens of the code
    for n, want in ((RESUME_MATCH - 1, False), (RESUME_MATCH, True), (RESUME_MATCH + 5, True)):
        own = _req(f"a{n}", [1, *code, 2, *novel, *tail_of(n)])
        assert ng.copy_resumes([own]) is want, n
        assert not ng.copy_resumes([_req(f"b{n}", [1, *novel, *tail_of(n)])])  # nothing to repeat
        with_ref = _req(f"c{n}", [1, *novel, *tail_of(n)], reference_token_ids=code)
        assert ng.copy_resumes([with_ref]) is want
        ref.add_request(with_ref)
        assert ref.copy_resumes([with_ref]) is want
        ref.remove_request(f"c{n}")
    off = _req("d", [1, *code, 2, *code[:RESUME_MATCH]], speculative=False)
    assert not ng.copy_resumes([off])
    assert ng.copy_resumes([off, _req("e", [1, *code, 2, *code[:RESUME_MATCH]])])
    long = _req("f", [*novel * 30, *code, *novel, *code[:RESUME_MATCH]])  # past SHORT_SEARCH: the array search
    assert ng.copy_resumes([long])


def test_repeat_watch_answers_as_a_search_at_every_length_while_skipping_most():
    """RepeatWatch skips the searches that cannot find a repeat of n (a repeat of n tokens j
    tokens later holds one of n - j now) and answers as suffix_matches would at every length of a
    growing context, in itself and in a fixed haystack; most steps of text with short repeats
    search nothing."""
    import random

    from specserve.spec import suffix
    from specserve.spec.suffix import RepeatWatch

    rng = random.Random(5)
    real = suffix.suffix_matches
    searches = [0]

    def counting(*a, **k):
        searches[0] += 1
        return real(*a, **k)

    for trial in range(30):
        n = rng.choice([2, 4, 8])
        vocab = rng.choice([3, 6, 20, 200])
        text, hay = [], [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
        own, fixed = RepeatWatch(n), RepeatWatch(n)
        searches[0] = 0
        suffix.suffix_matches = counting
        try:
            for step in range(400):
                if rng.random() < 0.05 and len(text) > 10:  # copy a stretch of earlier text
                    s0 = rng.randrange(len(text) - 5)
                    text.extend(text[s0 : s0 + rng.randrange(1, 20)])
                else:
                    text.append(rng.randrange(vocab))
                assert own.repeats("r", text, text, exclude_tail=True) == (
                    real(text, text, n, n, exclude_tail=True)[0] >= n), (trial, step)
                assert fixed.repeats("r", hay, text) == (real(hay, text, n, n)[0] >= n), (trial, step)
        finally:
            suffix.suffix_matches = real
        if vocab == 200 and n == 8:
            assert searches[0] < 0.4 * 2 * 400, searches[0]


def test_rate_guard_remeasures_a_stale_plain_rate_with_one_plain_step():
    """Where speculating steps are measured, a plain rate older than GUARD_FRESH_S is measured
    again by running one step plain; where speculation leads by GUARD_CLEAR, only every
    GUARD_FRESH_LONG_S. The guard never adds drafts the cost model did not choose."""
    from specserve.spec import policy as P

    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    clock = p.guard.clock = _Clock()
    reqs = [_req("a", [1, 2, 3])]
    p.guard.observe(1, 1, 0.100, speculated=False)  # 10 tok/s
    for _ in range(P.GUARD_MIN_CYCLES):
        p.guard.observe(1, 1.2, 0.100, speculated=True)  # 12 tok/s: ahead, but by less than GUARD_CLEAR
    clock.t += P.GUARD_FRESH_S + 0.1
    assert p.choose(reqs) == [0] and p.guard.num_plain_probes == 1
    assert p.choose(reqs) == [4]  # one step
    p.guard.observe(1, 1, 0.100, speculated=False)
    for _ in range(20):
        p.guard.observe(1, 3, 0.100, speculated=True)  # 30 tok/s: far ahead
    clock.t += P.GUARD_FRESH_S + 0.1
    assert p.choose(reqs) == [4]
    clock.t += P.GUARD_FRESH_LONG_S
    assert p.choose(reqs) == [0] and p.guard.num_plain_probes == 2
    q = _policy(COSTLY_VERIFY, {1: 0.001}, acceptance=0.5)
    q.guard.clock = clock
    assert q.choose(reqs) == [0] and q.guard.num_plain_probes == 0


def test_rate_guard_judges_speculating_steps_against_plain_ones_of_the_same_seconds():
    """Speculating steps measured in a slow phase, then plain ones in a fast phase: the old
    speculating rate is not held against the new plain one. Speculation is judged again on
    GUARD_MIN_CYCLES fresh steps."""
    from specserve.spec import policy as P

    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.8)
    clock = p.guard.clock = _Clock()
    reqs = [_req("a", [1, 2, 3])]
    p.guard.observe(1, 1, 0.034, speculated=False)  # slow phase: plain 29 tok/s
    for _ in range(P.GUARD_MIN_CYCLES):
        p.guard.observe(1, 1.2, 0.033, speculated=True)  # 36 tok/s: ahead
        clock.t += 0.033
    for _ in range(90):  # a plain run in a fast phase: 45 tok/s
        p.guard.observe(1, 1, 0.022, speculated=False)
        clock.t += 0.022
    for _ in range(P.GUARD_MIN_CYCLES - 1):  # speculating again, fast phase: 55 tok/s
        p.guard.observe(1, 1.2, 0.022, speculated=True)
        clock.t += 0.022
        assert p.guard.num_held == 0 and p.choose(reqs) == [4]
    p.guard.observe(1, 1.2, 0.022, speculated=True)
    assert p.guard.num_held == 0
    for _ in range(P.GUARD_MIN_CYCLES):  # and a real loss in the same seconds is still caught
        p.guard.observe(1, 1.2, 0.040, speculated=True)  # 30 tok/s against plain's 45
        clock.t += 0.040
    assert p.guard.num_held == 1


def test_a_delivered_tree_node_is_valued_by_its_acceptance_given_delivery():
    """A draft that stops at an unsure token delivers its deep positions only where it was sure,
    and there they are nearly always accepted. The rates count an undelivered position as a miss
    (right for choosing K: a step gets only what is delivered), but a node already in the tree was
    delivered: prune() values it with the acceptance measured over the verifies that held that
    depth, so a sure deep node whose verify pays is kept, and its siblings share only what that
    leaves. A depth the drafts reach but the target rejects is valued low all the same."""
    from specserve.spec.tree import DraftTree

    p = _policy({1: 0.100, 2: 0.104, 3: 0.108, 4: 0.112, 8: 0.200}, {1: 0.001}, acceptance=0.8)
    p.trees = True
    st = p.stats("a")
    for _ in range(200):  # position 1 delivered half the time; whenever delivered, accepted
        p.observe_proposal("a", 2, 2)
        p.observe("a", 2, 2)
        p.observe_proposal("a", 2, 1)
        p.observe("a", 1, 1)
    assert 0.4 < st.rates[1] < 0.6 and 0.4 < st.reach[1] < 0.6
    chain = DraftTree((5, 6), (-1, 0), scores=(0.9, 0.85))
    gains = SpecPolicy.node_gains(st, chain)
    assert gains[0] > 0.99 and gains[1] > 0.95  # not ~0.5: node 1 is there, so it was delivered
    # Its verify costs 4% of a step and it brings ~0.97 tokens: kept whole.
    assert len(p.prune([_req("a", [1])], {"a": chain})["a"]) == 2
    # A sibling of a node accepted ~always when delivered gets what little is left.
    bushy = DraftTree((5, 7, 6), (-1, 0, 0), scores=(0.9, 0.85, 0.05))
    assert SpecPolicy.node_gains(st, bushy)[2] < 0.05
    for _ in range(200):  # now delivered half the time and then rejected
        p.observe_proposal("b", 2, 2)
        p.observe("b", 2, 1)
        p.observe_proposal("b", 2, 1)
        p.observe("b", 1, 1)
    assert SpecPolicy.node_gains(p.stats("b"), chain)[1] < 0.05


def test_a_draft_row_is_charged_its_attention_over_the_requests_context():
    """T(n) is timed at a short context; a draft row attends over its request's whole context, and
    on the CPU that attention is arithmetic the rows do not share (the Qwen 1.5B's T(9) / T(1): 1.8
    at 64 tokens of context, 4.3 at 8,000). With pair_s the policy charges each draft row its
    keys beyond T(n)'s context: a long request drafts less than a short one with the same
    acceptance, in K (choose) and in what prune() keeps; without it (0: not measured) the two
    are alike, as before."""
    from specserve.spec.policy import TIMED_CONTEXT
    from specserve.spec.tree import DraftTree

    short, long = _req("s", list(range(40))), _req("l", list(range(8000)))
    p = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.6)
    assert p.choose([short]) == p.choose([long]) == [4]
    p.pair_s = 0.05 / (8000 - TIMED_CONTEXT)  # a row at 8,000 tokens: half a 0.1 s step
    assert p.choose([short]) == [4]
    assert p.choose([long]) == [1]  # 1.6 tokens in 0.203 s beat 1 in 0.15; two drafts do not
    poor = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.3)
    poor.pair_s = p.pair_s
    for r in (short, long):  # verified before: no first probe (see the module docstring)
        poor.stats(r.request_id).trials = 1
    assert poor.choose([short])[0] > 0 and poor.choose([long]) == [0]
    assert p.row_s(short) == pytest.approx(0.05 * 8 / (8000 - TIMED_CONTEXT)) and p.row_s(long) == pytest.approx(0.05)
    # A step's attention beyond T(n)'s: each row's keys beyond those its counterpart in T(n)'s
    # profile saw (that profile's rows also saw the rows before them, as a chunk's rows do).
    assert p.attention_s([(1, 7999)]) == pytest.approx(p.pair_s * (8000 - TIMED_CONTEXT))
    assert p.attention_s([(3, 100)]) == pytest.approx(p.pair_s * 3 * (101 - TIMED_CONTEXT))
    # A prompt's first chunk attends among its own rows only: as T(n) was timed, nothing beyond it
    # (counting the chunk's causal pairs here took ~115 ms off each 512-token chunk SmolLM2's T(512) learned).
    assert p.attention_s([(512, 0)]) == 0.0
    assert p.attention_s([(512, 512), (1, 40)]) == pytest.approx(p.pair_s * (512 * (513 - TIMED_CONTEXT) + 41 - TIMED_CONTEXT))

    # prune(): a chain at acceptance 0.3 keeps its first nodes at a short context, none at a long one.
    tree = DraftTree(tuple(range(4)), (-1, 0, 1, 2), scores=(0.3, 0.09, 0.027, 0.008))
    kept = {}
    for r in (short, long):
        q = _policy(CHEAP_VERIFY, {1: 0.001}, acceptance=0.3)
        q.pair_s = p.pair_s
        kept[r.request_id] = len(q.prune([r], {r.request_id: tree}).get(r.request_id) or ())
        q.pair_s = 0.0
        assert len(q.prune([r], {r.request_id: tree})[r.request_id]) == 3  # as before, whatever the context
    assert kept == {"s": 3, "l": 0}
