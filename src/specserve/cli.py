"""`specserve` command line: serve a model (OpenAI-compatible), generate offline, and the operator's tools (calc, profile, plan, audit, train-draft, build-corpus)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specserve.config import (
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    KV_TIER_LOADS,
    QUANTIZATIONS,
    SPEC_METHODS,
    TARGET_QUANTIZATIONS,
    spec_kwargs_from_vllm,
)
from specserve.errors import ConfigError, SpecServeError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="the model, as vLLM's positional argument (or --model)")
    g.add_argument("--model", default=None, help="bundled model name, GGUF file or HF directory")
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--dtype", default="auto",
                   help="auto (bf16 on GPU / CPUs with native bf16, else float32), bfloat16, float32")
    g.add_argument("--linear-backend", default="auto", choices=["auto", "dense", "onednn"],
                   help="linear kernels: auto picks oneDNN packed weights for float32 on CPU")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (default: decode and verify steps replay as CUDA graphs)")
    g.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits", "raw", "processed"],
                   help="generated tokens' logprobs, vLLM's modes: raw_logprobs (raw) = the model's own distribution, "
                        "before logit_bias, penalties, min_tokens and grammars (the default); processed_logprobs "
                        "(processed) = the distribution the token was drawn from: after those, temperature, min-p, "
                        "top-k and top-p; *_logits = the same rows' logits. Prompt logprobs are always raw logprobs")
    g.add_argument("--quantization", default=None, choices=TARGET_QUANTIZATIONS,
                   help="default: auto for a GGUF model on the CPU, else none. none: float weights (a GGUF's "
                        "blocks decoded once; exact reference); auto: keep a GGUF's quantized blocks and compute "
                        "from them (native kernels, fastest on CPU); int4: 4-bit blocks; int8: weight-only int8 per row")
    g.add_argument("--kv-cache-dtype", default="auto", type=str.lower, choices=[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES],
                   metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="KV cache storage: auto = fp16 on the native CPU kernels, else the model dtype; fp32; "
                        "fp16 (also float16, f16, half: 2x a float32 cache's tokens); "
                        "int8 = per-(token, head) scaled int8 (~3.8x the tokens)")
    g.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache memory budget in GiB")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: model's, capped at 8192)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=64, help="max concurrently running requests")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--kv-host-gib", type=float, default=0.0, metavar="G",
                   help="prefix cache host-memory tier: blocks leaving the KV cache are kept in G GiB of RAM "
                        "and loaded back on a prefix hit (default 0: off)")
    g.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="prefix cache disk tier: every cached block is also written to DIR (verified on load; "
                        "a server restarted on the same DIR starts warm)")
    g.add_argument("--kv-disk-gib", type=float, default=16.0, metavar="G", help="disk tier size (default 16)")
    g.add_argument("--kv-tier-load", choices=list(KV_TIER_LOADS), default="auto",
                   help="how disk-tier hits reach the KV cache: layer (read and verified layer by layer while the "
                        "forward runs), whole (all before the forward), auto (layer when a CPU is spare beyond "
                        "--threads; default)")
    g.add_argument("--no-chunked-prefill", "--no-enable-chunked-prefill", action="store_true", help="disable chunked prefill")
    g.add_argument("--enable-chunked-prefill", dest="no_chunked_prefill", action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--spec-method", choices=list(SPEC_METHODS), default=None,
                   help="proposer (default: draft when --draft-model is given, else none)")
    s.add_argument("--draft-model", default=None,
                   help="draft model (bundled name, GGUF or HF dir; auto: the bundled smaller sibling of a bundled target); "
                        "with --spec-method eagle | medusa | mtp | layerskip: a head or exit file from `specserve train-draft` (default: the "
                        "one trained for this model in the cache; mtp: first the MTP layer a GGUF target ships, llama.cpp's "
                        "blk.N.nextn.*), or for mtp a GGUF or safetensors file that ships one")
    s.add_argument("--num-spec-tokens", type=int, default=8, help="maximum draft tokens K per step (the policy picks <= this)")
    s.add_argument("--spec-policy", choices=["adaptive", "always", "off"], default="adaptive",
                   help="adaptive: cost model decides K per request per step")
    s.add_argument("--spec-tree", choices=["auto", "tree", "chain"], default="auto",
                   help="tree: proposers that can branch draft trees verified in one pass; chain: one path per draft; "
                        "auto: whichever measured faster for the proposer (trees: ngram, lookahead)")
    s.add_argument("--max-draft-nodes", type=int, default=16,
                   help="trees: most nodes per draft (the policy prunes to what pays each step)")
    s.add_argument("--draft-num-layers", type=int, default=None, help="use only the draft's first N layers; layerskip: the target layer its draft exits after "
                        "(default: the fitted exit's, else three quarters of the layers)")
    s.add_argument("--draft-quantization", default=None, choices=QUANTIZATIONS,
                   help="draft model (and EAGLE head / MTP module) quantization (default: int4 when --quantization is auto, else as "
                        "--quantization); a draft's precision changes its acceptance rate, never the output")
    s.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft LM head over only the N most frequent tokens (+ special tokens, + up to 1024 ids "
                        "the requests' text uses beyond them, learned as they come); stays exact "
                        "(default: 65536 for vocabularies above 100k; 0: the whole vocabulary)")
    s.add_argument("--draft-p-min", type=float, default=None,
                   help="a draft stops after a token it gives a probability below this (default 0.8; 0: "
                        "always draft --num-spec-tokens); exactness is unaffected")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form, instead of --spec-method / --draft-model: e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}' or '{\"model\": \"NAME\", "
                        "\"num_speculative_tokens\": 5}' (methods: draft_model, ngram, suffix, eagle, eagle3, medusa, "
                        "mtp, or ours; disable_by_batch_size N stops speculating at batch N)")
    s.add_argument("--ngram-min", type=int, default=1)
    s.add_argument("--ngram-max", type=int, default=4)
    s.add_argument("--lookahead-window", type=int, default=6, help="lookahead: Jacobi window length")
    s.add_argument("--lookahead-corpus", default="auto",
                   help="lookahead: text whose n-grams also draft: auto (the Python standard library's source, "
                        "and the model's own answers once `specserve build-corpus` wrote them), stdlib, python "
                        "(the stdlib and the installed packages' source: minutes to build once), a directory of "
                        "text files, or none")
    s.add_argument("--suffix-cache-requests", type=int, default=10_000,
                   help="ngram and lookahead also draft from the outputs of the last N finished requests "
                        "(SuffixDecoding's global cache; vLLM's suffix_decoding_max_cached_requests); 0: off")
    s.add_argument("--spec-copy", choices=["auto", "none", "ngram", "reference"], default="auto",
                   help="with a model drafter: copy from the request's context (ngram) or reference text (reference) "
                        "where its last --spec-copy-min-match tokens occur there, and draft with the model elsewhere "
                        "(auto, the default: ngram in front of a model drafter; none: the drafter alone)")
    s.add_argument("--spec-copy-min-match", type=int, default=3, metavar="N",
                   help="--spec-copy: tokens of the request's tail that must match before a copy is drafted")
    s.add_argument("--spec-join", choices=["none", "lookahead"], default="none",
                   help="with a model drafter: lookahead's candidates (Jacobi window, n-grams, the model's own answers, "
                        "a corpus) join the drafter's tree every step it drafts, verified in the same pass")
    s.add_argument("--spec-on-batch", type=int, default=8, help="speculate freely at batch <= this")
    s.add_argument("--spec-off-batch", type=int, default=32, help="never speculate at batch >= this")
    s.add_argument("--spec-release-after", type=float, default=300.0, metavar="SECONDS",
                   help="speculation switched off (POST /admin/speculation) this long frees the drafter's weights "
                        "and KV cache; switching on reloads them (default 300; a negative value keeps them)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed (generate: per-request sampling seed, reproducible output)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine flags (--speculative-config resolved into
    the flags it stands for, so every engine a command builds, disaggregated workers too, gets
    plain keyword arguments)."""
    kwargs = _flag_kwargs(args)
    if getattr(args, "speculative_config", None) is not None:
        if args.spec_method is not None or args.draft_model is not None:
            raise ConfigError("give --speculative-config or --spec-method / --draft-model, not both.")
        kwargs.update(spec_kwargs_from_vllm(args.speculative_config))
    return kwargs


