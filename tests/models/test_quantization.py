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
from specserve.models.linear import (
    DynamicInt8Linear,
    Int8Linear,
    apply_quantization,
    linear_weight_bytes,
    row_reader,
)
from specserve.models.llama import RestrictedLMHead
from specserve.sampling_params import SamplingParams
from specserve.spec.factory import frequent_token_subset

LOGPROB_TOL = 0.05  # mean |log p_int8(x_t) - log p_fp32(x_t)| in nats
ARGMAX_AGREEMENT = 0.9


@pytest.mark.parametrize("cls", [Int8Linear, DynamicInt8Linear])
def test_int8_linear_matches_its_dequantized_weight(cls):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = cls(lin)
    x = torch.randn(7, 96)
    with torch.no_grad():
        w = q.dequantized_weight()
        ref = torch.nn.functional.linear(x, w, lin.bias)
        # bf16 activations (W8A16) or 8-bit dynamic activations (W8A8) add a little more.
        assert (q(x) - ref).abs().max() < 0.02 * ref.abs().max()
        # Weight rounding moves each weight by at most half a step of its row's scale.
        step = lin.weight.abs().amax(1, keepdim=True) / 127
        # (Int8Linear's bf16 scale is rounded up by at most 2^-7 + 2^-9 relative.)
        assert ((w - lin.weight).abs() <= step / 2 * (1 + 2.0**-6) + 1e-7).all()
    assert linear_weight_bytes(q) <= 96 * 40 + 40 * 4  # a quarter of float32, plus the scales
    # Rows read alone (a restricted head's learned ids) where the layout keeps rows apart.
    read = row_reader(q)
    ids = torch.tensor([39, 0, 7, 7])
    assert (read is None) == (cls is DynamicInt8Linear)
    if read is not None:
        assert torch.equal(read(ids), w[ids])
    assert torch.equal(row_reader(lin)(ids), lin.weight.detach()[ids])


def test_apply_quantization_replaces_every_linear_including_a_restricted_head():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), RestrictedLMHead(torch.randn(3, 8), torch.tensor([0, 2, 5]), 6))
    assert apply_quantization(model, "w8a8") == 2
    assert isinstance(model[0], DynamicInt8Linear) and isinstance(model[2].proj, DynamicInt8Linear)
    out = model(torch.randn(4, 8))
    assert out.shape == (4, 6)
    assert torch.isinf(out[:, [1, 3, 4]]).all() and torch.isfinite(out[:, [0, 2, 5]]).all()
    with pytest.raises(ValueError, match="unknown quantization"):
        apply_quantization(model, "int3")


@pytest.mark.parametrize("subset", [[1, 4, 7, 9], [0, 1, 2, 3, 7, 9], [0, 1, 2, 3, 4]])
def test_restricted_head_equals_full_head_on_its_subset(subset):
    """Ids anywhere, a leading run with a tail (the first ids plus special ones), a run alone."""
    torch.manual_seed(1)
    full = nn.Linear(16, 10, bias=False)
    ids = torch.tensor(subset)
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


