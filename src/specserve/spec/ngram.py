"""Prompt-lookup (n-gram) proposer: copy what followed earlier occurrences of the tail, in the
request's own text or in earlier requests' outputs (SuffixDecoding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.request import Request
from specserve.spec.proposer import (
    Proposer,
    ProposerTraits,
    register_proposer,
)
from specserve.spec.served import (
    TRUST_PRIOR_ONWARD,
    TRUST_PRIOR_ROOT,
    ServedOutputs,
    ServedSource,
    shared_bucket,
)
from specserve.spec.suffix import suffix_matches, top_path, weighted_tree
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens

# Occurrences of the matched tail kept per step (the latest ones): enough for the weights.
MAX_OCCURRENCES = 64
MATCHES_MEASURED = 4  # the request's latest own matches whose shared context is measured
MAX_SHARED = 32  # how far back a match's shared context is measured
# How far a draft is trusted: the chance that its likeliest token is the target's, learned from
# every verified step, by source (the request's own text or the served outputs), by place (the
# root, or past a node the target took) and by how much context the match shares (served.py's
# buckets and priors).
TRUST_EWMA = 0.02  # weight of one observation in a trust


def shared_length(tokens: Sequence[int], starts: Sequence[int], limit: int) -> int:
    """The most tokens (up to limit) that end right before one of `starts` in `tokens` and equal
    the tokens' own last ones (how much context a match really shares)."""
    best = 0
    for start in starts:
        n = 0
        while n < limit and n < start and tokens[start - 1 - n] == tokens[-1 - n]:
            n += 1
        best = max(best, n)
    return best


@register_proposer("ngram")
class NgramProposer(ServedSource, Proposer):
    """Searches the request's own prompt and output for its last n tokens; no model, p one-hot.

    As a tree (the default) the draft holds the continuations of every earlier occurrence of
    the longest matching tail, the most frequent first (see specserve.spec.suffix); as a chain,
    the continuation of the latest occurrence. With `served` (SuffixDecoding's global cache,
    see specserve.spec.served) the outputs of earlier requests are searched too, and they draft
    where they share more of the context's tail than the request's own text does.

    Each node is scored with its chance to be accepted: its share of the matches through its
    parent, times the trust in the source at that place and shared length (learned from the
    target's argmax at every verified node), times its parent's score. The policy verifies the
    nodes whose scores pay (ProposerTraits.scores_predict_acceptance), so a 30-token match of
    an earlier answer drafts long where a one-token match of a common word drafts little.
    """

    # Trees by default: on edit prompts (Qwen2.5-Coder 1.5B on auto, AVX2 EPYC, batch 1) a tree of
    # every earlier occurrence beat the latest occurrence's chain, 1.70x vs 1.59x plain.
    traits = ProposerTraits(cost="flat", trees=True, tree_by_default=True, needs_verify_outputs=True,
                            prior_acceptance=0.5, scores_predict_acceptance=True)

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, tree: bool = True,
                 served: ServedOutputs | None = None) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tree = tree
        self.served = served
        self.trust = {(src, onward): list(TRUST_PRIOR_ONWARD if onward else TRUST_PRIOR_ROOT)
                      for src in ("own", "served") for onward in (False, True)}
        # request id -> (source, bucket, position, root guess) of its last draft, until scored
        self._last: dict[str, tuple[str, int, int, int]] = {}

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Its last draft is not scored any more."""
        self._last.pop(request_id, None)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """Drafts of up to k nodes for each request with k > 0 (fewer, or none, without matches)."""
        out = {}
        for req, k in zip(requests, num_tokens):
            toks = req.all_token_ids
            self._score_unverified(req.request_id, toks)
            if k <= 0:
                continue
            n, starts = suffix_matches(toks, toks, self.ngram_min, self.ngram_max, exclude_tail=True)
            own = shared_length(toks, starts[-MATCHES_MEASURED:].tolist(), MAX_SHARED) if n else 0
            shared, served = self.served.continuations(toks, k) if self.served is not None else (0, [])
            if shared > own:
                # An earlier output shares more of the context's tail than the request's own text does.
                source, conts = "served", served
            else:
                source, shared = "own", own
                conts = [(toks[s : s + k], 1.0) for s in starts[::-1][:MAX_OCCURRENCES].tolist()] if n else []
            tree = weighted_tree(conts, k) if conts else None
            if tree is None:
                continue
            if not self.tree:
                tree = top_path(tree)
            out[req.request_id] = tree = self._scored(tree, source, shared_bucket(shared))
            self._last[req.request_id] = (source, shared_bucket(shared), len(toks), tree.token_ids[0])
        return out

    def _scored(self, tree: DraftTree, source: str, bucket: int) -> DraftTree:
        """The tree with each node's predicted acceptance as its score (see the class docstring)."""
        share = tree.scores or (1.0,) * len(tree)
        root, onward = self.trust[(source, False)][bucket], self.trust[(source, True)][bucket]
        scores: list[float] = []
        for j, p in enumerate(tree.parents):
            parent_share, parent_score, trust = (1.0, 1.0, root) if p < 0 else (share[p], scores[p], onward)
            scores.append(parent_score * trust * share[j] / parent_share)
        return DraftTree(tree.token_ids, tree.parents, scores=tuple(scores))

    def _learn(self, source: str, onward: bool, bucket: int, right: bool) -> None:
        t = self.trust[(source, onward)]
        t[bucket] += TRUST_EWMA * (float(right) - t[bucket])

    def _score_unverified(self, request_id: str, tokens: Sequence[int]) -> None:
        """A draft the policy pruned away was never verified: its root guess is scored against
        the token the request went on with."""
        last = self._last.pop(request_id, None)
        if last is not None and last[2] < len(tokens):
            self._learn(last[0], False, last[1], tokens[last[2]] == last[3])

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:
        """Score the draft against the target: its likeliest root child against the target's
        argmax there, and below every node the target took, that node's likeliest child."""
        last = self._last.pop(request.request_id, None)
        if last is None or not result.node_argmax:
            return
        source, bucket = last[0], last[1]
        children = draft.children
        self._learn(source, False, bucket, draft.token_ids[children[0][0]] == result.node_argmax[0])
        for node in result.accepted_nodes:
            kids = children[node + 1]
            if kids:
                self._learn(source, True, bucket, draft.token_ids[kids[0]] == result.node_argmax[node + 1])