def _flag_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        device=args.device, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib, linear_backend=args.linear_backend,
        enforce_eager=args.enforce_eager, logprobs_mode=args.logprobs_mode,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, draft_quantization=args.draft_quantization,
        draft_vocab_size=args.draft_vocab_size,
        max_model_len=args.max_model_len, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_host_gib=args.kv_host_gib, kv_disk_dir=args.kv_disk_dir, kv_disk_gib=args.kv_disk_gib,
        kv_tier_load=args.kv_tier_load, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=not args.no_chunked_prefill, num_threads=args.threads, seed=args.seed or 0,
        draft_model=args.draft_model, spec_method=args.spec_method, num_spec_tokens=args.num_spec_tokens,
        spec_policy=args.spec_policy, spec_tree=args.spec_tree, max_draft_nodes=args.max_draft_nodes, draft_num_layers=args.draft_num_layers,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, lookahead_window=args.lookahead_window,
        lookahead_corpus=args.lookahead_corpus, suffix_cache_requests=args.suffix_cache_requests,
        spec_copy=args.spec_copy, spec_copy_min_match=args.spec_copy_min_match, spec_join=args.spec_join,
        spec_on_batch=args.spec_on_batch, spec_off_batch=args.spec_off_batch,
        spec_release_after_s=None if args.spec_release_after < 0 else args.spec_release_after,
        **({} if args.draft_p_min is None else {"draft_p_min": args.draft_p_min}),
    )


# ---------------------------------------------------------------------- models
def cmd_models(args: argparse.Namespace) -> int:
    """List bundled models, or print one's assembled path."""
    from specserve.models import bundled

    if args.action == "path":
        if not args.name:
            print("usage: specserve models path NAME", file=sys.stderr)
            return 2
        print(bundled.resolve_model(args.name))
        return 0
    rows = bundled.list_bundled()
    print(f"{'name':32} {'installed':10} {'assembled':10} path")
    for st in rows:
        print(f"{st.name:32} {st.installed!s:10} {st.assembled!s:10} {st.path or '-'}")
    return 0


