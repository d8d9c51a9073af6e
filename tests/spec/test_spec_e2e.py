"""Speculative decoding end to end: exactness (greedy and sampled), jagged batches, KV hygiene."""

from __future__ import annotations

import gc
import math
import os
import random
import sys
import time
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import ConfigError, InvalidRequestError
from specserve.models.chat import render_chat

# ----------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=2)
    return ckpt


def _tiny_prompts(n=50, seed=0):
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.randint(3, 40)
        if i % 3 == 0:  # repetitive prompts give the n-gram proposer something to find
            base = [rng.randint(3, 255) for _ in range(rng.randint(2, 6))]
            p = (base * 20)[:length]
        else:
            p = [rng.randint(3, 255) for _ in range(length)]
        prompts.append(p)
    return prompts


def _llm(ckpt, method="none", policy="always", draft=None, **kw):
    return LLM("tiny", dtype="float32", checkpoint=ckpt, spec_method=method, spec_policy=policy,
               draft_checkpoint=draft, num_spec_tokens=kw.pop("k", 4), profile_spec_costs=False,
               max_num_seqs=kw.pop("max_num_seqs", 64), **kw)


def _greedy(n=20, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


PROPOSERS = ["ngram", "reference", "reference-chain", "lookahead", "draft-truncated", "draft-full", "draft-restricted",
             "draft-pmin", "eagle", "medusa", "mtp", "layerskip", "layerskip-chain", "copy-draft", "copy-eagle", "copy-auto",
             "join-eagle", "join-copy-draft"]
_HEADS: dict[tuple[int, str], str] = {}


def _head(ckpt, method: str) -> str:
    """A random EAGLE or Medusa head file for this tiny target (one per checkpoint per session)."""
    from conftest import make_head_file

    from specserve.testing import scratch_dir

    if (id(ckpt), method) not in _HEADS:
        path = f"{scratch_dir(method)}/head.safetensors"
        _HEADS[id(ckpt), method] = str(make_head_file(ckpt, path, method=method))
    return _HEADS[id(ckpt), method]


def _spec_llm(ckpt, which, policy="always", **kw):
    # The model drafters' variants test the drafter itself: no copier in front of it (the default
    # puts prompt lookup there; the copy-* variants test that pairing).
    kw.setdefault("spec_copy", "none")
    if which.startswith("join-"):  # lookahead's candidates joined into the drafter's trees
        kw["spec_join"] = "lookahead"
        return _spec_llm(ckpt, which[len("join-"):], policy, **kw)
    if which == "copy-draft":  # prompt lookup where a 2-token tail matches, the one-layer draft's trees elsewhere
        kw["spec_copy"] = "ngram"
        # From the request's own text only: 20,000 requests of one prompt would copy each other's
        # answers (kept after the prompt's tail) from their first step, and the draft would draft
        # too rarely for the test to mix the two kinds of draft in its batches.
        kw.setdefault("suffix_cache_requests", 0)
        return _spec_llm(ckpt, "draft-truncated", policy, spec_copy_min_match=2, **kw)
    if which == "copy-eagle":  # the reference where it matches, the EAGLE head's chains elsewhere
        kw["spec_copy"] = "reference"
        return _spec_llm(ckpt, "eagle-chain", policy, **kw)
    if which == "copy-auto":  # the default: the reference where there is one, else the context, else the draft
        kw["spec_copy"] = "auto"
        return _spec_llm(ckpt, "draft-truncated", policy, **kw)
    if which.startswith("draft"):
        layers = None if which == "draft-full" else 1
        if which == "draft-restricted":  # draft LM head over the lower half of the vocabulary only
            kw["draft_vocab_size"] = ckpt.arch.vocab_size // 2
        # The tiny random drafts are unsure of nearly everything: the default p_min would cut every
        # proposal to one token. "draft-pmin" sets one that makes proposals of every length.
        kw.setdefault("draft_p_min", 0.05 if which == "draft-pmin" else 0.0)
        # chains: the draft stops at an unsure token; the others grow trees
        kw.setdefault("spec_tree", "chain" if which in ("draft-full", "draft-pmin") else "tree")
        return _llm(ckpt, "draft", policy, draft=ckpt, draft_num_layers=layers, **kw)
    if which.startswith("reference"):
        kw.setdefault("spec_tree", "chain" if which == "reference-chain" else "tree")
        return _llm(ckpt, "reference", policy, **kw)
    if which.startswith("eagle"):
        kw.setdefault("spec_tree", "chain" if which == "eagle-chain" else "tree")
        kw.setdefault("draft_p_min", 0.0)  # a random head is unsure of everything
        return _llm(ckpt, "eagle", policy, draft_model=_head(ckpt, "eagle"), **kw)
    if which == "medusa":
        return _llm(ckpt, "medusa", policy, draft_model=_head(ckpt, "medusa"), **kw)
    if which == "mtp":
        kw.setdefault("draft_p_min", 0.0)
        return _llm(ckpt, "mtp", policy, draft_model=_head(ckpt, "mtp"), **kw)
    if which.startswith("layerskip"):  # the tiny target's first layer, its final norm and head
        kw.setdefault("spec_tree", "chain" if which == "layerskip-chain" else "tree")
        kw.setdefault("draft_p_min", 0.0)
        return _llm(ckpt, "layerskip", policy, **kw)
    return _llm(ckpt, which, policy, **kw)


def _params_for(which, prompt, baseline_out):
    if which.startswith(("reference", "copy-eagle", "copy-auto")):
        # Half the requests get their own future as the reference (long accepted runs), half a
        # shuffled copy (mostly rejected drafts).
        ref = list(prompt) + list(baseline_out)
        if len(prompt) % 2:
            random.Random(len(prompt)).shuffle(ref)
        return _greedy(reference_token_ids=ref)
    return _greedy()


@pytest.mark.parametrize("which", PROPOSERS)
def test_tiny_greedy_spec_equals_plain_batched_and_alone(tiny, which):
    prompts = _tiny_prompts()
    base = _llm(tiny).generate(prompts, _greedy())
    llm = _spec_llm(tiny, which)
    params = [_params_for(which, p, b.token_ids) for p, b in zip(prompts, base)]
    batched = llm.generate(prompts, params)
    for b, o in zip(base, batched):
        assert o.token_ids == b.token_ids
    outs = list(batched)
    for p, prm, b in list(zip(prompts, params, base))[::3]:
        outs.append(llm.generate([p], prm)[0])
        assert outs[-1].token_ids == b.token_ids
    eng = llm.engine
    assert eng.spec_counters["num_draft_tokens"] > 0, "nothing was speculated"
    if which in ("draft-full",):
        assert eng.spec_counters["num_accepted_tokens"] == eng.spec_counters["num_draft_tokens"]
    assert eng.check_integrity()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    if which.startswith(("draft", "eagle", "medusa", "mtp", "copy", "ngram", "join")):
        assert not eng.proposer.live_request_ids()
    if which.startswith(("draft", "eagle", "mtp", "copy", "join")):
        assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks
    if which.startswith("join"):  # lookahead added nodes to the drafter's trees
        assert eng.proposer.num_joined > 0 and eng.proposer.num_nodes_added > 0
    if which.startswith(("copy", "join-copy")):  # both sources drafted, and both kinds of draft were verified
        assert eng.proposer.num_copied > 0 and eng.proposer.num_modelled > 0
    if which == "copy-auto":
        assert [type(c).__name__ for c in eng.proposer.copier.copiers] == ["ReferenceProposer", "NgramProposer"]
    if which == "draft-restricted":  # the draft's head learned the ids of the upper half the requests used
        upper = tiny.arch.vocab_size // 2
        used = {t for p, o in zip(prompts, outs) for t in (*p, *o.token_ids) if t >= upper}
        head = eng.proposer.learning_head
        assert used and set(head.learned_ids.tolist()) == used
        # The tiny model's head is untied: kept whole for those rows, and counted as the draft's memory.
        whole = head.rows_data
        assert whole is not None and whole.shape[0] == tiny.arch.vocab_size
        assert eng.proposer.memory_bytes() >= whole.numel() * whole.element_size() + eng.proposer.runner.kv_cache_bytes


def test_a_join_under_the_adaptive_policy_drafts_with_the_helper_alone_where_the_drafter_is_held_back(tiny):
    """--spec-join under the adaptive policy: where the drafter's passes do not pay (a random
    head), lookahead's candidates are verified alone, for no draft pass; greedy output stays
    plain decoding's, batched and alone, and nothing leaks."""
    prompts = _tiny_prompts(24, seed=3)
    base = _llm(tiny).generate(prompts, _greedy())
    llm = _spec_llm(tiny, "join-eagle", policy="adaptive", max_num_seqs=8)
    got = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in got] == [o.token_ids for o in base]
    for p, b in list(zip(prompts, base))[::4]:
        assert llm.generate([p], _greedy())[0].token_ids == b.token_ids
    eng = llm.engine
    assert eng.proposer.num_helper_alone > 20 and eng.spec_counters["num_accepted_tokens"] > 0
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_while_the_rate_guard_holds_drafts_off_neither_copier_nor_policy_is_asked(tiny):
    """Where the guard holds speculation off at a batch size it would drop every draft, so the
    engine asks neither the copier (its matches) nor the cost model, only whether the text turned
    copyable (Proposer.copy_resumes: not here); once the retry is due both are asked again, and
    a held step whose text a copy carries ends the hold at once. Greedy output stays plain
    decoding's."""
    from specserve.spec import policy as P

    prompts = _tiny_prompts(6, seed=4)
    base = _llm(tiny).generate(prompts[:1], _greedy(30))
    llm = _spec_llm(tiny, "copy-eagle", policy="adaptive")
    eng = llm.engine
    asked = {"free": 0, "choose": 0}
    free, choose = eng.proposer.free_drafts, eng.policy.choose

    def count(name, f):
        def g(*a, **k):
            asked[name] += 1
            return f(*a, **k)
        return g

    eng.proposer.free_drafts, eng.policy.choose = count("free", free), count("choose", choose)
    resumes = []
    eng.proposer.copy_resumes = lambda reqs: resumes.append(len(reqs)) or False
    now = eng.policy.guard.clock()
    rid = eng.add_request(prompts[0], _greedy(30))  # (an arrival ends a hold: RateGuard.new_request)
    eng.policy.guard.rates[1] = P._Rates(held_since=now, retry_s=3600.0)  # then held at batch 1 for an hour
    final = {}
    while eng.has_unfinished_requests():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    assert final[rid].token_ids == base[0].token_ids
    assert asked == {"free": 0, "choose": 0} and eng.spec_counters["num_drafts"] == 0
    assert len(resumes) >= 25 and set(resumes) == {1}  # every held decode step asked, cheaply
    eng.policy.guard.rates[1].retry_s = 0.0  # the retry is due
    llm.generate(prompts[1:2], _greedy(30))
    assert asked["free"] > 0 and asked["choose"] > 0
    # Held again for an hour: a copyable text ends the hold (the trial drafts) within the request.
    asked.update(free=0, choose=0)
    eng.proposer.copy_resumes = lambda reqs: True
    rid = eng.add_request(prompts[2], _greedy(30))
    eng.policy.guard.rates[1] = P._Rates(held_since=eng.policy.guard.clock(), retry_s=3600.0)
    final = {}
    while eng.has_unfinished_requests():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    assert asked["free"] > 0 and asked["choose"] > 0 and eng.policy.guard.rates[1].trial_left == 0
    assert final[rid].token_ids == _llm(tiny).generate(prompts[2:3], _greedy(30))[0].token_ids
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_a_learning_draft_head_forgets_aborted_and_finished_requests(tiny):
    """The restricted draft head counts a request's prompt on arrival and its answer as drafting
    reaches it; an abort mid-answer or a finish leaves no request counted, and the others' outputs
    stay plain's."""
    prompts = [p for p in _tiny_prompts(12, seed=4) if any(t >= tiny.arch.vocab_size // 2 for t in p)][:6]
    base = _llm(tiny).generate(prompts, _greedy(24))
    llm = _spec_llm(tiny, "draft-restricted")
    eng = llm.engine
    head = eng.proposer.learning_head
    assert eng.proposer.describe().endswith(f"-token head learning up to {len(head.rows_buf):,} more ids from the requests")
    rids = [eng.add_request(p, _greedy(24)) for p in prompts]
    upper = tiny.arch.vocab_size // 2
    assert set(head.learned_ids.tolist()) == {t for p in prompts for t in p if t >= upper}  # prompts on arrival
    final = {}
    for _ in range(3):
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    assert rids[0] not in final and rids[0] in eng.proposer._counted  # mid-answer
    eng.abort_request(rids[0])
    while eng.has_unfinished_requests():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    for rid, b in zip(rids[1:], base[1:]):
        assert final[rid].token_ids == b.token_ids
    assert eng.proposer._counted == {} and not eng.proposer.live_request_ids() and eng.check_integrity()


def test_draft_stops_after_the_first_token_it_is_unsure_of():
    """draft_p_min: every proposed token but the last has draft probability >= p_min, and a
    proposal shorter than K ends with the token that fell below it."""
    from collections import Counter

    from conftest import tiny_checkpoint

    from specserve.request import Request

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    p_min = 0.1
    llm = _llm(ckpt, "draft", draft=ckpt, draft_num_layers=1, k=4, draft_p_min=p_min, spec_tree="chain", spec_copy="none")
    prop = llm.engine.proposer
    # Unseeded: each request draws its own chain (a seeded one is offered the draft's likeliest tokens).
    reqs = [Request(str(i), [1, 5, 7, 5, 7, 5], SamplingParams(temperature=1.0, max_tokens=8)) for i in range(64)]
    out = prop.propose(reqs, [4] * len(reqs))
    lengths = Counter()
    for r in reqs:
        d = out[r.request_id]
        q = [float(d.dists[d.dist_row[j], t]) for j, t in enumerate(d.token_ids)]
        assert all(x >= p_min for x in q[:-1]), q
        assert len(q) == 4 or q[-1] < p_min, q
        lengths[len(q)] += 1
    assert lengths[1] and lengths[4] and len(lengths) >= 3, lengths
    for r in reqs:
        prop.remove_request(r.request_id)
    assert prop.check_integrity() and prop.kv.num_free_blocks == prop.kv.num_blocks


def test_adaptive_policy_learns_the_draft_cost_without_the_catch_up_pass(tiny):
    """The draft's first pass of a step also catches it up (on the prompt, or on tokens made
    while drafting was off). That one-off cost must not enter the per-position draft cost, or
    the policy concludes drafting is slow and switches it off for good."""
    import time

    from specserve.spec.policy import StepTimer

    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="draft", spec_policy="adaptive",
              draft_checkpoint=tiny, draft_num_layers=1, num_spec_tokens=3)
    # A target step as slow as a real model's: whether drafting pays must not hang on how this
    # machine timed two passes of a tiny model at start-up (both mostly Python overhead, and
    # close enough that noise sometimes switched drafting off from the first step).
    llm.engine.policy.target_time = StepTimer({1: 0.05, 16: 0.05})
    prop = llm.engine.proposer
    real = prop.runner.forward_logits

    def slow_catch_up(inputs):
        if inputs.input_ids.numel() > 2:  # a catch-up pass (one request at a time here)
            time.sleep(1.0)
        return real(inputs)

    prop.runner.forward_logits = slow_catch_up
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    for _ in range(2):
        llm.generate([prompt], _greedy(24))
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    # dividing a proposal's time by K would have folded 1.0 / 3 s (at EWMA weight 0.15, >= 0.05)
    # into the estimate; a pass of this tiny model takes milliseconds
    assert max(llm.engine.policy.draft_time.points.values()) < 0.02


def test_the_rate_guard_is_told_each_drafting_step_without_the_catch_up_the_cost_model_charged(tiny):
    """A catch-up (the drafter feeding a request's prompt, or what it fell behind while drafts
    were held) is paid once, and the cost model weighed it, spread over the steps the request
    has left, when it chose to draft. The rate guard judges the rate of drafting from then on:
    it is told each step's seconds less the catch-up at the cost model's price, so one slow
    catch-up among a few steps no longer reads as drafting that loses to plain decoding."""
    import time

    from specserve.spec.policy import CATCHUP_FREE, StepTimer

    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="draft", spec_policy="adaptive",
              draft_checkpoint=tiny, draft_num_layers=1, num_spec_tokens=3)
    eng = llm.engine
    eng.policy.target_time = StepTimer({1: 0.05, 16: 0.05})  # drafting pays (see the test above)
    eng.policy.catchup_s_per_token = per_token = 0.02
    prop = eng.proposer
    real = prop.runner.forward_logits

    def priced_catch_up(inputs):  # a catch-up pass costs what the cost model charges for it
        if inputs.input_ids.numel() > CATCHUP_FREE:
            time.sleep(per_token * (inputs.input_ids.numel() - CATCHUP_FREE))
        return real(inputs)

    prop.runner.forward_logits = priced_catch_up
    told = []
    observe = eng.policy.guard.observe

    def spy(batch, tokens, seconds, speculated):
        told.append((seconds, speculated))
        observe(batch, tokens, seconds, speculated)

    eng.policy.guard.observe = spy
    prompt = list(range(5, 25))  # 20 tokens: the first drafting step catches up on ~21 (0.38 s)
    out = llm.generate([prompt], _greedy(24))[0]
    assert eng.spec_counters["num_draft_tokens"] > 0 and eng.spec_counters["draft_time_s"] > 0.3
    drafting = [s for s, spec in told if spec]
    assert drafting and max(drafting) < 0.15, drafting  # a step of the tiny model takes milliseconds
    plain = _llm(tiny).generate([prompt], _greedy(24))[0]
    assert out.token_ids == plain.token_ids


