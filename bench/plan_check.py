"""The planner's simulator against measurement: replay benchmark traces, compare TTFT and TPOT p50.

Each point of bench/serve.py (a workload at a rate, speculation adaptive or off) and each run of
bench/disagg.py (co-located or disaggregated, per request kind) saved its requests: when each
arrived, its prompt and output tokens, and for speculation the server's draft counters. This
replays every trace through `specserve.ops.simulate` with the step costs of a profile of the
same machine (`specserve profile`), and writes measured vs predicted TTFT p50 and TPOT p50 and
their ratio (the acceptance bar: within 20%).

    specserve profile --model smollm2-135m-instruct --spec-method ngram --out bench/results/profile.json
    specserve profile --model smollm2-135m-instruct --threads 1 --out bench/results/profile-1thread.json
    python bench/plan_check.py --profile bench/results/profile.json \
        --worker-profile bench/results/profile-1thread.json \
        --results bench/results/serve.json bench/results/disagg.json
    python bench/plan_check.py --recordings all     # every stored recording, one line each and the total

--worker-profile: disaggregated workers run one thread each in bench/disagg.py (default: --profile);
its `co_run` (recorded where a second one-thread worker fits) is how much the prefill and decode
workers slow each other down on this machine's two cores.
Speculation: verify steps D, draft tokens verified T and accepted tokens A give K = round(T / D)
drafts per verify step, the per-token acceptance b with 1 + A / D = (1 - b^(K+1)) / (1 - b) (the
tokens a verify step yields), and the draft share D / S of the decode steps S (output tokens
after the first, less A): prompt lookup drafts only where its text matches. Each request's own counters
(the server's `usage.speculation`) give its own K and b where the trace has them: with the
server's store of earlier outputs a repeated ask copies its whole answer in long drafts while a
new one drafts little, and one (K, b) for the whole point puts every request in between. Traces
recorded before the server reported them fall back to the point's counters (/metrics).

Each prediction also comes with a band: the same trace simulated on a machine --drift faster and
slower. A shared VM's speed moves by about that much between a profile and a benchmark run
minutes later; a miss whose measurement lies inside the band is a statistic that sensitive to
the machine's speed (a p50 that falls between two clusters of requests: those whose short
decodes a long prefill interrupted and those it did not), which the table and the PNG show.

Writes bench/results/plan_check.json and plan_check.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

from specserve.ops.calc import acceptance_for  # noqa: E402
from specserve.ops.costmodel import CostModel, MeasuredCostModel, ScaledCostModel  # noqa: E402
from specserve.ops.simulate import (  # noqa: E402
    SLO,
    Deployment,
    RequestResult,
    SimResult,
    SpecSetting,
    TraceRequest,
    simulate,
    summarize,
)

TOLERANCE = 0.2
NO_SLO = SLO(float("inf"), float("inf"))
DRIFT = 0.1
SERVE_MAX_NUM_SEQS = 64  # bench/serve.py starts the server with --max-num-seqs 64


def speculation(counters: dict[str, float] | None, output_tokens: int) -> tuple[int, float, float]:
    """(K, per-token acceptance, draft share) that reproduce drafts per verify step, tokens per
    verify step and how many decode steps verified drafts.

    A proposer that drafts in only some steps (prompt lookup, where its text matches) is not a
    proposer that drafts every step with less acceptance: a request copying an earlier answer
    verifies ten long drafts and takes every other step plainly. K = round(T / D) drafts per
    verify step, the acceptance b from the tokens a verify step keeps (1 + A / D =
    (1 - b^(K+1)) / (1 - b)), and the share D / S of the decode steps S (output tokens after
    the first, less A) that verified drafts."""
    if not counters or counters.get("drafts", 0) <= 0:
        return 0, 0.0, 1.0
    accepted, drafts = counters["accepted_tokens"], counters["drafts"]
    k = max(1, round(counters["draft_tokens"] / drafts))
    alpha = min(1 + accepted / drafts, k + 1 - 1e-9)
    steps = max(output_tokens - accepted, 1.0)
    return k, acceptance_for(alpha, k) if alpha > 1 else 0.0, min(1.0, drafts / steps)


def request_speculation(spec: dict[str, int] | None, output_tokens: int) -> tuple[int, float, float]:
    """(K, per-token acceptance, draft share) of one request from its usage.speculation counters
    (0, 0, 1 when it verified no draft)."""
    return speculation({**spec, "drafts": spec["verify_steps"]}, max(output_tokens - 1, 0)) if spec \
        else (0, 0.0, 1.0)


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured if predicted is not None and measured else None


def _row(source: str, label: str, kind: str, measured: dict[str, float | None], predicted: Any,
         band: tuple[Any, Any], deployment: Deployment, n: int) -> dict[str, Any]:
    """One comparison; `band` holds the predictions on a machine `drift` faster and slower."""
    out: dict[str, Any] = {"source": source, "point": label, "kind": kind, "requests": n,
                           "deployment": deployment.label, "speculation": deployment.spec.label}
    for key in ("ttft_p50", "tpot_p50"):
        pred = getattr(predicted, key)
        edges = [getattr(b, key) for b in band]
        out[key] = {"measured": measured[key], "predicted": pred, "ratio": _ratio(pred, measured[key]),
                    "band": None if None in edges else [min(edges), max(edges)]}
    return out


def _predict(trace: list[TraceRequest], dep: Deployment, cost: CostModel, seed: int,
             drift: float) -> tuple[SimResult, list[Any]]:
    """The trace simulated on the profiled machine, and summaries of that run and of one on a
    machine `drift` faster and one `drift` slower (every step time scaled: a shared VM runs that
    much faster or slower from one run to the next, so a profile and a benchmark recorded
    minutes apart differ by that much)."""
    runs = [simulate(trace, dep, c, seed=seed)
            for c in (cost, ScaledCostModel(cost, 1 - drift), ScaledCostModel(cost, 1 + drift))]
    return runs[0], [summarize(r, NO_SLO) for r in runs]


def _request_errors(measured: list[tuple[float | None, float | None]],
                    simulated: Sequence[RequestResult]) -> dict[str, list[float]]:
    """log(predicted / measured) of each request's TTFT and TPOT (those both sides have).

    A p50 between two clusters of requests (decodes a prefill interrupted and those it did not;
    repeats copying their answers and new asks) jumps when one request changes sides; these say
    how close the model comes request by request."""
    out: dict[str, list[float]] = {"ttft": [], "tpot": []}
    for (ttft, tpot), r in zip(measured, simulated):
        for key, m, p in (("ttft", ttft, r.ttft_s), ("tpot", tpot, r.tpot_s)):
            if m and p and m > 0 and p > 0:
                out[key].append(math.log(p / m))
    return out


def check_serve(payload: dict[str, Any], cost: MeasuredCostModel, seed: int, drift: float) -> list[dict[str, Any]]:
    """One row per bench/serve.py point: one co-located server, the point's requests replayed."""
    rows = []
    for p in payload["points"]:
        reqs = [r for r in p.get("requests", []) if r.get("ok")]
        if not reqs or "arrival_s" not in reqs[0]:
            raise SystemExit("the serve results hold no request traces: rerun bench/serve.py (it saves them now).")
        decoded = sum(max(r["tokens"] - 1, 0) for r in reqs)
        k, a, f = speculation(p.get("spec_counters"), decoded) if p["speculation"] == "adaptive" else (0, 0.0, 1.0)
        label = f"{p['workload']} {p['rate']:g} req/s, spec {p['speculation']}"
        trace = [TraceRequest(r["arrival_s"], r["prompt_tokens"], max(r["tokens"], 1), label, a,
                              r.get("cached_tokens", 0), draft_share=f) for r in reqs]
        if k and all("speculation" in r for r in reqs):  # each request's own drafts and acceptance
            own = [request_speculation(r["speculation"], r["tokens"]) for r in reqs]
            trace = [t._replace(acceptance=b, spec_k=kr, draft_share=fr) for t, (kr, b, fr) in zip(trace, own)]
        dep = Deployment(max_num_batched_tokens=cost.max_num_batched_tokens, max_num_seqs=SERVE_MAX_NUM_SEQS,
                         spec=SpecSetting(k))
        sim, summaries = _predict(trace, dep, cost, seed, drift)
        pred, faster, slower = (s.overall for s in summaries)
        rows.append(_row("serve", label, "all", {"ttft_p50": p["ttft_p50"], "tpot_p50": p["tpot_p50"]}, pred,
                         (faster, slower), dep, len(trace)))
        rows[-1]["request_log_errors"] = _request_errors([(r.get("ttft"), r.get("tpot")) for r in reqs], sim.requests)
    return rows


