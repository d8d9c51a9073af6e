"""Earlier requests' outputs as a draft source (spec/served.py, SuffixDecoding's global cache):
the store's lookups and bounds, how ngram and lookahead weigh it against the request's own text,
and greedy exactness end to end with it on."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpecConfig, spec_kwargs_from_vllm
from specserve.errors import ConfigError
from specserve.request import Request
from specserve.spec import served
from specserve.spec.lookahead import LookaheadProposer
from specserve.spec.ngram import NgramProposer
from specserve.spec.served import KEY_LEN, ServedOutputs
from specserve.testing import repetitive_prompts


def _req(rid, prompt, output=()):
    r = Request(rid, list(prompt), SamplingParams())
    if output:
        r.append_output_tokens(list(output))
    return r


def test_lookup_returns_what_followed_the_hits_sharing_the_most_context():
    store = ServedOutputs()
    store.add([1, 2, 3, 4, 5, 6, 7, 8])
    store.add([9, 9, 3, 4, 5, 6, 70, 80])  # the same 4-token window, less context before it
    shared, conts = store.continuations([0, 1, 2, 3, 4, 5, 6], budget=3)
    assert shared == 6 and conts == [([7, 8], 1.0)]  # only the output sharing 6 tokens
    shared, conts = store.continuations([0, 0, 3, 4, 5, 6], budget=1)
    assert shared == 4 and conts == [([70], 1.0), ([7], 1.0)]  # both share 4: latest first
    assert store.continuations([5, 6, 7], budget=4) == (0, [])  # shorter than KEY_LEN
    assert store.continuations([42, 43, 44, 45], budget=4) == (0, [])  # never seen
    assert store.continuations([1, 2, 3, 4], budget=0) == (0, [])


def test_an_output_is_kept_after_its_prompts_tail_so_a_retry_drafts_it_from_its_first_step():
    """A hit may share the prompt's last tokens (up to MAX_MATCH) before the output; what it
    drafts is always output. A retried ask (the same prompt) drafts the earlier answer from its
    first decode step, and an answer shorter than KEY_LEN + 1 tokens is kept after its context."""
    store = ServedOutputs()
    prompt = list(range(100, 140))  # 40 tokens: the last MAX_MATCH are kept
    store.add([7, 8, 9], context=prompt)
    assert store.num_tokens == served.MAX_MATCH + 3
    assert store.continuations(prompt, budget=8) == (served.MAX_MATCH, [([7, 8, 9], 1.0)])
    assert store.continuations(prompt + [7], budget=8) == (served.MAX_MATCH, [([8, 9], 1.0)])
    # A window inside the prompt's tail continues with prompt text: not indexed, nothing drafted.
    assert store.continuations(prompt[:20], budget=8) == (0, [])
    # Another ask ending in the same few tokens shares only those, and drafts as much.
    shared, conts = store.continuations([1, 2] + prompt[-5:], budget=8)
    assert shared == 5 and conts == [([7, 8, 9], 1.0)]
    store.add([], context=prompt)  # no output: nothing kept
    assert len(store) == 1


def test_short_outputs_teach_nothing_and_clear_forgets():
    store = ServedOutputs()
    store.add(list(range(KEY_LEN)))  # no token after its only window
    assert len(store) == 0 and store.num_tokens == 0
    store.add(list(range(10)))
    assert store.continuations([0, 1, 2, 3], 2)[1] == [([4, 5], 1.0)]
    store.clear()
    assert len(store) == 0 and store.continuations([0, 1, 2, 3], 2) == (0, [])


def test_oldest_outputs_go_first_by_count_and_by_tokens_and_lookups_survive_compaction(monkeypatch):
    store = ServedOutputs(max_requests=3)
    for i in range(5):
        store.add([100 + i, 1, 2, 3, 4, 200 + i])
    assert len(store) == 3
    assert store.continuations([1, 2, 3, 4], 1)[1] == [([204], 1.0), ([203], 1.0), ([202], 1.0)]
    by_tokens = ServedOutputs(max_tokens=20)
    for i in range(5):
        by_tokens.add([i] * 3 + [1, 2, 3, 4, 50 + i])  # 8 tokens each: two fit
    assert len(by_tokens) == 2 and by_tokens.num_tokens == 16
    assert by_tokens.continuations([1, 2, 3, 4], 1)[1] == [([54], 1.0), ([53], 1.0)]
    # Many outputs through a small store: the index is rebuilt from the kept ones, and lookups
    # still find exactly those.
    monkeypatch.setattr(served, "COMPACT_MIN", 16)
    churn = ServedOutputs(max_requests=2)
    for i in range(3000):
        churn.add([i % 7, 5, 6, 7, 8, i])
        assert churn._stale <= 16 + 2
    assert len(churn) == 2 and sum(map(len, churn._index.values())) <= 4 + 2 * 16
    assert churn.continuations([5, 6, 7, 8], 1)[1] == [([2999], 1.0), ([2998], 1.0)]
    with pytest.raises(ValueError):
        ServedOutputs(max_requests=-1)


def test_ngram_takes_served_outputs_only_where_they_share_more_than_its_own_text():
    store = ServedOutputs()
    store.add([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])
    ng = NgramProposer(tree=False, served=store)
    # Nothing in the request's own text matches: the served output drafts, as far as its
    # match length allows (spec factor 1: 5 shared tokens -> at most 5 drafted).
    req = _req("a", [1, 2, 10, 11, 12, 13], [14])
    assert list(ng.propose([req], [8])["a"].token_ids) == [15, 16, 17, 18, 19]
    # Its own text repeats a longer stretch of the tail: that wins.
    own = [30, 12, 13, 14, 99, 98, 30, 12, 13, 14]
    req = _req("b", [10, 11] + own[:-1], own[-1:])
    assert list(ng.propose([req], [3])["b"].token_ids) == [99, 98, 30]
    # Without a store (or with --suffix-cache-requests 0) nothing but its own text drafts.
    assert NgramProposer(tree=False).propose([_req("c", [1, 2, 10, 11, 12, 13], [14])], [8]) == {}
    # Trees: every served output sharing the most, weighted alike.
    store.add([7, 11, 12, 13, 14, 15, 16, 40])
    tree = NgramProposer(tree=True, served=store).propose([_req("d", [0, 11, 12, 13], [14])], [4])["d"]
    assert tree.token_ids[0] == 15 and set(tree.token_ids) >= {16}
    # A finished request's output joins the store; reset_served forgets them all.
    ng.request_finished(_req("e", [1], [50, 51, 52, 53, 54, 55]))
    assert store.continuations([50, 51, 52, 53], 1)[1] == [([54], 1.0)]
    ng.reset_served()
    assert len(store) == 0


def test_lookahead_offers_served_continuations_as_a_source():
    store = ServedOutputs()
    store.add([40, 41, 42, 43, 44, 45, 46, 47])
    la = LookaheadProposer(corpus=None, served=store)
    req = _req("a", [1, 40, 41, 42], [43])
    la.add_request(req)
    tree = la.propose([req], [4])["a"]
    assert tree.token_ids[:3] == (44, 45, 46)


def test_config_and_vllm_key():
    assert SpecConfig(method="ngram").suffix_cache_requests == 10_000
    with pytest.raises(ConfigError, match="suffix_cache_requests"):
        SpecConfig(method="ngram", suffix_cache_requests=-1)
    kw = spec_kwargs_from_vllm({"method": "suffix", "suffix_decoding_max_cached_requests": 50})
    assert kw["spec_method"] == "ngram" and kw["suffix_cache_requests"] == 50


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    return tiny_checkpoint("llama", seed=5, vocab=64, layers=2)[1]


@pytest.mark.parametrize("method", ["ngram", "lookahead"])
def test_repeated_requests_draft_from_earlier_outputs_and_stay_exact(tiny, method):
    prompts = repetitive_prompts(n=6)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", checkpoint=tiny, profile_spec_costs=False)
    base = [o.token_ids for o in LLM("tiny", spec_method="none", **kw).generate(prompts, params)]
    llm = LLM("tiny", spec_method=method, spec_policy="always", num_spec_tokens=8, lookahead_corpus="none", **kw)
    eng = llm.engine
    assert "also from the outputs of the last 10,000 requests" in eng.describe()["speculation"]
    assert ("no corpus; " in eng.describe()["speculation"]) == (method == "lookahead")
    first = llm.generate(prompts, params)  # batched: the store fills as they finish
    assert [o.token_ids for o in first] == base
    kept = sum(32 + min(served.MAX_MATCH, len(o.prompt_token_ids)) for o in first)  # each output after its prompt's tail
    assert len(eng.proposer.served) == len(prompts) and eng.suffix_cache_tokens == kept
    again = [llm.generate(p, params)[0] for p in prompts]  # alone, each after its own earlier output
    assert [o.token_ids for o in again] == base
    steps = lambda outs: sum(o.metrics.extra["num_target_steps"] for o in outs)  # noqa: E731
    assert steps(again) < 0.6 * steps(first)
    llm.reset_suffix_cache()
    assert len(eng.proposer.served) == 0 and eng.suffix_cache_tokens == 0
    assert eng.kv_manager.check_integrity() and eng.proposer.check_integrity()


def test_suffix_cache_off(tiny):
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, profile_spec_costs=False, spec_method="ngram",
              suffix_cache_requests=0)
    llm.generate(repetitive_prompts(n=2), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert llm.engine.proposer.served is None
    assert "outputs of the last" not in llm.engine.describe()["speculation"]
    llm.reset_suffix_cache()  # nothing to forget: no error


def test_ngram_scores_predict_acceptance_by_shared_context_and_learn_from_the_target():
    from specserve.engine.scheduler import SampledTokens
    from specserve.spec.copy_trust import TRUST_EWMA, shared_bucket

    store = ServedOutputs()
    store.add(list(range(100, 140)))
    ng = NgramProposer(tree=True, served=store)
    assert ng.traits.scores_predict_acceptance and ng.traits.needs_verify_outputs
    long = _req("long", [1, 2], list(range(100, 120)))  # shares 20 tokens with the served output
    short = _req("short", [7, 8, 9, 3, 4, 1, 5, 3, 4], [])  # shares 2 tokens ("3 4") with its own text
    drafts = ng.propose([long, short], [4, 4])
    a, b = drafts["long"], drafts["short"]
    assert a.token_ids == (120, 121, 122, 123) and b.token_ids[0] == 1
    # Scores fall along a path and a long shared context is trusted more.
    assert all(x > y for x, y in zip(a.scores, a.scores[1:]))
    assert a.scores[0] == pytest.approx(ng.copies.trust[("served", False)][shared_bucket(20)])
    assert a.scores[0] > b.scores[0] == pytest.approx(ng.copies.trust[("own", False)][shared_bucket(2)])
    # The target took 120 and 121, then went another way: root right, onward right once, wrong once.
    before_root, before_on = ng.copies.trust[("served", False)][shared_bucket(20)], ng.copies.trust[("served", True)][shared_bucket(20)]
    ng.observe(long, a, SampledTokens([120, 121, 7], num_draft_tokens=4, num_accepted_tokens=2,
                                      accepted_nodes=(0, 1), node_argmax=(120, 121, 7, 123, 124)))
    assert ng.copies.trust[("served", False)][shared_bucket(20)] == pytest.approx(before_root + TRUST_EWMA * (1 - before_root))
    on = before_on + TRUST_EWMA * (1 - before_on)
    assert ng.copies.trust[("served", True)][shared_bucket(20)] == pytest.approx(on + TRUST_EWMA * (0 - on))
    # A draft the policy pruned away is scored against the token the request went on with.
    root = ng.copies.trust[("own", False)][shared_bucket(2)]
    short.append_output_tokens([6])  # not the drafted 1
    ng.propose([short], [0])
    assert ng.copies.trust[("own", False)][shared_bucket(2)] == pytest.approx(root - TRUST_EWMA * root)
    # Chains carry scores too.
    chain = NgramProposer(tree=False, served=store).propose([long], [3])["long"]
    assert chain.is_chain and len(chain.scores) == 3


def test_a_copied_node_is_trusted_and_teaches_at_the_context_it_will_share_when_verified():
    """A node d deep is verified only after its d - 1 ancestors were accepted, when the copy
    shares d - 1 more tokens of context than at the root: its trust is that bucket's."""
    from specserve.engine.scheduler import SampledTokens
    from specserve.spec.copy_trust import shared_bucket

    ng = NgramProposer(tree=False)
    # "3 4" shares 2 tokens with its earlier occurrence, which went on 5 6 7 8.
    req = _req("r", [9, 3, 4, 5, 6, 7, 8, 1, 3, 4])
    draft = ng.propose([req], [4])["r"]
    assert draft.token_ids == (5, 6, 7, 8)
    onward = ng.copies.trust[("own", True)]
    assert len({shared_bucket(2 + d) for d in range(3)}) == 3  # three different buckets below
    assert draft.scores[0] == pytest.approx(ng.copies.trust[("own", False)][shared_bucket(2)])
    for d in (1, 2, 3):  # node d + 1 deep: shared 2 + d
        assert draft.scores[d] == pytest.approx(draft.scores[d - 1] * onward[shared_bucket(2 + d)])
    # The target took 5 and 6, then not 7: the buckets of shared 3 (right) and 4 (wrong) learn.
    before = list(onward)
    ng.observe(req, draft, SampledTokens([5, 6, 0], num_draft_tokens=4, num_accepted_tokens=2,
                                         accepted_nodes=(0, 1), node_argmax=(5, 6, 0, 8, 9)))
    changed = {i for i, (x, y) in enumerate(zip(before, onward)) if x != y}
    assert changed == {shared_bucket(3), shared_bucket(4)}
    assert onward[shared_bucket(3)] > before[shared_bucket(3)] and onward[shared_bucket(4)] < before[shared_bucket(4)]


