"""Frozen engine configuration, validated on construction with messages a user can act on."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from specserve.errors import ConfigError


class Quantization(str, enum.Enum):
    """How a model's linear layers hold their weights (a str, like KVCacheDtype: it compares,
    prints and serialises as its value). What each mode can do is a property here, so no caller
    spells out lists of mode names. Kernels: specserve.models.linear, specserve.models.block_linear."""

    NONE = "none"  # float weights
    INT8 = "int8"  # weight-only int8 per output row
    INT4 = "int4"  # 4-bit blocks (Q4_K; a GGUF's other blocks requantized) through the native kernels
    AUTO = "auto"  # a GGUF file's own blocks as they are, through the native kernels
    W8A8 = "w8a8"  # int8 weights and per-call int8 activations: drafts only (draft_only)

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def parse(cls, value: object, what: str = "quantization") -> Quantization:
        """The mode a user's spelling names (any case); a ConfigError naming the choices otherwise."""
        try:
            return cls(value.strip().lower() if isinstance(value, str) else value)
        except ValueError:
            raise ConfigError(f"Unknown {what} {value!r}; use one of {', '.join(QUANTIZATIONS)}.") from None

    @property
    def blocks(self) -> bool:
        """Computes from block-quantized weights with the native CPU kernels (specserve.kernels):
        a checkpoint's blocks are kept at load instead of being expanded to float."""
        return self in (Quantization.INT4, Quantization.AUTO)

    @property
    def cpu_only(self) -> bool:
        """Its kernels exist for the CPU only."""
        return self.blocks or self is Quantization.W8A8

    @property
    def draft_only(self) -> bool:
        """Too lossy and batch-dependent for a target; a draft's numerics only move its acceptance rate."""
        return self is Quantization.W8A8


QUANTIZATIONS = tuple(q.value for q in Quantization)
TARGET_QUANTIZATIONS = tuple(q.value for q in Quantization if not q.draft_only)


class KVCacheDtype(str, enum.Enum):
    """How the paged KV cache stores keys and values (a str: compares, prints and serialises as
    its value, so configs, fingerprints and JSON hold the plain name; CacheConfig maps other
    spellings, KV_CACHE_DTYPE_ALIASES, onto it)."""

    AUTO = "auto"  # float16 for a model on the native CPU kernels (specserve.defaults), else the model's dtype
    FP32 = "fp32"  # float32
    FP16 = "fp16"  # float16: half a float32 cache's bytes; the native CPU kernels widen it as they read
    INT8 = "int8"  # int8 with a float32 scale per (token, head): ~3.8x a float32 cache's tokens

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @property
    def quantized(self) -> bool:
        """Keys and values stored as integers with per-(token, head) scales beside them."""
        return self is KVCacheDtype.INT8

    def storage(self, model_dtype: torch.dtype) -> torch.dtype:
        """The element type of the K and V pages for a model computing in model_dtype."""
        return {KVCacheDtype.AUTO: model_dtype, KVCacheDtype.FP32: torch.float32, KVCacheDtype.FP16: torch.float16,
                KVCacheDtype.INT8: torch.int8}[self]


KV_CACHE_DTYPES = tuple(d.value for d in KVCacheDtype)
# Other spellings users bring from torch, llama.cpp (-ctk f16) and numpy.
KV_CACHE_DTYPE_ALIASES = {"float32": "fp32", "f32": "fp32", "float16": "fp16", "f16": "fp16", "half": "fp16"}
# How a step writes lower-tier prefix hits into the pool (kv_cache/layer_load.py).
KV_TIER_LOADS = ("auto", "layer", "whole")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); else it is emulated."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Turn a user-facing dtype name into a torch dtype ('auto': the fastest exact one here)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        # bf16 halves the bytes read per step, but on CPUs without native bf16 arithmetic
        # every matmul is emulated and runs ~3x slower than float32 (measured on AVX2 EPYC).
        if device.startswith("cuda") or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"Unknown dtype {name!r}; use one of: auto, float32, bfloat16, float16."
        ) from None