def test_restricted_head_learns_the_ids_seen_enough_with_the_full_heads_logits(monkeypatch):
    """An id outside the subset gets a logit once the requests' text held it LEARN_AFTER times (2 here),
    the full head's; ids in the subset, out of range or seen once stay as they were; at most
    MAX_LEARNED_IDS are learned, the most emitted ones."""
    import specserve.models.llama as llama

    monkeypatch.setattr(llama, "LEARN_AFTER", 2)
    torch.manual_seed(2)
    full = nn.Linear(16, 10, bias=False)
    ids = torch.tensor([1, 4, 7, 9])
    w = full.weight.detach()
    head = RestrictedLMHead(w[ids], ids, 10, rows=lambda t: w[t])
    # Room for every id it may learn, held from the start: part of the model's memory before any is learned.
    assert head.rows_buf.shape == (llama.MAX_LEARNED_IDS, 16) and head.num_learned == 0
    assert head.rows_buf in set(head.buffers())
    h = torch.randn(3, 16)
    with torch.no_grad():
        want = full(h)
    assert head.learn([2, 4, -1, 10, 3]) == 0 and torch.isneginf(head(h)[:, [0, 2, 3, 5, 6, 8]]).all()
    assert head.learn([2, 4, 1]) == 1 and head.num_learned == 1  # 2 twice; 4 and 1 are in the subset
    got = head(h)
    assert torch.allclose(got[:, [1, 2, 4, 7, 9]], want[:, [1, 2, 4, 7, 9]], atol=1e-6)
    assert torch.isneginf(got[:, [0, 3, 5, 6, 8]]).all()
    assert head.learn([2, 2, 2]) == 0  # learned once
    monkeypatch.setattr(llama, "MAX_LEARNED_IDS", 2)
    assert head.learn([0, 5, 6, 0, 5, 6]) == 1 and head.num_learned == 2  # room for one more
    assert head.learn([3, 3]) == 0
    assert torch.isfinite(head(h)[:, [0, 1, 2, 4, 7, 9]]).all() and torch.isneginf(head(h)[:, [3, 5, 6, 8]]).all()
    # Full: an id takes over the slot of the learned id counted least (0, twice) once emitted
    # twice as often; 2 (five times) keeps its slot.
    assert head.learn([8, 8, 8]) == 0 and head.learn([8]) == 1 and sorted(head.learned_ids.tolist()) == [2, 8]
    got = head(h)
    assert torch.allclose(got[:, [2, 8]], want[:, [2, 8]], atol=1e-6) and torch.isneginf(got[:, 0]).all()
    head.stop_learning()  # the subset alone again, for good
    assert head.num_learned == 0 and head.learn([0, 0, 3, 3, 3, 3]) == 0
    assert torch.isneginf(head(h)[:, [0, 2, 3, 8]]).all() and torch.isfinite(head(h)[:, ids]).all()
    # A head given no rows (an EAGLE head over a subset) learns nothing.
    fixed = RestrictedLMHead(w[ids], ids, 10)
    assert fixed.learn([0, 0, 0]) == 0 and torch.isneginf(fixed(h)[:, 0]).all()
    assert fixed.rows_buf.numel() == 0 and fixed.learned_ids.numel() == 0  # and holds no room for any


def test_a_restricted_tied_head_learns_rows_of_the_embedding_table(smollm_path):
    """SmolLM2's head is its embedding table: a learned id's logits are the table row's product
    with the hidden state, in both the float model and the one computing from GGUF blocks."""
    from specserve.config import CacheConfig, ModelConfig
    from specserve.engine.runner import ModelRunner
    from specserve.models.loader import load_model_files

    ck = load_model_files(smollm_path, keep_blocks=True)
    subset = torch.arange(4096)
    for quant in ("none", "auto"):
        runner = ModelRunner(ck.arch, ck.weights, ModelConfig(model="smollm2", dtype="float32", quantization=quant),
                             CacheConfig(block_size=16, kv_cache_gib=0.01), 64, vocab_subset=subset,
                             packed=ck.packed)
        head = runner.model.lm_head
        assert isinstance(head, RestrictedLMHead) and head.rows_data is None  # the table is the embedding's: nothing kept
        assert head.learn([9000, 20000, 9000, 20000]) == 2
        h = torch.randn(2, ck.arch.hidden_size)
        table = runner.model.model.embed_tokens(torch.tensor([9000, 20000])).float()
        with torch.no_grad():
            got = head(h)
        assert torch.allclose(got[:, [9000, 20000]], h @ table.T, atol=1e-4, rtol=1e-4)
        assert torch.isneginf(got[:, 9001]).all() and torch.isfinite(got[:, :4096]).all()


