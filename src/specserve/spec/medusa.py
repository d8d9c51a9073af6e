"""Medusa: M residual heads on the target's last hidden state, head d guessing d tokens past the next.

With f_t the target's last hidden state at position t (the root token x_{t+1} was sampled from
it), head d computes h_d = f_t + SiLU(W_d f_t + b_d) and the target's own LM head (its most
frequent rows) turns h_d into a distribution of x_{t+1+d}. No KV cache, one batched pass per
step for every head: cheaper than EAGLE, but a head never sees the tokens between, so its guesses
are independent per depth. The tree takes each depth's most likely tokens under the most likely
nodes of the depth before (the product of the heads' probabilities scores a path), the budget
best kept; verification is exact as for any drafter: trees hold each head's likeliest tokens of
its processed distribution (deterministic candidates, `spec.tree.drafts_ranked`), a chain of an
unseeded sampled request its draws.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ConfigError
from specserve.models.linear import storage_bytes
from specserve.request import Request
from specserve.spec.draft_model import (
    CHILDREN,
    CandidateWidth,
    PassTimer,
    _TreeDraft,
    expand_rows,
)
from specserve.spec.proposer import Proposer, ProposerTraits, register_proposer
from specserve.spec.tree import DraftTree

EXPAND_PER_DEPTH = 4  # nodes of a depth that get children from the next head
EXPAND_MIN = 0.02  # path probability below which a node gets no children


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero at initialisation (the head starts as the target's own next-token guess)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One residual step."""
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """M residual blocks over the same feature; outputs one hidden state per head."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.heads = nn.ModuleList(ResBlock(hidden) for _ in range(num_heads))

    def forward(self, f: torch.Tensor) -> list[torch.Tensor]:
        """Head d's hidden state for every row of f."""
        return [head(f) for head in self.heads]


class _Seq:
    """What Medusa keeps of a request: its newest feature and its position."""

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "pos", "feat")

    def __init__(self, request_id: str, pos: int, feat: torch.Tensor) -> None:
        self.request_id, self.pos, self.feat = request_id, pos, feat
        self.all_token_ids: list[int] = []
        self.num_computed_tokens = 0


@register_proposer("medusa")
class MedusaProposer(PassTimer, CandidateWidth, Proposer):
    """Trees from M heads on the target's newest hidden state (see the module docstring)."""

    traits = ProposerTraits(cost="per_pass", trees=True, tree_by_default=True, needs_hidden_states=True,
                            prior_acceptance=0.4)

    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, tree: bool = True, seed: int = 0,
                 card: dict | None = None, device: torch.device | str = "cpu") -> None:
        self.heads = heads.eval()
        self.lm_head = lm_head
        self.card = card or {}
        self.children = CHILDREN if tree else 1
        self.device = torch.device(device)  # the target's: the heads read its features there
        self._seqs: dict[str, _Seq] = {}
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + 3)
        self.num_forwards = 0

    # ------------------------------------------------------------------ features in
    def observe_hidden(self, hidden: dict) -> None:
        """Keep each request's newest verified feature (all a Medusa head reads)."""
        for rid, hr in hidden.items():
            n = hr.rows.shape[0]
            if n:
                self._seqs[rid] = _Seq(rid, hr.start_pos + n - 1, hr.rows[-1].float())

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Forget the request's feature."""
        self._seqs.pop(request_id, None)

    def live_request_ids(self) -> list[str]:
        """Requests with a kept feature."""
        return list(self._seqs)

    def describe(self) -> str:
        """Heads and training, for the start-up summary."""
        acc = self.card.get("heldout_accept_by_depth")
        held = f", held-out top-1 by depth {', '.join(f'{a:.2f}' for a in acc)}" if acc else ""
        return f"{len(self.heads.heads)} heads, {len(getattr(self.lm_head, 'token_ids', []))}-token LM head{held}"

    def memory_bytes(self) -> int:
        """The heads and the LM head's rows (the target's embedding is not copied)."""
        mods = [self.heads, self.lm_head]
        return storage_bytes([t for m in mods for t in [*m.parameters(), *m.buffers()]])

    # ------------------------------------------------------------------ drafting
    def _distributions(self, feats: torch.Tensor) -> torch.Tensor:  # [B, H] -> [M, B, V]
        hs = self.heads(feats)
        self.num_forwards += 1
        return self.lm_head(torch.cat(hs)).float().view(len(hs), feats.shape[0], -1)

    @torch.inference_mode()
    def time_pass(self, batch: int) -> float:
        """Seconds of the heads over `batch` requests, per depth (the policy charges a pass per depth)."""
        feats = torch.zeros(batch, self.heads.hidden_size, device=self.device)
        return self.best_of(lambda: self._distributions(feats)) / len(self.heads.heads)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """One pass of every head over the batch's newest features; then per request a tree of the
        heads' most likely tokens, EXPAND_PER_DEPTH nodes of each depth getting children."""
        t0 = time.perf_counter()
        active = []
        for req, k in zip(requests, num_tokens):
            seq = self._seqs.get(req.request_id)
            # The newest feature must be the root's parent's (position len - 2): the root was drawn from it.
            if k > 0 and seq is not None and seq.pos == len(req.all_token_ids) - 2:
                active.append((req, seq, k))
        if not active:
            return {}
        dists = self._distributions(torch.stack([seq.feat for _, seq, _ in active]))  # [M, B, V]
        out = {}
        for i, (req, seq, k) in enumerate(active):
            t = _TreeDraft(req, seq, k, k)  # type: ignore[arg-type]
            level = [-1]
            for d in range(min(len(dists), k)):
                expand_rows([(t, parent) for parent in level], dists[d, i].expand(len(level), -1), self.generator,
                            self.device, self.children)
                nxt = [c for parent in level for c in (t.root_kids if parent < 0 else t.cands[parent].kids)]
                nxt.sort(key=lambda c: -t.cands[c].score)
                level = [c for c in nxt[:EXPAND_PER_DEPTH] if t.cands[c].score >= EXPAND_MIN]
                if not level:
                    break
            draft = t.select()
            if draft is not None:
                out[req.request_id] = draft
        # Charged per depth, as the policy prices a drafter (the whole call: heads and tree building).
        depth = max((d.max_depth for d in out.values()), default=1)
        self.record_timing(t0, [(time.perf_counter() - t0) / depth] * depth, len(active))
        return out


def build_medusa(path: str | Path, target_runner: object, target_fp: str | tuple[str, ...], tree: bool, seed: int,
                 quantize: bool) -> MedusaProposer:
    """Load a Medusa head file for the target behind `target_runner` (Q8_0 blocks when it runs the
    native kernels)."""
    from specserve.spec.eagle import (
        card_size,
        head_token_ids,
        load_head_for,
        quantize_linears,
        restricted_lm_head,
    )

    tensors, card = load_head_for(path, "medusa", target_fp)
    token_ids = head_token_ids(path, tensors, target_runner.arch.vocab_size)
    heads = MedusaHeads(target_runner.arch.hidden_size, card_size(path, card, "num_heads"))
    try:
        heads.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    except RuntimeError as exc:  # missing / extra / misshapen tensors, as build_eagle says
        raise ConfigError(f"{path} does not hold Medusa heads for this target: {str(exc)[:300]}") from exc
    heads.to(target_runner.device)
    if quantize:
        quantize_linears(list(heads.heads))
    return MedusaProposer(heads, restricted_lm_head(target_runner, token_ids), tree=tree, seed=seed, card=card,
                          device=target_runner.device)
