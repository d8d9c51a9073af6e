"""Lookahead decoding (Fu et al. 2024): a model-free proposer fed by the target's own outputs.

Candidates from several sources, verified together in one target pass as one draft tree:

* A Jacobi window: guesses y_1..y_W for the next W tokens. The target computes every one of
  them in the verify pass anyway (they are a branch of the tree), so it also gives, at each, its
  own next-token prediction o_j made after y_1..y_j. Jacobi iteration takes those outputs as the
  next step's guesses (shifted past what was accepted); where the guesses were right they are
  accepted, and a window that has converged on a stretch of text is accepted whole.
* An n-gram pool keyed by a token: continuations seen after it, in the prompt, in the output,
  and along the window's trajectory (after y_j the target went on with o_j, o_{j+1}, ...), the
  way lookahead decoding collects n-grams from its lookahead branch. Continuations of the
  request's last token become branches, weighted by how often they were seen.

* The request's own earlier occurrences of its last 2-6 tokens, and what followed them.
* Earlier requests' outputs that share at least the context's last 4 tokens, and what followed
  there (SuffixDecoding's global cache, see specserve.spec.served).
* A corpus (on by default: the Python standard library's source and the model's own answers
  from `specserve build-corpus`, see specserve.spec.corpus): what followed the context's tail in
  a datastore of text (REST, He et al. 2023). On a small model's coding output the window and the pool alone were right about
  one step in twenty; the corpus guesses ``self``, ``range(``, ``return`` and their like.

The draft grows best first: a node's children are the tokens the sources give after its path,
each scored by the chance that some source is right (noisy-or of the sources' shares, each
weighted by how much it is trusted), and the budget's highest path scores form the tree.

Candidates are a function of the context and of earlier target outputs, never of this step's
verification, so the tree is deterministic (one-hot proposals) and exact for greedy and sampled
requests alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.request import Request
from specserve.spec.copy_trust import TRUST_PRIOR_ONWARD, TRUST_PRIOR_ROOT, shared_bucket
from specserve.spec.proposer import Proposer, ProposerTraits, register_proposer
from specserve.spec.served import ServedSource
from specserve.spec.suffix import TokenArray, suffix_matches
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens
    from specserve.spec.corpus import CorpusNgrams
    from specserve.spec.served import ServedOutputs

POOL_PER_KEY = 8  # continuations kept per key token (the most weighted)
# How far each source is trusted: the chance that its likeliest next token is the target's,
# learned per proposer from every verified node (the target's argmax there) and from every
# step's root; a source's other candidates get that chance scaled by their share against its
# likeliest one. Kept apart for the root and for nodes past it ("onward": the path so far
# taken as right). The priors are where they start.
TRUST_PRIOR = {"window": 0.1, "pool": 0.2, "match": 0.4, "corpus1": 0.2, "corpus2": 0.3, "corpus3": 0.4,
               "corpus4": 0.45, "corpus6": 0.5}
TRUST_EWMA = 0.02  # weight of one step's outcome in a source's trust
# Past the root, a continuation of the request's own text whose earlier tokens were right is
# right far more often than a first guess (a window converges on stretches, a copy runs on).
TRUST_ONWARD = {"window": 0.8, "pool": 0.5, "match": 0.7}
# Earlier requests' outputs are trusted by how much context their match shares: one source per
# copy_trust.py bucket ("served0", "served1", ...), with that bucket's priors.
TRUST_PRIOR.update({f"served{b}": t for b, t in enumerate(TRUST_PRIOR_ROOT)})
TRUST_ONWARD.update({f"served{b}": t for b, t in enumerate(TRUST_PRIOR_ONWARD)})
MATCH_MIN, MATCH_MAX = 2, 6  # context tails looked up in the request's own text
MATCHES = 4  # its most recent matches, each a continuation
CORPUS_BRANCHES = 3  # corpus continuations considered per node
MIN_SCORE = 0.02  # nodes less likely than this are not drafted
CONTEXT_TAIL = 8  # tokens of context the corpus lookups see (its longest order is shorter)
# An earlier output sharing this much of the context drafts alone (the other sources' guesses
# took nodes from a copy that held: 5.1 against ngram's 8.1 tokens per step on a retried ask).
SERVED_ALONE = 18


class _State:
    """One request's window and pool."""

    __slots__ = ("window", "pool", "folded", "drafted", "guessed_at", "guesses", "tokens")

    def __init__(self, window: list[int]) -> None:
        self.window = window  # guesses for the tokens after the request's last one
        self.pool: dict[int, dict[tuple[int, ...], float]] = {}
        self.folded = 0  # key positions of the request's text whose n-grams are in the pool
        self.drafted: list[int] = []  # the window as drafted last step
        self.guessed_at = -1  # the position the sources' last root guesses were for
        # path below the root -> source -> the next token it found likeliest there (last draft)
        self.guesses: dict[tuple[int, ...], dict[str, int]] = {}
        self.tokens = TokenArray()  # the request's text as an array, for the per-step search


