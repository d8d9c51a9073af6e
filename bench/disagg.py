"""Disaggregated prefill/decode vs the co-located engine on this machine, one run.

Co-located: one engine on both cores; long prompts are prefilled in chunks mixed into the
same steps as everyone's decoding. Disaggregated: one prefill worker pinned to core 0 and one
decode worker pinned to core 1 (Ray actors), KV streamed layer by layer through shared memory.

Two workloads, open loop (arrivals at fixed times whatever the progress), greedy, streaming:
- `mixed`: long-decode requests (short prompt, --decode-tokens answer) are running when long
  prompts (~2.1-2.4k tokens, --long-output-token answers, 16 by default) arrive every --interval seconds
  (every other decode arrives 0.25 s before a long prompt, the rest half an interval later);
- `decode-only`: the same decodes without the long prompts.

Per configuration and workload: TTFT p50/p99 by request kind, TPOT (per-request mean) and
inter-token gaps p50/p99 of the decodes, goodput under an SLO, output tokens/s; for the
disaggregated runs the KV transfer bytes, send/load time, the time left exposed after the
prefill finished, and the fraction of the load hidden by layer streaming.

    python bench/disagg.py                   # SmolLM2-135M, ~10 min
    python bench/disagg.py --long 2 --decode 2 --decode-tokens 48 --workloads mixed   # ~3 min

With --draft MODEL every engine speculates with that draft model, and the disaggregated
deployment runs twice: the prefill worker computing and sending the draft's prompt KV, and
(`disaggregated, draft recomputes`) the decode worker's draft recomputing it on its first
proposal, which stalls every request of that step. The stall shows in the decodes' longest
inter-token gap and in each long prompt's first gap after its first token.

Writes bench/results/disagg.json and disagg.png.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT  # noqa: E402

from specserve import SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOPICS = ["the ocean", "volcanoes", "tea", "compilers", "bees", "the moon", "jazz", "chess", "glaciers", "bread"]


def log(msg: str) -> None:
    print(msg, flush=True)


def long_prompt(i: int, tokenizer: Any, target_tokens: int) -> str:
    """A distinct ~target_tokens prompt (distinct from its first line, so no shared prefix)."""
    parts = [f"Document {i} ({TOPICS[i % len(TOPICS)]}), numbered sections follow.\n"]
    j = 0
    while len(tokenizer.encode("".join(parts))) < target_tokens:
        src = CODING[(i + j) % len(CODING)] if j % 2 else EDIT[(i + j) % len(EDIT)][1]
        parts.append(f"\nSection {i}.{j}:\n{src}\n")
        j += 1
    return "".join(parts) + "\nSummarize the document above in one sentence."


def code_prompt(i: int, tokenizer: Any, target_tokens: int) -> str:
    """The first ~target_tokens of the i-th sizeable module of this Python's standard library: a
    prompt to continue, whose identifiers the continuation reuses (where a drafter that has the
    prompt in view can guess them)."""
    import sysconfig

    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 40_000)
    text = files[i % len(files)].read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text)[:target_tokens]
    return tokenizer.decode(ids)


DECODE_LEAD_S = 0.25  # mixed workload: how long before a long prompt a decode request arrives


def workload(kind: str, args: argparse.Namespace, tokenizer: Any, warm_up: bool = False) -> list[dict[str, Any]]:
    """Requests with arrival offsets (s), prompts and parameters (warm-up: other prompts, so the
    measured run finds nothing of them in any prefix cache)."""
    if warm_up:
        return [{"kind": "decode", "at": 0.0, "prompt": "Warm-up: say something about the weather.",
                 "params": SamplingParams(max_tokens=8, temperature=0.0)},
                {"kind": "long", "at": 0.1, "prompt": long_prompt(99, tokenizer, 600),
                 "params": SamplingParams(max_tokens=4, temperature=0.0)}]
    reqs = []
    # Mixed: every other decode starts DECODE_LEAD_S before a long prompt, so it is still running
    # when the prompt arrives on any machine (160 tokens take >= 0.3 s even at 2 ms a token); with
    # 0.75 s, a 2-vCPU Zen 5's decodes ended just as the prompts came, and whether they overlapped
    # at all came down to a few milliseconds.
    for i in range(args.decode):
        reqs.append({"kind": "decode", "at": 1.0 - DECODE_LEAD_S + args.interval / 2 * i if kind == "mixed" else 0.25 * i,
                     "prompt": f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}.",
                     "params": SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)})
    if kind == "mixed":
        for i in range(args.long):
            reqs.append({"kind": "long", "at": 1.0 + args.interval * i,
                         "prompt": (code_prompt(i + 1, tokenizer, args.long_tokens + 40 * i) if args.long_kind == "code"
                                    else long_prompt(i, tokenizer, args.long_tokens + 40 * i)),
                         "params": SamplingParams(max_tokens=args.long_output, temperature=0.0, ignore_eos=True)})
    return sorted(reqs, key=lambda r: r["at"])


async def drive(ae: Any, frontend: Any, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Submit each request at its arrival time; record token timestamps as they stream."""
    t0 = time.perf_counter()

    async def one(r: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
        arrival = time.perf_counter()
        p = frontend.prepare_request(r["prompt"], r["params"], arrival_time=arrival)
        stream = ae.submit([p])
        stamps: list[float] = []
        ids: list[int] = []
        error = None
        extra: dict[str, Any] = {}
        async for _, out in stream:
            now = time.perf_counter()
            stamps += [now] * len(out.outputs[0].delta_token_ids)
            ids += out.outputs[0].delta_token_ids
            error = error or out.error
            if out.finished and out.metrics is not None:
                extra = out.metrics.extra or {}
        gaps = list(np.diff(stamps)) if len(stamps) > 1 else []
        return {"kind": r["kind"], "arrival_s": arrival - t0, "prompt_tokens": p.request.num_prompt_tokens,
                "tokens": len(stamps), "token_ids": ids,
                "ttft_s": stamps[0] - arrival if stamps else None,
                "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
                "gaps_s": gaps, "e2e_s": (stamps[-1] if stamps else time.perf_counter()) - arrival,
                "draft_tokens": extra.get("num_draft_tokens", 0), "accepted_tokens": extra.get("num_accepted_tokens", 0),
                "error": error}

    return list(await asyncio.gather(*(one(r) for r in reqs)))


def pct(xs: list[float], q: float) -> float | None:
    """Percentile, None for no data."""
    return float(np.percentile(xs, q)) if xs else None


def summarize(results: list[dict[str, Any]], wall_s: float, slo: dict[str, float]) -> dict[str, Any]:
    """Latency percentiles, goodput and throughput of one run."""
    out: dict[str, Any] = {"wall_s": wall_s, "errors": sum(1 for r in results if r["error"])}
    firsts = [r["gaps_s"][0] for r in results if r["kind"] == "long" and r["gaps_s"]]
    for kind in ("decode", "long"):
        rs = [r for r in results if r["kind"] == kind]
        if not rs:
            continue
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        tpot = [r["tpot_s"] for r in rs if r["tpot_s"] is not None]
        gaps = [g for r in rs for g in r["gaps_s"]]
        ok = [r for r in rs if r["ttft_s"] is not None and r["ttft_s"] <= slo[f"ttft_{kind}_s"]
              and (kind == "long" or (r["tpot_s"] or 0) <= slo["tpot_s"])]
        drafted = sum(r.get("draft_tokens", 0) for r in rs)
        out[kind] = {"n": len(rs), "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                     "draft_tokens": drafted, "accepted_tokens": sum(r.get("accepted_tokens", 0) for r in rs),
                     "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
                     "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99), "itl_max_s": max(gaps, default=None),
                     "slo_met": len(ok), "goodput_rps": len(ok) / wall_s}
        if kind == "long":  # the step after the first token: where a draft catching up on the prompt stalls
            out[kind] |= {"first_gap_p50_s": pct(firsts, 50), "first_gap_max_s": max(firsts, default=None)}
    n_tok = sum(r["tokens"] for r in results)
    out["output_tokens_per_s"] = n_tok / wall_s
    met = sum(out[k]["slo_met"] for k in ("decode", "long") if k in out)
    out["goodput_fraction"] = met / len(results)
    return out


def draft_transfer_summary(router: Any) -> dict[str, Any]:
    """The drafts' prompt-KV transfers: how many arrived, their bytes, the prefill worker's draft
    forward per request, and how long after its first step each request waited for them."""
    ds, ps = router.draft_transfers, router.prefills
    if not ds:
        return {}
    ok = [d for d in ds if d["ok"]]
    waits = [d["draft_after_s"] for d in ok if d.get("draft_after_s") is not None]
    outcomes = dict(Counter(d.get("outcome") or "?" for d in ds))
    return {"transfers": len(ds), "arrived": len(ok), "outcomes": outcomes, "mean_bytes": float(np.mean([d["bytes"] for d in ok])) if ok else 0,
            "mean_load_s": float(np.mean([d["load_s"] for d in ok])) if ok else None,
            "wait_after_first_step_p50_s": pct(waits, 50), "wait_after_first_step_max_s": max(waits, default=None),
            "prefill_draft_compute_mean_s": float(np.mean([p.get("draft_compute_s", 0.0) for p in ps])) if ps else None}


def transfer_summary(router: Any) -> dict[str, Any]:
    """KV transfer figures the router collected from its workers."""
    ts, ps = router.transfers, router.prefills
    if not ts:
        return {}
    send = sum(p["send_s"] for p in ps)
    load = sum(t["load_s"] for t in ts)
    exposed = sum(t["exposed_s"] for t in ts)
    nbytes = sum(t["bytes"] for t in ts)
    return {
        "transfers": len(ts), "bytes": nbytes, "mean_bytes": nbytes / len(ts),
        "mean_send_s": send / max(len(ps), 1), "mean_load_s": load / len(ts), "mean_exposed_s": exposed / len(ts),
        # Share of the decode-side load done while the prefill was still computing: the part of
        # the transfer that layer (and chunk) streaming hid. "exposed" (prefill done -> KV complete
        # on the decode worker) also holds the wait for the decode worker's current step to end.
        "hidden_fraction": float(np.mean([t["overlap"] for t in ts])),
        # Layer-0 start: the first step's waits for later layers, and when it began relative to
        # the sender finishing (negative: before the last layers were written).
        "mean_waited_in_step_s": float(np.mean([t.get("waited_in_step_s", 0.0) for t in ts])),
        "mean_admitted_after_done_s": float(np.mean([t["admitted_at"] - t["sender_done_at"] for t in ts
                                                     if t.get("admitted_at") and t.get("sender_done_at")] or [0.0])),
        "prefill_wall_mean_s": float(np.mean([p["wall_s"] for p in ps])) if ps else None,
    }


async def run_colocated(args: argparse.Namespace, kinds: list[str], slo: dict[str, float]) -> dict[str, Any]:
    from specserve import LLM
    from specserve.engine.engine import build_off_thread
    from specserve.server.async_engine import AsyncEngine

    # AsyncEngine's own thread steps it, not this one.
    llm = build_off_thread(LLM, args.model, dtype="float32", kv_cache_gib=1.0, max_model_len=4096, num_threads=2,
                           max_num_batched_tokens=args.chunk, kv_cache_dtype=args.kv_cache_dtype, **spec_kwargs(args))
    ae = AsyncEngine(llm.engine)
    ae.start(asyncio.get_running_loop())
    res = {}
    for kind in kinds:
        await drive(ae, llm.engine, workload(kind, args, llm.tokenizer, warm_up=True))
        llm.engine.kv_manager.reset_prefix_cache()
        llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
        t0 = time.perf_counter()
        results = await drive(ae, llm.engine, workload(kind, args, llm.tokenizer))
        res[kind] = {"summary": summarize(results, time.perf_counter() - t0, slo), "requests": results}
        log(f"co-located {kind}: {fmt(res[kind]['summary'])}")
    await ae.shutdown(5)
    del llm
    gc.collect()
    return res


def spec_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings of the draft model every engine speculates with (--draft), or none."""
    if not args.draft:
        return {}
    return {"spec_method": args.spec_method, "draft_model": args.draft, "draft_num_layers": args.draft_num_layers,
            "spec_policy": args.spec_policy}


async def run_disagg(args: argparse.Namespace, kinds: list[str], slo: dict[str, float],
                     draft_kv: bool = True, layer_start: str = "all") -> dict[str, Any]:
    from specserve.disagg.launch import launch

    # Without draft KV the prefill pool runs no draft (its own setting): decode workers' drafts recompute it.
    roles = None if draft_kv else {"prefill": {"spec_method": "none"}}
    router = launch(args.model, dict(dtype="float32", kv_cache_gib=1.0, max_model_len=4096,
                                max_num_batched_tokens=args.chunk, kv_cache_dtype=args.kv_cache_dtype, **spec_kwargs(args)),
                    1, 1, threads_per_worker=1, pin_cpus=True, role_engine_kwargs=roles, kv_layer_start=layer_start)
    router.start(asyncio.get_running_loop())
    tok = router.engine.tokenizer
    res = {}
    for kind in kinds:
        await drive(router, router.engine, workload(kind, args, tok, warm_up=True))
        router.transfers.clear()
        router.draft_transfers.clear()
        router.prefills.clear()
        t0 = time.perf_counter()
        results = await drive(router, router.engine, workload(kind, args, tok))
        await asyncio.sleep(0.5)  # the last transfer records arrive with the next polls
        res[kind] = {"summary": summarize(results, time.perf_counter() - t0, slo)
                     | {"kv": transfer_summary(router), "draft_kv": draft_transfer_summary(router)},
                     "requests": results}
        log(f"disaggregated {kind}: {fmt(res[kind]['summary'])}")
    await router.shutdown(5)
    import ray

    ray.shutdown()
    return res


def fmt(s: dict[str, Any]) -> str:
    d = s.get("decode", {})
    lg = s.get("long", {})

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    txt = (f"decode TPOT p50/p99 {f(d.get('tpot_p50_s'))}/{f(d.get('tpot_p99_s'))} s, ITL p99 {f(d.get('itl_p99_s'))} "
           f"max {f(d.get('itl_max_s'))}; long TTFT p50/p99 {f(lg.get('ttft_p50_s'))}/{f(lg.get('ttft_p99_s'))} s, "
           f"first gap max {f(lg.get('first_gap_max_s'))} s; "
           f"goodput {s['goodput_fraction']:.2f}; {s['output_tokens_per_s']:.1f} tok/s; errors {s['errors']}")
    for kind, part in ((k, s[k]) for k in ("decode", "long") if s.get(k, {}).get("draft_tokens")):
        txt += f"; {kind} accepted {part['accepted_tokens']}/{part['draft_tokens']}"
    if s.get("kv"):
        kv = s["kv"]
        txt += (f"; KV {kv['mean_bytes'] / 1e6:.1f} MB/transfer, send {kv['mean_send_s'] * 1e3:.1f} ms, load "
                f"{kv['mean_load_s'] * 1e3:.1f} ms, exposed {kv['mean_exposed_s'] * 1e3:.1f} ms, "
                f"hidden {kv['hidden_fraction']:.2f}")
    if s.get("draft_kv"):
        dk = s["draft_kv"]
        txt += (f"; draft KV {dk['outcomes']}, {dk['mean_bytes'] / 1e6:.1f} MB, prefill-side "
                f"draft {f(dk['prefill_draft_compute_mean_s'])} s, wait after first step max "
                f"{f(dk['wait_after_first_step_max_s'])} s")
    return txt


def plot(payload: dict[str, Any], path: Path) -> None:
    """ITL CDFs of the decodes, TTFT of long prompts, TPOT and goodput per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for cfg, by_kind in runs.items():
        for kind, run in by_kind.items():
            gaps = sorted(g for r in run["requests"] if r["kind"] == "decode" for g in r["gaps_s"])
            if gaps:
                ax.plot(gaps, np.linspace(0, 1, len(gaps)), label=f"{cfg} / {kind}")
    ax.set_xscale("log")
    ax.set_xlabel("decode inter-token gap (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    ax.set_title("decode inter-token gaps")
    labels = [(cfg, kind) for cfg, by_kind in runs.items() for kind in by_kind]
    names = [f"{c}\n{k}" for c, k in labels]
    x = np.arange(len(labels))

    def bars(ax: Any, keys: list[tuple[str, str, str]], title: str, ylabel: str) -> None:
        w = 0.8 / len(keys)
        for j, (kind, key, lab) in enumerate(keys):
            vals = [runs[c][k]["summary"].get(kind, {}).get(key) or 0.0 for c, k in labels]
            b = ax.bar(x + (j - (len(keys) - 1) / 2) * w, vals, w, label=lab)
            ax.bar_label(b, fmt="%.2f", fontsize=7)
        ax.set_xticks(x, names, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)

    bars(axes[0][1], [("long", "ttft_p50_s", "long TTFT p50"), ("long", "ttft_p99_s", "long TTFT p99"),
                      ("decode", "ttft_p99_s", "decode TTFT p99")], "time to first token", "s")
    bars(axes[1][0], [("decode", "tpot_p50_s", "TPOT p50"), ("decode", "tpot_p99_s", "TPOT p99"),
                      ("decode", "itl_p99_s", "ITL p99"), ("decode", "itl_max_s", "ITL max"),
                      ("long", "first_gap_max_s", "long prompt: first gap max")],
         "decode time per output token (and the longest gaps)", "s")
    ax = axes[1][1]
    vals = [runs[c][k]["summary"]["goodput_fraction"] for c, k in labels]
    b = ax.bar(x, vals, 0.5)
    ax.bar_label(b, fmt="%.2f", fontsize=8)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylim(0, 1.1)
    slo = payload["slo"]
    ax.set_title(f"goodput: TTFT<= {slo['ttft_long_s']}s (long) / {slo['ttft_decode_s']}s (decode), "
                 f"TPOT <= {slo['tpot_s']}s", fontsize=9)
    kv = runs.get("disaggregated", {}).get("mixed", {}).get("summary", {}).get("kv")
    if kv:
        ax.text(0.02, 0.02, f"KV/transfer {kv['mean_bytes'] / 1e6:.0f} MB, send {kv['mean_send_s'] * 1e3:.0f} ms, "
                f"load {kv['mean_load_s'] * 1e3:.0f} ms,\nexposed {kv['mean_exposed_s'] * 1e3:.1f} ms: "
                f"{kv['hidden_fraction'] * 100:.0f}% hidden by layer streaming", transform=ax.transAxes, fontsize=8)
    m = payload["machine"]
    fig.suptitle(f"{payload['model']}: disaggregated (1 prefill core + 1 decode core) vs co-located (2 cores) — "
                 f"{m['cpu']}, {m['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="the model every engine serves (bundled name or path)")
    ap.add_argument("--long", type=int, default=6, help="long-prompt requests in the mixed workload")
    ap.add_argument("--long-tokens", type=int, default=2100, help="approximate tokens of the first long prompt")
    ap.add_argument("--long-output", type=int, default=16, help="tokens each long prompt's answer has")
    ap.add_argument("--long-kind", default="summary", choices=["summary", "code"],
                    help="long prompts: documents to summarize, or the start of a standard-library module to "
                         "continue")
    ap.add_argument("--decode", type=int, default=12, help="long-decode requests (12: a p50 between two clusters "
                    "of 3 requests moved 30%% from one recording to the next)")
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--interval", type=float, default=12.0,
                    help="seconds between long prompts (about one prompt's prefill time on one core here)")
    ap.add_argument("--chunk", type=int, default=512, help="token budget per step (prefill chunk size)")
    ap.add_argument("--workloads", nargs="+", default=["mixed", "decode-only"])
    ap.add_argument("--slo-ttft-long", type=float, default=20.0)
    ap.add_argument("--slo-ttft-decode", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                    help="KV cache of every engine (int8: the transfers carry int8 K/V and their scales)")
    ap.add_argument("--draft", default=None, help="a draft model (or with --spec-method eagle/mtp a head file, or "
                                                  "auto) every engine speculates with")
    ap.add_argument("--spec-method", default="draft", choices=["draft", "eagle", "mtp"],
                    help="the drafter --draft names")
    ap.add_argument("--draft-num-layers", type=int, default=None, help="the draft's first N layers only")
    ap.add_argument("--spec-policy", default="adaptive", choices=["adaptive", "always"])
    ap.add_argument("--configs", nargs="+", default=None,
                    help="configurations to run (default: co-located and disaggregated, plus "
                         "'disaggregated, draft recomputes' with --draft; also 'disaggregated, layer-0 start')")
    ap.add_argument("--out", default="disagg", help="results name under bench/results/")
    args = ap.parse_args()
    slo = {"ttft_long_s": args.slo_ttft_long, "ttft_decode_s": args.slo_ttft_decode, "tpot_s": args.slo_tpot}
    configs = args.configs or ["co-located", "disaggregated"] + (["disaggregated, draft recomputes"] if args.draft else [])
    runners = {"co-located": lambda: run_colocated(args, args.workloads, slo),
               "disaggregated": lambda: run_disagg(args, args.workloads, slo),
               "disaggregated, draft recomputes": lambda: run_disagg(args, args.workloads, slo, draft_kv=False),
               "disaggregated, layer-0 start": lambda: run_disagg(args, args.workloads, slo, layer_start="first")}
    runs = {c: asyncio.run(runners[c]()) for c in configs}
    payload = {"machine": machine_info(), "model": args.model, "settings": vars(args), "slo": slo, "runs": runs,
               "configs": {"co-located": "one engine, 2 torch threads, chunked prefill mixed with decodes",
                           "disaggregated": "1 prefill worker (core 0) + 1 decode worker (core 1), Ray actors, "
                                            "KV via shared memory, 1 torch thread each"
                                            + (" (the prefill worker also sends the draft's prompt KV)" if args.draft else ""),
                           "disaggregated, draft recomputes": "the same, the prefill worker without the draft: the "
                                                              "decode worker's draft recomputes the prompt's KV",
                           "disaggregated, layer-0 start": "the same, the decode worker starting a request's first "
                                                           "step once layer 0 of its KV is in (--kv-layer-start first)"}}
    verdict = {}
    for kind in args.workloads:
        if "co-located" not in runs or "disaggregated" not in runs:
            break
        c, d = runs["co-located"][kind]["summary"], runs["disaggregated"][kind]["summary"]
        verdict[kind] = {
            "decode_tpot_p99_ratio_disagg_over_coloc": _ratio(d, c, "decode", "tpot_p99_s"),
            "decode_itl_p99_ratio_disagg_over_coloc": _ratio(d, c, "decode", "itl_p99_s"),
            "long_ttft_p50_ratio_disagg_over_coloc": _ratio(d, c, "long", "ttft_p50_s"),
            "goodput_coloc": c["goodput_fraction"], "goodput_disagg": d["goodput_fraction"],
            "throughput_ratio_disagg_over_coloc": d["output_tokens_per_s"] / c["output_tokens_per_s"],
        }
    payload["verdict"] = verdict
    # Greedy and the same KV precision everywhere: every request's tokens must match an engine
    # computing as the workers do (one thread: with an int8 KV cache the thread count alone can
    # flip a token, float32's summation order moving a value across an int8 rounding boundary).
    ref = reference_outputs(args)
    same = {config: all([r["token_ids"] for r in runs[config][kind]["requests"]] == ref[kind]
                        for kind in args.workloads) for config in runs}
    payload["outputs_identical_to_one_thread_engine"] = same
    log(f"greedy outputs identical to a one-thread co-located engine: {same}")
    out = write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    log(f"wrote {out}")
    return 0


def reference_outputs(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Greedy tokens of every workload request from one co-located engine on one thread, each alone."""
    from specserve import LLM

    llm = LLM(args.model, dtype="float32", kv_cache_gib=1.0, max_model_len=4096, num_threads=1,
              max_num_batched_tokens=args.chunk, kv_cache_dtype=args.kv_cache_dtype)
    out = {kind: [llm.generate([r["prompt"]], r["params"], use_tqdm=False)[0].outputs[0].token_ids
                  for r in workload(kind, args, llm.tokenizer)] for kind in args.workloads}
    del llm
    gc.collect()
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], kind: str, key: str) -> float | None:
    x, y = a.get(kind, {}).get(key), b.get(kind, {}).get(key)
    return x / y if x and y else None


if __name__ == "__main__":
    raise SystemExit(main())
