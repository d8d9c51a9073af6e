"""Soak: mixed load with client disconnects on the disaggregated server, for a long time.

Starts `specserve serve --disagg` (1 prefill + 1 decode worker on local Ray, n-gram speculation
on the decode worker), or with --colocated one engine with the speculation flags given in
--server-args (default: the model's own defaults), then drives Poisson arrivals at a bounded concurrency with a mix of what
clients do: short and long-prompt chats (streamed and not), completions with logprobs and
top_logprobs, n=2, JSON-schema output, streams the client drops after a few chunks, non-streamed
requests whose client gives up, and deliberately bad requests. Every 5 s it samples the RSS of
the server and each of its processes (router, Ray, workers), the workers' free KV blocks,
/health and the KV channel files in /dev/shm.

At the end it waits for the server to go idle and checks the promises: no 5xx, no request lost
(every one not dropped by its client finished with a finish_reason, streams with [DONE]), bad
requests refused with 4xx, every KV block back (free == total on each worker), no channel file
left after SIGTERM, no process left behind, and memory flat after warm-up.

    python bench/soak.py                     # 30 minutes
    python bench/soak.py --minutes 3         # a quick look
    python bench/soak.py --colocated --model qwen2.5-coder-1.5b-instruct \
        --server-args="--draft-model auto" --minutes 10 --out soak_qwen_draft

A co-located engine's KV is back when its free blocks (cached ones count as free) equal what it
had before the first request. Its KV pool is mapped lazily (kv_cache/pages.py): resident memory
grows by each region of the pool the first time a request writes there, up to the whole
`--kv-cache-gib`, so the warm-up (--warmup-minutes, at most a third of the run) has to cover
that (the Qwen pair's 1 GiB took ~4 minutes of this load on a 2-vCPU Zen 4).

Writes bench/results/soak.json and soak.png (RSS over time, with requests and checks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT  # noqa: E402

SHM_DIR = Path("/dev/shm")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "year"],
}
WORDS = ["river", "stone", "market", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "violet", "engine",
         "garden"]


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------- processes and files
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def process_tree(root: int) -> list[int]:
    """root and every descendant alive now."""
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def rss_and_name(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return rss, _short_name(cmd)


def _short_name(cmd: str) -> str:
    for key in ("specserve.cli", "gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if key in cmd:
            return "server (router)" if key == "specserve.cli" else key
    if cmd.startswith("ray::"):  # Ray retitles a worker with the method it runs: keep the actor
        return cmd.split()[0].split(".")[0]
    if "default_worker" in cmd:
        return "ray worker"
    return cmd.split()[0].rsplit("/", 1)[-1] if cmd else "?"


def channel_files() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob("specserve-kv-*")) if SHM_DIR.is_dir() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- requests
def make_request(i: int, rng: random.Random) -> dict[str, Any]:
    """One client action: what it sends, how it behaves, and what counts as correct."""
    kind = rng.choices(
        ["chat_stream", "chat", "long_stream", "completion_logprobs", "chat_top_logprobs", "n2", "json_schema",
         "drop_stream", "drop_wait", "bad"],
        weights=[18, 10, 10, 10, 10, 6, 8, 12, 8, 8],
    )[0]
    topic = rng.choice(CODING + [e[0] for e in EDIT] + [f"Tell me about {w}s." for w in WORDS])
    msgs = [{"role": "user", "content": f"[{i}] {topic}"}]
    body: dict[str, Any] = {"messages": msgs, "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.8])}
    path, stream = "/v1/chat/completions", False
    if kind in ("chat_stream", "long_stream", "drop_stream", "chat_top_logprobs"):
        stream = True
    if kind == "long_stream":
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(300, 1200)))
        body["messages"] = [{"role": "user", "content": f"[{i}] Summarise these notes: {words}"}]
        body["max_tokens"] = rng.randint(8, 24)
    elif kind == "completion_logprobs":
        path = "/v1/completions"
        body = {"prompt": f"[{i}] {topic}", "max_tokens": body["max_tokens"], "logprobs": 2, "temperature": 0.7}
    elif kind == "chat_top_logprobs":
        body.update(logprobs=True, top_logprobs=3)
    elif kind == "n2":
        path = "/v1/completions"
        body = {"prompt": f"[{i}] {topic}", "max_tokens": body["max_tokens"], "n": 2, "temperature": 0.9, "seed": i}
    elif kind == "json_schema":
        body.update(max_tokens=96, temperature=0.7,
                    response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}})
        body["messages"] = [{"role": "user", "content": f"[{i}] Give a JSON object for a book: name, year, tags."}]
    elif kind == "drop_wait":
        body["max_tokens"] = 96
    elif kind == "bad":
        bad = rng.choice(["unknown_field", "too_long", "bad_json", "bad_type"])
        if bad == "unknown_field":
            body["frobnicate"] = True
        elif bad == "too_long":
            body["max_tokens"] = 10**7
        elif bad == "bad_type":
            body["temperature"] = "hot"
        else:
            body = {"_raw": b'{"messages": [{"role": "user", "content": "x"'}
        return {"i": i, "kind": f"bad:{bad}", "path": path, "body": body, "stream": False}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {"i": i, "kind": kind, "path": path, "body": body, "stream": stream,
            "drop_after": rng.randint(1, 4) if kind == "drop_stream" else None,
            "client_timeout": rng.uniform(0.2, 1.5) if kind == "drop_wait" else None}


async def run_one(client: httpx.AsyncClient, base: str, req: dict[str, Any]) -> dict[str, Any]:
    """Send one request; return its outcome: status, whether it finished, whether that was right."""
    out: dict[str, Any] = {"kind": req["kind"], "status": None, "finished": False, "t0": time.time()}
    body = req["body"]
    try:
        if "_raw" in body:
            r = await client.post(base + req["path"], content=body["_raw"], headers={"content-type": "application/json"})
            out["status"] = r.status_code
        elif req["stream"]:
            async with client.stream("POST", base + req["path"], json=body) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    await r.aread()
                else:
                    chunks, reasons, done, lp_missing = 0, set(), False, 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["stream_error"] = chunk["error"].get("message")
                        for ch in chunk.get("choices", []):
                            if ch.get("finish_reason"):
                                reasons.add(ch["finish_reason"])
                            if body.get("top_logprobs") and ch.get("delta", {}).get("content") is not None:
                                lp = (ch.get("logprobs") or {}).get("content") or []
                                lp_missing += sum(1 for e in lp if len(e.get("top_logprobs", [])) == 0)
                        chunks += 1
                        if req["drop_after"] is not None and chunks >= req["drop_after"]:
                            out["dropped"] = True
                            return out
                    out["finished"] = done and bool(reasons) and "error" not in reasons
                    out["finish_reasons"] = sorted(reasons)
                    out["top_logprobs_missing"] = lp_missing
        else:
            timeout = req.get("client_timeout")
            try:
                r = await client.post(base + req["path"], json=body, timeout=timeout or 600)
            except httpx.TimeoutException:
                out["dropped"] = True
                return out
            out["status"] = r.status_code
            if r.status_code == 200:
                data = r.json()
                reasons = [c.get("finish_reason") for c in data.get("choices", [])]
                out["finish_reasons"] = reasons
                out["finished"] = bool(reasons) and all(x and x != "error" for x in reasons)
                if req["kind"] == "n2":
                    out["finished"] &= len(reasons) == 2
                if req["kind"] == "json_schema":
                    out["valid_json"] = _valid(data["choices"][0]["message"]["content"], reasons[0])
    except httpx.HTTPError as e:
        out["transport_error"] = f"{type(e).__name__}: {e}"
    out["t1"] = time.time()
    return out


def _valid(text: str, reason: str | None) -> bool | None:
    if reason != "stop":
        return None  # cut by max_tokens: the prefix is valid, the object unfinished
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("year"), int)


def judge(res: dict[str, Any]) -> str:
    """ok | dropped | refused_ok | server_error | lost | wrong_refusal."""
    if res.get("dropped"):
        return "dropped"
    status = res["status"]
    if status is not None and status >= 500:
        return "server_error"
    if res["kind"].startswith("bad:"):
        return "refused_ok" if status is not None and 400 <= status < 500 else "wrong_refusal"
    if status != 200:
        return "wrong_refusal"
    if res.get("valid_json") is False:
        return "invalid_json"
    return "ok" if res["finished"] else "lost"


# ---------------------------------------------------------------------- the run
DEPLOYMENT = {False: "disaggregated", True: "co-located"}


async def sample(client: httpx.AsyncClient, base: str, root: int, t0: float,
                 idle_free: dict[str, float]) -> dict[str, Any]:
    procs = []
    for pid in process_tree(root):
        got = rss_and_name(pid)
        if got is not None:  # two workers are both "ray::EngineWorkerActor": tell them by pid
            name = f"{got[1]} [{pid}]" if got[1].startswith("ray::") else got[1]
            procs.append({"pid": pid, "name": name, "rss": got[0]})
    s: dict[str, Any] = {"t": time.time() - t0, "rss_total": sum(p["rss"] for p in procs), "procs": procs,
                         "channel_files": len(channel_files())}
    try:
        s["health"] = (await client.get(base + "/health", timeout=10)).json().get("status")
        s["kv"] = worker_kv((await client.get(base + "/metrics", timeout=10)).text, idle_free)
    except (httpx.HTTPError, ValueError) as e:
        s["health"] = f"unreachable: {type(e).__name__}"
    return s


def worker_kv(metrics: str, idle_free: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """{worker: {"free": n, "total": n}} from the Prometheus text; a co-located engine ("engine")
    has no total gauge: its free blocks before the first request (`idle_free`) stand for it."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics.splitlines():
        if line.startswith("specserve_kv_blocks_free{"):
            free = float(line.rsplit(" ", 1)[1])
            total = (idle_free or {}).setdefault("engine", free)
            out["engine"] = {"free": free, "total": total}
        for key, name in (("free", "specserve_worker_kv_blocks_free{"), ("total", "specserve_worker_kv_blocks_total{")):
            if line.startswith(name):
                labels, value = line[len(name):].split("} ")
                worker = dict(kv.split("=", 1) for kv in labels.split(","))["worker"].strip('"')
                out.setdefault(worker, {})[key] = float(value)
    return out