def test_frequent_subset_keeps_special_tokens(smollm_checkpoint):
    tok = smollm_checkpoint.tokenizer
    ids = frequent_token_subset(tok, smollm_checkpoint.arch.vocab_size, 1000).tolist()
    assert ids == sorted(set(ids))
    assert set(range(1000)) <= set(ids)
    assert tok.eos_token_id in ids and set(tok.special_token_ids) <= set(ids)
    assert len(ids) % 8 == 0 and set(ids) - set(tok.special_token_ids) - set(range(1000)) <= set(range(1000, 1008))
    assert frequent_token_subset(None, 50, 10).tolist() == list(range(16))  # padded to 8-row groups
    assert frequent_token_subset(None, 13, 10).tolist() == list(range(13))  # ... while ids last


def test_w8a8_is_refused_for_the_target_but_allowed_for_a_draft():
    from specserve.config import SpecConfig
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError, match="draft models only"):
        EngineConfig(model=ModelConfig(model="m", quantization="w8a8"))
    cfg = EngineConfig(model=ModelConfig(model="m", quantization="int8"),
                       spec=SpecConfig(method="draft", draft_model="d", draft_quantization="w8a8"))
    assert cfg.spec.draft_quantization == "w8a8"
    with pytest.raises(ConfigError, match="Unknown quantization"):
        ModelConfig(model="m", quantization="int3")


def test_quantization_modes_are_one_type_with_their_abilities():
    """A mode named as a string (any case) becomes the Quantization it names; it still compares,
    formats and serialises as its plain name, and callers ask it what it can do instead of
    listing mode names. Unknown names and non-strings fail with the choices listed."""
    import json

    from specserve.config import QUANTIZATIONS, TARGET_QUANTIZATIONS, Quantization, SpecConfig
    from specserve.errors import ConfigError
    from specserve.spec.factory import default_draft_quantization

    cfg = ModelConfig(model="m", quantization=" INT4 ")
    assert cfg.quantization is Quantization.INT4 and cfg.quantization == "int4"
    assert f"{cfg.quantization}" == str(cfg.quantization) == "int4" and json.dumps(cfg.quantization) == '"int4"'
    assert ModelConfig(model="m").quantization is None  # picked when the engine starts
    assert {q.value for q in Quantization if q.blocks} == {"int4", "auto"}
    assert {q.value for q in Quantization if q.cpu_only} == {"int4", "auto", "w8a8"}
    assert [q for q in Quantization if q.draft_only] == [Quantization.W8A8]
    assert set(QUANTIZATIONS) - set(TARGET_QUANTIZATIONS) == {"w8a8"}
    assert ModelConfig(model="m", quantization="auto").native_cpu
    assert not ModelConfig(model="m", quantization="int8").native_cpu
    spec = SpecConfig(method="draft", draft_model="d", draft_quantization="W8A8")
    assert spec.draft_quantization is Quantization.W8A8
    assert default_draft_quantization(None, Quantization.AUTO) is Quantization.INT4
    assert default_draft_quantization(None, "int8") is Quantization.INT8
    assert default_draft_quantization(None, None) is Quantization.NONE
    assert default_draft_quantization("w8a8", Quantization.AUTO) is Quantization.W8A8
    for bad in ("q4", 4, ""):
        with pytest.raises(ConfigError, match="none, int8, int4, auto, w8a8"):
            ModelConfig(model="m", quantization=bad)
    with pytest.raises(ConfigError, match="Unknown draft quantization"):
        SpecConfig(method="draft", draft_model="d", draft_quantization="fp8")


