"""One KV budget: a drafter with KV of its own (draft model, EAGLE head) holds as many tokens as
the target, and both fit in --kv-cache-gib together."""

from __future__ import annotations

import pytest

from specserve import LLM

GIB = 0.01


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=2)
    return ckpt


def _check_split(eng, drafter_kv_bytes: int, drafter_blocks: int) -> None:
    runner = eng.runner
    budget = GIB * (1 << 30)
    per_block = runner.kv_cache_bytes / runner.num_blocks + drafter_kv_bytes / drafter_blocks
    assert drafter_blocks == runner.num_blocks  # the same token capacity
    assert runner.kv_cache_bytes + drafter_kv_bytes <= budget
    assert runner.kv_cache_bytes + drafter_kv_bytes > budget - 2 * per_block  # and nothing left over
    assert "in the same budget" in eng.describe()["KV cache"]


def test_a_draft_models_kv_comes_out_of_the_budget(tiny):
    plain = LLM("tiny", dtype="float32", checkpoint=tiny, kv_cache_gib=GIB).engine
    eng = LLM("tiny", dtype="float32", checkpoint=tiny, kv_cache_gib=GIB, spec_method="draft", draft_checkpoint=tiny,
              draft_num_layers=1, profile_spec_costs=False).engine
    drafter = eng.proposer.runner
    _check_split(eng, drafter.kv_cache_bytes, drafter.num_blocks)
    # The 1-layer draft holds a third of the bytes per token (2 layers + 1): the target keeps 2/3.
    assert abs(eng.runner.num_blocks - plain.runner.num_blocks * 2 / 3) <= 1
    own = LLM("tiny", dtype="float32", checkpoint=tiny, kv_cache_gib=GIB, spec_method="draft", draft_checkpoint=tiny,
              draft_kv_cache_gib=GIB, profile_spec_costs=False).engine
    assert own.runner.num_blocks == plain.runner.num_blocks  # a budget of its own: the target keeps all


def test_an_eagle_heads_kv_comes_out_of_the_budget(tiny, tmp_path):
    from conftest import make_head_file

    path = make_head_file(tiny, tmp_path / "h.safetensors")
    eng = LLM("tiny", dtype="float32", checkpoint=tiny, kv_cache_gib=GIB, spec_method="eagle", draft_model=str(path),
              profile_spec_costs=False).engine
    head_kv = sum(t.numel() * t.element_size() for t in eng.proposer.kv_cache)
    _check_split(eng, head_kv, eng.proposer.kv.num_blocks)