async def drive(args: argparse.Namespace, base: str, root: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(args.seed)
    results: list[dict] = []
    samples: list[dict] = []
    idle_free: dict[str, float] = {}  # a co-located engine's free KV blocks at the first sample (idle)
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency * 2 + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def sampler() -> None:
            while time.time() < deadline:
                samples.append(await sample(client, base, root, t0, idle_free))
                await asyncio.sleep(args.sample_every)

        async def one(req: dict[str, Any]) -> None:
            try:
                results.append(await run_one(client, base, req))
            finally:
                sem.release()

        sampling = asyncio.create_task(sampler())
        tasks, i, last_report = [], 0, t0
        while time.time() < deadline:
            await asyncio.sleep(rng.expovariate(args.rate))
            await sem.acquire()  # bounded: an arrival waits while the concurrency cap is reached
            tasks.append(asyncio.create_task(one(make_request(i, rng))))
            i += 1
            if time.time() - last_report > 60:
                last_report = time.time()
                counts = Counter(judge(r) for r in results)
                last = samples[-1] if samples else {}
                log(f"{(time.time() - t0) / 60:.1f} min: {i} sent, {dict(counts)}, "
                    f"RSS {last.get('rss_total', 0) / 2**20:.0f} MiB, health {last.get('health')}")
        await asyncio.gather(*tasks)
        await sampling
        # Idle: every KV block must come back once the aborted requests are cleaned up.
        settle_deadline = time.time() + 60
        while True:
            final = await sample(client, base, root, t0, idle_free)
            kv = final.get("kv", {})
            if kv and all(v.get("free") == v.get("total") for v in kv.values()):
                break
            if time.time() > settle_deadline:
                break
            await asyncio.sleep(1)
        final["final"] = True
        samples.append(final)
    return results, samples


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-waiting", "256", "--log-level", "warning", "--drain-timeout", "30"]
    if not args.colocated:
        cmd += ["--disagg", "--prefill-workers", "1", "--decode-workers", "1", "--spec-method", "ngram"]
    cmd += shlex.split(args.server_args)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).json().get("status") == "ok":
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("server did not become healthy in 10 minutes")


