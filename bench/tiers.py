"""Multi-turn chat with the prefix cache's host and disk tiers, against the KV pool alone.

Conversations share a system prompt and grow turn by turn (user message, greedy answer); turns
go round-robin over the conversations, so by the time a conversation comes back its history has
been pushed out of the small in-memory pool by the others (the working set, every unique token,
is several times the pool). Every turn after a conversation's first repeats its whole history:
that prefix is recomputed with the pool alone and loaded back from a lower tier with them.

Configurations, each a fresh engine with the same settings:
- `pool`: prefix caching in the KV pool only (specserve's default);
- `host+disk`: --kv-host-gib and --kv-disk-dir (an empty directory);
- `disk, restarted`: a new engine on the directory the previous one filled, no host tier:
  the first turns too find their prefix, on disk (a server restarted warm);
- with --layer-wise, each disk configuration twice: `, layer by layer` (`--kv-tier-load layer`:
  a hit's file is read, verified and written into the pool layer by layer on a thread while the
  forward runs each group of layers once its layers are in place: kv_cache/layer_load.py) and
  `, whole-block loads` (`--kv-tier-load whole`: every hit read, verified and written before the
  forward starts); plus `disk only` (no host tier, an empty directory: each repeated turn loads its
  history from disk and prefills the new message). specserve's default, `auto`, is `layer`
  only when a CPU is spare beyond the compute threads: compare with --threads below the CPUs;
- with --store, `store, another worker`: the `host+disk` engine also wrote every block to the
  deployment's KV block store (kv_cache/remote.py: a Ray actor, here on this machine), and a new
  engine with nothing but the store behind its pool runs the same turns: what a worker that never
  saw these conversations gets from blocks another worker computed (one host here, so Ray moves
  the blocks through shared memory, not a network).

Reports TTFT p50 of the repeated-prefix turns per configuration and their ratio, checks the
outputs are identical token for token, and the tiers' hit/byte/load-time counters.

    python bench/tiers.py                        # SmolLM2-135M, ~6 min on 2 cores
    python bench/tiers.py --conversations 8 --turns 4
    python bench/tiers.py --layer-wise           # layer-by-layer loads against whole-block ones
    python bench/tiers.py --layer-wise --cold    # ... with every disk hit read from the device
    python bench/tiers.py --layer-wise --threads 1   # ... with a CPU spare for the loader

Writes bench/results/tiers.json and tiers.png (tiers_layer_wise[_cold].* with those flags).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CODING, EDIT  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
STORE = "specserve-kv-store-bench"
WHOLE = ", whole-block loads"  # --kv-tier-load whole
LAYER = ", layer by layer"  # --kv-tier-load layer
SYSTEM = ("You are a meticulous senior engineer reviewing code and documents for a team. Answer with "
          "precise, complete sentences, cite the line you mean, and never invent an API. ") * 6


def log(msg: str) -> None:
    print(msg, flush=True)


def user_message(conv: int, turn: int) -> str:
    """A distinct user message: a code or text excerpt and a question about it."""
    src = CODING[(conv * 7 + turn) % len(CODING)] if (conv + turn) % 2 else EDIT[(conv * 3 + turn) % len(EDIT)][1]
    return f"\n\nUser (conversation {conv}, turn {turn}): please review this.\n{src}\nWhat would you change?\nAssistant:"


def evict_page_cache(directory: str) -> None:
    """Drop the disk tier's files from the OS page cache (POSIX_FADV_DONTNEED; no root needed), so
    the next hits read the device, as they do when the tier holds more than the RAM caches."""
    for path in Path(directory).rglob("*.kvb"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(config: str, args: argparse.Namespace, disk_dir: str | None) -> dict[str, Any]:
    """One configuration: every turn of every conversation, round-robin; TTFT and tokens per turn."""
    kw: dict[str, Any] = {}
    whole = config.endswith(WHOLE)  # lower-tier hits verified and written before the forward
    if config == "host+disk":
        kw = {"kv_host_gib": args.host_gib, "kv_disk_dir": disk_dir}
    elif config.startswith("disk, restarted"):
        kw = {"kv_disk_dir": disk_dir}
    elif config.startswith("disk only"):
        kw = {"kv_disk_dir": tempfile.mkdtemp(prefix="specserve-tiers-disk-only-")}
    elif config == "store, another worker":
        kw = {"kv_remote_store": STORE}
    if args.store and config == "host+disk":
        kw["kv_remote_store"] = STORE
    llm = LLM(MODEL, kv_cache_gib=args.kv_cache_gib, max_num_batched_tokens=args.chunk, num_threads=args.threads, **kw)
    if config.endswith((WHOLE, LAYER)):
        llm.engine.runner.tier_load = "whole" if whole else "layer"
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    system = tok.encode(SYSTEM)
    histories = [list(system) for _ in range(args.conversations)]
    llm.generate([tok.encode("Warm-up: hello.")], SamplingParams(max_tokens=2), use_tqdm=False)
    records = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for conv in range(args.conversations):
            prompt = histories[conv] + tok.encode(user_message(conv, turn), add_special_tokens=False)
            if args.cold and "kv_disk_dir" in kw:
                evict_page_cache(kw["kv_disk_dir"])
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            answer = out.outputs[0].token_ids
            records.append({"conversation": conv, "turn": turn, "prompt_tokens": len(prompt),
                            "cached_tokens": out.metrics.num_cached_prompt_tokens, "ttft_s": out.metrics.ttft_s,
                            "answer": answer})
            histories[conv] = prompt + answer
        log(f"  {config}: turn {turn + 1}/{args.turns} done ({time.perf_counter() - t0:.0f} s)")
    eng = llm.engine
    if eng.kv_manager.tiers is not None:
        eng.kv_manager.tiers.flush()  # every block written (disk, store) before the next engine looks
    unique = len(system) + sum(len(h) - len(system) for h in histories)
    stats = {k: v for k, v in eng.stats().items() if k.startswith("kv_tier_")}
    capacity = eng.kv_manager.capacity_tokens
    eng.close()
    if config.startswith("disk only"):
        shutil.rmtree(kw["kv_disk_dir"], ignore_errors=True)
    del llm, eng
    gc.collect()
    return {"records": records, "pool_tokens": capacity, "working_set_tokens": unique, "tier_stats": stats,
            "wall_s": time.perf_counter() - t0}


def summarize(res: dict[str, Any], all_turns: bool) -> dict[str, Any]:
    """TTFT p50/mean of repeated-prefix turns (turn >= 1; every turn after a restart) and hit shares."""
    rs = [r for r in res["records"] if all_turns or r["turn"] >= 1]
    ttft = [r["ttft_s"] for r in rs]
    return {"requests": len(rs), "ttft_p50_s": statistics.median(ttft), "ttft_mean_s": statistics.fmean(ttft),
            "cached_share": sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs)}


def plot(payload: dict[str, Any], path: Path) -> None:
    """TTFT by turn per configuration, and the repeated-prefix p50 bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    turns = payload["settings"]["turns"]
    for config, res in payload["runs"].items():
        p50 = [statistics.median(r["ttft_s"] for r in res["records"] if r["turn"] == t) for t in range(turns)]
        ax1.plot(range(1, turns + 1), [x * 1e3 for x in p50], marker="o", label=config)
    ax1.set_xlabel("turn")
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_yscale("log")
    ax1.set_title("time to first token by turn (history grows)")
    ax1.legend(fontsize=8)
    names = list(payload["summary"])
    vals = [payload["summary"][n]["ttft_p50_s"] * 1e3 for n in names]
    bars = ax2.bar([n.replace(", ", ",\n") for n in names], vals,
                   color=["#888", "#2a7", "#27a", "#a72", "#7a2", "#a27", "#2aa"][: len(names)])
    ax2.tick_params(axis="x", labelsize=7)
    ax2.bar_label(bars, fmt="%.0f ms")
    ax2.set_ylabel("TTFT p50 of repeated-prefix turns (ms)")
    ws = payload["working_set_over_pool"]
    ax2.set_title(f"working set {ws:.1f}x the KV pool; outputs identical: {payload['outputs_identical']}")
    m = payload["machine"]
    st = payload["settings"]
    extra = (f", {st['threads']} torch thread(s)" if st.get("threads") else "") + (", page cache dropped every turn" if st.get("cold") else "")
    fig.suptitle(f"bench/tiers.py, {MODEL} on {m.get('cpu')} ({m.get('commit')}){extra}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--kv-cache-gib", type=float, default=0.06, help="the in-memory KV pool (small on purpose)")
    ap.add_argument("--host-gib", type=float, default=2.0)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--disk-dir", default=None, help="disk tier directory (default: a temporary one, removed)")
    ap.add_argument("--layer-wise", action="store_true",
                    help="also each disk configuration with its hits verified and written whole before the forward "
                         "(the default loads them layer by layer beside it), and a disk-only one")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice, every CPU)")
    ap.add_argument("--cold", action="store_true",
                    help="before every turn, drop the disk tier's files from the page cache (hits read the device)")
    ap.add_argument("--store", action="store_true",
                    help="also the deployment's KV block store (a local Ray actor): a fresh engine with only the store")
    args = ap.parse_args()
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="specserve-tiers-")
    configs = ["pool", "host+disk", "disk, restarted"]
    if args.layer_wise:
        configs = ["pool", f"disk only{WHOLE}", f"disk only{LAYER}", "host+disk", f"disk, restarted{WHOLE}",
                   f"disk, restarted{LAYER}"]
    if args.store:
        from specserve.disagg.launch import init_ray
        from specserve.kv_cache.remote import start_kv_store

        init_ray(num_cpus=2)
        start_kv_store(4 << 30, name=STORE)
        configs.append("store, another worker")
    try:
        runs = {}
        for config in configs:
            log(f"{config}:")
            runs[config] = run(config, args, disk_dir)
    finally:
        if args.disk_dir is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    answers = {c: [r["answer"] for r in res["records"]] for c, res in runs.items()}
    identical = all(a == answers["pool"] for a in answers.values())
    for res in runs.values():  # the JSON keeps a digest of each answer, not its tokens
        for r in res["records"]:
            r["answer"] = hashlib.blake2b(str(r["answer"]).encode(), digest_size=8).hexdigest()
    summary = {c: summarize(res, all_turns=c.startswith(("disk, restarted", "store, another worker")))
               for c, res in runs.items()}
    base = summary["pool"]["ttft_p50_s"]
    for c in summary:
        summary[c]["speedup_vs_pool"] = base / summary[c]["ttft_p50_s"]
    ws = runs["pool"]["working_set_tokens"] / runs["pool"]["pool_tokens"]
    payload = {"benchmark": "multi-turn chat, prefix cache tiers", "machine": machine_info(), "model": MODEL,
               "settings": vars(args) | {"disk_dir": None}, "working_set_over_pool": ws,
               "outputs_identical": identical, "summary": summary, "runs": runs}
    for c, s in summary.items():
        log(f"{c:36} TTFT p50 {s['ttft_p50_s'] * 1e3:7.1f} ms  mean {s['ttft_mean_s'] * 1e3:7.1f} ms  "
            f"cached {s['cached_share']:.0%}  x{s['speedup_vs_pool']:.2f} vs pool")
    log(f"working set {ws:.1f}x the pool; outputs identical: {identical}")
    name = ("tiers_layer_wise" if args.layer_wise else "tiers") + ("_cold" if args.cold else "")
    name += f"_t{args.threads}" if args.threads else ""
    out = write_json(f"{name}.json", payload)
    plot(payload, RESULTS_DIR / f"{name}.png")
    log(f"wrote {out}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
