"""EAGLE heads: the training forward is the serving forward, features reach the head, heads are
checked against their target, and `specserve train-draft` runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention import build_attention_metadata
from specserve.errors import ConfigError
from specserve.kv_cache.pages import LayerKV
from specserve.models.llama import RotaryEmbedding
from specserve.spec.eagle import EagleHead, head_arch


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=2)
    return ckpt


def _paged(head, rope, emb, feat, positions, starts, counts, tables, tails, kv):
    meta = build_attention_metadata(counts, starts, tables, 16, torch.device("cpu"), tails)
    return head.forward_paged(emb, feat, torch.tensor(positions), rope, kv, meta)


def _record_features(proposer) -> dict[str, dict[int, torch.Tensor]]:
    """Every feature row the engine hands `proposer`, by request and position (filled as it runs)."""
    seen: dict[str, dict[int, torch.Tensor]] = {}
    orig = proposer.observe_hidden

    def spy(hidden):
        for rid, hr in hidden.items():
            for j in range(hr.rows.shape[0]):
                seen.setdefault(rid, {})[hr.start_pos + j] = hr.rows[j].clone()
        orig(hidden)

    proposer.observe_hidden = spy
    return seen


def test_unrolled_training_forward_is_the_serving_forward(tiny):
    """Pass 1 of training == the catch-up pass over the head's paged cache; pass 2 at row i ==
    a depth-1 tree node at position i fed pass 1's output at i - 1, seeing the prefix up to i - 1
    and itself. So what the head is trained on is what it does when serving."""
    torch.manual_seed(0)
    arch = head_arch(tiny.arch)
    head = EagleHead(arch).eval()
    s, h = 24, arch.hidden_size
    emb, feat = torch.randn(1, s, h), torch.randn(1, s, h)
    rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, 128)
    with torch.no_grad():
        p1, p2 = head.forward_unrolled(emb, feat, rope.cos[:s], rope.sin[:s], depth=2)
        kv = LayerKV(*(torch.zeros(4, 16, arch.num_kv_heads, arch.head_dim) for _ in range(2)))
        out = _paged(head, rope, emb[0], feat[0], list(range(s)), [0], [s], [[0, 1, 2, 3]], None, kv)
        torch.testing.assert_close(out, p1[0], atol=1e-5, rtol=1e-4)
        for i in (1, 7, s - 1):  # a depth-1 node after the true prefix 0 .. i-1
            kv_i = LayerKV(*(torch.zeros(4, 16, arch.num_kv_heads, arch.head_dim) for _ in range(2)))
            _paged(head, rope, emb[0, :i], feat[0, :i], list(range(i)), [0], [i], [[0, 1, 2, 3]], None, kv_i)
            node = _paged(head, rope, emb[0, i : i + 1], p1[0, i - 1 : i], [i], [i], [1], [[0, 1, 2, 3]],
                          [torch.ones(1, 1, dtype=torch.bool)], kv_i)
            torch.testing.assert_close(node[0], p2[0, i], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("method", "precision"), [("eagle", None), ("mtp", None), ("eagle", "auto")])
def test_a_quantized_heads_layer_in_one_native_call_equals_its_native_ops(smollm_path, smollm_checkpoint, tmp_path, method,
                                                                          precision):
    """On a native target the head's matrices are quantized (4-bit blocks by default, as a draft
    model's; Q8_0 with --draft-quantization auto), its rows of the target's LM head likewise, and its
    layer runs as one native call (a DecoderStack of one layer): the same kernels its native ops
    call one by one, so a catch-up pass and a tree pass over it give the same bits, and write the
    same KV, as the layer module."""
    from conftest import make_head_file

    from specserve.models.block_linear import FOUR_BIT, Q8_0

    path = make_head_file(smollm_checkpoint, tmp_path / f"{method}.safetensors", seed=3, method=method)
    llm = LLM(str(smollm_path), spec_method=method, draft_model=str(path), profile_spec_costs=False,
              draft_quantization=precision)
    proposer = llm.engine.proposer.drafter if hasattr(llm.engine.proposer, "drafter") else llm.engine.proposer
    head = proposer.head
    assert head.native_stack is not None
    four_bit = precision is None
    assert proposer.weight_format == ("4-bit" if four_bit else "Q8_0")
    assert f"MLP {head.arch.intermediate_size}, {proposer.weight_format}" in llm.engine.describe()["speculation"]
    for linear in (head.fc, head.layer.self_attn.o_proj, head.layer.mlp.down_proj):
        assert (linear.qtype in FOUR_BIT) if four_bit else linear.qtype == Q8_0
    target_rows = llm.engine.runner.model.lm_head.qtype
    assert proposer.lm_head.proj.qtype in (FOUR_BIT if four_bit else (target_rows,))
    arch = head.arch
    torch.manual_seed(1)
    s, h = 20, arch.hidden_size
    emb, feat = torch.randn(s + 3, h), torch.randn(s + 3, h)
    rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, 128)
    outs, caches = [], []
    for native in (head.native_stack, None):
        head.native_stack = native
        kv = LayerKV(*(torch.zeros(4, 16, arch.num_kv_heads, arch.head_dim) for _ in range(2)))
        with torch.inference_mode():
            a = _paged(head, rope, emb[:s], feat[:s], list(range(s)), [0], [s], [[2, 0, 3, 1]], None, kv)
            tail = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and its two children
            b = _paged(head, rope, emb[s:], feat[s:], [s, s + 1, s + 1], [s], [3], [[2, 0, 3, 1]], [tail], kv)
        outs.append((a, b))
        caches.append(kv)
    for x, y in zip(outs[0], outs[1]):
        assert torch.equal(x, y)
    for x, y in zip(caches[0], caches[1]):
        assert torch.equal(x, y)


def test_a_catch_up_call_is_not_learned_as_a_draft_pass(tiny, tmp_path):
    """The policy learns a head pass's cost from propose() calls that fed each request at most a
    steady call's features (its accepted nodes and the next token); a call that caught a request
    up on its prompt is not counted as one (the cost model charges catch-up apart)."""
    from conftest import make_head_file

    from specserve.spec.eagle import STEADY_CATCHUP

    path = make_head_file(tiny, tmp_path / "head.safetensors")
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(path),
              spec_policy="always", spec_copy="none", num_spec_tokens=4, profile_spec_costs=False)
    prop = llm.engine.proposer
    calls = []
    propose = prop.propose

    def spy(requests, num_tokens):
        fed = max(prop.catchup_tokens(r) for r in requests)
        out = propose(requests, num_tokens)
        calls.append((fed, prop.last_pass_time_s))
        return out

    prop.propose = spy
    llm.generate([list(range(3, 3 + 2 * STEADY_CATCHUP))], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert calls[0][0] > STEADY_CATCHUP and calls[0][1] is None  # the prompt's features
    steady = [t for fed, t in calls[1:] if fed <= STEADY_CATCHUP]
    assert len(steady) == len(calls) - 1 and all(t is not None and t > 0 for t in steady)


def test_the_head_receives_the_targets_features_of_verified_tokens_only(tiny, tmp_path):
    """Every feature the engine hands the head equals the target's hidden state of that token in
    a plain prefill of the final sequence: rejected tree nodes' rows never reach it."""
    from conftest import make_head_file

    path = make_head_file(tiny, tmp_path / "h.safetensors")
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(path),
              spec_policy="always", num_spec_tokens=4, profile_spec_costs=False)
    eng = llm.engine
    seen = _record_features(eng.proposer)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [40, 41, 42]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert eng.spec_counters["num_draft_tokens"] > 0
    assert eng.spec_counters["num_draft_tokens"] > eng.spec_counters["num_accepted_tokens"]  # some rejected
    ref = LLM("tiny", dtype="float32", checkpoint=tiny)
    runner = ref.engine.runner
    from specserve.engine.runner import FeedEntry

    for o in outs:
        full = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        n = len(full) - 1  # the last token is never fed
        hid = runner.hidden_states([FeedEntry(full[:n], list(range(n)), 0, list(range(8)), None, [])])
        rows = seen[o.request_id]
        assert set(range(n)) <= set(rows)  # (a final step may verify past max_tokens; those are cut)
        for pos in range(n):
            torch.testing.assert_close(rows[pos], hid[pos], atol=1e-4, rtol=1e-4)
    assert not eng.proposer.live_request_ids()
    assert eng.proposer.kv.num_free_blocks == eng.proposer.kv.num_blocks


