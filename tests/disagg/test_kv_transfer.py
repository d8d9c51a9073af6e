"""Disaggregation without Ray: channels, connectors and two workers in one process."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.disagg.kv_transfer import (
    SHM_DIR,
    KVLayout,
    LocalKVChannel,
    TransferDescriptor,
    draft_kv_layout_of,
    kv_layout_of,
    new_transfer_id,
)
from specserve.disagg.router import DisaggFrontend, DisaggRouter, WorkerHandle
from specserve.disagg.worker import WorkerCore, check_pairable
from specserve.engine.engine import RequestPreparer
from specserve.errors import ConfigError
from specserve.request import Request

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    " * 6,
    "Once upon a time, " * 14,
    "List three colours:",
    "x",
]


def _shm_files() -> set[str]:
    """Channel files of this process's transfers (their ids start with its pid): another server on
    the machine makes its own meanwhile (.ci/run beside a disaggregated server failed on one)."""
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"specserve-kv-{os.getpid()}-")}


def test_local_channel_copies_bfloat16_and_strided_parts_exactly():
    # receive copies bytes with numpy (single-threaded, see LocalKVChannel.receive): dtypes numpy
    # lacks and parts that are views of larger tensors arrive intact.
    layout = KVLayout(1, 2, 4, "bfloat16")
    ch = LocalKVChannel(TransferDescriptor("tb", "ray", 6, layout))
    k = torch.randn(6, 4, 2).to(torch.bfloat16).transpose(1, 2)  # [6, 2, 4], not contiguous
    v = torch.randn(6, 2, 8).to(torch.bfloat16)[:, :, ::2]
    ch.receive(0, 0, [k, v])
    got_k, got_v = ch.read(0, 0, 6)
    assert got_k.dtype == torch.bfloat16 and torch.equal(got_k, k) and torch.equal(got_v, v)


def test_local_channel_ready_stops_at_first_gap():
    layout = KVLayout(2, 1, 4, "float32")
    ch = LocalKVChannel(TransferDescriptor("t", "ray", 10, layout))
    piece = torch.ones(3, 1, 4)
    ch.receive(0, 3, [piece, piece])  # tokens 3..5 before 0..2
    assert ch.ready(0) == 0
    ch.receive(0, 0, [piece, piece])
    assert ch.ready(0) == 6
    ch.receive(0, 6, [torch.ones(4, 1, 4), torch.ones(4, 1, 4)])
    assert ch.ready(0) == 10 and ch.ready(1) == 0 and not ch.all_written
    ch.receive(1, 0, [torch.ones(10, 1, 4), torch.ones(10, 1, 4)])
    assert ch.all_written


def _info(name, role, **fp):
    base = {"model": "m", "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32"},
            "quantization": "none", "kv_cache_dtype": "auto", "vocab_size": 10, "tokenizer": "t"}
    return {"name": name, "role": role, "fingerprint": base | fp, "speculation": "none", "block_size": 4,
            "num_blocks": 100, "max_num_seqs": 8}


def test_incompatible_workers_refuse_to_pair():
    check_pairable(_info("p", "prefill"), _info("d", "decode"))
    with pytest.raises(ConfigError, match="quantization"):
        check_pairable(_info("p", "prefill", quantization="int8"), _info("d", "decode"))
    with pytest.raises(ConfigError, match="layout"):
        check_pairable(_info("p", "prefill"),
                       _info("d", "decode", layout={"num_layers": 3, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32"}))
    spec = _info("p", "prefill") | {"speculation": "ngram"}
    with pytest.raises(ConfigError, match="decode workers only"):
        check_pairable(spec, _info("d", "decode"))


def _router(prefill_blocks=(100, 100), decode_free=(50, 80)):
    workers = [WorkerHandle(None, _info(f"p{i}", "prefill") | {"num_blocks": b}) for i, b in enumerate(prefill_blocks)]
    workers += [WorkerHandle(None, _info(f"d{i}", "decode"), stats={"kv_free_blocks": f})
                for i, f in enumerate(decode_free)]
    front = DisaggFrontend("m", RequestPreparer(None, 10, 64, 400), None, False)
    return DisaggRouter(front, workers)


def test_routing_prefers_cached_prefix_then_short_queue_and_free_blocks():
    r = _router()
    tokens = list(range(1, 10)) * 2  # 18 tokens = 4 full blocks of 4
    hashes = r._hashes(tokens)
    assert len(hashes) == 4
    p0, p1 = r.prefill
    p0.pending_tokens = 500
    assert r.pick_prefill(hashes, 18, set()) is p1  # nothing cached: shortest queue
    r._index(hashes[:2], "p0")
    assert r.pick_prefill(hashes, 18, set()) is p0  # longest cached prefix beats queue length
    assert r.pick_prefill(hashes, 18, {"p0"}) is p1  # an excluded (failed) worker is skipped
    dec, full = r.pick_decode(hashes)
    assert dec.name == "d1" and not full  # most free blocks
    r._index(hashes, "d0")
    dec, full = r.pick_decode(hashes)
    assert dec.name == "d0" and full  # the whole prompt is cached there: prefill is skipped
    r.decode[0].alive = r.decode[1].alive = False
    assert r.pick_decode(hashes) == (None, False)


def test_prefill_without_room_is_routed_elsewhere():
    r = _router(prefill_blocks=(2, 100))
    hashes = r._hashes(list(range(40)))
    r._index(hashes, "p0")  # p0 caches the prefix but cannot hold the request
    assert r.pick_prefill(hashes, 40, set()).name == "p1"


@pytest.fixture(scope="module")
def pair(smollm_checkpoint):
    def engine(**kw):
        return LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.25,
                   **kw).engine

    pre = WorkerCore("prefill", engine(max_num_batched_tokens=32), "p0")  # chunked: 32-token chunks
    dec = WorkerCore("decode", engine(), "d0", transfer_timeout_s=1.0)
    yield pre, dec
    pre.shutdown()
    dec.shutdown()


def _decode_via(pre, dec, tokenizer, eos, prompt, params, rid):
    ids = tokenizer.encode(prompt)
    m = len(ids) - 1
    desc = TransferDescriptor(new_transfer_id(), "shm", m, kv_layout_of(pre.engine)) if m else None
    dec.add_decode(Request(rid, ids, params, eos_token_ids=eos), desc)
    if desc is not None:
        st = pre.prefill(rid, ids[:m], desc)
        assert st["num_tokens"] == m
    deadline = time.time() + 60
    while time.time() < deadline:
        outs, stats = dec.poll(0.1)
        for o in outs:
            if o.finished and o.request_id == rid:
                return o, stats
    raise AssertionError("no output")


def test_prefill_decode_pair_matches_colocated(pair, smollm_llm):
    pre, dec = pair
    before = _shm_files()
    params = SamplingParams(max_tokens=20, temperature=0.0)
    want = [o.outputs[0].token_ids for o in smollm_llm.generate(PROMPTS, params, use_tqdm=False)]
    tok, eos = smollm_llm.tokenizer, smollm_llm.engine.eos_token_ids
    for i, prompt in enumerate(PROMPTS):
        out, _ = _decode_via(pre, dec, tok, eos, prompt, params, f"a{i}")
        assert out.error is None
        assert out.outputs[0].token_ids == want[i], prompt
    # The same long prompt again: the prefill worker finds it in its prefix cache and sends the
    # cached pages; the decode worker finds it in its own cache and loads only the rest.
    out, _ = _decode_via(pre, dec, tok, eos, PROMPTS[2], params, "again")
    assert out.outputs[0].token_ids == want[2]
    assert out.metrics.num_cached_prompt_tokens > 0
    assert pre.check_integrity() and dec.check_integrity()
    assert pre.engine.kv_manager.num_free_blocks == pre.engine.kv_manager.num_blocks
    assert dec.engine.kv_manager.num_free_blocks == dec.engine.kv_manager.num_blocks
    assert _shm_files() <= before  # every channel file was removed


def test_a_prefill_queued_behind_others_is_no_stall_but_one_that_never_comes_is(pair, smollm_llm):
    """The decode side's --transfer-timeout (1 s here) counts from the first KV; before it, the
    prefill may wait its turn behind the prompts queued ahead of it (they failed healthy
    transfers whenever the queue took longer than the timeout). A prefill that never comes still
    fails its request, once that allowance is spent."""
    pre, dec = pair
    tok, eos = smollm_llm.tokenizer, smollm_llm.engine.eos_token_ids
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ids = tok.encode(PROMPTS[0])
    m = len(ids) - 1
    want = smollm_llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids

    def run(rid: str, queued: int, prefill_after_s: float | None):  # noqa: ANN202
        desc = TransferDescriptor(new_transfer_id(), "shm", m, kv_layout_of(pre.engine), queued_tokens=queued)
        dec.add_decode(Request(rid, ids, params, eos_token_ids=eos), desc)
        t0 = time.time()
        while prefill_after_s is not None and time.time() - t0 < prefill_after_s:  # queued on the prefill side
            dec.poll(0.1)
        if prefill_after_s is not None:
            pre.prefill(rid, ids[:m], desc)
        while time.time() - t0 < 60:
            for o in dec.poll(0.1)[0]:
                if o.finished and o.request_id == rid:
                    return o, time.time() - t0
        raise AssertionError("no output")

    out, _ = run("queued", queued=100, prefill_after_s=2.5)  # allowance 1 + 0.05 * (m + 100) s
    assert out.error is None and out.outputs[0].token_ids == want
    out, took = run("never", queued=0, prefill_after_s=None)  # allowance 1 + 0.05 * m s
    assert out.error is not None and "no KV arrived" in out.error and took < 1 + 0.05 * m + 5
    assert dec.check_integrity() and dec.engine.kv_manager.num_free_blocks == dec.engine.kv_manager.num_blocks


def test_resumed_request_continues_the_same_text(pair, smollm_llm):
    pre, dec = pair
    params = SamplingParams(max_tokens=24, temperature=0.0)
    full = smollm_llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    ids = smollm_llm.tokenizer.encode(PROMPTS[1])
    done = full.token_ids[:9]  # as if a decode worker died after streaming 9 tokens
    tokens = ids + done
    m = len(tokens) - 1
    req = Request("resumed", ids, params, eos_token_ids=smollm_llm.engine.eos_token_ids)
    req.append_output_tokens(done)
    desc = TransferDescriptor(new_transfer_id(), "shm", m, kv_layout_of(pre.engine))
    emitted = len(smollm_llm.tokenizer.decode(done))
    dec.add_decode(req, desc, emitted)
    pre.prefill("resumed", tokens[:m], desc)
    deltas, final = [], None
    deadline = time.time() + 60
    while final is None and time.time() < deadline:
        outs, _ = dec.poll(0.1)
        for o in outs:
            deltas.append(o.outputs[0].delta_text)
            final = o if o.finished else final
    assert final.outputs[0].token_ids == full.token_ids
    assert final.outputs[0].text == full.text
    assert full.text[:emitted] + "".join(deltas) == full.text  # nothing streamed twice or lost
    assert dec.check_integrity()


def test_transfer_that_never_arrives_times_out_without_leaking(pair, smollm_llm):
    pre, dec = pair
    before = _shm_files()
    ids = smollm_llm.tokenizer.encode(PROMPTS[2])
    desc = TransferDescriptor(new_transfer_id(), "shm", len(ids) - 1, kv_layout_of(dec.engine))
    dec.add_decode(Request("lost", ids, SamplingParams(max_tokens=4)), desc)  # no prefill ever comes
    deadline = time.time() + 30
    final = None
    while final is None and time.time() < deadline:
        outs, _ = dec.poll(0.1)
        final = next((o for o in outs if o.request_id == "lost" and o.finished), None)
    assert final is not None and final.error.startswith("KVTransferError")
    assert dec.check_integrity()
    assert dec.engine.kv_manager.num_free_blocks == dec.engine.kv_manager.num_blocks
    assert _shm_files() <= before


@pytest.mark.parametrize("kv_dtype", ["int8", "fp16"])
def test_a_small_kv_travels_as_held_and_decodes_as_colocated(smollm_checkpoint, kv_dtype):
    """An int8 KV cache is sent as it is held (int8 K/V + float32 scales per token and head):
    about a quarter of float32's bytes; a float16 one as float16, half. The decode worker's pages
    equal the prefill worker's, so greedy output equals a co-located engine's with that cache."""
    def engine(**kw):
        return LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.25,
                   kv_cache_dtype=kv_dtype, num_threads=1, **kw).engine

    layout = kv_layout_of(engine())
    float_layout = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, "float32")
    if kv_dtype == "int8":
        assert [dt for _, dt in layout.parts()] == [torch.int8, torch.int8, torch.float32, torch.float32]
        assert layout.bytes_per_token() / float_layout.bytes_per_token() == pytest.approx(
            (layout.head_dim + 4) / (4 * layout.head_dim))  # 68 / 256 for head_dim 64
    else:
        assert [dt for _, dt in layout.parts()] == [torch.float16, torch.float16]
        assert layout.bytes_per_token() * 2 == float_layout.bytes_per_token()

    colocated = LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.25,
                    kv_cache_dtype=kv_dtype, num_threads=1)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = [o.outputs[0].token_ids for o in colocated.generate(PROMPTS, params, use_tqdm=False)]
    pre = WorkerCore("prefill", engine(max_num_batched_tokens=32), f"p-{kv_dtype}")
    dec = WorkerCore("decode", engine(), f"d-{kv_dtype}", transfer_timeout_s=5.0)
    try:
        tok, eos = colocated.tokenizer, colocated.engine.eos_token_ids
        sent = 0
        for i, prompt in enumerate(PROMPTS):
            out, stats = _decode_via(pre, dec, tok, eos, prompt, params, f"i{i}")
            assert out.error is None and out.outputs[0].token_ids == want[i], prompt
            m = len(tok.encode(prompt)) - 1
            sent += m
            assert all(t["bytes"] <= m * layout.bytes_per_token() for t in stats.get("transfers", []))
        assert pre.check_integrity() and dec.check_integrity()
    finally:
        pre.shutdown()
        dec.shutdown()


def test_local_channel_carries_every_part_of_an_int8_layer():
    layout = KVLayout(2, 3, 8, "float32", "int8")
    ch = LocalKVChannel(TransferDescriptor("t8", "ray", 5, layout))
    parts = [torch.randint(-128, 127, (5, 3, 8), dtype=torch.int8), torch.randint(-128, 127, (5, 3, 8), dtype=torch.int8),
             torch.rand(5, 3), torch.rand(5, 3)]
    ch.receive(1, 0, parts)
    assert ch.ready(1) == 5 and ch.ready(0) == 0
    assert all(torch.equal(a, b) for a, b in zip(ch.read(1, 0, 5), parts))


def _draft_engines(smollm_checkpoint, prefill_override=None, spec_copy="none"):
    """A prefill and a decode engine whose draft is the target itself (greedy drafts then match
    the target wherever the draft's KV is right, so wrong KV would show as lost acceptance)."""
    from specserve.disagg.worker import prefill_engine_kwargs

    kw = dict(dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.25, num_threads=1,
              draft_model="smollm2-135m-instruct", draft_checkpoint=smollm_checkpoint, num_spec_tokens=3,
              spec_policy="always", profile_spec_costs=False, spec_tree="chain", spec_copy=spec_copy)
    pre = LLM("smollm2-135m-instruct", max_num_batched_tokens=32, **(prefill_engine_kwargs(kw) | (prefill_override or {})))
    dec = LLM("smollm2-135m-instruct", **kw)
    return pre.engine, dec.engine


def _widest_draft_feed(engine):
    """Record the most tokens any one request feeds the decode worker's draft in a pass."""
    runner = engine.proposer.runner
    seen = {"max": 0}
    feed = runner.feed_inputs

    def spy(entries):
        seen["max"] = max([seen["max"], *(len(e.token_ids) for e in entries)])
        return feed(entries)

    runner.feed_inputs = spy
    return seen


def _final_and_draft_transfers(dec, rid):
    """Poll a decode worker until the request's final output (None after 60 s), collecting the
    draft-transfer records its polls report meanwhile."""
    final, drafts = None, []
    deadline = time.time() + 60
    while final is None and time.time() < deadline:
        outs, stats = dec.poll(0.1)
        drafts += stats["draft_transfers"]
        final = next((o for o in outs if o.request_id == rid and o.finished), None)
    return final, drafts


@pytest.mark.parametrize(("draft_on_prefill", "spec_copy"), [(True, "none"), (False, "none"), (True, "ngram")])
def test_the_drafts_prompt_kv_comes_from_the_prefill_worker(smollm_checkpoint, smollm_llm, draft_on_prefill, spec_copy):
    """With the decode workers' draft on the prefill worker too, the draft's prompt KV travels
    beside the target's: the decode worker's draft never feeds the prompt itself (its widest pass
    is a few tokens, not the prompt), accepts as a draft with the right KV does, greedy output
    equals co-located plain decoding, and both draft pools end whole. (The prefill worker runs the
    draft once the target's KV is sent, so the request's first few tokens decode without drafts.) Without a draft on the
    prefill worker the draft channel reports failure at once and the draft catches up itself. With
    --spec-copy in front of the draft (a hybrid) the draft's prompt KV travels the same way."""
    from specserve.disagg.worker import draft_kv_fingerprint

    override = None if draft_on_prefill else {"spec_method": "none", "spec_copy": "none"}
    pre_eng, dec_eng = _draft_engines(smollm_checkpoint, override, spec_copy)
    assert (draft_kv_fingerprint(pre_eng) == draft_kv_fingerprint(dec_eng)) is draft_on_prefill
    pre, dec = WorkerCore("prefill", pre_eng, "p-draft"), WorkerCore("decode", dec_eng, "d-draft", transfer_timeout_s=5.0)
    widest = _widest_draft_feed(dec_eng)
    # The decode worker decodes without drafts (a hybrid: by copying) while the draft's KV is on its
    # way, and a request that ends first cancels the rest of it: given 12 tokens, a request could end
    # before the draft's KV had all come (SmolLM2 decodes a token in under 3 ms on 2 Zen 5 threads).
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = PROMPTS[1:3]  # 60 and 70 tokens: three prefill chunks each
    want = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, params, use_tqdm=False)]
    tok, eos = smollm_llm.tokenizer, smollm_llm.engine.eos_token_ids
    layout = draft_kv_layout_of(dec_eng)
    before = _shm_files()
    try:
        for i, prompt in enumerate(prompts):
            ids = tok.encode(prompt)
            m = len(ids) - 1
            draft = TransferDescriptor(new_transfer_id(), "shm", m, layout)
            desc = TransferDescriptor(new_transfer_id(), "shm", m, kv_layout_of(pre_eng), draft=draft)
            dec.add_decode(Request(f"dr{i}", ids, params, eos_token_ids=eos), desc)
            reply = pre.prefill(f"dr{i}", ids[:m], desc)
            assert reply["draft_bytes"] == (m * layout.bytes_per_token() if draft_on_prefill else 0)
            final, drafts = _final_and_draft_transfers(dec, f"dr{i}")
            assert final is not None and final.error is None
            assert final.outputs[0].token_ids == want[i], prompt
            drafts += dec.poll(0.1)[1]["draft_transfers"]
            assert [d["ok"] for d in drafts] == [draft_on_prefill], str(drafts)
            if draft_on_prefill:
                assert drafts[0]["bytes"] == m * layout.bytes_per_token()
                # Only the tokens decoded before the draft's KV landed and the fed drafts, never the
                # prompt (which takes at least m in one pass, as below). How many tokens a hybrid
                # decodes by copying before it lands depends on the machine: 22 of 48 on a Zen 5.
                assert widest["max"] < m
            else:
                assert widest["max"] >= m  # it caught up on the prompt itself
        counters = dec_eng.spec_counters
        # The draft is the target: with its true KV it drafts what the target decodes (all but the
        # drafts past an end of output); KV in the wrong slots would show as rejections.
        assert counters["num_accepted_tokens"] >= 0.8 * counters["num_draft_tokens"] > 0
        assert pre.check_integrity() and dec.check_integrity()
        for eng in (pre_eng, dec_eng):
            if eng.proposer is not None:
                assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks
            assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
        assert _shm_files() <= before
    finally:
        pre.shutdown()
        dec.shutdown()


