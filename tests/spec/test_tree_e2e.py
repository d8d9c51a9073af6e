"""Draft trees end to end: branching drafts verified in one pass stay exact (greedy == plain,
batched and alone), the accepted path's KV lands in consecutive slots, nothing leaks."""

from __future__ import annotations

from collections import Counter

import pytest

from specserve import LLM, SamplingParams
from specserve.testing import repetitive_prompts


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    return tiny_checkpoint("llama", seed=5, vocab=64, layers=2)[1]


def _spy(llm: LLM) -> Counter:
    """Count branching drafts and accepted paths that leave the first branch."""
    seen: Counter = Counter()
    runner = llm.engine.runner
    execute = runner.execute

    def wrapped(out):
        res = execute(out)
        for sr in out.scheduled:
            if sr.draft is not None:
                seen["drafts"] += 1
                seen["branching"] += not sr.draft.is_chain
                nodes = res[sr.request_id].accepted_nodes if sr.request_id in res else ()
                seen["moved"] += any(node != d for d, node in enumerate(nodes))
        return res

    runner.execute = wrapped
    return seen


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp16"])
def test_ngram_trees_are_exact_batched_and_alone(tiny, kv_cache_dtype):
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", checkpoint=tiny, kv_cache_dtype=kv_cache_dtype, profile_spec_costs=False)
    base = LLM("tiny", spec_method="none", **kw).generate(prompts, params)
    llm = LLM("tiny", spec_method="ngram", spec_policy="always", num_spec_tokens=8, **kw)
    seen = _spy(llm)
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in base]
    for p, b in list(zip(prompts, base))[::4]:
        assert llm.generate([p], params)[0].token_ids == b.token_ids
    assert seen["branching"] > 0, seen  # real trees were verified
    assert seen["moved"] > 0, seen  # and some accepted path left the first branch (KV moved)
    # Tree metrics in every request's output: accepted length per step and nodes per step.
    x = batched[0].metrics.extra
    assert sum(x["accepted_length_histogram"].values()) == x["num_spec_steps"] == len(x["accepted_lengths"])
    assert sum(k * v for k, v in x["accepted_length_histogram"].items()) == x["num_accepted_tokens"]
    assert x["draft_nodes_per_step"] >= x["mean_accepted_len"]
    eng = llm.engine
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_draft_model_trees_accept_the_drafts_argmax_path_when_draft_is_target(tiny):
    """Draft = target, greedy: the draft's most likely child is the target's argmax at every
    level, so each step accepts the whole first-child path of its tree (and no other)."""
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="draft", draft_checkpoint=tiny, spec_tree="tree",
              spec_policy="always", num_spec_tokens=8, profile_spec_costs=False, spec_copy="none")
    runner = llm.engine.runner
    execute = runner.execute
    checked = Counter()

    def wrapped(out):
        res = execute(out)
        for sr in out.scheduled:
            if sr.draft is not None and sr.request_id in res:
                first, node = [], -1
                while sr.draft.children[node + 1]:
                    node = sr.draft.children[node + 1][0]
                    first.append(node)
                assert list(res[sr.request_id].accepted_nodes) == first
                checked["steps"] += 1
                checked["branching"] += not sr.draft.is_chain
        return res

    runner.execute = wrapped
    prompts = repetitive_prompts(8)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    base = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="none").generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in base]
    assert checked["steps"] > 0 and checked["branching"] > 0
    eng = llm.engine
    assert eng.check_integrity() and eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks


def test_draft_model_trees_stop_at_the_chain_depth_and_spend_the_rest_on_width(tiny):
    """A tree drafter feeds one level per draft pass: its main path goes no deeper than the chain
    K its node budget was sized from (K = 3 here, budget 6), so a step costs at most the chain's
    K passes; the other half of the budget holds alternatives, which cost no pass. (Fed as deep
    as the budget, the main path took 7 passes here where the policy priced 3.)"""
    k = 3
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="draft", draft_checkpoint=tiny, spec_tree="tree",
              spec_policy="always", num_spec_tokens=k, draft_p_min=0.0, profile_spec_costs=False, spec_copy="none")
    seen: Counter = Counter()
    runner, proposer = llm.engine.runner, llm.engine.proposer
    execute, propose = runner.execute, proposer.propose

    def wrapped_execute(out):
        for sr in out.scheduled:
            if sr.draft is not None:
                seen["drafts"] += 1
                seen["deepest"] = max(seen["deepest"], sr.draft.max_depth)
                seen["at_k"] += sr.draft.max_depth == k
                seen["branching"] += not sr.draft.is_chain
        return execute(out)

    def wrapped_propose(requests, num_tokens):
        before = proposer.num_forwards
        out = propose(requests, num_tokens)
        seen["most_passes"] = max(seen["most_passes"], proposer.num_forwards - before)
        return out

    runner.execute, proposer.propose = wrapped_execute, wrapped_propose
    prompts = repetitive_prompts(6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="none").generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in base]
    assert seen["drafts"] > 0 and seen["at_k"] > 0 and seen["branching"] > 0
    assert seen["deepest"] == k
    assert seen["most_passes"] <= k  # the catch-up pass (the root's children) and k - 1 levels fed
    eng = llm.engine
    assert eng.check_integrity() and eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks


