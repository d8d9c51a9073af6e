"""Speculative decoding benchmark: Qwen2.5-Coder 1.5B target, 0.5B draft, on this machine.

Sections (all by default, in one run):
  trees       batch 1, greedy: plain vs chain vs tree drafts for the draft model, prompt lookup,
              reference and lookahead, on coding and edit prompts; per prompt the three modes run
              back to back (chain and tree each on an engine of its own, plain on the chain one
              with speculation off), so a noisy machine's drift hits all three alike and each
              mode's policy learns from its own steps only
  batch1      tokens/s and speedup of none / draft / ngram / reference at batch 1, greedy and
              T=0.7, on coding prompts and on "edit this code" prompts (reference = the code)
  ksweep      K = 1..8 with the draft model: measured acceptance and tokens per step against
              the geometric-model prediction (1 - b^(K+1)) / (1 - b), and the speedup
  batchsweep  batch 1..64: policy none vs always vs adaptive (--batch-method, the draft model by default)
  hf          HF transformers on the same GGUF pair: plain, assisted generation
              (assistant_model) and prompt lookup (prompt_lookup_num_tokens), batch 1 greedy
  drafthead   the draft model's LM head: its first --draft-vocab ids alone, with the ids the
              requests use learned (the default), and the whole vocabulary, against plain;
              the four engines alternate prompt by prompt in one process (--tree-sets, e.g.
              chinese: a third of the target's tokens there lie above the first 65,536 ids)
  shift       traffic that changes, batch 1: an engine that first served prose answers sampled
              hot (--shift-temperature; its drafts mostly rejected), then the coding prompts
              greedy, against a fresh engine and plain on the same coding prompts, the three
              alternating prompt by prompt; fresh engines each of --shift-rounds rounds

    python bench/spec.py                       # everything (~1 h on 2 CPU cores)
    python bench/spec.py --sections trees batchsweep
    python bench/spec.py --sections batch1 --prompts 2 --max-tokens 48   # a quick look

Writes bench/results/spec.json and spec.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from prompts import CHINESE, CODING, EDIT, PROSE  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.config import SpecConfig  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.models.bundled import resolve_model  # noqa: E402
from specserve.models.loader import load_model_files  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


class Bench:
    """Holds the loaded checkpoints and builds engines that share them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        t0 = time.perf_counter()
        # The fast path computes from the GGUF's blocks: keep them (a float checkpoint on `auto`
        # would silently run the float layers). Engines share these checkpoints read-only.
        blocks = args.quantization in ("auto", "int4")
        self.target = load_model_files(resolve_model(args.target), keep_blocks=blocks)
        self.draft = load_model_files(resolve_model(args.draft), keep_blocks=blocks and args.draft_quantization in (None, "auto", "int4"))
        log(f"loaded checkpoints in {time.perf_counter() - t0:.1f}s")
        tok = self.target.tokenizer
        self.coding = [(tok.apply_chat_template([{"role": "user", "content": p}]), None)
                       for p in CODING[: args.prompts]]
        self.edit = [(tok.apply_chat_template([{"role": "user", "content": p}]), ref)
                     for p, ref in EDIT[: args.prompts]]
        self.prose = [(tok.apply_chat_template([{"role": "user", "content": p}]), None)
                      for p in PROSE[: args.prompts]]
        self.chinese = [(tok.apply_chat_template([{"role": "user", "content": p}]), None)
                        for p in CHINESE[: args.prompts]]

    def llm(self, method: str, policy: str = "adaptive", k: int = 4, **kw: Any) -> LLM:
        gc.collect()
        quant = self.args.quantization
        method, parts = _method_parts(method)
        kw.update(parts)
        if method == "none-int8":  # the plain baseline on the int8 weight-only target, for reference
            method, quant = "none", "int8"
        if method == "lookahead" and self.args.lookahead_corpus:
            kw.setdefault("lookahead_corpus", self.args.lookahead_corpus)
        if method == "eagle":
            kw.setdefault("draft_model", self.args.eagle_head or "auto")
        if self.args.draft_p_min is not None:
            kw.setdefault("draft_p_min", self.args.draft_p_min)
        if self.args.max_draft_nodes is not None:
            kw.setdefault("max_draft_nodes", self.args.max_draft_nodes)
        if method == "draft":
            if self.args.draft_quantization:
                kw.setdefault("draft_quantization", self.args.draft_quantization)
            kw.setdefault("draft_vocab_size", self.args.draft_vocab)
        llm = LLM(
            self.args.target, dtype=self.args.dtype, checkpoint=self.target, kv_cache_gib=1.0,
            spec_method=method, spec_policy=policy, num_spec_tokens=k, quantization=quant,
            draft_checkpoint=self.draft if method == "draft" else None,
            max_num_seqs=64, max_num_batched_tokens=1024, **kw,
        )
        # Warm-up: first-use costs (kernel set-up for new shapes, first touch of the KV pages)
        # must not be billed to whichever configuration happens to run first.
        llm.generate(self.coding[0][0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        llm.engine.kv_manager.reset_prefix_cache()
        llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
        return llm


def _method_parts(name: str) -> tuple[str, dict[str, str]]:
    """A row's proposer name as the method and its LLM keywords: "draft+ngram" is the draft model
    with --spec-copy ngram in front of it; "eagle+join", "eagle+none+join" join lookahead's
    candidates into its trees (--spec-join lookahead)."""
    method, *extra = name.split("+")
    kw = {}
    for part in extra:
        if part == "join":
            kw["spec_join"] = "lookahead"
        else:
            kw["spec_copy"] = part
    return method, kw


def _check_methods(ap: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Refuse a proposer name the engine would refuse, before any model loads (a bad row would
    otherwise stop the run after the rows before it)."""
    for name in names:
        method, kw = _method_parts(name)
        if method == "none-int8":
            continue
        try:
            SpecConfig(method=method, draft_model="draft" if method == "draft" else None,
                       copy=kw.get("spec_copy", "auto"), join=kw.get("spec_join", "none"))
        except ConfigError as e:
            ap.error(f"{name}: {e}")


def run_sequential(llm: LLM, prompts: list[tuple[str, str | None]], temperature: float, max_tokens: int) -> dict:
    """Each prompt alone (batch 1); aggregate tokens/s and speculation counters."""
    gen = e2e = decode_t = 0.0
    drafted = accepted = spec_steps = target_steps = 0
    eng = llm.engine
    before = dict(eng.spec_counters)
    pos_d0, pos_a0 = list(eng.drafted_per_position), list(eng.accepted_per_position)
    for i, (prompt, ref) in enumerate(prompts):
        # Every configuration starts cold: no prompt is served from an earlier run's cache.
        eng.kv_manager.reset_prefix_cache()
        eng.reset_suffix_cache()  # earlier runs' outputs would draft this one's
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 + i,
                                reference_text=ref, ignore_eos=False)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m = out.metrics
        gen += m.num_generated_tokens
        e2e += m.e2e_s
        decode_t += m.e2e_s - m.ttft_s
        x = m.extra
        drafted += x["num_draft_tokens"]
        accepted += x["num_accepted_tokens"]
        spec_steps += x["num_spec_steps"]
        target_steps += x["num_target_steps"]
    per_pos_d = [d - d0 for d, d0 in zip(eng.drafted_per_position, pos_d0 + [0] * 64)]
    per_pos_a = [a - a0 for a, a0 in zip(eng.accepted_per_position, pos_a0 + [0] * 64)]
    delta = {k: eng.spec_counters[k] - before[k] for k in before}
    return {
        "generated_tokens": gen,
        "tokens_per_s": gen / e2e,
        "decode_tokens_per_s": (gen - len(prompts)) / decode_t if decode_t else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_per_spec_step": accepted / spec_steps if spec_steps else None,
        "target_forwards_per_token": target_steps / gen if gen else None,
        "acceptance_per_position": [a / d if d else None for a, d in zip(per_pos_a, per_pos_d) if d],
        "draft_time_s": delta["draft_time_s"],
        "verify_time_s": delta["verify_time_s"],
        "plain_forward_time_s": delta["decode_time_s"],  # forwards without drafts (incl. prefill)
        "ttft_total_s": e2e - decode_t,
    }


def section_trees(b: Bench) -> list[dict]:
    """Batch 1, greedy: plain / chain / tree per proposer, the modes interleaved prompt by prompt.

    Chain and tree run on engines of their own (plain on the chain one, speculation off), so
    each mode's policy and proposer learn only from its own steps, as a server in that mode
    would: on one engine switched between the modes, the chain steps fed the pooled estimates
    and source trusts the tree steps were sized from (lookahead on the coding prompts drafted
    2.2 nodes per tree step in one such run, 3.5 on an engine of its own)."""
    rows = []
    for method in b.args.tree_methods:
        engines = {shape: b.llm(method, b.args.tree_policy, b.args.tree_k, spec_tree=shape) for shape in ("chain", "tree")}
        held = {shape: _count_held_steps(e.engine.policy.guard) for shape, e in engines.items()}
        modes = {"plain": engines["chain"], "chain": engines["chain"], "tree": engines["tree"]}
        eng = engines["tree"].engine
        sets = {"coding": b.coding, "edit": b.edit, "prose": b.prose, "chinese": b.chinese}
        for set_name, prompts in [(n, sets[n]) for n in b.args.tree_sets]:
            if method == "reference" and set_name != "edit":
                continue  # nothing to copy from
            acc = {m: {"gen": 0, "t": 0.0, "steps": 0, "accepted": 0, "drafted": 0, "lengths": [], "same": 0,
                       "holds": 0, "probes": 0, "held_steps": 0} for m in TREE_MODES}
            for prompt, ref in prompts:
                plain_ids = None
                for mode in TREE_MODES:
                    llm = modes[mode]
                    llm.engine.set_speculation(mode != "plain")
                    llm.engine.kv_manager.reset_prefix_cache()
                    llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
                    params = SamplingParams(max_tokens=b.args.max_tokens, temperature=0, reference_text=ref)
                    guard, steps = llm.engine.policy.guard, held["tree" if mode == "tree" else "chain"]
                    before = guard.num_held, guard.num_plain_probes, steps[0]
                    out = llm.generate(prompt, params, use_tqdm=False)[0]
                    m, a = out.metrics, acc[mode]
                    a["holds"] += guard.num_held - before[0]  # the rate guard held speculation off (RateGuard)
                    a["probes"] += guard.num_plain_probes - before[1]
                    a["held_steps"] += steps[0] - before[2]
                    a["gen"] += m.num_generated_tokens - 1
                    a["t"] += m.e2e_s - m.ttft_s
                    a["steps"] += m.extra["num_target_steps"] - 1
                    a["accepted"] += m.extra["num_accepted_tokens"]
                    a["drafted"] += m.extra["num_draft_tokens"]
                    a["lengths"] += m.extra.get("accepted_lengths", [])
                    ids = out.outputs[0].token_ids
                    plain_ids = ids if mode == "plain" else plain_ids
                    a["same"] += ids == plain_ids  # greedy speculation must reproduce plain decoding
            pol = eng.policy
            # From the policy's start-up timings (made by the adaptive policy only).
            profiled = b.args.tree_policy == "adaptive" and eng.proposer.traits.cost == "per_pass"
            pass_ratio = pol.draft_time(1) / pol.target_time(1) if profiled else None
            for mode in TREE_MODES:
                a = acc[mode]
                rows.append({
                    "method": method, "mode": mode, "prompt_set": set_name, "draft_pass_over_target_step": pass_ratio,
                    "decode_tokens_per_s": a["gen"] / a["t"], "tokens_per_step": a["gen"] / max(a["steps"], 1),
                    "draft_nodes_per_step": a["drafted"] / max(a["steps"], 1), "accepted_tokens": a["accepted"],
                    "accepted_length_histogram": _histogram(a["lengths"]),
                    "prompts_equal_to_plain": f"{a['same']}/{len(prompts)}",
                    "rate_guard_holds": a["holds"], "rate_guard_held_steps": a["held_steps"],
                    "rate_guard_plain_probes": a["probes"],
                    # What the proposer drafted from (lookahead: its corpus, with or without the
                    # model's own answers from build-corpus, which move its acceptance).
                    "proposer_note": eng.proposer.describe() or None,
                })
            plain = next(r for r in rows if r["method"] == method and r["prompt_set"] == set_name and r["mode"] == "plain")
            for r in rows[-len(TREE_MODES):]:
                r["speedup_vs_plain"] = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                log(f"trees {method:9s} {set_name:6s} {r['mode']:5s}: {r['decode_tokens_per_s']:6.2f} tok/s "
                    f"x{r['speedup_vs_plain']:.2f}, {r['tokens_per_step']:.2f} tokens/step, {r['draft_nodes_per_step']:.1f} nodes/step, "
                    f"output equal to plain {r['prompts_equal_to_plain']}, guard holds {r['rate_guard_holds']} ({r['rate_guard_held_steps']} steps)")
        llm = eng = modes = engines = None  # both engines go before the next method builds its own
    return rows


TREE_MODES = ("plain", "chain", "tree")


def _count_held_steps(guard: Any) -> list[int]:
    """A counter of the decode steps whose drafts the rate guard held off: the engine asks
    guard.copy_resumes on each such step, and the hold stays where it answers False."""
    count = [0]
    ask = guard.copy_resumes

    def counted(batch: int, copyable: bool) -> bool:
        ended = ask(batch, copyable)
        count[0] += not ended
        return ended

    guard.copy_resumes = counted
    return count


def _histogram(values: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _alternating(engines: dict[str, LLM], prompts: list[tuple[str, str | None]], rnd: int,
                 params: Callable[[str | None], SamplingParams]) -> dict[str, list]:
    """Every prompt on every engine, the engines back to back in an order that alternates by
    prompt and round (a noisy machine's drift hits all alike), each starting without cached
    prompts or outputs: each engine's outputs in prompt order."""
    outs: dict[str, list] = {name: [] for name in engines}
    for i, (prompt, ref) in enumerate(prompts):
        for name in list(engines) if (i + rnd) % 2 == 0 else list(engines)[::-1]:
            llm = engines[name]
            llm.engine.kv_manager.reset_prefix_cache()
            llm.engine.reset_suffix_cache()
            outs[name].append(llm.generate(prompt, params(ref), use_tqdm=False)[0])
    return outs


def _summed(outs: list, **counters: str) -> dict[str, Any]:
    """Generated tokens, decode seconds (after the first token), target steps and the outputs'
    token ids of one engine's outputs, and each named speculation counter summed."""
    sums: dict[str, Any] = {"gen": sum(o.metrics.num_generated_tokens for o in outs),
                            "t": sum(o.metrics.e2e_s - o.metrics.ttft_s for o in outs),
                            "steps": sum(o.metrics.extra["num_target_steps"] for o in outs),
                            "outputs": [o.token_ids for o in outs]}
    sums.update({key: sum(o.metrics.extra[counter] for o in outs) for key, counter in counters.items()})
    return sums


def section_drafthead(b: Bench) -> list[dict]:
    """Draft-model tokens per step and decode speed by LM head, batch 1, greedy (see the module doc).
    Fresh engines per prompt set; --drafthead-rounds passes over its prompts, the heads keeping
    what they learned from one pass to the next (as a server's would)."""
    k, policy = b.args.tree_k, b.args.tree_policy
    sets = {"coding": b.coding, "edit": b.edit, "prose": b.prose, "chinese": b.chinese}
    rows = []
    for set_name in b.args.tree_sets:
        engines = {"plain": b.llm("none"), "first_ids": b.llm("draft", policy, k), "learned": b.llm("draft", policy, k),
                   "whole": b.llm("draft", policy, k, draft_vocab_size=0)}
        head = engines["first_ids"].engine.proposer.learning_head
        if head is not None:
            head.stop_learning()  # also what the warm-up taught it
        for rnd in range(b.args.drafthead_rounds):
            outs = _alternating(engines, sets[set_name], rnd, lambda ref: SamplingParams(
                max_tokens=b.args.max_tokens, temperature=0, reference_text=ref))
            acc = {name: _summed(os, drafted="num_draft_tokens", accepted="num_accepted_tokens")
                   for name, os in outs.items()}
            n = len(sets[set_name])
            base = (acc["plain"]["gen"] - n) / acc["plain"]["t"]
            for name, a in acc.items():
                rate = (a["gen"] - n) / a["t"]
                head = engines[name].engine.proposer.learning_head if name != "plain" else None
                learned = head.num_learned if head is not None else 0
                same = a["outputs"] == acc["plain"]["outputs"]
                rows.append({"prompt_set": set_name, "round": rnd, "head": name, "prompts": n, "policy": policy,
                             "k_max": k, "decode_tokens_per_s": rate, "speedup_vs_plain": rate / base,
                             "tokens_per_step": a["gen"] / a["steps"], "draft_tokens": a["drafted"],
                             "accepted_tokens": a["accepted"], "learned_ids": learned, "outputs_equal_plain": same})
                log(f"drafthead {set_name:7s} round {rnd} {name:9s}: {rate:6.2f} tok/s x{rate / base:.2f}, "
                    f"{a['gen'] / a['steps']:.2f} tokens/step, {learned} ids learned, outputs equal to plain: {same}")
        del engines
    return rows


def section_shift(b: Bench) -> list[dict]:
    """Does the adaptive policy draft on text that drafts well after text that did not? Per round:
    a "shifted" engine answers the prose prompts sampled at --shift-temperature, then it, a fresh
    engine and a plain one answer the coding prompts greedy, alternating prompt by prompt."""
    method = b.args.batch_method
    prelude = SamplingParams(max_tokens=128, temperature=b.args.shift_temperature, top_p=1.0)
    tok = b.target.tokenizer
    hot = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROSE[:8]]
    rows = []
    for rnd in range(b.args.shift_rounds):
        engines = {"plain": b.llm("none"), "fresh": b.llm(method), "shifted": b.llm(method)}
        for i, prompt in enumerate(hot):
            engines["shifted"].generate(prompt, dataclasses.replace(prelude, seed=100 * rnd + i), use_tqdm=False)
        outs = _alternating(engines, b.coding, rnd, lambda ref: SamplingParams(max_tokens=b.args.max_tokens, temperature=0))
        acc = {name: _summed(os, spec_steps="num_spec_steps") for name, os in outs.items()}
        for name, os in outs.items():
            acc[name]["held_answers"] = sum(o.metrics.extra["num_spec_steps"] < o.metrics.extra["num_target_steps"] / 4
                                            for o in os)
        n = len(b.coding)
        base = (acc["plain"]["gen"] - n) / acc["plain"]["t"]
        for name, a in acc.items():
            rate = (a["gen"] - n) / a["t"]
            same = a["outputs"] == acc["plain"]["outputs"]
            rows.append({"round": rnd, "engine": name, "method": "none" if name == "plain" else method,
                         "prelude_temperature": b.args.shift_temperature, "prompts": n,
                         "decode_tokens_per_s": rate, "speedup_vs_plain": rate / base,
                         "tokens_per_step": a["gen"] / a["steps"], "spec_steps": a["spec_steps"],
                         "target_steps": a["steps"], "answers_drafting_in_under_a_quarter_of_steps": a["held_answers"],
                         "outputs_equal_plain": same})
            log(f"shift round {rnd} {name:8s}: {rate:6.2f} tok/s x{rate / base:.2f}, {a['gen'] / a['steps']:.2f} "
                f"tokens/step, drafting in {a['spec_steps']} of {a['steps']} steps, "
                f"{a['held_answers']} answers drafting in < 1/4 of their steps, outputs equal to plain: {same}")
        del engines
    return rows


def section_batch1(b: Bench) -> list[dict]:
    """none / draft / ngram / reference at batch 1 on both prompt sets, greedy and T=0.7."""
    rows = []
    for method in ["none", "draft", "ngram", "reference", *b.args.extra_baselines]:
        k = 4 if method == "draft" else 8
        llm = b.llm(method, "adaptive", k)
        for set_name, prompts in [("coding", b.coding), ("edit", b.edit)]:
            for temp in [0.0, 0.7]:
                r = run_sequential(llm, prompts, temp, b.args.max_tokens)
                r.update(method=method, prompt_set=set_name, temperature=temp, k_max=k, policy="adaptive")
                rows.append(r)
                log(f"batch1 {method:9s} {set_name:6s} T={temp}: {r['decode_tokens_per_s']:.2f} decode tok/s "
                    f"acc={r['acceptance_rate']}")
        del llm
    # Speculation accelerates decoding; prefill (TTFT) is the same work for every method, so the
    # headline speedup compares decode rates; the end-to-end ratio is kept beside it.
    base = {(r["prompt_set"], r["temperature"]): r for r in rows if r["method"] == "none"}
    for r in rows:
        ref = base[(r["prompt_set"], r["temperature"])]
        r["speedup_vs_none"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        r["e2e_speedup_vs_none"] = r["tokens_per_s"] / ref["tokens_per_s"]
    return rows


def section_ksweep(b: Bench) -> list[dict]:
    """Draft model, greedy, coding prompts, policy always with K = 1..8."""
    llm = b.llm("draft", "always", 8)
    eng = llm.engine
    eng.set_speculation(False)
    base = run_sequential(llm, b.coding, 0.0, b.args.max_tokens)["decode_tokens_per_s"]
    eng.set_speculation(True)
    rows = []
    for k in range(1, 9):
        eng.policy.config = dataclasses.replace(eng.policy.config, num_spec_tokens=k)
        eng.drafted_per_position = [0] * 8
        eng.accepted_per_position = [0] * 8
        r = run_sequential(llm, b.coding, 0.0, b.args.max_tokens)
        r.update(k=k, speedup_vs_none=r["decode_tokens_per_s"] / base, none_decode_tokens_per_s=base)
        # Tokens per verify step = accepted + 1 (recovered or bonus).
        r["tokens_per_spec_step"] = 1 + (r["mean_accepted_per_spec_step"] or 0.0)
        rows.append(r)
        log(f"ksweep K={k}: {r['decode_tokens_per_s']:.2f} decode tok/s, speedup {r['speedup_vs_none']:.2f}, "
            f"tokens/step {r['tokens_per_spec_step']:.2f}")
    # Geometric model: b from the K=1 run (per-token acceptance), prediction for every K.
    b1 = rows[0]["acceptance_rate"] or 0.0
    for r in rows:
        k = r["k"]
        r["geometric_b"] = b1
        r["predicted_tokens_per_spec_step"] = (1 - b1 ** (k + 1)) / (1 - b1) if b1 < 1 else k + 1
    del llm
    return rows


def section_batchsweep(b: Bench) -> list[dict]:
    """Throughput at batch 1..64 for policy none / always / adaptive (--batch-method: the draft model).

    Each round runs plain, always and adaptive back to back at one batch size (the order turning
    from round to round); a configuration's
    speedup is the median over rounds of its tokens/s over that round's plain run. A run of 32
    tokens at batch 1-4 lasts under a second, and one run per configuration saw this 2-vCPU VM's
    memory speed move by 10-25% between configurations (Zen 5: the hybrid's batch 4 read 0.92x
    in one run and 0.97-1.05x over three interleaved rounds).

    Below batch 4 a round runs several waves of `batch` requests (4 requests in all, different
    prompts): one 32-token request is one noisy sample, and three rounds of the same prompt at
    batch 1 read 1.18x where 8 rounds read 1.44x (Zen 4, session 83). Two rates per run: end to
    end (generated tokens over the wall time, prefill included) and decode (the requests' decode
    rates summed: each one's tokens after its first over the time from its first to its last);
    at batch 1 a 32-token answer's prefill is a third of the wall time and dilutes both the gain
    and any loss."""
    llm = b.llm(b.args.batch_method, "adaptive", 4)
    eng = llm.engine
    rows = []
    prompts = [p for p, _ in b.coding]
    for batch in b.args.batches:
        waves = max(1, -(-4 // batch))
        wave_prompts = [[prompts[(w * batch + i) % len(prompts)] for i in range(batch)] for w in range(waves)]
        runs: dict[str, list[dict]] = {"none": [], "always": [], "adaptive": []}
        for rnd in range(b.args.batch_rounds):
            # The order turns round by round: whichever runs right after another drifts with it (at
            # batch 32, adaptive drafting nothing ran 0.94x plain third in every round of one
            # sweep, and 0.96-1.03x with the order alternating in one process).
            order = ("none", "always", "adaptive")
            for policy in order[rnd % 3:] + order[: rnd % 3]:
                if policy == "none":
                    eng.set_speculation(False)
                else:
                    eng.set_speculation(True)
                    eng.policy.config = dataclasses.replace(eng.policy.config, policy=policy)
                params = SamplingParams(max_tokens=b.args.batch_max_tokens, temperature=0, ignore_eos=True)
                run = {"wall_s": 0.0, "decode_tokens_per_s": 0.0, "generated_tokens": 0, "draft_tokens": 0,
                       "accepted_tokens": 0}
                for batch_prompts in wave_prompts:
                    eng.kv_manager.reset_prefix_cache()
                    eng.reset_suffix_cache()  # earlier runs' outputs would draft this one's
                    t0 = time.perf_counter()
                    outs = llm.generate(batch_prompts, params, use_tqdm=False)
                    run["wall_s"] += time.perf_counter() - t0
                    # The waves run one after another: their decode rates average, not add.
                    run["decode_tokens_per_s"] += sum(1 / o.metrics.tpot_s for o in outs if o.metrics.tpot_s) / waves
                    run["generated_tokens"] += sum(o.metrics.num_generated_tokens for o in outs)
                    run["draft_tokens"] += sum(o.metrics.extra["num_draft_tokens"] for o in outs)
                    run["accepted_tokens"] += sum(o.metrics.extra["num_accepted_tokens"] for o in outs)
                run["tokens_per_s"] = run["generated_tokens"] / run["wall_s"]
                runs[policy].append(run)
        for policy, rs in runs.items():
            ratios = sorted(r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(rs, runs["none"]))
            decode_ratios = sorted(r["decode_tokens_per_s"] / p["decode_tokens_per_s"] for r, p in zip(rs, runs["none"]))
            rates = sorted(r["tokens_per_s"] for r in rs)
            decode_rates = sorted(r["decode_tokens_per_s"] for r in rs)
            mid = len(rs) // 2
            rows.append({"batch": batch, "policy": policy, "rounds": len(rs), "requests_per_round": batch * waves,
                         "tokens_per_s": rates[mid], "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
                         "speedup_vs_none": ratios[mid],
                         "decode_tokens_per_s": decode_rates[mid],
                         "decode_tokens_per_s_runs": [r["decode_tokens_per_s"] for r in rs],
                         "decode_speedup_vs_none": decode_ratios[mid],
                         "generated_tokens": sum(r["generated_tokens"] for r in rs),
                         "draft_tokens": sum(r["draft_tokens"] for r in rs),
                         "accepted_tokens": sum(r["accepted_tokens"] for r in rs)})
            log(f"batchsweep B={batch:2d} {policy:8s}: median {rates[mid]:.2f} tok/s end to end, "
                f"{decode_rates[mid]:.2f} decoding; x{ratios[mid]:.2f} / x{decode_ratios[mid]:.2f} over plain "
                f"(medians of {len(rs)} rounds of {batch * waves} requests)")
    del llm
    return rows


def section_hf(b: Bench) -> list[dict]:
    """HF transformers (fp32) on the same GGUF files: plain, assisted, prompt lookup."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tpath, dpath = resolve_model(b.args.target), resolve_model(b.args.draft)
    gc.collect()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(tpath.parent), gguf_file=tpath.name)
    target = AutoModelForCausalLM.from_pretrained(str(tpath.parent), gguf_file=tpath.name,
                                                  torch_dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(dpath.parent), gguf_file=dpath.name,
                                                 torch_dtype=torch.float32).eval()
    log(f"HF models loaded in {time.perf_counter() - t0:.1f}s")
    rows = []
    modes = {"hf_plain": {}, "hf_assisted": {"assistant_model": draft},
             "hf_prompt_lookup": {"prompt_lookup_num_tokens": 8}}
    for set_name, prompts in [("coding", b.coding), ("edit", b.edit)]:
        for mode, extra in modes.items():
            gen = 0
            elapsed = prefill = 0.0
            for prompt, _ in prompts:
                ids = tok(prompt, return_tensors="pt").input_ids
                with torch.no_grad():
                    t0 = time.perf_counter()
                    target(ids)  # the prefill alone, to report a decode rate comparable to ours
                    prefill += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    out = target.generate(ids, max_new_tokens=b.args.max_tokens, do_sample=False,
                                          pad_token_id=tok.eos_token_id, **extra)
                elapsed += time.perf_counter() - t0
                gen += out.shape[1] - ids.shape[1]
            decode = max(elapsed - prefill, 1e-9)
            rows.append({"mode": mode, "prompt_set": set_name, "tokens_per_s": gen / elapsed,
                         "decode_tokens_per_s": (gen - len(prompts)) / decode, "generated_tokens": gen})
            log(f"hf {mode:17s} {set_name:6s}: {gen / elapsed:.2f} tok/s e2e, {(gen - len(prompts)) / decode:.2f} decode")
    del target, draft
    return rows


_MODE_COLORS = {"plain": "#999999", "chain": "#4c72b0", "tree": "#55a868"}


def _tree_bars(ax: Any, trees: list[dict], modes: Sequence[str], value: Callable[[dict], float],
               label: Callable[[dict], str]) -> None:
    """Bars of value(row) per proposer and prompt set, one per mode side by side, each labelled."""
    groups = list(dict.fromkeys((r["method"], r["prompt_set"]) for r in trees))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        legend = mode
        for i, g in enumerate(groups):
            row = next((r for r in trees if (r["method"], r["prompt_set"]) == g and r["mode"] == mode), None)
            if row is None:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            ax.bar(x, value(row), width=width, color=_MODE_COLORS[mode], label=legend)
            legend = None  # once per mode
            ax.annotate(label(row), (x, value(row)), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)), [f"{m}\n{ps}" for m, ps in groups], fontsize=7, rotation=30 if len(groups) > 6 else 0)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.legend(fontsize=8)


def plot(payload: dict, path: Path) -> None:
    """Four panels: batch-1 speedups, K sweep, batch sweep, peer comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    b1 = payload.get("batch1") or []
    trees = payload.get("trees") or []
    ax = axes[0][0]
    if trees:  # grouped bars: plain / chain / tree per proposer and prompt set
        _tree_bars(ax, trees, TREE_MODES, lambda r: r["speedup_vs_plain"],
                   lambda r: f"{r['speedup_vs_plain']:.2f}x\n{r['decode_tokens_per_s']:.0f}")
        ax.set_ylabel("decode speedup vs plain (batch 1, greedy)")
        ax.set_title("trees vs chains vs plain (labels: speedup, tok/s)", fontsize=10)
    elif b1:
        labels, vals, colors = [], [], []
        palette = {"none": "#999999", "draft": "#4c72b0", "ngram": "#55a868", "reference": "#c44e52",
                   "none-int8": "#8172b2"}
        for r in b1:
            labels.append(f"{r['method']}\n{r['prompt_set']} T={r['temperature']}")
            vals.append(r["speedup_vs_none"])
            colors.append(palette[r["method"]])
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), labels, rotation=90, fontsize=6)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("decode speedup vs none (batch 1)")
        ax.set_title("batch 1: tokens/s relative to plain decoding", fontsize=10)
    else:
        ax.text(0.5, 0.5, "not measured in this run\n(python bench/spec.py --sections trees batch1)",
                ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#666666")
        ax.set_axis_off()
    ks = payload.get("ksweep") or []
    ax = axes[0][1]
    if ks:
        x = [r["k"] for r in ks]
        ax.plot(x, [r["tokens_per_spec_step"] for r in ks], "o-", label="measured tokens / verify step")
        ax.plot(x, [r["predicted_tokens_per_spec_step"] for r in ks], "s--",
                label=f"geometric model, b={ks[0]['geometric_b']:.2f}")
        ax.plot(x, [r["speedup_vs_none"] for r in ks], "^-", label="speedup vs none")
        ax.set_xlabel("K (draft tokens per step)")
        ax.legend(fontsize=8)
        ax.set_title("draft model, greedy, coding prompts", fontsize=10)
    dh = payload.get("drafthead") or []
    if dh and not ks and not trees:  # the draft head's vocabulary, where no K sweep takes the panel
        ax = axes[0][1]
        groups = list(dict.fromkeys((r["prompt_set"], r["round"]) for r in dh))
        heads = [h for h in ("first_ids", "learned", "whole") if any(r["head"] == h for r in dh)]
        width = 0.8 / len(heads)
        for j, h in enumerate(heads):
            for i, g in enumerate(groups):
                r = next(r for r in dh if (r["prompt_set"], r["round"]) == g and r["head"] == h)
                x = i + (j - (len(heads) - 1) / 2) * width
                ax.bar(x, r["speedup_vs_plain"], width=width, color=f"C{j}", label=h if i == 0 else None)
                ax.annotate(f"{r['speedup_vs_plain']:.2f}x\n{r['tokens_per_step']:.2f}", (x, r["speedup_vs_plain"]),
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(groups)), [f"{ps}\npass {rnd + 1}" for ps, rnd in groups], fontsize=7)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("decode speedup vs plain (batch 1, greedy)")
        ax.set_title("draft model by LM head (labels: speedup, tokens/step)", fontsize=10)
        ax.legend(fontsize=8)
    bs = payload.get("batchsweep") or []
    ax = axes[1][0]
    if bs:
        # The medians over rounds of each run's rate over its round's plain run.
        for pol, marker in [("always", "s"), ("adaptive", "^")]:
            for key, style, what in [("speedup_vs_none", "-", "end to end"), ("decode_speedup_vs_none", "--", "decoding")]:
                pts = {r["batch"]: r[key] for r in bs if r["policy"] == pol and r.get(key) is not None}
                if pts:
                    ax.plot(list(pts), list(pts.values()), marker + style, label=f"{pol}, {what}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.95, color="red", lw=0.8, ls=":", label="0.95x floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s over plain")
        ax.legend(fontsize=7)
        ax.set_title("speculation vs batch size (greedy, medians of rounds)", fontsize=10)
    hf = payload.get("hf") or []
    shift = payload.get("shift") or []
    ax = axes[1][1]
    if shift and not hf:  # the peer panel shows traffic that changes instead
        names = ["fresh", "shifted"]
        rounds = sorted({r["round"] for r in shift})
        for j, name in enumerate(names):
            vals = [next(r["speedup_vs_plain"] for r in shift if r["round"] == k and r["engine"] == name) for k in rounds]
            ax.bar([k + (j - 0.5) * 0.4 for k in rounds], vals, width=0.4, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(rounds, [f"round {k}" for k in rounds], fontsize=8)
        ax.set_ylabel("coding decode speedup vs plain (batch 1)")
        ax.legend(fontsize=8)
        ax.set_title(f"after prose sampled at T {shift[0]['prelude_temperature']} (shifted) vs a fresh engine", fontsize=10)
    elif hf:
        ours = {(r["method"], r["prompt_set"]): r["decode_tokens_per_s"] for r in b1 if r["temperature"] == 0.0}
        pairs = [("none", "hf_plain"), ("draft", "hf_assisted"), ("ngram", "hf_prompt_lookup")]
        labels, a, c = [], [], []
        for set_name in ["coding", "edit"]:
            for mine, theirs in pairs:
                h = next((r["decode_tokens_per_s"] for r in hf if r["mode"] == theirs and r["prompt_set"] == set_name), None)
                labels.append(f"{mine}\n{set_name}")
                a.append(ours.get((mine, set_name), 0.0))
                c.append(h or 0.0)
        xs = range(len(labels))
        ax.bar([i - 0.2 for i in xs], a, width=0.4, label="specserve")
        ax.bar([i + 0.2 for i in xs], c, width=0.4, label="HF transformers")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("decode tokens/s (batch 1, greedy)")
        ax.legend(fontsize=8)
        ax.set_title("peer: same GGUF pair through HF transformers", fontsize=10)
    if trees and not ks:  # no K sweep: its panel shows what the drafts yielded, tokens per target forward
        ax = axes[0][1]
        _tree_bars(ax, trees, ("chain", "tree"), lambda r: r["tokens_per_step"], lambda r: f"{r['tokens_per_step']:.2f}")
        ax.set_ylabel("tokens per target forward")
        ax.set_title(f"what the drafts yield (policy {payload['settings'].get('tree_policy', 'adaptive')})", fontsize=10)
    carried = payload.get("carried", {})
    for ax, key in ((axes[0][1], "ksweep"), (axes[1][0], "batchsweep"), (axes[1][1], "hf")):
        if key == "ksweep" and not payload.get(key) and (trees or payload.get("drafthead")):
            continue  # the panel shows tokens per forward or the draft heads instead
        if key == "hf" and not hf and shift:
            continue  # the panel shows traffic that changes
        if not payload.get(key):
            ax.text(0.5, 0.5, f"not measured in this run\n(python bench/spec.py --sections {key})",
                    ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#666666")
            ax.set_axis_off()
        elif key in carried:
            ax.set_title(ax.get_title() + f" [earlier run, commit {carried[key]}]", fontsize=9)
    mi = payload["machine"]
    # The draft model is named where a section may have run it: the trees and shift rows say
    # which methods ran; the other sections run the draft model (or --batch-method) anyway.
    drafted = any(payload.get(k) for k in ("batch1", "ksweep", "batchsweep", "hf")) or any(
        r.get("method") == "draft" for k in ("trees", "shift") for r in payload.get(k) or [])
    pair = payload["settings"]["target"] + (f" + {payload['settings']['draft']}" if drafted else "")
    fig.suptitle(f"specserve speculative decoding — {pair} — {mi['cpu']}, commit {mi['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="target weights: auto (the GGUF's blocks), none (float), int8")
    ap.add_argument("--draft-quantization", default=None,
                    help="draft weights (default: the engine's, int4 under a target on auto); only moves acceptance")
    ap.add_argument("--draft-vocab", type=int, default=65536, help="draft LM head vocabulary (0: full)")
    ap.add_argument("--eagle-head", default=None, help="EAGLE head file for --tree-methods eagle (default: the cache's)")
    ap.add_argument("--draft-p-min", type=float, default=None,
                    help="model drafters stop a branch after a token they give p below this (default: the engine's)")
    ap.add_argument("--lookahead-corpus", default=None,
                    help="lookahead's corpus: stdlib, python, a directory or none (default: the engine's)")
    ap.add_argument("--extra-baselines", nargs="*", default=[],
                    help="extra batch-1 rows: none-int8 = plain decoding of the int8 target")
    ap.add_argument("--batch-rounds", type=int, default=3, help="batchsweep: interleaved rounds (medians reported)")
    ap.add_argument("--drafthead-rounds", type=int, default=2, help="drafthead: passes over each set's prompts")
    ap.add_argument("--shift-rounds", type=int, default=3, help="shift: rounds, fresh engines each")
    ap.add_argument("--shift-temperature", type=float, default=1.3,
                    help="shift: temperature of the prose answers the shifted engine serves first")
    ap.add_argument("--batch-method", default="draft", help="batchsweep: the proposer (METHOD+COPY as --tree-methods)")
    ap.add_argument("--tree-methods", nargs="+", default=["draft", "ngram", "reference", "lookahead"],
                    help="proposers of the trees section; METHOD+COPY (draft+ngram, eagle+reference) puts "
                         "--spec-copy COPY in front of a model drafter, METHOD+join (eagle+join, eagle+none+join) "
                         "joins lookahead's candidates into its trees (--spec-join lookahead)")
    ap.add_argument("--sections", nargs="+", default=["trees", "batch1", "ksweep", "batchsweep", "hf"],
                    choices=["trees", "batch1", "ksweep", "batchsweep", "hf", "drafthead", "shift"])
    ap.add_argument("--tree-policy", default="adaptive", choices=["adaptive", "always"],
                    help="trees section: the policy (always: every step drafts, to measure acceptance)")
    ap.add_argument("--tree-k", type=int, default=8,
                    help="trees section: the node budget per step (--num-speculative-tokens)")
    ap.add_argument("--max-draft-nodes", type=int, default=None,
                    help="the most nodes a tree may have (--max-draft-nodes; the engine's default when not given)")
    ap.add_argument("--tree-sets", nargs="+", default=["coding", "edit"], choices=["coding", "edit", "prose", "chinese"],
                    help="prompt sets of the trees section")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--batch-max-tokens", type=int, default=32)
    ap.add_argument("--out", default="spec")
    args = ap.parse_args()
    _check_methods(ap, [*args.tree_methods, args.batch_method])
    payload: dict[str, Any] = {"benchmark": "speculative decoding", "machine": machine_info(),
                               "settings": vars(args)}
    out_json = RESULTS_DIR / f"{args.out}.json"
    if out_json.exists():  # keep sections from an earlier run that this run does not redo
        import json

        old = json.loads(out_json.read_text())
        same = all(old.get("settings", {}).get(k) == getattr(args, k) for k in ("target", "draft", "quantization"))
        carried = dict(old.get("carried", {}))
        for key in ("trees", "batch1", "ksweep", "batchsweep", "hf", "drafthead", "shift"):
            if same and key in old and key not in args.sections:  # never mix precisions in one file
                payload[key] = old[key]
                payload.setdefault("carried", {})[key] = carried.get(key, old["machine"].get("commit"))
    b = Bench(args)
    sections = {"trees": section_trees, "batch1": section_batch1, "ksweep": section_ksweep,
                "batchsweep": section_batchsweep, "hf": section_hf, "drafthead": section_drafthead,
                "shift": section_shift}
    for name in args.sections:
        t0 = time.perf_counter()
        payload[name] = sections[name](b)
        payload.setdefault("section_time_s", {})[name] = time.perf_counter() - t0
        write_json(f"{args.out}.json", payload)  # keep partial results if a later section fails
    plot(payload, RESULTS_DIR / f"{args.out}.png")
    log(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
