"""Build the configured proposer: spec method name -> builder, one registry entry each."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.config import CacheConfig, ModelConfig, Quantization, SpecConfig
from specserve.defaults import default_draft_vocab, default_head_vocab
from specserve.errors import ConfigError, TokenizerMismatchError
from specserve.models.tokenizer import Tokenizer
from specserve.spec.proposer import Proposer
from specserve.spec.served import ServedOutputs

logger = logging.getLogger(__name__)


@dataclass
class ProposerContext:
    """What a proposer builder may need from the engine."""

    spec: SpecConfig
    model: ModelConfig
    cache: CacheConfig
    max_model_len: int
    tokenizer: Tokenizer | None
    target_vocab_size: int
    target_num_blocks: int
    draft_checkpoint: object | None = None  # tests: an already loaded draft checkpoint
    target_runner: object | None = None  # the target's ModelRunner (feature-level drafters share its embedding and head)
    target_block_ids: Callable[[str], list[int]] | None = None  # a request's target block table (read only)
    target_source: str | None = None  # the target's file or directory when it ships an MTP layer (else None)


def _served(ctx: ProposerContext) -> ServedOutputs | None:
    """The engine's store of earlier requests' outputs (None when --suffix-cache-requests is 0)."""
    n = ctx.spec.suffix_cache_requests
    return ServedOutputs(max_requests=n) if n > 0 else None


def _build_ngram(ctx: ProposerContext) -> Proposer:
    from specserve.spec.ngram import NgramProposer

    return NgramProposer(ctx.spec.ngram_min, ctx.spec.ngram_max, tree=ctx.spec.use_trees(NgramProposer.traits.tree_by_default),
                         served=_served(ctx))


def _build_reference(ctx: ProposerContext) -> Proposer:
    """`--spec-method reference` is prompt lookup: `NgramProposer` searches a request's reference
    as text before its prompt, with its trees, copy trust and learned edits, and drafted more per
    step than the reference-only proposer on every edit prompt (Qwen 1.5B `auto`, Zen 4, prompts
    0-3 at 96 tokens: 2.53 / 3.20 / 1.85 / 4.87 tokens per step against 1.96 / 2.82 / 1.66 / 3.65).
    In front of a model drafter the reference-only copier stays (`_build_reference_copier`)."""
    return _build_ngram(ctx)


def _build_reference_copier(ctx: ProposerContext) -> Proposer:
    """The reference-only copier, first in front of a model drafter under `--spec-copy auto`. With
    it the 0.5B draft behind drafted more per step than with prompt lookup as the copier (edit
    prompts, 8, two runs each: 4.8-4.9 tokens per step, 1.87-1.95x, against 4.3-4.4,
    1.77-1.90x), mostly because its copies were seldom taken there: the draft model predicts an
    edited file's copied lines better than a copy does, and prompt lookup's copies replaced its
    drafts in about half the steps."""
    from specserve.spec.reference import ReferenceProposer

    tok = ctx.tokenizer
    encode = (lambda text: tok.encode(text, add_special_tokens=False)) if tok is not None else None
    tree = ctx.spec.use_trees(ReferenceProposer.traits.tree_by_default)
    return ReferenceProposer(encode, ctx.spec.ngram_min, ctx.spec.ngram_max, tree=tree)


def _build_lookahead(ctx: ProposerContext) -> Proposer:
    from specserve.spec.corpus import corpus_note
    from specserve.spec.lookahead import LookaheadProposer

    corpus, own = None, None
    tok = ctx.tokenizer
    if ctx.spec.lookahead_corpus != "none" and tok is not None:
        from specserve.models.bundled import resolve_model
        from specserve.spec.corpus import load_corpus, self_text_path

        if ctx.spec.lookahead_corpus == "auto":
            with contextlib.suppress(Exception):  # a model given as a loaded checkpoint has no file: no answers
                own = self_text_path(resolve_model(ctx.model.model))
        corpus = load_corpus(ctx.spec.lookahead_corpus, tok.encode_many, tok.fingerprint(), self_text=own)
    note = corpus_note(ctx.spec.lookahead_corpus, corpus, own, str(ctx.model.model))
    if own is not None and not own.is_file():
        logger.info("lookahead: %s", note)
    return LookaheadProposer(ctx.spec.lookahead_window, max(2, ctx.spec.ngram_max), corpus, served=_served(ctx),
                             tree=ctx.spec.use_trees(LookaheadProposer.traits.tree_by_default), corpus_note=note)


def _build_draft(ctx: ProposerContext) -> Proposer:
    from dataclasses import replace

    from specserve.models.bundled import resolve_model
    from specserve.models.loader import LoadedCheckpoint, load_model_files
    from specserve.spec.draft_model import DraftModelProposer, truncate_layers

    quantization = default_draft_quantization(ctx.spec.draft_quantization, ctx.model.quantization)
    ckpt = ctx.draft_checkpoint
    if ckpt is None:
        ckpt = load_model_files(resolve_model(ctx.spec.draft_model or ""), keep_blocks=quantization.blocks)
    assert isinstance(ckpt, LoadedCheckpoint)
    check_draft_tokenizer(ctx.tokenizer, ckpt.tokenizer, ctx.target_vocab_size, ckpt.arch.vocab_size)
    arch, weights, packed = ckpt.arch, ckpt.weights, ckpt.packed
    if ctx.spec.draft_num_layers is not None:
        _, packed = truncate_layers(arch, packed, ctx.spec.draft_num_layers)  # type: ignore[arg-type]
        arch, weights = truncate_layers(arch, weights, ctx.spec.draft_num_layers)
    if ctx.spec.draft_kv_cache_gib is not None:
        cache = replace(ctx.cache, kv_cache_gib=ctx.spec.draft_kv_cache_gib, num_gpu_blocks_override=None)
    else:
        # As many token slots as the target has, so drafting never runs out before verifying.
        cache = replace(ctx.cache, num_gpu_blocks_override=ctx.target_num_blocks)
    model = replace(ctx.model, quantization=quantization)
    subset = None
    vocab = default_draft_vocab(ctx.spec.draft_vocab_size, arch.vocab_size)
    if vocab is not None:
        subset = frequent_token_subset(ckpt.tokenizer, arch.vocab_size, vocab)
    return DraftModelProposer(arch, weights, model, cache, ctx.max_model_len, vocab_subset=subset, packed=packed,
                              p_min=ctx.spec.draft_p_min, tree=ctx.spec.use_trees(DraftModelProposer.traits.tree_by_default),
                              source=ckpt.source if ctx.draft_checkpoint is None else None)  # (a file it loaded itself)


def _head_for_target(ctx: ProposerContext, method: str) -> tuple[object, tuple[str, str], object, bool]:
    """(target runner, its fingerprints (current, legacy), the head file, whether to quantize the head) for a
    feature-level drafter: --draft-model FILE, or (None / auto) the MTP layer a GGUF or HF-directory target ships (mtp) or else the
    head train-draft left in the cache."""
    from specserve.models.block_linear import embedding_rows
    from specserve.spec.eagle import FINGERPRINT_ROWS, default_head_path, target_fingerprints

    runner = ctx.target_runner
    if runner is None:
        raise ConfigError(f"--spec-method {method} needs the target model's runner (an engine builds it).")
    fp = target_fingerprints(runner.arch, ctx.tokenizer.fingerprint() if ctx.tokenizer is not None else None,
                             embedding_rows(runner.model.model.embed_tokens, FINGERPRINT_ROWS))
    path = ctx.spec.draft_model
    if path in (None, "auto") and method == "mtp" and ctx.target_source:
        path = ctx.target_source  # the module the model's authors trained with it comes first
    elif path in (None, "auto"):
        path = default_head_path(fp[0], method)
        if method != "layerskip" and not path.is_file():  # (layer skip runs without a fitted exit)
            raise ConfigError(
                f"--spec-method {method} reads a {method} head trained for {ctx.model.model}, and the cache holds none "
                f"({path}). Train it once (minutes for SmolLM2): `specserve train-draft --method {method} --model "
                f"{ctx.model.model}`, or pass --draft-model FILE.")
    quantize = ctx.model.block_weights and getattr(runner, "native_ops", False)
    return runner, fp, path, quantize


def _four_bit_head(ctx: ProposerContext) -> bool:
    """An EAGLE head or MTP module in 4-bit blocks: as a draft model, int4 unless --draft-quantization
    says otherwise when the target runs its file's blocks (build_eagle has the measurements). Not
    Medusa's heads: SmolLM2's, 4-bit with their LM-head rows, proposed in 1.14 / 1.22 ms against
    1.35 / 1.32 (alternating processes) but accepted 277 draft tokens against 288 of ~7,000 over
    8 coding and 8 prose prompts, every step drafting: no gain."""
    return default_draft_quantization(ctx.spec.draft_quantization, ctx.model.quantization) == Quantization.INT4


def _build_eagle(ctx: ProposerContext) -> Proposer:
    from specserve.engine.runner import ROPE_SLACK
    from specserve.spec.eagle import build_eagle

    runner, fp, path, quantize = _head_for_target(ctx, "eagle")
    return build_eagle(path, runner, fp, ctx.cache.block_size, ctx.target_num_blocks, ctx.max_model_len + ROPE_SLACK,
                       p_min=ctx.spec.draft_p_min, tree=ctx.spec.use_trees(True), seed=ctx.model.seed, quantize=quantize,
                       four_bit=_four_bit_head(ctx))


def _build_mtp(ctx: ProposerContext) -> Proposer:
    from specserve.engine.runner import ROPE_SLACK
    from specserve.spec.eagle import build_eagle

    runner, fp, path, quantize = _head_for_target(ctx, "mtp")
    # An imported module (a checkpoint's own) reads as many of the most frequent ids as a head
    # trained here: SmolLM2's shipped layer drafted 1.90 / 1.67 tokens per forward over all 49,152
    # ids and over 16,384 alike, at 187 / 195 against 211 / 202 tok/s (bench/mtp_gguf.py, Zen 4).
    size = runner.arch.vocab_size
    asked = ctx.spec.draft_vocab_size
    vocab = default_draft_vocab(asked, size) if asked is not None else default_head_vocab(size)
    ids = frequent_token_subset(ctx.tokenizer, size, vocab) if vocab is not None and vocab < size else None
    return build_eagle(path, runner, fp, ctx.cache.block_size, ctx.target_num_blocks, ctx.max_model_len + ROPE_SLACK,
                       p_min=ctx.spec.draft_p_min, tree=ctx.spec.use_trees(True), seed=ctx.model.seed, quantize=quantize,
                       method="mtp", default_ids=ids, four_bit=_four_bit_head(ctx))


def _build_medusa(ctx: ProposerContext) -> Proposer:
    from specserve.spec.medusa import build_medusa

    runner, fp, path, quantize = _head_for_target(ctx, "medusa")
    return build_medusa(path, runner, fp, tree=ctx.spec.use_trees(True), seed=ctx.model.seed, quantize=quantize)


def _build_layerskip(ctx: ProposerContext) -> Proposer:
    from specserve.spec.layerskip import build_layerskip

    runner, fp, path, quantize = _head_for_target(ctx, "layerskip")
    if ctx.target_block_ids is None:
        raise ConfigError("--spec-method layerskip reads the target's block tables; an engine provides them.")
    if ctx.spec.draft_model in (None, "auto") and not path.is_file():  # type: ignore[attr-defined]
        path = None  # no exit fitted for this model: the target's final norm
    subset = None
    vocab = default_draft_vocab(ctx.spec.draft_vocab_size, runner.arch.vocab_size)
    if vocab is not None:
        subset = frequent_token_subset(ctx.tokenizer, runner.arch.vocab_size, vocab)
    return build_layerskip(runner, ctx.target_block_ids, ctx.spec.draft_num_layers, path, fp, subset,
                           p_min=ctx.spec.draft_p_min, tree=ctx.spec.use_trees(False), seed=ctx.model.seed,
                           quantize=quantize)


def drafter_kv_bytes_per_token(spec: SpecConfig, target_arch: object, cache: CacheConfig, dtype: torch.dtype,
                               draft_arch: object | None = None) -> int:
    """KV bytes per token a drafter keeps beside the target's, for as many tokens as the target
    holds: the engine splits --kv-cache-gib between them (one budget). 0 for drafters without
    KV of their own, and for a draft model given its own --draft-kv-cache-gib."""
    import dataclasses

    if spec.method in ("eagle", "mtp"):  # one float32 layer of the target's K/V shape
        return 2 * target_arch.num_kv_heads * target_arch.head_dim * 4  # type: ignore[attr-defined]
    if spec.method == "draft" and spec.draft_kv_cache_gib is None:
        from specserve.engine.runner import kv_bytes_per_token

        if draft_arch is None:
            from specserve.ops.calc import load_arch

            draft_arch = load_arch(str(spec.draft_model or ""))
        if spec.draft_num_layers is not None:
            draft_arch = dataclasses.replace(draft_arch, num_layers=min(spec.draft_num_layers, draft_arch.num_layers))
        return kv_bytes_per_token(draft_arch, cache, dtype)  # type: ignore[arg-type]
    return 0


def reserved_kv_blocks(spec: SpecConfig, max_num_seqs: int, block_size: int) -> int:
    """KV blocks the target runner keeps outside its pool for the drafter (layer-skip scratch)."""
    if spec.method != "layerskip":
        return 0
    from specserve.spec.layerskip import reserved_blocks

    # The policy drafts for fewer than off_batch requests at a time.
    return reserved_blocks(min(max_num_seqs, max(1, spec.off_batch)), block_size)


def default_draft_quantization(draft: Quantization | str | None, target: Quantization | str | None) -> Quantization:
    """--draft-quantization, else int4 when the target keeps its file's blocks (auto), else the
    target's. A draft's precision moves only its acceptance rate, never the output, and decode
    reads every weight each step: the 0.5B Qwen draft in 4 bits (its Q5_0/Q8_0 matrices as Q4_0,
    Q6_K as Q4_K) reads 236 MB per step instead of 310 MB, for ~2 points of acceptance."""
    if draft is not None:
        return Quantization(draft)
    return Quantization.INT4 if target == Quantization.AUTO else Quantization(target or Quantization.NONE)


def frequent_token_subset(tokenizer: Tokenizer | None, vocab_size: int, n: int) -> torch.Tensor:
    """The draft's restricted vocabulary: the first n ids plus every added/special token.

    Byte-level BPE numbers tokens in merge order, and merges are learned most-frequent-first,
    so the lowest ids are the most frequent pieces of the training corpus. Special tokens
    (end of turn, tool markers) sit at the end of the vocabulary and must stay draftable.
    The count is then rounded up to a multiple of 8 with the next ids in order, so the smaller
    head keeps the kernels' 8-row interleaved layout (65,536 ids + Qwen2's 22 specials did not,
    and its head ran through the slower row-at-a-time kernel).
    """
    ids = set(range(min(n, vocab_size)))
    if tokenizer is not None:
        ids |= {i for i in tokenizer.backend.get_added_tokens_decoder() if i < vocab_size}
        ids |= {i for i in tokenizer.special_token_ids if i < vocab_size}
    nxt = min(n, vocab_size)
    while len(ids) % 8 and nxt < vocab_size:
        if nxt not in ids:
            ids.add(nxt)
        nxt += 1
    return torch.tensor(sorted(ids), dtype=torch.long)


def check_draft_tokenizer(
    target: Tokenizer | None, draft: Tokenizer | None, target_vocab: int, draft_vocab: int
) -> None:
    """Refuse a draft whose tokens would not mean the same as the target's."""
    if target is not None and draft is not None:
        if target.fingerprint() != draft.fingerprint():
            raise TokenizerMismatchError(
                f"The draft model's tokenizer ({draft.name or 'draft'}, vocab {draft.vocab_size}) differs from "
                f"the target's ({target.name or 'target'}, vocab {target.vocab_size}): drafts would be "
                "verified as the wrong tokens. Use a draft from the same model family (same vocabulary, "
                "merges and special tokens)."
            )
    elif draft_vocab > target_vocab:
        raise TokenizerMismatchError(
            f"The draft's vocabulary ({draft_vocab}) is larger than the target's ({target_vocab}); "
            "use a draft that shares the target's tokenizer."
        )