def test_requests_that_opt_out_of_speculation_cost_the_head_nothing(tiny, tmp_path):
    """speculative=False: the step keeps none of the request's features and asks neither the copier
    nor the cost model (SmolLM2 + EAGLE served such requests at 0.91x the plain engine's tokens/s);
    beside a request that speculates, that one's features still arrive, every token, and both
    outputs equal plain decoding's."""
    from conftest import make_head_file

    path = make_head_file(tiny, tmp_path / "h.safetensors")
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(path),
              num_spec_tokens=4, profile_spec_costs=False)
    eng = llm.engine
    seen = _record_features(eng.proposer)
    asked = []
    for name in ("free_drafts", "propose"):
        orig = getattr(eng.proposer, name)
        setattr(eng.proposer, name, lambda *a, _o=orig, _n=name: asked.append(_n) or _o(*a))
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [40, 41, 42, 40, 41]]
    off = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=False)
    plain = LLM("tiny", dtype="float32", checkpoint=tiny).generate(prompts, off)
    outs = llm.generate(prompts, off)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert seen == {} and asked == [] and eng.spec_counters["num_drafts"] == 0

    always = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(path),
                 spec_policy="always", num_spec_tokens=4, profile_spec_costs=False)
    seen = _record_features(always.engine.proposer)
    on = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = always.generate(prompts, [off, on])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert list(seen) == [outs[1].request_id]
    n = len(outs[1].prompt_token_ids) + len(outs[1].outputs[0].token_ids) - 1
    assert set(range(n)) <= set(seen[outs[1].request_id])
    assert always.engine.spec_counters["num_drafts"] > 0 and always.engine.check_integrity()