def test_the_cost_model_learns_drafting_time_from_each_step_without_a_catch_up(tiny):
    """Each drafting step tells the policy what its drafting took (observe_drafting), against
    which the cost model scales its predicted drafting at that batch size, except a step that
    also caught the drafter up (its cost is the catch-up estimate's, not drafting's)."""
    from specserve.spec.policy import CATCHUP_FREE, StepTimer

    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="draft", spec_policy="adaptive",
              draft_checkpoint=tiny, draft_num_layers=1, num_spec_tokens=3)
    eng = llm.engine
    eng.policy.target_time = StepTimer({1: 0.05, 16: 0.05})  # drafting pays (see above)
    eng.policy.catchup_s_per_token = 0.02
    # A prediction far below any real pass (10 us), so that every measured ratio is above it: at
    # 1 ms a machine's ratios fell on both sides of the window's prior 1.0s and the median stayed 1.0.
    eng.policy.draft_time = StepTimer({1: 1e-5})
    told, proposals = [], []
    observe, propose = eng.policy.observe_drafting, eng.proposer.propose

    def spy(seconds):
        told.append((seconds, eng._cycle_catchup_s, eng.policy._draft_predicted))
        observe(seconds)

    def count(requests, ks):  # whether the proposal catches the drafter up
        proposals.append(any(k and eng.proposer.catchup_tokens(r) > CATCHUP_FREE for r, k in zip(requests, ks)))
        return propose(requests, ks)

    eng.policy.observe_drafting, eng.proposer.propose = spy, count
    prompt = list(range(5, 25))
    out = llm.generate([prompt], _greedy(24))[0]
    assert len(proposals) >= 4 and proposals[0]  # the first catches up on the prompt
    assert len(told) == proposals.count(False)
    assert all(s > 0 and catch == 0 and pred is not None and pred[1] > 0 for s, catch, pred in told)
    assert list(eng.policy.draft_scales()) == [1] and eng.policy.draft_scale(1) > 1.0
    assert out.token_ids == _llm(tiny).generate([prompt], _greedy(24))[0].token_ids


