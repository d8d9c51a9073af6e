"""Prompt-lookup (n-gram) proposer: copy what followed earlier occurrences of the tail."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.request import Request
from specserve.spec.proposer import (
    Proposer,
    ProposerTraits,
    longest_suffix_match,
    register_proposer,
)
from specserve.spec.suffix import suffix_matches, weighted_tree
from specserve.spec.tree import DraftTree

# Occurrences of the matched tail kept per step (the latest ones): enough for the weights.
MAX_OCCURRENCES = 64


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Searches the request's own prompt and output for its last n tokens; no model, p one-hot.

    As a tree (the default) the draft holds the continuations of every earlier occurrence of
    the longest matching tail, the most frequent first (see specserve.spec.suffix); as a chain,
    the continuation of the latest occurrence.
    """

    # Trees by default: on edit prompts (Qwen2.5-Coder 1.5B on auto, AVX2 EPYC, batch 1) a tree of
    # every earlier occurrence beat the latest occurrence's chain, 1.70x vs 1.59x plain.
    traits = ProposerTraits(cost="flat", trees=True, tree_by_default=True, prior_acceptance=0.5)

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, tree: bool = True) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tree = tree

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """Drafts of up to k nodes for each request with k > 0 (fewer, or none, without matches)."""
        out = {}
        for req, k in zip(requests, num_tokens):
            if k <= 0:
                continue
            toks = req.all_token_ids
            if not self.tree:
                draft, _ = longest_suffix_match(toks, toks, self.ngram_min, self.ngram_max, k, exclude_tail=True)
                if draft:
                    out[req.request_id] = DraftTree.chain(draft)
                continue
            n, starts = suffix_matches(toks, toks, self.ngram_min, self.ngram_max, exclude_tail=True)
            latest_first = starts[::-1][:MAX_OCCURRENCES].tolist()
            tree = weighted_tree([(toks[s : s + k], 1.0) for s in latest_first], k) if n else None
            if tree is not None:
                out[req.request_id] = tree
        return out