# What generated tokens' logprobs report (vLLM's --logprobs-mode names), and the short spellings
# accepted for the two logprob modes.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
LOGPROBS_MODE_ALIASES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


def check_field_types(config: object) -> None:
    """Refuse a config field whose value is not of its declared kind, before any range check:
    `int` fields take integers (not bools, not 2.5), `float` fields finite numbers, `str` fields
    strings (or paths), `bool` fields bools (None where the field allows it). Without this a
    num_spec_tokens of 2.5 built an engine whose every step failed, and a kv_cache_gib of NaN
    failed deep inside the allocator."""
    import dataclasses
    import math
    import numbers

    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        kinds = {k.strip() for k in str(f.type).split("|")}
        value = getattr(config, f.name)
        if value is None and "None" in kinds:
            continue
        if kinds - {"None"} == {"int"}:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            want = "an integer"
        elif kinds - {"None"} == {"float"}:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        elif kinds - {"None"} == {"bool"}:
            ok, want = isinstance(value, bool), "True or False"
        elif kinds - {"None"} == {"str"}:
            ok, want = isinstance(value, (str, os.PathLike)), "a string"  # (a path where a path goes)
        else:
            continue
        if not ok:
            raise ConfigError(f"{f.name} must be {want}{' (or None)' if 'None' in kinds else ''}, got {value!r}.")