def test_draft_catch_up_is_measured_and_counted_per_request(tiny):
    """The policy charges a draft model's catch-up: start-up measures its cost per token, and the
    proposer says how far its cache is behind each request (the prompt less what its prefix
    cache holds before the first draft, a token or two while drafting every step)."""
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="draft", spec_policy="always",
              draft_checkpoint=tiny, draft_num_layers=1, num_spec_tokens=3, block_size=16)
    eng, prop = llm.engine, llm.engine.proposer
    eng.profile_costs(max_batch=2)  # what policy "adaptive" does at start-up
    assert eng.policy.catchup_s_per_token > 0
    prompt = list(range(5, 45))  # 40 tokens
    eng.add_request(prompt, _greedy(12), request_id="a")
    req = eng.scheduler.requests["a"]
    assert prop.catchup_tokens(req) == 40
    behind = []
    while eng.has_unfinished_requests():
        eng.step()
        if "a" in eng.scheduler.requests and req.num_output_tokens:
            behind.append(prop.catchup_tokens(req))
    # Drafts are proposed at the start of a step: after the prefill step the draft has yet to see
    # the prompt and the first token; from the first decode step on (policy always: drafting every
    # step) it is never far behind.
    assert behind and behind[0] == 41 and max(behind[1:]) <= 3, behind
    # A second request with the same prompt finds two full blocks in the draft's prefix cache.
    eng.add_request(prompt, _greedy(4), request_id="b")
    assert prop.catchup_tokens(eng.scheduler.requests["b"]) == 40 - 32
    while eng.has_unfinished_requests():
        eng.step()
    assert prop.live_request_ids() == [] and not prop._cached and prop.check_integrity()


@pytest.mark.parametrize(("which", "draft_quant"), [("ngram", None), ("draft-truncated", "int8"),
                                                    ("draft-truncated", "w8a8")])
def test_tiny_quantized_greedy_spec_equals_quantized_plain(tiny, which, draft_quant):
    """Speculation stays exact on the int8 target path, whatever the draft's quantization.

    The W8A8 draft quantizes activations per call (its numbers depend on the batch); that may
    only change which drafts are proposed, never the emitted tokens.
    """
    prompts = _tiny_prompts(24)
    base = _llm(tiny, quantization="int8").generate(prompts, _greedy())
    kw = {"draft_quantization": draft_quant} if draft_quant else {}
    llm = _spec_llm(tiny, which, quantization="int8", **kw)
    assert llm.engine.runner.linear_backend == "int8"
    if which.startswith("draft"):
        assert llm.engine.proposer.runner.linear_backend == draft_quant
    outs = llm.generate(prompts, [_params_for(which, p, b.token_ids) for p, b in zip(prompts, base)])
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.engine.spec_counters["num_accepted_tokens"] > 0
    assert llm.engine.check_integrity()


@pytest.mark.parametrize("which", ["ngram", "draft-truncated"])
def test_tiny_int8_kv_greedy_spec_equals_int8_kv_plain(tiny, which):
    """Rollback and verification stay exact on an int8 KV cache (target and draft caches)."""
    prompts = _tiny_prompts(24)
    base = _llm(tiny, kv_cache_dtype="int8").generate(prompts, _greedy())
    llm = _spec_llm(tiny, which, kv_cache_dtype="int8")
    outs = llm.generate(prompts, [_params_for(which, p, b.token_ids) for p, b in zip(prompts, base)])
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.engine.spec_counters["num_accepted_tokens"] > 0
    assert llm.engine.check_integrity()


def _tv_permutation_test(a: np.ndarray, b: np.ndarray, n_perm: int = 2000, seed: int = 0) -> tuple[float, float]:
    """TV distance between the empirical distributions of two samples and its permutation p-value
    (n_perm shuffles: the smallest p-value it can give is 1 / (n_perm + 1), so at 2,000 a test
    at 1e-3 can fail; at the 200 it had, it never could)."""
    keys, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
    n = len(a)

    def tv(labels: np.ndarray) -> float:
        cx = np.bincount(labels[:n], minlength=len(keys)) / n
        cy = np.bincount(labels[n:], minlength=len(keys)) / (len(labels) - n)
        return 0.5 * np.abs(cx - cy).sum()

    observed = tv(inv)
    rng = np.random.default_rng(seed)
    pooled = inv.copy()
    null = np.empty(n_perm)
    for i in range(n_perm):
        rng.shuffle(pooled)
        null[i] = tv(pooled)
    p = (1 + int((null >= observed).sum())) / (1 + n_perm)
    return observed, p


_PLAIN_SAMPLE: dict[str, list] = {}


def _assert_same_distribution(base, spec, vocab=12):
    """The joint distribution of the outputs (a permutation test, above), each position's and each
    neighbouring pair's (chi-square tests of homogeneity; before, a permutation test of 100
    shuffles per position, whose p-value is never below 1/101, so it could not fail)."""
    from scipy.stats import chi2_contingency

    enc = lambda outs: np.array([sum(t * vocab**i for i, t in enumerate(o.token_ids)) for o in outs])  # noqa: E731
    tv, p = _tv_permutation_test(enc(base), enc(spec))
    assert p > 1e-3, f"TV={tv:.4f}, permutation p={p:.4f}"
    length = len(base[0].token_ids)
    # Each position, and each pair of neighbours (where a verify step's tokens depend on each other).
    for span in [(pos,) for pos in range(length)] + [(pos, pos + 1) for pos in range(length - 1)]:
        code = lambda o: sum(o.token_ids[i] * vocab**j for j, i in enumerate(span))  # noqa: B023, E731
        a = np.bincount([code(o) for o in base], minlength=vocab ** len(span))
        b = np.bincount([code(o) for o in spec], minlength=vocab ** len(span))
        seen = (a + b) > 0
        p_span = chi2_contingency(np.stack([a[seen], b[seen]]))[1] if seen.sum() > 1 else 1.0
        assert p_span > 1e-3, f"positions {span}: chi-square p={p_span:.2e}"


@pytest.mark.parametrize("which", [
    # The quick tier keeps a model drafter's drawn chains (layer-skip; a model drafter's trees
    # hold its likeliest tokens, spec.tree.drafts_ranked, and the tiny layer-skip drafts too
    # rarely for its ranked trees to pass the 1000-accepted guard: 923 of 20,000 requests);
    # seeded sampled tokens are tested equal to plain sampling's (test_seeded_sampling_emits_...).
    # copy-draft: copied (one-hot) and drafted (the draft's ranked trees) drafts in one batch.
    # join-copy-draft: the copies joined by lookahead's candidates, verified as deterministic trees
    # beside the draft's own.
    "layerskip-chain", "copy-draft", "join-copy-draft", *(pytest.param(w, marks=pytest.mark.slow)
                   for w in ("ngram", "draft-truncated", "lookahead", "draft-restricted", "draft-pmin", "eagle",
                             "medusa", "mtp")),
])
def test_tiny_sampled_distribution_matches(which):
    """First 4 generated tokens with speculation vs without: same joint distribution.

    Threshold: a permutation test on the total-variation distance between the two empirical
    joint distributions (20k samples each). Under the null (both samplers exact) relabelled
    samples are exchangeable, so the p-value is uniform; we fail only below 1e-3 (a real bias
    of a few percent TV is detected at p ~ 0), i.e. the noise level is measured, not guessed.
    The restricted draft can only propose tokens 0..5 while the target also emits 6..11: the
    residual distribution must restore exactly that mass. With draft-pmin the number of drafts
    depends on the draft's own draws (it stops after one it gave p < p_min): still exact.
    """
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    n = 20_000
    prompt = [1, 5, 7, 5, 7, 5]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    big = dict(max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    # The plain sample is the same for every proposer: drawn once (each test stays a two-sample
    # test of its own speculative sample against it).
    if "base" not in _PLAIN_SAMPLE:
        _PLAIN_SAMPLE["base"] = _llm(ckpt, **big).generate([prompt] * n, params, use_tqdm=False)
    base = _PLAIN_SAMPLE["base"]
    spec_llm = _spec_llm(ckpt, which, **big)
    spec = spec_llm.generate([prompt] * n, params, use_tqdm=False)
    counters = spec_llm.engine.spec_counters
    assert counters["num_accepted_tokens"] > 1000
    if which.startswith(("copy", "join-copy")):
        assert spec_llm.engine.proposer.num_copied > 1000 and spec_llm.engine.proposer.num_modelled > 1000
    if which.startswith("join"):
        assert spec_llm.engine.proposer.num_joined > 1000
    if which == "draft-pmin":  # proposals of several lengths, not all cut to one token
        assert 1.2 < counters["num_draft_tokens"] / counters["num_drafts"] < 3.0
    _assert_same_distribution(base, spec)


@pytest.mark.parametrize("which", ["draft-truncated", "draft-full", "eagle", "eagle-chain", "medusa", "mtp", "layerskip",
                                   "layerskip-chain"])
def test_model_drafters_offer_sampled_trees_their_likeliest_tokens(tiny, which):
    """A sampled request's model-drafted tree holds deterministic candidates (spec.tree.drafts_ranked):
    drawn siblings are exact only if whether one is verified does not depend on the sibling
    itself, and the node budget and pruning keep the best path probabilities (a Medusa tree of
    drawn siblings, cut so, emitted a biased second token: chi-square p = 9e-14 over 100,000
    requests). An unseeded chain keeps its drawn tokens; a seeded one is ranked too."""
    from specserve.spec.tree import SiblingDraw

    llm = _spec_llm(tiny, which)
    drafts = []
    execute = llm.engine.runner.execute

    def spy(so):
        drafts.extend((sr.draft, sr.sampling_params.seed) for sr in so.scheduled if sr.draft is not None)
        return execute(so)

    llm.engine.runner.execute = spy
    prompts = _tiny_prompts(16, seed=12)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, ignore_eos=True, seed=i if i % 4 == 0 else None)
              for i in range(len(prompts))]
    llm.generate(prompts, params)
    branched = [d for d, _ in drafts if any(len(c) > 1 for c in d.children)]
    assert all(d.draw is SiblingDraw.DETERMINISTIC for d in branched)
    assert all(d.draw is SiblingDraw.DETERMINISTIC for d, seed in drafts if seed is not None)
    if which in ("draft-full", "eagle-chain", "layerskip-chain"):
        assert any(d.draw is not SiblingDraw.DETERMINISTIC for d, seed in drafts if seed is None)
    else:
        assert branched, "no tree branched: the test would be vacuous"


