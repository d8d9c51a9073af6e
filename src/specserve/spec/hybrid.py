"""Copying first, a model drafter for the rest (`--spec-copy auto|ngram|reference`).

Requests that repeat their context (an edit of the prompt's code, a quoted passage, a list that
follows a pattern) are drafted best by copying: a long continuation for no forward pass at all.
Everywhere else a model drafter is better than nothing. This proposer asks a model-free copier
first and the model drafter only for the requests the copier has nothing for: a request whose
last `min_match` tokens occur earlier in its context (ngram) or in its reference text (reference)
gets the copy that step, and the draft passes are made for the others alone (`auto`: the
reference text where a request has one and it matches, else the context). SuffixDecoding's
hybrid with EAGLE (Oliaro et al. 2025) and Arctic Inference's suffix + draft speculation do the
same.

Verification does not care where a draft came from: a copied draft is deterministic (one-hot p),
the model's carries its distributions, and each is verified by the rule for how it was drawn. A
stateful drafter (a draft model's KV cache, an EAGLE head's features) skips the steps a request
was copied and catches up on the tokens they accepted the next time it drafts for it, as it does
after any step the policy gave it no draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.spec.proposer import PromptKVTraveller, Proposer, ProposerTraits
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens
    from specserve.request import Request

class FirstOf(Proposer):
    """Several copiers in turn: each request takes the first one's draft that has one."""

    def __init__(self, copiers: Sequence[Proposer]) -> None:
        self.copiers = list(copiers)

    @property
    def tree(self) -> bool:
        """Whether any of them drafts trees (the bench switches them all at run time)."""
        return any(getattr(c, "tree", False) for c in self.copiers)

    @tree.setter
    def tree(self, value: bool) -> None:
        for c in self.copiers:
            if hasattr(c, "tree"):
                c.tree = value

    def add_request(self, request: Request) -> None:
        for c in self.copiers:
            c.add_request(request)

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        for c in self.copiers:
            c.remove_request(request_id, finished)

    def request_finished(self, request: Request) -> None:
        for c in self.copiers:
            c.request_finished(request)

    def reset_served(self) -> None:
        for c in self.copiers:
            c.reset_served()

    def served_tokens(self) -> int:
        return sum(c.served_tokens() for c in self.copiers)

    def copy_resumes(self, requests: Sequence[Request]) -> bool:
        return any(c.copy_resumes(requests) for c in self.copiers)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        out: dict[str, DraftTree] = {}
        left = [(r, k) for r, k in zip(requests, num_tokens) if k > 0]
        for c in self.copiers:
            if not left:
                break
            out.update(c.propose([r for r, _ in left], [k for _, k in left]))
            left = [(r, k) for r, k in left if r.request_id not in out]
        return out

    def check_integrity(self) -> bool:
        return all(c.check_integrity() for c in self.copiers)

    def live_request_ids(self) -> list[str]:
        return sorted({rid for c in self.copiers for rid in c.live_request_ids()})

    def memory_bytes(self) -> int:
        return sum(c.memory_bytes() for c in self.copiers)


class StepDrafts:
    """A model-free proposer's drafts made before K is chosen (Proposer.free_drafts), kept for
    the same step's propose(): cut there to the nodes asked (model-free proposers list nodes best
    first, parents before children), made anew for a request that has grown since."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.trees: dict[str, DraftTree] = {}
        self._looked: dict[str, int] = {}  # each request's length when its draft was made

    def make(self, requests: Sequence[Request], budget: int) -> dict[str, DraftTree]:
        """Drafts of `budget` nodes for `requests`, kept."""
        self.trees = self.proposer.propose(requests, [budget] * len(requests))
        self._looked = {r.request_id: len(r.all_token_ids) for r in requests}
        return self.trees

    def take(self, asked: Sequence[tuple[Request, int]]) -> dict[str, DraftTree]:
        """Drafts of `asked` (request, nodes): the kept ones cut to the nodes, new ones where a
        request was not seen as it is now."""
        out, ask = {}, []
        for r, k in asked:
            if k <= 0:
                continue
            if self._looked.get(r.request_id) == len(r.all_token_ids):
                if r.request_id in self.trees:
                    out[r.request_id] = self.trees[r.request_id].truncate(k)
            else:
                ask.append((r, k))
        if ask:
            out.update(self.proposer.propose([r for r, _ in ask], [k for _, k in ask]))
        return out

    def clear(self) -> None:
        """Forget this step's drafts."""
        self.trees, self._looked = {}, {}


