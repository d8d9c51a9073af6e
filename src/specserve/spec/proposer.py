"""The proposer protocol: cheap guesses of the next K tokens, verified by the target later."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from specserve.request import Request


class DraftProposal(NamedTuple):
    """Draft tokens for one request and the distribution they were drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), V] draft distribution; None = deterministic


class Proposer(ABC):
    """Proposes draft tokens for a batch of requests; never changes their accepted tokens."""

    #: True when drafts are a deterministic function of the context (p is one-hot).
    deterministic: bool = True

    def add_request(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Called when a request enters the engine."""

    def remove_request(self, request_id: str, finished: bool = True) -> None:  # noqa: B027
        """Called when a request finishes or is aborted (finished=True) or is preempted
        (finished=False): release what it holds; a preempted request comes back later."""

    @abstractmethod
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftProposal]:
        """Up to num_tokens[i] draft tokens continuing requests[i].all_token_ids.

        A proposer may return fewer tokens than asked (or none) when it has no good guess.
        """

    def check_integrity(self) -> bool:
        """Proposer-side resource bookkeeping holds (draft KV cache, if any)."""
        return True

    def live_request_ids(self) -> list[str]:
        """Requests the proposer still holds state for."""
        return []


def longest_suffix_match(
    haystack: Sequence[int], context: Sequence[int], n_min: int, n_max: int,
    k: int, prefer_from: int | None = None, exclude_tail: bool = False,
) -> tuple[list[int], int]:
    """Continuation in `haystack` of the longest suffix of `context` (n from n_max down to n_min).

    Among matches of the longest n that has one, the latest wins; with `prefer_from`, the first
    at or after it wins when there is one (a reference text is followed in order). With exclude_tail the match may
    not be the suffix itself (prompt lookup searches the context in itself). Returns up to k
    tokens and the index in haystack where the continuation starts (-1 when nothing matched).
    """
    import numpy as np

    hay = np.asarray(haystack, dtype=np.int64)
    limit = len(hay) - 1 if exclude_tail else len(hay)
    for n in range(min(n_max, len(context)), n_min - 1, -1):
        if limit - n < 0 or n == 0:
            continue
        pattern = np.asarray(context[-n:], dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(hay[:limit], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        # A match must leave at least one token after it.
        hits = hits[hits + n < len(hay)]
        if hits.size == 0:
            continue
        after = hits[hits >= prefer_from] if prefer_from is not None else hits[:0]
        start = int(after[0] if after.size else hits[-1]) + n
        return hay[start : start + k].tolist(), start
    return [], -1


PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str):  # noqa: ANN201 - decorator
    """Class decorator adding a proposer to the registry under `name`."""

    def deco(cls: type[Proposer]) -> type[Proposer]:
        PROPOSERS[name] = cls
        return cls

    return deco
