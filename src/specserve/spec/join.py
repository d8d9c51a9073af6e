"""A model drafter's tree joined by a model-free proposer's candidates (`--spec-join lookahead`).

A head drafting from the target's features and lookahead (Jacobi window, n-gram pool, the
model's own answers and a corpus) are right in different places: the head where the next
tokens follow from the meaning so far, lookahead where the text repeats itself or the model's
habits (a closing phrase it always writes, a stock idiom of code). Copying first
(specserve.spec.hybrid) picks one of the two per step; joining verifies both in the same pass,
as one tree, and keeps the longest path the target accepts. The model-free candidates cost no
draft pass, only verify rows, and the policy prices every node by its score like any other
(SmolLM2 with its default EAGLE head, 8 held-out prompts per set, every step drafting: 1.79 /
1.52 tokens per forward on coding / prose alone, 2.44 / 1.81 joined).

Under the adaptive policy the helper's candidates are also offered alone, as free drafts (no
draft pass, like a copier's): the policy weighs them against the drafter's joined drafts per
request (SpecPolicy.prefer_copy, each source's acceptance learned apart) and takes them where the
drafter's passes would not pay, so a drafter the policy holds back (a head whose pass is a large
share of a small target's step; prose, where a head is weak) still leaves lookahead's drafts.
Measured on two Zen 5 cores (adaptive, trees, batch 1): the join yields the most tokens per
target forward (SmolLM2 and its head 1.77 / 1.35 on coding / prose against the head's 1.60 /
1.09; Qwen2.5-Coder-1.5B 1.79 / 1.27 against 1.70 / 1.04) but not the most tokens per second:
lookahead drafts for every request every step before the policy weighs its drafts, and its rows
cost about what they save (a Zen 5's verify cost rises steeply past 9 rows), so lookahead alone
ran as fast or faster. It is off by default; where verifying more rows is nearly free (a GPU at
small batch) it is the lever.

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

from specserve.spec.hybrid import DrafterPair, StepDrafts
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

    def __init__(self, drafter: Proposer, helper: Proposer, helper_name: str, budget: int = 8,
                 free_budget: int = 0) -> None:
        super().__init__(helper, drafter)
        self.helper_name = helper_name
        # The fewest nodes the helper is asked for where the drafter drafts: the adaptive policy
        # often gives a model drafter a small budget (its passes cost), while the helper's
        # candidates cost verify rows alone, which the policy's pruning weighs node by node.
        self.budget = budget
        # Where the policy would rather not pay the drafter's passes, the helper's candidates
        # alone are offered as free drafts of this many nodes (free_drafts; 0: never, the drafter
        # drafts every step the policy gives the request a draft, as under policy 'always').
        self.free_budget = free_budget
        # The drafter's traits, and the verify outputs the helper learns from (lookahead's window).
        self.traits = replace(drafter.traits, needs_verify_outputs=(drafter.traits.needs_verify_outputs
                                                                    or helper.traits.needs_verify_outputs))
        self.num_joined = 0  # drafts the helper added nodes to (over the proposer's life)
        self.num_nodes_added = 0  # nodes it added there
        self.num_helper_alone = 0  # drafts the helper made alone (the drafter held back)
        self._helper_drafts = StepDrafts(helper)  # this step's helper drafts made by free_drafts
        self._alone: set[str] = set()  # requests whose helper draft is offered alone this step

    @property
    def helper(self) -> Proposer:
        """The model-free proposer whose candidates join."""
        return self.other

    def free_drafts(self, requests: Sequence[Request]) -> list[bool] | None:
        """The drafter's own free drafts (a copier in front of it), and, with free_budget, every
        other request the helper has candidates for: drafted by the helper alone, such a request
        takes no draft pass. The policy weighs them against the drafter's (joined) drafts
        (SpecPolicy.prefer_copy) and declines the ones the drafter should make."""
        inner = self.drafter.free_drafts(requests)
        if not self.free_budget:  # (then nothing is ever kept here)
            return inner
        trees = self._helper_drafts.make(requests, self.free_budget)
        own = [False] * len(requests) if inner is None else inner
        self._alone = {r.request_id for r, f in zip(requests, own) if not f and r.request_id in trees}
        return [f or r.request_id in self._alone for r, f in zip(requests, own)]

    def decline_free(self, request_ids: set[str]) -> None:
        """The drafter drafts for these (joined by the helper's candidates)."""
        self._alone -= request_ids
        self.drafter.decline_free(request_ids)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """The helper's drafts alone for the requests free_drafts offered them for (and the
        policy took), the drafter's for the others, each joined by the helper's candidates for
        the same request (as many nodes as the step gives the request, at least `budget`; the
        policy prunes the joint tree)."""
        alone = [(r, k) for r, k in zip(requests, num_tokens) if k > 0 and r.request_id in self._alone]
        rest = [(r, k) for r, k in zip(requests, num_tokens) if k > 0 and r.request_id not in self._alone]
        out = self._helper_drafts.take(alone)
        self.num_helper_alone += len(out)
        self._drafted = bool(rest)
        if rest:
            own = self.drafter.propose([r for r, _ in rest], [k for _, k in rest])
            asked = [(r, max(k, self.budget)) for r, k in rest if self._joinable(r, own.get(r.request_id))]
            extra = self._helper_drafts.take(asked)
            for rid, tree in extra.items():
                mine = own.get(rid)
                if mine is None:
                    own[rid] = tree
                    continue
                joint = join_trees(mine, tree)
                if len(joint) > len(mine):
                    self.num_joined += 1
                    self.num_nodes_added += len(joint) - len(mine)
                    own[rid] = joint
            out.update(own)
        self._helper_drafts.clear()
        self._alone = set()
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
        if self.free_budget:
            join += ", and alone where its passes do not pay"
        return f"{inner}; {join}" if inner else join