def stop_server(proc: subprocess.Popen) -> dict[str, Any]:
    """SIGTERM, then what outlived it: processes of its tree and channel files."""
    tree = process_tree(proc.pid)
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    time.sleep(5)  # Ray's own processes exit shortly after the driver
    left = [pid for pid in tree if rss_and_name(pid) is not None]
    out = {"exit_code": code, "shutdown_s": round(time.time() - t, 1), "processes_left": len(left),
           "channel_files_left": channel_files()}
    with_names = [rss_and_name(pid) for pid in left]
    out["processes_left_names"] = sorted({n for _, n in filter(None, with_names)})
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return out


def summarise(results: list[dict], samples: list[dict], shutdown: dict[str, Any],
              channels_before: list[str], args: argparse.Namespace) -> dict[str, Any]:
    verdicts = Counter(judge(r) for r in results)
    by_kind: dict[str, Counter] = {}
    for r in results:
        by_kind.setdefault(r["kind"], Counter())[judge(r)] += 1
    live = [s for s in samples if "procs" in s and not s.get("final")]
    warm = [s for s in live if s["t"] >= args.warmup_minutes * 60]
    growth = slope = None
    if len(warm) >= 3:
        import numpy as np

        t = np.array([s["t"] for s in warm]) / 60
        rss = np.array([s["rss_total"] for s in warm]) / 2**20
        slope = float(np.polyfit(t, rss, 1)[0])  # MiB per minute
        growth = float((rss[-1] - rss[0]) / rss[0])
    final = samples[-1] if samples else {}
    kv_back = bool(final.get("kv")) and all(v.get("free") == v.get("total") for v in final["kv"].values())
    new_channels = sorted(set(shutdown["channel_files_left"]) - set(channels_before))
    checks = {
        "no_5xx": verdicts["server_error"] == 0 and not any(r.get("stream_error") for r in results),
        "none_lost": verdicts["lost"] == 0 and not any(r.get("transport_error") for r in results),
        "bad_requests_refused_with_4xx": verdicts["wrong_refusal"] == 0,
        "json_valid": verdicts["invalid_json"] == 0,
        "top_logprobs_complete": sum(r.get("top_logprobs_missing", 0) for r in results) == 0,
        "kv_blocks_all_back": kv_back,
        "no_channel_files_left": not new_channels,
        "no_processes_left": shutdown["processes_left"] == 0,
        "clean_exit": shutdown["exit_code"] == 0,
        "memory_flat": growth is not None and growth < args.max_growth,
        "health_ok_throughout": all(s.get("health") == "ok" for s in live),
    }
    return {
        "requests": len(results), "verdicts": dict(verdicts), "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "transport_errors": [r["transport_error"] for r in results if r.get("transport_error")][:10],
        "stream_errors": [r["stream_error"] for r in results if r.get("stream_error")][:10],
        "rss_mib_first_after_warmup": warm[0]["rss_total"] / 2**20 if warm else None,
        "rss_mib_last": live[-1]["rss_total"] / 2**20 if live else None,
        "rss_growth_after_warmup": growth, "rss_slope_mib_per_min": slope,
        "max_channel_files_in_flight": max((s["channel_files"] for s in live), default=0),
        "final_kv": final.get("kv"), "shutdown": shutdown, "new_channel_files_left": new_channels,
        "checks": checks, "passed": all(checks.values()),
    }


