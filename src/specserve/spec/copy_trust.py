"""How far a copied draft is trusted: learned chances that a copy's next token is the target's.

Model-free copiers (prompt lookup, inference with reference, earlier requests' outputs) draft
what followed an earlier occurrence of the context's tail. How often such a copy holds depends
above all on how much context the match shares: a 30-token match of an earlier answer almost
always goes on as it did, a one-token match of a common word rarely does. `CopyTrust` keeps, per
source, place (the root, or past a node the target took) and shared-length bucket, the chance
that the copy's likeliest token is the target's, learned from the target's argmax at every
verified node; it scores draft trees with it, so the policy verifies the nodes whose predicted
acceptance pays (ProposerTraits.scores_predict_acceptance).

A node is verified only where its ancestors were accepted, and then the copy shares its depth - 1
more tokens of context than the match did at the root: a node d deep is scored, and teaches, at
the bucket of shared + d - 1. (Scored at the root's bucket, every node after an edit or a
paraphrase broke the copy looked as doubtful as the first one, and the policy regrew the copy one
node per step: Qwen 1.5B on an edit prompt accepted 1, 2, 2, 3, 3 tokens in the steps after each
break, where the copy then ran on for tens of tokens.)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens

# Shared-context buckets (their lower bounds) and the trusts a bucket starts from.
SHARED_BUCKETS = (1, 2, 3, 4, 6, 10, 18)
TRUST_PRIOR_ROOT = (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.8)
TRUST_PRIOR_ONWARD = (0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)
TRUST_EWMA = 0.02  # weight of one observation in a trust
MAX_SHARED = 32  # how far back a match's shared context is measured


def shared_bucket(shared: int) -> int:
    """Index of the SHARED_BUCKETS bucket of a match sharing `shared` tokens of context."""
    return bisect.bisect_right(SHARED_BUCKETS, shared) - 1


def shared_length(haystack: Sequence[int], starts: Sequence[int], context: Sequence[int], limit: int = MAX_SHARED) -> int:
    """The most tokens (up to limit) that end right before one of `starts` in `haystack` and
    equal the context's last ones (how much context a match really shares)."""
    best = 0
    for start in starts:
        n = 0
        while n < limit and n < start and n < len(context) and haystack[start - 1 - n] == context[-1 - n]:
            n += 1
        best = max(best, n)
    return best


class CopyTrust:
    """Trusts per (source, onward) and shared-length bucket; the last draft of each request."""

    def __init__(self, sources: Sequence[str]) -> None:
        self.trust = {(src, onward): list(TRUST_PRIOR_ONWARD if onward else TRUST_PRIOR_ROOT)
                      for src in sources for onward in (False, True)}
        # request id -> (source, shared length, position, root guess) of its last draft, until scored
        self._last: dict[str, tuple[str, int, int, int]] = {}

    def scored(self, request_id: str, position: int, tree: DraftTree, source: str, shared: int) -> DraftTree:
        """The tree (nodes best first, scores = shares of the matches through them, or none for
        a single copy) with each node's predicted acceptance as its score: its share of its
        parent's matches x the trust at its place and shared context x its parent's score.
        Remembered for scoring."""
        share = tree.scores or (1.0,) * len(tree)
        root, onward = self.trust[(source, False)][shared_bucket(shared)], self.trust[(source, True)]
        trust = [onward[shared_bucket(shared + d - 1)] for d in range(tree.max_depth + 1)]  # by depth
        scores: list[float] = []
        for j, (p, depth) in enumerate(zip(tree.parents, tree.depths)):
            if p < 0:
                scores.append(root * share[j])
            else:
                scores.append(scores[p] * trust[depth] * share[j] / share[p])
        # node 0 is the likeliest root child (parents come first; nodes best first)
        self._last[request_id] = (source, shared, position, tree.token_ids[0])
        return DraftTree(tree.token_ids, tree.parents, scores=tuple(scores))

    def score_unverified(self, request_id: str, tokens: Sequence[int]) -> None:
        """A draft the policy pruned away was never verified: its root guess is scored against
        the token the request went on with."""
        last = self._last.pop(request_id, None)
        if last is not None and last[2] < len(tokens):
            self._learn(last[0], False, shared_bucket(last[1]), tokens[last[2]] == last[3])

    def observe(self, request_id: str, draft: DraftTree, result: SampledTokens) -> None:
        """Score a verified draft: its likeliest root child against the target's argmax there,
        and below every node the target took, that node's likeliest child."""
        last = self._last.pop(request_id, None)
        if last is None or not result.node_argmax:
            return
        source, shared = last[0], last[1]
        children, depths = draft.children, draft.depths
        self._learn(source, False, shared_bucket(shared), draft.token_ids[children[0][0]] == result.node_argmax[0])
        for node in result.accepted_nodes:
            kids = children[node + 1]
            if kids:  # the child is depths[node] + 1 deep: its context shares depths[node] more tokens
                right = draft.token_ids[kids[0]] == result.node_argmax[node + 1]
                self._learn(source, True, shared_bucket(shared + depths[node]), right)

    def forget(self, request_id: str) -> None:
        """The request's last draft will not be scored."""
        self._last.pop(request_id, None)

    def _learn(self, source: str, onward: bool, bucket: int, right: bool) -> None:
        t = self.trust[(source, onward)]
        t[bucket] += TRUST_EWMA * (float(right) - t[bucket])