def check_disagg(payload: dict[str, Any], cost: CostModel, worker_cost: CostModel, seed: int,
                 drift: float) -> list[dict[str, Any]]:
    """Rows per bench/disagg.py run and request kind: co-located (one engine) or 1 prefill + 1 decode worker."""
    chunk = payload["settings"]["chunk"]
    rows = []
    for config, by_workload in payload["runs"].items():
        disagg = config == "disaggregated"
        dep = Deployment(colocated=0, prefill=1, decode=1, max_num_batched_tokens=chunk) if disagg else \
            Deployment(max_num_batched_tokens=chunk)
        for workload, run in by_workload.items():
            reqs = [r for r in run["requests"] if not r.get("error") and r["tokens"]]
            if not reqs or "arrival_s" not in reqs[0]:
                raise SystemExit("the disagg results hold no arrival times: rerun bench/disagg.py (it saves them now).")
            trace = [TraceRequest(r["arrival_s"], r["prompt_tokens"], r["tokens"], r["kind"]) for r in reqs]
            result, (sim, faster, slower) = _predict(trace, dep, worker_cost if disagg else cost, seed, drift)
            for kind, pred in sim.by_class.items():
                m = run["summary"][kind]
                rows.append(_row("disagg", f"{config} {workload}", kind,
                                 {"ttft_p50": m["ttft_p50_s"], "tpot_p50": m["tpot_p50_s"]}, pred,
                                 (faster.by_class[kind], slower.by_class[kind]), dep, pred.requests))
                mine = [(r, x) for r, x in zip(reqs, result.requests) if r["kind"] == kind]
                rows[-1]["request_log_errors"] = _request_errors([(r.get("ttft_s"), r.get("tpot_s")) for r, _ in mine],
                                                                 [x for _, x in mine])
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str, drift: float) -> None:
    """Predicted against measured TTFT p50 and TPOT p50, with the 20% band and each prediction's
    drift band as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, key, unit in ((axes[0], "ttft_p50", "s"), (axes[1], "tpot_p50", "s")):
        pts = [(r[key]["measured"], r[key]["predicted"], r) for r in rows
               if r[key]["measured"] and r[key]["predicted"]]
        if not pts:
            continue
        lo = min(min(m, p) for m, p, _ in pts) * 0.7
        hi = max(max(m, p) for m, p, _ in pts) * 1.4
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * (1 - TOLERANCE), hi * (1 - TOLERANCE)],
                        [lo * (1 + TOLERANCE), hi * (1 + TOLERANCE)], color="green", alpha=0.12, label="within 20%")
        for source, marker in (("serve", "o"), ("disagg", "s")):
            sel = [(m, p, r[key]["band"] or [p, p]) for m, p, r in pts if r["source"] == source]
            if sel:
                ax.errorbar([m for m, _, _ in sel], [p for _, p, _ in sel], fmt=marker, capsize=2, elinewidth=0.8,
                            yerr=[[max(0.0, p - b[0]) for _, p, b in sel], [max(0.0, b[1] - p) for _, p, b in sel]],
                            label=f"bench/{source}.py (bar: machine {drift:.0%} faster / slower)")
        for m, p, r in pts:
            ax.annotate(f"{r['point']} / {r['kind']}", (m, p), fontsize=6, alpha=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {key.replace('_', ' ')} ({unit})")
        ax.set_ylabel(f"simulated {key.replace('_', ' ')} ({unit})")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="profile JSON of this machine (specserve profile)")
    ap.add_argument("--worker-profile", default=None,
                    help="profile for bench/disagg.py's one-thread workers (default: --profile)")
    ap.add_argument("--results", nargs="+", help="bench/serve.py and/or bench/disagg.py JSON")
    ap.add_argument("--recordings", nargs="+", default=None, metavar="NAME",
                    help="instead: replay stored recordings (bench/results/profile_NAME.json, profile_NAME-1thread.json, "
                         "serve_NAME.json, disagg_NAME.json), or `all` of them, and print each one's count and the "
                         "total: how a change to the simulator or the cost model moves every recording at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift", type=float, default=DRIFT,
                    help="also predict on a machine this fraction faster and slower (default %(default)s: what two "
                         "profiles of the 2-vCPU dev VM recorded 12 minutes apart differed by, median of their tables)")
    ap.add_argument("--out", default="plan_check")
    args = ap.parse_args()
    if args.recordings:
        return check_recordings(args.recordings, args.seed, args.drift, args.out)
    if not args.profile or not args.results:
        ap.error("give --profile and --results (or --recordings).")
    rows = replay(args.profile, args.worker_profile, args.results, args.seed, args.drift)
    within, checks, in_band, per_request = tally(rows)
    print(f"{'source':7} {'point':36} {'kind':7} {'TTFT p50 meas/pred s':>22} {'ratio':>6} {'band':>10} "
          f"{'TPOT p50 meas/pred ms':>22} {'ratio':>6} {'band':>10}")

    def pair(r: dict[str, Any], key: str, scale: float) -> str:
        m, p = r[key]["measured"], r[key]["predicted"]
        return "-" if m is None or p is None else f"{m * scale:.3g} / {p * scale:.3g}"

    def ratio(r: dict[str, Any], key: str) -> str:
        x = r[key]["ratio"]
        return "-" if x is None else f"{x:.2f}"

    def band(r: dict[str, Any], key: str) -> str:
        b, m = r[key]["band"], r[key]["measured"]
        return "-" if not b or not m else f"{b[0] / m:.2f}-{b[1] / m:.2f}"

    for r in rows:
        print(f"{r['source']:7} {r['point']:36} {r['kind']:7} {pair(r, 'ttft_p50', 1):>22} {ratio(r, 'ttft_p50'):>6} "
              f"{band(r, 'ttft_p50'):>10} {pair(r, 'tpot_p50', 1e3):>22} {ratio(r, 'tpot_p50'):>6} "
              f"{band(r, 'tpot_p50'):>10}")
    print(f"{within} of {checks} predictions within {TOLERANCE:.0%} of the measurement; band: predicted/measured "
          f"on a machine {args.drift:.0%} faster and slower, {in_band} of the {checks - within} misses inside it")
    for key, q in per_request.items():
        print(f"request by request, {key.upper()}: predicted/measured median {math.exp(q['median_log_ratio']):.2f}, "
              f"median error {math.exp(q['median_abs_log_ratio']) - 1:.0%}, {q['within_tolerance']:.0%} of "
              f"{q['requests']} requests within {TOLERANCE:.0%}")
    payload = {"benchmark": "planner simulator vs measurement", "machine": machine_info(),
               "profile": args.profile, "worker_profile": args.worker_profile, "results": args.results,
               "tolerance": TOLERANCE, "drift": args.drift, "within_tolerance": within, "predictions": checks,
               "misses_inside_drift_band": in_band, "per_request": per_request, "rows": rows}
    out = write_json(f"{args.out}.json", payload)
    plot(rows, RESULTS_DIR / f"{args.out}.png",
         f"simulator ({Path(args.profile).name}) vs bench measurements: {within}/{checks} within 20%", args.drift)
    print(f"wrote {out}")
    return 0


def replay(profile_path: str | Path, worker_profile_path: str | Path | None, results: Sequence[str | Path],
           seed: int, drift: float) -> list[dict[str, Any]]:
    """The rows of one recording: every serve.py point and disagg.py run replayed on its profiles."""
    profile = json.loads(Path(profile_path).read_text())
    worker_profile = json.loads(Path(worker_profile_path).read_text()) if worker_profile_path else profile
    # Every engine here streams its outputs to consumers on the same machine: HTTP clients
    # (bench/serve.py), the in-process driver (bench/disagg.py co-located) or the router polling a
    # worker (disaggregated): steps pay the overhead measured behind the server, not the bare
    # engine's. Requests pay their front end's time: HTTP, in-process (AsyncEngine) or the
    # router's calls, each drawn from the lone requests the profile timed that way. Disaggregated
    # workers also slow each other down (the profile's co_run).
    served = MeasuredCostModel.from_profile(profile, served=True, in_process=True)
    http = MeasuredCostModel.from_profile(profile, served=True, http=True)  # bench/serve.py's clients use HTTP
    worker = MeasuredCostModel.from_profile(worker_profile, served=True)
    rows: list[dict[str, Any]] = []
    for path in results:
        payload = json.loads(Path(path).read_text())
        rows += check_serve(payload, http, seed, drift) if "points" in payload else \
            check_disagg(payload, served, worker, seed, drift)
    return rows


def tally(rows: list[dict[str, Any]]) -> tuple[int, int, int, dict[str, Any]]:
    """(p50s within the tolerance, p50s compared, misses inside their drift band, per-request errors)."""
    checks = [r[k] for r in rows for k in ("ttft_p50", "tpot_p50") if r[k]["ratio"] is not None]
    within = sum(1 for c in checks if abs(c["ratio"] - 1) <= TOLERANCE)
    # A miss whose measurement lies inside the band: the prediction is that sensitive to the
    # machine's speed (a p50 between two clusters of requests, say), not wrong about the engine.
    in_band = sum(1 for c in checks if abs(c["ratio"] - 1) > TOLERANCE and c["band"]
                  and c["band"][0] <= c["measured"] <= c["band"][1])
    per_request = {}
    for key in ("ttft", "tpot"):
        errs = [e for r in rows for e in r["request_log_errors"][key]]
        if errs:
            per_request[key] = {"requests": len(errs), "median_log_ratio": statistics.median(errs),
                                "median_abs_log_ratio": statistics.median(abs(e) for e in errs),
                                "within_tolerance": sum(abs(math.exp(e) - 1) <= TOLERANCE for e in errs) / len(errs)}
    return within, len(checks), in_band, per_request


def check_recordings(names: Sequence[str], seed: int, drift: float, out: str) -> int:
    """Replay stored recordings (`all`: every profile_NAME.json with a serve_ or disagg_NAME.json
    beside it) and print one line each and the total."""
    if list(names) == ["all"]:
        stored = (p.stem.removeprefix("profile_") for p in RESULTS_DIR.glob("profile_*.json"))
        names = sorted(n for n in stored if not n.endswith("-1thread")
                       and any((RESULTS_DIR / f"{kind}_{n}.json").exists() for kind in ("serve", "disagg")))
    summary, total, compared = [], 0, 0
    for name in names:
        profile = RESULTS_DIR / f"profile_{name}.json"
        worker = RESULTS_DIR / f"profile_{name}-1thread.json"
        results = [RESULTS_DIR / f"{kind}_{name}.json" for kind in ("serve", "disagg")]
        results = [r for r in results if r.exists()]
        if not profile.exists() or not results:
            raise SystemExit(f"recording {name!r}: bench/results holds no profile_{name}.json or no serve_/disagg_{name}.json.")
        within, checks, _, per_request = tally(replay(profile, worker if worker.exists() else None, results, seed, drift))
        total, compared = total + within, compared + checks
        req = {k: round(q["within_tolerance"], 3) for k, q in per_request.items()}
        summary.append({"recording": name, "within_tolerance": within, "predictions": checks, "requests_within": req})
        print(f"{name:14} {within:3d} of {checks:3d} p50s within {TOLERANCE:.0%}; requests within: "
              + ", ".join(f"{k.upper()} {v:.0%}" for k, v in req.items()))
    print(f"total: {total} of {compared} p50s within {TOLERANCE:.0%} over {len(names)} recordings")
    path = write_json(f"{out}.json", {"benchmark": "planner simulator vs stored recordings", "machine": machine_info(),
                                      "tolerance": TOLERANCE, "drift": drift, "within_tolerance": total,
                                      "predictions": compared, "recordings": summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
