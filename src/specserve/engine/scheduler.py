"""Continuous batching over a token budget: one scheduling path for prefill, chunks, decode and verify.

Every request carries ``num_computed_tokens`` (tokens whose KV is in the cache) catching up
with its token list. A step gives each scheduled request some new tokens: a prompt chunk, the
one token sampled last step, or that token plus K draft tokens to verify. Plain Python over
ids and counts; the runner sees only the data-only ``SchedulerOutput``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from specserve.config import SchedulerConfig
from specserve.kv_cache.manager import KVCacheManager, KVLoad, PrefixHit
from specserve.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from specserve.sampling.grammar import GrammarState


class ScheduledRequest(NamedTuple):
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # fed this step: uncomputed tokens, then the draft's node tokens
    start_pos: int  # position of token_ids[0] (== num_computed_tokens)
    block_ids: list[int]  # the request's whole block table
    draft: DraftTree | None  # verified this step; its nodes are the last len(draft) of token_ids
    sample: bool  # the step reaches the request's last known token, so it produces output
    sampling_params: SamplingParams
    output_index: int  # number of output tokens before this step (keys seeded sampling)
    grammar: GrammarState | None = None  # structured output: masks the rows this step samples from
    # Requests with penalties: the tokens generated before this step (the rows' penalties count
    # them, and each draft node's ancestors); with a repetition penalty, the prompt's distinct ids.
    penalized_output: Sequence[int] | None = None
    penalized_prompt: torch.Tensor | None = None
    # Requests still short of min_tokens: the ids that would end the output (masked in the rows
    # whose path is shorter than min_tokens).
    min_tokens_ban: torch.Tensor | None = None
    # prompt_logprobs still missing: the prompt (the rows of this step's tokens that predict a
    # prompt token get their logprobs computed).
    prompt_for_logprobs: Sequence[int] | None = None

    @property
    def num_spec_tokens(self) -> int:
        """Draft nodes at the end of token_ids."""
        return len(self.draft) if self.draft is not None else 0

    @property
    def num_new_tokens(self) -> int:
        """Tokens fed before the draft: a prompt chunk, or the token sampled last step."""
        return len(self.token_ids) - self.num_spec_tokens


class SchedulerOutput(NamedTuple):
    """Data-only description of one step, consumed by the model runner."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str]
    # Prefix blocks found in a lower tier (host memory, disk): written into their pool blocks
    # before the forward that reads them.
    kv_loads: Sequence[KVLoad] = ()

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.scheduled


