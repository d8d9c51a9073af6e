"""Model runner: turns a SchedulerOutput into tensors, runs one forward pass, samples.

Owns the model weights and the paged KV cache tensors of one model. All tensor work of a
step happens here; the scheduler only ever sees ids and counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from specserve.attention import AttentionMetadata, build_attention_metadata
from specserve.config import CacheConfig, ModelConfig, Quantization, usable_cpus
from specserve.engine.graphs import StepGraphs
from specserve.engine.scheduler import SampledTokens, ScheduledRequest, SchedulerOutput
from specserve.errors import ConfigError
from specserve.kernels import row_argmax
from specserve.kv_cache.layer_load import KVLoad, LayerLoader, LayerWriter
from specserve.kv_cache.pages import LayerKV, layer_pages
from specserve.kv_cache.tiers import TieredKVStore
from specserve.models.arch import ArchConfig
from specserve.models.block_linear import (
    EMBEDDING,
    FOUR_BIT,
    BlockEmbedding,
    BlockQuantLinear,
    PackedWeight,
    enable_native_ops,
    requantize_4bit,
)
from specserve.models.linear import (
    apply_linear_backend,
    apply_quantization,
    linear_weight_bytes,
    quantization_usable,
    resolve_linear_backend,
    storage_bytes,
)
from specserve.models.llama import LayerHooks, RMSNorm, RotaryEmbedding
from specserve.models.registry import build_model, unset_weights
from specserve.sampling.grammar import apply_masks, forbid_unless_only
from specserve.sampling.penalties import (
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    min_tokens_rows,
)
from specserve.sampling.rejection import SpecBatch, rejection_sample
from specserve.sampling.sampler import Sampler, SamplingMetadata, processed_rows, top_logprobs
from specserve.sampling.tree_rejection import verify_trees
from specserve.spec.policy import TIMED_CONTEXT
from specserve.spec.tree import DraftTree, SiblingDraw

# Extra rotary positions beyond max_model_len so look-ahead (draft) slots always have a table row.
ROPE_SLACK = 64
# Weights whose products time_hot_products runs from cache: small enough for the L2s and L3 of the
# machines measured, large enough for a pass of tens of microseconds.
HOT_TUNE_BYTES = 3 << 20


class StepInputs(NamedTuple):
    """Flattened tensors of one step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [num_logit_rows] rows of the hidden states that need logits
    row_spans: list[tuple[int, int]]  # per entry: its rows in logits_index
    every_row: bool = False  # logits_index is every row in order (decode and verify steps): no gather


class HiddenRows(NamedTuple):
    """The target's hidden states of one request's tokens that a step verified, for proposers that
    read them (`ProposerTraits.needs_hidden_states`): the residual streams after each of the
    proposer's `feature_layers()` then the last hidden state (after the final norm), side by side."""

    start_pos: int  # position of rows[0]; the others follow consecutively
    rows: torch.Tensor  # [n, hidden * (len(feature_layers) + 1)]


class RawRows(NamedTuple):
    """Copies of logits rows taken before the processors changed them (logprobs_mode raw_*)."""

    rows: torch.Tensor  # [n, V]
    starts: dict[str, int]  # request id -> its first row in `rows` (then one per row it samples from)


def _select_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows `idx` of `t`: `t` itself when they are all of its rows in order (no copy)."""
    if idx == list(range(t.shape[0])):
        return t
    return t.index_select(0, torch.tensor(idx, dtype=torch.long, device=t.device))


class FeedEntry(NamedTuple):
    """One request's tokens in one forward pass, as the model sees them."""

    token_ids: list[int]
    positions: list[int]  # rotary positions (a draft node's: its root's + its depth)
    start_slot: int  # slot of token_ids[0] in the request's block table; the rest follow in order
    block_ids: list[int]
    tail_mask: torch.Tensor | None  # [q, m]: which of the last m slots each token sees (None: causal)
    logit_rows: range | list[int]  # which of token_ids need logits


_EMPTY_TREE = DraftTree((), ())
PROMPT_LOGPROB_SLICE = 256  # rows of prompt logits at a time


def _split(values: list[int], sizes: list[int]) -> list[tuple[int, ...]]:
    out, at = [], 0
    for n in sizes:
        out.append(tuple(values[at : at + n]))
        at += n
    return out


def _chain_probs(draft: DraftTree | None) -> torch.Tensor | None:  # [K, V] or None
    """The rows a chain's tokens were drawn from, in order (None: deterministic / no draft)."""
    if draft is None or draft.draw is SiblingDraw.DETERMINISTIC or draft.dists is None:
        return None
    return draft.dists[list(draft.dist_row)]


class StepConnector(LayerHooks, Protocol):
    """Moves KV in or out of this runner's cache around each step (see specserve.disagg)."""

    def begin_step(self, out: SchedulerOutput) -> bool:
        """Before the forward of a step; whether its layer hooks must run in this step's forward."""

    def end_step(self, out: SchedulerOutput) -> None:
        """After the forward of a step (every layer's KV is written)."""