def test_a_fusing_head_reads_the_targets_residual_streams_and_stays_exact(tmp_path):
    """EAGLE-3's fusion: the head is handed, per verified token, the target's residual streams
    after its feature layers beside the last hidden state (the same rows a plain forward computes),
    and greedy speculation with it equals plain decoding, batched and alone."""
    from conftest import make_head_file, tiny_checkpoint

    from specserve.engine.runner import FeedEntry

    _, ckpt = tiny_checkpoint("llama", seed=7, vocab=256, layers=4)
    path = make_head_file(ckpt, tmp_path / "fused.safetensors", feature_layers=[1, 3])
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, spec_method="eagle", draft_model=str(path),
              spec_policy="always", num_spec_tokens=4, profile_spec_costs=False)
    eng = llm.engine
    assert eng.proposer.feature_layers() == (1, 3) and eng.runner.feature_layers == (1, 3)
    seen = _record_features(eng.proposer)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [40, 41, 42], [200, 3]]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    plain = LLM("tiny", dtype="float32", checkpoint=ckpt)
    want = plain.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert llm.generate(prompts[1:2], params)[0].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert eng.spec_counters["num_draft_tokens"] > 0 and eng.check_integrity()

    runner, h = plain.engine.runner, ckpt.arch.hidden_size
    model = runner.model.model
    for o in outs:
        full = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        n = len(full) - 1
        entry = [FeedEntry(full[:n], list(range(n)), 0, list(range(8)), None, [])]
        last = runner.hidden_states(entry)
        assert last.shape == (n, h)
        # The residual streams, layer by layer, as the model's own layers compute them.
        inputs = runner.feed_inputs(entry)
        x = model.embed_tokens(inputs.input_ids)
        streams = []
        for i in range(4):
            x = model.layers[i](x, inputs.positions, model.rotary, runner.kv_caches[i], inputs.meta)
            streams.append(x)
        rows = torch.stack([seen[o.request_id][p] for p in range(n)])
        assert rows.shape == (n, 3 * h)
        torch.testing.assert_close(rows[:, :h], streams[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rows[:, h : 2 * h], streams[2], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rows[:, 2 * h :], last, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="feature layers"):
        runner.feature_layers = (4,)


def test_a_fused_head_projects_the_rows_of_held_back_requests_in_batches_and_drafts_from_all_of_them(tmp_path):
    """The rows of a request that is not drafting wait unprojected (FUSE_AT at a time, and all
    of them once it drafts), so a step that drafts nothing pays no fusion; the head is fed the
    same features either way, and greedy speculation after such a wait equals plain decoding."""
    from conftest import make_head_file, tiny_checkpoint

    from specserve.engine.runner import HiddenRows
    from specserve.spec.eagle import FUSE_AT

    _, ckpt = tiny_checkpoint("llama", seed=7, vocab=256, layers=4)
    path = make_head_file(ckpt, tmp_path / "fused.safetensors", feature_layers=[1, 3])
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, spec_method="eagle", draft_model=str(path),
              spec_policy="always", num_spec_tokens=4, profile_spec_costs=False)
    prop = llm.engine.proposer
    width = 3 * ckpt.arch.hidden_size
    rows = torch.randn(FUSE_AT + 9, width)
    for p in range(FUSE_AT + 9):  # one verified token a step, never drafted for
        prop.observe_hidden({"a": HiddenRows(p, rows[p : p + 1])})
    seq = prop._seqs["a"]
    assert seq.raw.count == 9 and seq.num_pending == FUSE_AT + 9 and seq.next_pos == FUSE_AT + 9
    prop._fuse([seq])
    fed = torch.cat(seq.pending.parts)
    assert seq.raw.count == 0 and fed.shape == (FUSE_AT + 9, ckpt.arch.hidden_size)
    torch.testing.assert_close(fed, prop.head.target_feature(rows), rtol=1e-5, atol=1e-5)
    prop.remove_request("a")
    # End to end: requests whose drafting waits behind a long prompt's rows stay exact.
    prompts = [list(range(3, 3 + FUSE_AT + 5)), [40, 41, 42]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM("tiny", dtype="float32", checkpoint=ckpt).generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.spec_counters["num_draft_tokens"] > 0 and llm.engine.check_integrity()


def test_capturing_feature_layers_leaves_the_native_forward_bit_identical(smollm_path):
    """The native stack split at the feature layers runs the same kernels: the last hidden states
    are bit for bit those of the one-call stack, so a fusing head cannot change the target."""
    from specserve.engine.runner import FeedEntry

    llm = LLM("smollm2-135m-instruct")
    runner = llm.engine.runner
    assert runner.model.model.native_stack is not None
    ids = llm.engine.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    entry = [FeedEntry(ids, list(range(len(ids))), 0, list(range(8)), None, [])]
    plain = runner.hidden_states(entry)
    runner.feature_layers = (2, 15)
    fused = runner.hidden_states(entry)
    h = plain.shape[1]
    assert fused.shape == (len(ids), 3 * h)
    assert torch.equal(fused[:, 2 * h :], plain)
    assert fused[:, :h].abs().sum() > 0 and not torch.equal(fused[:, :h], fused[:, h : 2 * h])
    # One native call that keeps the streams (DecoderStack.forward_capturing) against the stack
    # split at the feature layers into three calls: every row bit for bit.
    model = runner.model.model
    inputs = runner.feed_inputs(entry)
    model.captured = []
    last = model._forward_capturing(model.embed_tokens(inputs.input_ids), inputs.positions, runner.kv_caches, inputs.meta, None)
    split = torch.cat((*model.captured, model.norm(last)), dim=-1)
    model.captured = []
    assert torch.equal(split, fused)
    with pytest.raises(RuntimeError, match="capture layers must ascend"):
        model.native_stack.forward_capturing(model.embed_tokens(inputs.input_ids), inputs.positions, model.rotary.cos,
                                             model.rotary.sin, [t for pair in runner.kv_caches for t in pair],
                                             inputs.meta.slot_mapping, inputs.meta.block_tables, inputs.meta.attn_mask,
                                             inputs.meta.query_index, model.layers[0].self_attn.scale, [15, 2])


def test_a_head_for_another_target_or_no_head_is_refused(tiny, tmp_path):
    from conftest import make_head_file, tiny_checkpoint

    _, other = tiny_checkpoint("llama", seed=6, vocab=256, layers=2)
    path = make_head_file(other, tmp_path / "other.safetensors")
    with pytest.raises(ConfigError, match="trained for another target"):
        LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(path))
    with pytest.raises(ConfigError, match="train-draft"):
        LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(tmp_path / "none.safetensors"))
    with pytest.MonkeyPatch.context() as mp:  # nothing in the cache: the message names the command for this method
        mp.setenv("SPECSERVE_CACHE", str(tmp_path / "empty-cache"))
        for method in ("eagle", "medusa", "mtp"):
            with pytest.raises(ConfigError, match=f"`specserve train-draft --method {method} --model tiny`"):
                LLM("tiny", dtype="float32", checkpoint=tiny, spec_method=method)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ConfigError, match="not a readable"):
        LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model=str(bad))


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_head_file_with_a_broken_card_or_token_ids_is_refused_by_name(tiny, tmp_path, method):
    """Each of these was a KeyError / JSONDecodeError / IndexError / ZeroDivisionError traceback (or,
    for Medusa's shapes, torch's RuntimeError) out of the engine's start."""
    import json

    from conftest import make_head_file
    from safetensors import safe_open
    from safetensors.torch import save_file

    good = make_head_file(tiny, tmp_path / "good.safetensors", method=method)
    with safe_open(str(good), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    card = json.loads(meta["card"])
    size = "intermediate_size" if method == "eagle" else "num_heads"
    first = next(k for k in tensors if k != "token_ids")
    cases = {
        "no-card": ({k: v for k, v in meta.items() if k != "card"}, tensors, "without a readable card"),
        "card-json": ({**meta, "card": "{oops"}, tensors, "without a readable card"),
        "card-list": ({**meta, "card": "[1]"}, tensors, "not a JSON object"),
        "card-size": ({**meta, "card": json.dumps({**card, size: "many"})}, tensors, f"card's {size} is 'many'"),
        "no-ids": (meta, {k: v for k, v in tensors.items() if k != "token_ids"}, "holds no token_ids"),
        "empty-ids": (meta, {**tensors, "token_ids": torch.zeros(0, dtype=torch.int64)}, "non-empty list"),
        "float-ids": (meta, {**tensors, "token_ids": tensors["token_ids"].float()}, "non-empty list"),
        "far-ids": (meta, {**tensors, "token_ids": tensors["token_ids"] + 10**6}, "outside this target's vocabulary"),
        "shape": (meta, {**tensors, first: tensors[first][:-1].contiguous()}, "does not hold"),
    }
    for name, (m, t, match) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(t, str(path), metadata=m)
        with pytest.raises(ConfigError, match=match):
            LLM("tiny", dtype="float32", checkpoint=tiny, spec_method=method, draft_model=str(path))


def test_a_bfloat16_copy_of_the_target_finds_its_heads_and_legacy_heads_still_serve(tiny, tmp_path, monkeypatch):
    """The fingerprint is the same for the float32 target (the CPU's default) and a bfloat16 copy
    (a GPU's); a head that carries the older float16-rows fingerprint is accepted and its cache
    folder moves to the current fingerprint, so `--draft-model auto` finds it."""
    from specserve.spec.eagle import save_head, target_fingerprint, target_fingerprints

    emb = tiny.weights["model.embed_tokens.weight"].float()
    fp = target_fingerprint(tiny.arch, None, emb)
    assert target_fingerprint(tiny.arch, None, emb.to(torch.bfloat16)) == fp
    legacy = target_fingerprint(tiny.arch, None, emb, legacy=True)
    assert legacy != fp
    assert target_fingerprint(tiny.arch, None, emb * 1.01) != fp  # another model's embedding

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    old = tmp_path / "heads" / legacy / "eagle.safetensors"
    save_head(old, EagleHead(head_arch(tiny.arch)), torch.arange(tiny.arch.vocab_size),
              {"method": "eagle", "target": legacy, "target_name": "tiny",
               "intermediate_size": tiny.arch.intermediate_size})
    assert target_fingerprints(tiny.arch, None, emb) == (fp, legacy)
    moved = tmp_path / "heads" / fp / "eagle.safetensors"
    assert moved.is_file() and not old.parent.exists()
    from specserve.spec.eagle import load_head_for

    assert load_head_for(moved, "eagle", fp)[1]["target"] == fp  # re-carded: a bfloat16 target accepts it
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="eagle", draft_model="auto",
              spec_policy="always", profile_spec_costs=False)
    base = LLM("tiny", dtype="float32", checkpoint=tiny).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0))
    assert out[0].token_ids == base[0].token_ids
    assert llm.engine.spec_counters["num_draft_tokens"] > 0