LINEAR_BACKEND_NAMES = ("auto", "dense", "onednn")  # specserve.models.linear.LINEAR_BACKENDS and auto


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how to hold it in memory."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length, capped at 8192
    seed: int = 0
    linear_backend: str = "auto"  # auto | dense | onednn (see specserve.models.linear)
    # A Quantization (its name as a string is accepted and converted); None: the fast path for
    # the model (see specserve.defaults: `auto` for a GGUF model on the CPU, `none` otherwise),
    # made explicit when the engine starts.
    quantization: Quantization | None = None
    # CUDA: run every step eagerly instead of replaying short steps as CUDA graphs (engine/graphs.py).
    enforce_eager: bool = False
    # What generated tokens' logprobs (and top logprobs) report, vLLM's modes (LOGPROBS_MODES;
    # "raw" and "processed" are short for the two logprob modes): raw_logprobs (the default), the
    # model's own distribution, before logit_bias, penalties, min_tokens and grammar masks;
    # processed_logprobs, the distribution the token was drawn from: after those, temperature,
    # min-p, top-k and top-p (tokens they remove: -inf; greedy requests: no temperature or
    # truncation); raw_logits / processed_logits, the same rows' logits, not normalised. Prompt
    # logprobs are always raw logprobs (as vLLM's).
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        check_field_types(self)
        parse_dtype(self.dtype, self.device)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"Unknown device {self.device!r}; use 'cpu' or 'cuda'.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(
                f"device={self.device!r} was requested but CUDA is not available here; use --device cpu."
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.linear_backend not in LINEAR_BACKEND_NAMES:  # before the model loads, not after
            raise ConfigError(f"Unknown linear_backend {self.linear_backend!r}; use one of {', '.join(LINEAR_BACKEND_NAMES)}.")
        if self.quantization is not None:  # frozen: the enum from here on
            object.__setattr__(self, "quantization", Quantization.parse(self.quantization))
        mode = LOGPROBS_MODE_ALIASES.get(self.logprobs_mode, self.logprobs_mode)
        if mode not in LOGPROBS_MODES:
            raise ConfigError(f"Unknown logprobs_mode {self.logprobs_mode!r}; use one of {', '.join(LOGPROBS_MODES)} "
                              f"(or {' / '.join(LOGPROBS_MODE_ALIASES)}).")
        object.__setattr__(self, "logprobs_mode", mode)  # frozen: the canonical name from here on

    @property
    def block_weights(self) -> bool:
        """Its linear layers compute from block-quantized weights (quantization auto / int4; False
        while the quantization is still to be picked)."""
        return self.quantization is not None and self.quantization.blocks

    @property
    def native_cpu(self) -> bool:
        """The model runs on the native CPU kernels: block-quantized weights (quantization auto /
        int4) and float32 activations on the CPU (its KV cache then defaults to float16)."""
        return self.device == "cpu" and self.block_weights and self.torch_dtype == torch.float32

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights and activations.

        'auto' with the CPU block kernels (quantization auto / int4) is float32 even where bf16
        is fast: those kernels take float32 activations, and the native norms, RoPE, attention
        and one-call decoder stack are float32 only, so bf16 would only add conversions.
        """
        if self.dtype == "auto" and self.block_weights and not self.device.startswith("cuda"):
            return torch.float32
        return parse_dtype(self.dtype, self.device)

    @cached_property
    def torch_device(self) -> torch.device:
        """The torch device everything runs on."""
        return torch.device(self.device)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget and prefix caching."""

    block_size: int = 16
    kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # tests: an exact block count instead of a budget
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO  # a string is accepted and converted (see KVCacheDtype)
    # Lower tiers of the prefix cache (kv_cache/tiers.py): host memory, then local disk.
    kv_host_gib: float = 0.0  # 0: no host tier
    kv_disk_dir: str | None = None  # None: no disk tier
    kv_disk_gib: float = 16.0  # disk tier size when kv_disk_dir is given
    # layer: a disk hit is read, verified and written layer by layer beside the forward; whole:
    # every hit before the forward; auto: layer when a CPU is spare beyond the compute threads
    # (measured: with none spare the loader only slows the forward's threads down).
    kv_tier_load: str = "auto"
    # The deployment's block store across hosts (kv_cache/remote.py): the name of its Ray actor.
    kv_remote_store: str | None = None

    @property
    def has_tiers(self) -> bool:
        """True when blocks leaving the pool are kept in a lower tier."""
        return self.enable_prefix_caching and (self.kv_host_gib > 0 or self.kv_disk_dir is not None
                                               or self.kv_remote_store is not None)

    def __post_init__(self) -> None:
        check_field_types(self)
        spelled = str(self.kv_cache_dtype).strip().lower()
        kv_dtype = KV_CACHE_DTYPE_ALIASES.get(spelled, spelled)
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"Unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}."
            )
        object.__setattr__(self, "kv_cache_dtype", KVCacheDtype(kv_dtype))  # frozen: the enum from here on
        if self.kv_tier_load not in KV_TIER_LOADS:
            raise ConfigError(f"Unknown kv_tier_load {self.kv_tier_load!r}; use one of {', '.join(KV_TIER_LOADS)}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}.")
        if not self.kv_host_gib >= 0:
            raise ConfigError(f"kv_host_gib must be >= 0 (0: no host tier), got {self.kv_host_gib}.")
        if not self.kv_disk_gib > 0:
            raise ConfigError(f"kv_disk_gib must be > 0, got {self.kv_disk_gib}.")
        if self.kv_disk_dir is not None and not str(self.kv_disk_dir).strip():
            raise ConfigError("kv_disk_dir is empty; give a directory for the disk tier or leave it out.")
        if self.kv_remote_store is not None and not str(self.kv_remote_store).strip():
            raise ConfigError("kv_remote_store is empty; name the deployment's KV store actor or leave it out.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be >= 1 when given.")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # requests running at once
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None  # bounded waiting queue (None: unbounded)

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1.")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1.")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError("max_waiting must be >= 0 when given.")


