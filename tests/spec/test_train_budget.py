"""train-draft's time budget: without --tokens, a run takes as many of the default tokens as this
machine gets through in --budget-minutes (measured at the start), and a rerun keeps the plan."""

from __future__ import annotations

import json
import time

import pytest

from specserve.spec.train import DEFAULT_TOKENS, Rates, TrainConfig, _fit_budget, budget_tokens


def test_the_budget_takes_what_fits_and_never_more_than_the_default():
    cfg = TrainConfig(model="m")  # 220k tokens, 3/4 conversations, 4 epochs
    assert not cfg.tokens_asked and cfg.tokens == DEFAULT_TOKENS
    # SmolLM2 on a 2-vCPU Zen 5 (bf16 training): the default fits 10 minutes with room to spare.
    fast = Rates(generate=0.57e-3, extract=0.38e-3, train=0.32e-3)
    assert budget_tokens(cfg, fast, 560.0) == DEFAULT_TOKENS // 256 * 256
    # An AVX2-only Zen 3 (float32 training, ~2 ms a token-epoch): a quarter of it or so.
    slow = Rates(generate=1.5e-3, extract=1.9e-3, train=2.05e-3)
    n = budget_tokens(cfg, slow, 560.0)
    per_token = 0.75 * 1.5e-3 + 0.25 * 1.9e-3 + 4 * 2.05e-3
    assert n % 256 == 0 and 40_000 < n < 560.0 / per_token
    held = 8192 * (1.5e-3 + 1.9e-3) / 2 + 11 * 8192 * 2.05e-3 / 3
    assert n * per_token + held <= 560.0 < (n + 256) * per_token + held
    # Nothing fits: one optimizer step's worth, so the run still writes a head (and can resume).
    assert budget_tokens(cfg, slow, 1.0) == 512
    # More epochs, fewer tokens.
    assert budget_tokens(TrainConfig(model="m", epochs=8), slow, 560.0) < n


def test_a_plan_is_kept_and_an_explicit_token_count_or_no_budget_is_left_alone(tmp_path, monkeypatch, capsys):
    from specserve.spec import train

    calls = []

    def measure(cfg, llm, frozen, layers):
        calls.append(cfg.tokens)
        return Rates(generate=1.5e-3, extract=1.9e-3, train=2.05e-3)

    monkeypatch.setattr(train, "_measure_rates", measure)
    cfg = TrainConfig(model="m")
    now = time.perf_counter()
    planned = _fit_budget(cfg, None, tmp_path, None, (), t_start=now - 3600)  # the budget spent already
    assert planned.tokens == 512 and planned.max_minutes == 10.0  # the floor, and training stops at 10 min
    assert "--tokens 220000 for the full run" in capsys.readouterr().err
    planned = _fit_budget(cfg, None, tmp_path, None, (), t_start=now)
    assert planned.tokens == 512 and len(calls) == 1  # the kept plan, no second measurement
    (tmp_path / "plan-0.json").unlink()
    planned = _fit_budget(cfg, None, tmp_path, None, (), t_start=now)
    assert 40_000 < planned.tokens < DEFAULT_TOKENS and len(calls) == 2
    saved = json.loads((tmp_path / "plan-0.json").read_text())
    assert saved["tokens"] == planned.tokens and saved["rates_s_per_token"]["train"] == pytest.approx(2.05e-3)
    assert _fit_budget(TrainConfig(model="m", max_minutes=4), None, tmp_path, None, (), now).max_minutes == 4
    for asked in (TrainConfig(model="m", tokens=300_000), TrainConfig(model="m", budget_minutes=0)):
        assert _fit_budget(asked, None, tmp_path, None, (), now) is asked
    assert len(calls) == 2
    fast = Rates(generate=0.57e-3, extract=0.38e-3, train=0.32e-3)  # the default fits: nothing to say
    monkeypatch.setattr(train, "_measure_rates", lambda *a: fast)
    (tmp_path / "x").mkdir()
    capsys.readouterr()
    assert _fit_budget(cfg, None, tmp_path / "x", None, (), t_start=time.perf_counter()).tokens == 219_904
    assert capsys.readouterr().err == ""


def test_the_rates_are_measured_on_the_target_without_touching_the_random_state():
    import math

    import torch

    from specserve import LLM
    from specserve.spec.train import _Frozen, _measure_rates
    from specserve.testing import tiny_checkpoint

    _, ckpt = tiny_checkpoint("llama", seed=5, vocab=256, layers=2)
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, enable_prefix_caching=False)
    llm.engine.runner.feature_layers = (1,)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    frozen = _Frozen(llm.engine, torch.arange(256))
    for method in ("eagle", "medusa"):
        cfg = TrainConfig(model="tiny", method=method, seq_len=16, batch_tokens=32, generate_max_tokens=16)
        rates = _measure_rates(cfg, llm, frozen, (1,))
        assert all(math.isfinite(r) and r > 0 for r in (rates.generate, rates.extract, rates.train))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_negative_budget_is_refused_before_anything_loads():
    from specserve.errors import ConfigError
    from specserve.spec.train import train_draft

    with pytest.raises(ConfigError, match="budget-minutes must be >= 0"):
        train_draft(TrainConfig(model="no-such-model", budget_minutes=-1))


@pytest.mark.parametrize(("kw", "message"), [
    (dict(corpus="/no/such/corpus"), "is not a directory"),
    (dict(epochs=0), "--epochs must be > 0"),
    (dict(lr=float("nan")), "--lr must be > 0"),
    (dict(generated_share=1.5), "--generated-share must lie in"),
    (dict(heldout_tokens=8), "--heldout-tokens must cover"),
    (dict(out=__file__ + "/sub/head.safetensors"), "is a file, not a folder"),  # under a file
])
def test_bad_arguments_are_refused_before_the_model_loads_or_the_cache_is_touched(kw, message, tmp_path, monkeypatch):
    """Before: a missing corpus failed after the target loaded and the machine was timed, and left
    an empty work directory (or a budget plan) in the cache."""
    from specserve.errors import ConfigError
    from specserve.spec.train import train_draft

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=message):
        train_draft(TrainConfig(model="no-such-model", **kw))  # the model would fail later: it is not reached
    assert not (tmp_path / "cache").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="No text files"):
        train_draft(TrainConfig(model="no-such-model", corpus=str(empty)))