# ---------------------------------------------------------------------- generate
def _read_text_file(path: str, flag: str) -> str:
    """A UTF-8 text file a flag names; a missing, unreadable or binary file is a one-line error."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecServeError(f"{flag} {path}: cannot read it as UTF-8 text ({e.__class__.__name__}: "
                             f"{getattr(e, 'strerror', None) or e}).") from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for one or more prompts and print text or JSON lines."""
    from specserve import LLM, SamplingParams
    from specserve.sampling_params import is_unicode

    prompts = list(args.prompt or [])
    if args.prompt_file:
        lines = _read_text_file(args.prompt_file, "--prompt-file").splitlines()
        prompts += [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        given = f"--prompt-file {args.prompt_file} holds no prompt (every line is blank)" if args.prompt_file else ""
        print(f"error: {given or 'give at least one --prompt or a --prompt-file'}", file=sys.stderr)
        return 2
    for i, text in enumerate(args.prompt or []):
        if not is_unicode(text):  # argv bytes that were not UTF-8 arrive as lone surrogates
            print(f"error: --prompt {i + 1} is not valid UTF-8 text; write it to a file and pass --prompt-file.",
                  file=sys.stderr)
            return 2
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens, prompt_logprobs=args.prompt_logprobs,
        reference_text=_read_text_file(args.reference_file, "--reference-file") if args.reference_file else None,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        tok = llm.tokenizer
        if tok is None:
            raise SpecServeError("This model has no tokenizer, so --chat cannot render a chat template.")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=not args.json and len(prompts) > 1)
    for out in outputs:
        if args.json:
            print(json.dumps(out.to_dict(), ensure_ascii=False))
        else:
            print(out.text)
            m = out.metrics
            tps = (m.num_generated_tokens - 1) / (m.tpot_s * (m.num_generated_tokens - 1)) if m.tpot_s else float("nan")
            print(
                f"\n[{m.num_generated_tokens} tokens, ttft {m.ttft_s:.3f}s, {tps:.1f} tok/s decode, "
                f"finish={out.finish_reason}]",
                file=sys.stderr,
            )
    return 0


# ---------------------------------------------------------------------- calc
def cmd_calc(args: argparse.Namespace) -> int:
    """specserve calc: one formula's answer as text (or JSON); exit 2 on out-of-range input."""
    from specserve.ops import calc
    from specserve.ops.hardware import HardwareSpec, get_hardware

    def dims() -> tuple[calc.KVDims, calc.ArchConfig | None]:
        """KV dimensions from --model or from --layers/--kv-heads/--head-dim."""
        given = [args.layers, args.kv_heads, args.head_dim]
        if args.model is not None and not args.model.strip():
            raise calc.CalcInputError("--model is empty; give a bundled name, a GGUF file or an HF directory.")
        if args.model is not None:
            if any(v is not None for v in given):
                raise calc.CalcInputError("give --model or the dimensions (--layers --kv-heads --head-dim), not both.")
            arch = calc.load_arch(args.model)
            return calc.KVDims.from_arch(arch), arch
        if any(v is None for v in given):
            raise calc.CalcInputError("give --model M, or all of --layers, --kv-heads and --head-dim.")
        return calc.KVDims(args.layers, args.kv_heads, args.head_dim), None

    def figure(explicit: float | None, flag: str, pick: Callable[[HardwareSpec], float | None]) -> float:
        """An explicit flag's value, else the --hardware preset's figure."""
        if explicit is not None:
            return explicit
        if args.hardware is None:
            raise calc.CalcInputError(f"give {flag} or --hardware NAME.")
        value = pick(get_hardware(args.hardware))
        if value is None:
            raise calc.CalcInputError(f"--hardware {args.hardware} publishes no figure for {flag}; give {flag}.")
        return value

    try:
        if args.calc == "speedup":
            report = calc.speedup_report(args.alpha, args.k, args.cost_ratio)
        elif args.calc == "alpha":
            report = calc.alpha_report(args.k, acceptance=args.acceptance, alpha=args.alpha)
        elif args.calc == "best-k":
            report = calc.best_k_report(args.acceptance, args.cost_ratio, args.max_k)
        elif args.calc == "kv":
            report = calc.kv_report(dims()[0], args.dtype, args.tokens, model=args.model)
        elif args.calc == "transfer":
            bw = figure(args.bandwidth_gbs, "--bandwidth-gbs", lambda hw: hw.link_gb_s)
            if args.bytes is not None:
                if args.model is not None or args.kv_heads is not None or args.head_dim is not None:
                    raise calc.CalcInputError("give --bytes or the KV flags (--model or dimensions), not both.")
                report = calc.transfer_report(args.bytes, bw, 1 if args.layers is None else args.layers,
                                                 args.compute_ms_per_layer)
            else:
                if args.tokens is None:
                    raise calc.CalcInputError("give --bytes B, or the KV flags with --tokens N.")
                d, _ = dims()
                nbytes = calc.kv_bytes_per_token(d, args.dtype) * args.tokens
                report = calc.transfer_report(nbytes, bw, d.layers, args.compute_ms_per_layer)
        elif args.calc == "latency":
            report = calc.latency_report(args.ttft_ms, args.tpot_ms, args.tokens)
        else:  # roofline
            bw = figure(args.bandwidth_gbs, "--bandwidth-gbs", lambda hw: hw.memory_gb_s)
            tflops = figure(args.tflops, "--tflops", lambda hw: hw.tflops)
            if (args.model is None) == (args.params_b is None):
                raise calc.CalcInputError("give --model M or --params-b P (billions of weights), one of them.")
            kv_token, attn, arch = 0, 0, None
            if args.context_tokens < 0:
                raise calc.CalcInputError(f"--context-tokens must be >= 0, got {args.context_tokens}.")
            if args.model is not None or args.context_tokens:  # the KV each request reads per step
                if args.model is None and args.layers is None:
                    raise calc.CalcInputError("--context-tokens with --params-b needs the KV dimensions: "
                                              "--layers, --kv-heads and --head-dim.")
                d, arch = dims()
                kv_token = calc.kv_bytes_per_token(d, args.kv_dtype)
                attn = calc.attention_flops_per_context_token(arch) if arch is not None else 0
            weights = calc.weights_read_per_token(arch) if arch is not None else args.params_b * 1e9
            report = calc.roofline_report(weights, args.weight_bits, args.batch, bw, tflops,
                                          context_tokens=args.context_tokens, kv_bytes_token=kv_token,
                                          attn_flops_per_context_token=attn,
                                          inputs={"model": args.model, "hardware": args.hardware})
    except SpecServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # strict JSON, in either form: a figure that came out NaN or infinite is an input out of range
        text = json.dumps(report.to_dict(), indent=2, allow_nan=False)
        text = text if args.json else report.to_text()
    except ValueError:
        print("error: these inputs give a result that is not a finite number; check their magnitudes.", file=sys.stderr)
        return 2
    print(text)
    return 0


