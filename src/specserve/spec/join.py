"""A model drafter's tree joined by a model-free proposer's candidates (`--spec-join lookahead`).

A head drafting from the target's features and lookahead (Jacobi window, n-gram pool, the
model's own answers and a corpus) are right in different places: the head where the next
tokens follow from the meaning so far, lookahead where the text repeats itself or the model's
habits (a closing phrase it always writes, a stock idiom of code). Copying first
(specserve.spec.hybrid) picks one of the two per step; joining verifies both in the same pass,
as one tree, and keeps the longest path the target accepts. The model-free candidates cost no
draft pass, only verify rows, and the policy prices every node by its score like any other
(SmolLM2 with its default EAGLE head, 8 held-out prompts per set, every step drafting: 1.79 /
1.52 tokens per forward on coding / prose alone, 2.44 / 1.81 joined). On two CPU cores the rows
a join adds cost about what they save (a Zen 5's verify cost rises steeply past 9 rows), so it is
off by default; where verifying more rows is nearly free (a GPU at small batch) it is the lever.

Exactness. A joined node's children come from two sources, so no one draw rule covers them;
the joint tree is therefore verified as deterministic candidates, which is exact for any
candidates chosen without looking at the target's randomness: greedy verification follows the
target's argmax whatever drew the children, and the sampled rule for deterministic children
(each rejected child's mass removed from the target distribution) holds for any candidate set
fixed before the draw. It forgoes, for sampled requests, the acceptance the drafter's
distributions buy in the rejection test, so a sampled request whose drafter drew from its
distributions keeps the drafter's tree alone; greedy requests, and drafts that are
deterministic anyway, are joined.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from specserve.spec.hybrid import DrafterPair
from specserve.spec.proposer import Proposer
from specserve.spec.tree import DraftTree, SiblingDraw

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens
    from specserve.request import Request


def join_trees(a: DraftTree, b: DraftTree) -> DraftTree:
    """One deterministic tree holding every path of `a` and of `b` (a path both hold is one
    node, scored the higher of its two scores), listed best score first with parents before
    children, so that any prefix of its nodes is a tree of the best-scored nodes (what the
    policy's pruning keeps). A tree without scores counts its nodes as certain (score 1)."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(tree: DraftTree) -> None:
        mine: list[int] = []
        for i, (tok, par) in enumerate(zip(tree.token_ids, tree.parents)):
            key = (mine[par] if par >= 0 else -1, tok)
            sc = tree.scores[i] if tree.scores else 1.0
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(tok)
                parents.append(key[0])
                scores.append(sc)
            else:
                scores[node] = max(scores[node], sc)
            mine.append(node)

    add(a)
    add(b)
    # Best first, each node after its parent: a heap over the nodes whose parent is placed.
    kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    order: list[int] = []
    heap = [(-scores[c], c) for c in kids[0]]
    heapq.heapify(heap)
    while heap:
        _, node = heapq.heappop(heap)
        order.append(node)
        for c in kids[node + 1]:
            heapq.heappush(heap, (-scores[c], c))
    new = {-1: -1}
    for pos, old in enumerate(order):
        new[old] = pos
    return DraftTree(tuple(tokens[o] for o in order), tuple(new[parents[o]] for o in order),
                     SiblingDraw.DETERMINISTIC, scores=tuple(scores[o] for o in order))


class JoinedProposer(DrafterPair):
    """The drafter's trees with the helper's candidates joined in; traits are the drafter's."""

    def __init__(self, drafter: Proposer, helper: Proposer, helper_name: str, budget: int = 8) -> None:
        super().__init__(helper, drafter)
        self.helper_name = helper_name
        # The fewest nodes the helper is asked for where the drafter drafts: the adaptive policy
        # often gives a model drafter a small budget (its passes cost), while the helper's
        # candidates cost verify rows alone, which the policy's pruning weighs node by node.
        self.budget = budget
        # The drafter's traits, and the verify outputs the helper learns from (lookahead's window).
        self.traits = replace(drafter.traits, needs_verify_outputs=(drafter.traits.needs_verify_outputs
                                                                    or helper.traits.needs_verify_outputs))
        self.num_joined = 0  # drafts the helper added nodes to (over the proposer's life)
        self.num_nodes_added = 0  # nodes it added there

    @property
    def helper(self) -> Proposer:
        """The model-free proposer whose candidates join."""
        return self.other

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """The drafter's trees, each joined by the helper's candidates for the same request (as
        many nodes as the step gives the request, at least `budget`; the policy prunes the joint
        tree)."""
        out = self.drafter.propose(requests, num_tokens)
        asked = [(r, k) for r, k in zip(requests, num_tokens) if k > 0 and self._joinable(r, out.get(r.request_id))]
        if not asked:
            return out
        extra = self.helper.propose([r for r, _ in asked], [max(k, self.budget) for _, k in asked])
        for rid, tree in extra.items():
            own = out.get(rid)
            if own is None:
                out[rid] = tree
                continue
            joint = join_trees(own, tree)
            if len(joint) > len(own):
                self.num_joined += 1
                self.num_nodes_added += len(joint) - len(own)
                out[rid] = joint
        return out

    @staticmethod
    def _joinable(request: Request, own: DraftTree | None) -> bool:
        """Greedy requests, drafts that are deterministic anyway, and requests the drafter gave
        nothing (see the module docstring)."""
        return own is None or own.draw is SiblingDraw.DETERMINISTIC or request.sampling_params.is_greedy

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:
        """Verify outputs, by the paths of the tree verified, to each that learns from them."""
        if self.drafter.traits.needs_verify_outputs:
            self.drafter.observe(request, draft, result)
        if self.helper.traits.needs_verify_outputs:
            self.helper.observe(request, draft, result)

    def describe(self) -> str:
        inner = self.drafter.describe()
        join = f"{self.helper_name}'s candidates joined into its trees"
        return f"{inner}; {join}" if inner else join
