"""Defaults against the best flags: what a user who passes no flag gets, measured.

1. Qwen2.5-Coder-1.5B plain: `LLM(model)` with no precision flag vs the best flags known
   (`quantization="auto"`), and the pair: `LLM(model, draft_model="auto")` vs the best draft
   flags known (int4 draft, 65,536-token head, K <= 8, p_min 0.8). Batch 1, greedy, the same
   coding prompts, the two engines of each pair alternating prompt by prompt for `--rounds`.
2. `specserve serve` with `./dev.sh serve`'s default arguments on SmolLM2: TPOT of the
   server at a given commit (`--before REV`, run from a git worktree) and of this checkout,
   over HTTP on loopback.

    python bench/defaults.py [--before 6df3f9c] [--rounds 2]

Writes bench/results/defaults.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_json  # noqa: E402
from prompts import CODING  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
BEST_DRAFT = dict(draft_model=DRAFT, quantization="auto", draft_quantization="int4", draft_vocab_size=65536,
                  num_spec_tokens=8, draft_p_min=0.8)
SERVE_ARGS = ["--model", "smollm2-135m-instruct", "--spec-method", "ngram", "--spec-policy", "adaptive"]


def log(msg: str) -> None:
    print(msg, flush=True)


def decode_rate(llm: LLM, prompt: str, max_tokens: int) -> tuple[int, float]:
    """(tokens after the first, seconds from the first token to the last)."""
    llm.engine.kv_manager.reset_prefix_cache()
    llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)[0]
    m = out.metrics
    return m.num_generated_tokens - 1, m.e2e_s - m.ttft_s


def compare(name: str, engines: dict[str, LLM], prompts: list[str], rounds: int, max_tokens: int) -> dict:
    totals = {k: [0, 0.0] for k in engines}
    for _ in range(rounds):
        for p in prompts:
            for label, llm in engines.items():
                n, t = decode_rate(llm, p, max_tokens)
                totals[label][0] += n
                totals[label][1] += t
    rates = {k: n / t for k, (n, t) in totals.items()}
    labels = list(engines)
    row = {"case": name, "tokens_per_s": rates, "default_vs_best": rates[labels[0]] / rates[labels[1]],
           "configs": {k: {"quantization": e.engine.config.model.quantization, "spec": e.engine.config.spec.method,
                           "draft": e.engine.config.spec.draft_model, "trees": e.engine.policy.trees}
                       for k, e in engines.items()}}
    log(f"{name}: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in rates.items()) + f"  (default / best {row['default_vs_best']:.3f})")
    return row


def serve_tpot(src: Path, n_prompts: int, max_tokens: int) -> dict:
    """Start `specserve serve` from the package at src with ./dev.sh serve's defaults; TPOT over HTTP."""
    import httpx

    port = 8300 + os.getpid() % 500
    env = dict(os.environ, PYTHONPATH=str(src), SPECSERVE_PROGRESS="0")
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", *SERVE_ARGS, "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("server did not start")
        gaps = []
        for p in CODING[:n_prompts]:
            body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": p}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True}
            times = []
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        times.append(time.perf_counter())
            if len(times) > 1:
                gaps.append((times[-1] - times[0]) / (len(times) - 1))
        return {"tpot_s": sum(gaps) / len(gaps), "requests": len(gaps)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--before", default="6df3f9c", help="commit whose ./dev.sh serve defaults to compare with ('' skips)")
    ap.add_argument("--sections", nargs="+", default=["plain", "pair", "serve"])
    args = ap.parse_args()
    payload: dict = {"benchmark": "defaults vs best flags", "machine": machine_info(), "settings": vars(args), "rows": []}
    prompts = None
    if "plain" in args.sections or "pair" in args.sections:
        probe = LLM(TARGET, kv_cache_gib=0.5, spec_method="none")
        tok = probe.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CODING[: args.prompts]]
    if "plain" in args.sections:
        engines = {"default: LLM(model)": probe, "best flags: quantization=auto": LLM(TARGET, quantization="auto")}
        payload["rows"].append(compare("qwen 1.5B plain", engines, prompts, args.rounds, args.max_tokens))
        del engines
    if "plain" in args.sections or "pair" in args.sections:
        del probe
    if "pair" in args.sections:
        engines = {"default: LLM(model, draft_model='auto')": LLM(TARGET, draft_model="auto"),
                   "best flags known": LLM(TARGET, **BEST_DRAFT)}
        payload["rows"].append(compare("qwen 1.5B + 0.5B draft", engines, prompts, args.rounds, args.max_tokens))
        del engines
    if "serve" in args.sections:
        here = Path(__file__).resolve().parents[1]
        serve = {"args": SERVE_ARGS}
        if args.before:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(["git", "worktree", "add", "--detach", tmp, args.before], cwd=here, check=True,
                               capture_output=True)
                try:
                    serve["before"] = {"commit": args.before, **serve_tpot(Path(tmp) / "src", args.prompts, args.max_tokens)}
                finally:
                    subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=here, capture_output=True)
            log(f"serve defaults at {args.before}: TPOT {serve['before']['tpot_s'] * 1e3:.1f} ms")
        serve["after"] = serve_tpot(here / "src", args.prompts, args.max_tokens)
        log(f"serve defaults now: TPOT {serve['after']['tpot_s'] * 1e3:.1f} ms")
        payload["serve_smollm2"] = serve
    path = write_json("defaults.json", payload)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
