"""Inference with reference: drafts are copied from a text the output is expected to track.

The request carries `reference_text` (the document being edited, the code being refactored).
Wherever the tail of the output matches a span of the reference, the proposer offers what
follows that span, keeping a cursor so an edited document is followed in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specserve.request import Request
from specserve.spec.proposer import DraftProposal, Proposer, longest_suffix_match, register_proposer


@register_proposer("reference")
class ReferenceProposer(Proposer):
    """Copies continuations from each request's tokenized reference text; p is one-hot."""

    deterministic = True

    def __init__(
        self, encode: Callable[[str], list[int]] | None, ngram_min: int = 1, ngram_max: int = 4
    ) -> None:
        self.encode = encode
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._refs: dict[str, list[int]] = {}
        self._cursor: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        """Keep the request's reference tokens (tokenizing its reference text once)."""
        params = request.sampling_params
        ids = params.reference_token_ids
        if ids is None and params.reference_text and self.encode is not None:
            ids = self.encode(params.reference_text)
        if ids:
            self._refs[request.request_id] = list(ids)
            self._cursor[request.request_id] = 0

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Forget the reference of a finished request (a preempted one keeps it)."""
        if finished:
            self._refs.pop(request_id, None)
            self._cursor.pop(request_id, None)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftProposal]:
        """Drafts from the reference for each request that has one."""
        out = {}
        for req, k in zip(requests, num_tokens):
            ref = self._refs.get(req.request_id)
            if k <= 0 or not ref:
                continue
            draft, start = longest_suffix_match(
                ref, req.all_token_ids, self.ngram_min, self.ngram_max, k,
                prefer_from=self._cursor.get(req.request_id, 0),
            )
            if draft:
                self._cursor[req.request_id] = start
                out[req.request_id] = DraftProposal(draft, None)
        return out

    def live_request_ids(self) -> list[str]:
        """Requests with a stored reference."""
        return list(self._refs)