def _head_prompt_kv(engine, m):
    """Each request's EAGLE head KV of positions [0, m), snapshot the first time the head drafts
    with those slots filled."""
    prop = engine.proposer
    seen: dict[str, list[torch.Tensor]] = {}
    propose = prop.propose

    def spy(requests, num_tokens):
        out = propose(requests, num_tokens)
        for req in requests:
            seq = prop._seqs.get(req.request_id)
            if (req.request_id not in seen and seq is not None and seq.base == 0 and seq.num_computed_tokens >= m
                    and not prop.prompt_kv_pending(req.request_id)):
                slots = prop.prompt_kv_slots(req.request_id, 0, m)
                seen[req.request_id] = [t.view(-1, *t.shape[2:]).index_select(0, slots).clone() for t in prop.kv_cache]
        return out

    prop.propose = spy
    return seen


@pytest.mark.parametrize("head_on_prefill", [True, False])
def test_an_eagle_heads_prompt_kv_comes_from_the_prefill_worker(smollm_checkpoint, smollm_llm, tmp_path,
                                                                head_on_prefill):
    """EAGLE on decode workers: the prefill worker holding the same head feeds it the target's
    features of the prompt as its chunks run and sends the head's KV (one layer, slot p = (f_p,
    x_{p+1}), the last slot paired with the prompt's next token that the descriptor carries). The
    decode worker's head then holds the prompt's slots [0, m) equal to a co-located head's, greedy
    output equals plain decoding, and both head caches end empty. Without the head on the prefill
    worker the draft channel fails at once and the decode head drafts from its first decoded
    position, with no prompt slots at all (the behaviour before)."""
    from conftest import make_head_file

    from specserve.disagg.worker import draft_kv_fingerprint, prefill_engine_kwargs

    head = str(make_head_file(smollm_checkpoint, tmp_path / "eagle.safetensors", seed=3))
    kw = dict(dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.25, num_threads=1, spec_method="eagle",
              draft_model=head, spec_policy="always", profile_spec_costs=False)
    pre_kw = prefill_engine_kwargs(kw) | ({} if head_on_prefill else {"spec_method": "none"})
    pre_eng = LLM("smollm2-135m-instruct", max_num_batched_tokens=32, **pre_kw).engine
    dec_eng = LLM("smollm2-135m-instruct", **kw).engine
    ref_llm = LLM("smollm2-135m-instruct", **kw)  # co-located, the same head
    assert (draft_kv_fingerprint(pre_eng) == draft_kv_fingerprint(dec_eng)) is head_on_prefill
    pre, dec = WorkerCore("prefill", pre_eng, "p-eagle"), WorkerCore("decode", dec_eng, "d-eagle", transfer_timeout_s=5.0)
    params = SamplingParams(max_tokens=48, temperature=0.0)  # outlives the head's KV on its way (above)
    prompt = PROMPTS[2]  # 70 tokens: three prefill chunks of 32
    want = smollm_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = smollm_llm.tokenizer.encode(prompt)
    m = len(ids) - 1
    got, ref = _head_prompt_kv(dec_eng, m), _head_prompt_kv(ref_llm.engine, m)
    assert ref_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert len(ref) == 1
    layout = draft_kv_layout_of(dec_eng)
    assert layout.num_layers == 1
    before = _shm_files()
    try:
        draft = TransferDescriptor(new_transfer_id(), "shm", m, layout, next_token=ids[m])
        desc = TransferDescriptor(new_transfer_id(), "shm", m, kv_layout_of(pre_eng), draft=draft)
        dec.add_decode(Request("eg", ids, params, eos_token_ids=smollm_llm.engine.eos_token_ids), desc)
        reply = pre.prefill("eg", ids[:m], desc)
        assert reply["draft_bytes"] == (m * layout.bytes_per_token() if head_on_prefill else 0)
        final, drafts = _final_and_draft_transfers(dec, "eg")
        assert final is not None and final.error is None
        assert final.outputs[0].token_ids == want
        drafts += dec.poll(0.1)[1]["draft_transfers"]
        assert [d["ok"] for d in drafts] == [head_on_prefill]
        assert dec_eng.spec_counters["num_draft_tokens"] > 0
        if head_on_prefill:
            for a, b in zip(got["eg"], ref[next(iter(ref))]):
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)
        else:
            assert "eg" not in got  # the head never held the prompt's slots
        assert pre.check_integrity() and dec.check_integrity()
        for eng in (pre_eng, dec_eng):
            if eng.proposer is not None:
                assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks
                assert not eng.proposer.live_request_ids()
        assert _shm_files() <= before
    finally:
        pre.shutdown()
        dec.shutdown()