@pytest.mark.parametrize("which,tree", [("draft-truncated", "tree"), ("draft-truncated", "chain")])
def test_seeded_sampled_speculation_draws_from_the_target_distribution(which, tree):
    """Seeded requests (each its own seed) with a model drafter: the same joint distribution as
    plain sampling, over 20,000 seeds. (Before model drafters offered seeded requests their
    likeliest tokens, such requests drew accept coins and recovery draws from generators keyed by
    (seed + stream, position); torch's CPU generator kept only 32 bits of that key, so the draws
    were one number and a rejected draft's recovery came from the top of the residual
    distribution: position 1, chi-square p = 0 for chains and 6e-24 for trees.)"""
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    n = 20_000
    prompt = [1, 5, 7, 5, 7, 5]
    big = dict(max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]
    if "base" not in _PLAIN_SAMPLE:
        _PLAIN_SAMPLE["base"] = _llm(ckpt, **big).generate(
            [prompt] * n, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True), use_tqdm=False)
    spec_llm = _spec_llm(ckpt, which, spec_tree=tree, **big)
    spec = spec_llm.generate([prompt] * n, params, use_tqdm=False)
    c = spec_llm.engine.spec_counters
    assert 1000 < c["num_accepted_tokens"] < c["num_draft_tokens"] - 1000  # many accepted, many rejected
    _assert_same_distribution(_PLAIN_SAMPLE["base"], spec)


@pytest.mark.parametrize("which", ["ngram", "draft-truncated", "eagle"])
def test_logit_bias_bans_and_forces_tokens_and_greedy_speculation_stays_exact(tiny, which):
    """logit_bias is added to every row a request samples or verifies from: -100 bans a token,
    +100 forces one, and speculative greedy output equals plain greedy output under the same bias."""
    prompts = _tiny_prompts(24, seed=4)
    plain = _llm(tiny)
    base = plain.generate(prompts, _greedy())
    banned = [_greedy(logit_bias={o.token_ids[0]: -100.0, o.token_ids[1]: -100.0}) for o in base]
    want = plain.generate(prompts, banned)
    for b, w, prm in zip(base, want, banned):
        assert w.token_ids[0] != b.token_ids[0]
        assert not set(w.token_ids) & set(prm.logit_bias)
    forced = plain.generate(prompts[:3], _greedy(logit_bias={9: 100.0}))
    assert all(o.token_ids == [9] * len(o.token_ids) for o in forced)
    llm = _spec_llm(tiny, which)
    got = llm.generate(prompts, banned)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0, "nothing was speculated"
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate(prompts[:1], _greedy(logit_bias={256: 1.0}))


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_drafts_follow_logit_bias_and_min_tokens(tiny, tree):
    """A drafter gets the request's logit_bias and min_tokens ban on its own rows, so it does not
    propose what the target bans: the target drafting for itself has every chain draft accepted
    (before: 146 of 1669 tree nodes accepted against 318 of 666 now)."""
    prompts = _tiny_prompts(24, seed=4)
    base = _llm(tiny).generate(prompts, _greedy())
    params = [_greedy(20, logit_bias={o.token_ids[0]: -100.0, o.token_ids[2]: 100.0 if i % 2 else -100.0},
                      stop_token_ids=[o.token_ids[1]], min_tokens=8) for i, o in enumerate(base)]
    want = _llm(tiny).generate(prompts, params)
    llm = _spec_llm(tiny, "draft-full", spec_tree=tree)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    eng = llm.engine
    c = eng.spec_counters
    if tree == "chain":
        assert c["num_accepted_tokens"] == c["num_draft_tokens"] > 0
    else:
        # Side branches are the alternatives, always rejected; the main path is the target's own
        # choice: by depth, every step that reached a depth accepted its node there (save where a
        # stop, min_tokens or max_tokens ended the request on it).
        reached, accepted = sum(eng.drafted_per_position), sum(eng.accepted_per_position)
        assert accepted >= 0.9 * reached > 0


@pytest.mark.parametrize("which", ["ngram", "lookahead", "reference", "reference-chain", "draft-truncated", "draft-full",
                                   "draft-pmin", "eagle", "medusa", "mtp", "layerskip", "layerskip-chain",
                                   "copy-draft", "join-copy-draft"])
def test_seeded_sampling_emits_the_plain_text_with_every_proposer(tiny, which):
    """Candidates without a draft distribution are verified by coupling to the plain draw: proposers
    that have none (prompt lookup, lookahead, reference text), and model drafters for seeded
    requests, which they offer their likeliest tokens (spec.tree.drafts_ranked). So a seeded sampled
    request emits exactly what decoding without speculation emits: its text does not depend on
    whether, what or with which drafter the (timing-driven) adaptive policy drafted."""
    prompts = _tiny_prompts(24, seed=11)
    plain = [SamplingParams(max_tokens=16, temperature=0.5, top_p=0.95, top_k=40 if i % 2 else 0, seed=300 + i,
                            ignore_eos=True) for i in range(len(prompts))]
    want = _llm(tiny).generate(prompts, plain)
    params = plain
    if which.startswith("reference"):  # every other request gets its own future as the reference
        params = [replace(p, reference_token_ids=list(pr) + (list(w.token_ids) if i % 2 else []))
                  for i, (p, pr, w) in enumerate(zip(plain, prompts, want))]
    llm = _spec_llm(tiny, which)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in llm.generate(prompts[:3], params[:3])] == [o.token_ids for o in want[:3]]  # alone
    eng = llm.engine
    assert eng.spec_counters["num_accepted_tokens"] > 0, "nothing was accepted: the test would be vacuous"
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def _copy_spliced_outputs(tiny, which, prompts, params, splice, proposed=None):
    """Copied drafts against plain decoding: the text a copier copies (the reference, or for
    prompt lookup the prompt) is each plain output with `splice(i, token)`'s ids after its i-th
    token. Returns the speculative engine, its outputs, plain decoding's and every verified draft
    (and the proposer's drafts, before the engine's cuts, in `proposed` when given)."""
    want = _llm(tiny).generate(prompts, params)
    spliced = [[x for i, t in enumerate(o.token_ids) for x in [t, *splice(i, t)]] for o in want]
    if which == "ngram":  # the output copies its prompt: the spliced text goes there
        prompts = [list(p) + ref for p, ref in zip(prompts, spliced)]
        want = _llm(tiny).generate(prompts, params)
    else:
        params = [replace(params[0], reference_token_ids=ref) for ref in spliced]
    llm = _spec_llm(tiny, which)
    verified: list = []
    verify = llm.engine.runner._sample_and_verify

    def record(out, logits):  # noqa: ANN001, ANN202
        verified.extend(sr.draft for sr in out.scheduled if sr.draft is not None)
        return verify(out, logits)

    llm.engine.runner._sample_and_verify = record
    if proposed is not None:
        propose = llm.engine.proposer.propose

        def keep(requests, num_tokens):  # noqa: ANN001, ANN202
            out = propose(requests, num_tokens)
            proposed.extend(out.values())
            return out

        llm.engine.proposer.propose = keep
    return llm, llm.generate(prompts, params), want, verified


