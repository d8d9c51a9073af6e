"""The Python API refuses bad configuration with specserve's own errors, naming the field, before
it builds anything it could not use; and takes every key of vLLM's speculative_config it maps."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specserve.errors import ConfigError, InvalidRequestError


@pytest.mark.parametrize(("build", "message"), [
    (lambda: SpecConfig(method="ngram", num_spec_tokens=2.5), "num_spec_tokens must be an integer, got 2.5"),
    (lambda: SpecConfig(method="ngram", num_spec_tokens="4"), "num_spec_tokens must be an integer"),
    (lambda: SpecConfig(method="ngram", num_spec_tokens=True), "num_spec_tokens must be an integer"),
    (lambda: SpecConfig(method="ngram", draft_p_min=float("nan")), "draft_p_min must be a finite number"),
    (lambda: SchedulerConfig(max_num_seqs=2.5), "max_num_seqs must be an integer"),
    (lambda: ModelConfig("m", max_model_len=100.5), "max_model_len must be an integer (or None)"),
    (lambda: ModelConfig("m", linear_backend="bogus"), "Unknown linear_backend 'bogus'"),  # was raised after loading
    (lambda: EngineConfig(ModelConfig("m"), num_threads=0), "num_threads must be >= 1"),
    (lambda: EngineConfig(ModelConfig("m"), num_threads="two"), "num_threads must be an integer"),
])
def test_fields_of_the_wrong_kind_are_config_errors(build, message):
    """Before: num_spec_tokens=2.5 built an engine whose every step raised a TypeError, and
    num_threads=-1 or a NaN budget failed inside torch."""
    with pytest.raises(ConfigError) as err:
        build()
    assert message in str(err.value)


def test_cache_budgets_that_cannot_be_held_are_config_errors(smollm_checkpoint):
    from specserve.config import CacheConfig

    for gib, message in ((float("nan"), "finite number"), (float("inf"), "finite number"), ("big", "finite number")):
        with pytest.raises(ConfigError, match=message):
            CacheConfig(kv_cache_gib=gib)
    with pytest.raises(ConfigError, match="block_size must be an integer"):
        CacheConfig(block_size=16.0)
    # a budget the machine cannot map: specserve's error, not the allocator's OSError
    with pytest.raises(ConfigError, match="does not fit in this machine's memory"):
        LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=1e7)


def test_every_speculative_config_key_reaches_the_engine(smollm_checkpoint):
    """vLLM's suffix_decoding_max_cached_requests (documented) raised an AssertionError in LLM()."""
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint, profile_spec_costs=False,
              speculative_config={"method": "suffix", "suffix_decoding_max_cached_requests": 100,
                                  "num_speculative_tokens": 3, "prompt_lookup_min": 2, "disable_by_batch_size": 6})
    spec = llm.engine.config.spec
    assert (spec.method, spec.suffix_cache_requests, spec.num_spec_tokens, spec.ngram_min, spec.off_batch) == (
        "ngram", 100, 3, 2, 6)


def test_sampling_params_of_the_wrong_kind_are_request_errors(smollm_checkpoint):
    llm = LLM("smollm2", dtype="float32", checkpoint=smollm_checkpoint)
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=123)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate(["hi"], {"max_tokens": 4})  # type: ignore[arg-type]
    out = llm.generate(["hi"], SamplingParams(max_tokens=2))  # still usable
    assert len(out[0].outputs[0].token_ids) == 2
    eng = llm.engine
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks


def test_the_config_names_every_linear_backend_the_models_have():
    from specserve.config import LINEAR_BACKEND_NAMES
    from specserve.models.linear import LINEAR_BACKENDS

    assert ("auto", *LINEAR_BACKENDS) == LINEAR_BACKEND_NAMES