def test_chain_mode_drafts_only_chains(tiny):
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="ngram", spec_policy="always",
              spec_tree="chain", num_spec_tokens=8, profile_spec_costs=False)
    seen = _spy(llm)
    llm.generate(repetitive_prompts(8), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert seen["drafts"] > 0 and seen["branching"] == 0


def test_sampled_trees_run_and_keep_the_cache_clean(tiny):
    """Sampled verification of trees through the engine (exactness itself is tested on the
    sampler, tests/sampling/test_tree_rejection.py); seeded outputs repeat."""
    prompts = repetitive_prompts(12)
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="ngram", spec_policy="always",
              num_spec_tokens=8, profile_spec_costs=False)
    seen = _spy(llm)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=i, ignore_eos=True) for i in range(12)]
    a = llm.generate(prompts, params)
    b = llm.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert seen["branching"] > 0
    assert llm.engine.check_integrity()


def test_smollm_native_trees_equal_plain(smollm_path):
    """The native path (GGUF blocks, one-call decoder stack, native attention with the tree
    mask) on SmolLM2: greedy with n-gram trees equals plain decoding."""
    text = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
            "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n\n")
    prompts = [text + "def mod(a, b):", text + "def pow(a, b):", text * 2 + "def neg(a):"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(quantization="auto", kv_cache_gib=0.25, profile_spec_costs=False)
    base = LLM("smollm2-135m-instruct", spec_method="none", **kw).generate(prompts, params)
    llm = LLM("smollm2-135m-instruct", spec_method="ngram", spec_policy="always", num_spec_tokens=8, **kw)
    seen = _spy(llm)
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in base]
    assert seen["branching"] > 0
    assert llm.engine.check_integrity()


def test_the_rate_guard_measures_decode_steps_and_its_hold_removes_every_draft(tiny):
    """The engine tells the adaptive policy's rate guard every decode step (tokens, seconds,
    with drafts or not; never a step with a prompt chunk), at the step's batch size; where the
    guard holds speculation off, no step carries a draft and the output is unchanged."""
    prompts = repetitive_prompts(4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="ngram", spec_policy="adaptive",
              profile_spec_costs=False, max_num_batched_tokens=4096)
    eng = llm.engine
    seen: list[tuple[int, int, bool]] = []
    observe = eng.policy.guard.observe

    def spy(batch, tokens, seconds, speculated):
        seen.append((batch, tokens, speculated))
        observe(batch, tokens, seconds, speculated)

    eng.policy.guard.observe = spy
    base = llm.generate(prompts, params)
    assert any(s for _, _, s in seen) and all(1 <= b <= 4 for b, _, _ in seen) and seen[0][0] == 4
    # every token after each prompt's first came from a decode step the guard saw
    assert sum(t for _, t, _ in seen) == sum(len(o.outputs[0].token_ids) - 1 for o in base)
    assert eng.policy.guard.rates[4].spec is not None

    drafts = eng.spec_counters["num_drafts"]
    eng.policy.guard.allows = lambda batch: False
    seen.clear()
    held = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in held] == [o.outputs[0].token_ids for o in base]
    assert eng.spec_counters["num_drafts"] == drafts and not any(s for _, _, s in seen)
    assert eng.check_integrity()



