"""Scheduler over ids and counts, driven by a fake runner (no model)."""

from __future__ import annotations

from specserve.config import SchedulerConfig
from specserve.engine.scheduler import SampledTokens, Scheduler
from specserve.kv_cache.manager import KVCacheManager
from specserve.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.spec.tree import DraftTree


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, max_len=256):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv, max_len), kv


def fake_step(sched: Scheduler, next_token=lambda req_id, pos: 7):
    out = sched.schedule()
    sampled = {
        sr.request_id: SampledTokens([next_token(sr.request_id, sr.start_pos + len(sr.token_ids))])
        for sr in out.scheduled if sr.sample
    }
    return out, sched.update_from_output(out, sampled)


def req(rid, n_prompt, max_tokens=4, first=1, **kw):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw))


def test_chunked_prefill_mixed_with_decode():
    sched, kv = make(budget=16)
    sched.add_request(req("a", 4, max_tokens=10))
    out, _ = fake_step(sched)  # a: whole prompt
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 4, True)]
    sched.add_request(req("b", 40, first=100))  # no shared prefix with a
    out, _ = fake_step(sched)
    # a decodes one token, b gets the remaining 15 tokens of budget as its first chunk.
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 1, True), ("b", 15, False)]
    out, _ = fake_step(sched)
    assert [(s.request_id, len(s.token_ids), s.start_pos) for s in out.scheduled] == [("a", 1, 5), ("b", 15, 15)]
    out, _ = fake_step(sched)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 1, True), ("b", 10, True)]
    assert kv.check_integrity([r.request_id for r in sched.running])


def test_max_tokens_and_eos_finish_and_free():
    sched, kv = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=3), eos_token_ids=frozenset({99}))
    sched.add_request(r)
    fake_step(sched)
    fake_step(sched, lambda rid, pos: 99)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7, 99]
    assert kv.num_free_blocks == kv.num_blocks
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=3), eos_token_ids=frozenset({99}))
    sched.add_request(r2)
    for _ in range(3):
        fake_step(sched)
    assert r2.status == RequestStatus.FINISHED_LENGTH and len(r2.output_token_ids) == 3
    assert not sched.has_unfinished()
    kv.check_integrity([])