LOOKAHEAD_CORPORA = ("auto", "stdlib", "python", "none")  # or a directory of text files
SPEC_METHODS = ("none", "draft", "ngram", "reference", "lookahead", "eagle", "medusa", "mtp", "layerskip")
# Methods whose --draft-model is a file `specserve train-draft` fits for the target (auto: the cached one).
HEAD_METHODS = ("eagle", "medusa", "mtp", "layerskip")
# A draft stops after a token it gives a probability below this (the token is still proposed).
# Measured on Qwen2.5-Coder 1.5B + 0.5B (2-vCPU Xeon, coding prompts): 0.8 +5-7% tok/s over 0.
DEFAULT_DRAFT_P_MIN = 0.8
SPEC_POLICIES = ("adaptive", "always", "off")
# tree: proposers that can branch draft trees (several candidates per position, verified in one
# pass); chain: every draft is one path (the classic K-token draft); auto: what measured faster
# for the proposer (ProposerTraits.tree_by_default).
SPEC_TREES = ("auto", "tree", "chain")
# --spec-copy: a model drafter's requests that repeat their context (ngram) or their reference text
# (reference) are drafted by copying where a tail of copy_min_match tokens matches (spec/hybrid.py);
# auto: the reference where a request has one, else ngram, in front of a model drafter; nothing
# in front of the others.
SPEC_COPIES = ("auto", "none", "ngram", "reference")
# --spec-join: a model-free proposer whose candidates join a model drafter's tree every step it
# drafts, verified in the same pass (spec/join.py); none: the drafter's (and the copier's) alone.
SPEC_JOINS = ("none", "lookahead")
# Proposers that draft with a model pass: the ones a copier can go in front of.
MODEL_DRAFTERS = ("draft", "eagle", "medusa", "mtp", "layerskip")


# vLLM's speculative_config methods -> ours. vLLM's suffix decoding (suffix trees over prompt and
# output) is what our ngram proposer does within a request; eagle3's fused low/mid/high features
# are our eagle head's default.
_VLLM_METHODS = {"draft_model": "draft", "eagle3": "eagle", "suffix": "ngram", "deepseek_mtp": "mtp"}
# vLLM's keys -> LLM(...) keyword arguments (disable_by_batch_size is handled apart).
_VLLM_KEYS = {"model": "draft_model", "num_speculative_tokens": "num_spec_tokens", "quantization": "draft_quantization",
              "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max",
              "suffix_decoding_max_cached_requests": "suffix_cache_requests"}
# Keys accepted with these values only: they ask for nothing beyond what specserve does anyway.
_VLLM_NOOPS = {"draft_tensor_parallel_size": (None, 1), "revision": (None,), "code_revision": (None,)}


