"""Which thread steps the engine: torch's OpenMP teams make a second one slower (see
LLMEngine._check_stepping_thread); the engine says so once instead of running slow silently."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, ModelConfig
from specserve.engine.engine import LLMEngine, build_off_thread
from specserve.sampling_params import SamplingParams

CPUS = len(os.sched_getaffinity(0))


def _engine(checkpoint) -> LLMEngine:
    cfg = EngineConfig(model=ModelConfig(model="m", dtype="float32"), cache=CacheConfig(kv_cache_gib=0.05),
                       num_threads=CPUS)
    return LLMEngine(cfg, checkpoint=checkpoint)


def _generate(engine: LLMEngine) -> None:
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.skipif(CPUS < 2, reason="one CPU: torch runs no OpenMP team")
def test_stepping_on_another_thread_than_the_live_loader_warns_once(tiny_llama, caplog):
    before = torch.get_num_threads()
    try:
        engine = _engine(tiny_llama[1])
        with caplog.at_level(logging.WARNING, logger="specserve.engine.engine"):
            _generate(engine)  # the loading thread: nothing to say
            assert not [r for r in caplog.records if "loaded on" in r.message]
            for _ in range(2):
                t = threading.Thread(target=_generate, args=(engine,), name="stepper")
                t.start()
                t.join()
        warned = [r.message for r in caplog.records if "loaded on" in r.message]
        assert len(warned) == 1 and "'stepper'" in warned[0] and "'MainThread'" in warned[0]

        # Loaded on a thread that exits (as disaggregated workers load): no team is left behind.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specserve.engine.engine"):
            _generate(build_off_thread(_engine, tiny_llama[1]))
        assert not [r for r in caplog.records if "loaded on" in r.message]
    finally:
        torch.set_num_threads(before)
