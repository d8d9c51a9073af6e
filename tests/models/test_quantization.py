"""Weight-only int8 linear layers and the restricted draft LM head.

Quantization changes numerics, so the model-level test bounds the damage instead of asking for
identical logits: along a fixed greedy continuation of SmolLM2 (teacher-forced), the int8
model's log-probability of each float32-chosen token may differ by at most LOGPROB_TOL on
average and its argmax must agree on at least ARGMAX_AGREEMENT of the positions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from specserve.engine.engine import LLMEngine
from specserve.models.linear import Int8Linear, apply_quantization, linear_weight_bytes
from specserve.models.llama import RestrictedLMHead
from specserve.sampling_params import SamplingParams
from specserve.spec.factory import frequent_token_subset

LOGPROB_TOL = 0.05  # mean |log p_int8(x_t) - log p_fp32(x_t)| in nats
ARGMAX_AGREEMENT = 0.9


def test_int8_linear_matches_its_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = Int8Linear(lin)
    x = torch.randn(7, 96)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, q.dequantized_weight(), lin.bias)
        assert torch.allclose(q(x), ref, atol=1e-4, rtol=1e-4)
        # Rounding moves each weight by at most half a step of its row's scale.
        err = (q.dequantized_weight() - lin.weight).abs()
        assert (err <= q.scales[:, None] / 2 + 1e-7).all()
    assert q.qweight.dtype == torch.int8
    assert linear_weight_bytes(q) == 96 * 40 + 40 * 4  # a quarter of float32, plus the scales


def test_apply_quantization_replaces_every_linear_including_a_restricted_head():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), RestrictedLMHead(torch.randn(3, 8), torch.tensor([0, 2, 5]), 6))
    assert apply_quantization(model, "int8") == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2].proj, Int8Linear)
    out = model(torch.randn(4, 8))
    assert out.shape == (4, 6)
    assert torch.isinf(out[:, [1, 3, 4]]).all() and torch.isfinite(out[:, [0, 2, 5]]).all()
    with pytest.raises(ValueError, match="unknown quantization"):
        apply_quantization(model, "int3")


def test_restricted_head_equals_full_head_on_its_subset():
    torch.manual_seed(1)
    full = nn.Linear(16, 10, bias=False)
    ids = torch.tensor([1, 4, 7, 9])
    head = RestrictedLMHead(full.weight.detach()[ids], ids, 10)
    h = torch.randn(5, 16)
    with torch.no_grad():
        got, want = head(h), full(h)
    assert torch.allclose(got[:, ids], want[:, ids])
    mask = torch.ones(10, dtype=torch.bool)
    mask[ids] = False
    assert torch.isneginf(got[:, mask]).all()
    # As a distribution: softmax over the subset, exactly zero elsewhere, sums to one.
    p = torch.softmax(got, -1)
    assert torch.allclose(p.sum(-1), torch.ones(5)) and (p[:, mask] == 0).all()


def test_frequent_subset_keeps_special_tokens(smollm_checkpoint):
    tok = smollm_checkpoint.tokenizer
    ids = frequent_token_subset(tok, smollm_checkpoint.arch.vocab_size, 1000).tolist()
    assert ids == sorted(set(ids))
    assert set(range(1000)) <= set(ids)
    assert tok.eos_token_id in ids and set(tok.special_token_ids) <= set(ids)
    assert frequent_token_subset(None, 50, 10).tolist() == list(range(10))


def _teacher_forced_logprobs(checkpoint, quantization: str, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Log-softmax rows predicting forced[t] from prompt + forced[:t], for every t."""
    cfg = EngineConfig(
        model=ModelConfig(model="smollm2", dtype="float32", quantization=quantization),
        cache=CacheConfig(kv_cache_gib=0.25),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    eng = LLMEngine(cfg, checkpoint=checkpoint)
    eng.runner.keep_logits = True
    rows = []
    for t in range(len(forced)):  # prefix caching makes each re-prefill cost only its last block
        eng.add_request(prompt + forced[:t], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        rows.append(torch.log_softmax(eng.runner.last_logits[0].float(), -1))
    assert eng.check_integrity()
    return torch.stack(rows)


def test_int8_smollm2_logprobs_stay_close_to_float32(smollm_checkpoint, smollm_llm):
    tok = smollm_checkpoint.tokenizer
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    forced = smollm_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    ref = _teacher_forced_logprobs(smollm_checkpoint, "none", prompt, forced)
    q = _teacher_forced_logprobs(smollm_checkpoint, "int8", prompt, forced)
    idx = torch.tensor(forced)[:, None]
    diff = (q.gather(1, idx) - ref.gather(1, idx)).abs().squeeze(1)
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"int8 vs fp32: mean |dlogp|={diff.mean():.4f} max={diff.max():.4f} argmax agreement={agree:.3f}")
    assert diff.mean().item() < LOGPROB_TOL, diff
    assert agree >= ARGMAX_AGREEMENT