class SampledTokens(NamedTuple):
    """What the runner produced for one request: accepted drafts then one new token."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    num_draft_tokens: int = 0  # draft nodes that were verified this step
    num_accepted_tokens: int = 0  # of those, how many were accepted (one path through the tree)
    accepted_nodes: tuple[int, ...] = ()  # the accepted path's node indices, depth 1 first
    node_argmax: tuple[int, ...] = ()  # with a draft: the target's argmax at its root, then at each node
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per emitted token: most likely (id, logprob)


def _queue_key(r: Request) -> tuple[int, float]:
    return (r.priority, r.times.arrival)


class Scheduler:
    """FCFS (with priorities) continuous-batching scheduler with preemption by recompute."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests that finished inside the scheduler since the last call to take_finished().
        self._finished: list[Request] = []

    # ------------------------------------------------------------------ intake
    @property
    def max_tokens_per_request(self) -> int:
        """Longest sequence a request may reach: the context window or the whole KV pool."""
        return min(self.max_model_len, self.kv.capacity_tokens)

    def add_request(self, request: Request) -> None:
        """Queue a validated request (callers check prompt length first)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort_right(self.waiting, request, key=_queue_key)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self.running)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def prompt_tokens_next_step(self, num_decode_rows: int) -> int:
        """Prompt tokens the next schedule() will carry beside `num_decode_rows` decode rows, as
        far as can be told before drafting: the running requests' unfinished prompts, then the
        waiting requests admission takes in queue order (what the prefix cache lacks of each, a
        lookup only; within the token budget and max_num_seqs). Drafts are proposed before the
        step admits anyone, so without the waiting ones a draft is sized for a step that turns
        out to carry a new request's prompt too, and that request's first token waits for it."""
        budget = self.config.max_num_batched_tokens - num_decode_rows
        total = 0
        for req in self.running:
            if budget <= 0:
                return total
            if not req.is_decoding:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                total, budget = total + n, budget - n
        seats = self.config.max_num_seqs - len(self.running)
        for req in self.waiting:
            if budget <= 0 or seats <= 0:
                break
            if req.kv_source is not None:
                if not req.kv_source.admissible():
                    continue
                cached = req.kv_source.num_tokens
            else:
                cached = 0 if req.wants_prompt_logprobs else self.kv.num_cached_tokens(req)
            n = min(req.num_tokens - cached, budget)
            total, budget, seats = total + n, budget - n, seats - 1
        return total

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then admit waiting ones."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.perf_counter()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_spec = len(req.draft) if req.draft is not None else 0
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new + num_spec > budget:
                # Drop drafts that do not fit rather than delay the request.
                num_spec = max(0, budget - num_new)
            num_new = min(num_new, budget)
            if num_new <= 0:
                i += 1
                continue
            total = num_new + num_spec
            while not self.kv.can_allocate(req, total):
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req preempted itself; running[i] is now the next request
            self.kv.allocate_slots(req, total)
            if req.draft is not None and num_spec != len(req.draft):
                # A prefix of a tree's nodes is a tree (parents come first).
                req.draft = req.draft.truncate(num_spec) if num_spec else None
            scheduled.append(self._make_scheduled(req, num_new, num_spec))
            budget -= total
            i += 1

        # Admit waiting requests only when nobody had to be preempted this step.
        w = 0
        while (
            not preempted and w < len(self.waiting) and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[w]
            if req.kv_source is not None:
                # KV of the first tokens comes from a prefill worker into blocks reserve_incoming
                # placed (see specserve.disagg). Wait for it without holding up the queue.
                if not req.kv_source.admissible():
                    w += 1
                    continue
                num_hit = req.kv_source.num_tokens
                req.num_computed_tokens = num_hit
                num_new = min(req.num_tokens - num_hit, budget)
                if not self.kv.can_allocate(req, num_new):
                    req.num_computed_tokens = 0
                    break
                self.kv.allocate_slots(req, num_new)
            else:
                # The pool's blocks, then the lower tiers'; none for a prompt whose logprobs are wanted.
                hit = self.kv.find_prefix(req) if not req.wants_prompt_logprobs else PrefixHit([], [], 0)
                num_hit = hit.num_tokens
                num_new = req.num_tokens - num_hit
                if num_new > budget:
                    if not self.config.enable_chunked_prefill:
                        break
                    num_new = budget
                if not self.kv.can_allocate(req, num_new, hit.blocks, loaded=hit.loaded):
                    break
                self.kv.allocate_slots(req, num_new, hit.blocks, loaded=hit.loaded)
            self.waiting.pop(w)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            req.draft = None
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            self.running.append(req)
            scheduled.append(self._make_scheduled(req, num_new, 0))
            budget -= num_new

        used = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled, used, preempted, self.kv.take_pending_loads())

    def reserve_incoming(self) -> None:
        """Allocate the blocks of waiting requests whose first tokens' KV arrives from outside
        (a prefill worker's), in queue order, so that it can be copied in as it arrives: the
        tokens the prefix cache holds are referenced, the rest get fresh blocks. A request the
        pool has no room for yet is tried again next step; the scheduler is the only allocator
        of blocks, the KV source only copies into what it is given (`KVSource.place`)."""
        for req in self.waiting:
            src = req.kv_source
            if src is None or src.reserved:
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            block = self.kv.block_size
            num_hit = min(num_hit, src.num_tokens // block * block)
            hits = hits[: num_hit // block]
            if not self.kv.allocate_slots(req, src.num_tokens - num_hit, hits):
                continue
            req.num_cached_tokens = num_hit
            src.place(num_hit, self.kv.block_ids(req.request_id))

    def _make_scheduled(self, req: Request, num_new: int, num_spec: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        draft = req.draft if num_spec else None
        tokens = req.all_token_ids[start : start + num_new] + (list(draft.token_ids) if draft is not None else [])
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=tokens,
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            draft=draft,
            sample=start + num_new == req.num_tokens,
            sampling_params=req.sampling_params,
            output_index=req.num_output_tokens,
            grammar=req.grammar,
            penalized_output=req.output_token_ids if req.sampling_params.has_penalties else None,
            penalized_prompt=req.distinct_prompt_ids if req.sampling_params.repetition_penalty != 1.0 else None,
            min_tokens_ban=req.end_token_ids if req.num_output_tokens < req.sampling_params.min_tokens else None,
            prompt_for_logprobs=req.prompt_token_ids if req.wants_prompt_logprobs else None,
        )

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """Lowest-priority request not yet scheduled this step (latest arrival breaks ties)."""
        candidates = self.running[first_unscheduled:]
        return max(candidates, key=lambda r: (r.priority, r.times.arrival))

    def _preempt(self, req: Request) -> None:
        """Free a running request's KV and send it back to the queue to be recomputed."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def requeue_failed_loads(self, block_ids: Iterable[int], holders: Iterable[str]) -> list[str]:
        """After a step whose lower-tier loads partly failed verification: forget those blocks'
        content and send the step's requests that hold one (`holders`) back to the queue, as a
        preemption does (the step's results for them are void). Returns the ids requeued."""
        self.kv.uncache(list(block_ids))
        out = []
        for rid in holders:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                self._preempt(req)
                out.append(rid)
        return out

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, SampledTokens]
    ) -> list[tuple[Request, list[int]]]:
        """Advance each scheduled request past its computed and accepted tokens.

        Returns (request, newly accepted token ids) for every request that produced output
        this step; requests that hit a stop condition are finished and their blocks freed.
        """
        now = time.perf_counter()
        results: list[tuple[Request, list[int]]] = []
        for sr in output.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            num_fed = len(sr.token_ids)
            if not sr.sample:
                req.num_computed_tokens += num_fed
                self.kv.cache_blocks(req, req.num_computed_tokens)
                continue
            out = sampled[sr.request_id]
            # The fed uncomputed tokens and the accepted drafts now have KV (the runner has moved
            # an accepted tree path's KV into consecutive slots); the final sampled token
            # (recovered or bonus) does not yet.
            num_accepted = len(out.token_ids) - 1
            req.num_computed_tokens += num_fed - sr.num_spec_tokens + num_accepted
            req.draft = None
            new_tokens = self._append_checking_stops(req, out)
            req.record_verify(sr.num_spec_tokens, num_accepted, sr.draft.max_depth if sr.draft is not None else None,
                              len(new_tokens))
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            # Drop KV slots of rejected drafts (and of tokens cut off by a stop condition).
            self.kv.rollback(req, req.num_computed_tokens)
            self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            results.append((req, new_tokens))
            if req.is_finished:
                self._finish(req)
        return results

    def _append_checking_stops(self, req: Request, out: SampledTokens) -> list[int]:
        params = req.sampling_params
        accepted: list[int] = []
        for j, tok in enumerate(out.token_ids):
            req.append_output_tokens([tok], [out.logprobs[j]] if out.logprobs is not None else None,
                                     [out.top_logprobs[j]] if out.top_logprobs is not None else None)
            accepted.append(tok)
            status = self._token_stop_status(req, tok, params)
            if status is not None:
                req.status = status
                # KV exists only for tokens before the stop; keep the count consistent.
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                break
        return accepted

    def _token_stop_status(self, req: Request, tok: int, params: SamplingParams) -> RequestStatus | None:
        # The first min_tokens rows mask every ending id, except under structured output where
        # the grammar allows nothing else (a finished choice or JSON object; see
        # grammar.forbid_unless_only): an ending id there ends the output as the grammar does.
        if req.num_output_tokens > params.min_tokens or req.grammar is not None:
            if not params.ignore_eos and tok in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if tok in params.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_tokens_per_request:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ finishing
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string, error); frees their blocks at once."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self._finish(req)
            done.append(req)
        return done

    def _finish(self, req: Request) -> None:
        # A request is running or waiting, never both: a running one (the usual case) does not scan
        # the waiting queue (a full scan per finished request cost 0.1 ms with 20k queued).
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.times.finished = time.perf_counter()
        self.kv.forget(req)
        self.requests.pop(req.request_id, None)
        self._finished.append(req)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call (for output processing)."""
        done, self._finished = self._finished, []
        return done