@pytest.mark.parametrize("which", ["reference", "reference-chain", "ngram"])
def test_copied_drafts_leave_out_what_the_request_bans(tiny, which):
    """Model-free proposers copy text without reading the request: a copied token with logit_bias
    -100, or an ending id before min_tokens, is cut from the draft with what follows it (the target
    would reject it). The reference (and for prompt lookup the prompt) is the output itself with a
    banned and an ending id spliced in every few tokens."""
    ban, stop = 7, 11
    params = [_greedy(24, logit_bias={ban: -100.0}, stop_token_ids=[stop], min_tokens=24)] * 12
    _, got, want, verified = _copy_spliced_outputs(
        tiny, which, _tiny_prompts(12, seed=6), params, lambda i, _: [ban if i % 6 == 2 else stop] if i % 3 == 2 else [])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(len(d) for d in verified) >= 50, "the proposer drafted too little for the test to mean anything"
    assert not any(t in (ban, stop) for d in verified for t in d.token_ids)


@pytest.mark.parametrize("which", ["reference", "ngram"])
def test_copied_drafts_hold_no_ending_token(tiny, which):
    """A copy of text holding a stop id goes on past it in the text, but an accepted stop id ends
    the output and adds no token its parent's row would not draw: verified drafts hold neither
    the stop node nor anything below it, the copier still drafts (prompt lookup from another
    occurrence of a shorter tail), and outputs equal plain decoding's (with the stop id an
    output may end on)."""
    stop = 11
    params = [_greedy(24, stop_token_ids=[stop])] * 12
    proposed: list = []
    llm, got, want, verified = _copy_spliced_outputs(
        tiny, which, _tiny_prompts(12, seed=8), params, lambda i, _: [stop] if i % 4 == 3 else [], proposed)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(len(d) for d in verified) >= 50, "the proposer drafted too little for the test to mean anything"
    if which == "reference":  # prompt lookup leaves out such occurrences itself
        assert any(stop in d.token_ids for d in proposed), "no draft held the stop id: the test would be vacuous"
    assert not any(stop in d.token_ids for d in verified)
    assert llm.engine.check_integrity()


@pytest.mark.slow
def test_logit_bias_sampled_distribution_matches_under_speculation():
    """With temperature, a biased request's first tokens have the same joint distribution with
    and without speculation (permutation test as above), and the bias moved them."""
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    n = 20_000
    prompt = [1, 5, 7, 5, 7, 5]
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, logit_bias={3: 2.0, 7: -100.0})
    big = dict(max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    base = _llm(ckpt, **big).generate([prompt] * n, params, use_tqdm=False)
    unbiased = _llm(ckpt, **big).generate([prompt] * 2000, replace(params, logit_bias=None), use_tqdm=False)
    spec_llm = _spec_llm(ckpt, "draft-truncated", **big)
    spec = spec_llm.generate([prompt] * n, params, use_tqdm=False)
    assert spec_llm.engine.spec_counters["num_accepted_tokens"] > 1000
    assert not any(7 in o.token_ids for o in base + spec)
    share = lambda outs: np.mean([o.token_ids[0] == 3 for o in outs])  # noqa: E731
    assert share(base) > share(unbiased) + 0.1
    _assert_same_distribution(base, spec)


@pytest.mark.parametrize("which", [None, "draft-full", "ngram"])
def test_logprobs_are_raw_unless_processed_is_asked_for(tiny, which):
    """Generated tokens' logprobs are of the model's own distribution (vLLM's default raw_logprobs),
    also under logit_bias, penalties, min_tokens and speculation: a token the bias forces keeps its
    raw logprob and the top logprobs are the raw likeliest. logprobs_mode="processed" gives the
    distribution after the processors (the forced token near logprob 0)."""
    prompts = _tiny_prompts(6, seed=8)
    firsts = [dict(o.outputs[0].top_logprobs[0])  # the 20 likeliest first tokens
              for o in _llm(tiny).generate(prompts, _greedy(1, logprobs=True, top_logprobs=20))]
    forced = [sorted(d, key=d.get)[-5] for d in firsts]  # each prompt's 5th likeliest first token
    params = [_greedy(8, logprobs=True, top_logprobs=3, logit_bias={x: 12.0}, repetition_penalty=1.3,
                      stop_token_ids=[sorted(d, key=d.get)[-1]], min_tokens=8) for x, d in zip(forced, firsts)]
    plain = _llm(tiny).generate(prompts, params)
    llm = _llm(tiny) if which is None else _spec_llm(tiny, which)
    got = llm.generate(prompts, params)
    for o, p, d, x in zip(got, plain, firsts, forced):
        c, ref = o.outputs[0], p.outputs[0]
        assert c.token_ids[0] == x and c.logprobs[0] == pytest.approx(d[x], abs=1e-4)
        assert [t for t, _ in c.top_logprobs[0]] == sorted(d, key=d.get, reverse=True)[:3]
        assert c.token_ids == ref.token_ids and c.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in c.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]
    if which is None:
        for o, x in zip(_llm(tiny, logprobs_mode="processed").generate(prompts, params), forced):
            c = o.outputs[0]
            assert c.token_ids[0] == x and c.logprobs[0] > -0.05 and c.top_logprobs[0][0][0] == x
    with pytest.raises(ConfigError, match="logprobs_mode"):
        _llm(tiny, logprobs_mode="logits")


def _logsumexp(xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


@pytest.mark.parametrize("which", [None, "ngram", "draft-full"])
def test_processed_logprobs_are_of_the_distribution_each_token_was_drawn_from(tiny, which):
    """vLLM's logprobs modes. processed_logprobs reports the distribution a token was drawn from:
    after temperature and truncation, so a top_k = 5 request's five candidates carry all the
    mass (their exp sums to 1), the rest are -inf, and each value is the raw logits over T
    renormalised over those five; processed_logits reports those logits (raw / T, -inf outside);
    raw_logits the model's logits, which differ from raw_logprobs by one constant per row. Seeded
    requests draw the same tokens in every mode (the mode only changes what is reported), also
    under speculation, so each mode's rows can be checked against another's."""
    temp, k = 0.7, 5
    prompts = _tiny_prompts(6, seed=21)
    params = [SamplingParams(max_tokens=6, temperature=temp, top_k=k, seed=100 + i, ignore_eos=True, logprobs=True,
                             top_logprobs=8) for i in range(len(prompts))]

    def run(mode):
        llm = _llm(tiny, logprobs_mode=mode) if which is None else _spec_llm(tiny, which, logprobs_mode=mode)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        if which is not None:
            assert llm.engine.spec_counters["num_draft_tokens"] > 0
        return outs

    modes = {m: run(m) for m in ("raw_logits", "raw_logprobs", "processed_logprobs", "processed_logits")}
    n_checked = 0
    for outs in zip(*modes.values()):
        raw_logits, raw_lp, proc_lp, proc_logits = outs
        assert raw_logits.token_ids == raw_lp.token_ids == proc_lp.token_ids == proc_logits.token_ids
        for pos, tok in enumerate(proc_lp.token_ids):
            logits = dict(raw_logits.top_logprobs[pos])  # the 8 largest logits
            top5 = sorted(logits, key=logits.get, reverse=True)[:k]
            lse = _logsumexp([logits[t] / temp for t in top5])
            # raw_logprobs: the logits less one constant per row
            shifts = [logits[t] - lp for t, lp in raw_lp.top_logprobs[pos]]
            assert max(shifts) - min(shifts) < 1e-4 and raw_lp.logprobs[pos] == pytest.approx(raw_logits.logprobs[pos] - shifts[0], abs=1e-4)
            # processed_logprobs: the five candidates renormalised, the rest -inf
            lp = dict(proc_lp.top_logprobs[pos])
            assert [t for t, _ in proc_lp.top_logprobs[pos]][:k] == top5
            assert all(lp[t] == pytest.approx(logits[t] / temp - lse, abs=1e-4) for t in top5)
            assert sum(math.exp(lp[t]) for t in top5) == pytest.approx(1.0, abs=1e-4)
            assert all(v == float("-inf") for _, v in proc_lp.top_logprobs[pos][k:])
            assert tok in top5 and proc_lp.logprobs[pos] == pytest.approx(lp[tok], abs=1e-6)
            # processed_logits: the logits over T where kept
            lg = dict(proc_logits.top_logprobs[pos])
            assert all(lg[t] == pytest.approx(logits[t] / temp, abs=1e-4) for t in top5)
            assert proc_logits.logprobs[pos] == pytest.approx(logits[tok] / temp, abs=1e-4)
            n_checked += 1
    assert n_checked == 6 * len(prompts)


def test_greedy_processed_logprobs_equal_plain_decodings_under_speculation(tiny):
    """Greedy requests' processed logprobs (no temperature, no truncation, as vLLM's greedy rows)
    are the same with every proposer as without speculation, top logprobs included."""
    prompts = _tiny_prompts(8, seed=4)
    params = _greedy(10, logprobs=True, top_logprobs=4, top_k=3, top_p=0.5)  # truncation settings a greedy row ignores
    plain = _llm(tiny, logprobs_mode="processed_logprobs").generate(prompts, params)
    for which in ("ngram", "draft-full", "lookahead"):
        llm = _spec_llm(tiny, which, logprobs_mode="processed_logprobs")
        got = llm.generate(prompts, params)
        assert llm.engine.spec_counters["num_accepted_tokens"] > 0, which
        for o, ref in zip(got, plain):
            c, r = o.outputs[0], ref.outputs[0]
            assert c.token_ids == r.token_ids and c.logprobs == pytest.approx(r.logprobs, abs=1e-4), which
            assert all(v > float("-inf") for top in c.top_logprobs for _, v in top)
            assert [[t for t, _ in top] for top in c.top_logprobs] == [[t for t, _ in top] for top in r.top_logprobs]


def _penalized_greedy_by_hand(llm, prompt, n, presence, frequency, vocab):
    """Greedy decoding with OpenAI's penalties, one plain step at a time from the full distribution."""
    out: list[int] = []
    for _ in range(n):
        o = llm.generate([prompt + out], _greedy(1, logprobs=True, top_logprobs=vocab))[0].outputs[0]
        lp = dict(o.top_logprobs[0])
        assert len(lp) == vocab
        out.append(max(lp, key=lambda t: lp[t] - frequency * out.count(t) - presence * (t in out)))
    return out


def test_presence_and_frequency_penalties_match_a_step_by_step_reference():
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=3, vocab=16, layers=2)
    plain = _llm(ckpt)
    for prompt in ([1, 5, 7, 5, 7, 5], [3, 3, 3, 9]):
        for presence, frequency in ((0.0, 1.5), (1.0, 0.0), (-0.5, 0.7)):
            want = _penalized_greedy_by_hand(plain, prompt, 12, presence, frequency, 16)
            got = plain.generate([prompt], _greedy(12, presence_penalty=presence, frequency_penalty=frequency))[0]
            assert got.token_ids == want, (prompt, presence, frequency)
    unpenalized = plain.generate([[1, 5, 7, 5, 7, 5]], _greedy(12))[0].token_ids
    assert unpenalized != _penalized_greedy_by_hand(plain, [1, 5, 7, 5, 7, 5], 12, 0.0, 1.5, 16)


