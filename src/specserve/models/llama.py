"""Llama-family decoder (Llama, SmolLM2, Mistral-style): GQA, RoPE, RMSNorm, SwiGLU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import AttentionMetadata, paged_attention, write_kv
from specserve.errors import CorruptModelError
from specserve.kv_cache.pages import LayerKV
from specserve.models.arch import ArchConfig

# A restricted LM head learns an id outside its subset once the requests' text (prompts and
# outputs) held it this often, and at most this many: their logits are a float product beside
# the subset's (896 wide: 25-57 us for 256 at 1-4 rows, 75-300 us for 1024, where a 0.5B draft
# pass takes 7-8 ms). On 8 Chinese asks (Qwen2.5-Coder 1.5B + 0.5B, every step drafting K 4):
# 1.97 tokens a step with the first 65,536 ids alone, 2.24 learning ids once seen twice, 2.43
# learning them at once, 2.62 with the whole vocabulary (a ~10% dearer pass).
LEARN_AFTER = 1
MAX_LEARNED_IDS = 1024
# Layers per native call in a forward that waits on KV loading layer by layer (LlamaModel.layer_wait).
LAYER_GROUP = 4


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the reference models."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native: ModuleType | None = None  # specserve.kernels module: one fused call (see enable_native_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, dim]
        """Normalise the last dimension."""
        if self.native is not None:
            return self.native.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE: pairs (x_i, x_{i+d/2}) rotated by pos * theta^(-2i/d)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_positions, d/2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, n_heads, d]
        k: torch.Tensor,  # [num_tokens, n_kv, d]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the rotation for each token's absolute position."""
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, d/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Self-attention with grouped KV heads over the paged cache."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.q_size
        self.kv_size = cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.native: ModuleType | None = None  # q/k/v in one native call + in-place RoPE (enable_native_ops)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rope: RotaryEmbedding,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Project, rotate, store K/V in the cache, attend, project back."""
        n = x.shape[0]
        if self.native is not None:
            projs = (self.q_proj, self.k_proj, self.v_proj)
            qkv = self.native.qmatmul_multi(
                x, [p.qweight for p in projs], [p.kernel_qtype for p in projs], [p.bias for p in projs], False
            )
            q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
            self.native.rope_(q, k, rope.cos, rope.sin, positions)
        else:
            q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
            q, k = rope(positions, q, k)
        k_cache, v_cache, scales = kv_cache.k, kv_cache.v, kv_cache.scales
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        # Native ops use the native attention for every step shape: the kernels round activations to
        # int8, which turns a 1e-7 difference between two attention codes into a different rounding
        # step, so a token must always take the same path whatever else shares its step.
        if self.native is not None:
            out = self.native.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.attn_mask, meta.query_index, self.scale, *(scales or ())
            )
        else:
            out = paged_attention(q, k_cache, v_cache, meta, self.scale, scales)
        return self.o_proj(out.reshape(n, self.q_size))


