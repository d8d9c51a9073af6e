"""The planner: cost models, the deployment simulator's invariants, workload files, `specserve plan`."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace

import pytest

from specserve.cli import main
from specserve.ops import calc
from specserve.ops.costmodel import (
    PROFILE_FORMAT,
    MeasuredCostModel,
    ProfileError,
    RooflineCostModel,
    ScaledCostModel,
    StepShape,
)
from specserve.ops.hardware import get_hardware
from specserve.ops.plan import WorkloadError, load_workload, parse_slo, parse_workload
from specserve.ops.profile import LONE_GAPS_S
from specserve.ops.simulate import (
    SLO,
    Deployment,
    RequestClass,
    RequestResult,
    SimResult,
    SimulationError,
    SpecSetting,
    TokenRange,
    TraceRequest,
    Workload,
    percentile,
    simulate,
    summarize,
)

BASE_S, PER_TOKEN_S = 0.05, 0.001  # synthetic machine: a step costs 50 ms + 1 ms per token
BATCHES, CONTEXTS, NS, CHUNKS = [1, 2, 4, 8, 16, 32], [128, 1024], [1, 2, 3, 5, 9], [64, 128, 256, 512]


def step(tokens: float) -> float:
    """The synthetic machine's forward time for a step of `tokens` tokens."""
    return BASE_S + PER_TOKEN_S * tokens


def synthetic_profile(*, link_gb_s: float = 1.0, drafter: dict | None = None, overhead_s: float = 0.0) -> dict:
    """A profile as `specserve profile` writes it, of a machine whose steps cost step(tokens)."""
    return {
        "format": PROFILE_FORMAT,
        "machine": {"cpu": "synthetic"},
        "model": {"name": "tiny", "num_layers": 4, "kv_bytes_per_token": 1000, "kv_capacity_tokens": 200_000},
        "engine": {"max_num_batched_tokens": 512, "max_num_seqs": 64, "attention": "per_token"},
        "decode": {"contexts": CONTEXTS, "batches": BATCHES, "step_s": [[step(b) for b in BATCHES] for _ in CONTEXTS]},
        "verify": {"context": 128, "batches": [1, 4, 16], "tokens": NS,
                   "step_s": [[step(b * n) for n in NS] for b in [1, 4, 16]]},
        "prefill": {"chunks": CHUNKS, "step_s": [step(p) for p in CHUNKS]},
        "prefill_context": {"chunk": 512, "offsets": [0, 1024], "step_s": [step(512), step(512)]},
        "engine_overhead": {"batches": [1, 8], "step_s": [overhead_s, overhead_s]},
        "served": {"batches": [1, 8], "context": 32, "step_s": [step(1) + 0.002, step(8) + 0.010]},
        "drafter": drafter,
        "kv_transfer": {"bandwidth_gb_s": link_gb_s},
    }


@pytest.fixture
def cost() -> MeasuredCostModel:
    return MeasuredCostModel.from_profile(synthetic_profile())


# ---------------------------------------------------------------------- cost models
def test_measured_cost_interpolates_the_tables(cost):
    assert cost.step_s(StepShape(1, 1, 100, 100)) == pytest.approx(step(1))
    assert cost.step_s(StepShape(6, 6, 600, 100)) == pytest.approx(step(6))  # between measured batches
    assert cost.step_s(StepShape(4, 20, 400, 100)) == pytest.approx(step(20))  # verify: 4 requests x 5 tokens
    assert cost.step_s(StepShape(prefill=((300, 0),))) == pytest.approx(step(300))
    # A prompt chunk sharing a step with decodes: the weights' fixed cost counted once.
    assert cost.step_s(StepShape(4, 4, 400, 100, ((300, 0),))) == pytest.approx(step(304), rel=1e-6)
    assert cost.step_s(StepShape(prefill=((100, 0), (200, 0)))) == pytest.approx(step(300), rel=1e-6)


def test_a_steps_rows_share_one_forward():
    """On a CPU the first rows of a forward cost little more than one (each weight block is read
    once for every row): a short prompt beside decodes costs what its rows add to theirs, not a
    forward of its own, and each chunk's own causal attention is charged on top of the rows."""
    p = synthetic_profile()
    flat = {1: 0.010, 2: 0.010, 4: 0.010, 8: 0.011, 16: 0.012, 64: 0.030, 512: 0.200}
    p["prefill"] = {"chunks": list(flat)[1:], "step_s": list(flat.values())[1:]}
    p["decode"]["step_s"] = [[flat[1] if b == 1 else 0.010 + 0.0001 * b for b in BATCHES] for _ in CONTEXTS]
    p["prefill_context"] = {"chunk": 512, "offsets": [0, 1000], "step_s": [0.200, 0.200 + 512 * 1000 * 1e-8]}
    m = MeasuredCostModel.from_profile(p)
    assert m.pair_s == pytest.approx(1e-8)
    assert m.step_s(StepShape(prefill=((16, 0),))) == pytest.approx(0.012)  # a chunk alone: the table
    # One decode and an 8-token prompt: 9 rows, G(9) - G(1) on top of the decode (G: the table less
    # the chunk's own attention), then the chunk's attention; not a second 10 ms forward.
    g9 = 0.011 + 0.001 / 8 - 1e-8 * 9 * 10 / 2
    g1 = 0.010 - 1e-8
    assert m.step_s(StepShape(1, 1, 100, 100, ((8, 0),))) == pytest.approx(0.010 + g9 - g1 + 1e-8 * 36, rel=1e-6)
    assert m.step_s(StepShape(1, 1, 100, 100, ((8, 0),))) < 0.0115
    # A chunk after a context also attends to it.
    assert m.step_s(StepShape(prefill=((512, 1000),))) == pytest.approx(0.200 + 512 * 1000 * 1e-8)


def test_draft_rows_attend_over_the_context_beyond_the_verify_tables():
    """The verify table is timed at one context (128 here); each draft row of a step at a longer
    context also attends over the keys beyond it, at the fitted c per (query, key) pair (a 9-token
    verify at a 1k-token context cost twice the one at 128 on SmolLM2, and the table alone missed it)."""
    p = synthetic_profile()
    p["prefill_context"] = {"chunk": 512, "offsets": [0, 1000], "step_s": [step(512), step(512) + 512 * 1000 * 1e-8]}
    m = MeasuredCostModel.from_profile(p)
    assert m.pair_s == pytest.approx(1e-8) and m.verify_context == 128
    near, far = (m.step_s(StepShape(4, 20, 4 * ctx, ctx)) for ctx in (100, 2128))
    assert near == pytest.approx(step(20))
    assert far - near == pytest.approx(16 * 2000 * 1e-8)  # 16 draft rows x 2,000 keys past the table's context
    assert m.step_s(StepShape(4, 4, 4 * 2128, 2128)) == pytest.approx(step(4))  # decodes alone: the decode table


