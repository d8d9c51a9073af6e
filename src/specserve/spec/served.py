"""What the engine has written before: finished requests' outputs, looked up by a context's tail.

SuffixDecoding (Oliaro et al. 2024; vLLM's `suffix` method) drafts from two places: the request's
own prompt and output, and a global cache of the outputs of earlier requests. The second is what
makes it fast on agents, retries, regenerations and templated answers: a request whose text goes
the way an earlier answer went copies that answer, although nothing in its own context holds it.

The store keeps the outputs of the last `max_requests` finished requests (and at most
`max_tokens` tokens of them), the oldest dropped first, each after the last MAX_MATCH tokens of
its prompt: a hit may share that context, so a retried ask drafts its earlier answer from its
first decode step on (with the output alone it shared nothing until KEY_LEN tokens of the new
answer were out). Every window of KEY_LEN tokens that an output token follows is indexed
by its hash; a lookup takes the context's last KEY_LEN tokens, follows each recent hit back to
see how many tokens of context it really shares (a hash collision shares fewer than KEY_LEN and
is dropped), and returns what followed the hits that share the most. Like every draft source it
changes only what is drafted: verification keeps the output the target's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specserve.request import Request

KEY_LEN = 4  # tokens of context a hit must share at least (shorter shared tails are noise across requests)
MAX_MATCH = 32  # how far back a hit's shared context is measured (SuffixDecoding's tree depth is of this order)
MAX_HITS = 16  # the most recent hits of a key weighed per lookup (bounds a lookup's time)
_POS_BITS = 32  # an index entry is entry_no << _POS_BITS | position
COMPACT_MIN = 1 << 16  # dropped outputs' index entries rebuilt away once they pass this and the live ones
# A hit's continuation is drafted up to this many tokens per token of context it shares (vLLM's
# suffix_decoding_max_spec_factor, 1.0 there too): a short chance match drafts little.
SPEC_FACTOR = 1.0


class ServedOutputs:
    """Finished requests' output tokens with an index of their KEY_LEN-token windows."""

    def __init__(self, max_requests: int = 10_000, max_tokens: int = 1 << 19) -> None:
        if max_requests < 0 or max_tokens < 0:
            raise ValueError("max_requests and max_tokens must be >= 0")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        # entry_no -> (tokens (int32): the prompt's tail, then the output; the tail's length), oldest first
        self._entries: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._index: dict[int, list[int]] = {}  # hash of KEY_LEN tokens -> entries (latest last)
        self._next = 0
        self.num_tokens = 0
        self._stale = 0  # index entries that point at dropped outputs (compacted when they dominate)
        self._live = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, tokens: Sequence[int], context: Sequence[int] = ()) -> None:
        """Remember one finished request's output `tokens`, after the last MAX_MATCH tokens of
        its `context` (its prompt); windows are indexed where an output token follows them, so
        an output shorter than KEY_LEN + 1 without context teaches nothing."""
        lead = list(context[-MAX_MATCH:]) if len(tokens) else []
        ids = lead + list(tokens)
        first = max(KEY_LEN, len(lead))  # the first window end that an output token follows
        if self.max_requests == 0 or len(ids) <= first or len(ids) > self.max_tokens:
            return
        no = self._next
        self._next += 1
        self._entries[no] = (np.asarray(ids, dtype=np.int32), len(lead))
        self.num_tokens += len(ids)
        base = no << _POS_BITS
        for end in range(first, len(ids)):  # the window ids[end - KEY_LEN : end], continued at end
            self._index.setdefault(hash(tuple(ids[end - KEY_LEN : end])), []).append(base | end)
        self._live += len(ids) - first
        while len(self._entries) > self.max_requests or self.num_tokens > self.max_tokens:
            _, (old, old_lead) = self._entries.popitem(last=False)
            self.num_tokens -= len(old)
            self._stale += len(old) - max(KEY_LEN, old_lead)
            self._live -= len(old) - max(KEY_LEN, old_lead)
        if self._stale > max(self._live, COMPACT_MIN):
            self._compact()

    def clear(self) -> None:
        """Forget every output."""
        self._entries.clear()
        self._index.clear()
        self.num_tokens = self._stale = self._live = 0

    def may_continue(self, context: Sequence[int]) -> bool:
        """Whether continuations(context, ...) could find a hit: its last KEY_LEN tokens' hash
        is indexed (one lookup, no walk)."""
        return len(context) >= KEY_LEN and bool(self._entries) and bool(self._index.get(hash(tuple(context[-KEY_LEN:]))))

    def continuations(self, context: Sequence[int], budget: int) -> tuple[int, list[tuple[list[int], float]]]:
        """(shared, continuations): the most context any recent hit shares (0: no hit of at least
        KEY_LEN tokens) and the continuations of the hits sharing that much, latest first, each of
        weight 1 and at most `budget` and SPEC_FACTOR * shared tokens long."""
        if budget <= 0 or len(context) < KEY_LEN or not self._entries:
            return 0, []
        hits = self._index.get(hash(tuple(context[-KEY_LEN:])))
        if not hits:
            return 0, []
        tail = list(context[-MAX_MATCH:])[::-1]  # tail[j]: the context's token j places from its end
        best, found = 0, []
        seen = 0
        mask = (1 << _POS_BITS) - 1
        for h in reversed(hits):
            entry = self._entries.get(h >> _POS_BITS)
            if entry is None:
                continue  # dropped; compacted later
            arr = entry[0]
            end = h & mask
            n = 0
            while n < len(tail) and n < end and arr[end - 1 - n] == tail[n]:
                n += 1
            if n >= KEY_LEN:  # not a hash collision
                if n > best:
                    best, found = n, []
                if n == best:
                    found.append(arr[end : end + budget].tolist())
            seen += 1
            if seen >= MAX_HITS:
                break
        n = min(budget, max(1, int(SPEC_FACTOR * best)))
        return best, [(c[:n], 1.0) for c in found]

    def _compact(self) -> None:
        """Rebuild the index from the outputs still kept."""
        kept = list(self._entries.values())
        self.clear()
        for arr, lead in kept:
            self.add(arr[lead:].tolist(), arr[:lead].tolist())


class ServedSource:
    """Proposer hooks of a proposer that drafts from a `served` store (None: off)."""

    served: ServedOutputs | None = None

    def request_finished(self, request: Request) -> None:
        """Its output joins the served outputs, after its prompt's last tokens."""
        if self.served is not None:
            self.served.add(request.output_token_ids, request.prompt_token_ids)

    def reset_served(self) -> None:
        """Forget the served outputs."""
        if self.served is not None:
            self.served.clear()

    def served_tokens(self) -> int:
        """Tokens of the served outputs kept."""
        return self.served.num_tokens if self.served is not None else 0

    def describe(self) -> str:
        """For the start-up summary."""
        return f"also from the outputs of the last {self.served.max_requests:,} requests" if self.served is not None else ""
