"""Layer-skip self-speculation: the target's own first L layers draft.

The draft is the target truncated after layer L: the same embedding and the same first L
decoder layers (the target's tensors, and with native kernels a DecoderStack over exactly those
layers: no second copy of any weight), then an exit to the vocabulary.

KV is shared where that is exact. The K/V a token gets in layers 0..L-1 depends only on the
tokens up to it and on those layers' weights, so for every verified token the target's own cache
already holds what the draft would compute: the draft reads the target's cache for the prefix
and never catches up on a prompt or on accepted tokens. Only the tokens it feeds itself (the
newest token, whose KV the target writes next step, and the tree nodes) need slots. Those go to
blocks reserved for the drafter outside the target's pool, from the same --kv-cache-gib budget
(ModelRunner.reserved_block_ids): each request's draft table is its target table up to the
block holding the newest token, then scratch blocks (the verified part of that block copied in,
for layers < L), so the draft never writes a block the target owns.

The exit. A model trained with an early-exit loss (LayerSkip) can read layer L's residual
stream through its final norm and LM head; models trained without one mostly cannot (SmolLM2
at layer 24 of 30 agrees with its own next token 27% of the time). `train-draft --method
layerskip` fits an exit translator per candidate layer by least squares ("tuned lens"):

    f_L(x) = W (x / rms(x)) + b   ~   the target's final feature (after its norm) at the same position

which raises that agreement to 62% at layer 24, and keeps the layer whose predicted speedup is
best. The target's LM head (restricted to the most frequent ids) decodes f_L. Without an exit
file the draft uses the target's final norm (the identity exit).

Exactness never depends on the draft: its proposals are verified like any drafter's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from specserve.engine.runner import FeedEntry
from specserve.errors import ConfigError
from specserve.models.block_linear import partial_decoder_stack
from specserve.models.linear import storage_bytes
from specserve.request import Request
from specserve.spec.draft_model import (
    EXPAND_WIDTH,
    MAX_PASSES,
    CandidateWidth,
    PassTimer,
    _TreeDraft,
    expand_rows,
    grow_trees,
    picked_rows,
)
from specserve.spec.proposer import Proposer, ProposerTraits, register_proposer
from specserve.spec.tree import DraftTree

# Nodes one propose() may feed per request (the tree drafter's cap), plus the newest token.
FEED_CAP = EXPAND_WIDTH * MAX_PASSES


def scratch_blocks_per_request(block_size: int) -> int:
    """Scratch blocks one drafting request may need: its newest token may sit anywhere in a
    block, then up to FEED_CAP nodes follow."""
    return -(-(block_size - 1 + 1 + FEED_CAP) // block_size)


def reserved_blocks(max_drafting_requests: int, block_size: int) -> int:
    """Blocks to reserve in the target's KV budget for a layer-skip drafter."""
    return max(1, max_drafting_requests) * scratch_blocks_per_request(block_size)


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x), row by row: the exit's input (the same in fitting and serving)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ExitHead(nn.Module):
    """Layer L's residual stream -> the target's final feature space: W (x / rms(x)) + b."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        """The predicted final feature of each row."""
        return self.proj(unit_rms(x.float(), self.eps))


@register_proposer("layerskip")
class LayerSkipProposer(PassTimer, CandidateWidth, Proposer):
    """Drafts with the target's first L layers over its own KV cache (see the module docstring)."""

    # Chains by default, as for the draft model: a draft pass is a sizeable share of a target
    # step, and a wider tree pass costs more than it adds. --spec-tree tree asks for trees.
    traits = ProposerTraits(cost="per_pass", trees=True, tree_by_default=False, prior_acceptance=0.5)

    def __init__(self, runner: object, block_ids_of: Callable[[str], list[int]], num_layers: int,
                 exit_head: nn.Module | None, lm_head: nn.Module, p_min: float = 0.0, tree: bool = False,
                 seed: int = 0, card: dict | None = None) -> None:
        self.runner = runner
        self.model = runner.model.model  # the target's LlamaModel
        total = len(self.model.layers)
        if not 1 <= num_layers < total:
            raise ConfigError(f"--draft-num-layers for layerskip must be in [1, {total - 1}] (the target has {total} "
                              f"layers), got {num_layers}.")
        self.layers = range(num_layers)
        self.stack = partial_decoder_stack(self.model, self.layers)
        self.block_ids_of = block_ids_of
        self.exit = exit_head
        self.lm_head = lm_head
        self.card = card or {}
        self.block_size = runner.block_size
        self.scratch = list(runner.reserved_block_ids)
        self.per_request = scratch_blocks_per_request(self.block_size)
        if len(self.scratch) < self.per_request:
            raise ConfigError(f"layerskip needs at least {self.per_request} KV blocks reserved for its drafts; the "
                              f"target runner has {len(self.scratch)} (the engine reserves them when the spec method "
                              "is layerskip).")
        self.device = runner.device
        self.p_min = p_min
        self.tree = tree
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + 4)
        self.num_forwards = 0

    # ------------------------------------------------------------------ reporting
    def describe(self) -> str:
        """Layers kept, the exit and the head, for the start-up summary."""
        total = len(self.model.layers)
        head = f", {len(self.lm_head.token_ids):,}-token head" if hasattr(self.lm_head, "token_ids") else ""
        if self.exit is None:
            exit_ = "the target's final norm (untrained exit: `specserve train-draft --method layerskip` fits one)"
        else:
            acc = self.card.get("heldout_accept_depth1")
            exit_ = "a trained exit" + (f" (held-out top-1 {acc:.2f})" if isinstance(acc, (int, float)) else "")
        return f"the target's first {len(self.layers)} of {total} layers, shared weights and KV, {exit_}{head}"

    def memory_bytes(self) -> int:
        """What the drafter adds: its exit and its head rows (layers and KV are the target's)."""
        own = [*self.lm_head.parameters(), *self.lm_head.buffers()] if hasattr(self.lm_head, "token_ids") else []
        if self.exit is not None:
            own += [*self.exit.parameters(), *self.exit.buffers()]
        return storage_bytes(own)

    def catchup_tokens(self, request: Request) -> int:
        """Tokens without target KV the draft feeds before drafting (the newest token)."""
        return max(0, len(request.all_token_ids) - request.num_computed_tokens)

    def check_integrity(self) -> bool:
        """Nothing is held between steps: scratch blocks are reused by every call."""
        return True

    def live_request_ids(self) -> list[str]:
        """None: the drafter keeps no per-request state."""
        return []

    # ------------------------------------------------------------------ passes
    def _logits(self, entries: list[FeedEntry]) -> torch.Tensor:  # [logit rows, vocab]
        inputs = self.runner.feed_inputs(entries)
        x = self.model.embed_tokens(inputs.input_ids)
        x = self.model.run_layers(x, inputs.positions, self.runner.kv_caches, inputs.meta, self.layers, self.stack)
        x = x.index_select(0, inputs.logits_index)
        h = self.model.norm(x) if self.exit is None else self.exit(x)
        self.num_forwards += 1
        return self.lm_head(h).float()

    def _table(self, req: Request, free: list[int]) -> list[int] | None:
        """The request's draft block table: its target blocks before the one holding its first
        uncomputed token, then scratch blocks (None when the scratch is used up)."""
        first = req.num_computed_tokens
        b0, offset = divmod(first, self.block_size)
        target = self.block_ids_of(req.request_id)
        if b0 > len(target) or (offset and b0 >= len(target)):
            return None
        if len(free) < self.per_request:
            return None
        mine = [free.pop() for _ in range(self.per_request)]
        if offset:  # the verified tokens of that block, layers < L only
            for li in self.layers:
                for t in self.runner.kv_caches[li]:
                    t[mine[0]].copy_(t[target[b0]])
        return target[:b0] + mine

    @torch.inference_mode()
    def time_pass(self, batch: int, tokens_per_req: int = 1) -> float:
        """Seconds of one draft pass over `batch` requests (start-up profiling: writes scratch only)."""
        context = 32
        n_blocks = -(-(context + tokens_per_req) // self.block_size)
        if n_blocks > len(self.scratch):
            return float("nan")
        table = self.scratch[:n_blocks]
        entries = [FeedEntry([1] * tokens_per_req, list(range(context, context + tokens_per_req)), context, table, None,
                             [tokens_per_req - 1]) for _ in range(batch)]
        return self.best_of(lambda: self._logits(entries))

    def time_catchup(self, tokens: int) -> float:
        """Seconds to feed one request `tokens` tokens in one pass."""
        return self.time_pass(1, tokens)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """One pass over each request's uncomputed tokens (the newest: its last row gives the
        root's children), then chains or EAGLE-2 trees (draft_model._TreeDraft), every pass
        through the first L layers over the target's cache plus the request's scratch blocks."""
        t0 = time.perf_counter()
        free = list(self.scratch)
        trees: list[_TreeDraft] = []
        tables: dict[str, list[int]] = {}  # request -> its draft block table
        entries: list[FeedEntry] = []
        for req, k in zip(requests, num_tokens):
            if k <= 0:
                continue
            table = self._table(req, free)
            if table is None:
                continue
            ids = req.all_token_ids
            first = req.num_computed_tokens
            n = len(ids) - first
            trees.append(_TreeDraft(req, req, k, min(k, FEED_CAP)))  # type: ignore[arg-type]
            tables[req.request_id] = table
            entries.append(FeedEntry(ids[first:], list(range(first, len(ids))), first, table, None, [n - 1]))
        if not trees:
            return {}
        logits = self._logits(entries)
        expand_rows([(t, -1) for t in trees], logits, self.generator, self.device, self.children)

        def run_pass(step: list[tuple[_TreeDraft, list[int]]]) -> None:
            logits = self._logits([t.entry(picked, tables[t.req.request_id]) for t, picked in step])
            expand_rows(picked_rows(step), logits, self.generator, self.device, self.children)

        later = grow_trees(trees, self.pass_cost_ratio, self.p_min, run_pass)
        out = {}
        for t in trees:
            draft = t.select()
            if draft is not None:
                out[t.req.request_id] = draft
        self.record_timing(t0, later, len(trees))
        return out


def build_layerskip(runner: object, block_ids_of: Callable[[str], list[int]], num_layers: int | None,
                    path: str | None, target_fp: str | tuple[str, ...], token_ids: torch.Tensor | None, p_min: float, tree: bool,
                    seed: int, quantize: bool) -> LayerSkipProposer:
    """The layer-skip drafter: an exit file (train-draft --method layerskip) fixes the layer and
    the head's vocabulary; without one, the target's final norm at layer num_layers (default:
    three quarters of the target's layers)."""
    from specserve.spec.eagle import (
        card_size,
        head_token_ids,
        load_head_for,
        quantize_linears,
        restricted_lm_head,
    )

    exit_head, card = None, {}
    total = runner.arch.num_layers
    if path is not None:
        tensors, card = load_head_for(path, "layerskip", target_fp)
        layer = card_size(path, card, "num_layers")
        if num_layers is not None and num_layers != layer:
            raise ConfigError(f"The exit {path} was fitted at layer {layer}; --draft-num-layers {num_layers} asks for "
                              f"another. Drop the flag, or fit one there: `specserve train-draft --method layerskip "
                              f"--layers {num_layers}`.")
        num_layers = layer
        token_ids = head_token_ids(path, tensors, runner.arch.vocab_size)
        exit_head = ExitHead(runner.arch.hidden_size)
        try:
            exit_head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
        except RuntimeError as exc:  # missing / extra / misshapen tensors, as build_eagle says
            raise ConfigError(f"{path} does not hold a layer-skip exit for this target: {str(exc)[:300]}") from exc
        exit_head.eval().to(runner.device)
        if quantize:
            from specserve.models.block_linear import enable_native_ops

            quantize_linears([exit_head])
            enable_native_ops(exit_head)
    if num_layers is None:
        num_layers = max(1, (3 * total) // 4)
    lm_head = runner.model.lm_head if token_ids is None else restricted_lm_head(runner, token_ids)
    return LayerSkipProposer(runner, block_ids_of, num_layers, exit_head, lm_head, p_min=p_min, tree=tree, seed=seed,
                             card=card)
