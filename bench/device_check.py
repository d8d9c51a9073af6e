"""The engine on another device (CUDA): is speculation exact there, and what does it buy?

One prepared run for a lent GPU (it also runs on the CPU, which is how it is checked here):

  exact   float32, TF32 off. Greedy speculation == plain decoding token for token, batched and
          alone, for n-gram (chain and tree, float and int8 KV), lookahead, a draft model,
          layerskip and EAGLE / MTP / Medusa heads (random ones on the tiny model), and with a real
          model the reference proposer and a trained EAGLE head; the KV pool is whole afterwards.
          On a tiny random model (built here, no download) and, when given, a real one. Seeded
          sampled runs with a deterministic proposer or a draft model emit plain decoding's tokens.
  sampling the verifiers on the device's tensors and generator: chain rejection sampling is
          exact (chi-square, 10^6 draws, drafts from p and one-hot), and one-hot chains and trees
          are coupled to the plain sampler's draws for a seed.
  speed   the device's default dtype. Plain decode tokens/s at batch 1..64, prompt tokens/s,
          and batch-1 speculation against plain (real model only): the speedups over our own
          plain path on this device.

    python bench/device_check.py --device cuda --model smollm2-135m-instruct --eagle HEAD
    python bench/device_check.py --device cpu --sections exact      # the tiny model only

Writes device_check_<device>.json and .png under --out (default bench/results/). Every case
records its error instead of stopping the run, so one broken path still leaves the others'
figures.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info  # noqa: E402
from prompts import CODING, EDIT, PROSE  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.testing import repetitive_prompts, scratch_dir, tiny_checkpoint, write_random_head  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def run_case(results: list[dict], name: str, fn) -> None:
    """Run one case; record its figures or its error, never stop the whole check."""
    t0 = time.perf_counter()
    try:
        row = fn()
        row["ok"] = row.get("ok", True)
    except Exception as e:  # noqa: BLE001 - the point is to report every failure
        row = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
    row["case"] = name
    row["seconds"] = round(time.perf_counter() - t0, 2)
    results.append(row)
    status = "ok" if row["ok"] else f"FAILED {row.get('error', '')}"
    log(
        f"  {name}: {status} ({row['seconds']}s) {', '.join(f'{k}={v}' for k, v in row.items() if k in SHOW)}"
    )
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


SHOW = (
    "matched",
    "of",
    "first_mismatch",
    "tokens_per_s",
    "speedup",
    "mean_accepted",
    "prompt_tokens_per_s",
    "p_first",
    "p_bonus",
)


def compare_exact(
    build,
    base_ids: list[list[int]],
    prompts: list,
    params: list[SamplingParams],
    alone_every: int = 4,
) -> dict:
    """Greedy outputs of `build()` against the plain ones, batched and every `alone_every`th alone."""
    llm = build()
    batched = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    matched = sum(a == b for a, b in zip(batched, base_ids))
    alone_idx = list(range(0, len(prompts), alone_every))
    alone_matched = sum(
        llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0].token_ids == base_ids[i]
        for i in alone_idx
    )
    first = next((i for i, (a, b) in enumerate(zip(batched, base_ids)) if a != b), None)
    mismatch = None
    if first is not None:
        a, b = batched[first], base_ids[first]
        mismatch = {
            "prompt": first,
            "token": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))),
        }
    c = llm.engine.spec_counters
    eng = llm.engine
    whole = eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    return {
        "matched": matched,
        "of": len(prompts),
        "alone_matched": alone_matched,
        "alone_of": len(alone_idx),
        "first_mismatch": mismatch,
        "pool_whole": whole,
        "draft_tokens": c["num_draft_tokens"],
        "accepted_tokens": c["num_accepted_tokens"],
        "ok": matched == len(prompts) and alone_matched == len(alone_idx) and whole,
    }


def section_exact(args: argparse.Namespace, real: Any | None, real_prompts: dict) -> list[dict]:
    results: list[dict] = []
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # A tiny random Llama target and a different, one-layer tiny draft (built here, no download).
    # Four layers, so an EAGLE-3 head can fuse the residual streams after layers 1 and 2.
    target = tiny_checkpoint("llama", seed=5, vocab=64, layers=4)[1]
    draft = tiny_checkpoint("llama", seed=6, vocab=64, layers=1)[1]
    prompts = repetitive_prompts(16)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(prompts)
    kw = dict(device=args.device, dtype="float32", checkpoint=target, profile_spec_costs=False)
    log(f"exact: tiny random Llama on {args.device}")
    # The reference runs every step eagerly; each case below replays CUDA graphs (on a GPU).
    base = [
        o.token_ids
        for o in LLM("tiny", spec_method="none", enforce_eager=True, **kw).generate(
            prompts, params, use_tqdm=False
        )
    ]
    cases = {
        "tiny plain (CUDA graphs on a GPU)": dict(spec_method="none"),
        "tiny ngram chain": dict(spec_method="ngram", spec_tree="chain"),
        "tiny ngram tree": dict(spec_method="ngram", spec_tree="auto"),
        "tiny ngram tree int8 KV": dict(
            spec_method="ngram", spec_tree="auto", kv_cache_dtype="int8"
        ),
        "tiny lookahead": dict(spec_method="lookahead"),
        "tiny draft model chain": dict(
            spec_method="draft", draft_checkpoint=draft, spec_tree="chain"
        ),
        # `auto` means chains for these two (their measured default): ask for trees.
        "tiny draft model tree": dict(
            spec_method="draft", draft_checkpoint=draft, spec_tree="tree"
        ),
        "tiny layerskip chain": dict(spec_method="layerskip", draft_num_layers=1),
        "tiny layerskip tree": dict(spec_method="layerskip", draft_num_layers=1, spec_tree="tree"),
    }
    # Randomly initialised heads for the tiny target: exactness does not depend on their quality.
    head_dir = scratch_dir("heads-")
    for method in ("eagle", "mtp", "medusa"):
        path = write_random_head(target, head_dir / f"{method}.safetensors", method)
        cases[f"tiny {method} tree"] = dict(spec_method=method, draft_model=str(path))
        cases[f"tiny {method} chain"] = dict(
            spec_method=method, draft_model=str(path), spec_tree="chain"
        )
    # EAGLE-3's fusion: the target's forward keeps the streams after layers 1 and 2 as well.
    path = write_random_head(target, head_dir / "eagle3.safetensors", "eagle", feature_layers=[1, 2])
    cases["tiny eagle fused tree"] = dict(spec_method="eagle", draft_model=str(path))
    cases["tiny eagle fused chain"] = dict(
        spec_method="eagle", draft_model=str(path), spec_tree="chain"
    )
    # lookahead's candidates joined into the head's trees (--spec-join)
    cases["tiny eagle tree + join"] = dict(
        spec_method="eagle", draft_model=str(path), spec_join="lookahead"
    )
    # int8 KV is compared with plain decoding on int8 KV (the quantization changes the numbers).
    base_int8 = [
        o.token_ids
        for o in LLM(
            "tiny", spec_method="none", kv_cache_dtype="int8", enforce_eager=True, **kw
        ).generate(prompts, params, use_tqdm=False)
    ]
    for name, extra in cases.items():
        ref = base_int8 if extra.get("kv_cache_dtype") == "int8" else base
        run_case(
            results,
            name,
            lambda extra=extra, ref=ref: compare_exact(
                lambda: LLM("tiny", spec_policy="always", num_spec_tokens=6, **kw, **extra),
                ref,
                prompts,
                params,
            ),
        )
    results += _features_exact(kw, prompts, draft)
    if real is not None:
        log(f"exact: {args.model} on {args.device}, float32")
        rkw = dict(
            device=args.device,
            dtype="float32",
            checkpoint=real,
            quantization="none",
            profile_spec_costs=False,
        )
        rp = real_prompts["prose"] + real_prompts["coding"] + real_prompts["edit"]
        rparams = [
            SamplingParams(max_tokens=args.max_tokens, temperature=0, reference_text=ref)
            for _, ref in rp
        ]
        rprompts = [p for p, _ in rp]
        rbase = [
            o.token_ids
            for o in LLM(args.model, spec_method="none", **rkw).generate(
                rprompts, rparams, use_tqdm=False
            )
        ]
        rcases = {
            "real ngram tree": dict(spec_method="ngram"),
            "real reference tree": dict(spec_method="reference"),
            "real lookahead": dict(spec_method="lookahead"),
        }
        if args.eagle:
            rcases["real eagle tree"] = dict(spec_method="eagle", draft_model=args.eagle)
            rcases["real eagle chain"] = dict(
                spec_method="eagle", draft_model=args.eagle, spec_tree="chain"
            )
            rcases["real eagle tree + join"] = dict(
                spec_method="eagle", draft_model=args.eagle, spec_join="lookahead"
            )
        # Seeded sampling: a deterministic proposer's drafts are coupled to the plain draw, so
        # the text equals plain decoding's with the same seeds (a real vocabulary's sums).
        sparams = [
            replace(p, temperature=0.7, top_p=0.95, seed=100 + i) for i, p in enumerate(rparams)
        ]
        sbase = [
            o.token_ids
            for o in LLM(args.model, spec_method="none", **rkw).generate(
                rprompts, sparams, use_tqdm=False
            )
        ]
        for method in ("ngram", "reference", "lookahead"):
            rcases[f"real seeded sampled {method} == plain"] = dict(spec_method=method)
        for name, extra in rcases.items():
            seeded = name.startswith("real seeded")
            run_case(
                results,
                name,
                lambda extra=extra, seeded=seeded: compare_exact(
                    lambda: LLM(args.model, spec_policy="always", **rkw, **extra),
                    sbase if seeded else rbase,
                    rprompts,
                    sparams if seeded else rparams,
                ),
            )
    return results


def _features_exact(kw: dict, prompts: list, draft: Any) -> list[dict]:
    """The request-level sampling features under speculation on the device: penalties,
    logit_bias, min_tokens, min_p and logprobs ride along every verified row (greedy, so the
    output must equal plain decoding with the same parameters), and a seeded sampled run with
    prompt logprobs must finish with the KV pool whole."""
    results: list[dict] = []
    params = [
        SamplingParams(
            max_tokens=24,
            temperature=0,
            min_tokens=12,
            min_p=0.05,
            repetition_penalty=1.15,
            presence_penalty=0.4,
            frequency_penalty=0.2,
            logit_bias={i % 64: (5.0 if i % 2 else -100.0) for i in (3, 7, 11 + p)},
            logprobs=True,
            top_logprobs=3,
        )
        for p in range(len(prompts))
    ]
    base = [
        o.token_ids
        for o in LLM("tiny", spec_method="none", enforce_eager=True, **kw).generate(
            prompts, params, use_tqdm=False
        )
    ]
    cases = {
        "tiny features ngram tree": dict(spec_method="ngram", spec_tree="auto"),
        "tiny features draft model chain": dict(
            spec_method="draft", draft_checkpoint=draft, spec_tree="chain"
        ),
        "tiny features lookahead": dict(spec_method="lookahead"),
    }
    for name, extra in cases.items():
        run_case(
            results,
            name,
            lambda extra=extra: compare_exact(
                lambda: LLM("tiny", spec_policy="always", num_spec_tokens=6, **kw, **extra),
                base,
                prompts,
                params,
            ),
        )

    def sampled(extra: dict) -> dict:
        llm = LLM("tiny", spec_policy="always", num_spec_tokens=6, **kw, **extra)
        sp = [
            SamplingParams(
                max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True,
                seed=i if i % 2 else None, prompt_logprobs=2, logprobs=True, repetition_penalty=1.1,
            )
            for i in range(len(prompts))
        ]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        again = llm.generate(prompts, sp, use_tqdm=False)
        eng = llm.engine
        whole = eng.check_integrity() and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
        seeded = [i for i in range(len(prompts)) if sp[i].seed is not None]
        # A seeded request's tokens depend on neither the run nor the batch around it.
        alone = [llm.generate([prompts[i]], [sp[i]], use_tqdm=False)[0] for i in seeded[:4]]
        same = sum(outs[i].token_ids == again[i].token_ids for i in seeded)
        same += sum(a.token_ids == outs[i].token_ids for a, i in zip(alone, seeded))
        complete = sum(
            o.finish_reason == "length"
            and len(o.token_ids) == 24
            and o.prompt_logprobs is not None
            and len(o.outputs[0].logprobs or ()) == 24
            for o in outs + again
        )
        c = eng.spec_counters
        return {
            "matched": same,
            "of": len(seeded) + len(alone),
            "complete": complete,
            "pool_whole": whole,
            "draft_tokens": c["num_draft_tokens"],
            "accepted_tokens": c["num_accepted_tokens"],
            "ok": whole and complete == 2 * len(prompts) and same == len(seeded) + len(alone),
        }

    for name, extra in {
        "tiny features sampled ngram tree": dict(spec_method="ngram", spec_tree="auto"),
        "tiny features sampled draft model tree": dict(
            spec_method="draft", draft_checkpoint=draft, spec_tree="tree"
        ),
        "tiny features sampled draft model chain": dict(
            spec_method="draft", draft_checkpoint=draft, spec_tree="chain"
        ),
    }.items():
        run_case(results, name, lambda extra=extra: sampled(extra))

    # A deterministic proposer's drafts, and a model drafter's for a seeded request (its likeliest
    # tokens: spec.tree.drafts_ranked), are coupled to the plain draw: a seeded sampled request
    # emits the tokens plain decoding emits with the same seed, whatever was drafted.
    seeded = [
        SamplingParams(max_tokens=24, temperature=0.5, top_p=0.95, top_k=40 if i % 2 else 0,
                       seed=300 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = LLM("tiny", spec_method="none", enforce_eager=True, **kw).generate(
        prompts, seeded, use_tqdm=False
    )
    # Every other request gets its own future as the reference text (the rest their prompt).
    with_ref = [
        replace(p, reference_token_ids=list(pr) + (list(o.token_ids) if i % 2 else []))
        for i, (p, pr, o) in enumerate(zip(seeded, prompts, plain))
    ]
    for name, extra, params in (
        ("tiny seeded sampled ngram tree == plain", dict(spec_method="ngram", spec_tree="auto"), seeded),
        ("tiny seeded sampled ngram chain == plain", dict(spec_method="ngram", spec_tree="chain"), seeded),
        ("tiny seeded sampled lookahead == plain", dict(spec_method="lookahead"), seeded),
        ("tiny seeded sampled reference tree == plain", dict(spec_method="reference"), with_ref),
        ("tiny seeded sampled draft model tree == plain",
         dict(spec_method="draft", draft_checkpoint=draft, spec_tree="tree"), seeded),
        ("tiny seeded sampled draft model chain == plain",
         dict(spec_method="draft", draft_checkpoint=draft, spec_tree="chain"), seeded),
    ):
        run_case(
            results,
            name,
            lambda extra=extra, params=params: compare_exact(
                lambda: LLM("tiny", spec_policy="always", num_spec_tokens=6, **kw, **extra),
                [o.token_ids for o in plain],
                prompts,
                params,
            ),
        )
    return results


def section_sampling(args: argparse.Namespace) -> list[dict]:
    """The verifiers on the device's tensors and generator: chain rejection sampling emits the
    target's distribution (chi-square over 10^6 draws, drafts sampled from p and one-hot), and
    one-hot drafts (chains and trees) are coupled to the plain sampler: for a seed, the emitted
    tokens are a prefix of what plain sampling draws, whatever the drafts."""
    from scipy.stats import chisquare

    from specserve.sampling.rejection import SpecBatch, rejection_sample
    from specserve.sampling.sampler import SamplingMetadata, logits_to_probs, sample_from_probs
    from specserve.sampling.tree_rejection import verify_trees
    from specserve.spec.tree import DraftTree

    dev = torch.device(args.device)
    vocab, chunk, draws = 50, 100_000, args.draws
    results: list[dict] = []
    log(f"sampling: the verifiers on {dev}, {draws:,} draws per distribution case")

    def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        meta = SamplingMetadata.build([params] * logits.shape[0], [0] * logits.shape[0], dev)
        return logits_to_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.any_top_k, meta.any_top_p)

    def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
        counts, probs = counts.double().cpu(), probs.double().cpu()
        zero = probs == 0
        expected = probs[~zero] / probs[~zero].sum() * counts.sum()
        return float(chisquare(counts[~zero].numpy(), expected.numpy()).pvalue), int(counts[zero].sum())

    def distribution(params: SamplingParams, k: int, one_hot: bool) -> dict:
        g = torch.Generator(device=dev).manual_seed(11)
        target = torch.randn(k + 1, vocab, device=dev, generator=g) * 2.0
        q = probs_of(target, params)
        p = probs_of(target[:k] + torch.randn(k, vocab, device=dev, generator=g) * 1.5, params)
        first = torch.zeros(vocab, dtype=torch.long, device=dev)
        bonus = torch.zeros(vocab, dtype=torch.long, device=dev)
        accepted = 0
        for _ in range(draws // chunk):
            if one_hot:
                drafts = p.argmax(-1).repeat(chunk, 1)
            else:
                drafts = torch.stack([torch.multinomial(p[j], chunk, True, generator=g) for j in range(k)], 1)
            meta = SamplingMetadata.build([params] * chunk, [0] * chunk, dev)
            batch = SpecBatch([k] * chunk, drafts.tolist(), [None] * chunk, meta,
                              None if one_hot else p.repeat(chunk, 1))
            res = rejection_sample(target.repeat(chunk, 1), batch, g)
            first += torch.bincount(torch.tensor([t[0] for t in res.token_ids], device=dev), minlength=vocab)
            last = [t[-1] for t, a in zip(res.token_ids, res.num_accepted) if a == k]
            if last:
                bonus += torch.bincount(torch.tensor(last, device=dev), minlength=vocab)
            accepted += sum(res.num_accepted)
        p_first, bad_first = chi2(first, q[0])
        p_bonus, bad_bonus = chi2(bonus, q[k]) if bonus.sum() > 1000 else (1.0, 0)
        return {
            "p_first": p_first, "p_bonus": p_bonus, "bonus_draws": int(bonus.sum()),
            "mean_accepted": round(accepted / draws, 3),
            "ok": p_first > 1e-3 and p_bonus > 1e-3 and bad_first + bad_bonus == 0,
        }

    def coupled(tree: bool) -> dict:
        """For 64 seeds: plain sampling's first four draws on the device, then drafts that are
        that text, random tokens, or a prefix with a wrong tail; the verifier's tokens must be a
        prefix of the plain draws."""
        g = torch.Generator(device=dev).manual_seed(9)
        table = torch.randn(vocab, vocab, device=dev, generator=g) * 1.5  # next-token logits by last token
        matched = of = 0
        for seed in range(64):
            params = SamplingParams(temperature=0.8, top_k=6 if seed % 2 else 0, top_p=0.9, seed=seed)
            probs = probs_of(table, params)
            want, last = [], 0
            for step in range(3, 7):
                last = int(sample_from_probs(probs[last : last + 1], [seed], [step], None)[0])
                want.append(last)
            meta = SamplingMetadata.build([params], [3], dev)
            rand = [int(t) for t in torch.randint(0, vocab, (3,), device=dev, generator=g)]
            for drafts in (want[:3], rand, want[:1] + [want[0]], []):
                logits = table[[0] + drafts]
                if tree:  # the drafts as the first branch, a random sibling beside each node
                    toks = [t for d in drafts for t in (d, (d + 1 + seed % (vocab - 1)) % vocab)]
                    parents = [-1 if j < 2 else 2 * (j // 2 - 1) for j in range(len(toks))]
                    logits = table[[0] + toks]
                    (r,) = verify_trees(logits, [DraftTree(tuple(toks), tuple(parents))], meta, g)
                    got = r.token_ids
                else:
                    got = rejection_sample(logits, SpecBatch([len(drafts)], [drafts], [None], meta), g).token_ids[0]
                of += 1
                matched += got == want[: len(got)]
        return {"matched": matched, "of": of, "ok": matched == of}

    cases = {
        "sampling chain K3 T1.0 drafts from p": lambda: distribution(SamplingParams(temperature=1.0), 3, False),
        "sampling chain K3 T0.8 top-p 0.7 drafts from p": lambda: distribution(
            SamplingParams(temperature=0.8, top_p=0.7), 3, False
        ),
        "sampling chain K3 T1.0 one-hot": lambda: distribution(SamplingParams(temperature=1.0), 3, True),
        "sampling chain K3 top-k 20 top-p 0.9 one-hot": lambda: distribution(
            SamplingParams(temperature=1.0, top_k=20, top_p=0.9), 3, True
        ),
        "sampling one-hot chain coupled to plain draws": lambda: coupled(tree=False),
        "sampling one-hot tree coupled to plain draws": lambda: coupled(tree=True),
    }
    for name, fn in cases.items():
        run_case(results, name, fn)
    return results


def decode_rate(
    llm: LLM, prompts: list, max_tokens: int, refs: list | None = None, repeats: int = 2
) -> dict:
    """Generated tokens/s over the prompts run together (the best of `repeats` runs: a device's
    first run of new shapes pays one-time set-up), and per-step speculation counters."""
    runs = [_decode_once(llm, prompts, max_tokens, refs) for _ in range(repeats)]
    return max(runs, key=lambda r: r["tokens_per_s"])


def _decode_once(llm: LLM, prompts: list, max_tokens: int, refs: list | None) -> dict:
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            reference_text=None if refs is None else refs[i],
        )
        for i in range(len(prompts))
    ]
    llm.engine.kv_manager.reset_prefix_cache()
    llm.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
    before = dict(llm.engine.spec_counters)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    c = {k: llm.engine.spec_counters[k] - before.get(k, 0) for k in llm.engine.spec_counters}
    steps = c["num_drafts"]
    return {
        "tokens_per_s": round(gen / wall, 1),
        "generated": gen,
        "wall_s": round(wall, 3),
        "mean_accepted": round(c["num_accepted_tokens"] / steps, 2) if steps else None,
        "token_ids": [o.token_ids for o in outs],
    }


def section_speed(
    args: argparse.Namespace, real: Any, real_prompts: dict, results: list[dict], save=None
) -> list[dict]:
    """Plain decode by batch (CUDA graphs and eager), prompt rate, a step profile and batch-1
    speculation against plain, appended to `results` (saved after each speculation case)."""
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    kw = dict(
        device=args.device,
        dtype=args.dtype,
        checkpoint=real,
        quantization=args.quantization,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_gib=args.kv_cache_gib,
    )
    log(f"speed: {args.model} on {args.device}, dtype {args.dtype}")
    plain = LLM(args.model, spec_method="none", **kw)
    # The same engine with every step eager: what CUDA graphs buy, on the same machine and run.
    eager = LLM(args.model, spec_method="none", enforce_eager=True, **kw)
    warm = real_prompts["prose"][0][0]
    for llm in (plain, eager):
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    prose = [p for p, _ in real_prompts["prose"]]
    for batch in (1, 8, 32, 64):
        batch_prompts = [prose[i % len(prose)] for i in range(batch)]
        for mode, llm in (("", plain), (" eager", eager)):

            def one(batch_prompts=batch_prompts, batch=batch, llm=llm) -> dict:
                r = decode_rate(llm, batch_prompts, args.max_tokens)
                r.pop("token_ids")
                r["batch"] = batch
                graphs = llm.engine.runner.step_graphs
                r["graphs"] = None if graphs is None else graphs.num_graphs
                return r

            run_case(results, f"plain decode batch {batch}{mode}", one)
    eager = None
    gc.collect()

    def prefill() -> dict:
        tok = real.tokenizer
        text = "\n\n".join(s for _, s in EDIT) * 8
        ids = tok.encode(text)[: args.long_prompt]
        plain.engine.kv_manager.reset_prefix_cache()
        plain.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
        t0 = time.perf_counter()
        out = plain.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
        ttft = out.metrics.ttft_s or (time.perf_counter() - t0)
        return {
            "prompt_tokens": len(ids),
            "ttft_s": round(ttft, 4),
            "prompt_tokens_per_s": round(len(ids) / ttft, 1),
        }

    run_case(results, "prefill", prefill)

    def step_profile() -> dict:
        """Where a batch-1 decode step's time goes: the profiler's top operators by self CPU
        time, kernel launches per step, and device-busy time against wall time."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if args.device.startswith("cuda") else []
        )
        steps = 32
        plain.engine.kv_manager.reset_prefix_cache()
        plain.engine.reset_suffix_cache()  # earlier runs' outputs would draft this one's
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            plain.generate(
                [prose[0]],
                SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        dev_total = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
        launches = sum(
            e.count
            for e in events
            if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
        )
        graph_launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
        return {
            "steps": steps,
            "wall_s": round(wall, 3),
            "device_busy_s": round(dev_total / 1e6, 4),
            "kernel_launches_per_step": round(launches / steps, 1),
            "graph_launches_per_step": round(graph_launches / steps, 1),
            "top_self_cpu": [
                {
                    "op": e.key,
                    "count": e.count,
                    "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                }
                for e in top
            ],
        }

    run_case(results, "step profile batch 1", step_profile)

    sets = {
        "coding": real_prompts["coding"],
        "edit": real_prompts["edit"],
        "prose": real_prompts["prose"],
    }
    base_rates = {}
    for set_name, rows in sets.items():

        def base(rows=rows, set_name=set_name) -> dict:
            rates = [decode_rate(plain, [p], args.max_tokens) for p, _ in rows]
            r = _merge(rates)
            base_rates[set_name] = r
            return {"set": set_name, "tokens_per_s": r["tokens_per_s"]}

        run_case(results, f"plain batch 1 {set_name}", base)
    plain = None  # free its KV before the speculative engines start
    gc.collect()
    methods = [
        ("ngram", "auto", "edit"),
        ("ngram", "chain", "edit"),
        ("reference", "auto", "edit"),
        ("lookahead", "auto", "coding"),
    ]
    if args.eagle:
        methods += [
            ("eagle", "auto", "coding"),
            ("eagle", "chain", "coding"),
            ("eagle", "auto", "prose"),
            ("eagle+join", "auto", "coding"),
            ("eagle+join", "auto", "prose"),
        ]
    for policy in ("always", "adaptive"):
        for method, tree, set_name in methods:

            def spec(method=method, tree=tree, set_name=set_name, policy=policy) -> dict:
                extra = {"draft_model": args.eagle} if method.startswith("eagle") else {}
                if method.endswith("+join"):  # lookahead's candidates joined into the head's trees
                    extra["spec_join"] = "lookahead"
                llm = LLM(
                    args.model,
                    spec_method=method.removesuffix("+join"),
                    spec_policy=policy,
                    spec_tree=tree,
                    **kw,
                    **extra,
                )
                llm.generate(warm, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
                rows = sets[set_name]
                rates = [decode_rate(llm, [p], args.max_tokens, refs=[ref]) for p, ref in rows]
                r = _merge(rates)
                b = base_rates.get(set_name)
                same = b is not None and r["token_ids"] == b["token_ids"]
                return {
                    "method": method,
                    "tree": tree,
                    "policy": policy,
                    "set": set_name,
                    "tokens_per_s": r["tokens_per_s"],
                    "mean_accepted": r["mean_accepted"],
                    "speedup": round(r["tokens_per_s"] / b["tokens_per_s"], 3) if b else None,
                    "greedy_same_as_plain": same,
                }

            run_case(results, f"{method} {tree} {policy} on {set_name}", spec)
            if save is not None:
                save()
    return results


def _merge(rates: list[dict]) -> dict:
    gen = sum(r["generated"] for r in rates)
    wall = sum(r["wall_s"] for r in rates)
    acc = [r["mean_accepted"] for r in rates if r["mean_accepted"] is not None]
    return {
        "tokens_per_s": round(gen / wall, 1),
        "generated": gen,
        "wall_s": wall,
        "mean_accepted": round(sum(acc) / len(acc), 2) if acc else None,
        "token_ids": [t for r in rates for t in r["token_ids"]],
    }


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [r for r in payload["speed"] if r.get("ok")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, eager in (("CUDA graphs", False), ("eager", True)):
        plain = [r for r in speed if r["case"].startswith("plain decode")
                 and r["case"].endswith(" eager") == eager]
        if plain:
            axes[0].plot([r["batch"] for r in plain], [r["tokens_per_s"] for r in plain], "o-", label=label)
    if speed:
        axes[0].legend()
        axes[0].set_xscale("log", base=2)
        axes[0].set_xlabel("batch")
        axes[0].set_ylabel("decode tokens/s")
        axes[0].set_title("plain decoding")
    spec = [r for r in speed if "speedup" in r and r["speedup"]]
    if spec:
        names = [f"{r['method']} {r['tree']}\n{r['policy']} ({r['set']})" for r in spec]
        axes[1].barh(
            range(len(spec)),
            [r["speedup"] for r in spec],
            color=["C1" if r["policy"] == "always" else "C2" for r in spec],
        )
        axes[1].set_yticks(range(len(spec)), names, fontsize=7)
        axes[1].axvline(1.0, color="k", lw=0.8)
        axes[1].set_xlabel("speedup over own plain, batch 1 greedy")
    exact = payload["exact"] + payload["sampling"]
    ok = sum(r["ok"] for r in exact)
    m = payload["machine"]
    fig.suptitle(
        f"{payload['model']} on {m.get('gpu') or m.get('cpu')} ({payload['device']}), "
        f"exactness {ok}/{len(exact)} cases, commit {m.get('commit')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--model", default=None, help="a bundled name or a model path (omit: the tiny model only)"
    )
    ap.add_argument("--eagle", default=None, help="an EAGLE head trained for --model")
    ap.add_argument(
        "--sections", nargs="+", default=["exact", "sampling", "speed"], choices=["exact", "sampling", "speed"]
    )
    ap.add_argument("--draws", type=int, default=1_000_000, help="draws per distribution case (sampling)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set (coding, edit, prose)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()

    real = None
    real_prompts: dict = {}
    if args.model:
        from specserve.models.bundled import resolve_model
        from specserve.models.loader import load_model_files

        # On the CPU the default path computes from the GGUF's blocks: keep them.
        real = load_model_files(resolve_model(args.model), keep_blocks=args.device == "cpu")
        tok = real.tokenizer
        chat = lambda p: tok.apply_chat_template([{"role": "user", "content": p}])  # noqa: E731
        real_prompts = {
            "coding": [(chat(p), None) for p in CODING[: args.prompts]],
            "edit": [(chat(p), ref) for p, ref in EDIT[: args.prompts]],
            "prose": [(chat(p), None) for p in PROSE[: args.prompts]],
        }
    payload: dict[str, Any] = {
        "benchmark": "device_check",
        "device": args.device,
        "model": args.model or "tiny",
        "eagle": args.eagle,
        "machine": machine_info(),
        "exact": [],
        "sampling": [],
        "speed": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"device_check_{args.device.split(':')[0]}"

    def save() -> None:  # after each section: a run stopped at a lease's limit keeps what it measured
        import json

        for rows in (payload["exact"], payload["speed"]):
            for r in rows:
                r.pop("token_ids", None)
        (args.out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))

    if "exact" in args.sections:
        payload["exact"] = section_exact(args, real, real_prompts)
        save()
    if "sampling" in args.sections:
        payload["sampling"] = section_sampling(args)
        save()
    if "speed" in args.sections and real is not None:
        section_speed(args, real, real_prompts, payload["speed"], save)
    save()
    try:
        plot(payload, args.out / f"{name}.png")
    except Exception as e:  # noqa: BLE001 - a missing plot never loses the figures
        log(f"plot failed: {e}")
    failed = [r["case"] for r in payload["exact"] + payload["sampling"] + payload["speed"] if not r["ok"]]
    log(f"wrote {args.out / name}.json; failed cases: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