def test_the_router_pairs_drafter_kv_only_between_equal_drafters_and_names_the_next_token():
    """The router adds a drafter channel only between workers whose drafter fingerprints agree,
    and gives it the prompt's token after the m that travel (an EAGLE head's last slot needs it)."""
    from dataclasses import asdict
    from types import SimpleNamespace

    fp = {"layout": asdict(KVLayout(1, 3, 64, "float32")), "method": "eagle", "model": "head.safetensors",
          "num_layers": None, "target": "abc", "tokens_seen": 10, "head_vocab": 100}
    pre, dec = SimpleNamespace(info={"draft_kv": fp}), SimpleNamespace(info={"draft_kv": dict(fp)})
    d = DisaggRouter._draft_descriptor(pre, dec, "shm", [5, 6, 7, 8], 3, None)
    assert d is not None and d.num_tokens == 3 and d.next_token == 8 and d.layout == KVLayout(1, 3, 64, "float32")
    for other in ({**fp, "model": "other.safetensors"}, {**fp, "method": "mtp"}, None):
        assert DisaggRouter._draft_descriptor(SimpleNamespace(info={"draft_kv": other}), dec, "shm", [5, 6, 7, 8], 3,
                                              None) is None


def test_the_router_skips_the_prefill_for_prompts_the_shared_store_holds(tmp_path):
    """A prompt whose full blocks are all in a store every worker shares needs no prefill worker:
    the disk tier's folder (a file per block) or the store across hosts (asked in one call). A
    partial hit, or a store that does not answer, means a prefill."""
    import asyncio
    from types import SimpleNamespace

    from specserve.kv_cache.tiers import block_file_name

    held: dict[str, int] = {}

    class Store:
        class held:  # noqa: N801 - the actor method's shape: store.held.remote(fingerprint, hashes)
            @staticmethod
            async def remote(fingerprint, hashes):
                if fingerprint == "down":
                    raise ConnectionError("store unreachable")
                n = 0
                while n < len(hashes) and hashes[n] in held.get(fingerprint, ()):
                    n += 1
                return n

    held["fp"] = {1, 2, 3}
    remote = SimpleNamespace(kv_store=None, remote_store=Store(), remote_fingerprint="fp")
    stored = DisaggRouter._stored
    assert asyncio.run(stored(remote, [1, 2, 3])) is True
    assert asyncio.run(stored(remote, [1, 2, 4])) is False and asyncio.run(stored(remote, [])) is False
    assert asyncio.run(stored(SimpleNamespace(**{**vars(remote), "remote_fingerprint": "down"}), [1])) is False
    (tmp_path / block_file_name(5)).write_bytes(b"x")
    disk = SimpleNamespace(kv_store=str(tmp_path), remote_store=None, remote_fingerprint=None)
    assert asyncio.run(stored(disk, [5])) is True and asyncio.run(stored(disk, [5, 6])) is False