def test_held_out_conversations_share_no_ask_with_the_training_ones(tmp_path):
    """Greedy answers to the same ask are the same text: held-out conversations come from subjects
    and wordings no training conversation uses, or the held-out top-1 would score memorised text."""
    from specserve.spec import asks
    from specserve.spec.asks import chat_prompts

    src = tmp_path / "m.py"
    src.write_text('def area(w, h):\n    """Return the area of a w by h rectangle."""\n    return w * h\n')
    train = chat_prompts([src], 800, seed=0)
    held = chat_prompts([src], 200, seed=1000, held=True)
    assert len(set(train)) == len(train) == 800 and len(set(held)) == len(held) == 200  # distinct asks

    def parts(p: str, asks: tuple[str, ...], slot: str, fills: tuple[str, ...], styles: tuple[str, ...]):
        """(wording, fill) of a prompt built from `asks` with `slot` filled from `fills`, or None."""
        for a in asks:
            pre, post = a.split(slot)
            for s in set(styles):
                if p.startswith(pre) and p.endswith(post + s) and p[len(pre) : len(p) - len(post + s)] in fills:
                    return a, p[len(pre) : len(p) - len(post + s)]
        return None

    def split(prompts: list[str]) -> tuple[set, set]:
        prose = {x for p in prompts if (x := parts(p, asks.PROSE_ASKS, "{t}", asks.TOPICS, asks.STYLES))}
        tasks = {x for p in prompts if (x := parts(p, asks.TASK_ASKS, "{task}", asks.TASKS, asks.CODE_STYLES))}
        return prose, tasks

    (tp, tt), (hp, ht) = split(train), split(held)
    assert len(tp) > 300 and len(tt) > 100 and len(hp) > 60 and len(ht) > 15  # half prose, a quarter tasks
    for tr, he in ((tp, hp), (tt, ht)):
        assert not {w for w, _ in tr} & {w for w, _ in he}  # no wording in both
        assert not {f for _, f in tr} & {f for _, f in he}  # no subject or task in both
    # bench/prompts.py's asks stay held out from every head trained here.
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_prompts", Path(__file__).resolve().parents[2] / "bench" / "prompts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert not set(bench.CODING + bench.PROSE) & set(train + held)
    for subject in ("bicycle", "autumn", "neighbours", "heist", "rabbit", "fishing village", "job interview",
                    "hot chocolate", "interval", "LRU", "CSV", "binary search", "word frequencies", "prime", "flatten", "email address"):
        assert not any(subject in f for _, f in tp | hp | tt | ht), subject


