"""--spec-join: a model-free proposer's candidates joined into a model drafter's trees."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec.join import JoinedProposer, join_trees
from specserve.spec.proposer import Proposer, ProposerTraits
from specserve.spec.tree import DraftTree, SiblingDraw


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.token_ids[n] for n in tree.path(i)) for i in range(len(tree))}


def _random_tree(rng: random.Random, n: int, vocab: int = 4) -> DraftTree:
    """A tree of n nodes with path scores (each child below its parent) and repeated tokens."""
    tokens, parents, scores = [], [], []
    for i in range(n):
        p = rng.randrange(-1, i)
        tokens.append(rng.randrange(vocab))
        parents.append(p)
        scores.append((1.0 if p < 0 else scores[p]) * rng.uniform(0.1, 1.0))
    return DraftTree(tuple(tokens), tuple(parents), scores=tuple(scores))


def test_joined_tree_holds_every_path_of_both_once_best_first():
    rng = random.Random(0)
    for _ in range(300):
        a, b = _random_tree(rng, rng.randrange(1, 12)), _random_tree(rng, rng.randrange(1, 12))
        j = join_trees(a, b)
        assert j.draw is SiblingDraw.DETERMINISTIC and j.dists is None
        assert _paths(j) == _paths(a) | _paths(b)
        assert len(j) == len(_paths(j))  # a path both hold is one node
        # best first: every prefix is a tree of the highest-scored nodes that can be taken
        assert all(j.scores[i] <= j.scores[p] for i, p in enumerate(j.parents) if p >= 0)
        for i in range(1, len(j)):
            frontier = [c for c in range(i, len(j)) if j.parents[c] < i]
            assert j.scores[i] == max(j.scores[c] for c in frontier)
        # a shared path keeps the higher of its two scores
        score_of = {}
        for t in (a, b):
            for i in range(len(t)):
                key = tuple(t.token_ids[n] for n in t.path(i))
                score_of[key] = max(score_of.get(key, 0.0), t.scores[i])
        for i in range(len(j)):
            assert j.scores[i] == score_of[tuple(j.token_ids[n] for n in j.path(i))]


def test_joined_tree_of_unscored_trees_counts_their_nodes_certain():
    chain = DraftTree.chain([5, 6, 7])
    other = DraftTree((5, 9), (-1, 0))
    j = join_trees(chain, other)
    assert _paths(j) == {(5,), (5, 6), (5, 6, 7), (5, 9)}
    assert j.scores == (1.0,) * 4


class _Fixed(Proposer):
    """Hands out the trees it was given; records what it saw."""

    def __init__(self, cost: str, trees: dict[str, DraftTree]) -> None:
        self.traits = ProposerTraits(cost=cost, trees=True, needs_verify_outputs=cost == "flat")
        self.trees = trees
        self.asked: dict[str, int] = {}  # request -> the nodes it was asked for
        self.observed: list[DraftTree] = []

    def propose(self, requests, num_tokens):  # noqa: ANN001, ANN201
        self.asked.update((r.request_id, k) for r, k in zip(requests, num_tokens) if k > 0)
        return {r.request_id: self.trees[r.request_id] for r, k in zip(requests, num_tokens)
                if k > 0 and r.request_id in self.trees}

    def observe(self, request, draft, result) -> None:  # noqa: ANN001
        self.observed.append(draft)


def _req(rid: str, temperature: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, temperature=temperature))


def test_a_sampled_request_keeps_the_drafters_own_distributions():
    """Greedy requests and deterministic drafts are joined; a sampled request whose drafter drew
    from its distributions keeps that tree (its rejection test needs them); a request the drafter
    gave nothing gets the helper's tree; a request given no budget gets nothing."""
    probs = torch.full((2, 8), 1 / 8)
    drawn = DraftTree((3, 4), (-1, 0), SiblingDraw.WITHOUT_REPLACEMENT, probs, (0, 1), (0.5, 0.2))
    fixed = DraftTree((3,), (-1,), scores=(0.9,))
    extra = DraftTree((3, 5), (-1, 0), scores=(0.6, 0.4))
    model = _Fixed("per_pass", {"greedy": drawn, "sampled": drawn, "copied": fixed, "zero": drawn})
    helper = _Fixed("flat", {k: extra for k in ("greedy", "sampled", "copied", "none", "zero")})
    join = JoinedProposer(model, helper, "lookahead", budget=6)
    assert join.traits.needs_verify_outputs and join.traits.cost == "per_pass"
    reqs = [_req("greedy", 0.0), _req("sampled", 0.8), _req("copied", 0.8), _req("none", 0.8), _req("zero", 0.0)]
    out = join.propose(reqs, [4, 9, 4, 9, 0])
    assert out["sampled"] is drawn
    assert _paths(out["greedy"]) == {(3,), (3, 4), (3, 5)} and out["greedy"].draw is SiblingDraw.DETERMINISTIC
    assert _paths(out["copied"]) == {(3,), (3, 5)}
    assert out["none"] is extra
    assert "zero" not in out and "zero" not in helper.asked and "sampled" not in helper.asked
    # the helper is asked for at least its budget where the drafter drafts (the policy prunes)
    assert helper.asked == {"greedy": 6, "copied": 6, "none": 9}
    assert join.num_joined == 2 and join.num_nodes_added == 2
    # the helper learns from the verified tree (lookahead's window); the model drafter does not ask
    join.observe(reqs[0], out["greedy"], None)
    assert helper.observed == [out["greedy"]] and model.observed == []


