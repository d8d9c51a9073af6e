"""Load the bundled Qwen2.5-Coder GGUFs and check they generate coherent code.

Greedy-generates a few coding prompts through the chat template, prints the outputs, and
checks that the Python code each returns parses and (where a test is given) runs correctly.
Writes bench/results/qwen_check.json.

    python scripts/check_qwen.py [--models qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from specserve import LLM, SamplingParams

TASKS = [
    ("Write a Python function `is_prime(n)` that returns True if n is prime. Only the code.",
     "assert [x for x in range(20) if is_prime(x)] == [2, 3, 5, 7, 11, 13, 17, 19]"),
    ("Write a Python function `fib(n)` returning the n-th Fibonacci number with fib(0) == 0. Only the code.",
     "assert [fib(i) for i in range(10)] == [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]"),
    ("Write a Python function `reverse_words(s)` that reverses the order of words in a sentence. Only the code.",
     "assert reverse_words('hello big world') == 'world big hello'"),
]


def extract_code(text: str) -> str:
    m = re.search(r"```(?:python)?\n(.*?)```", text, re.DOTALL)
    return m.group(1) if m else text


def run_check(code: str, test: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    proc = subprocess.run([sys.executable, "-c", code + "\n" + test], capture_output=True, timeout=20)
    return proc.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    results = []
    for name in args.models:
        t0 = time.perf_counter()
        llm = LLM(name, dtype=args.dtype, kv_cache_gib=0.5)
        load_s = time.perf_counter() - t0
        msgs = [[{"role": "user", "content": q}] for q, _ in TASKS]
        outs = llm.chat(msgs, SamplingParams(max_tokens=args.max_tokens, temperature=0))
        for (q, test), out in zip(TASKS, outs):
            code = extract_code(out.text)
            ok = run_check(code, test)
            print(f"=== {name}: {q}\n{out.text}\n--- passes its test: {ok}\n")
            results.append({
                "model": name, "prompt": q, "output": out.text, "passes_test": ok,
                "num_generated_tokens": out.metrics.num_generated_tokens,
                "decode_tok_s": (1 / out.metrics.tpot_s) if out.metrics.tpot_s else None,
                "load_s": load_s,
            })
        del llm
    out_path = Path(__file__).resolve().parents[1] / "bench" / "results" / "qwen_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    passed = sum(r["passes_test"] for r in results)
    print(f"{passed}/{len(results)} generated functions pass their tests; wrote {out_path}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
