"""Long prompts, short answers, no max_tokens: what a draft model's catch-up costs at batch 1.

Each request is ~650 tokens of Python standard-library source and a question answered in a
word or two (10-19 tokens); max_tokens is left out, so a request may run to its context window.
A draft model must first feed a request's prompt through its own cache before it drafts (one
pass of ~1 s for the 0.5B on 2 vCPUs) and gains back only what the short answer lets it. The
policy charges that catch-up over the tokens a request is expected to have left (the recent
answers' lengths once eight have finished); each mode runs in a fresh process, one request at a
time, in the order given, so the first answers (nothing learned yet) show apart from the rest.

    python bench/short_answers.py                      # plain, then the draft model (adaptive)
    python bench/short_answers.py --modes spec plain --requests 12

Writes bench/results/short_answers.json and .png (seconds per request, by mode).
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

MODULES = ["json", "argparse", "difflib", "csv", "http.client", "email.message", "logging", "string",
           "shutil", "tarfile", "zipfile", "pathlib", "fractions"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts: a 2,600-character slice of a standard-library module and a one-word question."""
    import importlib

    out = []
    for k in range(n):
        src = inspect.getsource(importlib.import_module(MODULES[k % len(MODULES)]))
        start = (k * 3000) % max(1, len(src) - 2600)
        ask = src[start:start + 2600] + "\n\nIn one word: which Python module is this code from?"
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}]))
    return out


def child(args: argparse.Namespace) -> None:
    """One mode in this process: prints one JSON line."""
    from specserve import LLM, SamplingParams

    llm = LLM(args.target, quantization="auto", draft_model=args.draft, spec_copy="none",
              spec_policy="adaptive" if args.child == "spec" else "off")
    todo = prompts(llm.engine.tokenizer, args.requests + 1)
    params = SamplingParams(max_tokens=None, temperature=0)
    llm.generate([todo[0]], params, use_tqdm=False)  # warm-up (not timed)
    seconds, tokens = [], []
    for p in todo[1:]:
        t0 = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - t0)
        tokens.append(len(out.token_ids))
    c = llm.engine.spec_counters
    print(json.dumps({"mode": args.child, "seconds": seconds, "answer_tokens": tokens,
                      "draft_tokens": c["num_draft_tokens"], "draft_time_s": c["draft_time_s"]}))


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in payload["runs"]:
        ax.plot(range(1, len(run["seconds"]) + 1), run["seconds"], "o-", label=f"{run['mode']} ({sum(run['seconds']):.1f} s)")
    ax.set_xlabel("request (one at a time, in order)")
    ax.set_ylabel("seconds")
    mi = payload["machine"]
    ax.set_title(f"long prompts, short answers, no max_tokens\n{payload['settings']['target']} + "
                 f"{payload['settings']['draft']} — {mi['cpu']}, commit {mi['commit']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--requests", type=int, default=24, help="timed requests per mode")
    ap.add_argument("--modes", nargs="+", default=["plain", "spec"], choices=["plain", "spec"])
    ap.add_argument("--out", default="short_answers")
    ap.add_argument("--child", choices=["plain", "spec"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    runs = []
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", mode, "--target", args.target, "--draft", args.draft,
               "--requests", str(args.requests)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        run = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(run)
        half = len(run["seconds"]) // 3
        print(f"{mode:5s}: {sum(run['seconds']):.1f} s for {len(run['seconds'])} requests "
              f"(first {half}: {sum(run['seconds'][:half]):.1f} s, the rest {sum(run['seconds'][half:]):.1f} s), "
              f"{run['draft_tokens']} draft tokens, {run['draft_time_s']:.1f} s drafting", flush=True)
    payload = {"benchmark": "short answers to long prompts", "machine": machine_info(), "settings": vars(args), "runs": runs}
    write_json(f"{args.out}.json", payload)
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    print(f"wrote {RESULTS_DIR / args.out}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
