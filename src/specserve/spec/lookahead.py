"""Lookahead decoding (Fu et al. 2024): a model-free proposer fed by the target's own outputs.

Two sources of candidates, verified together in one target pass as one draft tree:

* A Jacobi window: guesses y_1..y_W for the next W tokens. The target computes every one of
  them in the verify pass anyway (they are a branch of the tree), so it also gives, at each, its
  own next-token prediction o_j made after y_1..y_j. Jacobi iteration takes those outputs as the
  next step's guesses (shifted past what was accepted); where the guesses were right they are
  accepted, and a window that has converged on a stretch of text is accepted whole.
* An n-gram pool keyed by a token: continuations seen after it, in the prompt, in the output,
  and along the window's trajectory (after y_j the target went on with o_j, o_{j+1}, ...), the
  way lookahead decoding collects n-grams from its lookahead branch. Continuations of the
  request's last token become branches, weighted by how often they were seen.

Candidates are a function of the context and of earlier target outputs, never of this step's
verification, so the tree is deterministic (one-hot proposals) and exact for greedy and sampled
requests alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.request import Request
from specserve.spec.proposer import Proposer, ProposerTraits, register_proposer
from specserve.spec.suffix import weighted_tree
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens

POOL_PER_KEY = 8  # continuations kept per key token (the most weighted)
WINDOW_WEIGHT = 1.0  # the window's branch against a continuation seen once (weight 1)


class _State:
    """One request's window and pool."""

    __slots__ = ("window", "pool", "folded", "drafted")

    def __init__(self, window: list[int]) -> None:
        self.window = window  # guesses for the tokens after the request's last one
        self.pool: dict[int, dict[tuple[int, ...], float]] = {}
        self.folded = 0  # key positions of the request's text whose n-grams are in the pool
        self.drafted: list[int] = []  # the window as drafted last step


@register_proposer("lookahead")
class LookaheadProposer(Proposer):
    """Jacobi window plus n-gram pool; learns from the target's outputs at every draft node."""

    traits = ProposerTraits(cost="flat", trees=True, tree_by_default=True, needs_verify_outputs=True, prior_acceptance=0.4)

    def __init__(self, window: int = 6, ngram: int = 4) -> None:
        self.window = window
        self.n = ngram
        self._states: dict[str, _State] = {}

    def add_request(self, request: Request) -> None:
        """Start the window from the prompt's tail and the pool from the prompt's n-grams."""
        st = _State(list(request.prompt_token_ids[-self.window :]))
        self._fold(st, request.all_token_ids)
        self._states[request.request_id] = st

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """A finished request's state goes; a preempted one keeps its window and pool."""
        if finished:
            self._states.pop(request_id, None)

    def live_request_ids(self) -> list[str]:
        """Requests with a window and pool."""
        return list(self._states)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """The window and the pool's continuations of the last token, k nodes at most."""
        out = {}
        for req, k in zip(requests, num_tokens):
            st = self._states.get(req.request_id)
            if st is None or k <= 0:
                continue
            self._fold(st, req.all_token_ids)
            st.drafted = st.window[: min(k, self.window)]
            conts: list[tuple[Sequence[int], float]] = [(st.drafted, WINDOW_WEIGHT)] if st.drafted else []
            conts += [(c[:k], w) for c, w in st.pool.get(req.all_token_ids[-1], {}).items()]
            tree = weighted_tree(conts, k)
            if tree is not None:
                out[req.request_id] = tree
        return out

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:
        """Jacobi step: the target's outputs along the window become the next guesses; the
        window's trajectory adds n-grams to the pool."""
        st = self._states.get(request.request_id)
        if st is None or not result.node_argmax:
            return
        nodes = draft.match(st.drafted)
        outs = [result.node_argmax[0]] + [result.node_argmax[n + 1] for n in nodes]  # outs[j]: prediction after y_j
        ys = [draft.token_ids[n] for n in nodes]
        for j, y in enumerate(ys, start=1):  # after y_j the target went on with o_j, o_{j+1}, ...
            cont = tuple(outs[j : j + self.n - 1])
            if cont:
                self._add(st, y, cont)
        emitted = len(result.token_ids)  # the new last token sits emitted positions past the old one
        guesses = outs[emitted:] + st.window[len(outs) :]
        st.window = (guesses + [outs[-1]] * self.window)[: self.window]

    # ------------------------------------------------------------------ pool
    def _fold(self, st: _State, tokens: list[int]) -> None:
        """Add the n-grams of the request's text not added yet (a key once n - 1 tokens follow it)."""
        last = len(tokens) - self.n  # the last key with a full continuation
        for i in range(st.folded, last + 1):
            self._add(st, tokens[i], tuple(tokens[i + 1 : i + self.n]))
        st.folded = max(st.folded, last + 1)

    @staticmethod
    def _add(st: _State, key: int, cont: tuple[int, ...]) -> None:
        entries = st.pool.setdefault(key, {})
        entries[cont] = entries.get(cont, 0.0) + 1.0
        if len(entries) > POOL_PER_KEY:
            del entries[min(entries, key=entries.__getitem__)]