def test_a_draft_transfer_whose_request_ended_stops_the_prefill_workers_draft(smollm_checkpoint):
    """A request that ends on the decode worker before its draft's prompt KV has come (a one-token
    answer) cancels the transfer: the prefill worker stops running the draft between its passes
    instead of computing KV nobody will read, and no block or channel file is left behind."""
    pre_eng, dec_eng = _draft_engines(smollm_checkpoint)
    pre, dec = WorkerCore("prefill", pre_eng, "p-cancel"), WorkerCore("decode", dec_eng, "d-cancel", transfer_timeout_s=5.0)
    # The decode worker steps only once the prefill worker has sent its first draft pass: else
    # on a machine where the decode step wins the race the draft is cancelled before it starts
    # (draft_bytes 0), which would not show that a running draft stops between its passes.
    first_pass, ended = threading.Event(), threading.Event()
    send_draft, step = pre.connector._send_draft, dec_eng.step

    def sent_one(todo):
        send_draft(todo)
        if first_pass.is_set():  # later passes: each waits for the decode worker to have ended the
            ended.wait(5)        # request, then as slow as on a slow machine, so its cancel lands
            time.sleep(0.02)     # within the prompt however fast the draft or slow the decode step runs
        first_pass.set()

    def step_after_first_pass():
        first_pass.wait(10)
        try:
            return step()
        finally:
            if dec_eng.scheduler.requests.get("short") is None:
                ended.set()

    pre.connector._send_draft, dec_eng.step = sent_one, step_after_first_pass
    before = _shm_files()
    try:
        ids = smollm_checkpoint.tokenizer.encode("Once upon a time, " * 120)  # ~600 tokens: ~19 draft passes of 32
        m = len(ids) - 1
        layout = draft_kv_layout_of(dec_eng)
        desc = TransferDescriptor(new_transfer_id(), "shm", m, kv_layout_of(pre_eng),
                                  draft=TransferDescriptor(new_transfer_id(), "shm", m, layout))
        dec.add_decode(Request("short", ids, SamplingParams(max_tokens=1, temperature=0.0)), desc)
        reply = pre.prefill("short", ids[:m], desc)
        assert 0 < reply["draft_bytes"] < m * layout.bytes_per_token() / 2
        drafts = []
        deadline = time.time() + 10
        while not drafts and time.time() < deadline:
            drafts = dec.poll(0.1)[1]["draft_transfers"]
        assert [d["outcome"] for d in drafts] == ["request ended"]
        assert pre.check_integrity() and dec.check_integrity()
        assert dec_eng.proposer.kv.num_free_blocks == dec_eng.proposer.kv.num_blocks
        assert pre_eng.proposer.kv.num_free_blocks == pre_eng.proposer.kv.num_blocks
        assert _shm_files() <= before
    finally:
        pre.shutdown()
        dec.shutdown()