class LayerHooks(Protocol):
    """Called around each decoder layer with that layer's KV cache tensors."""

    def before_layer(self, index: int, kv_cache: LayerKV) -> None:
        """Before layer `index` reads its cache."""

    def after_layer(self, index: int, kv_cache: LayerKV) -> None:
        """After layer `index` has written this step's keys and values."""


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.native: ModuleType | None = None  # gate, up and SiLU * in one native call (enable_native_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        """Apply the gated feed-forward."""
        if self.native is not None:
            g, u = self.gate_proj, self.up_proj
            return self.down_proj(self.native.qmatmul_multi(x, [g.qweight, u.qweight], [g.kernel_qtype, u.kernel_qtype], [None, None], True))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rope: RotaryEmbedding,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x + attn(norm(x)), then + mlp(norm(.))."""
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)
        # Optional per-layer callbacks (disaggregation: stream a layer's KV out as soon as it is
        # written, or load a layer's KV just before it is needed). See specserve.disagg.
        self.layer_hooks: LayerHooks | None = None
        # The whole stack in one native call (specserve.kernels.DecoderStack; enable_native_ops
        # builds it when every projection is block-quantized). Used when no hooks are set; it runs
        # the same kernels as the module path, bit for bit.
        self.native_stack = None
        # Set for a step that loads prefix blocks from a lower tier beside its forward
        # (kv_cache/layer_load.py): blocks until the KV of layers [0, n) is in place.
        self.layer_wait: Callable[[int], None] | None = None
        self._group_stacks: dict[range, object | None] = {}
        # EAGLE-3 features: the residual streams after these many layers (ascending, each in
        # [1, num_layers)) are kept in `captured` by every forward, beside its output.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] = []

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Hidden states of the new tokens after the last norm."""
        x = self.embed_tokens(input_ids)
        hooks, wait = self.layer_hooks, self.layer_wait
        stack = self.native_stack
        self.captured = []
        whole = stack is not None and hooks is None and stack.num_layers == len(self.layers)
        if whole and wait is None:  # one native call (keeping the feature layers' streams where asked)
            kv = [t for pair in kv_caches for t in pair]
            args = (x, positions, self.rotary.cos, self.rotary.sin, kv, meta.slot_mapping, meta.block_tables,
                    meta.attn_mask, meta.query_index, self.layers[0].self_attn.scale)
            if self.capture_layers:
                *self.captured, x = stack.forward_capturing(*args, list(self.capture_layers))
            else:
                x = stack.forward(*args)
        elif self.capture_layers and hooks is None:
            x = self._forward_capturing(x, positions, kv_caches, meta, wait)
        elif whole:  # the same kernels in groups of layers, each run once its layers' KV has loaded
            for group in self._layer_groups():
                wait(group.stop)
                x = self.run_layers(x, positions, kv_caches, meta, group, self._group_stack(group))
        else:
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                if wait is not None:
                    wait(i + 1)
                if hooks is not None:
                    hooks.before_layer(i, kv)
                x = layer(x, positions, self.rotary, kv, meta)
                if hooks is not None:
                    hooks.after_layer(i, kv)
                if i + 1 in self.capture_layers:
                    self.captured.append(x)
        return self.norm(x)

    def _forward_capturing(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                           meta: AttentionMetadata, wait: Callable[[int], None] | None) -> torch.Tensor:
        """The stack in runs of layers split at capture_layers (each run one native call where the
        full stack is native: the same kernels, bit for bit), keeping the residual at each split."""
        n, start = len(self.layers), 0
        for stop in (*self.capture_layers, n):
            layers = range(start, stop)
            if wait is not None:
                wait(stop)
            x = self.run_layers(x, positions, kv_caches, meta, layers,
                                self._group_stack(layers) if self.native_stack is not None else None)
            if stop < n:
                self.captured.append(x)
            start = stop
        return x

    def _layer_groups(self) -> list[range]:
        """The layers in LAYER_GROUP-sized runs, for a forward that waits on loading KV."""
        n = len(self.layers)
        return [range(a, min(a + LAYER_GROUP, n)) for a in range(0, n, LAYER_GROUP)]

    def _group_stack(self, layers: range) -> object | None:
        """A native DecoderStack over `layers`, sharing the full stack's weights (built once)."""
        if layers not in self._group_stacks:
            from specserve.models.block_linear import partial_decoder_stack

            self._group_stacks[layers] = partial_decoder_stack(self, layers)
        return self._group_stacks[layers]

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], meta: AttentionMetadata,
                   layers: range, stack: object | None = None) -> torch.Tensor:  # [num_tokens, hidden], before any norm
        """The residual stream after `layers` (a contiguous range) starting from x: a layer-skip
        draft's first layers, or early-exit features. `stack`: a native DecoderStack over exactly
        those layers (block_linear.partial_decoder_stack)."""
        caches = kv_caches[layers.start : layers.stop]
        if stack is not None:
            kv = [t for pair in caches for t in pair]
            return stack.forward(x, positions, self.rotary.cos, self.rotary.sin, kv, meta.slot_mapping, meta.block_tables,
                                 meta.attn_mask, meta.query_index, self.layers[0].self_attn.scale)
        for i, kv in zip(layers, caches):
            x = self.layers[i](x, positions, self.rotary, kv, meta)
        return x


