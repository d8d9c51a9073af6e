"""Per-request-class metrics: acceptance and effective tokens/s vs the plain baseline, by `request_class`."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.server.metrics import (
    MAX_REQUEST_CLASSES,
    OTHER_REQUEST_CLASS,
    PlainBaseline,
    RequestClasses,
    ServerMetrics,
)
from specserve.spec.policy import StepTimer

from .conftest import serve


def samples(text: str) -> dict[str, dict[str, float]]:
    """Sample name -> {request_class: value} for the series that carry a request_class label."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "request_class" in s.labels:
                out.setdefault(s.name, {})[s.labels["request_class"]] = s.value
    return out


# ---------------------------------------------------------------------- units
def test_request_classes_cap_their_labels():
    classes = RequestClasses(max_classes=MAX_REQUEST_CLASSES)
    labels = {classes.label(f"tenant-{i}") for i in range(100)} | {classes.label(None)}
    assert len(labels) == MAX_REQUEST_CLASSES and OTHER_REQUEST_CLASS in labels
    assert classes.label("tenant-0") == "tenant-0"  # early classes keep their series
    assert classes.label(None) == "default"
    classes.tag(["a", "b"], "tenant-1")
    assert classes.pop("a") == "tenant-1" and classes.pop("never-tagged") == "default"
    small = RequestClasses(max_tagged=3)
    small.tag([str(i) for i in range(10)], "x")
    assert len(small._by_request) == 3  # tags of requests that never finish do not pile up


def test_plain_baseline_uses_the_batch_the_request_decoded_at():
    timer = StepTimer({1: 0.010, 2: 0.012, 4: 0.020})
    base = PlainBaseline()
    base.observe(100.0, 2, timer)
    base.observe(101.0, 4, timer)  # batch 2 over [100, 101], then 4
    assert base.step_seconds(100.0, 101.0) == pytest.approx(timer(2))
    assert base.step_seconds(100.5, 102.0) == pytest.approx(timer((0.5 * 2 + 1.0 * 4) / 1.5))
    assert PlainBaseline().step_seconds(0.0, 1.0) is None  # no engine step seen
    unmeasured = PlainBaseline()
    unmeasured.observe(100.0, 1, StepTimer({64: 0.1}))  # only a prompt chunk timed: no baseline
    assert unmeasured.step_seconds(100.0, 101.0) is None


def finished(
    request_id: str, tokens: int, tpot_s: float, drafted: int, accepted: int
) -> RequestOutput:
    metrics = RequestMetrics(
        ttft_s=0.05,
        tpot_s=tpot_s,
        e2e_s=0.05 + tpot_s * (tokens - 1),
        num_generated_tokens=tokens,
        extra={"num_draft_tokens": drafted, "num_accepted_tokens": accepted},
    )
    return RequestOutput(
        request_id, "p", [1], [CompletionOutput(0, "t", [2] * tokens, "length")], True, metrics
    )


def test_on_finished_exports_acceptance_rate_and_speedup_by_class():
    import time

    m = ServerMetrics("m")
    now = time.perf_counter()
    m.baseline.observe(now - 5.0, 1, StepTimer({1: 0.020}))  # batch 1, plain step 20 ms
    m.tag_requests(["r1"], "chat")
    m.tag_requests(["r2"], "batch")
    m.on_finished(
        finished("r1", 11, 0.010, drafted=20, accepted=15)
    )  # 100 tok/s, twice the plain rate
    m.on_finished(finished("r2", 11, 0.020, drafted=0, accepted=0))
    got = samples(m.render().decode())
    assert got["specserve_request_draft_tokens_total"] == {"chat": 20.0, "batch": 0.0}
    assert got["specserve_request_accepted_tokens_total"] == {"chat": 15.0, "batch": 0.0}
    assert got["specserve_acceptance_rate"] == {"chat": 0.75}  # no drafts, no rate for "batch"
    assert got["specserve_effective_tokens_per_second"] == pytest.approx(
        {"chat": 100.0, "batch": 50.0}
    )
    assert got["specserve_effective_speedup"] == pytest.approx({"chat": 2.0, "batch": 1.0})


def test_no_baseline_no_speedup_series():
    m = ServerMetrics("m")  # no engine step seen (e.g. the disaggregated router)
    m.on_finished(finished("r1", 5, 0.01, drafted=4, accepted=2))
    got = samples(m.render().decode())
    assert "specserve_effective_speedup" not in got
    assert got["specserve_acceptance_rate"] == {"default": 0.5}


# ---------------------------------------------------------------------- live server
@pytest.fixture(scope="module")
def spec_server(smollm_checkpoint):
    """SmolLM2 drafting with n-grams on every step, its plain one-token step timed (the baseline)."""
    from specserve import LLM

    llm = LLM(
        "smollm2",
        dtype="float32",
        checkpoint=smollm_checkpoint,
        kv_cache_gib=0.25,
        max_num_seqs=4,
        spec_method="ngram",
        spec_policy="always",
        num_spec_tokens=4,
    )
    # The baseline needs a timed one-token step; profile_costs would time ~20 step sizes.
    llm.engine.policy.target_time.observe(1, llm.engine.runner.time_decode_step(1, repeats=1))
    with serve(llm, "smollm2") as live:
        yield live


def test_live_server_labels_series_by_request_class(spec_server):
    url = spec_server.base_url
    prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"
    with httpx.Client(timeout=120) as http:
        for cls in ("interactive", "batch.v2"):
            for _ in range(2):
                r = http.post(
                    f"{url}/v1/completions",
                    json={
                        "model": "smollm2",
                        "prompt": prompt,
                        "max_tokens": 12,
                        "temperature": 0,
                        "ignore_eos": True,
                        "request_class": cls,
                    },
                )
                assert r.status_code == 200, r.text
        r = http.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Count to five."}],
                "max_tokens": 6,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        spec_server.wait_idle()
        got = samples(http.get(f"{url}/metrics").text)
    classes = {"interactive", "batch.v2", "default"}  # no request_class: "default"
    for name in (
        "specserve_request_draft_tokens_total",
        "specserve_request_accepted_tokens_total",
        "specserve_effective_tokens_per_second",
        "specserve_effective_speedup",
    ):
        assert set(got[name]) == classes, name
    # The repeating prompt gives the n-gram proposer drafts, most of them accepted.
    for cls in ("interactive", "batch.v2"):
        assert got["specserve_request_draft_tokens_total"][cls] > 0
        assert 0.0 < got["specserve_acceptance_rate"][cls] <= 1.0
    assert all(v > 0 for v in got["specserve_effective_tokens_per_second"].values())
    assert all(v > 0 for v in got["specserve_effective_speedup"].values())


@pytest.mark.parametrize("bad", ["has space", "x" * 65, "", "semi;colon", 7])
def test_invalid_request_class_is_a_400(spec_server, bad):
    r = httpx.post(
        f"{spec_server.base_url}/v1/completions",
        timeout=60,
        json={
            "model": "smollm2",
            "prompt": "Hi",
            "max_tokens": 2,
            "request_class": bad,
        },
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "request_class" and "request_class" in err["message"]