def kv_bytes_per_token(arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers (int8: 1 byte per element + a float32 scale per head)."""
    kv = cache.kv_cache_dtype
    scales = 2 * arch.num_layers * arch.num_kv_heads * 4 if kv.quantized else 0
    return arch.kv_bytes_per_token(kv.storage(dtype).itemsize) + scales


def num_kv_blocks(arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks that fit in the KV memory budget."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = cache.block_size * kv_bytes_per_token(arch, cache, dtype)
    return int(cache.kv_cache_gib * (1 << 30)) // per_block


def _in_4bit_blocks(packed: dict[str, PackedWeight], source: str | None) -> dict[str, PackedWeight]:
    """`--quantization int4` on a GGUF's blocks: 4-bit ones as they are, wider ones requantized
    (requantize_4bit), the embedding table as the file has it (its lookups keep the file's
    values). The requantized blocks of a model file are kept in the start-up cache (the 0.5B
    draft's took ~2 s a start on a 2-vCPU Zen 4)."""
    from specserve.startup_cache import StartupCache, code_identity, file_identity

    wide = {name: pw for name, pw in packed.items() if name != EMBEDDING and pw.qtype not in FOUR_BIT}
    if not wide:
        return packed
    ident = file_identity(source) if source is not None else None
    cache = None if ident is None else StartupCache("int4", {
        "source": ident, "matrices": sorted([name, pw.qtype, list(pw.shape)] for name, pw in wide.items())},
        code=code_identity("models/block_linear.py", "models/gguf_quants.py"))  # the quantizers and decoders
    saved = cache.load_tensors() if cache is not None else None
    done: dict[str, PackedWeight] = {}
    if saved is not None and set(saved) == {f"{name}.{part}" for name in wide for part in ("data", "qtype")}:
        done = {name: PackedWeight(int(saved[f"{name}.qtype"][0]), saved[f"{name}.data"], pw.shape)
                for name, pw in wide.items() if saved[f"{name}.data"].shape[0] == pw.shape[0]}
    if len(done) != len(wide):
        done = {name: requantize_4bit(pw) for name, pw in wide.items()}
        if cache is not None:
            cache.save_tensors({k: v for name, pw in done.items()
                                for k, v in ((f"{name}.data", pw.data), (f"{name}.qtype", torch.tensor([pw.qtype])))})
    return {**packed, **done}


class ModelRunner:
    """One model on one device with its KV cache."""

    def __init__(
        self,
        arch: ArchConfig,
        weights: dict[str, torch.Tensor],
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        vocab_subset: torch.Tensor | None = None,
        packed: dict[str, PackedWeight] | None = None,
        reserved_blocks: int = 0,
        source: str | None = None,
    ) -> None:
        self.arch = arch
        self.device = model_config.torch_device
        self.dtype = model_config.torch_dtype
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        if model_config.quantization is None:
            raise ConfigError("ModelRunner needs an explicit quantization (the engine resolves the default: "
                              "specserve.defaults.resolve_defaults).")
        packed = packed or {}
        if packed and not model_config.quantization.blocks:
            # Blocks run only with the native CPU kernels' attention and norms: beside torch's
            # attention the kernels' int8 rounding of activations turns its ~1e-7 differences
            # between step shapes into different tokens (greedy speculation then left plain decoding
            # at SmolLM2's 7th token). `none` asks for float weights, `int8` quantizes float ones:
            # both get the values the blocks encode, as a checkpoint loaded without them would.
            weights = {**weights, **{name: pw.dequantize() for name, pw in packed.items()}}
            packed = {}
        if model_config.quantization is Quantization.INT4:  # before the layers are built: no interleave round trip
            packed = _in_4bit_blocks(packed, source)
        self.model = self._build(arch, weights, max_model_len + ROPE_SLACK, packed)
        if vocab_subset is not None:  # before quantization, so the smaller head is quantized too
            self.model.restrict_vocab(vocab_subset)
        self.quantization = model_config.quantization
        self.logprobs_mode = model_config.logprobs_mode
        self.native_ops = False  # block-quantized weights run through specserve.kernels
        self.float_linear_backend: str | None = None  # what float matrices run through (dense / onednn), if any do
        if self.quantization is not Quantization.NONE:
            if not quantization_usable(self.quantization, self.device):
                raise ConfigError(f"--quantization {self.quantization} is not supported on {self.device} with this torch.")
            apply_quantization(self.model, self.quantization)
            self.linear_backend = self.quantization
            if self.quantization is Quantization.AUTO:  # float tensors of the file stay float: fastest float backend
                self.float_linear_backend = resolve_linear_backend(model_config.linear_backend, self.device, self.dtype)
                apply_linear_backend(self.model, self.float_linear_backend)
            if model_config.native_cpu:
                enable_native_ops(self.model)
                self.native_ops = True
        else:
            self.linear_backend = resolve_linear_backend(model_config.linear_backend, self.device, self.dtype)
            self.float_linear_backend = self.linear_backend
            apply_linear_backend(self.model, self.linear_backend)
        # Blocks the pool hands out, then `reserved_blocks` outside it, from the same budget: a
        # layer-skip drafter's scratch for its draft tokens (reserved_block_ids), never the pool's.
        self.num_blocks = num_kv_blocks(arch, cache_config, self.dtype)
        if cache_config.num_gpu_blocks_override is None:
            self.num_blocks -= reserved_blocks
        if self.num_blocks < 1:
            raise ConfigError(
                f"kv_cache_gib={cache_config.kv_cache_gib} holds no KV block for this model "
                f"({kv_bytes_per_token(arch, cache_config, self.dtype) * self.block_size} bytes per block"
                + (f", {reserved_blocks} reserved for the drafter" if reserved_blocks else "") + "); raise --kv-cache-gib."
            )
        self.reserved_block_ids = list(range(self.num_blocks, self.num_blocks + reserved_blocks))
        # CUDA graphs of short steps (engine/graphs.py): one more block past the reserved ones, where
        # a padded query row writes its keys and values.
        graphs = self.device.type == "cuda" and not model_config.enforce_eager
        scratch_blocks = 1 if graphs else 0
        shape = (self.num_blocks + reserved_blocks + scratch_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        # Zero-filled: masked-out slots are still multiplied by a zero weight, so they must be finite.
        # An int8 cache adds per-(slot, head) k and v scales; zero scales make never-written
        # slots dequantize to exact zeros too.
        self.kv_cache_dtype = cache_config.kv_cache_dtype
        quantized = self.kv_cache_dtype.quantized
        page_dtype = self.kv_cache_dtype.storage(self.dtype)
        shapes = [(shape, page_dtype)] * 2 + ([(shape[:3], torch.float32)] * 2 if quantized else [])
        try:
            self.kv_caches: list[LayerKV] = layer_pages(arch.num_layers, shapes, self.device)
        except (MemoryError, OSError, torch.OutOfMemoryError) as exc:
            raise ConfigError(
                f"kv_cache_gib={cache_config.kv_cache_gib} does not fit in this machine's memory ({exc}); "
                "lower --kv-cache-gib."
            ) from None
        self.sampler = Sampler(self.device, model_config.seed)
        self.keep_logits = False  # tests: keep the last step's logits in self.last_logits
        # The prefix cache's lower tiers (the engine sets them): a step's KVLoads report to them.
        self.tiers: TieredKVStore | None = None
        # Lower-tier hits: "layer" loads files layer by layer beside the forward
        # (kv_cache/layer_load.py), "whole" every block before it, "auto" decides per step.
        self.tier_load = cache_config.kv_tier_load
        self.failed_loads: dict[int, str] = {}  # blocks of the last step that failed to load
        self.failed_load_requests: list[str] = []  # the step's requests whose block tables hold one
        self.num_layer_wise_loads = 0  # steps whose forward ran beside their lower-tier loads
        self.last_logits: torch.Tensor | None = None
        # Feature-level proposers: keep each step's hidden states of the verified tokens (take_hidden),
        # or hand them to hidden_sink as each step makes them (train-draft: the target's features of
        # the conversations it writes, without a second pass over them).
        self.capture_hidden = False
        self.hidden_sink: Callable[[str, HiddenRows], None] | None = None
        self._hidden: dict[str, HiddenRows] = {}
        self.kept_hidden: torch.Tensor | None = None
        self._prompt_logprobs: dict[str, tuple[int, list[float], list[list[tuple[int, float]]]]] = {}
        self._last_hidden_states: torch.Tensor | None = None
        self.connector: StepConnector | None = None  # disaggregation: KV in or out per layer
        self.step_graphs: StepGraphs | None = None
        if graphs:
            scratch = (self.num_blocks + reserved_blocks) * self.block_size
            self.step_graphs = StepGraphs(self.model, self.kv_caches, self.block_size, scratch, self.device)
        self.num_steps = 0
        self.forward_time_s = 0.0
        self.grammar_time_s = 0.0  # structured output: building and applying the masks
        self.last_forward_time_s = 0.0
        self.last_forward_built_graph = False
        self.last_forward_eager = False  # graphs are on and the last step ran without one
        if self.native_ops:
            self._tune_kernels()

    def _tune_kernels(self) -> None:
        """The kernels' prefetch distances and wide-pass threshold for this machine and model:
        measured on this model's forwards, or what an earlier start measured (startup_cache)."""
        import os
        from dataclasses import asdict

        from specserve.kernels import tune_or_restore
        from specserve.startup_cache import StartupCache

        weight_bytes = self.weight_bytes_per_step()
        cache = StartupCache("kernels", {
            "arch": asdict(self.arch), "quantization": self.quantization, "dtype": str(self.dtype),
            "weight_bytes": weight_bytes,
            "env": {k: os.environ.get(k, "") for k in ("SPECSERVE_PREFETCH", "SPECSERVE_MARCH")},
        })
        tune_or_restore(lambda n: self.time_decode_step(1, tokens_per_req=n, repeats=1, context=64), weight_bytes, cache,
                        time_hot=self.time_hot_products)

    def time_hot_products(self, rows: int, repeats: int = 3) -> float:
        """Best-of-`repeats` seconds of the first block-quantized products of the model (in forward
        order, HOT_TUNE_BYTES of weights: one layer's attention projections on the Qwen 1.5B) over
        `rows` random activation rows, after one untimed pass that brings their weights into cache:
        the kernels' arithmetic without the memory traffic. NaN without such products."""
        calls, total = [], 0
        for mod in self.model.modules():
            if isinstance(mod, BlockQuantLinear) and total < HOT_TUNE_BYTES:
                calls.append((mod, torch.randn(rows, mod.in_features)))
                total += mod.weight_nbytes
        if not calls:
            return float("nan")
        best = float("inf")
        with torch.inference_mode():
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                for mod, x in calls:
                    mod(x)
                if i:
                    best = min(best, time.perf_counter() - t0)
        return best

    def _build(
        self, arch: ArchConfig, weights: dict[str, torch.Tensor], max_positions: int, packed: dict[str, PackedWeight]
    ) -> torch.nn.Module:
        # Build without random initialisation (unset_weights), then adopt the checkpoint tensors
        # (converted once) as the parameters.
        with unset_weights(self.device):
            model = build_model(arch, max_positions)
        converted = {k: v.to(device=self.device, dtype=self.dtype) for k, v in weights.items()}
        # Linear weights kept in GGUF blocks replace their nn.Linear (and take its bias along); an
        # embedding table kept in blocks replaces nn.Embedding.
        # (The loader keeps a tied head's blocks whenever it keeps the table's: the same blocks.)
        if (table := packed.get(EMBEDDING)) is not None:
            model.model.embed_tokens = BlockEmbedding(table, self.dtype)
            packed = {name: pw for name, pw in packed.items() if name != EMBEDDING}
        for name, pw in packed.items():
            parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
            bias = converted.pop(f"{name.removesuffix('.weight')}.bias", None)
            setattr(model.get_submodule(parent_name), attr, BlockQuantLinear(pw, bias))
        if arch.tie_word_embeddings and "lm_head.weight" not in packed:
            converted["lm_head.weight"] = converted[EMBEDDING]
        model.load_weights(converted)
        if model.model.rotary.cos.device != self.device:  # (built on the meta device)
            model.model.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions).to(self.device)
        model.eval()
        return model

    def attach_connector(self, connector: StepConnector | None) -> None:
        """Install (or remove) a connector: called around every step, and around every layer in
        the steps it asks for (its begin_step says so)."""
        self.connector = connector
        self.model.model.layer_hooks = None

    def weight_bytes_per_step(self) -> int:
        """Weight bytes one forward reads: every matrix and norm once; embeddings only by row."""
        total = 0
        for module in self.model.modules():
            total += linear_weight_bytes(module)
            if isinstance(module, RMSNorm):
                total += module.weight.numel() * module.weight.element_size()
        return total

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors."""
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

    def resident_bytes(self) -> int:
        """Bytes this runner keeps alive: every storage behind the model's parameters and
        buffers (a shared huge-page buffer counted once) plus the KV cache."""
        return storage_bytes([*self.model.parameters(), *self.model.buffers()]) + self.kv_cache_bytes

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Flatten scheduled requests into one token batch plus attention metadata.

        A draft's nodes sit after the request's uncomputed tokens; a node's position is the
        root's (the last uncomputed token's) plus its depth, and when the draft branches a tree
        mask lets each node see the prefix, its ancestors and itself only.
        """
        return self.feed_inputs([self._entry(sr) for sr in out.scheduled])

    @staticmethod
    def _entry(sr: ScheduledRequest) -> FeedEntry:
        n, k = len(sr.token_ids), sr.num_spec_tokens
        positions = list(range(sr.start_pos, sr.start_pos + n - k))
        tail = None
        if k:
            draft = sr.draft
            assert draft is not None
            root = sr.start_pos + n - k - 1
            positions += [root + d for d in draft.depths]
            if not draft.is_chain:  # causal over the request's other new tokens, then the nodes' ancestry
                before = n - k
                tail = torch.tensor([[j <= i for j in range(n)] for i in range(before)] + draft.ancestor_rows(before),
                                    dtype=torch.bool)
        # The last non-draft token predicts the next token (the root's children); each draft node
        # predicts its own children (used by verification).
        rows = range(n - 1 - k, n) if sr.sample else range(0)
        return FeedEntry(sr.token_ids, positions, sr.start_pos, sr.block_ids, tail, rows)

    def feed_inputs(self, entries: list[FeedEntry]) -> StepInputs:
        """Tensors of one forward pass over the entries' tokens."""
        ids: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        for e in entries:
            base = len(ids)
            ids.extend(e.token_ids)
            pos.extend(e.positions)
            first = len(logit_rows)
            logit_rows.extend(base + r for r in e.logit_rows)
            spans.append((first, len(logit_rows)))
        tails = [e.tail_mask for e in entries]
        meta = build_attention_metadata(
            [len(e.token_ids) for e in entries],
            [e.start_slot for e in entries],
            [e.block_ids for e in entries],
            self.block_size,
            self.device,
            tails if any(t is not None for t in tails) else None,
        )
        return StepInputs(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(pos, dtype=torch.long, device=self.device),
            meta,
            torch.tensor(logit_rows, dtype=torch.long, device=self.device),
            spans,
            len(logit_rows) == len(ids) and logit_rows == list(range(len(ids))),
        )

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs, keep_rows: torch.Tensor | None = None,
                       features: bool = True) -> torch.Tensor:  # [num_logit_rows, vocab]
        """Run the decoder over the step's tokens; return logits of the rows that need them
        (and keep the last hidden states of `keep_rows` in self.kept_hidden, and with
        capture_hidden and `features` the drafter's features of every row)."""
        t0 = time.perf_counter()
        hidden = self._decoder_output(inputs)
        self._last_hidden_states = self._features(hidden) if self.capture_hidden and features else None
        self.kept_hidden = hidden.index_select(0, keep_rows) if keep_rows is not None else None
        logits = self.model.compute_logits(hidden if inputs.every_row else hidden.index_select(0, inputs.logits_index))
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # honest step times for the cost model
        self.last_forward_time_s = time.perf_counter() - t0
        # A step that captured a CUDA graph first: its time is not the shape's cost. With graphs
        # on, a step that ran eagerly (a long prompt chunk) costs several times what the same
        # number of decode and verify rows replayed costs.
        graphs = self.step_graphs
        self.last_forward_built_graph = graphs is not None and graphs.built_in_step
        self.last_forward_eager = graphs is not None and not graphs.replayed_in_step
        self.forward_time_s += self.last_forward_time_s
        self.num_steps += 1
        return logits

    def _decoder_output(self, inputs: StepInputs) -> torch.Tensor:  # [num_tokens, hidden]
        """The decoder's output over the step's tokens: through the step's CUDA graph where it has one."""
        if self.step_graphs is not None:
            hidden = self.step_graphs.forward(inputs.input_ids, inputs.positions, inputs.meta)
            if hidden is not None:
                return hidden
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    @torch.inference_mode()
    def hidden_states(self, entries: list[FeedEntry]) -> torch.Tensor:  # [sum of tokens, hidden * (layers + 1)]
        """The features (HiddenRows' layout) of every token of the entries: what a feature-level
        drafter is trained on. The entries' blocks must be the caller's to write."""
        inputs = self.feed_inputs(entries)
        return self._features(self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The layers whose residual streams every forward keeps beside the last hidden state."""
        return self.model.model.capture_layers

    @feature_layers.setter
    def feature_layers(self, layers: tuple[int, ...]) -> None:
        layers = tuple(sorted(set(layers)))
        if any(not 0 < i < self.arch.num_layers for i in layers):
            raise ConfigError(f"feature layers {layers} must lie in [1, {self.arch.num_layers}) for this target.")
        self.model.model.capture_layers = layers

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The forward's kept residual streams and its last hidden state, side by side."""
        captured = self.model.model.captured
        self.model.model.captured = []
        return torch.cat((*captured, hidden), dim=-1) if captured else hidden

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledTokens]:
        """Run one step: sample one token per finishing request, or verify its draft.

        Everything about drafts comes from the step itself (each ScheduledRequest's tree).
        After verification the KV of an accepted tree path is moved into the request's next
        consecutive slots, so the cache holds exactly the verified sequence.
        """
        if self.failed_loads:  # a caller that never took the last step's: they do not carry over
            self.take_failed_loads()
        if out.is_empty:
            if out.kv_loads:
                self._finish_loads(self._loader(out.kv_loads), out)
            return {}
        inputs = self.prepare_inputs(out)
        wants_layers = False
        if self.connector is not None:
            # Layer hooks only in steps that move KV: with hooks set the model runs layer by layer
            # in Python, without them its native one-call stack (1.46x faster at batch 1 on
            # SmolLM2, auto): a decode worker's ordinary steps keep the fast path.
            wants_layers = self.connector.begin_step(out)
            self.model.model.layer_hooks = self.connector if wants_layers else None
        loader = self._loader(out.kv_loads) if out.kv_loads else None
        if loader is not None:
            # Files load layer by layer beside the forward; blocks already in host memory are
            # copied before it (a memcpy). Not while a connector streams this step's layers out:
            # a layer it sent cannot be taken back if a block then fails verification.
            if (self.loads_layer_wise() and loader.reads_disk and not wants_layers and self.device.type == "cpu"
                    and loader.start()):
                self.model.model.layer_wait = loader.wait
                self.num_layer_wise_loads += 1
            else:
                self._finish_loads(loader, out)
                loader = None
        # Features only where a drafter may read them: not for requests that opted out of
        # speculation (speculative=False), unless every request's are taken.
        features = self.capture_hidden and (
            self._features_for_all or any(sr.sampling_params.speculative is not False for sr in out.scheduled))
        prompt_rows = self._prompt_logprob_rows(out)
        keep = None
        if prompt_rows:
            keep = torch.tensor([r for _, _, rows, _, _ in prompt_rows for r in rows], dtype=torch.long, device=self.device)
        try:
            logits = self.forward_logits(inputs, keep, features)
        finally:
            self.model.model.layer_hooks = None
            self.model.model.layer_wait = None
            if loader is not None:  # every layer of every block is written (or failed) even if the forward raised
                self._finish_loads(loader, out)
        if self.connector is not None:
            self.connector.end_step(out)
        if self.keep_logits:
            self.last_logits = logits.clone()
        sampled = self._sample_and_verify(out, logits)
        if prompt_rows:
            self._keep_prompt_logprobs(prompt_rows)
        if self._last_hidden_states is not None:
            self._keep_verified_hidden(out, self._last_hidden_states, sampled)
            self._last_hidden_states = None
        for rid in self.failed_load_requests:  # computed on a block that failed: dropped
            sampled.pop(rid, None)
            self._hidden.pop(rid, None)
            self._prompt_logprobs.pop(rid, None)
        return sampled

    @staticmethod
    def _prompt_logprob_rows(out: SchedulerOutput) -> list[tuple[str, int, range, list[int], int]]:
        """(request, first prompt index, rows, prompt tokens, k) of the rows of this step that
        predict a prompt token of a request that wants prompt_logprobs (k alternatives): row j of a
        chunk starting at position s predicts prompt token s + j + 1."""
        found = []
        base = 0
        for sr in out.scheduled:
            prompt = sr.prompt_for_logprobs
            if prompt is not None:
                count = min(sr.num_new_tokens, len(prompt) - 1 - sr.start_pos)
                if count > 0:
                    first = sr.start_pos + 1
                    found.append((sr.request_id, first, range(base, base + count), list(prompt[first : first + count]),
                                  sr.sampling_params.prompt_logprobs or 0))
            base += len(sr.token_ids)
        return found

    def _keep_prompt_logprobs(self, prompt_rows: list[tuple[str, int, range, list[int], int]]) -> None:
        """Log-softmax of the model's raw logits at the kept rows, in slices (a 2k-token chunk of a
        150k vocabulary would be a 1.2 GB logits matrix): each prompt token's logprob and the k
        likeliest (id, logprob) pairs (k: the request's prompt_logprobs)."""
        hidden, self.kept_hidden = self.kept_hidden, None
        assert hidden is not None
        at = 0
        for rid, first, rows, targets, k in prompt_rows:
            lps: list[float] = []
            tops: list[list[tuple[int, float]]] = []
            for j in range(0, len(rows), PROMPT_LOGPROB_SLICE):
                h = hidden[at + j : at + min(j + PROMPT_LOGPROB_SLICE, len(rows))]
                logp = torch.log_softmax(self.model.compute_logits(h).float(), dim=-1)
                idx = torch.tensor(targets[j : j + len(h)], dtype=torch.long, device=logp.device)
                lps += logp.gather(1, idx[:, None])[:, 0].tolist()
                tops += top_logprobs(logp, k) if k else [[] for _ in range(len(h))]
            at += len(rows)
            self._prompt_logprobs[rid] = (first, lps, tops)

    def take_prompt_logprobs(self) -> dict[str, tuple[int, list[float], list[list[tuple[int, float]]]]]:
        """Per request: (first prompt index, logprobs, top pairs) computed by the last step."""
        got, self._prompt_logprobs = self._prompt_logprobs, {}
        return got

    def loads_layer_wise(self) -> bool:
        """Whether this step loads disk hits beside its forward: always with tier_load "layer",
        never with "whole"; with "auto" when a CPU is spare beyond torch's threads. With none spare
        the loader's reads, checks and copies take turns with the forward's threads instead of
        overlapping them, and OpenMP's barriers wait for whichever thread was descheduled (bench/tiers.py
        --layer-wise on 2 vCPUs: slower; with one compute thread on 2 vCPUs: faster)."""
        if self.tier_load != "auto":
            return self.tier_load == "layer"
        return usable_cpus() > torch.get_num_threads()

    def _finish_loads(self, loader: LayerLoader, out: SchedulerOutput) -> None:
        """Complete a step's loads; note the blocks that failed and the requests that hold them."""
        self.failed_loads = bad = loader.finish()
        self.failed_load_requests = [sr.request_id for sr in out.scheduled if not bad.keys().isdisjoint(sr.block_ids)] if bad else []

    def take_failed_loads(self) -> tuple[dict[int, str], list[str]]:
        """Blocks of the last step that failed verification while loading ({block id: why}) and the
        step's requests that hold one; both empty after the call."""
        out = self.failed_loads, self.failed_load_requests
        self.failed_loads, self.failed_load_requests = {}, []
        return out

    @property
    def _features_for_all(self) -> bool:
        """Whether every request's features are kept, opted out of speculation or not: train-draft's
        sink takes them all, and with a connector a head's prompt KV travels to decode workers."""
        return self.hidden_sink is not None or self.connector is not None

    def take_hidden(self) -> dict[str, HiddenRows]:
        """The hidden states of the tokens verified since the last call, per request (capture_hidden)."""
        out, self._hidden = self._hidden, {}
        return out

    def _keep_verified_hidden(self, out: SchedulerOutput, hidden: torch.Tensor, sampled: dict[str, SampledTokens]) -> None:
        """Per request: the rows of its new tokens (a prompt chunk, the last sampled token) and of
        its accepted draft nodes, in position order; rejected nodes' rows are dropped."""
        rows: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # (request, start position, first row, count)
        base = 0
        everyone = self._features_for_all
        for sr in out.scheduled:
            n, k = len(sr.token_ids), sr.num_spec_tokens
            if not everyone and sr.sampling_params.speculative is False:  # never drafts: nothing to keep
                base += n
                continue
            first = len(rows)
            rows.extend(range(base, base + n - k))
            st = sampled.get(sr.request_id)
            if k and st is not None:
                rows.extend(base + n - k + node for node in st.accepted_nodes)
            spans.append((sr.request_id, sr.start_pos, first, len(rows) - first))
            base += n
        if rows and rows[-1] - rows[0] + 1 == len(rows):  # ascending, so one run: a view (consumers copy)
            picked = hidden[rows[0] : rows[-1] + 1]
        else:
            picked = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))
        keep = self.hidden_sink or self._hidden.__setitem__
        for rid, start, first, count in spans:
            keep(rid, HiddenRows(start, picked[first : first + count]))

    def _sample_and_verify(self, out: SchedulerOutput, logits: torch.Tensor) -> dict[str, SampledTokens]:
        """Sample one token per finishing request, or verify its draft (chains or trees)."""
        sampled_reqs = [sr for sr in out.scheduled if sr.sample]
        if not sampled_reqs:
            return {}
        raw = self._raw_rows(logits, sampled_reqs)
        apply_logit_bias(logits, sampled_reqs)
        apply_penalties(logits, sampled_reqs)
        apply_min_tokens(logits, sampled_reqs)
        self._apply_grammars(logits, sampled_reqs)
        meta = SamplingMetadata.build(
            [sr.sampling_params for sr in sampled_reqs],
            [sr.output_index for sr in sampled_reqs],
            self.device,
        )
        # The sampler's own logprobs are raw_logprobs of the rows as processed: right for requests
        # no processor changed, with nothing more asked. Otherwise (top logprobs, raw copies of
        # processed rows, another logprobs_mode) the emitted rows are read once afterwards for every
        # logprobs request of the step, and the sampler computes none (one log-softmax, not two).
        reread = raw is not None or any(sr.sampling_params.top_logprobs for sr in sampled_reqs) or (
            self.logprobs_mode != "raw_logprobs" and meta.need_logprobs)
        if reread:
            meta = dataclasses.replace(meta, need_logprobs=False)
        drafts = [sr.draft for sr in sampled_reqs]
        if all(d is None for d in drafts):
            # Without drafts each sampling request owns exactly one logits row, in order.
            tokens, logprobs = self.sampler(logits, meta)
            tokens_l = tokens.tolist()
            lp_l = logprobs.tolist() if logprobs is not None else None
            sampled = {sr.request_id: SampledTokens([tokens_l[i]], [lp_l[i]] if lp_l is not None else None)
                       for i, sr in enumerate(sampled_reqs)}
        elif all(d is None or d.is_chain for d in drafts):
            sampled = self._verify_chains(logits, sampled_reqs, meta)
        else:
            sampled = self._verify_trees(logits, sampled_reqs, meta)
        if reread:
            sampled = self._emitted_logprobs(logits, sampled_reqs, sampled, raw)
        return sampled

    def _raw_rows(self, logits: torch.Tensor, sampled_reqs: list[ScheduledRequest]) -> RawRows | None:  # logits: [sum(1 + K_i), V]
        """logprobs_mode raw_*: one copy, before the processors change them, of the rows of every
        request that asks for logprobs and has a processor (logit_bias, penalties, min_tokens, a
        grammar); the other rows stay raw as they are, so nothing is copied in the common case."""
        if not self.logprobs_mode.startswith("raw"):
            return None
        rows: list[int] = []
        starts: dict[str, int] = {}
        at = 0
        for sr in sampled_reqs:
            n = 1 + sr.num_spec_tokens
            p = sr.sampling_params
            if p.logprobs and (p.logit_bias or sr.penalized_output is not None  # (top_logprobs needs logprobs)
                               or sr.min_tokens_ban is not None or sr.grammar is not None):
                starts[sr.request_id] = len(rows)
                rows.extend(range(at, at + n))
            at += n
        if not rows:
            return None
        return RawRows(logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device)), starts)

    @staticmethod
    def _emitted_rows(st: SampledTokens) -> list[int]:
        """Where a request's emitted tokens were drawn, counted from its root row: the t-th from the
        root (t = 0) or from the row of the t-th accepted node."""
        return [0] + [1 + node for node in st.accepted_nodes]

    def _emitted_logprobs(
        self, logits: torch.Tensor, sampled_reqs: list[ScheduledRequest], sampled: dict[str, SampledTokens],  # logits: [sum(1 + K_i), V]
        raw: RawRows | None,
    ) -> dict[str, SampledTokens]:
        """At each emitted position of every request that asks for logprobs, the values logprobs_mode
        reports: the emitted token's and, where asked for, the likeliest tokens'. The whole batch's
        rows are gathered at once (processed ones from `logits`, the others from the raw copy),
        transformed once (processed_*: each request's temperature and truncation,
        `processed_rows`; *_logprobs: a log-softmax) and read back once: per request, each would
        be a launch and a sync on a GPU. A request's rows start after the 1 + K_i rows of those
        before it."""
        mode = self.logprobs_mode
        starts = raw.starts if raw is not None else {}
        plain: list[int] = []  # rows of logits
        copied: list[int] = []  # rows of raw.rows
        spans: list[tuple[ScheduledRequest, bool, int, int]] = []  # (request, from the copy, first row, count)
        at = 0
        for sr in sampled_reqs:
            from_copy = sr.request_id in starts
            if sr.sampling_params.logprobs or sr.sampling_params.top_logprobs:
                mine = self._emitted_rows(sampled[sr.request_id])
                dest = copied if from_copy else plain
                base = starts[sr.request_id] if from_copy else at
                spans.append((sr, from_copy, len(dest), len(mine)))
                dest.extend(base + r for r in mine)
            at += 1 + sr.num_spec_tokens
        dev = logits.device
        blocks = [_select_rows(src, idx) for src, idx in ((logits, plain), (raw.rows if raw is not None else None, copied)) if idx]
        logp = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)).float()
        first_of = {False: 0, True: len(plain)}  # where each source's rows start in logp
        if mode.startswith("processed"):  # rows of `logits` only, in span order (copies are of raw_* modes)
            assert not copied
            logp = processed_rows(logp, [sr.sampling_params for sr, _, _, count in spans for _ in range(count)])
        if mode.endswith("logprobs"):
            logp = torch.log_softmax(logp, dim=-1)
        kmax = max(sr.sampling_params.top_logprobs for sr, *_ in spans)
        tops = top_logprobs(logp, kmax) if kmax else []
        # The emitted tokens' values, in one gather.
        tok_rows: list[int] = []
        toks: list[int] = []
        for sr, from_copy, first, _ in spans:
            st = sampled[sr.request_id]
            if sr.sampling_params.logprobs:
                tok_rows.extend(range(first_of[from_copy] + first, first_of[from_copy] + first + len(st.token_ids)))
                toks.extend(st.token_ids)
        tok_lp = (logp[torch.tensor(tok_rows, dtype=torch.long, device=dev), torch.tensor(toks, dtype=torch.long, device=dev)].tolist()
                  if toks else [])
        out = dict(sampled)
        used = 0
        for sr, from_copy, first, count in spans:
            st = sampled[sr.request_id]
            row = first_of[from_copy] + first
            if k := sr.sampling_params.top_logprobs:
                st = st._replace(top_logprobs=[pairs[:k] for pairs in tops[row : row + count]])
            if sr.sampling_params.logprobs:
                n = len(st.token_ids)
                st = st._replace(logprobs=tok_lp[used : used + n])
                used += n
            out[sr.request_id] = st
        return out

    def _apply_grammars(self, logits: torch.Tensor, sampled_reqs: list[ScheduledRequest]) -> None:  # logits: [sum(1 + K_i), V]
        """Structured output: forbid, in every row a request samples or verifies from, the tokens
        its grammar does not allow after that row's path (specserve.sampling.grammar), and its
        ending ids in the rows min_tokens holds them back in, unless the grammar allows nothing else."""
        if all(sr.grammar is None for sr in sampled_reqs):
            return
        t0 = time.perf_counter()
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        at = 0
        for sr in sampled_reqs:
            n = 1 + sr.num_spec_tokens
            if sr.grammar is not None:
                m = torch.empty(n, sr.grammar.num_words, dtype=torch.int32)  # [1 + K, ceil(V / 32)]
                sr.grammar.fill_masks(sr.draft, m)
                if sr.min_tokens_ban is not None:
                    forbid_unless_only(m, min_tokens_rows(sr), sr.min_tokens_ban.cpu())
                masks.append(m)
                rows.extend(range(at, at + n))
            at += n
        apply_masks(logits, torch.cat(masks), rows)
        self.grammar_time_s += time.perf_counter() - t0

    def _verify_chains(
        self, logits: torch.Tensor, sampled_reqs: list[ScheduledRequest], meta: SamplingMetadata  # logits: [sum(K_i + 1), V]
    ) -> dict[str, SampledTokens]:
        """Chains only: the batched accept / recover / bonus sampler (specserve.sampling.rejection)."""
        ks = [sr.num_spec_tokens for sr in sampled_reqs]
        batch = SpecBatch(
            num_draft=ks,
            draft_token_ids=[sr.token_ids[len(sr.token_ids) - k :] if k else [] for sr, k in zip(sampled_reqs, ks)],
            draft_probs=[_chain_probs(sr.draft) for sr in sampled_reqs],
            meta=meta,
        )
        flat_argmax = row_argmax(logits).tolist()
        res = rejection_sample(logits, batch, self.sampler.generator, flat_argmax)
        argmax = _split(flat_argmax, [k + 1 for k in ks])
        return {
            sr.request_id: SampledTokens(
                res.token_ids[i], res.logprobs[i] if res.logprobs is not None else None, num_draft_tokens=ks[i],
                num_accepted_tokens=res.num_accepted[i], accepted_nodes=tuple(range(res.num_accepted[i])),
                node_argmax=argmax[i],
            )
            for i, sr in enumerate(sampled_reqs)
        }

    def _verify_trees(
        self, logits: torch.Tensor, sampled_reqs: list[ScheduledRequest], meta: SamplingMetadata  # logits: [sum(N_i + 1), V]
    ) -> dict[str, SampledTokens]:
        """At least one branching draft: walk every request's tree (specserve.sampling.tree_rejection),
        then move each accepted path's KV into consecutive slots."""
        trees = [sr.draft if sr.draft is not None else _EMPTY_TREE for sr in sampled_reqs]
        flat_argmax = row_argmax(logits).tolist()
        results = verify_trees(logits, trees, meta, self.sampler.generator, flat_argmax)
        moves: list[tuple[ScheduledRequest, int, int]] = []  # (request, from, to) positions of accepted nodes' KV
        for sr, res in zip(sampled_reqs, results):
            first = sr.start_pos + sr.num_new_tokens  # where the nodes' KV was written, in node order
            moves += [(sr, first + node, first + d) for d, node in enumerate(res.accepted_nodes) if node != d]
        if moves:
            self.move_kv([(self._slot(sr, a), self._slot(sr, b)) for sr, a, b in moves])
        argmax = _split(flat_argmax, [len(t) + 1 for t in trees])
        return {
            sr.request_id: SampledTokens(res.token_ids, res.logprobs, num_draft_tokens=sr.num_spec_tokens,
                                         num_accepted_tokens=len(res.accepted_nodes), accepted_nodes=tuple(res.accepted_nodes),
                                         node_argmax=argmax[i])
            for i, (sr, res) in enumerate(zip(sampled_reqs, results))
        }

    def _slot(self, sr: ScheduledRequest, pos: int) -> int:
        return self.slot(sr.block_ids, pos)

    def slot(self, block_ids: list[int], index: int) -> int:
        """Flat cache slot of a request's index-th token slot."""
        return block_ids[index // self.block_size] * self.block_size + index % self.block_size

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's K/V (and int8 scales) of every layer, packed into one uint8 tensor on the
        host: what the prefix cache's lower tiers keep (kv_cache/tiers.py)."""
        parts = [t[block_id].reshape(-1).view(torch.uint8) for layer in self.kv_caches for t in layer]
        return torch.cat(parts).cpu()

    def block_payload_bytes(self) -> int:
        """Bytes of one block as read_block packs it."""
        return sum(layer.block_bytes for layer in self.kv_caches)

    def layer_payload_bytes(self) -> list[int]:
        """Bytes of each layer's part of a block as read_block packs it (in order)."""
        return [layer.block_bytes for layer in self.kv_caches]

    def _loader(self, loads: Sequence[KVLoad]) -> LayerLoader:
        """A LayerLoader writing these lower-tier blocks into this cache (read_block's format)."""
        return LayerLoader(loads, self.layer_payload_bytes(), self._layer_writer(), self.tiers)

    def _layer_writer(self) -> LayerWriter:
        """Writes one layer's packed bytes of one block into the cache tensors. On the CPU the
        stores go through NumPy views, so a loader thread starts no torch parallel region (each
        thread that does keeps an OpenMP team of its own: see Engine._check_stepping_thread)."""
        caches = self.kv_caches
        if self.device.type == "cpu":
            views = [[t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in layer] for layer in caches]

            def write(layer: int, block_id: int, data: np.ndarray) -> None:
                offset = 0
                for v in views[layer]:
                    v[block_id] = data[offset : offset + v.shape[1]]
                    offset += v.shape[1]
            return write

        def write_device(layer: int, block_id: int, data: np.ndarray) -> None:
            offset = 0
            for t in caches[layer]:
                dst = t[block_id]
                n = dst.numel() * t.element_size()
                dst.copy_(torch.from_numpy(data[offset : offset + n]).view(t.dtype).view(dst.shape))
                offset += n
        return write_device

    def load_blocks(self, loads: Sequence[KVLoad]) -> dict[int, str]:
        """Write lower-tier blocks (read_block's format) into their pool blocks now; returns the
        blocks that failed verification ({block id: why})."""
        return self._loader(loads).finish()

    def move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V (and int8 scales) from slot a to slot b for each (a, b); all
        sources are read before any destination is written."""
        src = torch.tensor([a for a, _ in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in moves], dtype=torch.long, device=self.device)
        for layer in self.kv_caches:
            for t in layer:
                flat = t.view(t.shape[0] * t.shape[1], -1)
                flat.index_copy_(0, dst, flat.index_select(0, src))

    # ------------------------------------------------------------------ profiling
    @torch.inference_mode()
    def time_attention_pairs(self, keys: int = 2048, rows: int = 8, repeats: int = 5) -> float:
        """Seconds the native attention adds per (query row, key) pair over the whole stack: one
        request's `rows` query rows against `keys` keys less one row's, per added row and key,
        times the layers (0.0 off the native CPU kernels, whose attention the profile's T(n)
        already carries at its context). Only for start-up profiling, while the KV cache holds
        nothing: it reads the cache's first blocks.

        A draft row attends over the request's whole context, and that attention is arithmetic,
        not a read the rows share: at 8,000 keys one Qwen 1.5B layer took 350 / 828 / 1,962 /
        3,274 us for 1 / 2 / 5 / 9 rows (2-vCPU Zen 4), so a verify there costs ~15 ms a draft
        row where T(n), timed at a 32-token context, says ~4."""
        if not self.native_ops or self.device.type != "cpu" or rows < 2:
            return 0.0
        from specserve.kernels import kernels

        n_blocks = -(-keys // self.block_size)
        if n_blocks > self.num_blocks:
            return 0.0
        layer = self.kv_caches[0]
        gen = torch.Generator().manual_seed(0)

        def best(n: int) -> float:  # n new rows after keys - n cached ones: keys keys for the last
            q = torch.randn(n, self.arch.num_heads, self.arch.head_dim, generator=gen)
            meta = build_attention_metadata([n], [keys - n], [list(range(n_blocks))], self.block_size, self.device)
            out = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                kernels().paged_attention(q, layer[0], layer[1], meta.block_tables, meta.attn_mask, meta.query_index,
                                          0.125, *layer[2:])
                out = min(out, time.perf_counter() - t0)
            return out

        best(1)  # warm-up
        extra = best(rows) - best(1)
        return max(0.0, extra / ((rows - 1) * keys)) * self.arch.num_layers

    @torch.inference_mode()
    def time_decode_step(self, batch: int, tokens_per_req: int = 1, repeats: int = 3,
                         context: int = TIMED_CONTEXT) -> float:
        """Seconds of one forward over `batch` requests of tokens_per_req new tokens each.

        Only for start-up profiling, while the KV cache holds nothing: it writes into blocks
        that no request owns yet. Each request reads its own blocks, as a real batch does (a
        shared table would be read from cache after its first request: at a 761-token context
        that timed batch 4 at half its cost); where the pool is too small for that, tables
        wrap around the pool, whose size is far beyond any cache.
        """
        n_blocks = -(-(context + tokens_per_req) // self.block_size)
        if n_blocks > self.num_blocks:
            return float("nan")
        from specserve.sampling_params import SamplingParams

        span = self.num_blocks - n_blocks + 1  # first blocks a table can start at
        entries = [
            ScheduledRequest(f"profile-{i}", [1] * tokens_per_req, context,
                             list(range((i * n_blocks) % span, (i * n_blocks) % span + n_blocks)),
                             DraftTree.chain([1] * (tokens_per_req - 1)) if tokens_per_req > 1 else None,
                             True, SamplingParams(), 0)
            for i in range(batch)
        ]
        inputs = self.prepare_inputs(SchedulerOutput(entries, batch * tokens_per_req, []))
        best = float("inf")
        for _ in range(repeats):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.model.compute_logits(self._decoder_output(inputs).index_select(0, inputs.logits_index))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best