@pytest.mark.slow
def test_train_draft_end_to_end_on_smollm2_resumes_and_serves(smollm_path, tmp_path):
    """A tiny budget: features, a few steps, the card, the plot; a rerun with more epochs resumes
    from the checkpoint; the head serves with greedy output equal to plain decoding."""
    from specserve.spec.train import TrainConfig, train_draft

    out = tmp_path / "eagle.safetensors"
    cfg = dict(model="smollm2-135m-instruct", out=str(out), tokens=1536, heldout_tokens=512, seq_len=128,
               batch_tokens=512, generated_share=0.5, work_dir=str(tmp_path / "work"), generate_max_tokens=48)
    card = train_draft(TrainConfig(epochs=1, **cfg))
    assert card["method"] == "eagle" and card["complete"]
    assert card["steps"] == card["total_steps"] == 3
    assert card["tokens_seen"] == 3 * 512
    assert 0 <= card["heldout_accept_depth1"] <= 1 and len(card["heldout_accept_by_depth"]) == 2
    kinds = card["heldout_accept_by_kind"]  # corpus text and the target's own conversations, apart
    assert set(kinds) == {"corpus", "conversations"} and all(len(a) == 2 and 0 <= min(a) <= max(a) <= 1 for a in kinds.values())
    assert min(kinds["corpus"][0], kinds["conversations"][0]) - 1e-6 <= card["heldout_accept_depth1"] <= max(
        kinds["corpus"][0], kinds["conversations"][0]) + 1e-6  # the whole is between its parts (equal batches)
    assert json.loads(out.with_suffix(".json").read_text())["target"] == card["target"]
    assert out.with_suffix(".png").stat().st_size > 1000
    again = train_draft(TrainConfig(epochs=2, **cfg))  # resumes at step 3: features are not recomputed
    assert again["steps"] == again["total_steps"] == 6
    assert again["extract_s"] < card["extract_s"]

    prompts = ["def add(a, b):", "The capital of France is"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM("smollm2-135m-instruct").generate(prompts, params)
    llm = LLM("smollm2-135m-instruct", spec_method="eagle", draft_model=str(out), spec_policy="always")
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    assert llm.engine.check_integrity()

    medusa_out = tmp_path / "medusa.safetensors"
    mcard = train_draft(TrainConfig(epochs=1, method="medusa", **{**cfg, "out": str(medusa_out)}))
    assert mcard["method"] == "medusa" and mcard["num_heads"] == 3 and mcard["complete"]
    assert mcard["extract_s"] < card["extract_s"]  # the same features, not extracted again
    llm = LLM("smollm2-135m-instruct", spec_method="medusa", draft_model=str(medusa_out), spec_policy="always")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    with pytest.raises(ConfigError, match="not a 'eagle' head"):
        LLM("smollm2-135m-instruct", spec_method="eagle", draft_model=str(medusa_out))

    mtp_out = tmp_path / "mtp.safetensors"  # DeepSeek-V3's MTP module, cross-entropy alone, same features
    tcard = train_draft(TrainConfig(epochs=1, method="mtp", **{**cfg, "out": str(mtp_out)}))
    assert tcard["method"] == "mtp" and tcard["complete"] and tcard["extract_s"] < card["extract_s"]
    llm = LLM("smollm2-135m-instruct", spec_method="mtp", draft_model=str(mtp_out), spec_policy="always")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    assert "MTP module" in llm.engine.describe()["speculation"]


def _random_mtp_in_deepseek_names(arch, seed: int) -> dict[str, torch.Tensor]:
    """A randomly initialised MTP module's tensors as DeepSeek-V3's checkpoints name them."""
    from specserve.spec.eagle import MTPModule, mtp_in_deepseek_names

    torch.manual_seed(seed)
    return {k: t.contiguous() for k, t in mtp_in_deepseek_names(MTPModule(head_arch(arch)).state_dict()).items()}


def test_an_mtp_module_shipped_in_deepseek_names_is_imported(tiny, tmp_path):
    """A checkpoint's own MTP layer (eh_proj / enorm / hnorm / shared_head.norm and a block, under
    its layer prefix, beside the embedding and head it shares) serves as --spec-method mtp with
    greedy output equal to plain; one made for another hidden size is refused."""
    from safetensors.torch import save_file

    h = tiny.arch.hidden_size
    theirs = {f"model.layers.2.{name}": t for name, t in _random_mtp_in_deepseek_names(tiny.arch, seed=3).items()}
    theirs["model.layers.2.embed_tokens.weight"] = torch.zeros(tiny.arch.vocab_size, h)
    theirs["model.layers.2.shared_head.head.weight"] = torch.zeros(tiny.arch.vocab_size, h)
    path = tmp_path / "mtp.safetensors"
    save_file(theirs, str(path))
    prompts = [[5, 9, 11, 13] * 4, list(range(3, 30))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = LLM("tiny", dtype="float32", checkpoint=tiny).generate(prompts, params)
    llm = LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="mtp", draft_model=str(path), spec_policy="always",
              draft_p_min=0.0, profile_spec_costs=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in base]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    assert "imported from a checkpoint" in llm.engine.describe()["speculation"]
    bad = {k: (v[:, :h].contiguous() if k.endswith("eh_proj.weight") else v) for k, v in theirs.items()}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError, match="another model"):
        LLM("tiny", dtype="float32", checkpoint=tiny, spec_method="mtp", draft_model=str(tmp_path / "bad.safetensors"),
            profile_spec_costs=False)


