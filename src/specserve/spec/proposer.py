"""The proposer protocol: cheap guesses of the next K tokens, verified by the target later."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from specserve.spec.tree import DraftTree

# A context whose last this-many tokens occur earlier in what a copier copies from is text a copy
# carries on (code being re-emitted, a quoted passage): it ends a rate-guard hold (copy_resumes).
# Copies sharing 6 tokens of context are accepted at the root more often than not (the copy
# trust's buckets); at 8, Qwen 1.5B re-emitting code after a docstring it wrote spent 7 more
# held steps (`    config = {}\n    with open(path` before the hold ended) than with no hold.
RESUME_MATCH = 6

if TYPE_CHECKING:
    import numpy as np
    import torch

    from specserve.engine.scheduler import SampledTokens
    from specserve.kv_cache.pages import LayerKV
    from specserve.request import Request


@dataclass(frozen=True)
class ProposerTraits:
    """What the engine and the policy need to know about a proposer, declared by the proposer."""

    # A model drafter pays one forward pass per draft depth level ("per_pass", measured by the
    # policy); model-free proposers a flat, negligible cost ("flat").
    cost: str = "flat"
    # Drafts may branch (the policy then sizes node budgets, not chain lengths).
    trees: bool = False
    # `--spec-tree auto` drafts trees with this proposer (else chains): whichever measured faster.
    tree_by_default: bool = False
    # Learns from the target's output at every draft node after verification (lookahead).
    needs_verify_outputs: bool = False
    # Reads the target's hidden states (feature-level drafters).
    needs_hidden_states: bool = False
    # Its draft trees' scores estimate each node's chance to be accepted (up to a factor the
    # policy learns): the policy then prices every node by its score instead of by a chain K.
    scores_predict_acceptance: bool = False
    # The prior acceptance a new request starts from before any is measured.
    prior_acceptance: float = 0.5
    # Its prompt KV can travel between disaggregated workers (it is a `PromptKVTraveller`).
    prompt_kv_travels: bool = False


class PromptFeed(NamedTuple):
    """Bring a drafter's KV of `request` to its first `upto` tokens on a prefill worker.
    `next_token` is the prompt's token after them (a feature drafter's slot upto-1 pairs the
    target's feature there with it; None where it is unknown)."""

    request: Request
    upto: int
    next_token: int | None = None


class PromptKVTraveller(ABC):
    """A drafter whose prompt KV can travel between disaggregated workers: a prefill worker
    holding the same drafter computes it beside the target's (`feed_prompts`) and sends it; the
    decode worker's drafter places it (`expect_prompt_kv`), drafts nothing for the request until
    it has arrived (`prompt_kv_arrived`) and catches up itself when it will not come
    (`drop_prompt_kv`). The KV lives in paged caches (`prompt_kv_caches`) at the request's slots
    (`prompt_kv_slots`); the connector moves it layer by layer like the target's."""

    @abstractmethod
    def prompt_kv_caches(self) -> list[LayerKV]:
        """Per layer, the paged cache tensors ([blocks, block_size, ...]) that travel."""

    @abstractmethod
    def prompt_kv_shape(self) -> dict[str, Any]:
        """The KV's per-token shape as `KVLayout` fields (layers, heads, head dim, dtypes)."""

    @abstractmethod
    def prompt_kv_identity(self) -> dict[str, Any]:
        """What else must agree between two workers for one's KV to serve the other's drafter."""

    @abstractmethod
    def prompt_kv_slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat cache slots of the request's tokens [start, end) (blocks it holds)."""

    @abstractmethod
    def feed_prompts(self, feeds: Sequence[PromptFeed]) -> dict[str, int]:
        """Prefill side: bring each request's KV to its first `upto` tokens; returns the tokens
        each request's pages now hold (a request it has no room or no input for is left out)."""

    @abstractmethod
    def expect_prompt_kv(self, request: Request, num_tokens: int) -> int | None:
        """Decode side: hold blocks for the first num_tokens tokens of a request whose KV
        arrives; returns the tokens already held (prefix-cache hits), None without room."""

    @abstractmethod
    def prompt_kv_pending(self, request_id: str) -> bool:
        """Blocks are held for this request's arriving KV (False once dropped or ended)."""

    @abstractmethod
    def prompt_kv_arrived(self, request_id: str) -> None:
        """Every layer of the expected KV is in the held blocks: draft from there on."""

    @abstractmethod
    def drop_prompt_kv(self, request_id: str) -> None:
        """The KV will not come: free its blocks; the drafter catches the request up itself."""