def test_layer_zero_start_runs_the_first_step_while_later_layers_arrive(pair, smollm_llm, smollm_checkpoint):
    """With kv_layer_start "first" a decode worker admits a request once layer 0 of its prompt KV
    is in and waits for each later layer inside that first step: here the layers arrive one by
    one (Ray's transport), each 10 ms after the step took the one before, the step waits for
    them, and the output equals co-located decoding."""
    from specserve.disagg.kv_transfer import STATUS_DONE, open_receiver

    pre, _ = pair
    engine = LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.25).engine
    dec = WorkerCore("decode", engine, "d-first", transfer_timeout_s=5.0, kv_layer_start="first")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        prompt = PROMPTS[2]
        want = smollm_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        ids = smollm_llm.tokenizer.encode(prompt)
        m = len(ids) - 1
        layout = kv_layout_of(pre.engine)
        staging = TransferDescriptor(new_transfer_id(), "shm", m, layout)  # the prefill's KV, held back
        held = open_receiver(staging)
        pre.prefill("l0", ids[:m], staging)
        assert held.status == STATUS_DONE
        desc = TransferDescriptor(new_transfer_id(), "ray", m, layout)
        dec.add_decode(Request("l0", ids, params, eos_token_ids=smollm_llm.engine.eos_token_ids), desc)
        dec.receive_kv(desc.transfer_id, 0, 0, held.read(0, 0, m))
        inc = None
        deadline = time.time() + 10
        while inc is None and time.time() < deadline:  # wait until the first step has begun
            inc = next((i for i in list(dec.connector._step) if i.request.request_id == "l0"), None)
            time.sleep(0.0005)
        assert inc is not None, "the request was not admitted on layer 0 alone"
        for layer in range(1, layout.num_layers):
            # Each layer goes 10 ms after the step has taken the one before: sent at fixed times
            # from admission (3 ms apart), they had all arrived on a slower machine before the
            # step reached layer 1, and the step never waited.
            while inc.loaded[layer - 1] < m and time.time() < deadline:
                time.sleep(0.0002)
            time.sleep(0.01)
            dec.receive_kv(desc.transfer_id, layer, 0, held.read(layer, 0, m))
        dec.finish_kv(desc.transfer_id, True)
        final = None
        while final is None and time.time() < deadline:
            outs, stats = dec.poll(0.1)
            final = next((o for o in outs if o.finished), final)
        assert final is not None and final.error is None and final.outputs[0].token_ids == want
        assert inc.stats.waited_in_step_s > 0.05  # 29 layers, each 10 ms after the last: mostly waited for inside the step
        assert dec.check_integrity()
        held.close()
    finally:
        dec.shutdown()