def test_a_new_prompt_is_not_held_behind_another_requests_draft(tiny):
    """Drafts are proposed before a step admits a waiting request, so a copy sized for a decode
    step alone used to land in the step that computes a new prompt, and that prompt's first token
    waited for it. Now a step carrying prompt tokens verifies only the draft rows that add at most
    PROMPT_DRAFT_SHARE to its predicted time; both outputs stay plain decoding's, nothing leaks."""
    from specserve.ops.calc import PROMPT_DRAFT_SHARE
    from specserve.spec.policy import StepTimer

    prompts = repetitive_prompts(2)
    a, b = prompts[0], prompts[1][:10]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", checkpoint=tiny, profile_spec_costs=False)
    plain = [o.outputs[0].token_ids for o in LLM("tiny", spec_method="none", **kw).generate([a, b], params)]
    llm = LLM("tiny", spec_method="ngram", spec_policy="adaptive", num_spec_tokens=8, **kw)
    eng = llm.engine
    # A curve where a row costs 5% of a one-token step (kept: the tiny model's own times are flat).
    eng.policy.target_time = timer = StepTimer({n: 1e-3 * (1 + 0.05 * n) for n in (1, 2, 4, 8, 16, 32, 64, 128)})
    timer.observe_scaled = timer.observe = lambda n, seconds: None
    eng.policy.guard.allows = lambda batch: True
    steps: list[dict[str, int]] = []
    execute = eng.runner.execute

    def spy(out):
        steps.append({sr.request_id: len(sr.draft) if sr.draft is not None else -len(sr.token_ids) for sr in out.scheduled})
        return execute(out)

    eng.runner.execute = spy
    # a copies its reference (its own plain answer) in long drafts
    copying = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, reference_token_ids=list(plain[0]))
    eng.add_request(a, copying, request_id="a")
    while not any(s.get("a", 0) > 4 for s in steps):
        assert len(steps) < 20, steps
        eng.step()
    eng.add_request(b, params, request_id="b")
    eng.step()
    admitted = steps[-1]
    assert admitted["b"] == -len(b)  # b's whole prompt (no prefix in the cache) beside a's draft
    base = 1 + len(b)
    allowed = max(d for d in range(64) if timer(base + d) <= (1 + PROMPT_DRAFT_SHARE) * timer(base))
    assert 0 <= admitted.get("a", 0) <= allowed < 4
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert outs["a"] == plain[0] and outs["b"] == plain[1]
    assert max(s.get("a", 0) for s in steps) > allowed  # uncut where no prompt shared the step
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft"])
def test_drafts_near_the_length_limit_stay_exact_and_inside_it(tiny, method):
    """Requests that run into max_model_len while drafting: every verified tree fits in the
    positions left (its deepest node and the token after it included), the outputs equal plain
    decoding's and end at the limit, batched and alone, and no block leaks."""
    limit = 64
    prompts = [p[: limit - 1 - k % 12] for k, p in enumerate(repetitive_prompts(12)) if len(p) >= limit - 1]
    prompts += [p[:n] for p, n in zip(repetitive_prompts(4, seed=9), (limit - 1, limit - 2, limit - 3, 40))]
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", checkpoint=tiny, max_model_len=limit, profile_spec_costs=False)
    base = LLM("tiny", spec_method="none", **kw).generate(prompts, params)
    extra = dict(draft_checkpoint=tiny) if method == "draft" else dict(lookahead_corpus="none")
    llm = LLM("tiny", spec_method=method, spec_policy="always", num_spec_tokens=8, spec_copy="none", **extra, **kw)
    runner, near = llm.engine.runner, Counter()
    execute = runner.execute

    def wrapped(out):
        for sr in out.scheduled:
            if sr.draft is not None:
                last_known = sr.start_pos + len(sr.token_ids) - len(sr.draft) - 1
                # the deepest node, then the token the target samples after it, both inside the window
                end = last_known + sr.draft.max_depth + 2
                assert end <= limit, (last_known, sr.draft.max_depth)
                near["drafts"] += 1
                near["at_the_limit"] += end == limit
        return execute(out)

    runner.execute = wrapped
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in base]
    for p, b in list(zip(prompts, base))[::3]:
        out = llm.generate([p], params)[0]
        assert out.token_ids == b.token_ids and len(p) + len(out.token_ids) == limit and out.finish_reason == "length"
    assert near["drafts"] > 0 and near["at_the_limit"] > 0, near
    eng = llm.engine
    assert eng.check_integrity()
    if method == "draft":
        assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks


def test_the_policy_is_told_what_a_draft_rows_attention_costs_per_key_of_context(tiny):
    """The engine times the native attention per (query row, key) at start-up (pair_s), so the
    policy charges each draft row its request's context beyond the short one T(n) was timed at;
    a runner off the native kernels reports 0 (its T(n) is all the policy has, as before)."""
    llm = LLM("smollm2-135m-instruct", spec_method="ngram", quantization="auto", kv_cache_gib=0.25)
    runner, policy = llm.engine.runner, llm.engine.policy
    assert runner.native_ops and 0 < policy.pair_s < 1e-4
    per_pair = runner.time_attention_pairs(keys=1024)
    assert 0 < per_pair < 1e-4
    # A step's attention is taken off the time T(n) learns: a 4,000-token request's decode row
    # carries ~4,000 pairs of it, a short one none.
    assert policy.attention_s([(1, 3999)]) == pytest.approx(policy.pair_s * (4000 - 32))
    assert policy.attention_s([(1, 10)]) == 0.0
    plain = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="ngram")
    assert not plain.engine.runner.native_ops and plain.engine.runner.time_attention_pairs() == 0.0
    assert plain.engine.policy.pair_s == 0.0