def test_the_mtp_layer_a_gguf_model_ships_drafts_by_default(tiny, tmp_path):
    """A GGUF that ships a multi-token-prediction layer (llama.cpp's blk.N.nextn.* and
    <arch>.nextn_predict_layers) serves `--spec-method mtp` with it and no --draft-model: the
    module drafts as the same tensors imported from a safetensors file in DeepSeek-V3's names do,
    greedy output equal to plain; the file as --draft-model of another method, and a GGUF without
    such a layer as an MTP module, are refused with the reason."""
    from safetensors.torch import save_file

    from specserve.testing import write_gguf_model

    deepseek = _random_mtp_in_deepseek_names(tiny.arch, seed=4)
    a = tiny.arch
    cfg = {"layers": a.num_layers, "hidden": a.hidden_size, "ffn": a.intermediate_size, "heads": a.num_heads,
           "kv_heads": a.num_kv_heads}
    path = write_gguf_model(tmp_path / "ships.gguf", "llama", tiny.weights, cfg, mtp=deepseek, byte_vocab=True)
    plain_file = write_gguf_model(tmp_path / "plain.gguf", "llama", tiny.weights, cfg, byte_vocab=True)
    save_file({f"model.layers.{a.num_layers}.{n}": t for n, t in deepseek.items()}, str(tmp_path / "mtp.safetensors"))

    prompts = [[5, 9, 11, 13] * 4, list(range(3, 30))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    opts = {"dtype": "float32", "spec_policy": "always", "draft_p_min": 0.0, "profile_spec_costs": False}
    base = [o.token_ids for o in LLM(str(plain_file), dtype="float32").generate(prompts, params)]
    plain = LLM(str(path), dtype="float32")
    assert base == [o.token_ids for o in plain.generate(prompts, params)]  # the layer is not run
    assert "ships a multi-token-prediction layer: --spec-method mtp" in plain.engine.describe()["speculation"]
    shipped = LLM(str(path), spec_method="mtp", **opts)
    assert [o.token_ids for o in shipped.generate(prompts, params)] == base
    assert "shipped in the GGUF file" in shipped.engine.describe()["speculation"]
    imported = LLM(str(path), spec_method="mtp", draft_model=str(tmp_path / "mtp.safetensors"), **opts)
    assert [o.token_ids for o in imported.generate(prompts, params)] == base
    counters = ("num_draft_tokens", "num_accepted_tokens")
    assert shipped.engine.spec_counters["num_draft_tokens"] > 0
    assert [shipped.engine.spec_counters[c] for c in counters] == [imported.engine.spec_counters[c] for c in counters]

    with pytest.raises(ConfigError, match="not a 'eagle' head"):
        LLM(str(plain_file), spec_method="eagle", draft_model=str(path), profile_spec_costs=False)
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        LLM(str(path), spec_method="mtp", draft_model=str(plain_file), profile_spec_costs=False)


def test_the_mtp_layer_a_hf_directory_ships_drafts_by_default(tiny, tmp_path):
    """A HF directory whose safetensors hold an MTP layer after the decoder's (DeepSeek-V3's
    model.layers.N.eh_proj and block, num_nextn_predict_layers in config.json) serves `--spec-method
    mtp` with it and no --draft-model; the network is the one without it."""
    from safetensors.torch import save_file

    n = tiny.arch.num_layers
    config = json.loads((Path(tiny.source) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    mtp = {f"model.layers.{n}.{k}": v for k, v in _random_mtp_in_deepseek_names(tiny.arch, seed=6).items()}
    save_file({**tiny.weights, **mtp}, str(tmp_path / "model.safetensors"))
    prompts = [[5, 9, 11, 13] * 4, list(range(3, 30))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM("tiny", dtype="float32", checkpoint=tiny).generate(prompts, params)]
    assert "--spec-method mtp drafts with it" in LLM(str(tmp_path), dtype="float32").engine.describe()["speculation"]
    llm = LLM(str(tmp_path), dtype="float32", spec_method="mtp", spec_policy="always", draft_p_min=0.0,
              profile_spec_costs=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == base
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    assert "shipped in the model directory" in llm.engine.describe()["speculation"]


def test_generated_conversations_mark_the_answers_and_held_out_agreement_counts_only_them(tmp_path):
    """The held-out conversations' agreement scores the target's answers, not its chat template
    and the ask (the same few templates in every conversation would flatter a head); the stream
    and its marks are kept, so a rerun does not generate again."""
    from types import SimpleNamespace

    import torch

    from specserve.spec.train import _agreement, _generated_sequences

    src = tmp_path / "m.py"
    src.write_text('def area(w, h):\n    """Return the area of a w by h rectangle."""\n    return w * h\n')

    class Writer:  # stands in for LLM.chat: prompt i is 3 tokens, its answer 5
        calls = 0

        def chat(self, conversations, params, use_tqdm=False):  # noqa: ANN001
            Writer.calls += 1
            return [SimpleNamespace(prompt_token_ids=[1000 + i] * 3,
                                    outputs=[SimpleNamespace(token_ids=[2000 + i] * 5)]) for i in range(len(conversations))]

    (tmp_path / "generated-train-0.json").write_text("[1, 2, 3]")  # an older run's file: other asks, no marks
    seqs, answers, feats = _generated_sequences(Writer(), [src], want=40, seq_len=8, seed=0, work=tmp_path, max_tokens=4)
    assert not list(tmp_path.glob("generated-*.json"))  # replaced, not left behind
    assert len(seqs) == 5 and all(len(s) == len(a) == 8 for s, a in zip(seqs, answers))
    assert feats == [None] * 5  # no runner: features come from a pass of their own
    for s, a in zip(seqs, answers):
        assert a == [t >= 2000 for t in s]  # answer tokens, and only they
    # each conversation's last answer token is never fed to the target (no feature): left out
    flat = [t for s in seqs for t in s]
    assert flat[:7] == [1000] * 3 + [2000] * 4 and flat[7] == 1001
    again = _generated_sequences(Writer(), [src], want=40, seq_len=8, seed=0, work=tmp_path, max_tokens=4)
    assert Writer.calls == 1 and again == (seqs, answers, [None] * 5)

    pred, want = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 0, 3, 0]])
    assert _agreement(pred, want, None) == (2, 4)
    assert _agreement(pred, want, torch.tensor([[False, True, True, True]])) == (1, 3)


def test_captured_rows_buffer_grows_keeps_order_and_lets_a_recomputation_win():
    """A request's captured rows live in one float16 buffer by position (one tensor per request,
    not one per step: per-step pieces fragmented the heap until a 1,290-conversation round was
    killed for memory): it grows past its first capacity keeping what it held, a recomputation
    after preemption overwrites the positions it repeats, and a gap means no features."""
    import torch

    from specserve.spec.train import _RowBuffer

    rows = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    buf = _RowBuffer(3, capacity=4)
    buf.write(0, rows[:5])  # a prompt chunk past the first capacity
    for p in range(5, 30):  # decode steps, one row each
        buf.write(p, rows[p : p + 1])
    buf.write(10, -rows[10:20])  # preempted at 20, recomputed from 10
    got = buf.take(30)
    assert got is not None and got.dtype == torch.float16 and got.shape == (30, 3)
    want = rows[:30].clone()
    want[10:20] *= -1
    assert torch.equal(got.float(), want)
    assert buf.take(31) is None  # position 30 never written
    gap = _RowBuffer(3)
    gap.write(0, rows[:3])
    gap.write(4, rows[4:6])
    assert gap.take(3) is not None and gap.take(6) is None


def test_conversation_features_are_kept_as_the_target_writes_them(tiny, tmp_path):
    """train-draft keeps the target's features of the conversations it writes (prompt chunks and
    every decode step, batched) instead of a second pass over them: each window's rows equal the
    target's features of the same tokens over the whole conversation, and _extract stores them in
    the shards, running the target only for sequences without them."""
    from specserve.spec.train import TrainConfig, _extract, _generated_sequences

    src = tmp_path / "m.py"
    src.write_text('def area(w, h):\n    """Return the area of a w by h rectangle."""\n    return w * h\n')

    class Chat:  # LLM.chat over raw token prompts (the tiny model has no chat template)
        def __init__(self, llm):
            self.llm = llm

        def chat(self, conversations, params, use_tqdm=False):  # noqa: ANN001
            prompts = [[3 + (7 * i + j) % 200 for j in range(5 + i % 4)] for i in range(len(conversations))]
            params.ignore_eos = True  # every answer max_tokens long
            return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    llm = LLM("tiny", dtype="float32", checkpoint=tiny, enable_prefix_caching=False, max_num_seqs=3,
              max_num_batched_tokens=16)  # small chunks and batches: rows arrive in many pieces
    runner = llm.engine.runner
    runner.feature_layers = (1,)
    seqs, _, feats = _generated_sequences(Chat(llm), [src], want=64, seq_len=16, seed=0, work=tmp_path,
                                          max_tokens=12, runner=runner)
    assert runner.hidden_sink is None and not runner.capture_hidden  # switched off afterwards
    width = 2 * llm.engine.arch.hidden_size  # layer 1's residual stream beside the last hidden state
    assert len(seqs) == 4 and all(f is not None and f.shape == (16, width) and f.dtype == torch.float16 for f in feats)
    cfg = TrainConfig(model="tiny", seq_len=16, batch_tokens=32)
    # Conversation 0 (5 prompt tokens, 11 of its 12 answer tokens) is window 0: its rows, written
    # over several prompt chunks and decode steps beside other requests, are the target's
    # features of those 16 tokens in one pass (to float16 rounding).
    assert seqs[0][:5] == [3 + j for j in range(5)] and seqs[1][:6] == [10 + j for j in range(6)]
    one = _extract(cfg, llm.engine, [seqs[0]], tmp_path, "one")
    torch.testing.assert_close(feats[0].float(), torch.load(one[0], weights_only=True)["feats"][0].float(),
                               atol=2e-3, rtol=2e-3)
    paths = _extract(cfg, llm.engine, seqs, tmp_path, "t", {j: f for j, f in enumerate(feats) if j != 2})
    stored = torch.load(paths[0], weights_only=True)
    assert stored["tokens"].tolist() == seqs
    for j in (0, 1, 3):
        assert torch.equal(stored["feats"][j], feats[j])  # kept as written, no pass of their own
    # Sequence 2 had none: computed by a pass over the window alone.
    alone = _extract(cfg, llm.engine, [seqs[2]], tmp_path, "u")
    assert torch.equal(stored["feats"][2], torch.load(alone[0], weights_only=True)["feats"][0])


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_training_step_without_agreement_has_the_same_loss_and_gradient(tiny, method):
    """The optimizer steps that skip the top-1 agreement (taken for the progress bar every few
    steps) train on the same loss: only the argmax over the vocabulary is left out."""
    from types import SimpleNamespace

    from specserve.spec.train import TRAINERS, TrainConfig

    torch.manual_seed(0)
    arch = head_arch(tiny.arch)
    h, v, s = arch.hidden_size, 64, 12
    w = torch.randn(v, h)
    frozen = SimpleNamespace(embed=torch.randn(arch.vocab_size, h), feat_rms=1.0, logits=lambda x: x @ w.T)
    trainer = TRAINERS[method](TrainConfig(model="tiny", method=method, feature_layers=()), tiny.arch, frozen)
    toks, feats = torch.randint(0, arch.vocab_size, (2, s)), torch.randn(2, s, h)
    runs = []
    for agree in (True, False):
        trainer.module.zero_grad()
        torch.manual_seed(1)  # the same input noise
        loss, accs = trainer.losses(toks, feats, 0.05, agree=agree)
        loss.backward()
        runs.append((loss.detach(), accs, [p.grad.clone() for p in trainer.module.parameters() if p.grad is not None]))
    (l1, a1, g1), (l2, a2, g2) = runs
    assert len(a1) == trainer.depth and all(n > 0 for _, n in a1) and a2 == []
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    for x, y in zip(g1, g2, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