def test_repetition_penalty_matches_transformers_generate():
    """HF's repetition penalty (over prompt and output): greedy output equals transformers'
    generate(repetition_penalty=r) on the same tiny model, and speculation keeps it."""
    from conftest import tiny_checkpoint

    hf, ckpt = tiny_checkpoint("llama", seed=3, vocab=64, layers=2)
    plain = _llm(ckpt)
    spec = _spec_llm(ckpt, "draft-truncated")
    for prompt in ([1, 5, 7, 5, 7, 5, 9, 9], [3, 3, 3, 9, 12, 40]):
        for r in (1.3, 0.7):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=r,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            params = _greedy(12, repetition_penalty=r)
            assert plain.generate([prompt], params)[0].token_ids == ref, (prompt, r)
            assert spec.generate([prompt], params)[0].token_ids == ref, (prompt, r)
        with torch.no_grad():
            unpenalized = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert plain.generate([prompt], _greedy(12))[0].token_ids == unpenalized


@pytest.mark.parametrize("which", ["ngram", "draft-truncated", "eagle", "lookahead"])
def test_penalties_keep_greedy_speculation_exact(tiny, which):
    """A draft node's row is penalised for the node and its ancestors too: speculative greedy
    output equals plain greedy output under the same penalties, batched."""
    prompts = _tiny_prompts(24, seed=6)
    params = [_greedy(24, presence_penalty=0.4 * (i % 3), frequency_penalty=0.8 if i % 2 else -0.3,
                      repetition_penalty=(1.0, 1.2, 0.8)[i % 3]) for i in range(len(prompts))]
    want = _llm(tiny).generate(prompts, params)
    assert [o.token_ids for o in want] != [o.token_ids for o in _llm(tiny).generate(prompts, _greedy(24))]
    llm = _spec_llm(tiny, which)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_counters["num_accepted_tokens"] > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.mark.slow
def test_penalties_sampled_distribution_matches_under_speculation():
    """With temperature and penalties that change along a draft's path, the first tokens' joint
    distribution is the same with and without speculation (permutation test as above)."""
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    n = 20_000
    prompt = [1, 5, 7, 5, 7, 5]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=1.2)
    big = dict(max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    base = _llm(ckpt, **big).generate([prompt] * n, params, use_tqdm=False)
    spec_llm = _spec_llm(ckpt, "draft-truncated", **big)
    spec = spec_llm.generate([prompt] * n, params, use_tqdm=False)
    assert spec_llm.engine.spec_counters["num_accepted_tokens"] > 1000
    repeats = lambda outs: np.mean([len(set(o.token_ids)) < 4 for o in outs])  # noqa: E731
    plain_unpenalized = _llm(ckpt, **big).generate([prompt] * 4000, replace(params, presence_penalty=0.0,
                                                                           frequency_penalty=0.0), use_tqdm=False)
    assert repeats(base) < repeats(plain_unpenalized) - 0.05
    _assert_same_distribution(base, spec)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["draft-truncated", "ngram"])
def test_min_p_sampled_distribution_matches_under_speculation(which):
    """min_p truncates the target distribution drafts are verified against exactly as plain
    sampling truncates it: same joint distribution of the first tokens (permutation test)."""
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    n = 20_000
    prompt = [1, 5, 7, 5, 7, 5]
    params = SamplingParams(max_tokens=4, temperature=1.3, ignore_eos=True, min_p=0.2)
    big = dict(max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    base = _llm(ckpt, **big).generate([prompt] * n, params, use_tqdm=False)
    spec_llm = _spec_llm(ckpt, which, **big)
    spec = spec_llm.generate([prompt] * n, params, use_tqdm=False)
    assert spec_llm.engine.spec_counters["num_accepted_tokens"] > 1000
    unbounded = _llm(ckpt, **big).generate([prompt] * 4000, replace(params, min_p=0.0), use_tqdm=False)
    first = lambda outs: {o.token_ids[0] for o in outs}  # noqa: E731
    assert first(base) < first(unbounded)  # min_p cut some first tokens ...
    assert first(spec) <= first(base)  # ... and speculation never emits them
    _assert_same_distribution(base, spec)


def test_float32_drafter_memory_counts_onednn_packed_weights(tiny):
    """A float32 draft keeps its weights in oneDNN's packed layout, which has no storage to look
    at: reading its memory (the server's /metrics does every step) raised and stopped the engine."""
    from specserve.models.linear import OneDNNLinear

    llm = _spec_llm(tiny, "draft-full")
    runner = llm.engine.proposer.runner
    packed = [m.packed_weight for m in runner.model.modules() if isinstance(m, OneDNNLinear)]
    if not packed:
        pytest.skip("oneDNN is not available here: no packed weights")
    assert llm.engine.drafter_memory_bytes >= sum(t.numel() * 4 for t in packed) + runner.kv_cache_bytes
    assert llm.engine.runner.resident_bytes() > runner.kv_cache_bytes


def _min_tokens_by_hand(llm, prompt, stop_ids, m, n):
    """Plain greedy under min_tokens m, built from two plain runs: m tokens with the stop ids
    banned, then the rest from there with them live."""
    head = llm.generate([prompt], _greedy(m, logit_bias=dict.fromkeys(stop_ids, -100.0)))[0].token_ids
    tail = llm.generate([list(prompt) + head], _greedy(n - m, stop_token_ids=stop_ids))[0]
    return head + tail.token_ids, tail.finish_reason


@pytest.mark.parametrize("which", ["ngram", "draft-truncated", "eagle", "lookahead"])
def test_min_tokens_masks_stop_tokens_until_reached_and_greedy_speculation_stays_exact(tiny, which):
    """vLLM's min_tokens: no stop token among the first min_tokens outputs (a draft node's row
    counts its depth), the stop tokens live after them; speculative greedy equals plain."""
    prompts = _tiny_prompts(24, seed=7)
    plain = _llm(tiny)
    base = plain.generate(prompts, _greedy(20))
    m = 6
    stops = [[o.token_ids[0], o.token_ids[3]] for o in base]  # both would stop inside the first m
    params = [_greedy(20, stop_token_ids=s, min_tokens=m) for s in stops]
    want = plain.generate(prompts, params)
    for p, s, w in zip(prompts, stops, want):
        assert len(w.token_ids) > m and not set(w.token_ids[:m]) & set(s)
        assert (w.token_ids, w.finish_reason) == _min_tokens_by_hand(plain, p, s, m, 20)
    assert any(w.finish_reason == "stop" for w in want) and any(w.finish_reason == "length" for w in want)
    without = plain.generate(prompts, [_greedy(20, stop_token_ids=s) for s in stops])
    assert all(len(o.token_ids) == 1 for o in without)  # stop at once without min_tokens
    llm = _spec_llm(tiny, which)
    got = llm.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0, "nothing was speculated"
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=-1)