def test_prompt_lookup_copies_a_requests_reference_and_stops_where_it_ends():
    """The reference (reference_token_ids, OpenAI's prediction) is searched as text before the
    prompt: a draft copies it, learned edits included, and never runs past its end."""
    ref = [50, 51, 52, 53, 54, 55, 56]
    ng = NgramProposer(tree=True)
    r = Request("a", [1, 2, 3], SamplingParams(reference_token_ids=ref))
    assert ng.propose([r], [8]) == {}  # nothing of the prompt occurs in the reference
    r.append_output_tokens([50, 51])
    assert ng.propose([r], [8])["a"].main_path_tokens() == (52, 53, 54, 55, 56)  # to the reference's end
    r.append_output_tokens([52, 53, 54, 55, 56])
    assert ng.propose([r], [8]) == {}
    assert ng.propose([Request("b", [1, 2, 3, 50, 51], SamplingParams())], [8]) == {}  # no reference: no copy


def test_in_front_of_a_model_drafter_a_seeded_retry_copies_the_earlier_answer_and_keeps_its_text(tiny):
    """A model drafter offers a seeded request its likeliest tokens (spec.tree.drafts_ranked), so the
    request's text is plain sampling's for its seed whatever is drafted, and the copier in front
    may draft it from earlier requests' outputs too: a retry with the same seed copies the answer
    it gave before."""
    prompts = [[1, 10, 11, 12, 13, 14, 3], [1, 20, 21, 22, 23, 24, 3]]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    want = LLM("tiny", dtype="float32", checkpoint=tiny, profile_spec_costs=False).generate(prompts, params)
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, profile_spec_costs=False, spec_method="draft",
              draft_checkpoint=tiny, draft_num_layers=1, spec_policy="always")
    first = llm.generate(prompts, params)
    copied = llm.engine.proposer.num_copied
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [o.token_ids for o in want]
    assert llm.engine.proposer.num_copied - copied >= 4  # the retries drafted from the first answers
