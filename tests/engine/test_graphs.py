"""CUDA-graph step buckets (engine/graphs.py), checked on the CPU: the padded static step, run
without capture, gives the eager step's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention import build_attention_metadata
from specserve.engine.graphs import MIN_KV, GraphKey, StepGraphs
from specserve.kv_cache.pages import LayerKV
from specserve.testing import repetitive_prompts, tiny_checkpoint, write_random_head


def _padded(llm: LLM) -> StepGraphs:
    """Route the runner's short steps through padded static buffers (no capture: CPU), with a
    scratch block appended to every layer's cache as the runner allocates one on CUDA."""
    r = llm.engine.runner
    scratch = r.kv_caches[0][0].shape[0]
    r.kv_caches[:] = [LayerKV(*(torch.cat((t, torch.zeros_like(t[:1]))) for t in kv)) for kv in r.kv_caches]
    r.step_graphs = StepGraphs(r.model, r.kv_caches, r.block_size, scratch * r.block_size, r.device, capture=False)
    return r.step_graphs


@pytest.fixture(scope="module")
def target():
    return tiny_checkpoint("llama", seed=5, vocab=64, layers=4)[1]


@pytest.mark.parametrize("spec", [
    dict(spec_method="none"),
    dict(spec_method="ngram", spec_tree="auto"),
    dict(spec_method="ngram", spec_tree="chain", kv_cache_dtype="int8"),
    dict(spec_method="eagle"),  # a head fusing the streams after layers 1 and 2: kept through the padding
])
def test_padded_static_steps_give_the_eager_tokens(target, tmp_path: Path, spec: dict):
    if spec["spec_method"] == "eagle":
        head = write_random_head(target, tmp_path / "e3.safetensors", "eagle", feature_layers=[1, 2])
        spec = {**spec, "draft_model": str(head)}
    kw = dict(dtype="float32", checkpoint=target, profile_spec_costs=False, spec_policy="always",
              num_spec_tokens=6, **spec)
    prompts = repetitive_prompts(12)
    params = [SamplingParams(max_tokens=20 + 3 * (i % 4), temperature=0, ignore_eos=True) for i in range(len(prompts))]
    eager = [o.token_ids for o in LLM("tiny", **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny", **kw)
    graphs = _padded(llm)
    batched = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0].token_ids for i in (0, 5)]
    assert batched == eager and alone == [eager[0], eager[5]]
    assert graphs.num_replays > 0 and graphs.num_graphs >= 2
    eng = llm.engine
    assert eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    if spec["spec_method"] != "none":
        assert eng.spec_counters["num_draft_tokens"] > 0


def test_step_buckets(target):
    llm = LLM("tiny", dtype="float32", checkpoint=target, spec_method="none")
    graphs = _padded(llm)
    bs = llm.engine.runner.block_size

    def meta(query_lens: list[int], starts: list[int]):
        tables = [list(range(-(-(s + q) // bs))) for q, s in zip(query_lens, starts)]
        return build_attention_metadata(query_lens, starts, tables, bs, torch.device("cpu"))

    assert graphs.key(meta([1], [10])) == GraphKey(1, 1, MIN_KV, ())
    assert graphs.key(meta([1, 1, 1], [10, 300, 20])) == GraphKey(4, 1, 512, ())
    assert graphs.key(meta([9, 3], [40, 40])) == GraphKey(2, 12, MIN_KV, ())
    assert graphs.key(meta([17], [0])) == GraphKey(1, 20, MIN_KV, ())  # a tree of 16 nodes and its root
    assert graphs.key(meta([65], [0])) is None  # a prompt chunk: eager
    assert graphs.key(meta([1] * 31 + [60], [100] * 32)) is None  # mostly padding: eager
    llm.engine.runner.model.model.layer_hooks = object()  # a connector moving KV layer by layer: eager
    assert graphs.key(meta([1], [10])) is None


def test_a_step_that_builds_its_graph_does_not_teach_the_policy_its_cost(target, monkeypatch):
    """Capturing a bucket's graph takes 30-40x a replay of it on a GPU. The speculation policy
    learns T(n) from step times: a capture step's time must not land there (it said a 23-token
    step cost 140 ms where it costs 4.4). Here building a bucket sleeps as a capture would."""
    import time

    build = StepGraphs._build

    def slow_build(self, key):  # noqa: ANN001, ANN202
        time.sleep(0.25)
        return build(self, key)

    monkeypatch.setattr(StepGraphs, "_build", slow_build)
    llm = LLM("tiny", dtype="float32", checkpoint=target, spec_method="ngram", spec_tree="auto",
              profile_spec_costs=False)
    graphs = _padded(llm)
    prompts = repetitive_prompts(6)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(prompts)
    seen: list[tuple[int, float]] = []
    timer = llm.engine.policy.target_time
    observe = timer.observe
    monkeypatch.setattr(timer, "observe", lambda n, s: (seen.append((n, s)), observe(n, s)))
    for p, sp in zip(prompts, params):
        llm.generate([p], [sp], use_tqdm=False)
    assert graphs.num_graphs >= 2  # buckets were built, some steps during the run
    assert seen and max(s for _, s in seen) < 0.2, "a step that built a graph taught the policy its time"
    assert all(v < 0.2 for v in timer.points.values())
    assert llm.engine.num_steps > len(seen)  # the build steps were left out, the rest observed


def test_eager_prompt_steps_beside_graphs_do_not_teach_the_policy_their_cost(target, monkeypatch):
    """With graphs on, a prompt chunk too long for a bucket runs eagerly, several times dearer
    than as many decode and verify rows replayed (22 ms for a 113-token SmolLM2 prompt on an H200
    against 5 for 136 decode rows): the policy's T(n) learns decode and verify steps only. Without
    graphs every step is learned, as before."""
    prompts = [p * 8 for p in repetitive_prompts(3)]  # 100+ tokens: past the largest bucket
    assert min(len(p) for p in prompts) > 64
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * len(prompts)
    for graphs_on in (True, False):
        llm = LLM("tiny", dtype="float32", checkpoint=target, spec_method="ngram", profile_spec_costs=False)
        if graphs_on:
            _padded(llm)
        seen: list[int] = []
        timer = llm.engine.policy.target_time
        observe = timer.observe
        monkeypatch.setattr(timer, "observe", lambda n, s, seen=seen, observe=observe: (seen.append(n), observe(n, s)))
        for p, sp in zip(prompts, params):
            llm.generate([p], [sp], use_tqdm=False)
        prompt_steps = [n for n in seen if n > 64]
        assert seen, "no step was learned at all"
        assert bool(prompt_steps) is not graphs_on, (graphs_on, seen)