def test_served_overhead():
    served = MeasuredCostModel.from_profile(synthetic_profile(), served=True)
    assert served.step_s(StepShape(1, 1, 32, 32)) == pytest.approx(step(1) + 0.002)
    assert served.step_s(StepShape(8, 8, 8 * 32, 32)) == pytest.approx(step(8) + 0.010)
    p = synthetic_profile()
    del p["served"]
    with pytest.raises(ProfileError, match="served"):
        MeasuredCostModel.from_profile(p, served=True)


def test_served_forwards_take_the_decode_tables_excess_off_every_context():
    """Steps timed back to back behind the server (`served.forward_s`) faster than the decode
    table's isolated ones (weights that settle in a large cache): the table's excess at each
    served batch comes off every context of that batch, interpolated between served batches,
    nothing beyond the largest, never below half the timed step; a slower served forward (the
    server's own work) changes nothing."""
    p = synthetic_profile()
    p["served"]["forward_s"] = [step(1) - 0.010, step(8) - 0.004]
    m = MeasuredCostModel.from_profile(p)
    assert m.step_s(StepShape(1, 1, 32, 32)) == pytest.approx(step(1) - 0.010)
    assert m.step_s(StepShape(1, 1, 1024, 1024)) == pytest.approx(step(1) - 0.010)  # the weights' part
    assert m.step_s(StepShape(4, 4, 4 * 32, 32)) == pytest.approx(step(4) - (0.010 - 3 / 7 * 0.006))
    assert m.step_s(StepShape(16, 16, 16 * 32, 32)) == pytest.approx(step(16))
    # Served steps now cost what the profile measured behind the server, forward and all.
    served = MeasuredCostModel.from_profile(p, served=True)
    assert served.step_s(StepShape(8, 8, 8 * 32, 32)) == pytest.approx(step(8) + 0.010)
    p["served"]["forward_s"] = [0.001, step(8) + 0.005]
    m = MeasuredCostModel.from_profile(p)
    assert m.step_s(StepShape(1, 1, 32, 32)) == pytest.approx(step(1) / 2)
    assert m.step_s(StepShape(8, 8, 8 * 32, 32)) == pytest.approx(step(8))


def test_relay_costs_of_a_disaggregated_decode_worker():
    """`profile --disagg`'s relay: a decode worker's step pays the relay's overhead instead of the
    engine's, and a lone request's measured time to first token beyond what its steps (and the KV's
    way) cost is charged to every request of a disaggregated deployment, by route."""
    p = synthetic_profile(link_gb_s=1.0)
    p["relay"] = {"batches": [1, 8], "context": 32, "step_s": [step(1) + 0.004, step(8) + 0.012],
                  "ttft_s": step(63) + step(1) + 0.004 + 63 * 1000 / 1e9 + 0.150, "prompt_tokens": 64,
                  "local_ttft_s": step(8) + 0.004 + 0.020, "local_prompt_tokens": 8}
    m = MeasuredCostModel.from_profile(p)
    assert m.step_s(StepShape(1, 1, 32, 32), "decode") == pytest.approx(step(1) + 0.004)
    assert m.step_s(StepShape(8, 8, 8 * 32, 32), "decode") == pytest.approx(step(8) + 0.012)
    assert m.step_s(StepShape(8, 8, 8 * 32, 32), "prefill") == pytest.approx(step(8))  # no relay there
    assert m.disagg_request_overhead_s(local_prefill=True) == pytest.approx(0.020)
    assert m.disagg_request_overhead_s(local_prefill=False) == pytest.approx(0.150)
    plain = MeasuredCostModel.from_profile(synthetic_profile(link_gb_s=1.0))  # no relay measured: nothing added
    assert plain.step_s(StepShape(1, 1, 32, 32), "decode") == pytest.approx(step(1))
    assert plain.disagg_request_overhead_s(local_prefill=False) == 0.0
    dep = Deployment(colocated=0, prefill=1, decode=1)
    trace = [TraceRequest(0.0, 8, 4), TraceRequest(10.0, 300, 4)]
    with_relay, without = (simulate(trace, dep, c).requests for c in (m, plain))
    assert with_relay[0].ttft_s - without[0].ttft_s == pytest.approx(0.020 + 0.004, rel=1e-6)  # locally prefilled
    assert with_relay[1].ttft_s - without[1].ttft_s == pytest.approx(0.150 + 0.004, rel=1e-6)  # through P
    assert with_relay[0].tpot_s - without[0].tpot_s == pytest.approx(0.004, rel=1e-6)
    # Decodes timed beside a real prefill worker replace the synthetic neighbour's slowdown of a
    # decode step.
    p["co_run"] = {"slowdown": {"decode": 1.6, "prefill": 1.1}}
    m = MeasuredCostModel.from_profile(p)
    assert m.co_run_slowdown("decode") == 1.6
    p["relay"] |= {"beside_prefill": {"batches": [1, 4], "alone_s": [0.010, 0.020], "beside_s": [0.011, 0.030],
                                      "slowdown": [1.1, 1.5]}}
    m = MeasuredCostModel.from_profile(p)
    assert m.co_run_slowdown("prefill") == 1.1  # the synthetic neighbour's, for the other role
    # By the decode step's batch: between the timed batches linearly, held past them.
    assert [m.co_run_slowdown("decode", b) for b in (1, 2, 4, 16)] == pytest.approx([1.1, 1.1 + 0.4 / 3, 1.5, 1.5])
    dep, long_then_short = Deployment(colocated=0, prefill=1, decode=1), [TraceRequest(0.0, 4000, 2),
                                                                        TraceRequest(0.0, 8, 200)]
    beside, apart = (simulate(long_then_short, dep, c).requests[1] for c in (m, replace(m, decode_beside_prefill=None, co_run={})))
    assert beside.tpot_s > apart.tpot_s  # the decodes ran beside the long prompt's prefill


def test_measured_cost_context_and_noise():
    p = synthetic_profile()
    p["decode"]["step_s"][1] = [step(b) + 0.01 * b for b in BATCHES]  # context 1024: +10 ms per request
    p["decode"]["step_s"][0][2] = 5.0  # a noisy point (another process ran): above later ones
    p["verify"]["step_s"][0][0] = 3.0  # one token per request: the decode step measured it faster
    p["prefill_context"]["step_s"] = [step(512), step(512) + 0.5]
    m = MeasuredCostModel.from_profile(p)
    assert m.step_s(StepShape(2, 2, 2 * 1023, 1023)) == pytest.approx(step(2) + 0.02)
    assert m.step_s(StepShape(4, 4, 4 * 127, 127)) == pytest.approx(step(8))  # the noisy point repaired
    assert m.step_s(StepShape(1, 3, 127, 127)) == pytest.approx(step(3))
    assert m.pair_s == pytest.approx(0.5 / (512 * 1024))
    assert m.step_s(StepShape(prefill=((512, 2048),))) == pytest.approx(step(512) + 1.0)