class RestrictedLMHead(nn.Module):
    """An LM head over a subset of the vocabulary; every other token gets logit -inf.

    Used for draft models: the draft distribution becomes softmax over the subset, zero
    elsewhere. That is still a distribution, so rejection sampling against the target stays
    exact (the residual max(0, q - p) simply keeps the target's mass on excluded tokens);
    only the acceptance rate can change. Reading fewer rows makes every draft step cheaper.

    Given `rows` (the full head's float32 rows of some ids), the head also learns ids outside
    the subset that the requests' text keeps using (`learn`): up to MAX_LEARNED_IDS of them get
    their logits from those rows, a float product beside the subset's. The first 65,536 ids a
    Qwen2.5 draft head keeps by default are English and code: a third of the 1.5B's tokens in
    Chinese answers lie above them (and Qwen2.5's code fence "```", id 73,594), tokens the head
    could never draft. The draft's distribution only changes between passes, so each draft is
    still verified against the distribution it was drawn from.
    """

    def __init__(self, proj: nn.Module | torch.Tensor, token_ids: torch.Tensor, vocab_size: int,
                 rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 rows_data: torch.Tensor | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        if isinstance(proj, torch.Tensor):  # the subset's rows of a float head
            weight = proj
            proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                proj.weight.copy_(weight)
        self.proj = proj  # [n, hidden] -> [n, len(token_ids)]
        device = next(proj.parameters(), None)
        device = next(proj.buffers()) if device is None else device
        self.register_buffer("token_ids", token_ids.to(device=device.device, dtype=torch.long), persistent=False)
        self._rows = rows  # ids -> the full head's rows, float32 (None: nothing is learned)
        # What `rows` reads that nothing else keeps (an untied head, whole): counted in the model's memory.
        self.register_buffer("rows_data", rows_data, persistent=False)
        # The learned ids and their rows, room for MAX_LEARNED_IDS made up front (the first
        # num_learned in use): learning never copies what was learned before, and the room is
        # counted in the model's memory from the start (the drafter's memory the engine reports).
        learns = rows is not None
        self.register_buffer("ids_buf", torch.zeros(MAX_LEARNED_IDS if learns else 0, dtype=torch.long,
                                                    device=device.device), persistent=False)
        self.register_buffer("rows_buf", torch.zeros(MAX_LEARNED_IDS if learns else 0, proj.in_features,
                                                     device=device.device), persistent=False)  # float32
        self.num_learned = 0
        self._in_subset = bytearray(vocab_size)
        ids = token_ids.tolist()
        for i in ids:
            self._in_subset[i] = 1
        # The subset's leading run 0..m-1 (a frequency subset is the first ids plus a few special
        # ones): copied into the logits as one slice, the rest by index. index_copy_ across a
        # row costs ~50 us per row for 65,560 ids, the slice ~10 us in all.
        self._run = next((j for j, i in enumerate(ids) if i != j), len(ids))
        self._counts: dict[int, int] = {}  # ids outside the subset: times the requests' text held them
        self._slots: dict[int, int] = {}  # learned id -> its slot
        self._floor = 0  # a lower bound on the least count among the learned ids (counts only grow)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """Logits over the full vocabulary, -inf outside the subset and the learned ids."""
        sub = self.proj(hidden)
        m = self._run
        out = sub.new_empty((hidden.shape[0], self.vocab_size))
        out[:, :m] = sub[:, :m]
        out[:, m:] = float("-inf")
        if m < len(self.token_ids):
            out.index_copy_(1, self.token_ids[m:], sub[:, m:])
        if n := self.num_learned:
            out.index_copy_(1, self.ids_buf[:n], (hidden.float() @ self.rows_buf[:n].float().T).to(out.dtype))
        return out

    @property
    def learned_ids(self) -> torch.Tensor:
        """The ids learned so far, by slot."""
        return self.ids_buf[: self.num_learned]

    def learn(self, text: Sequence[int]) -> int:
        """Count the ids outside the subset in a request's new text. One counted LEARN_AFTER times
        gets a logit from then on: in a free slot of the MAX_LEARNED_IDS, or in place of the
        learned id counted least once counted twice as often (so a long-running server keeps the
        ids its traffic uses most, not the first ones). Returns how many ids were added."""
        if self._rows is None:
            return 0
        counts, slots, placed = self._counts, self._slots, []
        for t in text:
            if not 0 <= t < self.vocab_size or self._in_subset[t]:
                continue
            n = counts[t] = counts.get(t, 0) + 1
            if n < LEARN_AFTER or t in slots:
                continue
            if len(slots) < MAX_LEARNED_IDS:
                slot = len(slots)
            else:
                if n < 2 * self._floor:  # below twice any learned id's count: nothing to take over
                    continue
                victim = min(slots, key=counts.__getitem__)
                self._floor = counts[victim]
                if n < 2 * self._floor:
                    continue
                slot = slots.pop(victim)
            slots[t] = slot
            placed.append((slot, t))
        if placed:
            self._place(placed)
        return len(placed)

    def _place(self, placed: list[tuple[int, int]]) -> None:
        """Give each token its slot's row (a new slot, or one taken over): one read of the rows."""
        placed = list(dict(placed).items())  # a slot taken over within the call: its last token
        dev = self.token_ids.device
        tokens = torch.tensor([t for _, t in placed], dtype=torch.long, device=dev)
        rows = self._rows(tokens).to(device=dev, dtype=torch.float32)
        where = torch.tensor([j for j, _ in placed], dtype=torch.long, device=dev)
        self.ids_buf[where] = tokens
        self.rows_buf[where] = rows
        self.num_learned = max(self.num_learned, max(j for j, _ in placed) + 1)

    def stop_learning(self) -> None:
        """Forget the learned ids and learn no more: the subset alone (to compare against)."""
        self._rows = None
        self.num_learned = 0
        self._floor = 0
        self._counts.clear()
        self._slots.clear()


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache; weights use Hugging Face names."""

    def __init__(self, cfg: ArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Run the decoder; logits are computed separately, only for rows that need them."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """Project hidden states to vocabulary logits in float32."""
        return self.lm_head(hidden).float()

    def head_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """ids -> the LM head's float32 rows of them, read alone: a tied head's from the embedding
        table (the native kernels decode a block table's rows), an untied one's from the head where
        its layout allows (row_reader: None for oneDNN's packing)."""
        from specserve.models.linear import row_reader

        if self.config.tie_word_embeddings:
            table = self.model.embed_tokens
            return lambda ids: table(ids).float()
        return row_reader(self.lm_head)

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:
        """Replace the LM head by one over `token_ids` only (sorted, unique); see RestrictedLMHead."""
        from specserve.models.block_linear import BlockQuantLinear

        head = self.lm_head
        if isinstance(head, BlockQuantLinear):  # rows of blocks are independent: keep the chosen ones
            pw = head.packed()
            kept_rows = pw.data.index_select(0, token_ids.to(pw.data.device))
            proj: nn.Module | torch.Tensor = BlockQuantLinear(pw._replace(data=kept_rows, shape=(len(kept_rows), pw.shape[1])))
        else:
            proj = head.weight.detach().index_select(0, token_ids.to(head.weight.device))
        # The rows of the ids it learns (RestrictedLMHead.learn): a tied head's are the embedding
        # table's, which stays loaded; an untied head is kept whole (and counted as the head's).
        kept = None
        if not self.config.tie_word_embeddings:
            kept = head.qweight if isinstance(head, BlockQuantLinear) else head.weight.detach()
        self.lm_head = RestrictedLMHead(proj, token_ids, self.config.vocab_size, rows=self.head_rows(), rows_data=kept)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Adopt HF-named tensors as the parameters (no copy), refusing missing or extra names.

        With tied embeddings the caller passes the same tensor for the embedding and lm_head.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        missing = sorted(set(params) - set(weights))
        unexpected = sorted(set(weights) - set(params))
        if missing or unexpected:
            raise CorruptModelError(
                f"Checkpoint does not match the {self.config.architecture} layout: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}. "
                "Check that the file is a complete model of a supported architecture."
            )
        for name, dst in params.items():
            if tuple(weights[name].shape) != tuple(dst.shape):
                raise CorruptModelError(
                    f"Tensor {name} has shape {tuple(weights[name].shape)}, expected "
                    f"{tuple(dst.shape)}; the file's metadata and tensors disagree."
                )
        self.load_state_dict(weights, strict=False, assign=True)