class Proposer(ABC):
    """Proposes draft tokens for a batch of requests; never changes their accepted tokens."""

    traits: ProposerTraits = ProposerTraits()
    #: Per-pass proposers: seconds of one drafting pass over a target step's, kept current by
    #: the engine (a tree stops growing where one more pass would not pay for itself).
    pass_cost_ratio: float = 0.0

    def add_request(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Called when a request enters the engine."""

    def remove_request(self, request_id: str, finished: bool = True) -> None:  # noqa: B027
        """Called when a request finishes or is aborted (finished=True) or is preempted
        (finished=False): release what it holds; a preempted request comes back later."""

    def request_finished(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Called with a request that finished (or was aborted), before remove_request: what it
        wrote may draft later requests (specserve.spec.served)."""

    def served_tokens(self) -> int:
        """Tokens of earlier requests' outputs kept to draft from (request_finished)."""
        return 0

    def reset_served(self) -> None:  # noqa: B027 - optional hook
        """Forget what earlier requests wrote (request_finished); benchmarks that run one prompt
        several times call it between the runs."""

    @abstractmethod
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """A draft of up to num_tokens[i] nodes continuing requests[i].all_token_ids.

        A proposer may return fewer nodes than asked (or none) when it has no good guess.
        """

    def may_draft(self, request: Request) -> bool:
        """False only where propose() would surely draft nothing for the request now, known
        without its search (a copier whose text holds no earlier occurrence of the last token).
        The engine then does not ask propose() for the request, and tells the policy that nothing
        was drafted, as an empty proposal would have."""
        return True

    def prompt_kv_traveller(self) -> PromptKVTraveller | None:
        """The drafter whose prompt KV travels between disaggregated workers (traits.prompt_kv_travels)."""
        return self if self.traits.prompt_kv_travels and isinstance(self, PromptKVTraveller) else None

    def free_drafts(self, requests: Sequence[Request]) -> list[bool] | None:
        """Before K is chosen: which requests' next drafts could take no draft pass (a hybrid's
        copies, see specserve.spec.hybrid); None when that is what traits.cost says for all."""
        return None

    def copy_resumes(self, requests: Sequence[Request]) -> bool:
        """Whether some request's last RESUME_MATCH tokens occur earlier in the text this proposer
        copies from (its own text, its reference, earlier outputs), with a token after them.

        Asked while the policy's rate guard holds speculation off (SpecPolicy.copy_resumes): the
        text the hold was measured on has given way to text a copy carries on, as when a request
        arrives. Cheap (one search of the tail); False for proposers that do not copy."""
        return False

    def decline_free(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """This step drafts for these requests the way that takes a pass (the policy declined
        the free drafts free_drafts offered)."""

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:  # noqa: B027
        """After verification (traits.needs_verify_outputs): the draft and what the target did
        with it (result.node_argmax: the target's argmax at the root and at every node)."""

    def observe_hidden(self, hidden: dict) -> None:  # noqa: B027 - optional hook
        """After every step (traits.needs_hidden_states): request id -> HiddenRows, the target's
        hidden states of the tokens that step verified (specserve.engine.runner)."""

    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose residual streams (after that many layers) the proposer reads beside
        the last hidden state (EAGLE-3's low and middle features); () for the last alone."""
        return ()

    def time_pass(self, batch: int) -> float:
        """Seconds of one drafting pass over `batch` requests (start-up profiling of per-pass
        proposers; model-free ones cost nothing to speak of)."""
        return 1e-4

    def catchup_tokens(self, request: Request) -> int:
        """Tokens of `request` the proposer must still process before it can draft for it (a
        draft model's cache behind the request: its prompt on first use, everything generated
        while it did not draft). The policy charges that one-off cost; 0 for stateless proposers."""
        return 0

    def time_catchup(self, tokens: int) -> float:
        """Seconds to catch one request up on `tokens` tokens (start-up profiling; 0: no cost)."""
        return 0.0

    def check_integrity(self) -> bool:
        """Proposer-side resource bookkeeping holds (draft KV cache, if any)."""
        return True

    def live_request_ids(self) -> list[str]:
        """Requests the proposer still holds state for."""
        return []

    def describe(self) -> str:
        """Settings worth showing in the start-up summary (empty: none)."""
        return ""

    def memory_bytes(self) -> int:
        """Memory the proposer holds (a drafter's weights and KV cache); the engine frees a
        proposer that holds any after speculation has been off for `release_after_s`."""
        return 0


def longest_suffix_match(
    haystack: Sequence[int] | np.ndarray, context: Sequence[int], n_min: int, n_max: int,
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
    return [int(t) for t in haystack[start : start + k]], start


PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str):  # noqa: ANN201 - decorator
    """Class decorator adding a proposer to the registry under `name`."""

    def deco(cls: type[Proposer]) -> type[Proposer]:
        PROPOSERS[name] = cls
        return cls

    return deco