def test_decode_steps_grow_on_a_line_in_the_context_through_the_shortest_ones_time():
    p = synthetic_profile()
    contexts = [128, 1024, 2560]
    per_key = 2e-6  # seconds a step adds per key a request reads
    p["decode"]["contexts"] = contexts
    p["decode"]["step_s"] = [[step(b) + per_key * b * (c - 128) for b in BATCHES] for c in contexts]
    exact = MeasuredCostModel.from_profile(p)
    # A middle point timed in a fast spell no longer bends the whole range below it ...
    p["decode"]["step_s"][1][1] = step(2) + 0.2 * per_key * 2 * (1024 - 128)
    m = MeasuredCostModel.from_profile(p)
    at = (128, 700, 1300, 2000, 2560)
    line = [m.step_s(StepShape(2, 2, 2 * (c - 1), c - 1)) for c in at]
    assert line[0] == pytest.approx(step(2))  # the shortest context as timed
    slopes = [(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(at, at[1:], line, line[1:])]
    assert slopes[0] > 0 and slopes == pytest.approx([slopes[0]] * 4, rel=1e-6)  # one straight line
    piecewise = step(2) + 0.2 * per_key * 2 * (1024 - 128) + (1300 - 1024) / (2560 - 1024) * (
        per_key * 2 * (2560 - 128) - 0.2 * per_key * 2 * (1024 - 128))
    assert piecewise < line[2] < exact.step_s(StepShape(2, 2, 2 * 1299, 1299))
    # ... other batches keep their exact lines, and a slope is never negative.
    assert m.step_s(StepShape(4, 4, 4 * 1299, 1299)) == pytest.approx(exact.step_s(StepShape(4, 4, 4 * 1299, 1299)))
    p["decode"]["step_s"][2] = [v * 0.5 for v in p["decode"]["step_s"][0]]
    flat = MeasuredCostModel.from_profile(p)
    assert flat.step_s(StepShape(8, 8, 8 * 2559, 2559)) == pytest.approx(flat.step_s(StepShape(8, 8, 8 * 127, 127)))


def test_profile_round_trip(tmp_path, cost):
    from specserve.ops.profile import write_profile

    path = write_profile(synthetic_profile(), tmp_path / "sub" / "p.json")
    again = MeasuredCostModel.from_profile(json.loads(path.read_text()))
    assert again == cost
    for shape in (StepShape(3, 9, 300, 120), StepShape(prefill=((200, 64),)), StepShape(2, 2, 50, 30, ((40, 0),))):
        assert again.step_s(shape) == cost.step_s(shape)


@pytest.mark.parametrize(("edit", "field"), [
    (lambda p: p.update(format="other"), "format"),
    (lambda p: p.pop("decode"), "decode"),
    (lambda p: p["verify"].update(batches=[4, 1, 16]), "verify.batches"),
    (lambda p: p["prefill"].update(step_s=[0.1, 0.2]), "prefill.step_s"),
    (lambda p: p["decode"]["step_s"].__setitem__(0, [0.1, -1, 0.1, 0.1, 0.1, 0.1]), "decode.step_s[0]"),
    (lambda p: p["model"].update(kv_bytes_per_token=0), "kv_bytes_per_token"),
    (lambda p: p["engine"].update(attention="flash"), "engine.attention"),
    (lambda p: p.update(drafter={"cost": "cheap", "batches": [1], "pass_s": [0.1]}), "drafter.cost"),
    (lambda p: p.update(co_run={"slowdown": {"decode": -1.0, "prefill": 1.2}}), "co_run.slowdown.decode"),
    (lambda p: p.update(co_run={"slowdown": {"decode": 1.5}}), "co_run.slowdown.prefill"),
    (lambda p: p.update(served=[1]), "not a profile `specserve profile` wrote"),  # parts of another kind
    (lambda p: p.update(relay="x"), "not a profile `specserve profile` wrote"),
])
def test_malformed_profiles_name_the_field(edit, field):
    p = synthetic_profile()
    edit(p)
    with pytest.raises(ProfileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        MeasuredCostModel.from_profile(p)


def test_roofline_cost_of_a_70b_on_h100s():
    arch, h100 = calc.load_arch("llama-3-70b"), get_hardware("h100")
    tp4 = RooflineCostModel(h100, arch, tp=4)
    weights = calc.weights_read_per_token(arch) * 2
    memory_bound = weights / (4 * h100.memory_gb_s * 1e9 * tp4.memory_efficiency)
    one = tp4.step_s(StepShape(1, 1, 512, 512))
    assert memory_bound + tp4.step_overhead_s < one < memory_bound + tp4.step_overhead_s + 0.003  # + all-reduces
    assert tp4.step_s(StepShape(32, 32, 32 * 512, 512)) < 1.5 * one  # decode stays memory-bound
    assert tp4.step_s(StepShape(prefill=((8192, 0),))) > 10 * one  # a long prompt is compute-bound
    assert RooflineCostModel(h100, arch, tp=1).kv_capacity_tokens == 0  # 139 GB of weights: no room
    assert tp4.kv_capacity_tokens == int((4 * 80e9 * 0.9 - weights) // 327_680)
    assert tp4.link_gb_s == 900 / 2 * 4
    assert tp4.draft_s(8, 4) == 0.0  # model-free drafts
    with_draft = RooflineCostModel(h100, arch, tp=4, draft_arch=calc.load_arch("llama-3.2-1b"))
    assert 0 < with_draft.draft_s(8, 4) < one


# ---------------------------------------------------------------------- simulator invariants
def test_one_request_on_an_idle_engine(cost):
    [r] = simulate([TraceRequest(1.0, 300, 40)], Deployment(), cost).requests
    assert r.ttft_s == pytest.approx(step(300))  # one prefill step
    assert r.tpot_s == pytest.approx(step(1))  # one decode step per token at batch 1
    assert r.e2e_s == pytest.approx(step(300) + 39 * step(1))


def test_chunked_prefill_and_prefix_cache(cost):
    [r] = simulate([TraceRequest(0.0, 1200, 2)], Deployment(max_num_batched_tokens=512), cost).requests
    assert r.ttft_s == pytest.approx(step(512) + step(512) + step(176))
    [r] = simulate([TraceRequest(0.0, 1200, 2, cached_tokens=1000)], Deployment(), cost).requests
    assert r.ttft_s == pytest.approx(step(200))


def test_speculation_tpot_is_step_cost_over_expected_tokens(cost):
    a, k = 0.8, 4
    [r] = simulate([TraceRequest(0.0, 100, 6000, acceptance=a)], Deployment(spec=SpecSetting(k)), cost).requests
    expected = step(k + 1) / calc.expected_tokens(a, k)  # (1 - a^(K+1)) / (1 - a) tokens per verify step
    assert r.tpot_s == pytest.approx(expected, rel=0.03)
    # The threshold is the policy's rule: with a 10x bar speculation never runs.
    [plain] = simulate([TraceRequest(0.0, 100, 200, acceptance=a)],
                       Deployment(spec=SpecSetting(k, threshold=10.0)), cost).requests
    assert plain.tpot_s == pytest.approx(step(1))


def test_a_replayed_request_drafts_its_own_k(cost):
    """A trace request with its own K (a replayed request's measured drafts per verify step)
    drafts that many whenever the policy drafts, beside requests that take the policy's K."""
    a, k, own = 0.95, 4, 12
    dep = Deployment(spec=SpecSetting(k))
    [policy_k] = simulate([TraceRequest(0.0, 100, 6000, acceptance=a)], dep, cost).requests
    [long_k] = simulate([TraceRequest(0.0, 100, 6000, acceptance=a, spec_k=own)], dep, cost).requests
    assert policy_k.tpot_s == pytest.approx(step(k + 1) / calc.expected_tokens(a, k), rel=0.03)
    assert long_k.tpot_s == pytest.approx(step(own + 1) / calc.expected_tokens(a, own), rel=0.03)
    # Batched with a request of the policy's K, each keeps its own; one that never drafts stays plain.
    res = simulate([TraceRequest(0.0, 100, 3000, acceptance=a, spec_k=own), TraceRequest(0.0, 100, 3000, acceptance=a),
                    TraceRequest(0.0, 100, 3000)], dep, cost)
    fast, slow, plain = res.requests
    assert fast.tpot_s < slow.tpot_s < plain.tpot_s


def test_a_request_drafting_in_a_share_of_its_steps_pays_only_for_those(cost):
    """Prompt lookup drafts only where its text matches: a request that verifies K drafts, all
    accepted, in a third of its steps and decodes plainly in the rest takes (K + 1) tokens from
    a third of its steps at a (K + 1)-token step's cost and one token from the others at a plain
    step's, not K drafts every step at a lower acceptance."""
    k, share, n = 8, 1 / 3, 3000
    dep = Deployment(spec=SpecSetting(k))
    res = simulate([TraceRequest(0.0, 100, n, acceptance=1.0, spec_k=k, draft_share=share)], dep, cost, seed=1)
    [r] = res.requests
    per_step_tokens = share * (k + 1) + (1 - share)
    per_step_s = share * step(k + 1) + (1 - share) * step(1)
    assert r.tpot_s == pytest.approx(per_step_s / per_step_tokens, rel=0.05)
    assert res.num_spec_steps == pytest.approx(share * res.num_steps, rel=0.1)
    # The same tokens per step from every step drafting at the acceptance that yields them cost more.
    b = calc.acceptance_for(per_step_tokens, k)
    [every] = simulate([TraceRequest(0.0, 100, n, acceptance=b, spec_k=k)], dep, cost, seed=1).requests
    assert every.tpot_s == pytest.approx(step(k + 1) / per_step_tokens, rel=0.05)
    assert every.tpot_s > 1.06 * r.tpot_s
    with pytest.raises(SimulationError, match="draft_share"):
        RequestClass("c", 1.0, TokenRange(1, 1), TokenRange(1, 1), acceptance=0.5, draft_share=0.0)
    doc = _with("classes.0.draft_share", 0.25)
    assert parse_workload(doc).workload.classes[0].draft_share == 0.25
    assert parse_workload(GOOD).workload.classes[0].draft_share == 1.0


def test_the_policy_decides_per_request_which_drafts_pay(cost):
    """As the engine's policy, the simulated one lets the requests whose drafts pay draft and holds
    back the rest: a request copying its answer (acceptance 0.99) beside seven whose drafts are
    rarely accepted drafts K tokens a step alone, where one K and one decision for all the batch
    had all eight draft a single token."""
    a, k = 0.99, 4
    trace = [TraceRequest(0.0, 100, 400, acceptance=a)] + [TraceRequest(0.0, 100, 2000, acceptance=0.05)] * 7
    res = simulate(trace, Deployment(spec=SpecSetting(k)), cost)
    copy, *others = res.requests
    assert copy.tpot_s == pytest.approx(step(8 + k) / calc.expected_tokens(a, k), rel=0.2)  # draws and prefill steps
    assert copy.tpot_s < 0.5 * step(8 + 8) / calc.expected_tokens(a, 1)  # the shared decision: K = 1 for all eight
    assert all(o.tpot_s == pytest.approx(step(7), rel=0.02) for o in others)  # never draft; plain steps once alone


def test_speculation_pays_for_drafts_and_stops_when_they_do_not_pay():
    # A draft model whose pass costs as much as a target step: K drafts cost K steps, never worth it.
    costly = MeasuredCostModel.from_profile(synthetic_profile(
        drafter={"cost": "per_pass", "batches": [1, 8], "pass_s": [step(1), step(8)]}))
    res = simulate([TraceRequest(0.0, 100, 100, acceptance=0.5)], Deployment(spec=SpecSetting(4)), costly)
    assert res.num_spec_steps == 0
    assert res.requests[0].tpot_s == pytest.approx(step(1))


def test_speculation_switched_on_costs_every_step_with_a_model_free_proposer():
    m = MeasuredCostModel.from_profile(synthetic_profile(
        drafter={"cost": "flat", "batches": [1, 8], "step_s": [0.005, 0.012]}))
    for k, expected in ((0, step(1)), (4, step(1) + 0.005)):
        [r] = simulate([TraceRequest(0.0, 100, 50)], Deployment(spec=SpecSetting(k)), m).requests  # nothing to draft
        assert r.tpot_s == pytest.approx(expected)


def test_a_step_verifying_drafts_pays_what_verification_adds():
    """A model-free proposer's drafting steps pay the profile's verify_step_s on top: at 1 ms the
    policy still drafts (4.1 tokens expected from a 55 ms step), at 500 ms it does not."""
    base = {"cost": "flat", "batches": [1, 8], "step_s": [1e-6, 1e-6]}
    trace = [TraceRequest(0.0, 100, 100, acceptance=0.9)]
    cheap, dear = (MeasuredCostModel.from_profile(synthetic_profile(drafter=base | {"verify_step_s": [v, v]}))
                   for v in (0.001, 0.500))
    free = MeasuredCostModel.from_profile(synthetic_profile(drafter=base))
    assert cheap.spec_verify_s(4) == 0.001 and free.spec_verify_s(4) == 0.0
    dep = Deployment(spec=SpecSetting(4))
    with_cost, without = (simulate(trace, dep, c, seed=3) for c in (cheap, free))
    assert with_cost.num_spec_steps > 0 and with_cost.num_spec_steps == without.num_spec_steps
    assert with_cost.requests[0].e2e_s == pytest.approx(without.requests[0].e2e_s + 0.001 * with_cost.num_spec_steps)
    assert simulate(trace, dep, dear).num_spec_steps == 0


def test_a_step_carrying_a_prompt_keeps_only_drafts_that_add_a_tenth_to_its_time(cost, monkeypatch):
    """As the engine's policy, the simulated one cuts the drafts of a step that also computes a
    prompt to what adds PROMPT_DRAFT_SHARE to it: a 20-token prompt arriving beside a request
    that copies 12 tokens a step is computed in step(1 + 20 + 7) (7 rows: a tenth of step(21)),
    not step(1 + 20 + 12)."""
    trace = [TraceRequest(0.0, 100, 400, acceptance=1.0, spec_k=12), TraceRequest(1.0, 20, 5)]
    dep = Deployment(spec=SpecSetting(4))
    cut = simulate(trace, dep, cost)
    monkeypatch.setattr(calc, "PROMPT_DRAFT_SHARE", 100.0)
    whole = simulate(trace, dep, cost)
    assert cut.requests[0].ttft_s == whole.requests[0].ttft_s  # a's own prompt: nothing drafts beside it
    assert whole.requests[1].ttft_s - cut.requests[1].ttft_s == pytest.approx(step(1 + 20 + 12) - step(1 + 20 + 7))
    assert cut.num_spec_steps == whole.num_spec_steps


def test_queueing_grows_ttft_with_rate(cost):
    cls = (RequestClass("c", 1.0, TokenRange(400, 600), TokenRange(50, 80)),)
    ttfts = []
    for rate in (0.2, 2.0, 6.0):
        res = simulate(Workload(rate, cls).trace(200, seed=3), Deployment(), cost)
        ttfts.append(summarize(res, SLO(1.0, 0.2)).overall.ttft_p50)
    assert ttfts[0] == pytest.approx(step(512) + step(1), rel=0.5)  # mostly alone
    assert ttfts[0] < ttfts[1] < ttfts[2]
    assert ttfts[2] > 5 * ttfts[0]


@pytest.mark.parametrize("pipelining", [True, False])
def test_disaggregated_ttft_includes_the_exposed_transfer(pipelining):
    cost = MeasuredCostModel.from_profile(synthetic_profile(link_gb_s=512 * 1000 / 0.2 / 1e9))  # 0.2 s per 512 tokens
    dep = Deployment(colocated=0, prefill=1, decode=1, layer_pipelining=pipelining)
    [r] = simulate([TraceRequest(0.0, 513, 10)], dep, cost).requests
    prefill = step(512)  # the prefill worker computes m = n - 1 = 512 tokens: one chunk
    # Layer streaming: 4 layers of 50 ms of transfer each, compute per layer (140 ms) keeps ahead
    # of the link, so one layer's share is left once the prefill ends; without it, all of it.
    exposed = 0.2 / 4 if pipelining else 0.2
    assert calc.transfer_time(512 * 1000, cost.link_gb_s, 4, prefill / 4).exposed_s == pytest.approx(0.2 / 4)
    first_step = cost.step_s(StepShape(prefill=((1, 512),)))  # the decode worker's last prompt token
    assert r.ttft_s == pytest.approx(prefill + exposed + first_step)
    assert r.tpot_s == pytest.approx(step(1))


def test_disaggregated_short_prompts_prefill_on_the_decode_worker(cost):
    dep = Deployment(colocated=0, prefill=1, decode=1, local_prefill_tokens=32)
    [r] = simulate([TraceRequest(0.0, 20, 5)], dep, cost).requests
    assert r.ttft_s == pytest.approx(step(20))


def test_disaggregation_keeps_long_prompts_out_of_decode_steps(cost):
    trace = [TraceRequest(0.1 * i, 30, 200) for i in range(4)] + [TraceRequest(1.0 + i, 3000, 8) for i in range(4)]
    slo = SLO(60.0, 1.0)
    co = summarize(simulate(trace, Deployment(colocated=2), cost), slo)
    dis = summarize(simulate(trace, Deployment(colocated=0, prefill=1, decode=1), cost), slo)
    assert dis.overall.tpot_p99 < co.overall.tpot_p99


def test_http_front_end_time_is_added_to_every_first_token(cost):
    """served.ttft_s (a lone request through the server, as its client saw it) less the step
    that prefilled its prompt is the front end's time, added to every request's TTFT only when
    the deployment is asked to include HTTP."""
    profile = synthetic_profile()
    profile["served"] |= {"ttft_s": step(40) + 0.002 + 0.030, "prompt_tokens": 40}  # 30 ms outside steps
    http = MeasuredCostModel.from_profile(profile, served=True, http=True)
    assert http.request_overhead_s == pytest.approx(0.030, abs=1e-6)
    assert MeasuredCostModel.from_profile(profile, served=True).request_overhead_s == 0.0
    trace = [TraceRequest(0.0, 40, 4), TraceRequest(5.0, 40, 4)]
    plain = simulate(trace, Deployment(), MeasuredCostModel.from_profile(profile, served=True)).requests
    front = simulate(trace, Deployment(), http).requests
    assert [b.ttft_s - a.ttft_s for a, b in zip(plain, front)] == pytest.approx([0.030, 0.030])
    assert http.busy_request_overhead_s == http.request_overhead_s  # the server's front end works beside the engine
    with pytest.raises(ProfileError, match="served.ttft_s"):
        MeasuredCostModel.from_profile(synthetic_profile(), served=True, http=True)
    # The chat template's start found in the prefix cache: only the rest was prefilled.
    profile["served"] |= {"ttft_s": step(25) + 0.002 + 0.030, "prompt_tokens": 40, "cached_tokens": 15}
    assert MeasuredCostModel.from_profile(profile, served=True, http=True).request_overhead_s == pytest.approx(
        0.030, abs=1e-6)


def test_in_process_front_end_time_is_added_to_first_tokens_from_an_engine_at_rest():
    """`in_process` (lone requests submitted through AsyncEngine, as bench/disagg.py's co-located
    engine and an embedding application submit them) less the step that prefilled them is that
    front end's time; a profile without it charges nothing, and a front end is one or the other."""
    profile = synthetic_profile()
    plain = MeasuredCostModel.from_profile(profile, served=True, in_process=True)
    assert plain.request_overhead_s == 0.0  # recorded before profiles measured it
    profile["in_process"] = {"ttft_s": step(20) + 0.002 + 0.004, "prompt_tokens": 36, "cached_tokens": 16,
                             "lone": [{"ttft_s": 0.01, "prompt_tokens": 36, "cached_tokens": 16}]}
    inproc = MeasuredCostModel.from_profile(profile, served=True, in_process=True)
    assert inproc.request_overhead_s == pytest.approx(0.004, abs=1e-6)
    trace = [TraceRequest(0.0, 36, 4), TraceRequest(5.0, 36, 4)]
    base, front = (simulate(trace, Deployment(), c).requests for c in (plain, inproc))
    assert [b.ttft_s - a.ttft_s for a, b in zip(base, front)] == pytest.approx([0.004, 0.004])
    # That time is an engine at rest waking up: a request arriving while another decodes is
    # taken in at the next step and pays none of it (behind HTTP it pays all of it, as above).
    assert inproc.busy_request_overhead_s == 0.0
    busy = [TraceRequest(0.0, 36, 400), TraceRequest(0.5, 36, 4)]
    base, front = (simulate(busy, Deployment(), c).requests for c in (plain, inproc))
    assert front[0].ttft_s - base[0].ttft_s == pytest.approx(0.004)
    # As if the first had arrived 4 ms later and the second had no front end at all.
    [_, later] = simulate([TraceRequest(0.004, 36, 400), TraceRequest(0.5, 36, 4)], Deployment(), plain).requests
    assert front[1].ttft_s == pytest.approx(later.ttft_s)
    charged = replace(inproc, busy_request_overhead_s=0.3)  # would the busy request pay: later
    assert simulate(busy, Deployment(), charged).requests[1].ttft_s > front[1].ttft_s + 0.29
    with pytest.raises(ValueError, match="either HTTP or in-process"):
        MeasuredCostModel.from_profile(profile, http=True, in_process=True)


def test_a_scaled_cost_model_is_the_same_machine_that_much_slower(cost):
    slow = ScaledCostModel(cost, 1.1)
    shape = StepShape(4, 4, 400, 100, ((64, 128),))
    assert slow.step_s(shape) == pytest.approx(1.1 * cost.step_s(shape))
    assert slow.link_gb_s == pytest.approx(cost.link_gb_s / 1.1)
    assert slow.kv_capacity_tokens == cost.kv_capacity_tokens and slow.num_layers == cost.num_layers
    # Through the simulator: a lone request's latency scales with it (no queueing to amplify it).
    [base] = simulate([TraceRequest(0.0, 300, 40)], Deployment(), cost).requests
    [scaled] = simulate([TraceRequest(0.0, 300, 40)], Deployment(), slow).requests
    assert scaled.ttft_s == pytest.approx(1.1 * base.ttft_s) and scaled.tpot_s == pytest.approx(1.1 * base.tpot_s)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            ScaledCostModel(cost, bad)


def test_disaggregated_workers_on_one_machine_slow_each_other_by_the_profiled_factor(cost):
    """A decode step that starts while the prefill worker computes takes co_run.slowdown.decode
    times as long (and a prefill chunk beside decoding, .prefill); alone, or co-located, nothing."""
    profile = synthetic_profile()
    profile["co_run"] = {"slowdown": {"decode": 1.6, "prefill": 1.25}}
    shared = MeasuredCostModel.from_profile(profile)
    assert shared.co_run_slowdown("decode") == 1.6 and cost.co_run_slowdown("decode") == 1.0
    dep = Deployment(colocated=0, prefill=1, decode=1, local_prefill_tokens=32)
    decode_only = [TraceRequest(0.0, 20, 40)]
    assert simulate(decode_only, dep, shared).requests == simulate(decode_only, dep, cost).requests
    # One long decode with a long prompt prefilled beside it.
    mixed = [TraceRequest(0.0, 20, 60, "decode"), TraceRequest(0.2, 2000, 2, "long")]
    alone = {r.request_class: r for r in simulate(mixed, dep, cost).requests}
    beside = {r.request_class: r for r in simulate(mixed, dep, shared).requests}
    assert beside["decode"].tpot_s > alone["decode"].tpot_s * 1.05
    assert beside["long"].ttft_s > alone["long"].ttft_s * 1.1  # its chunks ran beside decoding
    co = Deployment(colocated=1)
    assert simulate(mixed, co, shared).requests == simulate(mixed, co, cost).requests


def test_simulation_is_deterministic_with_a_seed(cost):
    w = Workload(3.0, (RequestClass("a", 0.6, TokenRange(50, 400), TokenRange(20, 90), acceptance=0.7),
                       RequestClass("b", 0.4, TokenRange(800, 900), TokenRange(10, 20))))
    dep = Deployment(colocated=0, prefill=1, decode=2, spec=SpecSetting(4))
    assert w.trace(100, seed=5) == w.trace(100, seed=5)
    assert w.trace(100, seed=5) != w.trace(100, seed=6)
    trace = w.trace(100, seed=5)
    assert simulate(trace, dep, cost, seed=1) == simulate(trace, dep, cost, seed=1)
    assert simulate(trace, dep, cost, seed=1) != simulate(trace, dep, cost, seed=2)  # draft acceptance draws


def test_goodput_counts_only_requests_within_their_slo():
    def req(cls: str, ttft: float, tpot: float | None) -> RequestResult:
        return RequestResult(cls, 0.0, 10, 10, ttft, tpot, ttft + 1.0)

    result = SimResult((req("a", 0.5, 0.05), req("a", 3.0, 0.05), req("a", 0.5, 0.5), req("b", 2.5, None),
                        req("b", 2.5, 0.2)), duration_s=10.0, num_steps=10, num_spec_steps=0)
    s = summarize(result, {"a": SLO(1.0, 0.1), "b": SLO(3.0, 0.3)})
    assert s.overall.within_slo == 3  # a's first; both b's
    assert s.goodput_req_s == pytest.approx(0.3)
    assert s.slo_attainment == pytest.approx(0.6)
    assert s.by_class["a"].within_slo == 1 and s.by_class["b"].within_slo == 2
    assert summarize(result, SLO(10.0, 1.0)).overall.within_slo == 5
    with pytest.raises(ValueError, match="no SLO for request class"):
        summarize(result, {"a": SLO(1.0, 0.1)})


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [0.3, 5.0, 1.2, 9.9, 2.2, 0.01, 7.7]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_bad_deployments_and_requests_are_refused(cost):
    with pytest.raises(ValueError, match="co-located engines"):
        Deployment(colocated=1, prefill=1, decode=1)
    with pytest.raises(ValueError, match="K must be"):
        SpecSetting(k=-1)
    with pytest.raises(ValueError, match="more KV than a worker holds"):
        simulate([TraceRequest(0.0, 300_000, 10)], Deployment(), cost)
    no_link = RooflineCostModel(get_hardware("cpu-2core"), calc.load_arch("llama-3.2-1b"), weight_bits=4)
    with pytest.raises(ValueError, match="no KV transfer bandwidth"):
        simulate([TraceRequest(0.0, 100, 10)], Deployment(colocated=0, prefill=1, decode=1), no_link)


# ---------------------------------------------------------------------- workload files
GOOD = {"rate": 2.0, "slo": {"ttft": 2.0, "tpot": 0.1},
        "classes": [{"name": "chat", "share": 0.7, "prompt_tokens": [100, 200], "output_tokens": 50,
                     "acceptance": 0.6, "slo": {"ttft": 1.0}},
                    {"name": "long", "share": 0.3, "prompt_tokens": 2000, "output_tokens": 20}]}


def test_workload_parses_with_per_class_slos():
    plan = parse_workload(GOOD)
    assert plan.workload.rate == 2.0
    assert plan.workload.classes[0].prompt_tokens == TokenRange(100, 200)
    assert plan.slos == {"chat": SLO(1.0, 0.1), "long": SLO(2.0, 0.1)}
    assert parse_workload(GOOD, parse_slo("tpot=0.05")).slos["long"] == SLO(2.0, 0.05)  # --slo overrides the file
    assert plan.requests == 240  # two minutes at 2 req/s
    assert parse_workload(_with("rate", "2e0")).workload.rate == 2.0  # YAML 1.1 reads `rate: 2e0` as a string


def _with(path: str, value):
    doc = json.loads(json.dumps(GOOD))
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is KeyError:
        del node[int(last) if last.isdigit() else last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize(("doc", "field"), [
    (_with("classes.0.share", "abc"), "classes[0].share"),
    (_with("classes.1.share", 0.5), "add up to 1"),
    (_with("rate", KeyError), "rate"),
    (_with("rate", -1), "rate"),
    (_with("classes.1.output_tokens", 0), "classes[1].output_tokens"),
    (_with("classes.0.prompt_tokens", [300, 100]), "classes[0].prompt_tokens"),
    (_with("classes.0.acceptance", 1.5), "classes[0].acceptance"),
    (_with("classes.0.draft_share", 0), "classes[0].draft_share"),
    (_with("classes.0.promt_tokens", 5), "promt_tokens"),
    (_with("classes.1.name", "chat"), "used twice"),
    (_with("classes.0.slo", {"ttft": "soon"}), "classes[0].slo.ttft"),
    (_with("slo", {"ttft": 2.0}), "no tpot target"),
    (_with("classes", []), "classes"),
    ([1, 2], "mapping"),
])
def test_workload_errors_name_the_field(doc, field):
    with pytest.raises(WorkloadError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_workload(doc)


def test_slo_flag_errors():
    assert parse_slo("ttft=2.0,tpot=0.1") == {"ttft": 2.0, "tpot": 0.1}
    for bad in ("ttft=soon", "foo=1", "ttft", "", "tpot=-1"):
        with pytest.raises(WorkloadError):
            parse_slo(bad)


def test_workload_file_errors(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rate: [unclosed\n")
    with pytest.raises(WorkloadError, match="not valid YAML: line 2, column 1: expected ',' or ']'") as exc:
        load_workload(bad)
    assert "\n" not in str(exc.value)  # the parser's message spans lines; the error is one


def test_the_example_workload_file_is_valid():
    from pathlib import Path

    plan = load_workload(Path(__file__).resolve().parents[2] / "deploy" / "workloads" / "three-class-70b.yaml")
    assert [c.name for c in plan.workload.classes] == ["chat", "code", "summarize"]
    assert plan.workload.classes[1].acceptance == 0.8


# ---------------------------------------------------------------------- the command line
@pytest.fixture
def workload_file(tmp_path):
    import yaml

    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "requests": 60}))
    return path


def _table(out: str) -> list[list[str]]:
    """The ranked table's rows as cells (columns are two or more spaces apart)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    rows = []
    for line in lines[head + 1:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_plan_cli_on_published_hardware(workload_file, tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc = main(["plan", "--workload", str(workload_file), "--hardware", "h100", "--model", "llama-3-8b",
               "--gpus", "2", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = _table(out)
    # TP1 (2 co-located, 1P:1D) and TP2 (1 co-located); speculation off and at 3 K x 2 thresholds.
    assert len(rows) == 3 * 7
    assert {(r[1], r[2]) for r in rows} == {("2 x TP1", "2 co-located"), ("2 x TP1", "1P:1D"),
                                            ("1 x TP2", "1 co-located")}
    rank, workers, layout, spec, goodput = rows[0][:5]
    assert rank == "1"
    assert all(float(r[4]) <= float(goodput) for r in rows)
    best = next(line for line in out.splitlines() if line.startswith("Best:"))
    assert f"{goodput} req/s within the SLO" in best
    assert ("co-located" in best) == (layout.endswith("co-located"))
    assert png.stat().st_size > 10_000


def test_plan_cli_json_with_a_profile(workload_file, tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(synthetic_profile()))
    rc = main(["plan", "--workload", str(workload_file), "--profile", str(profile), "--gpus", "2",
               "--slo", "ttft=5,tpot=0.5", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    layouts = {r["layout"] for r in data["rows"]}
    assert layouts == {"2 co-located", "1P:1D"}
    goodputs = [r["goodput_req_s"] for r in data["rows"]]
    assert goodputs == sorted(goodputs, reverse=True)
    assert data["slo"]["chat"] == {"ttft_s": 1.0, "tpot_s": 0.5}


@pytest.mark.parametrize(("args", "message"), [
    (["--hardware", "h100"], "--model"),
    ([], "--profile"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--slo", "ttft=x"], "--slo.ttft"),
    (["--hardware", "tpu9", "--model", "llama-3-8b"], "Unknown hardware"),
    (["--profile", "/nonexistent/p.json"], "cannot read the profile"),
    (["--hardware", "h100", "--model", "llama-3-70b", "--gpus", "1"], "does not fit"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--requests", "100000000"], "--requests must be in"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--weight-bits", "0"], "--weight-bits must be in"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--png", "/proc/no-such/plan.png"], "--png /proc/no-such"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--png", "plan.txt"], "must end in one of"),
    (["--hardware", "h100", "--model", "llama-3-8b", "--max-num-seqs", "0"], "must be >= 1"),
])
def test_plan_cli_bad_input_exits_2(workload_file, capsys, args, message):
    assert main(["plan", "--workload", str(workload_file), *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_cli_refuses_an_unreadable_profile_and_a_folder_for_the_png(workload_file, tmp_path, capsys):
    binary = tmp_path / "p.json"
    binary.write_bytes(b"\xff\xfe" + bytes(range(256)))
    assert main(["plan", "--workload", str(workload_file), "--profile", str(binary)]) == 2
    assert "cannot read the profile" in capsys.readouterr().err
    assert main(["plan", "--workload", str(workload_file), "--hardware", "h100", "--model", "llama-3-8b",
                 "--png", str(tmp_path)]) == 2  # checked before the search, nothing written beside it
    captured = capsys.readouterr()
    assert "is a folder" in captured.err and not captured.out and not list(tmp_path.parent.glob(f"{tmp_path.name}.*"))


def test_plan_cli_bad_workload_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rate: 2\nclasses:\n  - {name: a, share: 1.0, prompt_tokens: 10, output_tokens: zero}\n")
    assert main(["plan", "--workload", str(bad), "--hardware", "h100", "--model", "llama-3-8b",
                 "--slo", "ttft=1,tpot=0.1"]) == 2
    err = capsys.readouterr().err
    assert "classes[0].output_tokens" in err and str(bad) in err
    # without an SLO the field's mistake is still what is reported (was: "no ttft target")
    assert main(["plan", "--workload", str(bad), "--hardware", "h100", "--model", "llama-3-8b"]) == 2
    assert "classes[0].output_tokens" in capsys.readouterr().err
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    assert main(["plan", "--workload", str(binary), "--hardware", "h100", "--model", "llama-3-8b"]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    huge = tmp_path / "huge.yaml"
    huge.write_text("rate: 2\nrequests: 100000000\nclasses:\n  - {name: a, share: 1.0, prompt_tokens: 10, output_tokens: 5}\n")
    assert main(["plan", "--workload", str(huge), "--hardware", "h100", "--model", "llama-3-8b",
                 "--slo", "ttft=1,tpot=0.1"]) == 2
    assert "requests must be a whole number in" in capsys.readouterr().err


# ---------------------------------------------------------------------- a real profile
@pytest.mark.slow
def test_profile_smollm2_round_trips(tmp_path, capsys):
    out = tmp_path / "smol.json"
    rc = main(["profile", "--model", "smollm2-135m-instruct", "--spec-method", "ngram", "--out", str(out),
               "--batches", "1", "4", "--contexts", "64", "--repeats", "1", "--max-num-batched-tokens", "64",
               "--max-model-len", "2048", "--threads", "1"])
    assert rc == 0
    profile = json.loads(out.read_text())
    model = MeasuredCostModel.from_profile(profile)
    # SmolLM2-135M, float16 KV (the native kernels' default)
    assert profile["model"]["kv_cache_dtype"] == "fp16"
    assert profile["model"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert profile["drafter"]["cost"] == "flat"
    assert len(profile["drafter"]["verify_step_s"]) == len(profile["drafter"]["batches"])  # drafting steps timed
    assert model.spec_verify_s(1) > 0
    assert model.link_gb_s > 0 and model.max_num_batched_tokens == 64
    assert 0 < model.step_s(StepShape(1, 1, 64, 64)) < model.step_s(StepShape(prefill=((64, 0),))) * 10
    assert math.isfinite(model.step_s(StepShape(4, 12, 256, 64, ((30, 100),))))
    assert 0 < profile["served"]["ttft_s"] < 5 and profile["served"]["prompt_tokens"] > 10
    assert MeasuredCostModel.from_profile(profile, served=True, http=True).request_overhead_s >= 0
    for front in ("served", "in_process"):  # every lone request kept, the median among them
        lone = profile[front]["lone"]
        assert len(lone) >= 10 and all(0 < x["ttft_s"] < 5 and x["prompt_tokens"] > 5 for x in lone)
        assert profile[front]["ttft_s"] in [x["ttft_s"] for x in lone]
        # each after one of the idle times in turn, five of each
        assert sorted(x["idle_s"] for x in lone if x["idle_s"] is not None) == sorted(LONE_GAPS_S * 5)
    inproc = MeasuredCostModel.from_profile(profile, served=True, in_process=True)
    assert 0 <= inproc.request_overhead_s < profile["in_process"]["ttft_s"]
    co = profile["co_run"]
    if len(os.sched_getaffinity(0)) >= 2:  # a second one-thread worker fits beside this one
        assert co["threads"] == 1 and co["decode_batch"] == 4 and co["prefill_chunk"] == 64
        for role in ("decode", "prefill"):
            assert co[f"{role}_alone_s"] > 0 and co[f"{role}_beside_s"] > 0
            assert model.co_run_slowdown(role) == co["slowdown"][role] >= 1.0
    else:
        assert co is None and model.co_run_slowdown("decode") == 1.0


def test_machine_info_records_the_kernels_start_up_choices(monkeypatch):
    """Results name what the kernels chose at start-up in that process (prefetch distance, 512-bit
    pass width) and, where the CPU has AMX, from how many rows Q4_K passes take the tiles, since
    all move the figures; nothing is recorded before a model tuned them."""
    import specserve.kernels as kmod
    from specserve.ops.profile import machine_info

    monkeypatch.setattr(kmod, "_prefetch_tuned", {})
    monkeypatch.setattr(kmod, "_wide_tuned", {})
    assert "kernel_tuning" not in machine_info()
    monkeypatch.setattr(kmod, "_wide_tuned", {"min_rows": 5, "ratio": {4: 1.01, 5: 1.3}})
    amx = kmod.kernels().amx_min_rows()
    info = machine_info()
    assert info["kernel_tuning"] == {"wide_passes": {"min_rows": 5, "ratio": {4: 1.01, 5: 1.3}},
                                     **({"amx_passes": {"min_rows": amx}} if amx else {})}
    monkeypatch.setattr(kmod, "kernels", lambda: type("NoAmx", (), {"amx_min_rows": staticmethod(lambda: 0)})())
    assert machine_info()["kernel_tuning"] == {"wide_passes": {"min_rows": 5, "ratio": {4: 1.01, 5: 1.3}}}