def test_a_join_needs_a_model_drafter_and_a_model_free_helper():
    with pytest.raises(ValueError, match="model-free"):
        JoinedProposer(_Fixed("flat", {}), _Fixed("flat", {}), "lookahead")
    with pytest.raises(ValueError, match="model-free"):
        JoinedProposer(_Fixed("per_pass", {}), _Fixed("per_pass", {}), "lookahead")


def test_under_the_adaptive_policy_the_helper_drafts_alone_where_the_drafter_is_held_back():
    """With a free budget, every request the helper has candidates for is offered as a free
    draft (no draft pass). One the policy takes is drafted by the helper alone, from the tree
    free_drafts made (the helper is not asked again; cut to the step's budget); one it declines
    is drafted by the model drafter and joined by the same candidates; the drafter is asked for
    none of the others."""
    drawn = DraftTree((3, 4), (-1, 0), scores=(0.8, 0.5))
    helper_tree = DraftTree((3, 5, 6, 7), (-1, 0, 1, 2), scores=(0.9, 0.7, 0.5, 0.3))
    model = _Fixed("per_pass", {k: drawn for k in ("a", "b", "c")})
    helper = _Fixed("flat", {"a": helper_tree, "b": helper_tree})
    join = JoinedProposer(model, helper, "lookahead", budget=3, free_budget=10)
    reqs = [_req("a", 0.0), _req("b", 0.8), _req("c", 0.0)]
    assert join.free_drafts(reqs) == [True, True, False]
    assert helper.asked == {"a": 10, "b": 10, "c": 10}
    join.decline_free({"b"})
    helper.asked.clear()
    out = join.propose(reqs, [2, 6, 5])
    assert out["a"].token_ids == (3, 5) and out["a"].parents == (-1, 0)  # the helper's alone, cut to 2
    assert _paths(out["b"]) == {(3,), (3, 4), (3, 5), (3, 5, 6), (3, 5, 6, 7)}  # joined
    assert out["c"] is drawn  # the helper had nothing for it
    assert model.asked == {"b": 6, "c": 5} and helper.asked == {}
    assert join.num_helper_alone == 1 and join.num_joined == 1
    # a step whose request grew since free_drafts asks the helper anew
    assert join.free_drafts(reqs[:1]) == [True]
    helper.asked.clear()
    reqs[0].append_output_tokens([9])
    out = join.propose(reqs[:1], [3])
    assert helper.asked == {"a": 3} and out["a"] is helper_tree and model.asked == {"b": 6, "c": 5}
    # no free budget (policy 'always'): the drafter's own free drafts, here none
    always = JoinedProposer(model, helper, "lookahead", budget=3)
    assert always.free_drafts(reqs) is None