@pytest.mark.slow
def test_min_tokens_sampled_distribution_matches_under_speculation():
    """With temperature, a stop token that min_tokens masks for the first two positions: the
    outputs (their lengths included) have the same distribution with and without speculation."""
    from types import SimpleNamespace

    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=9, vocab=12, layers=2)
    n = 20_000
    prompt = [1, 5, 7, 5, 7, 5]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, stop_token_ids=[3, 7], min_tokens=2)
    big = dict(max_num_seqs=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    base = _llm(ckpt, **big).generate([prompt] * n, params, use_tqdm=False)
    spec_llm = _spec_llm(ckpt, "draft-truncated", **big)
    spec = spec_llm.generate([prompt] * n, params, use_tqdm=False)
    assert spec_llm.engine.spec_counters["num_accepted_tokens"] > 1000
    for outs in (base, spec):
        assert not any({3, 7} & set(o.token_ids[:2]) for o in outs)
        assert 0.05 < np.mean([len(o.token_ids) == 3 for o in outs]) < 0.95  # stops right after min_tokens
    padded = lambda outs: [SimpleNamespace(token_ids=o.token_ids + [12] * (4 - len(o.token_ids))) for o in outs]  # noqa: E731
    _assert_same_distribution(padded(base), padded(spec), vocab=13)


# ----------------------------------------------------------------------------- SmolLM2

CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''

TOPICS = ["the sea", "a robot", "prime numbers", "Paris", "a cat", "coffee", "rain", "a library", "music",
          "mountains"]


def _smol_prompts():
    prompts = []
    for i in range(50):
        kind = i % 5
        t = TOPICS[i % len(TOPICS)]
        if kind == 0:
            prompts.append(f"Write one sentence about {t}.")
        elif kind == 1:
            prompts.append(f"Rewrite this code with better names:\n{CODE}\n")
        elif kind == 2:
            prompts.append(f"def add_{i}(a, b):")
        elif kind == 3:
            prompts.append(f"Repeat after me: {t} {t} {t}, {t} {t} {t},")
        else:
            prompts.append(f"{i} + {i} = ")
    return prompts


@pytest.fixture(scope="module")
def smol_base(smollm_checkpoint):
    prompts = _smol_prompts()
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, max_num_seqs=64,
              max_num_batched_tokens=2048)
    return prompts, llm.generate(prompts, _greedy(16))


@pytest.mark.parametrize("which", ["ngram", pytest.param("reference", marks=pytest.mark.slow),
                                   pytest.param("draft", marks=pytest.mark.slow),
                                   pytest.param("copy-draft", marks=pytest.mark.slow)])
def test_smollm2_greedy_spec_equals_plain(smollm_checkpoint, smol_base, which):
    prompts, base = smol_base
    kw = {}
    if which.endswith("draft"):
        kw = dict(draft_checkpoint=smollm_checkpoint, draft_num_layers=24)
    if which.startswith("copy"):
        which, kw["spec_copy"] = "draft", "ngram"
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method=which, spec_policy="always",
              spec_tree="tree", max_num_seqs=64, max_num_batched_tokens=2048, profile_spec_costs=False, **kw)
    params = [_greedy(16, reference_text=CODE) for _ in prompts]
    outs = llm.generate(prompts, params)
    mismatches = [i for i, (o, b) in enumerate(zip(outs, base)) if o.token_ids != b.token_ids]
    assert not mismatches, f"prompts {mismatches} differ with {which} speculation"
    for i in (1, 3, 8):  # and alone
        assert llm.generate(prompts[i], params[i])[0].token_ids == base[i].token_ids
    c = llm.engine.spec_counters
    assert c["num_accepted_tokens"] > 0
    assert llm.engine.check_integrity()


@pytest.mark.parametrize("method", [pytest.param("none", marks=pytest.mark.slow), "ngram"])
def test_smollm2_min_tokens_holds_back_eos_and_stop_strings(smollm_checkpoint, method):
    """min_tokens on a real tokenizer: EOS is masked until then (a short chat answer runs on), and
    a stop string counts only where it ends after the text of the first min_tokens tokens, also
    when a speculative step emits tokens on both sides of that boundary."""
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method=method, spec_policy="always",
              profile_spec_costs=False)
    tok = llm.tokenizer
    short = [{"role": "user", "content": "Say hi."}]
    natural = llm.chat(short, SamplingParams(max_tokens=64, temperature=0))[0]
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 32
    held = llm.chat(short, SamplingParams(max_tokens=64, temperature=0, min_tokens=40))[0]
    assert len(held.token_ids) >= 40
    assert not set(held.token_ids[:40]) & set(tok.stop_token_ids)
    assert held.token_ids[: len(natural.token_ids) - 1] == natural.token_ids[:-1]  # the same text up to the EOS

    prompt = "Repeat after me: the sea the sea the sea, the sea the sea the sea,"
    full = llm.generate(prompt, _greedy(30))[0].token_ids
    text = tok.decode(full)
    for m in (0, 3, 7):
        boundary = len(tok.decode(full[:m]))
        idx = text.find(" the", max(0, boundary - 3))
        while idx + 4 <= boundary:
            idx = text.find(" the", idx + 1)
        out = llm.generate(prompt, _greedy(30, stop=" the", min_tokens=m))[0]
        assert (out.text, out.finish_reason) == (text[:idx], "stop"), m
    if method != "none":
        assert llm.engine.spec_counters["num_accepted_tokens"] > 0


def _assert_counts_describe_the_output(out) -> None:
    """A request's speculation counters count only accepted drafts its output keeps (a stop inside
    a step drops the rest): at most one token of each step is not an accepted draft."""
    m = out.metrics.extra
    n = len(out.token_ids)
    assert m["num_spec_steps"] > 0
    assert m["num_accepted_tokens"] == sum(m["accepted_lengths"]) <= n - 1
    assert m["num_accepted_tokens"] + m["num_target_steps"] in (n, n + 1)
    assert all(0 <= a <= 1 for a in m["acceptance_per_position"] if a is not None)


def test_a_stop_string_inside_a_speculative_step_ends_the_tokens_where_plain_decoding_does(smollm_checkpoint):
    """A step that accepts several tokens can complete a stop string before its last one: the
    output (token ids, their logprobs, the text) ends at the token that completed it, as plain
    decoding's does, not at the step's end."""
    kw = dict(dtype="float32", checkpoint=smollm_checkpoint, profile_spec_costs=False)
    plain = LLM("smollm2", **kw)
    spec = LLM("smollm2", spec_method="ngram", spec_policy="always", **kw)
    prompt = "Repeat after me: the sea the sea the sea, the sea the sea the sea,"
    for stop, m in ((" sea", 0), (" sea", 5), (",", 0), (" the sea,", 2)):
        params = _greedy(30, stop=stop, min_tokens=m, logprobs=1)
        want, got = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop"), (stop, m)
        assert len(got.outputs[0].logprobs) == len(got.token_ids)
        assert got.metrics.num_generated_tokens == len(want.token_ids)
        _assert_counts_describe_the_output(got)
    # Characters spelled by several tokens: a step's tokens that end inside one still show the
    # text of the characters before it, so the first min_tokens tokens' text (which a stop
    # string must lie past) and the text cut at a stop are plain decoding's.
    tok = spec.engine.tokenizer
    chat = render_chat(tok, [{"role": "user", "content": "Repeat after me exactly: " + " ".join(["🚀🚀 x 🚀"] * 4)}])
    for text, stop, m in ((chat, ["🚀"], 12), (chat, ["本", "🚀"], 33), (chat, [" x"], 30), (chat, ["🚀"], 0),
                          ("日本語 🙂 café " * 5, ["本"], 6), ("日本語 🙂 café " * 5, ["é", "🙂"], 11)):
        params = _greedy(38, stop=stop, min_tokens=m)
        want, got = plain.generate(text, params)[0], spec.generate(text, params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), (stop, m)
    # A stop token id ends the output at the end of a speculative step too (drafts never hold
    # one: accepted, it adds no token, see prune_banned; the step's own token may be it); its
    # text is left out unless include_stop_str_in_output (vLLM's convention), in plain and
    # speculative decoding alike.
    comma = spec.engine.tokenizer.encode(",", add_special_tokens=False)
    assert len(comma) == 1
    for include in (False, True):
        params = _greedy(30, stop_token_ids=comma, include_stop_str_in_output=include)
        want, got = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
        assert got.token_ids[-1] == comma[0] and got.outputs[0].stop_reason == comma[0]
        assert got.text.endswith(",") == include
        _assert_counts_describe_the_output(got)
    eng = spec.engine
    assert eng.spec_counters["num_accepted_tokens"] > 0
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_smollm2_jagged_batch_of_16(smollm_checkpoint, smol_base):
    """16 concurrent requests accepting different numbers of drafts per step."""
    prompts, base = smol_base
    idx = list(range(0, 48, 3))[:16]
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method="draft",
              draft_checkpoint=smollm_checkpoint, draft_num_layers=24, spec_policy="always",
              num_spec_tokens=4, profile_spec_costs=False)
    eng = llm.engine
    seen_accept = set()
    orig = eng._account_step

    def spy(sched_out, sampled):
        per_step = {st.num_accepted_tokens for st in sampled.values() if st.num_draft_tokens}
        if len(per_step) > 1:
            seen_accept.add(tuple(sorted(per_step)))
        return orig(sched_out, sampled)

    eng._account_step = spy
    outs = llm.generate([prompts[i] for i in idx], _greedy(16))
    for i, o in zip(idx, outs):
        assert o.token_ids == base[i].token_ids
    assert seen_accept, "no step mixed different acceptance lengths"
    assert eng.check_integrity() and eng.proposer.check_integrity()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks


def test_spec_metrics_in_outputs(smollm_checkpoint):
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method="ngram", spec_policy="always",
              profile_spec_costs=False)
    out = llm.generate(f"Repeat: {CODE}\nAgain: {CODE[:60]}", _greedy(24))[0]
    m = out.metrics.to_dict()
    for key in ("num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "acceptance_per_position",
                "mean_accepted_len", "target_forwards_per_token"):
        assert key in m
    assert m["num_accepted_tokens"] > 0 and m["target_forwards_per_token"] < 1.0
    lengths = m["accepted_lengths"]  # the histogram kept step by step is the list's
    assert m["accepted_length_histogram"] == {k: lengths.count(k) for k in sorted(set(lengths))}
    assert list(m["accepted_length_histogram"]) == sorted(m["accepted_length_histogram"])