def _add_calc_parser(sub: argparse._SubParsersAction) -> None:
    """`specserve calc` and its subcommands (the formulas in specserve.ops.calc)."""
    from specserve.ops.calc import KV_DTYPE_BYTES
    from specserve.ops.hardware import HARDWARE

    calc = sub.add_parser("calc", help="the operator's formulas: speedup, alpha, best K, KV size, transfer, "
                          "latency, roofline", description="Exit status 2 on out-of-range input.")
    cs = calc.add_subparsers(dest="calc", required=True)

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        return p

    def kv_dims(p: argparse.ArgumentParser, dtype_flag: str = "--dtype") -> None:
        g = p.add_argument_group("KV dimensions (a model, or the three numbers)")
        g.add_argument("--model", default=None, help="bundled name, GGUF file or HF directory (reads its config only)")
        g.add_argument("--layers", type=int, default=None, help="transformer layers")
        g.add_argument("--kv-heads", type=int, default=None, help="key/value heads per layer")
        g.add_argument("--head-dim", type=int, default=None, help="dimension of one head")
        g.add_argument(dtype_flag, choices=list(KV_DTYPE_BYTES), default="fp16",
                       help="KV element type (int8: specserve's int8 cache, float32 scales included)")

    hw_help = f"published figures by name: {', '.join(HARDWARE)} (explicit flags override)"

    p = common(cs.add_parser("speedup", help="S = alpha / (1 + K*c), and its high-batch form"))
    p.add_argument("--alpha", type=float, required=True, help="expected tokens per target step (1..K+1)")
    p.add_argument("--k", type=int, required=True, help="draft tokens per step")
    p.add_argument("--cost-ratio", type=float, default=0.0,
                   help="T_draft / T_target: one draft pass over one target step (default 0: free drafts)")

    p = common(cs.add_parser("alpha", help="tokens per step from per-token acceptance, or the inverse"))
    p.add_argument("--k", type=int, required=True, help="draft tokens per step")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--acceptance", type=float, help="per-token acceptance b -> alpha")
    g.add_argument("--alpha", type=float, help="tokens per step -> per-token acceptance b")

    p = common(cs.add_parser("best-k", help="the K with the highest speedup, with S for every K"))
    p.add_argument("--acceptance", type=float, required=True, help="per-token acceptance b")
    p.add_argument("--cost-ratio", type=float, required=True, help="T_draft / T_target")
    p.add_argument("--max-k", type=int, default=16, help="largest K to consider")

    p = common(cs.add_parser("kv", help="KV bytes per token and per request"))
    kv_dims(p)
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (prompt + output)")

    p = common(cs.add_parser("transfer", help="KV transfer time and how much layer pipelining hides"))
    kv_dims(p)
    p.add_argument("--tokens", type=int, default=None, help="tokens whose KV moves (with the KV flags)")
    p.add_argument("--bytes", type=float, default=None, help="bytes to move (instead of the KV flags)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="link bandwidth in GB/s (10^9 bytes/s)")
    p.add_argument("--hardware", default=None, help=f"link bandwidth from {hw_help}")
    p.add_argument("--compute-ms-per-layer", type=float, default=None,
                   help="prefill compute per layer, ms (default: assume it keeps ahead of the link)")

    p = common(cs.add_parser("latency", help="latency = TTFT + (N - 1) * TPOT"))
    p.add_argument("--ttft-ms", type=float, required=True, help="time to first token, ms")
    p.add_argument("--tpot-ms", type=float, required=True, help="time per output token after the first, ms")
    p.add_argument("--tokens", type=int, required=True, help="output tokens N")

    p = common(cs.add_parser("roofline", help="bytes per decode step, tokens/s ceiling, ridge batch"))
    kv_dims(p, "--kv-dtype")
    p.add_argument("--params-b", type=float, default=None, help="billions of weights read per step (instead of --model)")
    p.add_argument("--weight-bits", type=float, default=16, help="bits per stored weight (e.g. 4.5 for Q4_K)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding in one step")
    p.add_argument("--context-tokens", type=int, default=0, help="KV context each request reads per step")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth in GB/s")
    p.add_argument("--tflops", type=float, default=None, help="peak dense TFLOP/s")
    p.add_argument("--hardware", default=None, help=hw_help)


# ---------------------------------------------------------------------- profile, plan
def cmd_profile(args: argparse.Namespace) -> int:
    """specserve profile: time this machine running the model; write the profile JSON."""
    from specserve import LLM
    from specserve.files import output_file
    from specserve.ops.profile import describe, record_profile, write_profile
    from specserve.progress import spinner

    for flag, values in (("--batches", args.batches), ("--contexts", args.contexts), ("--repeats", [args.repeats])):
        if values is not None and min(values) < 1:
            raise ConfigError(f"{flag} must be at least 1, got {min(values)}.")
    out = output_file(args.out, "--out")
    with spinner(f"loading {args.model}"):
        llm = LLM(args.model, **engine_kwargs(args), profile_spec_costs=False)
    kwargs = {k: getattr(args, k) for k in ("batches", "contexts") if getattr(args, k) is not None}
    if args.disagg:
        kwargs["disagg_kwargs"] = engine_kwargs(args)
    profile = record_profile(llm.engine, repeats=args.repeats, **kwargs)
    path = write_profile(profile, out)
    print(describe(profile))
    print(f"wrote {path}")
    return 0


def _layer_list(text: str) -> tuple[int, ...]:
    """--feature-layers: comma-separated layer counts, or none."""
    if text.strip().lower() in ("none", ""):
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers or 'none', got {text!r}") from None


def cmd_build_corpus(args: argparse.Namespace) -> int:
    """specserve build-corpus: the model's own answers, for lookahead's corpus."""
    from specserve import LLM
    from specserve.files import output_file
    from specserve.models.bundled import resolve_model
    from specserve.spec.corpus import self_text_path, write_self_text

    if args.asks < 1 or args.max_tokens < 1 or args.batch < 1:
        raise ConfigError("--asks, --max-tokens and --batch must be at least 1.")
    out = output_file(args.out, "--out") if args.out else self_text_path(resolve_model(args.model))
    llm = LLM(args.model, spec_method="none", quantization=args.quantization, max_num_seqs=args.batch,
              num_threads=args.threads)
    card = write_self_text(llm, out, args.asks, args.max_tokens, args.seed)
    print(f"wrote {card['path']}: {card['tokens']:,} tokens answering {card['asks']} asks in {card['seconds']:.0f} s")
    print("  `--spec-method lookahead` drafts from it with the default --lookahead-corpus auto")
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    """specserve train-draft: self-distil a drafter head for a model on this CPU."""
    from specserve.spec.train import TrainConfig, train_draft

    fields = ("model", "method", "out", "corpus", "tokens", "heldout_tokens", "generated_share", "seq_len", "epochs", "batch_tokens", "lr",
              "depth", "intermediate_size", "head_vocab", "max_minutes", "budget_minutes", "fresh", "seed", "quantization", "threads", "work_dir", "layers")
    card = train_draft(TrainConfig(**{f: getattr(args, f) for f in fields}, feature_layers=args.feature_layers))
    if card["method"] == "layerskip":
        done = "" if card["complete"] else " (stopped early: rerun to resume)"
        print(f"wrote {card['path']}{done}")
        print(f"  fitted on {card['tokens_seen']:,} tokens in {card['wall_s']:.0f} s; exit after layer {card['num_layers']} of "
              f"{card['target_layers']}: held-out top-1 {card['heldout_accept_depth1']:.2f}, predicted speedup "
              f"{card['predicted_speedup']:.2f}x (layer share as the draft's cost)")
        for r in card["candidates"]:
            print(f"    layer {r['layer']:3d}: top-1 {r['heldout_top1']:.2f} (untrained {r['raw_top1']:.2f}), "
                  f"predicted {r['predicted_speedup']:.2f}x at K = {r['best_k']}")
    else:
        done = "" if card["complete"] else f" (stopped at step {card['steps']} of {card['total_steps']}: rerun to resume)"
        print(f"wrote {card['path']}{done}")
        print(f"  trained on {card['tokens_seen']:,} tokens ({card['train_tokens']:,} distinct) in {card['wall_s']:.0f} s; "
              f"held-out top-1 agreement by depth: {', '.join(f'{a:.2f}' for a in card['heldout_accept_by_depth'])}")
        for kind, accs in card.get("heldout_accept_by_kind", {}).items():
            print(f"    {kind}: {', '.join(f'{a:.2f}' for a in accs)}")
    print(f"  serve it: specserve serve --model {args.model} --spec-method {card['method']}"
          + ("" if args.out is None else f" --draft-model {card['path']}"))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """specserve plan: rank deployments of a workload mix by goodput within the SLO."""
    from specserve.ops.plan import run

    return run(args)


# ---------------------------------------------------------------------- serve
def cmd_audit(args: argparse.Namespace) -> int:
    """specserve audit: run the audits, print a table (or JSON); exit 3 when one fails."""
    import json

    from specserve.defaults import bundled_draft
    from specserve.ops.audit import read_prompts, run_audit

    if args.draws is None:
        args.draws = 2_000 if args.url else 10_000
    bad = [msg for ok, msg in (
        (args.positions >= 1, f"--positions must be >= 1, got {args.positions}"),
        (args.draws >= 1, f"--draws must be >= 1, got {args.draws}"),
        (not (args.url and (args.spec_method != "none" or args.draft_model)),
         "--url audits the speculation the server runs: leave --spec-method and --draft-model out"),
        (0 < args.alpha < 1, f"--alpha (the significance level) must lie in (0, 1), got {args.alpha}"),
        (0 <= args.max_kl < float("inf"), f"--max-kl must be a number >= 0, got {args.max_kl}"),
        (args.continuation_tokens >= 1, f"--continuation-tokens must be >= 1, got {args.continuation_tokens}"),
    ) if not ok]
    if bad:
        print(f"error: {bad[0]}.", file=sys.stderr)
        return 2
    try:
        prompts = read_prompts(args.prompts)
    except OSError as e:
        print(f"error: --prompts {args.prompts}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    draft = args.draft_model
    if draft == "auto":
        draft = bundled_draft(args.model)
    if args.spec_method == "draft" and not draft:
        print("error: --spec-method draft needs --draft-model", file=sys.stderr)
        return 2
    from specserve import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    precisions = [p for p in args.precisions.split(",") if p]
    try:
        rows = run_audit(args.model, prompts, spec_method=args.spec_method,
                         draft_model=draft if args.spec_method == "draft" else None, precisions=precisions,
                         params=params, continuation_tokens=args.continuation_tokens, positions=args.positions,
                         draws=args.draws, alpha=args.alpha, max_kl=args.max_kl, url=args.url,
                         api_key=os.environ.get(API_KEY_ENV) or None)
    except SpecServeError as e:  # a model, precision or server it cannot use: bad input, status 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("error: nothing to audit: give --spec-method, --url and/or --precisions (at least two)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            verdict = ("PASS" if r["passed"] else "FAIL") + (f" ({r['reason']})" if r["reason"] else "")
            figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                                if k not in ("audit", "kind", "passed", "reason"))
            print(f"{r['audit']}: {verdict}\n  {figures}")
    return 0 if all(r["passed"] for r in rows) else 3


API_KEY_ENV = "SPECSERVE_API_KEY"


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from --api-key-file, --api-key or $SPECSERVE_API_KEY (the first given)."""
    import logging

    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both.")
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file}: {e}; give a readable UTF-8 file.") from None
        if not key:
            raise ConfigError(f"--api-key-file {args.api_key_file} is empty; write the key into it.")
        return key
    if args.api_key is not None:
        logging.getLogger("specserve.cli").warning(
            "--api-key shows the key to anyone who can list processes; prefer $%s or --api-key-file.", API_KEY_ENV)
        return args.api_key or None
    return os.environ.get(API_KEY_ENV) or None


def _port(text: str) -> int:
    """--port: a TCP port number."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port number is 0-65535, got {port}")
    return port