def _compact(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample with its processes summed by name (the JSON stays small over a long run)."""
    by_name: Counter = Counter()
    for p in sample.get("procs", []):
        by_name[p["name"]] += p["rss"]
    return {**{k: v for k, v in sample.items() if k != "procs"}, "rss_by_process": dict(by_name)}


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in payload["samples"] if "rss_by_process" in s]
    t = [s["t"] / 60 for s in samples]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(t, [s["rss_total"] / 2**20 for s in samples], lw=2, color="k", label="all processes")
    per: dict[str, list[float]] = {}
    for k, s in enumerate(samples):
        for name, rss in s["rss_by_process"].items():
            per.setdefault(name, [float("nan")] * len(samples))[k] = rss / 2**20
    for name, ys in sorted(per.items(), key=lambda kv: -max(v for v in kv[1] if v == v))[:6]:
        ax.plot(t, ys, lw=1, label=name)
    ax.axvline(payload["settings"]["warmup_minutes"], color="grey", ls=":", lw=1)
    s = payload["summary"]
    ax.set_ylabel("RSS (MiB)")
    growth = s["rss_growth_after_warmup"]
    ax.set_title(f"Soak, {DEPLOYMENT[payload['settings']['colocated']]} server: {s['requests']} requests, {payload['settings']['minutes']:.0f} min; "
                 f"RSS {growth * 100:+.1f}% after warm-up" if growth is not None else "Soak")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(alpha=0.3)
    per_min = payload["finished_per_minute"]
    ax2.bar([m + 0.5 for m in range(len(per_min))], per_min, width=0.9, color="tab:blue", alpha=0.7)
    ax2.set_ylabel("requests / min")
    ax2.set_xlabel("minutes")
    failed = [k for k, ok in s["checks"].items() if not ok]
    ax2.set_title("all checks passed" if not failed else f"FAILED: {', '.join(failed)}", fontsize=9)
    m = payload["machine"]
    fig.text(0.01, 0.005, f"{m.get('cpu')} ({', '.join(m.get('cpu_isa', []))}), {m.get('logical_cpus')} CPUs, "
             f"commit {m.get('commit')}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (before the cap)")
    ap.add_argument("--concurrency", type=int, default=8, help="most requests in flight at once")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS / KV / health samples")
    ap.add_argument("--warmup-minutes", type=float, default=5.0, help="RSS growth is measured after this")
    ap.add_argument("--max-growth", type=float, default=0.05, help="largest RSS growth after warm-up that is 'flat'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--colocated", action="store_true", help="one engine instead of 1 prefill + 1 decode worker")
    ap.add_argument("--server-args", default="", help="more `specserve serve` flags, e.g. \"--draft-model auto\"")
    ap.add_argument("--out", default="soak")
    args = ap.parse_args()
    args.warmup_minutes = min(args.warmup_minutes, args.minutes / 3)

    channels_before = channel_files()
    port = free_port()
    log(f"starting the {DEPLOYMENT[args.colocated]} server on :{port}")
    proc = start_server(args, port)
    t0 = time.time()
    try:
        results, samples = asyncio.run(drive(args, f"http://127.0.0.1:{port}", proc.pid))
    finally:
        shutdown = stop_server(proc)
    summary = summarise(results, samples, shutdown, channels_before, args)
    done = [int((r["t1"] - t0) // 60) for r in results if r.get("t1")]
    payload = {"benchmark": f"soak ({DEPLOYMENT[args.colocated]} server, mixed load with disconnects)", "machine": machine_info(),
               "settings": vars(args), "summary": summary,
               "finished_per_minute": [done.count(m) for m in range(max(done, default=-1) + 1)],
               "samples": [_compact(s) for s in samples],
               "not_ok": [r for r in results if judge(r) not in ("ok", "dropped", "refused_ok")][:200]}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    log(json.dumps({k: summary[k] for k in ("requests", "verdicts", "rss_growth_after_warmup", "checks")}, indent=1))
    log(f"wrote {RESULTS_DIR / (args.out + '.json')} and .png")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