class _CountingStack:
    """Stands in for a native DecoderStack and counts its forward calls."""

    def __init__(self, stack):
        self.stack, self.num_layers, self.calls = stack, stack.num_layers, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def test_a_decode_workers_ordinary_steps_keep_the_native_stack(smollm_path):
    """A connector's layer hooks run only in steps that move KV: with hooks the model runs layer by
    layer in Python, so a decode worker that kept them on for good lost the native one-call stack
    on every step (1.46x slower at batch 1, SmolLM2 on auto)."""
    engine = LLM("smollm2-135m-instruct", kv_cache_gib=0.25, num_threads=1).engine  # auto: native ops
    model = engine.runner.model.model
    assert model.native_stack is not None
    model.native_stack = counting = _CountingStack(model.native_stack)
    dec = WorkerCore("decode", engine, "d-native")
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        dec.add_decode(Request("local", engine.tokenizer.encode("Name a colour."), params), None)
        final = None
        deadline = time.time() + 30
        while final is None and time.time() < deadline:
            final = next((o for o in dec.poll(0.1)[0] if o.finished), None)
        assert final is not None and len(final.outputs[0].token_ids) == 6
        assert counting.calls >= 6  # the prompt and every decode step through the native stack
        assert model.layer_hooks is None
    finally:
        dec.shutdown()
