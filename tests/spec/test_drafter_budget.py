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


def test_a_drafts_prefix_hits_hold_their_blocks_once(tiny):
    """A draft that finds a request's prompt in its own prefix cache holds the hit blocks plus
    room for what follows, nothing more (it used to count the hits twice and hold as many blocks
    again until its next rollback); the same for prompt KV expected from a prefill worker."""
    from specserve.request import Request
    from specserve.sampling_params import SamplingParams

    eng = LLM("tiny", dtype="float32", checkpoint=tiny, kv_cache_gib=GIB, spec_method="draft", draft_checkpoint=tiny,
              draft_num_layers=1, profile_spec_costs=False).engine
    draft = eng.proposer
    bs = draft.kv.block_size
    prompt = [1 + i % 200 for i in range(4 * bs + 3)]  # 4 full blocks and 3 tokens
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = Request("a", prompt, params)
    assert draft.propose([first], [1])  # catches up on the prompt
    first.append_output_tokens([7])  # the target's next token
    assert draft.propose([first], [1])  # keeps what it computed: its full blocks enter the prefix cache
    draft.remove_request("a")
    assert draft.propose([Request("b", prompt, params)], [1])
    assert draft.kv.prefix_cache.num_hit_tokens >= 4 * bs
    assert len(draft.kv.block_ids("b")) == 5  # 4 hits + the block of the last 3 tokens
    placed = draft.expect_prompt_kv(Request("c", prompt, params), len(prompt) - 1)
    assert placed == 4 * bs and len(draft.kv.block_ids("c")) == 5
    draft.drop_prompt_kv("c")
    draft.remove_request("b")
    assert draft.check_integrity() and draft.kv.num_free_blocks == draft.kv.num_blocks