def _teacher_forced_logprobs(checkpoint, quantization: str, prompt: list[int], forced: list[int],
                             kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Log-softmax rows predicting forced[t] from prompt + forced[:t], for every t."""
    cfg = EngineConfig(
        model=ModelConfig(model="smollm2", dtype="float32", quantization=quantization),
        cache=CacheConfig(kv_cache_gib=0.25, kv_cache_dtype=kv_cache_dtype),
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


@pytest.mark.parametrize("quantization", ["int8"])
def test_quantized_smollm2_logprobs_stay_close_to_float32(smollm_checkpoint, smollm_llm, quantization):
    tok = smollm_checkpoint.tokenizer
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    forced = smollm_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    ref = _teacher_forced_logprobs(smollm_checkpoint, "none", prompt, forced)
    q = _teacher_forced_logprobs(smollm_checkpoint, quantization, prompt, forced)
    idx = torch.tensor(forced)[:, None]
    diff = (q.gather(1, idx) - ref.gather(1, idx)).abs().squeeze(1)
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{quantization} vs fp32: mean |dlogp|={diff.mean():.4f} max={diff.max():.4f} argmax agreement={agree:.3f}")
    assert diff.mean().item() < LOGPROB_TOL, diff
    assert agree >= ARGMAX_AGREEMENT


# ---------------------------------------------------------------------------------- KV cache int8
KV_LOGPROB_TOL = 0.05  # mean |Δ log p| in nats along the same teacher-forced continuation


def test_quantize_kv_round_trip_bound():
    from specserve.attention import quantize_kv

    torch.manual_seed(2)
    x = torch.randn(10, 3, 64) * torch.linspace(0.01, 20, 10)[:, None, None]
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.shape == (10, 3)
    assert ((q.float() * s[..., None] - x).abs() <= s[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize(("kv_dtype", "expected"), [("int8", 256 / 68), ("fp16", 2.0)])
def test_smaller_kv_caches_hold_more_tokens_in_the_same_budget(smollm_checkpoint, kv_dtype, expected):
    def engine(kv_dtype):
        cfg = EngineConfig(model=ModelConfig(model="smollm2", dtype="float32"),
                           cache=CacheConfig(kv_cache_gib=0.05, kv_cache_dtype=kv_dtype))
        return LLMEngine(cfg, checkpoint=smollm_checkpoint)

    full, small = engine("auto"), engine(kv_dtype)
    ratio = small.runner.num_blocks / full.runner.num_blocks
    # SmolLM2: head_dim 64 -> 256 B/head/token in float32 vs 64 + 4 (scale) in int8, 128 in float16.
    assert abs(ratio - expected) < 0.05, ratio
    assert small.runner.kv_cache_bytes <= 0.05 * (1 << 30)
    assert small.runner.kv_caches[0][0].dtype == {"int8": torch.int8, "fp16": torch.float16}[kv_dtype]
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")
    # torch's, llama.cpp's and numpy's spellings are accepted and stored as the canonical name
    for spelled, canonical in (("float16", "fp16"), ("F16", "fp16"), ("half", "fp16"), ("float32", "fp32"), ("int8", "int8")):
        assert CacheConfig(kv_cache_dtype=spelled).kv_cache_dtype == canonical
        assert str(CacheConfig(kv_cache_dtype=spelled).kv_cache_dtype) == canonical


@pytest.mark.parametrize(("quantization", "kv_dtype", "tol"),
                         [("none", "int8", KV_LOGPROB_TOL), ("auto", "int8", KV_LOGPROB_TOL), ("none", "fp16", KV_LOGPROB_TOL / 10),
                          ("auto", "auto", KV_LOGPROB_TOL / 10)])  # auto on auto: float16 pages the native kernels read
def test_smaller_kv_cache_logprobs_stay_close_to_float32(smollm_checkpoint, smollm_llm, quantization, kv_dtype, tol):
    tok = smollm_checkpoint.tokenizer
    prompt = tok.encode("The history of the printing press begins in")
    forced = smollm_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    ref = _teacher_forced_logprobs(smollm_checkpoint, quantization, prompt, forced, kv_cache_dtype="fp32")
    q = _teacher_forced_logprobs(smollm_checkpoint, quantization, prompt, forced, kv_cache_dtype=kv_dtype)
    idx = torch.tensor(forced)[:, None]
    diff = (q.gather(1, idx) - ref.gather(1, idx)).abs().squeeze(1)
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{kv_dtype} KV vs fp32 KV ({quantization}): mean |dlogp|={diff.mean():.4f} max={diff.max():.4f} argmax agreement={agree:.3f}")
    assert 0 < diff.mean().item() < tol  # (0: the smaller cache is really in use)
    assert agree >= ARGMAX_AGREEMENT