def _at_least(lo: float, kind: type) -> Callable[[str], float]:
    """An argparse type: a finite number of this kind, at least lo."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not (math.isfinite(value) and value >= lo):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {lo:g}, got {text}")
        return value
    return parse


def _check_listen(host: str, port: int) -> None:
    """Refuse a host:port the server could not listen on, before the model loads. (Another
    process may still take the port in between; the server's own bind then reports it.)"""
    import socket

    def why(e: OSError) -> str:  # "Address already in use" -> "address already in use", mid-sentence
        text = str(e.strerror or e)
        return text[:1].lower() + text[1:]

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ConfigError(f"--host {host!r} does not resolve: {why(e)}.") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {why(e)}; pick another --port or --host.") from None


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server until SIGTERM/SIGINT (then drain and exit)."""
    import logging

    from specserve import LLM
    from specserve.server.app import OpenAIServer
    from specserve.server.lifecycle import run_server

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = resolve_api_key(args)
    if args.protect_metrics and not api_key:
        raise ConfigError(f"--protect-metrics needs an API key: give --api-key-file, ${API_KEY_ENV} or --api-key.")
    access = dict(api_key=api_key, protect_metrics=args.protect_metrics,
                  **({} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}))
    name = args.served_model_name or args.model
    _check_listen(args.host, args.port)  # before the minutes a model may take to load
    if args.disagg:
        from specserve.disagg.launch import launch
        from specserve.server.metrics import DisaggMetrics

        def make_router(metrics):  # noqa: ANN001, ANN202
            return launch(
                args.model, engine_kwargs(args), args.prefill_workers, args.decode_workers,
                ray_address=args.ray_address, transport=args.kv_transport, transfer_timeout_s=args.transfer_timeout,
                threads_per_worker=args.worker_threads, pin_cpus=args.pin_cpus, max_waiting=args.max_waiting,
                local_prefill_tokens=args.local_prefill_tokens, role_engine_kwargs=role_engine_kwargs(args),
                kv_layer_start=args.kv_layer_start, kv_store_gib=args.kv_store_gib,
                metrics=DisaggMetrics(metrics.registry, metrics), on_output=metrics.on_finished,
            )

        server = OpenAIServer(None, name, max_waiting=args.max_waiting, drain_timeout_s=args.drain_timeout,
                              router_factory=make_router, **access)
        layout = f"disaggregated: {args.prefill_workers} prefill + {args.decode_workers} decode workers"
    else:
        llm = LLM(args.model, **engine_kwargs(args))
        server = OpenAIServer(llm.engine, name, max_waiting=args.max_waiting, drain_timeout_s=args.drain_timeout,
                              **access)
        layout = "co-located"
    url = f"http://{args.host}:{args.port}"
    lines = {"serving": f"{name!r} ({layout})"}
    if server.engine is not None and hasattr(server.engine, "describe"):
        lines.update(server.engine.describe())
    else:
        spec = server.engine.config.spec
        lines["speculation"] = f"{spec.method}, policy {spec.policy}, K <= {spec.num_spec_tokens}"
    lines["URL"] = f"{url}  (chat page at /, OpenAI API at /v1, metrics at /metrics)"
    lines["ready in"] = f"{time.perf_counter() - _STARTED:.1f} s"
    width = max(len(k) for k in lines)
    print("specserve " + "\n  ".join(["ready"] + [f"{k:<{width}}  {v}" for k, v in lines.items()]), file=sys.stderr, flush=True)
    # SIGTERM/SIGINT drain with the listener open (new requests get 503), then exit with status 0.
    run_server(server, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    print("specserve: drained and stopped", file=sys.stderr)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "models": cmd_models,
    "generate": cmd_generate,
    "audit": cmd_audit,
    "calc": cmd_calc,
    "profile": cmd_profile,
    "plan": cmd_plan,
    "train-draft": cmd_train_draft,
    "build-corpus": cmd_build_corpus,
    "serve": cmd_serve,
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list bundled models or print a model's path")
    p.add_argument("action", nargs="?", choices=["list", "path"], default="list")
    p.add_argument("name", nargs="?")

    p = sub.add_parser("generate", help="offline generation for one or more prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompt-file", help="file with one prompt per line (\\n escapes allowed)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this times as likely as the likeliest")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers', over prompt and output (1: off)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop string before this many tokens")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="with --json: each prompt token's logprob and its K likeliest alternatives (0: none)")
    p.add_argument("--reference-file", help="reference text the output is expected to copy (e.g. the file being edited), searched by prompt lookup (--spec-method ngram or reference) and the copier in front of a model drafter")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    p = sub.add_parser("audit", help="check that speculation emits the target's distribution; KL between precisions",
                       description="Exit status 0 when every audit passes, 3 when one fails (for CI and canaries).")
    p.add_argument("--model", required=True, help="bundled name, GGUF file or HF directory")
    p.add_argument("--prompts", required=True, help="prompt file: one per line, or JSON lines with a \"prompt\"")
    p.add_argument("--spec-method", default="none", choices=list(SPEC_METHODS),
                   help="audit speculation: model-free methods draft one-hot tokens; draft needs --draft-model")
    p.add_argument("--draft-model", default=None, help="draft model whose distribution proposes (auto: the bundled sibling)")
    p.add_argument("--precisions", default="",
                   help="comma list, the first the reference, e.g. none,auto,int4: KL of each against the first "
                        "(with --url, the first alone sets the reference's precision)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--continuation-tokens", type=int, default=32, help="greedy tokens after each prompt")
    p.add_argument("--positions", type=int, default=8, help="audited positions per prompt (the last ones)")
    p.add_argument("--draws", type=int, default=None,
                   help="verifications per position (default 10,000; with --url, served draws, default 2,000)")
    p.add_argument("--url", default=None,
                   help="audit the sampler of this running server (e.g. http://127.0.0.1:8000), speculation as it "
                        "serves, against --model computed here in the precision the server names in /v1/models "
                        "(a canary); the API key from $" + API_KEY_ENV)
    p.add_argument("--alpha", type=float, default=1e-3, help="significance of the speculation audit")
    p.add_argument("--max-kl", type=float, default=0.1, help="largest mean KL (nats) a precision may show")
    p.add_argument("--json", action="store_true", help="print the results as JSON")

    _add_calc_parser(sub)

    p = sub.add_parser("profile", help="time this machine running a model: the step costs `specserve plan` uses")
    add_engine_args(p)
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default 1 2 4 8 16 32)")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="decode contexts (default 128 1024 2560)")
    p.add_argument("--repeats", type=int, default=2, help="runs per point per round (each point's median run is kept)")
    p.add_argument("--disagg", action="store_true",
                   help="also time the model disaggregated (1 prefill + 1 decode worker on Ray, pinned, this many "
                        "threads each): the relay's per-step and per-request cost the planner charges `--disagg` plans")

    from specserve.ops.plan import add_arguments as add_plan_arguments

    p = sub.add_parser("build-corpus", help="the model's own answers to generic asks, for lookahead's corpus",
                       description="Greedy answers of the model to --asks generic asks (none of the benchmarks'); "
                                   "lookahead's default corpus (auto) adds them to the standard library's source.")
    p.add_argument("--model", required=True, help="model (bundled name, GGUF or HF dir)")
    p.add_argument("--asks", type=int, default=256, help="how many asks to answer")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most")
    p.add_argument("--batch", type=int, default=32, help="answers generated at once")
    p.add_argument("--seed", type=int, default=0, help="which asks")
    p.add_argument("--quantization", default=None, help="as for serve (default: the model's fast path)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--out", default=None, help="text file to write (default: the cache, where lookahead finds it)")

    p = sub.add_parser("train-draft", help="train a drafter head (EAGLE) on the target's own features, on this CPU",
                       description="Self-distillation over a local corpus (default: the Python standard library's "
                                   "sources). Resumable: a rerun continues from the last checkpoint.")
    p.add_argument("--model", required=True, help="target model (bundled name, GGUF or HF dir)")
    p.add_argument("--method", default="eagle", choices=["eagle", "medusa", "mtp", "layerskip"],
                   help="drafter kind (mtp: DeepSeek-V3's multi-token-prediction module; layerskip: an exit for the "
                        "target's own first layers, fitted by least squares)")
    p.add_argument("--layers", type=int, default=None,
                   help="layerskip: the exit layer (default: the best of several, by predicted speedup)")
    p.add_argument("--out", default=None, help="head file to write (default: the cache, where --draft-model auto finds it)")
    p.add_argument("--corpus", default=None, help="directory of text files (default: the Python standard library)")
    p.add_argument("--tokens", type=int, default=None,
                   help="training tokens (target features extracted once; default 220k, layerskip 32k)")
    p.add_argument("--heldout-tokens", type=int, default=8192, help="held-out tokens (files never trained on)")
    p.add_argument("--generated-share", type=float, default=None,
                   help="share of --tokens from conversations the target writes itself, greedy (asks about everyday "
                        "subjects, programming tasks and the corpus's functions; default 0.75, layerskip 0.5); the "
                        "rest is corpus text")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--epochs", type=float, default=4.0, help="passes over the training tokens (default 4)")
    p.add_argument("--batch-tokens", type=int, default=512, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--depth", type=int, default=None,
                   help="eagle: unrolled passes per step, the head reading its own predictions (default 2); "
                        "medusa: heads, one per draft depth (default 3)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    p.add_argument("--feature-layers", type=_layer_list, default=None, metavar="A,B|none",
                   help="eagle: target layers whose residual streams (after that many layers) the head fuses with the "
                        "last hidden state, EAGLE-3's low and middle features (default: 2 and half the layers; "
                        "none: the last hidden state alone)")
    p.add_argument("--head-vocab", type=int, default=None, help="ids the head's LM head reads (default 16k / 32k)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this long (a rerun resumes)")
    p.add_argument("--budget-minutes", type=float, default=10.0,
                   help="without --tokens: take as many of the default tokens as this machine gets through in "
                        "this long (measured at the start; training stops there, a rerun resumes); 0: all of them "
                        "(default 10)")
    p.add_argument("--fresh", action="store_true", help="discard a previous run's features and checkpoint")
    p.add_argument("--work-dir", default=None,
                   help="features, conversations and checkpoints (default: $SPECSERVE_CACHE/train/<target>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None, help="the target's precision (default: as it is served)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")

    p = sub.add_parser("plan", help="the deployment with the most goodput within the SLO for a workload mix",
                       description="Exit status 2 on a bad workload file, SLO or profile.")
    add_plan_arguments(p)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --model)")
    p.add_argument("--max-waiting", type=_at_least(0, int), default=256, help="queued requests beyond which clients get 429")
    p.add_argument("--drain-timeout", type=_at_least(0, float), default=30.0,
                   help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /admin, /tokenize and /detokenize (visible in the process list: "
                        f"prefer --api-key-file or ${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (surrounding whitespace dropped)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="also require the API key on /metrics, /stats and the API docs (/docs, /redoc, /openapi.json)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted; larger ones get 413 before they are read (default 8 MiB)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    d = p.add_argument_group("disaggregated serving (prefill and decode workers on Ray)")
    d.add_argument("--disagg", action="store_true",
                   help="run prefill and decode on separate workers (Ray actors) behind one router")
    d.add_argument("--prefill-workers", type=int, default=1, help="number of prefill workers")
    d.add_argument("--decode-workers", type=int, default=1, help="number of decode workers (speculation runs here)")
    d.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    d.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "ray"],
                   help="auto: shared memory between workers on one host, Ray's object store across hosts")
    d.add_argument("--transfer-timeout", type=float, default=60.0,
                   help="seconds without KV progress before a transfer is abandoned and the request re-prefilled "
                        "(before its first KV, + 50 ms per token of its prompt and of those queued ahead of it)")
    d.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    d.add_argument("--local-prefill-tokens", type=int, default=32,
                   help="prompts shorter than this are prefilled on their decode worker (0: always use a prefill worker)")
    d.add_argument("--pin-cpus", action="store_true", help="pin worker i to core i (local Ray only)")
    d.add_argument("--prefill-draft-kv", default="on", choices=["on", "off"],
                   help="with --draft-model (a draft model, or an EAGLE / MTP head): prefill workers also load "
                        "the drafter and send its prompt KV, so a decode worker's draft model does not recompute "
                        "a long prompt in its batch's step and a head drafts with the prompt in view (on); off "
                        "saves the prefill workers that compute (see docs/disaggregation.md)")
    d.add_argument("--kv-layer-start", default="all", choices=["all", "first"],
                   help="a decode worker runs a request's first step once every layer of its prompt KV has "
                        "arrived (all), or once layer 0 has, waiting for each later layer inside that step "
                        "(first: its other requests then wait on the prefill worker's pace; measured with "
                        "chunked prefill: no TTFT gain, 0.5 s decode stalls; see docs/disaggregation.md)")
    d.add_argument("--kv-store-gib", type=float, default=0.0, metavar="G",
                   help="a KV block store of G GiB shared by every worker on any host (a Ray actor; blocks move "
                        "through Ray's object store, each verified when read): prefix blocks one worker computed "
                        "serve all of them, and a prompt whose blocks are all there skips the prefill worker "
                        "(0: none; on one host --kv-disk-dir shares blocks too)")
    for role in ("prefill", "decode"):
        d.add_argument(f"--{role}-max-num-batched-tokens", type=int, default=None, metavar="N",
                       help=f"token budget per step of the {role} workers (default: --max-num-batched-tokens)")
        d.add_argument(f"--{role}-max-num-seqs", type=int, default=None, metavar="N",
                       help=f"running requests per {role} worker (default: --max-num-seqs)")
    return parser


def role_engine_kwargs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per-pool engine overrides of a disaggregated server (only the flags given)."""
    out: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode"):
        for key in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(args, f"{role}_{key}")
            if value is not None:
                out.setdefault(role, {})[key] = value
    if getattr(args, "prefill_draft_kv", "on") == "off":
        out.setdefault("prefill", {})["spec_method"] = "none"  # no draft there: decode workers' drafts catch up
    return out


def _names_a_model(text: str) -> bool:
    """Whether `text` could only mean a model: a bundled name or an existing path."""
    from specserve.models.bundled import BUNDLED_MODELS

    return text in BUNDLED_MODELS or text.lower() in BUNDLED_MODELS or Path(text).expanduser().exists()


_STARTED = time.perf_counter()  # process start, for the time to first request


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `specserve` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "model_arg"):  # a command with engine flags: the model as MODEL or --model, once
        if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
            if args.command == "generate" and not _names_a_model(args.model_arg):  # llama-cli's habit: -m M "prompt"
                args.prompt = [args.model_arg, *(args.prompt or [])]
                args.model_arg = None
            else:
                parser.error(f"the model is given twice: {args.model_arg!r} and --model {args.model!r}")
        args.model = args.model or args.model_arg
        if args.model is None:
            parser.error(f"{args.command} needs a model: specserve {args.command} MODEL (or --model MODEL)")
    try:
        return COMMANDS[args.command](args)
    except SpecServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # what the machine refused mid-way (a disk that filled up): a line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
