"""The proposer protocol: cheap guesses of the next K tokens, verified by the target later."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.request import Request


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
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """A draft of up to num_tokens[i] nodes continuing requests[i].all_token_ids.

        A proposer may return fewer nodes than asked (or none) when it has no good guess.
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
    from specserve.spec.suffix import suffix_matches

    n, starts = suffix_matches(haystack, context, n_min, n_max, exclude_tail)
    if n == 0:
        return [], -1
    after = starts[starts - n >= prefer_from] if prefer_from is not None else starts[:0]
    start = int(after[0] if after.size else starts[-1])
    return list(haystack[start : start + k]), start


PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str):  # noqa: ANN201 - decorator
    """Class decorator adding a proposer to the registry under `name`."""

    def deco(cls: type[Proposer]) -> type[Proposer]:
        PROPOSERS[name] = cls
        return cls

    return deco
