"""Per-request state: token ids, how many of them have KV, drafts, timings."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.sampling_params import SamplingParams
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.sampling.grammar import GrammarState


class KVSource(Protocol):
    """KV for a request's first tokens computed elsewhere (see specserve.disagg.kv_transfer).

    The scheduler allocates the blocks those tokens land in (`Scheduler.reserve_incoming`, in
    queue order, prefix-cache hits first) and hands them over with `place`; the source only
    copies into them."""

    num_tokens: int  # tokens [0, num_tokens) arrive from outside
    reserved: bool  # the scheduler has placed the blocks for [0, num_tokens)

    def place(self, num_cached: int, block_ids: list[int]) -> None:
        """The request's blocks for [0, num_tokens): the first num_cached tokens are prefix-cache
        hits already in them; the rest are to be copied in."""

    def admissible(self) -> bool:
        """True once every layer's KV has arrived (the first step only has to copy it in)."""


def ending_token_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids that end an output, sorted: EOS unless ignore_eos, and stop_token_ids."""
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; values above RUNNING mean finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        """True for every terminal status."""
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimes:
    """Wall-clock milestones of one request (time.perf_counter seconds)."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Request:
    """A request's token ids and its progress: tokens [0, num_computed_tokens) have KV in cache.

    The same bookkeeping drives every kind of step: a prompt chunk, a decode token and a
    speculative verify all schedule ``num_tokens - num_computed_tokens`` (plus drafts) tokens.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []  # per output token: (id, logprob) pairs
        # prompt_logprobs: per prompt token after the first, its logprob and the likeliest (id, logprob)
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.num_computed_tokens = 0
        # Tokens of the prompt found in the prefix cache when first admitted.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        # Draft proposed for the coming step (a tree; a chain is the special case); unverified,
        # never cached.
        self.draft: DraftTree | None = None
        # Structured output: where the output stands in its grammar (specserve.sampling.grammar);
        # set by the engine that samples the request, rebuilt from the output after a move.
        self.grammar: GrammarState | None = None
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.perf_counter())
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Disaggregation: KV of the first tokens arriving from a prefill worker (decode side; see
        # specserve.disagg.kv_transfer). While set, the scheduler admits the request only once
        # that KV is ready, and counts those tokens as computed.
        self.kv_source: KVSource | None = None
        # Speculation counters.
        self.num_target_steps = 0  # target passes that produced output for this request
        self.num_spec_steps = 0  # of those, passes that verified at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_per_position: list[int] = []  # steps whose draft reached depth j + 1 and tested it
        self.accepted_per_position: list[int] = []  # of those, steps that accepted a node at depth j + 1
        self.accepted_lengths: list[int] = []  # accepted drafts per speculative step (a histogram's data)
        self._last_verify: tuple[int, int, int, int] | None = None  # record_verify's last counts

    def __getstate__(self) -> dict:
        # A live KV source (open shared memory, locks) never travels between processes.
        state = self.__dict__.copy()
        state["kv_source"] = None
        state["grammar"] = None
        return state

    def record_verify(self, num_draft: int, num_accepted: int, depth: int | None = None,
                      num_kept: int | None = None) -> None:
        """Count one target pass that verified num_draft draft nodes (a tree `depth` deep; a chain
        of num_draft when not given) and accepted num_accepted of them (one path), of whose
        num_accepted + 1 tokens the output keeps the first num_kept (default all; fewer where a
        stop condition ended it inside the step). The counters describe the output: accepted
        drafts it does not keep are not counted (the policy learns from the verification itself)."""
        self.num_target_steps += 1
        if num_draft <= 0:
            self._last_verify = None
            return
        depth = num_draft if depth is None else depth
        kept = num_accepted + 1 if num_kept is None else num_kept
        self._add_verify(num_draft, min(num_accepted, kept), depth, +1)
        self._last_verify = (num_draft, num_accepted, depth, kept)

    def _add_verify(self, num_draft: int, num_accepted: int, depth: int, sign: int) -> None:
        """Add (sign +1) or take back (-1) one verify's counts."""
        self.num_spec_steps += sign
        self.num_draft_tokens += sign * num_draft
        self.num_accepted_tokens += sign * num_accepted
        if sign > 0:
            self.accepted_lengths.append(num_accepted)
        else:
            self.accepted_lengths.pop()
        while len(self.drafted_per_position) < depth:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(min(depth, num_accepted + 1)):  # depths actually tested
            self.drafted_per_position[j] += sign
            if j < num_accepted:
                self.accepted_per_position[j] += sign

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus accepted output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Accepted output tokens so far."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @functools.cached_property
    def distinct_prompt_ids(self) -> torch.Tensor:
        """The prompt's distinct token ids (int64, sorted), computed once: a repetition penalty
        reads them every step (a 30k-token prompt cost 2.9 ms a step to convert and dedupe)."""
        return torch.unique(torch.tensor(self.prompt_token_ids, dtype=torch.long))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """prompt_logprobs asked for and not all computed yet (its prompt is then computed in full)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    def add_prompt_logprobs(self, first: int, logprobs: list[float], tops: list[list[tuple[int, float]]]) -> None:
        """Record the logprobs of prompt tokens first, first + 1, ... (a recomputed chunk's are
        already there: only the new ones are kept)."""
        skip = len(self.prompt_logprobs) + 1 - first
        if skip < 0:
            raise RuntimeError(f"prompt logprobs of {self.request_id} arrived out of order")
        self.prompt_logprobs.extend(logprobs[skip:])
        self.prompt_top_logprobs.extend(tops[skip:])

    @functools.cached_property
    def end_token_ids(self) -> torch.Tensor:
        """The ids that end the output (EOS unless ignore_eos, and stop_token_ids; int64): what
        min_tokens masks."""
        return torch.tensor(ending_token_ids(self.sampling_params, self.eos_token_ids), dtype=torch.long)

    @functools.cached_property
    def end_token_set(self) -> frozenset[int]:
        """end_token_ids as a set, for drafts' tokens to be looked up in."""
        return frozenset(ending_token_ids(self.sampling_params, self.eos_token_ids))

    @property
    def output_token_ids(self) -> list[int]:
        """Accepted output tokens (a copy)."""
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        """True once the request has reached a terminal status."""
        return self.status.is_finished

    @property
    def is_decoding(self) -> bool:
        """True when every token but the last sampled one has KV: the next step decodes."""
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_output_tokens > 0

    def append_output_tokens(self, token_ids: list[int], logprobs: list[float] | None = None,
                             top_logprobs: list[list[tuple[int, float]]] | None = None) -> None:
        """Append accepted tokens (one per step without speculation, up to K+1 with it)."""
        self.all_token_ids.extend(token_ids)
        if logprobs is not None:
            self.output_logprobs.extend(logprobs)
        if top_logprobs is not None:
            self.output_top_logprobs.extend(top_logprobs)

    def drop_last_output_tokens(self, n: int) -> None:
        """Forget the last n accepted output tokens and their logprobs (a stop string ended the
        output at a token before them in the same step)."""
        if n <= 0:
            return
        if self._last_verify is not None:  # the step's counts, for the tokens the output keeps
            num_draft, num_accepted, depth, kept = self._last_verify
            self._add_verify(num_draft, min(num_accepted, kept), depth, -1)
            kept = max(0, kept - n)
            self._add_verify(num_draft, min(num_accepted, kept), depth, +1)
            self._last_verify = (num_draft, num_accepted, depth, kept)
        del self.all_token_ids[-n:]
        del self.output_logprobs[self.num_output_tokens :]
        del self.output_top_logprobs[self.num_output_tokens :]
        self.num_computed_tokens = min(self.num_computed_tokens, max(0, self.num_tokens - 1))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