@register_proposer("lookahead")
class LookaheadProposer(ServedSource, Proposer):
    """Jacobi window plus n-gram pool; learns from the target's outputs at every draft node."""

    traits = ProposerTraits(cost="flat", trees=True, tree_by_default=True, needs_verify_outputs=True, prior_acceptance=0.4,
                            scores_predict_acceptance=True)

    def __init__(self, window: int = 6, ngram: int = 4, corpus: CorpusNgrams | None = None, tree: bool = True,
                 served: ServedOutputs | None = None, corpus_note: str = "") -> None:
        self.window = window
        self.n = ngram
        self.corpus = corpus
        self.served = served
        self.tree = tree  # False: the best child at every level only (a chain)
        self.corpus_note = corpus_note  # what the corpus holds, for the start-up summary (spec.corpus.corpus_note)
        self.trust = {(s, False): t for s, t in TRUST_PRIOR.items()}
        self.trust.update({(s, True): TRUST_ONWARD.get(s, t) for s, t in TRUST_PRIOR.items()})
        self._states: dict[str, _State] = {}

    def describe(self) -> str:
        """For the start-up summary: the corpus, and the served outputs where they are kept."""
        return "; ".join(part for part in (self.corpus_note, ServedSource.describe(self)) if part)

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
        """The best k nodes grown from the window, the pool and the corpus."""
        out = {}
        for req, k in zip(requests, num_tokens):
            st = self._states.get(req.request_id)
            if st is None or k <= 0:
                continue
            ids = req.all_token_ids
            self._learn_trust(st, ids)
            self._fold(st, ids)
            st.drafted = st.window[: min(k, self.window)]
            shared, served = self.served.continuations(ids, k) if self.served is not None else (0, [])
            alone = shared >= SERVED_ALONE  # retracing an earlier answer: the budget goes to that copy
            own = []
            if not alone:
                # Where the last MATCH_MIN+ tokens occurred before, what followed them (the pool's
                # one-token key cannot tell those places from the others).
                arr = st.tokens.view(ids)
                n, starts = suffix_matches(arr, arr, MATCH_MIN, MATCH_MAX, exclude_tail=True)
                own = [("window", [(st.drafted, 1.0)] if st.drafted else []),
                       ("pool", list(st.pool.get(ids[-1], {}).items())),
                       ("match", [(ids[s : s + k], 1.0) for s in starts[-MATCHES:].tolist()] if n else [])]
            own.append((f"served{shared_bucket(shared)}", served))
            st.guessed_at = len(ids)
            tree = self._grow(ids[-CONTEXT_TAIL:], own, k, st.guesses, corpus=not alone)
            if tree is not None:
                out[req.request_id] = tree
        return out

    def _grow(self, tail: list[int], own: list[tuple[str, list]], budget: int,
              guesses: dict[tuple[int, ...], dict[str, int]], corpus: bool = True) -> DraftTree | None:
        """Best-first: the budget's nodes of highest path score (a node's score is its parent's
        times its own chance given the path, so parents always come before their children).
        `own`: per source of the request's own text, its continuations (token sequence, weight);
        `guesses` receives, per expanded path, each source's likeliest token after it; corpus:
        whether the corpus is asked too."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap: list[tuple[float, int, int, tuple[int, ...], list]] = []  # (-score, order, parent, path, own sources)
        order = 0

        def push_children(parent: int, path: tuple[int, ...], score: float, live: list) -> None:
            nonlocal order
            kids = self._children(tail + list(path), len(path), live, guesses.setdefault(path, {}), corpus)
            for tok, p, through in kids if self.tree else kids[:1]:
                order += 1
                heapq.heappush(heap, (-score * p, order, parent, (*path, tok), through))

        push_children(-1, (), 1.0, own)
        while heap and len(tokens) < budget:
            neg, _, parent, path, live = heapq.heappop(heap)
            if -neg < MIN_SCORE:
                break  # the rest are less likely still: not worth verifying anywhere
            tokens.append(path[-1])
            parents.append(parent)
            scores.append(-neg)
            push_children(len(tokens) - 1, path, -neg, live)
        if not tokens:
            return None
        return DraftTree(tuple(tokens), tuple(parents), scores=tuple(scores))

    def _children(self, context: list[int], depth: int, own: list[tuple[str, list]],
                  guesses: dict[str, int], corpus: bool = True) -> list[tuple[int, float, list]]:
        """[(token, chance, own sources' continuations through it)] at `depth` past the
        request's last token, most likely first. Each source gives its tokens a chance (its
        trust for its likeliest, scaled by share for the others); a token's chance is the
        noisy-or over the sources that give it."""
        miss: dict[int, float] = {}
        through: dict[int, list] = {}

        def offer(source: str, shares: dict[int, float]) -> None:
            top = max(shares.values())
            guesses[source] = max(shares, key=shares.__getitem__)
            trust = self.trust[(source, depth > 0)]
            for t, w in shares.items():
                miss[t] = miss.get(t, 1.0) * (1.0 - trust * w / top)

        for source, conts in own:
            weights: dict[int, float] = {}
            kept: dict[int, list] = {}
            for seq, w in conts:
                if len(seq) > depth:
                    t = int(seq[depth])
                    weights[t] = weights.get(t, 0.0) + w
                    kept.setdefault(t, []).append((seq, w))
            if weights:
                offer(source, weights)
                for t, cs in kept.items():
                    through.setdefault(t, []).append((source, cs))
        if corpus and self.corpus is not None:
            k, nxt = self.corpus.next_tokens(context)
            if nxt:
                offer(f"corpus{k}", dict(nxt[:CORPUS_BRANCHES]))
        chance = {t: 1.0 - m for t, m in miss.items()}
        norm = max(1.0, sum(chance.values()))  # the chances of disjoint events sum to at most 1
        ranked = sorted(chance.items(), key=lambda tc: -tc[1])[: CORPUS_BRANCHES + 1]
        return [(t, c / norm, through.get(t, [])) for t, c in ranked]

    def _learn_trust(self, st: _State, ids: list[int]) -> None:
        """A step whose draft was not verified (pruned away): score the sources' root guesses
        against the token the request went on with."""
        if 0 <= st.guessed_at < len(ids) and () in st.guesses:
            self._score(st.guesses[()], ids[st.guessed_at], onward=False)
        st.guesses = {}
        st.guessed_at = -1

    def _score(self, guesses: dict[str, int], actual: int, onward: bool) -> None:
        for source, guess in guesses.items():
            key = (source, onward)
            self.trust[key] += TRUST_EWMA * (float(guess == actual) - self.trust[key])

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:
        """Jacobi step: the target's outputs along the window become the next guesses; the
        window's trajectory adds n-grams to the pool."""
        st = self._states.get(request.request_id)
        if st is None or not result.node_argmax:
            return
        # Every verified node tells each source that guessed after it whether the target agreed.
        paths: list[tuple[int, ...]] = []
        for tok, parent in zip(draft.token_ids, draft.parents):
            paths.append((*(paths[parent] if parent >= 0 else ()), tok))
        for path, argmax in zip([(), *paths], result.node_argmax):
            if path in st.guesses:
                self._score(st.guesses[path], argmax, onward=bool(path))
        st.guesses = {}  # scored: not again at the next proposal
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
