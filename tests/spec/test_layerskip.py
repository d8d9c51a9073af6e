"""Layer-skip self-speculation: the draft is the target's own first layers (no weight copy), reads
the target's KV and writes only its reserved scratch, and `train-draft --method layerskip` fits
an exit that serves."""

from __future__ import annotations

import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import ConfigError
from specserve.kv_cache.pages import LayerKV


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=4)
    return ckpt


def _llm(ckpt, method="layerskip", **kw):
    kw.setdefault("num_spec_tokens", 4)
    return LLM("tiny", dtype="float32", checkpoint=ckpt, spec_method=method, spec_policy="always",
               profile_spec_costs=False, draft_p_min=0.0, **kw)


def test_the_draft_is_the_targets_first_layers_and_costs_no_memory(tiny):
    llm = _llm(tiny, draft_num_layers=2)
    prop, runner = llm.engine.proposer, llm.engine.runner
    assert prop.model is runner.model.model and list(prop.layers) == [0, 1]
    assert prop.lm_head is runner.model.lm_head  # a 256-token vocabulary: the target's own head
    assert prop.memory_bytes() == 0  # no exit file: nothing of its own
    assert "first 2 of 4 layers" in llm.engine.describe()["speculation"]


def test_scratch_blocks_come_out_of_the_kv_budget(tiny):
    plain = LLM("tiny", dtype="float32", checkpoint=tiny, kv_cache_gib=0.01).engine.runner
    ls = _llm(tiny, kv_cache_gib=0.01).engine.runner
    assert ls.reserved_block_ids and ls.num_blocks == plain.num_blocks - len(ls.reserved_block_ids)
    assert ls.kv_caches[0][0].shape[0] == plain.kv_caches[0][0].shape[0]  # the same bytes in all
    assert ls.reserved_block_ids[0] == ls.num_blocks  # outside the pool's ids


def test_drafting_reads_the_targets_kv_and_writes_only_scratch(tiny):
    """Run a few steps, then snapshot every pool block of the target's cache: a propose() over
    every decoding request leaves them bit-identical, and its drafts are the tokens a
    from-scratch run of the first L layers + final norm + head picks (the shared KV is right)."""
    llm = _llm(tiny, draft_num_layers=2, spec_tree="chain", num_spec_tokens=1)
    eng = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, p in enumerate([[5, 9, 11, 13] * 5, list(range(3, 40)), [7] * 19]):
        eng.add_request(p, params, request_id=f"r{i}")
    for _ in range(4):
        eng.step()
    decoding = [r for r in eng.scheduler.running if r.is_decoding]
    assert len(decoding) == 3
    pool = eng.runner.num_blocks
    before = [t[:pool].clone() for layer in eng.runner.kv_caches for t in layer]
    drafts = eng.proposer.propose(decoding, [1] * len(decoding))
    after = [t[:pool] for layer in eng.runner.kv_caches for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    model = eng.runner.model
    with torch.no_grad():
        for req in decoding:  # the reference: a fresh forward over the whole sequence, layers 0-1 only
            ids = torch.tensor(req.all_token_ids)
            x = model.model.embed_tokens(ids)
            kv = [LayerKV(*(torch.zeros(8, 16, *t.shape[2:]) for t in layer)) for layer in eng.runner.kv_caches]
            from specserve.attention import build_attention_metadata

            meta = build_attention_metadata([len(ids)], [0], [list(range(8))], 16, torch.device("cpu"), None)
            pos = torch.arange(len(ids))
            x = model.model.run_layers(x, pos, kv, meta, range(2))
            want = int(model.compute_logits(model.model.norm(x[-1:])).argmax())
            assert drafts[req.request_id].token_ids[0] == want
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_bad_layer_counts_are_refused(tiny):
    with pytest.raises(ConfigError, match="draft-num-layers"):
        _llm(tiny, draft_num_layers=4)


def test_train_draft_layerskip_fits_an_exit_that_serves(smollm_path, tmp_path):
    """A small fit on SmolLM2: every candidate layer scored, the fitted exit agrees with the target
    more often than its final norm does at the upper layers, the card and plot are written, a
    rerun resumes from the saved normal equations, and the exit serves with greedy output equal to
    plain decoding; a layer other than the fitted one, or another method's file, is refused."""
    from specserve.spec.train import TrainConfig, exit_candidates, train_draft

    out = tmp_path / "layerskip.safetensors"
    cfg = dict(model="smollm2-135m-instruct", method="layerskip", out=str(out), tokens=3072, heldout_tokens=1024,
               seq_len=128, batch_tokens=512, generated_share=0.0, work_dir=str(tmp_path / "work"))
    card = train_draft(TrainConfig(**cfg))
    assert card["complete"] and card["tokens_seen"] == 3072
    rows = {r["layer"]: r for r in card["candidates"]}
    assert sorted(rows) == exit_candidates(30, None)
    for layer in (22, 26):
        assert rows[layer]["heldout_top1"] > rows[layer]["raw_top1"]
    assert card["num_layers"] in rows
    assert json.loads(out.with_suffix(".json").read_text())["num_layers"] == card["num_layers"]
    assert out.with_suffix(".png").stat().st_size > 1000
    again = train_draft(TrainConfig(**cfg))  # the normal equations are loaded, not recomputed
    assert again["candidates"] == card["candidates"] and again["wall_s"] < card["wall_s"]
    work = tmp_path / "work"  # --fresh deletes what training wrote there, nothing else a --work-dir holds
    (work / "notes.txt").write_text("mine")
    (work / "runs").mkdir()
    (work / "runs" / "state-layerskip.pt").write_text("mine too")
    fresh = train_draft(TrainConfig(**cfg, fresh=True))
    assert fresh["complete"] and fresh["wall_s"] > again["wall_s"]  # fitted again
    assert (work / "notes.txt").read_text() == "mine" and (work / "runs" / "state-layerskip.pt").exists()

    prompts = ["def add(a, b):", "The capital of France is"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM("smollm2-135m-instruct").generate(prompts, params)
    llm = LLM("smollm2-135m-instruct", spec_method="layerskip", draft_model=str(out), spec_policy="always",
              spec_tree="tree")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.spec_counters["num_draft_tokens"] > 0
    assert llm.engine.check_integrity()
    assert 0 < llm.engine.proposer.memory_bytes() < 0.05 * llm.engine.runner.resident_bytes()
    other = 1 if card["num_layers"] != 1 else 2
    with pytest.raises(ConfigError, match="fitted at layer"):
        LLM("smollm2-135m-instruct", spec_method="layerskip", draft_model=str(out), draft_num_layers=other)
    with pytest.raises(ConfigError, match="not a 'eagle' head"):
        LLM("smollm2-135m-instruct", spec_method="eagle", draft_model=str(out))