class DrafterPair(Proposer):
    """A model drafter paired with a model-free proposer (`other`): what the engine sets and reads
    is the drafter's (its cost per pass, its prompt KV, its features and catch-up), except that
    both keep per-request state and learn from finished requests. Subclasses decide how the two
    draft (HybridProposer: one or the other; JoinedProposer: both in one tree)."""

    def __init__(self, other: Proposer, drafter: Proposer) -> None:
        if other.traits.cost != "flat" or drafter.traits.cost != "per_pass":
            raise ValueError(f"a {type(self).__name__} pairs a model-free proposer with a model drafter")
        self.other = other
        self.drafter = drafter
        # The drafter's: its cost per pass, trees, hidden states, prompt KV that travels.
        self.traits: ProposerTraits = drafter.traits
        self._drafted = False  # the drafter made passes in the last propose() (subclasses set it)

    # ------------------------------------------------------------------ what the engine sets / reads
    @property
    def pass_cost_ratio(self) -> float:  # type: ignore[override]
        return self.drafter.pass_cost_ratio

    @pass_cost_ratio.setter
    def pass_cost_ratio(self, value: float) -> None:
        self.drafter.pass_cost_ratio = value

    @property
    def tree(self) -> bool:
        """Trees or chains, for both (the bench switches them at run time)."""
        return bool(getattr(self.drafter, "tree", False))

    @tree.setter
    def tree(self, value: bool) -> None:
        for p in (self.other, self.drafter):
            if hasattr(p, "tree"):
                p.tree = value

    @property
    def last_pass_time_s(self) -> float | None:
        """The drafter's last pass time, None when the last step made no drafter pass (the other
        drafted for every request: no pass to learn the draft cost from)."""
        return getattr(self.drafter, "last_pass_time_s", None) if self._drafted else None

    def prompt_kv_traveller(self) -> PromptKVTraveller | None:
        """The drafter's prompt KV travels as it would alone (the other has none)."""
        return self.drafter.prompt_kv_traveller()

    def __getattr__(self, name: str) -> object:
        """Anything else is the drafter's (its runner, its KV cache manager, its head)."""
        if name in ("other", "drafter"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, request: Request) -> None:
        """Both keep per-request state (the reference text; the drafter's caches)."""
        self.other.add_request(request)
        self.drafter.add_request(request)

    def request_finished(self, request: Request) -> None:
        """Both learn from what it wrote."""
        self.other.request_finished(request)
        self.drafter.request_finished(request)

    def reset_served(self) -> None:
        """Both forget earlier requests' outputs."""
        self.other.reset_served()
        self.drafter.reset_served()

    def served_tokens(self) -> int:
        return self.other.served_tokens() + self.drafter.served_tokens()

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Both release the request."""
        self.other.remove_request(request_id, finished)
        self.drafter.remove_request(request_id, finished)

    # ------------------------------------------------------------------ the drafter's alone
    def free_drafts(self, requests: Sequence[Request]) -> list[bool] | None:
        return self.drafter.free_drafts(requests)

    def decline_free(self, request_ids: set[str]) -> None:
        self.drafter.decline_free(request_ids)

    def copy_resumes(self, requests: Sequence[Request]) -> bool:
        """The model-free proposer's copies (the copier in front, lookahead's pool: none)."""
        return self.other.copy_resumes(requests)

    def observe_hidden(self, hidden: dict) -> None:
        """Every verified token's features reach a feature drafter, copied steps' included."""
        self.drafter.observe_hidden(hidden)

    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.feature_layers()

    def time_pass(self, batch: int) -> float:
        return self.drafter.time_pass(batch)

    def catchup_tokens(self, request: Request) -> int:
        return self.drafter.catchup_tokens(request)

    def time_catchup(self, tokens: int) -> float:
        return self.drafter.time_catchup(tokens)

    # ------------------------------------------------------------------ bookkeeping
    def check_integrity(self) -> bool:
        return self.other.check_integrity() and self.drafter.check_integrity()

    def live_request_ids(self) -> list[str]:
        return sorted(set(self.other.live_request_ids()) | set(self.drafter.live_request_ids()))

    def memory_bytes(self) -> int:
        return self.drafter.memory_bytes() + self.other.memory_bytes()


class HybridProposer(DrafterPair):
    """A copier's draft where it has one, else the model drafter's; traits are the drafter's."""

    def __init__(self, copier: Proposer, drafter: Proposer, copier_name: str, min_match: int, budget: int = 64) -> None:
        # copier: a model-free proposer that drafts nothing where it has no match (ngram,
        # reference, or several in turn: FirstOf)
        super().__init__(copier, drafter)
        self.copier_name = copier_name
        self.min_match = min_match
        self.budget = budget  # the most nodes a step may ask for (the copies free_drafts makes are cut to k)
        self._copies = StepDrafts(copier)  # free_drafts' copies, kept for the propose() of the same step
        self.num_copied = 0  # drafts the copier gave (counted over the proposer's life)
        self.num_modelled = 0  # drafts the drafter gave

    @property
    def copier(self) -> Proposer:
        """The model-free proposer in front."""
        return self.other

    # ------------------------------------------------------------------ drafting
    def free_drafts(self, requests: Sequence[Request]) -> list[bool]:
        """The requests the copier has a match for now: their drafts make no draft pass. The
        copies (of the largest budget a step may ask for) are kept for this step's propose()."""
        copies = self._copies.make(requests, self.budget)
        return [r.request_id in copies for r in requests]

    def decline_free(self, request_ids: set[str]) -> None:
        """The drafter drafts for these this step: their copies are dropped."""
        for rid in request_ids:
            self._copies.trees.pop(rid, None)

    def _copy(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """This step's copies cut to k nodes (see StepDrafts)."""
        out = self._copies.take(list(zip(requests, num_tokens)))
        self._copies.clear()
        return out

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """The copier's drafts, then the drafter's for the requests left without one."""
        copies = self._copy(requests, num_tokens)
        rest = [(r, k) for r, k in zip(requests, num_tokens) if k > 0 and r.request_id not in copies]
        out = dict(copies)
        self._drafted = bool(rest)
        if rest:
            out.update(self.drafter.propose([r for r, _ in rest], [k for _, k in rest]))
        self.num_copied += len(copies)
        self.num_modelled += len(out) - len(copies)
        return out

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:
        """Verify outputs go to the drafter (copiers learn nothing from them)."""
        self.drafter.observe(request, draft, result)

    def describe(self) -> str:
        inner = self.drafter.describe()
        copy = f"copying first ({self.copier_name}, tails of >= {self.min_match} tokens)"
        return f"{inner}; {copy}" if inner else copy