def test_runtime_switch_and_per_request_opt_out(smollm_checkpoint):
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method="ngram", spec_policy="always",
              profile_spec_costs=False)
    eng = llm.engine
    prompt = f"Repeat: {CODE}\nAgain: {CODE[:60]}"
    eng.set_speculation(False)
    off = llm.generate(prompt, _greedy(16))[0]
    assert off.metrics.extra["num_draft_tokens"] == 0
    eng.set_speculation(True)
    on = llm.generate(prompt, _greedy(16))[0]
    assert on.metrics.extra["num_draft_tokens"] > 0 and on.token_ids == off.token_ids
    opt_out = llm.generate(prompt, _greedy(16, speculative=False))[0]
    assert opt_out.metrics.extra["num_draft_tokens"] == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_drafter_memory_is_released_while_speculation_is_off_and_reloaded_when_on(smollm_path):
    """Off for longer than release_after_s frees the draft model's weights and KV cache (in the
    loop, while requests run); switching on reloads it and speculation resumes, output unchanged."""
    llm = LLM(smollm_path, draft_model=smollm_path, spec_policy="always", profile_spec_costs=False,
              kv_cache_gib=0.25, spec_release_after_s=60.0)
    eng = llm.engine
    prompt = f"Repeat: {CODE}\nAgain: {CODE[:60]}"
    on = llm.generate(prompt, _greedy(24))[0]
    assert on.metrics.extra["num_draft_tokens"] > 0
    held = eng.drafter_memory_bytes
    kv_bytes = eng.proposer.runner.kv_cache_bytes
    assert held > kv_bytes > 0  # weights and KV cache both counted
    gone = [weakref.ref(eng.proposer), weakref.ref(eng.proposer.runner.kv_caches[0][0]),
            weakref.ref(next(iter(eng.proposer.runner.model.buffers())))]

    eng.set_speculation(False)
    t_off = time.monotonic()
    assert eng.release_idle_drafter(now=t_off + 30) == 0 and eng.proposer is not None  # not off long enough
    # The loop frees it while a request runs: pretend 61 s have passed since the switch.
    eng._spec_off_since = t_off - 61  # noqa: SLF001 - stands in for a minute of wall time
    rss_before = _rss_bytes()
    eng.add_request(prompt, _greedy(24), request_id="during")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert eng.proposer is None and eng.drafter_released and eng.drafter_memory_bytes == 0
    gc.collect()
    assert all(ref() is None for ref in gone), "the drafter's tensors are still referenced"
    # Back to the OS: at least half the weights (KV pages count only where they were written).
    assert rss_before - _rss_bytes() > 0.5 * (held - kv_bytes), "the freed memory did not go back to the OS"
    off = [o for o in outs if o.finished][0].outputs[0]
    assert off.token_ids == on.token_ids
    assert eng.check_integrity()
    assert "drafter released" in eng.describe()["speculation"]
    assert eng.release_idle_drafter(now=time.monotonic() + 1e6) == 0  # nothing left to free

    eng.set_speculation(True)  # reloads it
    assert eng.proposer is not None and not eng.drafter_released and eng.drafter_memory_bytes == held
    again = llm.generate(prompt, _greedy(24))[0]
    assert again.metrics.extra["num_draft_tokens"] > 0 and again.token_ids == on.token_ids
    assert eng.check_integrity()


def test_model_free_proposers_are_kept_while_speculation_is_off(smollm_checkpoint):
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method="ngram", profile_spec_costs=False,
              spec_release_after_s=0.0)
    eng = llm.engine
    eng.set_speculation(False)
    assert eng.release_idle_drafter(now=time.monotonic() + 1e6) == 0
    assert eng.proposer is not None and not eng.drafter_released


def test_draft_tokenizer_mismatch_is_refused(smollm_checkpoint):
    from specserve.errors import TokenizerMismatchError
    from specserve.models.loader import LoadedCheckpoint

    bundled = pytest.importorskip("specserve.models.bundled")
    try:
        qpath = bundled.resolve_model("qwen2.5-coder-0.5b-instruct")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"Qwen 0.5B not installed: {e}")
    from specserve.models.loader import open_gguf
    from specserve.models.tokenizer import Tokenizer

    qtok = Tokenizer.from_gguf(open_gguf(qpath))
    fake_draft = LoadedCheckpoint(smollm_checkpoint.arch, smollm_checkpoint.weights, qtok, "qwen-tokenizer")
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, draft_checkpoint=fake_draft)


def test_the_summary_says_when_greedy_speculation_may_leave_plain_decoding(tiny):
    """bf16 verify passes round other matrix shapes than a decode step does, and an int8 KV cache
    beside torch's attention rounds their tiny differences to whole steps: the start-up summary
    says so, and what gives token-for-token equality; float32 with a float cache says nothing."""
    warning = "greedy output can differ from plain decoding"
    bf16 = LLM("tiny", dtype="bfloat16", checkpoint=tiny, spec_method="ngram", profile_spec_costs=False)
    assert warning in bf16.engine.describe()["speculation"]
    assert warning in _llm(tiny, "ngram", kv_cache_dtype="int8").engine.describe()["speculation"]
    assert warning not in _llm(tiny, "ngram").engine.describe()["speculation"]
    assert warning not in _llm(tiny, "ngram", kv_cache_dtype="fp16").engine.describe()["speculation"]


def test_bad_spec_config_errors():
    from specserve.config import SpecConfig
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError, match="draft-model"):
        SpecConfig(method="draft")
    with pytest.raises(ConfigError, match="Unknown spec method"):  # (medusa, once the example here, now exists)
        SpecConfig(method="no-such-method")
    with pytest.raises(ConfigError):
        SpecConfig(method="ngram", num_spec_tokens=0)
    with pytest.raises(ConfigError, match="copies already"):  # a copier goes in front of a model drafter only
        SpecConfig(method="ngram", copy="ngram")
    with pytest.raises(ConfigError, match="has none"):
        SpecConfig(method="none", copy="reference")
    with pytest.raises(ConfigError, match="Unknown spec copy source"):
        SpecConfig(method="eagle", copy="suffix")
    with pytest.raises(ConfigError, match="Unknown spec join source"):
        SpecConfig(method="eagle", join="ngram")
    with pytest.raises(ConfigError, match="is model-free"):  # a join adds to a model drafter's trees
        SpecConfig(method="ngram", join="lookahead")
    with pytest.raises(ConfigError, match="has none"):
        SpecConfig(method="none", join="lookahead")
    with pytest.raises(ConfigError, match="copy_min_match"):
        SpecConfig(method="eagle", copy="ngram", copy_min_match=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_with_spec_is_reproducible(smollm_checkpoint, seed):
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, spec_method="draft",
              draft_checkpoint=smollm_checkpoint, draft_num_layers=24, spec_policy="always", profile_spec_costs=False)
    p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
    a = llm.generate(["Tell me about the sea.", "def f(x):"], p)
    b = llm.generate(["def f(x):"], p)
    assert a[1].token_ids == b[0].token_ids
    torch.manual_seed(123)  # global RNG state must not matter
    c = llm.generate(["Tell me about the sea."], p)
    assert c[0].token_ids == a[0].token_ids


def _mixed_params(prompts, outputs=None):
    """A batch of request settings that each change the rows a request samples from: greedy,
    stop ids, penalties, logit_bias, min_tokens, logprobs, seeded sampling, a reference text."""
    out = []
    for i, prompt in enumerate(prompts):
        base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
        kind = i % 8
        if kind == 1:
            base.update(stop_token_ids=[7, 9], ignore_eos=False)
        elif kind == 2:
            base.update(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
        elif kind == 3:
            base.update(logit_bias={5: -100.0, 11: 4.0})
        elif kind == 4:
            base.update(min_tokens=20, stop_token_ids=[3, 4, 5], ignore_eos=False)
        elif kind == 5:
            base.update(logprobs=True, top_logprobs=2)
        elif kind == 6:
            base.update(temperature=0.8, top_k=40, top_p=0.9, seed=500 + i)
        elif kind == 7 and outputs is not None:
            base.update(reference_token_ids=list(prompt) + list(outputs[i].token_ids))
        out.append(SamplingParams(**base))
    return out


@pytest.mark.parametrize("which", ["ngram", "lookahead", "draft-truncated", "eagle", "medusa", "layerskip-chain",
                                   "copy-draft"])
def test_mixed_request_settings_under_preemption_emit_plain_decodings_tokens(tiny, which):
    """Every request setting that changes a row (penalties, bias, min_tokens, stop ids, logprobs,
    seeded sampling, a reference) at once, in a KV pool small enough that requests are preempted
    and recomputed while they speculate: the same tokens (and logprobs) as plain decoding with room
    to spare, and every block back afterwards."""
    prompts = _tiny_prompts(16, seed=21)
    want = _llm(tiny).generate(prompts, _mixed_params(prompts))
    params = _mixed_params(prompts, want)
    want = _llm(tiny).generate(prompts, params)
    llm = _spec_llm(tiny, which, num_kv_blocks=14, max_num_seqs=16)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip((o.outputs[0] for o in got), (o.outputs[0] for o in want)):
        assert (g.logprobs is None) == (w.logprobs is None)
        if g.logprobs is not None:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0, "nothing was preempted: the pool is not small enough"
    assert eng.spec_counters["num_accepted_tokens"] > 0
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
