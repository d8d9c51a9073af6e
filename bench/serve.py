"""Open-loop load against the OpenAI server: Poisson arrivals at a sweep of request rates.

Two workloads: `chat` (short prompts, ~100-token answers) and `long` (~1k-token prompts,
short answers). For each rate, requests arrive as a Poisson process whatever the server's
progress (open loop), each streams its answer; we record TTFT, TPOT (mean inter-token time
after the first token), end-to-end latency, throughput and goodput: requests per second that
met the SLO (TTFT <= --slo-ttft and TPOT <= --slo-tpot). Every point runs twice on the same
server, speculation adaptive and off (switched through /admin/speculation).

    python bench/serve.py                                   # SmolLM2 + n-gram speculation
    python bench/serve.py --rates 0.5 1 2 --requests 24     # a shorter sweep

Writes bench/results/serve.json and serve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT  # noqa: E402

TOPICS = ["the ocean", "volcanoes", "the history of tea", "how compilers work", "bees", "the moon landing",
          "jazz", "chess openings", "rainforests", "the printing press", "neural networks", "glaciers"]


def chat_requests(n: int, rng: random.Random, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 3 == 2:
            content, ref = EDIT[i % len(EDIT)]
            body = {"messages": [{"role": "user", "content": content}], "reference_text": ref}
        elif i % 3 == 1:
            body = {"messages": [{"role": "user", "content": CODING[i % len(CODING)]}]}
        else:
            body = {"messages": [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)} in a paragraph."}]}
        body.update(max_tokens=max_tokens, temperature=0)
        out.append(body)
    return out


def _tag(body: dict, tag: str) -> dict:
    msgs = [dict(m) for m in body["messages"]]
    msgs[-1]["content"] = f"[{tag}] {msgs[-1]['content']}"
    return {**body, "messages": msgs}


def long_requests(n: int, rng: random.Random, prompt_words: int, max_tokens: int) -> list[dict]:
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(TOPICS).split()[-1] for _ in range(prompt_words))
        out.append({"messages": [{"role": "user", "content": f"Summarise these notes: {words}"}],
                    "max_tokens": max_tokens, "temperature": 0})
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict[str, Any]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = prompt_tokens = cached_tokens = 0
    spec = None
    status = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            status = resp.status_code
            if status != 200:
                await resp.aread()
                return {"ok": False, "status": status, "e2e": time.perf_counter() - t0}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
                    cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    spec = chunk["usage"].get("speculation")  # its verify steps, draft and accepted tokens
                for ch in chunk.get("choices", []):
                    if ch.get("delta", {}).get("content"):
                        first = first or now
                        last = now
    except httpx.HTTPError as e:
        return {"ok": False, "status": status, "error": str(e), "e2e": time.perf_counter() - t0}
    end = time.perf_counter()
    ttft = (first or end) - t0
    tpot = (last - first) / (tokens - 1) if first and last and tokens > 1 else None
    return {"ok": True, "status": 200, "ttft": ttft, "tpot": tpot, "e2e": end - t0, "tokens": tokens,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens, "speculation": spec}


async def run_point(base: str, bodies: list[dict], rate: float, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(bodies))
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        tasks, arrivals = [], []
        t0 = time.perf_counter()
        for gap, body in zip(gaps, bodies):
            await asyncio.sleep(gap)
            arrivals.append(time.perf_counter() - t0)
            tasks.append(asyncio.create_task(one_request(client, url, body)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    for r, at in zip(results, arrivals):
        r["arrival_s"] = at  # the request's trace for bench/plan_check.py: when it was sent
    return {"results": results, "wall_s": wall}


SPEC_COUNTERS = {"drafts": "specserve_spec_drafts_total", "draft_tokens": "specserve_spec_draft_tokens_total",
                 "accepted_tokens": "specserve_spec_accepted_tokens_total"}


def spec_counters(base: str) -> dict[str, float]:
    """The server's speculation counters (verify steps, draft tokens verified, accepted), from /metrics."""
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        for key, name in SPEC_COUNTERS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def summarise(point: dict[str, Any], slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    res = point["results"]
    ok = [r for r in res if r["ok"]]
    ttft = np.array([r["ttft"] for r in ok]) if ok else np.array([np.nan])
    tpot = np.array([r["tpot"] for r in ok if r["tpot"] is not None]) if ok else np.array([np.nan])
    tokens = sum(r["tokens"] for r in ok)
    good = [r for r in ok if r["ttft"] <= slo_ttft and (r["tpot"] is None or r["tpot"] <= slo_tpot)]
    wall = point["wall_s"]
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None  # noqa: E731
    return {
        "requests": len(res), "ok": len(ok), "errors": len(res) - len(ok),
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "throughput_tok_s": tokens / wall, "request_throughput": len(ok) / wall,
        "goodput_req_s": len(good) / wall, "slo_attainment": len(good) / max(len(res), 1),
        "wall_s": wall,
    }


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", args.model, "--port", str(port),
           "--spec-method", args.spec_method, "--spec-policy", "adaptive", "--max-num-seqs", "64",
           "--max-waiting", "1024", "--log-level", "warning", "--dtype", args.dtype]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    cmd += ["--suffix-cache-requests", str(args.suffix_cache_requests)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["points"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 4.2 * len(workloads)), squeeze=False)
    for w, axrow in zip(workloads, axes):
        for spec, style in [("adaptive", "o-"), ("off", "s--")]:
            pts = sorted([r for r in rows if r["workload"] == w and r["speculation"] == spec], key=lambda r: r["rate"])
            x = [r["rate"] for r in pts]
            axrow[0].plot(x, [r["ttft_p50"] for r in pts], style, label=f"p50, spec {spec}")
            axrow[0].plot(x, [r["ttft_p99"] for r in pts], style, alpha=0.5, label=f"p99, spec {spec}")
            axrow[1].plot(x, [1e3 * (r["tpot_p50"] or np.nan) for r in pts], style, label=f"p50, spec {spec}")
            axrow[1].plot(x, [1e3 * (r["tpot_p99"] or np.nan) for r in pts], style, alpha=0.5, label=f"p99, spec {spec}")
            axrow[2].plot(x, [r["throughput_tok_s"] for r in pts], style, label=f"tokens/s, spec {spec}")
            axrow[2].plot(x, [r["goodput_req_s"] * 100 for r in pts], style, alpha=0.5,
                          label=f"goodput x100 req/s, spec {spec}")
        axrow[0].set_title(f"{w}: TTFT (s)", fontsize=10)
        axrow[1].set_title(f"{w}: TPOT (ms)", fontsize=10)
        axrow[2].set_title(f"{w}: throughput and goodput (SLO)", fontsize=10)
        for ax in axrow:
            ax.set_xlabel("request rate (req/s, Poisson)")
            ax.legend(fontsize=7)
    mi = payload["machine"]
    s = payload["settings"]
    fig.suptitle(f"specserve serving — {s['model']} (+{s['spec_method']}) — {mi['cpu']}, commit {mi['commit']} — "
                 f"SLO TTFT<={s['slo_ttft']}s, TPOT<={s['slo_tpot']}s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--spec-method", default="ngram")
    ap.add_argument("--suffix-cache-requests", type=int, default=10_000,
                    help="the server's store of earlier outputs (0: off); this workload repeats its 8 coding and "
                         "8 edit asks within a run, so with it on later repeats draft from earlier answers")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rates", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--long-rates", nargs="+", type=float, default=[0.1, 0.2, 0.4],
                    help="request rates for the long-prompt workload (prefill-bound: lower than chat's)")
    ap.add_argument("--requests", type=int, default=32, help="requests per rate point")
    ap.add_argument("--workloads", nargs="+", default=["chat", "long"])
    ap.add_argument("--chat-max-tokens", type=int, default=96)
    ap.add_argument("--long-prompt-words", type=int, default=700)
    ap.add_argument("--long-max-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--out", default="serve")
    args = ap.parse_args()

    proc = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        port = 8700 + random.randint(0, 999)
        proc = start_server(args, port)
        base = f"http://127.0.0.1:{port}"
    points = []
    try:
        for workload in args.workloads:
            for rate in (args.rates if workload == "chat" else args.long_rates):
                rng = random.Random(int(rate * 1000))
                if workload == "chat":
                    bodies = chat_requests(args.requests, rng, args.chat_max_tokens)
                else:
                    bodies = long_requests(args.requests, rng, args.long_prompt_words, args.long_max_tokens)
                for spec in ["adaptive", "off"]:
                    httpx.post(base + "/admin/speculation", json={"enabled": spec == "adaptive"}, timeout=30)
                    # Same requests for both modes, but a per-run tag in front of each user message
                    # so the second mode gets no prefix-cache hits from the first mode's prompts
                    # (the chat template's system part is still shared, as in real traffic).
                    tagged = [_tag(body, f"{workload}-{rate}-{spec}-{i}") for i, body in enumerate(bodies)]
                    before = spec_counters(base)
                    point = asyncio.run(run_point(base, tagged, rate, seed=int(rate * 100)))
                    after = spec_counters(base)
                    summ = summarise(point, args.slo_ttft, args.slo_tpot)
                    summ.update(workload=workload, rate=rate, speculation=spec,
                                # per request: arrival, tokens, latencies; the point's drafts and acceptance
                                requests=point["results"], spec_counters={k: after[k] - before[k] for k in after})
                    points.append(summ)
                    print(f"{workload:5s} rate {rate:5.2f} spec {spec:8s}: TTFT p50 {summ['ttft_p50']:.2f}s "
                          f"p99 {summ['ttft_p99']:.2f}s | TPOT p50 {1e3 * (summ['tpot_p50'] or 0):.0f}ms "
                          f"p99 {1e3 * (summ['tpot_p99'] or 0):.0f}ms | {summ['throughput_tok_s']:.1f} tok/s | "
                          f"goodput {summ['goodput_req_s']:.2f} req/s | errors {summ['errors']}", flush=True)
        metrics_text = httpx.get(base + "/metrics", timeout=30).text
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    payload = {"benchmark": "serving (open loop)", "machine": machine_info(), "settings": vars(args),
               "points": points,
               "server_metrics_excerpt": [line for line in metrics_text.splitlines()
                                          if line.startswith(("specserve_spec_", "specserve_requests_total",
                                                              "specserve_generation_tokens_total"))]}
    path = write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
