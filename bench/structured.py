"""Structured output: what a JSON schema costs, and what speculation buys under it.

For one model (SmolLM2 by default; `--model qwen2.5-coder-1.5b-instruct --draft-model auto` for
the Qwen pair) on its default precision, each configuration decodes the same JSON-producing
prompts at batch 1 (one after another) and at batch 8 (all at once), greedy:
  plain            no constraint, no speculation (the rate a user gets today)
  json-token-by-token  the schema, one token per step (speculative=False: no drafts at all)
  json             the schema, no proposer: the text the grammar forces is drafted and verified
  json+<method>    the schema with speculation (ngram, lookahead; draft with --draft-model)
Every constrained output is parsed and validated against the schema; the time spent building
and applying masks is reported next to the forward time.

    python bench/structured.py                      # SmolLM2, ~5 min on 2 cores
    python bench/structured.py --model qwen2.5-coder-1.5b-instruct --draft-model auto

Writes bench/results/structured.json and structured.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine_info, write_json  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.sampling_params import StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 40},
        "language": {"enum": ["python", "rust", "go", "javascript"]},
        "arguments": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}, "type": {"type": "string", "maxLength": 24}},
            "required": ["name", "type"], "additionalProperties": False}},
        "returns": {"type": "string", "maxLength": 40},
        "complexity": {"enum": ["O(1)", "O(log n)", "O(n)", "O(n log n)", "O(n^2)"]},
        "summary": {"type": "string", "maxLength": 160},
    },
    "required": ["function", "language", "arguments", "returns", "complexity", "summary"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a Python function that merges overlapping intervals as a JSON object.",
    "Give a JSON description of a binary search function over a sorted list.",
    "As JSON: a Rust function that counts word frequencies in a text.",
    "Describe, in JSON, a Go function that checks whether a string is a palindrome.",
    "JSON for a JavaScript function that debounces another function.",
    "Describe a Python generator of prime numbers as JSON.",
    "As a JSON object, describe a function that flattens a nested list.",
    "Describe an LRU cache's get method as JSON.",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def run(llm: LLM, prompts: list[str], structured: bool, batch: int, max_tokens: int,
        forced: bool = True) -> dict[str, Any]:
    so = StructuredOutput.json(SCHEMA) if structured else None
    # speculative=False also turns off the drafts of forced text (the "json, token by token" row).
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=so,
                            speculative=None if forced else False)
    eng = llm.engine
    eng.kv_manager.reset_prefix_cache()
    eng.reset_suffix_cache()  # earlier runs' outputs would draft this one's
    c0, g0, f0 = dict(eng.spec_counters), eng.runner.grammar_time_s, eng.runner.forward_time_s
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = 0
    if structured:
        import jsonschema

        for o in outs:
            try:
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    drafted = eng.spec_counters["num_draft_tokens"] - c0["num_draft_tokens"]
    accepted = eng.spec_counters["num_accepted_tokens"] - c0["num_accepted_tokens"]
    return {
        "batch": batch, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "valid": valid if structured else None, "requests": len(outs),
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_step": accepted / max(eng.spec_counters["num_drafts"] - c0["num_drafts"], 1) if drafted else None,
        "grammar_time_s": eng.runner.grammar_time_s - g0, "forward_time_s": eng.runner.forward_time_s - f0,
    }


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    batches = sorted({r["batch"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        vals = [next((r["tokens_per_s"] for r in rows if r["config"] == c and r["batch"] == b), 0) for c in configs]
        xs = [i + (j - (len(batches) - 1) / 2) * width for i in range(len(configs))]
        ax.bar(xs, vals, width=width, label=f"batch {b}")
        for x, v, c in zip(xs, vals, configs):
            r = next((r for r in rows if r["config"] == c and r["batch"] == b), None)
            note = f"{v:.0f}" + (f"\n{r['speedup_vs_json']:.2f}x" if r and r.get("speedup_vs_json") else "")
            ax.annotate(note, (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(configs)), configs)
    ax.set_ylabel("generated tokens/s (greedy)")
    ax.set_title(f"{payload['model']}: JSON-schema decoding, with and without speculation\n"
                 f"{payload['machine'].get('cpu', '')} @ {payload['machine'].get('commit', '')}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model", default=None, help="a draft model for the `draft` method (auto: the bundled sibling)")
    ap.add_argument("--methods", nargs="+", default=["ngram", "lookahead"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    methods = args.methods + (["draft"] if args.draft_model else [])
    probe = LLM(args.model, kv_cache_gib=1.0)
    tok = probe.engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS[: args.prompts]]
    rows = []
    configs: list[tuple[str, LLM, bool]] = [("plain", probe, False), ("json-token-by-token", probe, True),
                                            ("json", probe, True)]
    for m in methods:
        kw = {"draft_model": args.draft_model} if m == "draft" else {}
        configs.append((f"json+{m}", LLM(args.model, kv_cache_gib=1.0, spec_method=m, **kw), True))
    for name, llm, structured in configs:
        # Warm-up: first-use costs, and the schema's compilation (once per process: ~1 s) are not timed.
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0,
                                                structured_output=StructuredOutput.json(SCHEMA)), use_tqdm=False)
        for b in args.batches:
            r = run(llm, prompts, structured, b, args.max_tokens, forced=name != "json-token-by-token")
            r["config"] = name
            rows.append(r)
            log(f"{name:16s} batch {b:2d}: {r['tokens_per_s']:7.1f} tok/s  valid {r['valid']}  "
                f"acceptance {r['acceptance_rate']}  grammar {r['grammar_time_s']:.2f}s of forward {r['forward_time_s']:.2f}s")
    for r in rows:
        base = next(x for x in rows if x["config"] == "json" and x["batch"] == r["batch"])
        r["speedup_vs_json"] = r["tokens_per_s"] / base["tokens_per_s"]
    payload = {"model": args.model, "machine": machine_info(), "schema": SCHEMA, "rows": rows,
               "settings": vars(args)}
    path = write_json("structured.json", payload)
    plot(payload, RESULTS_DIR / "structured.png")
    log(f"wrote {path} and structured.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
