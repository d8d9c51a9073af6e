"""Corpus n-gram tables (spec/corpus.py), lookahead drafting from them, and the policy's pricing
of drafts whose scores predict acceptance."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from specserve.config import SpecConfig
from specserve.errors import ConfigError
from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec.corpus import CorpusNgrams, load_corpus
from specserve.spec.lookahead import TRUST_PRIOR, LookaheadProposer
from specserve.spec.policy import (
    PROBE_EVERY,
    PROBE_SHARE,
    SCORE_EWMA,
    SCORE_PRIOR_WEIGHT,
    SpecPolicy,
    StepTimer,
)
from specserve.spec.tree import DraftTree


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams())


def test_table_backs_off_to_the_longest_context_seen_and_counts_shares():
    # "5 1 2" is followed by 3 three times; "1 2" by 3 three times and by 4 twice.
    docs = [[5, 1, 2, 3] * 3, [1, 2, 4, 0, 1, 2, 4]]
    table = CorpusNgrams.from_token_docs(docs, min_count=2)
    order, nxt = table.next_tokens([7, 5, 1, 2])
    assert order == 3 and nxt == [(3, 1.0)]
    order, nxt = table.next_tokens([9, 1, 2])  # "9 1 2" never occurred: back off to "1 2"
    assert order == 2 and nxt[0] == (3, pytest.approx(3 / 5)) and nxt[1] == (4, pytest.approx(2 / 5))
    assert table.next_tokens([42]) == (0, [])  # an unseen token
    assert table.num_tokens == 12 + 7


def test_table_drops_rare_continuations_but_keeps_their_share_of_the_total():
    docs = [[1, 2, 3, 1, 2, 3, 1, 2, 9]]  # "1 2" -> 3 twice, -> 9 once
    order, nxt = CorpusNgrams.from_token_docs(docs, min_count=2).next_tokens([0, 1, 2])
    assert order == 2 and nxt == [(3, pytest.approx(2 / 3))]  # 9 (seen once) dropped, still counted
    # An n-gram never spans two documents.
    table = CorpusNgrams.from_token_docs([[1, 2], [3, 4]], min_count=1)
    assert table.next_tokens([2]) == (0, [])


def test_corpus_is_built_once_and_loaded_after(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.py").write_text("for i in range(10):\n    print(i)\n" * 5)
    calls = []

    def encode(texts):
        calls.extend(texts)
        return [[ord(c) for c in text] for text in texts]

    cache = tmp_path / "cache"
    first = load_corpus(str(root), encode, "tok-a", cache)
    assert len(calls) == 1 and len(list(cache.glob("*.npz"))) == 1
    again = load_corpus(str(root), encode, "tok-a", cache)
    assert len(calls) == 1  # from the cache: nothing tokenized
    ctx = [ord(c) for c in "for i in ra"]
    assert again.next_tokens(ctx) == first.next_tokens(ctx) and first.next_tokens(ctx)[1][0][0] == ord("n")
    load_corpus(str(root), encode, "tok-b", cache)  # another tokenizer: its own table
    assert len(calls) == 2 and len(list(cache.glob("*.npz"))) == 2
    for f in cache.glob("*.npz"):  # a damaged table is built again, not trusted
        f.write_bytes(b"not a table")
    load_corpus(str(root), encode, "tok-a", cache)
    assert len(calls) == 3 and not list(cache.glob("*.tmp"))
    # The corpus changed: a new table replaces tok-a's old one (tok-b's stays).
    (root / "b.py").write_text("while True:\n    pass\n")
    load_corpus(str(root), encode, "tok-a", cache)
    assert len(calls) == 5 and len(list(cache.glob("*.npz"))) == 2


def test_a_corpus_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        SpecConfig(method="lookahead", lookahead_corpus=str(tmp_path / "missing"))
    assert SpecConfig(method="lookahead", lookahead_corpus="none").lookahead_corpus == "none"


def test_the_python_corpus_holds_the_stdlib_and_more():
    from specserve.spec.corpus import corpus_files

    stdlib = corpus_files("stdlib")
    python = corpus_files("python")
    assert set(stdlib) < set(python) and any("site-packages" in p.parts for p in python)
    assert python == sorted(python) or python[: len(stdlib)] == stdlib  # a fixed order either way


def test_lookahead_drafts_the_corpus_continuation_and_learns_whom_to_trust():
    corpus = CorpusNgrams.from_token_docs([[7, 8, 9, 10] * 4], min_count=2)
    prop = LookaheadProposer(window=2, ngram=3, corpus=corpus)
    r = _req("a", [1, 2, 3, 7, 8])
    prop.add_request(r)
    draft = prop.propose([r], [4])["a"]
    assert draft.main_path_tokens()[:2] == (9, 10)  # "7 8" -> 9 -> 10 from the corpus
    assert all(a >= b for a, b in zip(draft.scores, draft.scores[1:]))  # best first, parents first
    before = dict(prop.trust)
    r.append_output_tokens([9])  # the target went on with the corpus's guess
    prop.propose([r], [4])
    root = {s for s, onward in prop.trust if not onward}
    assert root == set(TRUST_PRIOR)
    assert prop.trust[("corpus3", False)] > before[("corpus3", False)] or prop.trust[("corpus2", False)] > before[("corpus2", False)]
    assert prop.trust[("window", False)] <= before[("window", False)]  # the window guessed the prompt's tail: wrong


def test_lookahead_without_a_corpus_or_in_chain_mode():
    r = _req("a", [4, 5, 6, 4, 5, 6, 4, 5])
    prop = LookaheadProposer(window=3, ngram=3)
    prop.add_request(r)
    draft = prop.propose([r], [6])["a"]
    assert draft.main_path_tokens()[0] == 6  # "4 5" occurred twice, followed by 6
    chain = LookaheadProposer(window=3, ngram=3, tree=False)
    chain.add_request(r)
    assert chain.propose([r], [6])["a"].is_chain


def _scored_policy(t1=0.020, t2=0.021, t3=0.022, t9=0.040):
    p = SpecPolicy(SpecConfig(method="lookahead", num_spec_tokens=4, max_draft_nodes=8),
                   draft_cost_is_per_token=False, trees=True, scored=True)
    p.target_time = StepTimer({1: t1, 2: t2, 3: t3, 9: t9})
    return p


def test_a_scored_proposer_drafts_every_step_and_prune_keeps_what_its_scores_pay_for():
    p = _scored_policy()
    reqs = [_req("a", [1, 2, 3])]
    assert p.choose(reqs) == [8]  # the full node budget: the nodes are priced in prune()
    tree = DraftTree((5, 6, 7, 8), (-1, 0, 0, 1), scores=(0.6, 0.3, 0.04, 0.01))
    kept = p.prune(reqs, {"a": tree})["a"]
    assert kept.token_ids == (5, 6)  # 0.04 does not pay for one more token of verify
    # A run of misses lowers the request's calibration, and with it what prune keeps.
    for _ in range(30):
        p.observe("a", 2, 0, predicted=0.9)
    assert p.stats("a").calibration(p.pooled.calibration(1.0)) < 0.2
    assert "a" not in p.prune(reqs, {"a": tree}) or len(p.prune(reqs, {"a": tree})["a"]) < 2
    # At a batch past off_batch nobody drafts.
    many = [_req(str(i), [1]) for i in range(p.config.off_batch)]
    assert not any(p.choose(many))


def test_calibration_starts_at_the_prior_and_follows_the_measured_ratio():
    p = _scored_policy()
    st = p.stats("a")
    assert st.calibration(1.0) == pytest.approx(1.0)
    for _ in range(200):
        p.observe("a", 4, 1, predicted=2.0)
    # steady state: accepted 1 / SCORE_EWMA against predicted 2 / SCORE_EWMA, shrunk towards the prior
    want = (1 / SCORE_EWMA + SCORE_PRIOR_WEIGHT) / (2 / SCORE_EWMA + SCORE_PRIOR_WEIGHT)
    assert st.calibration(1.0) == pytest.approx(want, abs=1e-3) and want < 0.6
    assert np.isclose(p.pooled.calibration(1.0), 0.5, atol=0.1)


def test_a_scored_draft_pays_for_the_host_work_a_speculative_step_adds():
    p = _scored_policy()
    reqs = [_req("a", [1, 2, 3])]
    tree = DraftTree((5, 6), (-1, 0), scores=(0.3, 0.1))
    assert len(p.prune(reqs, {"a": tree})["a"]) == 2
    p.verify_overhead_s = 0.010  # half a step of host work: 0.3 + 0.1 tokens do not pay for it
    assert "a" not in p.prune(reqs, {"a": tree})


def test_the_engine_learns_the_host_overhead_of_steps_with_drafts():
    from types import SimpleNamespace

    from specserve.engine.engine import HOST_WINDOW, LLMEngine
    from specserve.spec.policy import RecentMedian

    eng = SimpleNamespace(_host_s={False: RecentMedian(HOST_WINDOW), True: RecentMedian(HOST_WINDOW)},
                          policy=SimpleNamespace(verify_overhead_s=0.0))
    plain = SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=1, draft=None)])
    spec = SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=3, draft=object())])
    prompt = SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=40, draft=None)])
    LLMEngine._account_host_time(eng, plain, 0.001)
    LLMEngine._account_host_time(eng, prompt, 0.050)  # a prompt chunk teaches neither
    LLMEngine._account_host_time(eng, spec, 0.003)
    assert eng.policy.verify_overhead_s == pytest.approx(0.002)
    # A first-use cost or a collector pause in one verify does not set the overhead for the
    # steps after it (an EWMA from the first measurement read 60 ms as 3 ms for ~20 steps).
    LLMEngine._account_host_time(eng, spec, 0.060)
    LLMEngine._account_host_time(eng, spec, 0.0032)
    assert eng.policy.verify_overhead_s == pytest.approx(0.0022)
    for _ in range(HOST_WINDOW):  # and it follows a lasting change within the window
        LLMEngine._account_host_time(eng, spec, 0.005)
    assert eng.policy.verify_overhead_s == pytest.approx(0.004)


def test_a_scored_proposer_stops_drafting_where_its_yield_does_not_pay_and_probes():
    p = _scored_policy(t1=0.020, t2=0.0205, t3=0.021, t9=0.030)
    p.propose_s = 0.002  # a tenth of a step per request
    reqs = [_req("a", [1]), _req("b", [1])]
    for _ in range(40):
        p.observe("a", 3, 2, predicted=2.0, nodes=3)  # yields 2 tokens a step: pays
        p.observe_nothing_drafted("b")  # never yields
    ks = p.choose(reqs)
    assert ks[0] > 0 and ks[1] == 0
    # Its probes cost its proposal: one every ceil(propose_s / (PROBE_SHARE x its share of the step)).
    interval = math.ceil(p.propose_s / (PROBE_SHARE * p.target_time(2) / 2))
    assert 1 < interval < PROBE_EVERY
    for _ in range(interval - 2):
        assert p.choose(reqs)[1] == 0
    assert p.choose(reqs)[1] > 0  # the interval's last step held back probes
    assert p.choose(reqs)[1] == 0


def test_a_memory_phase_moves_the_read_bound_sizes_and_leaves_the_compute_bound_ones():
    """Measured on a 2-vCPU Zen 4 (Qwen 1.5B): T(1) went from 29-32 to 20-22 ms between memory
    phases while T(9), bound by the multiply-adds, stayed at 52-56. A phase seen in decode steps
    alone moves the read-bound part of the curve (with its shape), not the sizes past the knee."""
    t = StepTimer({1: 0.020, 3: 0.022, 9: 0.030})
    for _ in range(200):
        t.observe_scaled(1, 0.016)  # the memory got 20% faster; only decode steps ran
    assert t(1) == pytest.approx(0.016, rel=1e-3)
    assert t(3) / t(1) == pytest.approx(0.022 / 0.020, rel=0.03)  # up to the knee: the read, shape kept
    assert t(9) == pytest.approx(0.030, rel=1e-6)  # past it: the arithmetic, unmoved
    assert t.phase == pytest.approx(0.8, rel=1e-3)
    for _ in range(200):
        t.observe_scaled(9, 0.036)  # a compute-bound size measured slower: its own point, not the phase
    assert t(9) == pytest.approx(0.036, rel=1e-3) and t.phase == pytest.approx(0.8, rel=1e-3)
    t.observe_scaled(5, 0.025)  # a size not measured yet, bound by its arithmetic: its own point
    assert t.points[5] == 0.025
    t.calibrate({1: 0.020})  # a fresh profile: phase 1 again
    assert t.phase == 1.0 and t(1) == 0.020


def test_a_phase_fast_enough_to_meet_the_arithmetic_line_still_follows_the_machine_back():
    """A curve profiled in a slow patch (the first samples after loading, 8-minute run on the Zen 4):
    in the fast phase that followed, T(1) fell to where the arithmetic line below the knee lies.
    A one-token step there is explained by that line as well as by the read; the phase must still
    rise again with the steps once the memory slows down (it once stayed stuck at the floor)."""
    t = StepTimer({1: 41.6, 2: 37.6, 3: 41.2, 5: 42.6, 9: 65.8, 17: 110.5})  # ms
    for _ in range(300):
        t.observe_scaled(1, 20.0)
    assert t(1) == pytest.approx(21.1, rel=0.02)  # no lower than the line under the read
    for _ in range(300):
        t.observe_scaled(1, 30.0)
    assert t(1) == pytest.approx(30.0, rel=0.01)
    assert t(9) == pytest.approx(65.8, rel=1e-6)


def test_the_line_under_the_read_is_fitted_past_the_knee_not_drawn_through_its_first_two_points():
    """A start-up profile on the Zen 4 (Qwen 1.5B, ms): the two sizes just past the knee sit where
    the curve bends from the read to the arithmetic, 1.6 ms apart where the sizes after them are
    5-7. The line through those two alone put the arithmetic of one token at 36.7 ms, above the
    read: T(1) stayed at the profile's 36.2 while decode steps took 21-33, and a 5-token verify
    looked as dear as one decode step (it cost 1.5 of them). Fitted over the sizes up to twice
    the first past the knee, the line lies far below, and the phase moves T(1) again."""
    profile = {1: 36.2, 2: 31.53, 3: 33.9, 4: 36.1, 5: 36.67, 6: 38.76, 7: 46.46, 8: 48.08, 9: 55.5, 10: 62.92,
               11: 69.27, 12: 74.83, 13: 78.86, 14: 82.91, 15: 89.96, 16: 94.22, 17: 94.76, 32: 195.9, 64: 342.87}
    t = StepTimer(profile)
    for _ in range(300):
        t.observe_scaled(1, 22.0)  # a fast-memory phase, seen in decode steps
    assert t(1) == pytest.approx(22.0, rel=0.02)
    assert t(5) / t(1) > 1.4  # the arithmetic of 5 tokens (~34 ms measured in such phases) binds
    assert t(9) == pytest.approx(55.5, rel=1e-6)
    for _ in range(300):
        t.observe_scaled(1, 33.0)
    assert t(1) == pytest.approx(33.0, rel=0.02)


def test_no_step_reads_as_cheaper_than_one_token():
    """A profile whose one-token time caught a slow moment (36.2 ms against 31.5 for two): a step
    of more tokens reads the same weights, so it never looks cheaper than one (the policy would
    otherwise see a free draft token)."""
    t = StepTimer({1: 36.2, 2: 31.5, 3: 33.9, 5: 36.7, 9: 55.5, 17: 94.8})
    assert all(t(n) >= t(1) for n in (1, 1.5, 2, 2.5, 3, 4, 5, 9))


def test_one_token_steps_set_the_phase_even_among_many_larger_ones():
    """Lookahead's steps: one 1-token step per request (the first after its prompt) among 4-5
    token ones, whose arithmetic binds in a fast phase. The fast and slow curves measured on the
    Zen 4 (bench/results/phases_zen4_s43) alternate every 1,800 steps: T(1) is tracked within a few
    percent (the phase moved by every read-bound size was 9.5% off at the median step)."""
    slow = {1: 31.6, 2: 32.4, 3: 31.5, 4: 32.5, 5: 34.0, 6: 38.0, 7: 43.0, 8: 47.5, 9: 52.6, 10: 57.5, 17: 96.5}
    fast = {1: 24.9, 2: 25.5, 3: 29.6, 4: 32.0, 5: 34.4, 6: 40.0, 7: 45.0, 8: 51.0, 9: 56.6, 10: 62.0, 17: 107.0}
    mix = [1] + [4] * 28 + [5] * 19
    t = StepTimer(dict(slow))
    rng = random.Random(0)
    errors = []
    for step in range(12000):
        curve = fast if (step // 1800) % 2 else slow
        n = rng.choice(mix)
        t.observe_scaled(n, curve[n] * rng.uniform(0.95, 1.05))
        if step % 1800 >= 600:
            errors.append(abs(t(1) / curve[1] - 1))
    assert statistics.median(errors) < 0.05


def test_a_curve_without_a_knee_moves_as_a_whole():
    t = StepTimer({1: 0.010, 4: 0.0101, 16: 0.0105})  # a GPU's: flat far past the sizes measured
    for _ in range(200):
        t.observe_scaled(1, 0.008)
    for n in (1, 4, 16, 32):
        assert t(n) == pytest.approx(0.8 * StepTimer({1: 0.010, 4: 0.0101, 16: 0.0105})(n), rel=1e-3)


def test_the_step_timer_tracks_alternating_memory_phases_at_every_size():
    """Steps of mixed sizes on a machine whose memory alternates between a fast and a slow phase
    (truth: max(read, 5.1 ms a token + 5.4), the shape measured on the Zen 4): the curve stays
    within a few percent at sizes it sees rarely or never (7, 8, 10), where one factor for the
    whole curve was off by 8-15%."""
    measured = {1: 28.2, 2: 30.3, 3: 29.3, 4: 29.9, 5: 31.5, 6: 36.1, 7: 41.3, 8: 46.3, 9: 51.4, 10: 56.3, 16: 60.0}
    t = StepTimer({n: ms / 1e3 for n, ms in measured.items()})
    rng = random.Random(1)
    errors = []
    for step in range(3000):
        read = 21.0 if (step // 300) % 2 == 0 else 31.0

        def truth(n: int, read: float = read) -> float:
            return max(read, 5.1 * n + 5.4) / 1e3

        n = rng.choice([1, 1, 1, 2, 3, 4, 5, 6, 9])
        t.observe_scaled(n, truth(n) * rng.uniform(0.95, 1.05))
        if step % 300 >= 100:  # settled into the phase
            errors.append(max(abs(t(k) / truth(k) - 1) for k in range(1, 11)))
    assert statistics.median(errors) < 0.07
    assert max(errors) < 0.12


@pytest.mark.parametrize("start_phase, one_token_steps", [(0.6, True), (1.0, False), (0.6, False)])
def test_steps_bound_by_the_arithmetic_under_the_knee_leave_the_read_and_the_curve_rising(start_phase, one_token_steps):
    """Qwen 1.5B + 0.5B draft at batch 4 on the 2-vCPU Zen 4. (1) The saved profile's read (36 ms
    a token) was slower than the machine then (phase 0.55-0.6, 20-22 ms), where 4 tokens took
    30.5 ms of arithmetic. Learned as the read, a 4-token step a little slow raised T(4)'s point
    by 1 / phase, the knee moved below 4, and T(4) read 44.6 ms against T(5)'s 37.2: a draft
    token looked like it saved time, and the policy drafted where drafting lost (bench/spec.py
    batchsweep 0.93-0.94x plain in 2 of 4 runs). (2) A restore read the phase at 0.99 (36 ms)
    where steps of 1-4 tokens took 30, and at batch 4 no one-token step came to correct it: T(4)
    and T(5) both read as T(1), 35.6 ms, the fifth token free again. Here the truth is
    max(read, arithmetic) with that machine's arithmetic, the read alternating between its
    phases, steps of a batch of 3-4 with verifies of 5-8 (and, or not, a rare one-token step),
    5% noise and one step in ten 20% slow."""
    profile = {1: 36.0, 2: 32.2, 3: 31.9, 4: 32.4, 5: 37.2, 10: 73.1, 16: 107.4, 20: 128.0, 32: 210.6, 64: 430.0}
    arithmetic = {1: 18.0, 2: 24.0, 3: 29.5, 4: 30.5, 5: 38.0, 6: 43.0, 7: 47.0, 8: 52.5, 9: 58.0}
    t = StepTimer(profile)
    t.phase = start_phase  # as _restore_costs found the machine
    rng = random.Random(3)
    mix = [4] * 20 + [3] * 4 + [5, 6, 7, 8] + ([1] if one_token_steps else [])
    errors, margins = [], []
    for step in range(3000):
        read = (21.5, 30.0)[(step // 1000) % 2]

        def truth(n: int, read: float = read) -> float:
            return max(read, arithmetic[n])

        n = rng.choice(mix)
        t.observe_scaled(n, truth(n) * rng.uniform(0.95, 1.05) * (1.2 if rng.random() < 0.1 else 1.0))
        if step % 1000 >= 200:  # settled into the phase
            curve = [t(k) for k in range(1, 10)]
            assert all(b >= a for a, b in zip(curve, curve[1:])), (step, curve)
            errors.append(abs(t(4) / truth(4) - 1))
            margins.append((t(5) - t(4)) / (truth(5) - truth(4)))  # what one more token costs, against the truth
    assert statistics.median(errors) < 0.05 and max(errors) < 0.15
    assert min(margins) > 0.3 and statistics.median(margins) > 0.7


def test_a_size_no_longer_run_is_bounded_by_the_larger_steps_that_run():
    """Qwen 1.5B on the 2-vCPU Zen 4 (ms): batch 1 and 2 runs, their one-token steps in a fast
    phase of the one-row kernel (24 ms) while 2- and 3-token steps kept their 33, stored T(2) and
    T(3) against that phase; once one-token steps took 33 again they read 45 ms, and at batch 4,
    where no 2- or 3-token step runs, the curve's floor held T(4) and T(5) at 45 while 4-token
    steps took 33.5: a fifth token looked free and the policy drafted where it lost. The larger
    steps that run bound the sizes below them; the curve still never falls."""
    t = StepTimer({1: 34.0, 2: 33.4, 3: 34.0, 4: 37.2, 5: 37.0, 10: 63.1, 16: 99.0, 20: 127.8, 32: 195.1})
    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([1, 1, 2, 3])
        t.observe_scaled(n, (24.0 if n == 1 else 33.0) * rng.uniform(0.97, 1.03))
    for _ in range(300):
        t.observe_scaled(1, 33.0 * rng.uniform(0.97, 1.03))
    assert t(2) > 40.0  # the stale point (what the batch-4 steps below must correct)
    for _ in range(40):
        t.observe_scaled(4, 33.5 * rng.uniform(0.97, 1.03))
    assert t(4) == pytest.approx(33.5, rel=0.03)
    assert t(2) <= t(4) * 1.01 and t(3) <= t(4) * 1.01
    assert t(5) - t(4) > 1.0  # a fifth token costs again
    curve = [t(k) for k in range(1, 12)]
    assert all(b >= a for a, b in zip(curve, curve[1:]))


def test_a_noisy_near_flat_curve_reads_its_verifies_without_bias():
    """SmolLM2 135M on the 2-vCPU Zen 4: steps of 3-5 ms, 15% noise, a curve nearly flat to 4
    tokens, 60% one-token steps. Each larger step that noise took below the read's estimate
    lowered the phase, none raised it: T(1) read 1% fast and T(3) / T(1) 1.9% dear, and prompt
    lookup drafted 0.3-0.4 nodes a step where it had drafted 0.8. The median of the last larger
    steps bounds the phase instead."""
    truth = {1: 3.3, 2: 3.35, 3: 3.39, 4: 3.6, 5: 4.2, 6: 4.8, 7: 5.4, 8: 6.0, 9: 6.6, 16: 11.0, 32: 21.0, 64: 41.0}
    first, ratio = [], []
    for seed in range(8):
        rng = random.Random(seed)
        t = StepTimer({n: v * rng.uniform(0.9, 1.1) for n, v in truth.items()})  # a start-up profile
        for step in range(4000):
            n = 1 if rng.random() < 0.6 else rng.choice([2, 3, 3, 4, 5])
            t.observe_scaled(n, truth[n] * rng.uniform(0.85, 1.15))
            if step >= 500:
                first.append(t(1) / truth[1])
                ratio.append(t(3) / t(1) / (truth[3] / truth[1]))
    assert abs(statistics.median(first) - 1) < 0.005
    assert abs(statistics.median(ratio) - 1) < 0.012


def test_auto_adds_the_models_own_answers_where_they_exist(tmp_path):
    from specserve.spec.corpus import SELF_WEIGHT, corpus_files

    calls = []

    def encode(texts):
        calls.append(len(texts))
        return [[ord(c) for c in text[:2000]] for text in texts]

    own = tmp_path / "own.txt"
    stdlib = load_corpus("auto", encode, "tok", tmp_path / "cache", self_text=own)  # no answers yet: the stdlib
    n_stdlib = sum(calls)
    assert n_stdlib == len(corpus_files("stdlib"))
    own.write_text("☃♞ ☃♞ ☃♞ ☃♞", encoding="utf-8")  # characters the stdlib's first 2000 of a file lack
    both = load_corpus("auto", encode, "tok", tmp_path / "cache", self_text=own)
    assert sum(calls) == 2 * n_stdlib + SELF_WEIGHT  # a new table: the stdlib and the answers, weighted
    assert both.num_tokens == stdlib.num_tokens + SELF_WEIGHT * len("☃♞ ☃♞ ☃♞ ☃♞")
    assert both.next_tokens([ord("☃")])[1][0][0] == ord("♞")


def test_build_corpus_writes_the_models_answers(smollm_llm, tmp_path):
    from specserve.spec.corpus import self_text_path, write_self_text

    path = self_text_path("/models/x.gguf", root=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("x-") and path != self_text_path("/other/x.gguf", root=tmp_path)
    card = write_self_text(smollm_llm, path, num_asks=3, max_tokens=8)
    assert card["asks"] == 3 and 3 <= card["tokens"] <= 24
    assert path.read_text().strip() and not list(tmp_path.glob("*.tmp"))


def test_an_unreadable_corpus_file_is_skipped(tmp_path, monkeypatch):
    from pathlib import Path

    root = tmp_path / "corpus"
    root.mkdir()
    (root / "good.py").write_text("ab" * 20)
    (root / "bad.py").write_text("cd" * 20)
    real = Path.read_text

    def read_text(self, *a, **kw):
        if self.name == "bad.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", read_text)
    table = load_corpus(str(root), lambda texts: [[ord(c) for c in t] for t in texts], "tok", tmp_path / "cache")
    assert table.num_tokens == 40 and table.next_tokens([ord("a")])[1][0][0] == ord("b")


def test_build_corpus_refuses_an_empty_ask_count(capsys):
    from specserve.cli import main

    assert main(["build-corpus", "--model", "smollm2-135m-instruct", "--asks", "0"]) != 0
    assert "--asks" in capsys.readouterr().err


def test_the_start_up_summary_says_what_lookahead_drafts_from_and_how_to_add_the_models_answers(tmp_path):
    from specserve.spec.corpus import corpus_note

    table = CorpusNgrams.from_token_docs([[1, 2, 3, 1, 2, 4]])
    own = tmp_path / "m-abc.txt"
    missing = corpus_note("auto", table, own, "qwen2.5-coder-1.5b-instruct")
    assert missing.startswith("corpus: the stdlib only, 6 corpus tokens")
    assert "`specserve build-corpus --model qwen2.5-coder-1.5b-instruct`" in missing
    own.write_text("answers")
    assert corpus_note("auto", table, own, "m") == "corpus: the stdlib and the model's own answers, 6 corpus tokens"
    # A model without a file (a checkpoint given in memory) has no answers to add: no advice.
    assert corpus_note("auto", table, None, "m") == "corpus: the stdlib, 6 corpus tokens"
    assert corpus_note("python", table, None, "m") == "corpus python, 6 corpus tokens"
    assert corpus_note("none", None, None, "m") == "no corpus"


def test_lookahead_describes_its_corpus_beside_the_served_outputs():
    p = LookaheadProposer(corpus=None)
    assert p.describe() == ""
    p.corpus_note = "no corpus"
    assert p.describe() == "no corpus"


def test_step_timer_floor_bounds_every_larger_size_through_phases_and_noise():
    """StepTimer.floor(n) is at most the estimate at n and at every larger size (prune() stops
    where even that floor leaves no longer prefix a better rate), whatever the phase and however
    noisy the points; it is the estimate of a measured size just below n."""
    rng = random.Random(7)
    for _ in range(200):
        t1 = rng.uniform(0.002, 0.04)
        pts = {n: t1 * (1 + rng.uniform(-0.15, 0.15) + max(0, n - rng.choice([1, 3, 8])) * rng.uniform(0.02, 0.3))
               for n in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 33) if n == 1 or rng.random() < 0.7}
        t = StepTimer(pts)
        for _ in range(rng.randrange(0, 60)):
            n = rng.choice([1, 1, 2, 3, 5, 9, 17])
            t.observe_scaled(n, pts.get(n, t1) * rng.uniform(0.6, 1.6))
        sizes = [1 + i / 2 for i in range(80)]
        for i, n in enumerate(sizes):
            assert all(t.floor(n) <= t(m) * (1 + 1e-12) for m in sizes[i:])
        below = max((x for x in t.points if x < 5), default=None)
        if below is not None:
            assert t.floor(5) >= t(below) * (1 - 1e-12)
