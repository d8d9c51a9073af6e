"""Defaults that are the fast path: what a user gets without flags, each choice measured.

A user who passes no precision flag should not get the slowest engine we ship: a GGUF model on
the CPU computes from its own blocks (`auto`, 19 tok/s for Qwen2.5-Coder-1.5B Q4_K_M on an AVX2
EPYC against 2.8 tok/s decoded to float32). Exact float decoding stays one flag away
(`--quantization none`). Drafts get the settings measured best for them (4-bit blocks under an
`auto` target, a 65,536-token head for large vocabularies, adaptive K <= 8, early stop at
p < 0.8), and a bundled target names its bundled smaller sibling with `--draft-model auto`.

The KV cache of a model on the native CPU kernels is float16 (half the bytes of float32, exact
to read; see resolve_defaults).

`resolve_defaults` turns an EngineConfig whose fields say "pick for me" (None, "auto") into an
explicit one, once, before the engine builds anything; everything downstream sees plain values.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from specserve.config import HEAD_METHODS, EngineConfig, KVCacheDtype, Quantization
from specserve.errors import ConfigError

logger = logging.getLogger(__name__)

# Draft LM head over the most frequent ids when the vocabulary is larger than this: for the
# Qwen2.5-Coder 0.5B draft (151,936 ids) a 65,536-id head cut a draft pass by ~2.5 ms and lifted
# coding-prompt decoding 26.8 -> 29.3 tok/s on a 2-vCPU Xeon (acceptance 89% -> 84%), while
# 32,768 lost more acceptance than it saved. Smaller vocabularies keep their full head.
FAST_DRAFT_VOCAB = 65536
FAST_DRAFT_VOCAB_ABOVE = 100_000


def default_quantization(device: str, is_gguf: bool) -> Quantization:
    """`auto` (compute from the file's blocks) for a GGUF model on the CPU when the native
    kernels build here, else `none` (float)."""
    if not is_gguf or device != "cpu":
        return Quantization.NONE
    from specserve.kernels import kernels_available

    if kernels_available():
        return Quantization.AUTO
    logger.warning("the native CPU kernels could not be built: running the GGUF model decoded to float")
    return Quantization.NONE


def bundled_draft(target: str) -> str:
    """The bundled smaller sibling that drafts for a bundled target (`--draft-model auto`)."""
    from specserve.models.bundled import BUNDLED_MODELS

    model = BUNDLED_MODELS.get(target) or BUNDLED_MODELS.get(str(target).lower())
    if model is None or model.draft is None:
        siblings = sorted(n for n, m in BUNDLED_MODELS.items() if m.draft)
        raise ConfigError(
            f"--draft-model auto needs a bundled target with a bundled smaller sibling ({', '.join(siblings)}); "
            f"{target!r} has none. Pass --draft-model NAME_OR_PATH, or use a model-free method "
            "(--spec-method ngram | lookahead)."
        )
    return model.draft


def resolve_defaults(config: EngineConfig, model_path: Path | None, has_blocks: bool | None = None) -> EngineConfig:
    """config with every "pick for me" field made explicit.

    model_path: the model file or directory (None when a checkpoint was handed in); has_blocks:
    whether that checkpoint kept a GGUF's quantized blocks (tests hand in float checkpoints).
    """
    model, spec = config.model, config.spec
    if model.quantization is None:
        is_gguf = has_blocks if has_blocks is not None else (model_path is not None and model_path.suffix == ".gguf")
        model = dataclasses.replace(model, quantization=default_quantization(model.device, bool(is_gguf)))
    if spec.draft_model == "auto" and spec.method not in HEAD_METHODS:  # heads: the one trained here (factory)
        spec = dataclasses.replace(spec, draft_model=bundled_draft(config.model.model))
    # A model on the native CPU kernels keeps float16 KV (as llama.cpp does): the kernels widen it
    # exactly as they read it, twice the tokens fit in --kv-cache-gib, and long contexts decode
    # faster (SmolLM2 at 2,048 / 4,000 tokens of context: 6.03 -> 4.78 / 9.17 -> 6.81 ms a token on a
    # 2-vCPU Zen 5) for a mean log-prob change of ~0.0004 nats a token
    # (tests/models/test_quantization.py). `--kv-cache-dtype fp32` keeps float32.
    cache = config.cache
    if cache.kv_cache_dtype is KVCacheDtype.AUTO and model.native_cpu:
        cache = dataclasses.replace(cache, kv_cache_dtype=KVCacheDtype.FP16)
    return dataclasses.replace(config, model=model, spec=spec, cache=cache)


def default_head_vocab(vocab_size: int) -> int:
    """The head's LM head reads this many of the most frequent ids: one layer costs a few
    percent of a target step, a full 150k-row head would cost ten. SmolLM2's greedy answers to
    the benchmark's prompts are 94% among its 16k most frequent ids, 99% among 32k; a
    32k-id SmolLM2 head drafted no more (1.78 vs 1.79 tokens per forward on coding prompts, 1.52
    on prose) and was 15-20% slower."""
    return min(vocab_size, 16_384 if vocab_size <= 65_536 else 32_768)


def default_draft_vocab(requested: int | None, vocab_size: int) -> int | None:
    """The draft head's vocabulary: as asked (0: the whole vocabulary), else FAST_DRAFT_VOCAB for
    vocabularies larger than FAST_DRAFT_VOCAB_ABOVE, else the whole one (None)."""
    if requested is not None:
        return requested if 0 < requested < vocab_size else None
    return FAST_DRAFT_VOCAB if vocab_size > FAST_DRAFT_VOCAB_ABOVE else None