PROPOSER_BUILDERS: dict[str, Callable[[ProposerContext], Proposer]] = {
    "ngram": _build_ngram,
    "reference": _build_reference,
    "draft": _build_draft,
    "lookahead": _build_lookahead,
    "eagle": _build_eagle,
    "medusa": _build_medusa,
    "layerskip": _build_layerskip,
    "mtp": _build_mtp,
}


# --spec-copy's copiers in front of a model drafter
COPIER_BUILDERS: dict[str, Callable[[ProposerContext], Proposer]] = {
    "ngram": _build_ngram,
    "reference": _build_reference_copier,
}


def build_proposer(ctx: ProposerContext) -> Proposer | None:
    """The proposer for ctx.spec.method, or None for 'none'; with --spec-copy, a copier in front
    of it (specserve.spec.hybrid); with --spec-join, a model-free proposer's candidates joined
    into its trees (specserve.spec.join)."""
    if ctx.spec.method == "none":
        return None
    drafter = PROPOSER_BUILDERS[ctx.spec.method](ctx)
    names = ctx.spec.copiers
    if names:
        drafter = _with_copier(ctx, drafter, names)
    if ctx.spec.join != "none":
        from specserve.spec.join import JoinedProposer

        # Under the adaptive policy the helper's candidates are also offered alone, where the
        # drafter's passes would not pay; under 'always' the drafter drafts every step.
        free = _largest_draft(ctx.spec) if ctx.spec.policy == "adaptive" else 0
        drafter = JoinedProposer(drafter, PROPOSER_BUILDERS[ctx.spec.join](ctx), ctx.spec.join, ctx.spec.num_spec_tokens,
                                 free_budget=free)
    return drafter


def _with_copier(ctx: ProposerContext, drafter: Proposer, names: tuple[str, ...]) -> Proposer:
    """The drafter behind the copiers `names` (specserve.spec.hybrid)."""
    from dataclasses import replace

    from specserve.spec.hybrid import FirstOf, HybridProposer

    n = ctx.spec.copy_min_match
    sub = replace(ctx, spec=replace(ctx.spec, ngram_min=n, ngram_max=max(n, ctx.spec.ngram_max)))
    copiers = [COPIER_BUILDERS[name](sub) for name in names]
    copier = copiers[0] if len(copiers) == 1 else FirstOf(copiers)
    return HybridProposer(copier, drafter, "+".join(names), n, _largest_draft(ctx.spec))


def _largest_draft(spec: SpecConfig) -> int:
    """The most nodes a step may ask a proposer for (SpecPolicy.choose): what a free draft made
    before K is chosen holds, cut later to what the step asks."""
    from specserve.spec.policy import TREE_NODES_PER_K

    return max(TREE_NODES_PER_K * spec.num_spec_tokens, spec.max_draft_nodes)