def spec_kwargs_from_vllm(cfg: object) -> dict[str, object]:
    """LLM(...) keyword arguments from vLLM's speculative_config (a dict, or its JSON text):
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    {"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 5},
    {"method": "eagle3", "model": "head.safetensors"}. Methods are vLLM's (draft_model, ngram,
    suffix, eagle, eagle3, medusa, mtp, deepseek_mtp and the other *_mtp) or ours (SPEC_METHODS);
    disable_by_batch_size N stops speculation at batch N and above. A key specserve has no
    counterpart for is refused by name, never ignored."""
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}.") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"speculative_config must be a dict (JSON object), got {type(cfg).__name__}.")
    known = {"method", "disable_by_batch_size", *_VLLM_KEYS, *_VLLM_NOOPS}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"speculative_config keys {unknown} have no counterpart in specserve; it takes "
                          f"{', '.join(sorted(known))}.")
    for key, allowed in _VLLM_NOOPS.items():
        if key in cfg and cfg[key] not in allowed:
            raise ConfigError(f"speculative_config {key}={cfg[key]!r} is not supported (only {allowed[-1]!r}).")
    method = cfg.get("method")
    if method is None:
        if not cfg.get("model"):
            raise ConfigError("speculative_config needs a method (e.g. 'ngram', 'eagle', 'draft_model') or a draft model.")
        method = "draft_model"
    if not isinstance(method, str):
        raise ConfigError(f"speculative_config method must be a string, got {method!r}.")
    ours = _VLLM_METHODS.get(method, "mtp" if method.endswith("_mtp") else method)
    if ours not in SPEC_METHODS or ours == "none":
        raise ConfigError(f"speculative_config method {method!r} is not one specserve has; use one of "
                          f"{', '.join(sorted({*_VLLM_METHODS, *SPEC_METHODS} - {'none'}))}.")
    out: dict[str, object] = {"spec_method": ours}
    for key, name in _VLLM_KEYS.items():
        if cfg.get(key) is not None:
            out[name] = cfg[key]
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if cfg.get(key) is not None and (not isinstance(cfg[key], int) or isinstance(cfg[key], bool)):
            raise ConfigError(f"speculative_config {key} must be an integer, got {cfg[key]!r}.")
    if "ngram_min" in out and "ngram_max" not in out:  # a minimum above our default maximum raises it
        out["ngram_max"] = max(out["ngram_min"], SpecConfig.ngram_max)  # type: ignore[call-overload]
    n = cfg.get("disable_by_batch_size")
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"speculative_config disable_by_batch_size must be an integer >= 1, got {n!r}.")
        out["spec_off_batch"], out["spec_on_batch"] = n, min(SpecConfig.on_batch, n)
    return out


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which proposer, how many tokens, and when to speculate."""

    method: str = "none"  # none | draft | ngram | reference | lookahead | eagle | medusa | mtp | layerskip
    # Maximum K per request per step (chain length; for trees: how deep speculation pays). The
    # policy picks K <= this each step; 8 measured 3-4% faster than 4 with the Qwen 0.5B draft.
    num_spec_tokens: int = 8
    max_draft_nodes: int = 16  # trees: most nodes a draft may have (pruned to what pays each step)
    policy: str = "adaptive"  # adaptive | always | off
    tree: str = "auto"  # auto | tree | chain (see SPEC_TREES)
    draft_model: str | None = None
    # draft: keep only the draft model's first N layers; layerskip: the target layer the draft exits after
    draft_num_layers: int | None = None
    draft_kv_cache_gib: float | None = None  # default: a share of the target's budget
    draft_quantization: Quantization | None = None  # (a string is converted) None: int4 under a target on auto, else the target's
    # Restrict the draft LM head to the N most frequent token ids (0: the whole vocabulary; None:
    # 65,536 for vocabularies above 100k, see specserve.defaults).
    draft_vocab_size: int | None = None
    draft_p_min: float = DEFAULT_DRAFT_P_MIN  # stop drafting after a token the draft gives p < this (0: never)
    ngram_min: int = 1
    ngram_max: int = 4
    lookahead_window: int = 6  # lookahead: Jacobi window length
    # lookahead: the corpus whose n-grams also draft (specserve.spec.corpus): "auto" (the Python
    # standard library's source and the model's own answers once `specserve build-corpus` wrote
    # them), "stdlib", "python" (the stdlib and the installed packages'), a directory, or "none"
    lookahead_corpus: str = "auto"
    # ngram and lookahead also draft from the outputs of the last this many finished requests
    # (SuffixDecoding's global cache, specserve.spec.served; vLLM's suffix_decoding_max_cached_requests); 0: off
    suffix_cache_requests: int = 10_000
    copy: str = "auto"  # auto | none | ngram | reference: copy before drafting with the model (see SPEC_COPIES)
    copy_min_match: int = 3  # a copy needs the request's last this many tokens to occur earlier
    join: str = "none"  # none | lookahead: candidates joined into the model drafter's trees (see SPEC_JOINS)
    # Reference thresholds: speculate freely at batch <= on_batch, never at batch >= off_batch,
    # only priority requests (priority < 0) in between. The cost model decides within them.
    on_batch: int = 8
    off_batch: int = 32
    profile_on_start: bool = True  # time target/draft forwards at start-up to seed the cost model
    # Speculation switched off at run time for this many seconds frees the drafter's weights and
    # KV cache (switching it on reloads them); None keeps them loaded.
    release_after_s: float | None = 300.0

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"Unknown spec method {self.method!r}; use one of {', '.join(SPEC_METHODS)}.")
        if self.policy not in SPEC_POLICIES:
            raise ConfigError(f"Unknown spec policy {self.policy!r}; use one of {', '.join(SPEC_POLICIES)}.")
        if self.tree not in SPEC_TREES:
            raise ConfigError(f"Unknown spec tree mode {self.tree!r}; use one of {', '.join(SPEC_TREES)}.")
        if not 1 <= self.num_spec_tokens <= 32:
            raise ConfigError(f"num_spec_tokens must be in [1, 32], got {self.num_spec_tokens}.")
        if not 1 <= self.max_draft_nodes <= 64:
            raise ConfigError(f"max_draft_nodes must be in [1, 64], got {self.max_draft_nodes}.")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("spec method 'draft' needs a draft model; pass --draft-model NAME_OR_PATH.")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ConfigError("draft_num_layers must be >= 1 when given.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ConfigError("draft_vocab_size must be >= 0 when given (0: the whole vocabulary).")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise ConfigError(f"draft_p_min must be in [0, 1), got {self.draft_p_min}.")
        if self.draft_quantization is not None:  # frozen: the enum from here on
            object.__setattr__(self, "draft_quantization", Quantization.parse(self.draft_quantization, "draft quantization"))
        if self.suffix_cache_requests < 0:
            raise ConfigError(f"suffix_cache_requests must be >= 0 (0 turns the cache off), got {self.suffix_cache_requests}.")
        if not 1 <= self.lookahead_window <= 32:
            raise ConfigError(f"lookahead_window must be in [1, 32], got {self.lookahead_window}.")
        if self.lookahead_corpus not in LOOKAHEAD_CORPORA and not Path(self.lookahead_corpus).is_dir():
            raise ConfigError(f"lookahead_corpus {self.lookahead_corpus!r} is not a directory; give a directory "
                              "of text files, 'auto' (the stdlib and the model's own answers from `specserve "
                              "build-corpus`), 'stdlib' (the Python standard library's source), 'python' (that and "
                              "the installed packages' source) or 'none'.")
        if self.copy not in SPEC_COPIES:
            raise ConfigError(f"Unknown spec copy source {self.copy!r}; use one of {', '.join(SPEC_COPIES)}.")
        if self.copy not in ("auto", "none") and self.method not in MODEL_DRAFTERS:
            raise ConfigError(f"--spec-copy {self.copy} goes in front of a model drafter (--spec-method "
                              f"{'|'.join(MODEL_DRAFTERS)}); --spec-method {self.method} "
                              + ("has none." if self.method == "none" else "copies already."))
        if self.join not in SPEC_JOINS:
            raise ConfigError(f"Unknown spec join source {self.join!r}; use one of {', '.join(SPEC_JOINS)}.")
        if self.join != "none" and self.method not in MODEL_DRAFTERS:
            raise ConfigError(f"--spec-join {self.join} joins a model drafter's trees (--spec-method "
                              f"{'|'.join(MODEL_DRAFTERS)}); --spec-method {self.method} "
                              + ("has none." if self.method == "none" else "is model-free: use it alone."))
        if not 1 <= self.copy_min_match <= 32:
            raise ConfigError(f"copy_min_match must be in [1, 32], got {self.copy_min_match}.")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}.")
        if not 0 <= self.on_batch <= self.off_batch:
            raise ConfigError("need 0 <= on_batch <= off_batch for the speculation thresholds.")
        if self.release_after_s is not None and not self.release_after_s >= 0:
            raise ConfigError(f"release_after_s must be >= 0 seconds (or None: never), got {self.release_after_s}.")

    @property
    def enabled(self) -> bool:
        """True when a proposer is configured."""
        return self.method != "none"

    @property
    def copiers(self) -> tuple[str, ...]:
        """The copiers in front of the proposer, tried in turn: `copy`, with auto resolved (a
        request's reference text where it has one and it matches, else its context, in front of a
        model drafter; nothing in front of the others)."""
        if self.copy == "auto":
            return ("reference", "ngram") if self.method in MODEL_DRAFTERS else ()
        return () if self.copy == "none" else (self.copy,)

    def use_trees(self, proposer_default: bool) -> bool:
        """Whether a proposer that can branch drafts trees: as asked, or its measured default."""
        return self.tree == "tree" or (self.tree == "auto" and proposer_default)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, composed from the per-concern configs."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    num_threads: int | None = None  # torch intra-op threads on CPU (None: leave torch's default)
    log_stats: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1 (or None: torch's default), got {self.num_threads}.")
        if self.model.quantization is not None and self.model.quantization.draft_only:
            raise ConfigError(
                f"--quantization {self.model.quantization} is for draft models only "
                f"(--draft-quantization {self.model.quantization}): quantizing activations per call "
                "moves the target's log-probs by ~0.5 nats/token on SmolLM2 and makes its outputs depend "
                "on batch composition. For the target use --quantization int8 (weight-only)."
            )