def test_token_budget_and_max_seqs_respected():
    sched, _ = make(budget=10, max_seqs=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", 3, max_tokens=50))
    out, _ = fake_step(sched)
    assert len(out.scheduled) == 2 and out.num_batched_tokens == 6
    out, _ = fake_step(sched)
    assert len(out.scheduled) == 2 and sched.num_waiting == 2


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens each grow until the pool is full.
    sched, kv = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out, _ = fake_step(sched)
        preempted += out.preempted_ids
        kv.check_integrity([r.request_id for r in sched.running])
    assert preempted, "the pool is too small for both: someone must be preempted"
    assert preempted[0] == "b"  # the later arrival goes first
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert len(a.output_token_ids) == len(b.output_token_ids) == 12
    assert b.num_preemptions >= 1
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity([])


def test_abort_frees_blocks_immediately():
    sched, kv = make()
    sched.add_request(req("a", 10, max_tokens=100))
    sched.add_request(req("b", 10, max_tokens=100))
    fake_step(sched)
    assert kv.num_free_blocks < kv.num_blocks
    done = sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a"]
    assert "a" not in kv.req_blocks
    kv.check_integrity(["b"])
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_cache_hit_on_admission():
    sched, kv = make(budget=64, block_size=4)
    a = req("a", 20, max_tokens=1)
    sched.add_request(a)
    fake_step(sched)
    assert a.is_finished and a.num_cached_tokens == 0
    b = req("b", 20, max_tokens=1)
    sched.add_request(b)
    out, _ = fake_step(sched)
    assert b.num_cached_tokens == 16 and len(out.scheduled[0].token_ids) == 4


def test_speculative_tokens_accepted_and_rolled_back():
    sched, kv = make(budget=64, block_size=4)
    r = req("a", 6, max_tokens=20)
    sched.add_request(r)
    fake_step(sched)  # prefill, samples token 7
    r.draft = DraftTree.chain([11, 12, 13])
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.token_ids == [7, 11, 12, 13] and sr.num_spec_tokens == 3 and sr.start_pos == 6
    # 10 positions need 3 blocks of 4.
    assert len(sr.block_ids) == 3
    # Verification accepts 11 then rejects 12 and samples 42 in its place.
    sched.update_from_output(out, {"a": SampledTokens([11, 42], num_draft_tokens=3, num_accepted_tokens=1)})
    assert r.output_token_ids == [7, 11, 42]
    assert r.num_computed_tokens == 8  # prompt 6 + 7 + 11; 42 has no KV yet
    assert len(kv.block_ids("a")) == 2  # slots past position 8 released
    kv.check_integrity(["a"])


class _Arriving:
    """A KV source as the decode side of disaggregation has one: KV for [0, m) comes from outside."""

    def __init__(self, m: int) -> None:
        self.num_tokens, self.reserved, self.arrived = m, False, False
        self.placed: tuple[int, list[int]] | None = None

    def place(self, num_cached: int, block_ids: list[int]) -> None:
        self.placed, self.reserved = (num_cached, list(block_ids)), True

    def admissible(self) -> bool:
        return self.reserved and self.arrived


def test_the_scheduler_places_the_blocks_of_kv_arriving_from_outside():
    sched, kv = make(num_blocks=10, block_size=4, budget=64)
    warm = req("warm", 13, max_tokens=1)  # leaves 12 prompt tokens (3 blocks) in the prefix cache
    sched.add_request(warm)
    fake_step(sched)
    small, big = req("small", 13, max_tokens=2), req("big", 30, max_tokens=2, first=100)  # queue order
    big.kv_source, small.kv_source = _Arriving(29), _Arriving(12)  # the prefill worker sends m = n - 1
    sched.add_request(small)
    sched.add_request(big)
    sched.reserve_incoming()
    # small: its 12 tokens are the prefix cache's 3 blocks, referenced, nothing fresh. big: 8
    # fresh blocks for 29 tokens do not fit beside them (10 blocks), so it waits without one.
    assert small.kv_source.placed == (12, kv.block_ids("small")) and len(kv.block_ids("small")) == 3
    assert small.num_cached_tokens == 12
    assert big.kv_source.placed is None and kv.block_ids("big") == []
    out = sched.schedule()
    assert out.scheduled == []  # placed but not arrived: nothing runs, nothing else allocated
    small.kv_source.arrived = True
    _, results = fake_step(sched)
    assert [r.request_id for r, _ in results] == ["small"] and small.num_computed_tokens == 13
    while not small.is_finished:
        fake_step(sched)
    sched.reserve_incoming()  # room again: big gets its blocks, in one piece
    assert big.kv_source.placed[0] == 0 and len(big.kv_source.placed[1]) == 8
    big.kv_source.arrived = True
    while not big.is_finished:
        fake_step(sched)
    assert kv.check_integrity([])


def test_prompt_tokens_next_step_counts_what_the_next_schedule_will_carry():
    """Drafts are proposed before a step admits anyone: the engine asks how many prompt tokens
    the step will carry, running prompts and the waiting ones admission takes (less what the
    prefix cache holds), within the token budget and max_num_seqs; schedule() agrees."""
    sched, kv = make(budget=32, max_seqs=3)
    sched.add_request(req("a", 8, max_tokens=20))
    fake_step(sched)  # a decodes from here on
    assert sched.prompt_tokens_next_step(1) == 0
    sched.add_request(req("b", 10, first=100))
    assert sched.prompt_tokens_next_step(1) == 10
    out = sched.schedule()
    assert sum(len(s.token_ids) for s in out.scheduled if s.request_id == "b") == 10
    sched.update_from_output(out, {s.request_id: SampledTokens([7]) for s in out.scheduled if s.sample})
    # c repeats a's prompt: the prefix cache holds its first block (the last token is always computed)
    sched.add_request(req("c", 8, max_tokens=4))
    hit = kv.num_cached_tokens(sched.waiting[0])
    assert hit > 0 and sched.prompt_tokens_next_step(2) == 8 - hit
    # A long prompt fills the budget left beside the decodes; max_num_seqs caps who is admitted.
    sched.add_request(req("d", 60, first=200))
    assert sched.prompt_tokens_next_step(2) == 8 - hit  # one seat left: c only
    out = sched.schedule()
    assert sum(len(s.token_ids) for s in out.scheduled if s.request_id == "c") == 8 - hit
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    sched.update_from_output(out, {s.request_id: SampledTokens([7]) for s in out.scheduled if s.sample})
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert sched.prompt_tokens_next_step(2) == 30  # d: the 32-token budget less two decode rows
