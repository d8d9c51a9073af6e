"""Prompt-lookup (n-gram) proposer: copy what followed the last earlier occurrence of the tail."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.request import Request
from specserve.spec.proposer import DraftProposal, Proposer, longest_suffix_match, register_proposer


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Searches the request's own prompt and output for its last n tokens; no model, p one-hot."""

    deterministic = True

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftProposal]:
        """Drafts for each request with k > 0 (possibly fewer than k tokens, or none)."""
        out = {}
        for req, k in zip(requests, num_tokens):
            if k <= 0:
                continue
            toks = req.all_token_ids
            draft, _ = longest_suffix_match(toks, toks, self.ngram_min, self.ngram_max, k, exclude_tail=True)
            if draft:
                out[req.request_id] = DraftProposal(draft, None)
        return out
