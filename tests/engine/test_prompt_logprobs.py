"""vLLM's prompt_logprobs: every prompt token's logprob under the model, whatever splits or skips
the prompt's computation (chunked prefill, a warm prefix cache, speculation, n > 1)."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_checkpoint

    return tiny_checkpoint("llama", seed=3, vocab=64, layers=2)


def _reference(hf, prompt: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    lps = [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    return lps, [logp[i].topk(k).indices.tolist() for i in range(len(prompt) - 1)]


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_prompt_logprobs_match_a_full_forward_across_chunks_cache_hits_and_samples(tiny, method):
    hf, ckpt = tiny
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, max_num_batched_tokens=16, spec_method=method,
              spec_policy="always", profile_spec_costs=False)
    prompts = [[1, 5, 7, 5, 7, 5, 9, 9, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
               [4, 2], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # their blocks are in the prefix cache now
    hits_before = llm.engine.kv_manager.prefix_cache.num_hit_tokens
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=3, n=2)
    outs = llm.generate(prompts, params)
    assert llm.engine.kv_manager.prefix_cache.num_hit_tokens == hits_before  # computed in full
    for prompt, out in zip(prompts, outs):
        want, want_top = _reference(hf, prompt, 3)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert [[t for t, _ in pairs] for pairs in out.prompt_top_logprobs[1:]] == want_top
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # the output is unchanged
    assert plain[0].prompt_logprobs is None
    eng = llm.engine
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    for bad in (-1, 21, 1.5):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_survive_preemption(tiny):
    """A request preempted and recomputed keeps one logprob per prompt token (the recomputed
    chunks' are not appended twice)."""
    hf, ckpt = tiny
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, kv_cache_gib=48 * 512 / (1 << 30), block_size=4,
              max_num_batched_tokens=8)
    prompts = [[(7 * i + j) % 60 + 1 for j in range(20)] for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_logprobs[1:] == pytest.approx(_reference(hf, prompt, 1)[0], abs=1e-4)
        assert out.prompt_top_logprobs[1:] == [[]] * (len(prompt) - 1)
