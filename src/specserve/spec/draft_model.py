"""Draft-model proposer: a small model with its own paged KV cache drafts K tokens per request.

The draft cache is kept in lock-step with each request's *accepted* tokens: before drafting,
the draft tokens it fed last time are compared with what the target accepted, the matching
prefix stays, the rest is rolled back. Then one forward pass catches every request up (its
prompt on first use, the recovered/bonus token afterwards) and samples draft 1, and K-1 more
single-token passes over the whole batch produce drafts 2..K.

A request stops drafting early when the draft gives the token it just drafted a probability
below `p_min` (the token itself is still proposed): the draft's confidence predicts acceptance
well (greedy Qwen2.5-Coder 0.5B for 1.5B on coding prompts: 99% of drafts with p >= 0.9 were
accepted, about 45% of those with p < 0.5), so the passes that would follow an unsure token are
mostly wasted. Exactness is unaffected: whether to draft one more token depends only on the
draft's own outputs, never on the target's, and each proposed token is still verified with its
own draft probability.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence

import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.engine.runner import FeedEntry, ModelRunner
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.errors import ConfigError
from specserve.kernels import row_argmax, row_topk
from specserve.kv_cache.manager import KVCacheManager
from specserve.kv_cache.pages import LayerKV
from specserve.models.arch import ArchConfig
from specserve.models.llama import RestrictedLMHead
from specserve.request import Request
from specserve.sampling.penalties import drafter_logits
from specserve.sampling.sampler import (
    SamplingMetadata,
    logits_to_probs,
    sample_from_probs,
)
from specserve.spec.policy import tree_depth
from specserve.spec.proposer import (
    PromptFeed,
    PromptKVTraveller,
    Proposer,
    ProposerTraits,
    register_proposer,
)
from specserve.spec.tree import DraftTree, SiblingDraw, drafts_ranked

# Tree drafting (EAGLE-2's dynamic expansion): each pass feeds up to EXPAND_WIDTH unexpanded
# nodes of highest path probability, each one only if the draft was sure of it (its own
# probability >= draft_p_min, the chain's early stop) and the pass pays for itself, and gives
# each its CHILDREN most likely tokens (drafts_ranked; an unseeded sampled chain draws its one). The
# unexpanded alternatives stay as leaves: where the draft is sure the tree is a chain, where it
# is unsure it branches, for the price of the chain's passes. The draft keeps the best nodes
# within the step's node budget (and the policy prunes what does not pay to verify).
# Nodes fed per request and pass. A pass over more rows is no longer dear (the 0.5B int4 draft alone,
# 2-vCPU Zen 4: 2 / 3 / 4 rows 1.02 / 1.04 / 1.07 x one row's 8.3 ms), but side nodes are fed only
# where the draft is sure of them (p_min), so width rarely binds: 4 instead of 2 left SmolLM2's
# EAGLE trees unchanged (1.70 / 1.49 tokens per forward, coding / prose) and the Qwen pair's
# draft-model trees at 3.49-3.65 tokens a step against 3.19-3.39, their speed within the phases'
# noise (session 90).
EXPAND_WIDTH = 2
CHILDREN = 4
EXPAND_MIN = 0.05
MAX_PASSES = 8


class _DraftSeq:
    """A request as seen by the draft cache: accepted tokens plus unverified fed drafts."""

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "fed")

    def __init__(self, request: Request) -> None:
        self.request_id = request.request_id
        self.all_token_ids = request.all_token_ids  # the request's own list: always current
        self.num_computed_tokens = 0  # accepted tokens whose draft KV is valid
        # Draft nodes fed after them last time, in slot order (a chain, or the expanded nodes of
        # a tree), not yet verified.
        self.fed: DraftTree | None = None


class _Cand:
    """A node of a tree being drafted."""

    __slots__ = ("token", "parent", "score", "row", "fed", "kids", "main")

    def __init__(self, token: int, parent: int, score: float, row: int, main: bool = False) -> None:
        self.token = token
        self.parent = parent  # candidate index, -1 for the root
        self.score = score  # path probability under the draft
        self.row = row  # row of the distribution it was drawn from
        self.fed = -1  # index among the fed nodes once expanded
        self.main = main  # on the path of first children: the chain the draft would have drafted
        self.kids: list[int] = []  # candidate children in draw order


class _TreeDraft:
    """One request's tree while the draft grows it (see DraftModelProposer._propose_trees)."""

    def __init__(self, req: Request, seq: _DraftSeq, budget: int, cap: int) -> None:
        self.req, self.seq, self.budget, self.cap = req, seq, budget, cap
        # Each level costs a pass: no deeper than the chain the policy priced (see pick).
        self.max_depth = tree_depth(budget)
        self.cands: list[_Cand] = []
        self.root_kids: list[int] = []
        self.dists: list[torch.Tensor | None] = []  # [V] each, the distribution children were drawn from (greedy: None)
        self.fed: list[int] = []  # candidates fed to the draft, in slot order

    def depth(self, c: int) -> int:
        """Depth of candidate c (the root: 0)."""
        d = 0
        while c >= 0:
            c, d = self.cands[c].parent, d + 1
        return d

    def add_children(self, parent: int, dist: torch.Tensor | None, picks: list[tuple[int, float]]) -> None:
        row = len(self.dists)
        self.dists.append(dist)
        base = 1.0 if parent < 0 else self.cands[parent].score
        kids = self.root_kids if parent < 0 else self.cands[parent].kids
        main = parent < 0 or self.cands[parent].main
        for j, (tok, prob) in enumerate(picks):
            kids.append(len(self.cands))
            self.cands.append(_Cand(tok, parent, base * prob, row, main and j == 0))

    def pick(self, passes: int, cost_ratio: float, p_min: float) -> list[int]:
        """The unexpanded candidates to feed this pass: the main path first, then highest path
        probability.

        The main path (first children: the chain the draft would draft) grows as a chain does,
        while the draft is sure of it and no deeper than the chain K the node budget was sized
        from (policy.tree_depth), so a tree never holds less than the chain and never pays for
        more passes. Past that depth the policy's cost model says a pass does not pay: fed
        deeper (up to the whole budget), the 0.5B draft on coding prompts made 3.5 passes a step
        where its chain made 2.7, and prune() kept 4 of the 10 nodes. A side node
        costs the pass extra width: one more pass costs r = cost_ratio of a target step and
        gains about s tokens, s the node's path probability (its children's chances add up to at
        most s); with E tokens already expected from the tree and k passes made, the step's
        tokens per second rise only if s / r > (1 + E) / (1 + k r), so side nodes below that
        are not expanded.
        """
        room = min(EXPAND_WIDTH, self.cap - len(self.fed))
        if room <= 0:
            return []
        expected = sum(c.score for c in self.cands)
        floor = max(EXPAND_MIN, cost_ratio * (1 + expected) / (1 + passes * cost_ratio))
        open_ = [i for i, c in enumerate(self.cands)
                 if c.fed < 0 and (c.main or c.score >= floor) and self.sure(i, p_min) and self.depth(i) < self.max_depth]
        main = [i for i in open_ if self.cands[i].main]
        # Side nodes may take at most half the feed cap: the rest stays the main path's.
        side_room = self.cap // 2 - sum(not self.cands[c].main for c in self.fed)
        side = sorted((i for i in open_ if not self.cands[i].main), key=lambda i: -self.cands[i].score)
        picked = (main + side[: max(0, side_room)])[:room]
        for i in picked:
            self.cands[i].fed = len(self.fed)
            self.fed.append(i)
        return picked

    def sure(self, c: int, p_min: float) -> bool:
        """The draft gave candidate c at least p_min given its parent."""
        parent = self.cands[c].parent
        base = 1.0 if parent < 0 else self.cands[parent].score
        return self.cands[c].score >= p_min * base

    def entry(self, picked: list[int], block_ids: list[int]) -> FeedEntry:
        """The picked nodes as one request's share of a draft pass: slots after the nodes fed
        before them, positions root + depth, each seeing the prefix and its fed ancestors."""
        root = len(self.seq.all_token_ids) - 1
        start = len(self.seq.all_token_ids) + len(self.fed) - len(picked)
        return FeedEntry([self.cands[c].token for c in picked], [root + self.depth(c) for c in picked], start, block_ids,
                         self.tail_mask(picked), range(len(picked)))

    def tail_mask(self, picked: list[int]) -> torch.Tensor:  # [len(picked), len(fed)]
        """Which fed nodes each picked node sees: its fed ancestors and itself."""
        tail = torch.zeros(len(picked), len(self.fed), dtype=torch.bool)
        for r, c in enumerate(picked):
            while c >= 0:
                tail[r, self.cands[c].fed] = True
                c = self.cands[c].parent
        return tail

    def select(self) -> DraftTree | None:
        """The budget best nodes; a node enters only after its parent and its earlier siblings."""
        heap = [(-self.cands[self.root_kids[0]].score, self.root_kids[0])] if self.root_kids else []
        order: dict[int, int] = {}
        while heap and len(order) < self.budget:
            _, c = heapq.heappop(heap)
            order[c] = len(order)
            cand = self.cands[c]
            if cand.kids:
                heapq.heappush(heap, (-self.cands[cand.kids[0]].score, cand.kids[0]))
            sibs = self.root_kids if cand.parent < 0 else self.cands[cand.parent].kids
            nxt = sibs.index(c) + 1
            if nxt < len(sibs):
                heapq.heappush(heap, (-self.cands[sibs[nxt]].score, sibs[nxt]))
        if not order:
            return None
        nodes = list(order)
        tokens = tuple(self.cands[c].token for c in nodes)
        parents = tuple(order[self.cands[c].parent] if self.cands[c].parent >= 0 else -1 for c in nodes)
        scores = tuple(self.cands[c].score for c in nodes)
        if all(d is None for d in self.dists):  # ranked candidates (drafts_ranked): deterministic
            return DraftTree(tokens, parents, scores=scores)
        rows = sorted({self.cands[c].row for c in nodes})
        index = {r: i for i, r in enumerate(rows)}
        return DraftTree(tokens, parents, SiblingDraw.WITHOUT_REPLACEMENT, torch.stack([self.dists[r] for r in rows]),
                         tuple(index[self.cands[c].row] for c in nodes), scores)

    def fed_tree(self) -> DraftTree | None:
        """The fed nodes in slot order (what the draft cache holds beyond the accepted tokens)."""
        if not self.fed:
            return None
        return DraftTree(tuple(self.cands[c].token for c in self.fed),
                         tuple(self.cands[self.cands[c].parent].fed if self.cands[c].parent >= 0 else -1 for c in self.fed))


def expand_rows(rows: Sequence[tuple[_TreeDraft, int]], logits: torch.Tensor, generator: torch.Generator,
                device: torch.device, children: int = CHILDREN) -> None:  # logits: [len(rows), V]
    """Give each (tree t, candidate parent) of `rows` (parent -1: the root) its children from
    the drafter's next-token logits in the same row: the `children` most likely tokens for a
    greedy request (deterministic candidates, scored by the softmax of the logits), the
    `children` most likely of the processed distribution for a sampled one in a tree or a seeded
    one (`drafts_ranked`), else (an unseeded chain) a draw from the processed distribution. The
    rows are processed together: one softmax, top-k and draw for the pass, where a pass over a
    batch of trees would otherwise pay a dozen small operations per row."""
    if not rows:
        return
    depths = [t.depth(parent) + 1 for t, parent in rows]
    indices = [t.req.num_output_tokens + d - 1 for (t, _), d in zip(rows, depths)]
    logits = drafter_logits(logits, [t.req for t, _ in rows], indices).float()
    greedy = [t.req.sampling_params.is_greedy for t, _ in rows]
    picks: list[list[tuple[int, float]]] = [[] for _ in rows]
    probs: list[torch.Tensor | None] = [None] * len(rows)  # the distribution each sampled row's children came from
    g_rows = [i for i, g in enumerate(greedy) if g]
    if g_rows:  # the top children and their probabilities, no distribution kept (greedy trees carry none)
        values, ids, lse = row_topk(logits if len(g_rows) == len(rows) else logits[g_rows], min(children, logits.shape[-1]))
        for r, toks, vals in zip(g_rows, ids.tolist(), (values - lse.unsqueeze(1)).exp().tolist()):
            picks[r] = list(zip(toks, vals))
    s_rows = [i for i, g in enumerate(greedy) if not g]
    if s_rows:
        reqs = [rows[i][0].req for i in s_rows]
        meta = SamplingMetadata.build([q.sampling_params for q in reqs], [indices[i] for i in s_rows], device)
        p = logits_to_probs(logits if len(s_rows) == len(rows) else logits[s_rows], meta.temperature, meta.top_k,
                            meta.top_p, meta.any_top_k, meta.any_top_p, meta.min_p, meta.any_min_p)
        n = (p > 0).sum(-1).clamp(max=children).tolist()
        is_ranked = [drafts_ranked(q.sampling_params, children) for q in reqs]
        ranked = [i for i, r in enumerate(is_ranked) if r]
        if ranked:  # the likeliest tokens, no distribution kept (verified as deterministic candidates)
            values, ids = torch.topk(p[ranked], min(children, p.shape[-1]), dim=-1)
            for i, toks, vals in zip(ranked, ids.tolist(), values.tolist()):
                picks[s_rows[i]] = list(zip(toks[: n[i]], vals[: n[i]]))
        drawn = [i for i, r in enumerate(is_ranked) if not r]  # unseeded chains (one child): the next token drawn
        if drawn:
            toks = sample_from_probs(p[drawn], [None] * len(drawn), [0] * len(drawn), generator).tolist()
            for i, tok in zip(drawn, toks):
                picks[s_rows[i]] = [(tok, float(p[i, tok]))]
                probs[s_rows[i]] = p[i]
    for (t, parent), dist, pk in zip(rows, probs, picks):
        t.add_children(parent, dist, pk)


def grow_trees(trees: Sequence[_TreeDraft], cost_ratio: float, p_min: float,
               run_pass: Callable[[list[tuple[_TreeDraft, list[int]]]], None]) -> list[float]:
    """EAGLE-2's expansion passes, shared by every tree drafter: each pass picks every tree's
    nodes to feed (_TreeDraft.pick, in tree order), then `run_pass(step)` over the trees that have
    any, [(tree, picked)], feeds them and expands each picked node. Passes end when no tree has a
    node to grow (the main path may take up to budget levels). Returns each pass's seconds."""
    later = []
    for passes in range(1, min(MAX_PASSES, max(t.budget for t in trees)) + 1):
        tp = time.perf_counter()
        step = [(t, picked) for t in trees if (picked := t.pick(passes, cost_ratio, p_min))]
        if not step:
            break
        run_pass(step)
        later.append(time.perf_counter() - tp)
    return later


def picked_rows(step: list[tuple[_TreeDraft, list[int]]]) -> list[tuple[_TreeDraft, int]]:
    """(tree, candidate) of a pass's output rows, in feed order."""
    return [(t, c) for t, picked in step for c in picked]


def truncate_layers(
    arch: ArchConfig, weights: dict[str, torch.Tensor], num_layers: int
) -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """Keep the first num_layers decoder layers (plus embeddings, final norm and head)."""
    if num_layers > arch.num_layers:
        raise ConfigError(f"draft_num_layers={num_layers} exceeds the draft's {arch.num_layers} layers.")
    kept = {}
    for name, t in weights.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        kept[name] = t
    return dataclasses.replace(arch, num_layers=num_layers, name=f"{arch.name}[:{num_layers}]"), kept


class PassTimer:
    """Timing a per-pass drafter reports to the engine's policy."""

    time_s = 0.0  # all propose() calls
    last_time_s = 0.0
    # Seconds of one draft pass after the first in the last propose() (None if it made only the
    # catch-up pass): what each extra draft position costs. The first pass also catches the
    # drafter up on the prompt or on tokens generated while speculation was off, a one-off cost
    # that would make the policy believe drafting is slower than it is.
    last_pass_time_s: float | None = None
    last_batch = 0

    def best_of(self, run: Callable[[], object], repeats: int = 3) -> float:
        """The fastest of `repeats` timed calls of run() (start-up profiling; its passes are not
        counted as drafting)."""
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        self.num_forwards -= repeats
        return best

    def record_timing(self, t0: float, later: list[float], batch: int) -> None:
        """One propose() that began at t0 made passes `later` after its first, over `batch` requests."""
        self.last_time_s = time.perf_counter() - t0
        self.last_pass_time_s = sum(later) / len(later) if later else None
        self.last_batch = batch
        self.time_s += self.last_time_s


class CandidateWidth:
    """Children per expanded node of a head drafter's tree: CHILDREN (trees) or 1 (chains)."""

    children = CHILDREN

    @property
    def tree(self) -> bool:
        """Trees (CHILDREN candidates per expanded node) or chains (one)."""
        return self.children > 1

    @tree.setter
    def tree(self, value: bool) -> None:
        self.children = CHILDREN if value else 1


@register_proposer("draft")
class DraftModelProposer(PassTimer, PromptKVTraveller, Proposer):
    """Autoregressive drafting with a smaller model over its own paged KV cache."""

    # Chains by default: trees accept as many tokens per step as chains (3.0 vs 3.1, coding
    # prompts) but their wider draft passes cost more on a 2-core CPU (1.30x vs 1.47x plain;
    # Qwen 0.5B for 1.5B on auto, AVX2 EPYC). --spec-tree tree asks for them.
    traits = ProposerTraits(cost="per_pass", trees=True, tree_by_default=False, prior_acceptance=0.7,
                            prompt_kv_travels=True)

    def __init__(
        self,
        arch: ArchConfig,
        weights: dict[str, torch.Tensor],
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        vocab_subset: torch.Tensor | None = None,
        packed: dict | None = None,
        p_min: float = 0.0,
        tree: bool = False,
        source: str | None = None,
    ) -> None:
        self.p_min = p_min
        self.tree = tree
        self.runner = ModelRunner(arch, weights, model_config, cache_config, max_model_len, vocab_subset, packed,
                                  source=source)
        self.kv = KVCacheManager(
            self.runner.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, name="draft"
        )
        self.device = self.runner.device
        head = self.runner.model.lm_head
        # A restricted head learns the ids the requests use beyond it (count_text).
        self.learning_head = head if isinstance(head, RestrictedLMHead) else None
        self._counted: dict[str, int] = {}  # request id -> its tokens the head has counted
        self._seqs: dict[str, _DraftSeq] = {}
        self._cached: dict[str, int] = {}  # prefix-cache hits of requests not yet drafting
        self._memory_bytes: int | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_config.seed + 1)
        self.num_forwards = 0
        self._arriving: dict[str, int] = {}  # prompt KV coming from a prefill worker: tokens [0, m)

    def time_pass(self, batch: int) -> float:
        """Seconds of one single-token draft pass over `batch` requests (start-up profiling)."""
        return self.runner.time_decode_step(batch)

    def time_catchup(self, tokens: int) -> float:
        """Seconds to feed one request `tokens` tokens in one pass (its prompt, or a backlog)."""
        return self.runner.time_decode_step(1, tokens_per_req=tokens)

    def catchup_tokens(self, request: Request) -> int:
        """Tokens the draft cache is behind `request` (fed drafts may be kept: not counted)."""
        arriving = self._arriving.get(request.request_id)
        if arriving is not None:  # the prompt's KV is on its way: only what follows it
            return max(0, len(request.all_token_ids) - arriving)
        seq = self._seqs.get(request.request_id)
        if seq is None:  # the prompt, less what the draft's prefix cache holds (looked up once)
            hit = self._cached.get(request.request_id)
            if hit is None:
                hit = self._cached[request.request_id] = self.kv.num_cached_tokens(request)
            return max(0, len(request.all_token_ids) - hit)
        fed = len(seq.fed) if seq.fed is not None else 0
        return max(0, len(request.all_token_ids) - seq.num_computed_tokens - fed)

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, request: Request) -> None:
        """The head counts the prompt's ids (and later the answer's, drafted for or not)."""
        self.count_text(request)

    def request_finished(self, request: Request) -> None:
        """The head counts what the request wrote after its last draft."""
        self.count_text(request)
        self._counted.pop(request.request_id, None)

    def count_text(self, request: Request) -> None:
        """Show the restricted head the request's tokens it has not counted yet: the prompt when
        the request arrives, the answer as drafting reaches it and when it ends."""
        if self.learning_head is None:
            return
        ids = request.all_token_ids
        done = self._counted.get(request.request_id, 0)
        if len(ids) > done:
            self.learning_head.learn(ids[done:])
            self._counted[request.request_id] = len(ids)

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Free the request's draft KV (a preempted request catches up again later)."""
        self._cached.pop(request_id, None)
        self._arriving.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.forget(seq) if finished else self.kv.free(seq)

    def describe(self) -> str:
        """The draft's precision and LM-head size (and how many ids it may learn beyond it), for
        the start-up summary."""
        head = getattr(self.runner.model, "lm_head", None)
        vocab = f", {len(head.token_ids):,}-token head" if hasattr(head, "token_ids") else ""
        room = len(getattr(head, "rows_buf", ()))
        return f"{self.runner.quantization}{vocab}{f' learning up to {room:,} more ids from the requests' if room else ''}"

    def memory_bytes(self) -> int:
        """The draft's weights and KV cache (both fixed once built)."""
        if self._memory_bytes is None:
            self._memory_bytes = self.runner.resident_bytes()
        return self._memory_bytes

    def live_request_ids(self) -> list[str]:
        """Requests holding draft KV blocks."""
        return list(self._seqs)

    def check_integrity(self) -> bool:
        """The draft cache's blocks are free, cached or held by a live request."""
        return self.kv.check_integrity(list(self._seqs))

    # ------------------------------------------------------------------ drafting
    def _sync(self, seq: _DraftSeq) -> None:
        """Keep the fed drafts the target accepted (their KV moved into consecutive slots, as
        the target's is); roll back the rest."""
        if seq.fed is not None:
            base = seq.num_computed_tokens
            # The newest token is always fed again: its output is the next draft's root.
            path = seq.fed.match(seq.all_token_ids[base:-1])
            moves = [(base + node, base + d) for d, node in enumerate(path) if node != d]
            if moves:
                table = self.kv.block_ids(seq.request_id)
                self.runner.move_kv([(self.runner.slot(table, a), self.runner.slot(table, b)) for a, b in moves])
            seq.num_computed_tokens = base + len(path)
            seq.fed = None
        self.kv.rollback(seq, seq.num_computed_tokens)
        self.kv.cache_blocks(seq, seq.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """Draft up to num_tokens[i] nodes for every request, all requests batched per pass:
        trees (see _propose_trees) or, in chain mode, chains that stop at an unsure token."""
        if self.tree:
            return self._propose_trees(requests, num_tokens)
        t0 = time.perf_counter()
        active: list[tuple[Request, _DraftSeq, int]] = []
        first_pass: list[ScheduledRequest] = []
        for req, k in zip(requests, num_tokens):
            # Slots for the catch-up tokens and the k-1 drafts fed back in.
            admitted = self._admit(req, k, k - 1)
            if admitted is None:
                continue
            seq, new = admitted
            active.append((req, seq, k))
            first_pass.append(self._entry(req, new, seq.num_computed_tokens))
        if not active:
            return {}
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in active}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in active}

        entries = first_pass
        step_reqs = active
        later_passes = []
        for j in range(max(k for _, _, k in active)):
            tp = time.perf_counter()
            logits = self.runner.forward_logits(
                self.runner.prepare_inputs(SchedulerOutput(entries, sum(len(e.token_ids) for e in entries), []))
            )
            self.num_forwards += 1
            if j == 0:
                for _, seq, _ in step_reqs:
                    seq.num_computed_tokens = len(seq.all_token_ids)
            logits = drafter_logits(logits, [req for req, _, _ in step_reqs],
                                    [req.num_output_tokens + j for req, _, _ in step_reqs])
            toks, rows = self._sample(logits, step_reqs, j)
            # Only a request that may draft again needs to know (none does on the last pass).
            more = self.p_min > 0 and any(j + 1 < k for _, _, k in step_reqs)
            unsure = self._unsure(logits, toks, rows, step_reqs) if more else [False] * len(step_reqs)
            if j > 0:
                later_passes.append(time.perf_counter() - tp)
            next_reqs, entries = [], []
            for i, (req, seq, k) in enumerate(step_reqs):
                rid = req.request_id
                drafts[rid].append(toks[i])
                if rows is not None and not drafts_ranked(req.sampling_params):
                    probs[rid].append(rows[i])
                if j + 1 < k and not unsure[i]:
                    fed = list(seq.fed.token_ids) if seq.fed is not None else []
                    pos = len(seq.all_token_ids) + len(fed)
                    seq.fed = DraftTree.chain(fed + [toks[i]])
                    next_reqs.append((req, seq, k))
                    entries.append(self._entry(req, [toks[i]], pos))
            step_reqs = next_reqs
            if not step_reqs:
                break
        out = {}
        for req, _, _ in active:
            rid = req.request_id
            p = torch.stack(probs[rid]) if probs[rid] else None
            out[rid] = DraftTree.chain(drafts[rid], p)
        self.record_timing(t0, later_passes, len(active))
        return out

    def _admit(self, req: Request, k: int, extra: int) -> tuple[_DraftSeq, list[int]] | None:
        """Bring the request's draft cache up to date (keep what the target accepted, find prefix
        hits) and hold slots for its catch-up tokens plus `extra` draft nodes. None when nothing
        is asked (k <= 0) or the cache is full: no speculation this step rather than evicting."""
        if k <= 0 or req.request_id in self._arriving:  # no draft until its prompt KV is in
            return None
        seq = self._seqs.get(req.request_id)
        if seq is None:
            seq = self._seqs[req.request_id] = _DraftSeq(req)
        self._sync(seq)
        self.count_text(req)
        hits, start = self._prefix_hits(seq, len(seq.all_token_ids))
        new = seq.all_token_ids[start:]
        if not self.kv.allocate_slots(seq, len(new) + extra, hits):
            return None
        seq.num_computed_tokens = start
        return seq, new

    # ------------------------------------------------------------------ prompt KV across workers
    # Disaggregated serving: a prefill worker holding the same draft computes the draft's prompt
    # KV beside the target's (`feed_prompts`) and sends it; the decode worker's draft places it
    # (`expect_prompt_kv`), so its first drafts follow the request's first token instead of a
    # catch-up pass over the whole prompt that would stall every request of the step.
    def prompt_kv_caches(self) -> list[LayerKV]:
        """The draft's paged KV, per layer."""
        return self.runner.kv_caches

    def prompt_kv_shape(self) -> dict:
        """The draft's KV per token (its layers, heads, dtypes)."""
        arch = self.runner.arch
        return {"num_layers": arch.num_layers, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
                "dtype": str(self.runner.dtype).replace("torch.", ""), "kv_cache_dtype": self.runner.kv_cache_dtype}

    def prompt_kv_identity(self) -> dict:
        """The draft's weights' precision (the model and its layers are the engine's settings)."""
        return {"quantization": self.runner.quantization}

    def prompt_kv_slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of the request's draft tokens [start, end)."""
        return self.kv.slots(request_id, start, end)

    @torch.inference_mode()
    def feed_prompts(self, feeds: Sequence[PromptFeed]) -> dict[str, int]:
        """Bring each request's draft KV to its first n tokens (prefix-cache hits first, the rest
        in one batched forward without logits). Returns the tokens each request's draft pages now
        hold; a request the draft pool has no room for is left out."""
        entries: list[FeedEntry] = []
        fed: list[tuple[_DraftSeq, int]] = []
        done: dict[str, int] = {}
        for req, n, _ in feeds:
            rid = req.request_id
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._seqs[rid] = _DraftSeq(req)
            hits, start = self._prefix_hits(seq, n)
            if not self.kv.allocate_slots(seq, max(0, n - start), hits):
                continue
            seq.num_computed_tokens = start
            done[rid] = max(start, n)
            if n > start:
                entries.append(FeedEntry(seq.all_token_ids[start:n], list(range(start, n)), start,
                                         self.kv.block_ids(rid), None, range(0)))
                fed.append((seq, n))
        if entries:
            self.runner.hidden_states(entries)
            self.num_forwards += 1
        for seq, n in fed:
            seq.num_computed_tokens = n
            self.kv.cache_blocks(seq, n)
        return done

    def expect_prompt_kv(self, request: Request, num_tokens: int) -> int | None:
        """Hold draft blocks for the first num_tokens tokens of a request whose draft KV arrives
        from a prefill worker; returns the tokens already in this draft's prefix cache, or None
        when the pool has no room (the draft then catches up as usual). No draft is made for the
        request until `prompt_kv_arrived` or `drop_prompt_kv`."""
        rid = request.request_id
        if rid in self._seqs:
            return None
        seq = _DraftSeq(request)
        hits, start = self._prefix_hits(seq, num_tokens)
        if not self.kv.allocate_slots(seq, num_tokens - start, hits):
            return None
        seq.num_computed_tokens = start
        self._seqs[rid] = seq
        self._arriving[rid] = num_tokens
        return seq.num_computed_tokens

    def _prefix_hits(self, seq: _DraftSeq, upto: int) -> tuple[list, int]:
        """Prefix-cache hits within the first `upto` tokens of a sequence that holds no blocks yet
        (none otherwise) and the tokens computed after them. allocate_slots counts the hits
        itself, so the sequence's computed count is set only after it."""
        if self.kv.req_blocks.get(seq.request_id):
            return [], seq.num_computed_tokens
        seq.num_computed_tokens = 0
        hits, _ = self.kv.get_computed_blocks(seq)
        hits = hits[: upto // self.kv.block_size]
        return hits, len(hits) * self.kv.block_size

    def prompt_kv_pending(self, request_id: str) -> bool:
        """Blocks are held for this request's arriving prompt KV (False once it was dropped,
        preempted or finished)."""
        return request_id in self._arriving

    def prompt_kv_arrived(self, request_id: str) -> None:
        """Every layer of the expected prompt KV is in the held blocks: draft from there on."""
        n = self._arriving.pop(request_id, None)
        seq = self._seqs.get(request_id)
        if n is None or seq is None:
            return
        seq.num_computed_tokens = n
        self.kv.cache_blocks(seq, n)

    def drop_prompt_kv(self, request_id: str) -> None:
        """The prompt KV will not come (a failed or stalled transfer): free its blocks; the draft
        catches the request up on its prompt when it next drafts for it."""
        if self._arriving.pop(request_id, None) is not None:
            seq = self._seqs.pop(request_id, None)
            if seq is not None:
                self.kv.free(seq)

    # ------------------------------------------------------------------ trees
    @torch.inference_mode()
    def _propose_trees(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """EAGLE-2's dynamic tree: grow where the draft is sure, branch where it is not.

        After the catch-up pass (which gives the root's distribution) every pass feeds, for each
        request, the EXPAND_WIDTH unexpanded nodes of highest path probability (the product of
        the draft's probabilities along the path), each one's KV written after the nodes fed
        before it and masked to its ancestors; each fed node gets CHILDREN candidate children.
        The draft then keeps the budget nodes of highest path probability, a node only with its
        parent and its earlier siblings. Every request's children are the most likely tokens
        (deterministic candidates, `drafts_ranked`: the logits' for greedy requests, the processed
        distribution's for sampled ones), which keeps the cut exact.
        """
        t0 = time.perf_counter()
        trees: list[_TreeDraft] = []
        entries: list[FeedEntry] = []
        for req, k in zip(requests, num_tokens):
            cap = min(k, EXPAND_WIDTH * MAX_PASSES)  # nodes this call may feed
            admitted = self._admit(req, k, cap)
            if admitted is None:
                continue
            seq, new = admitted
            start = seq.num_computed_tokens
            trees.append(_TreeDraft(req, seq, k, cap))
            entries.append(FeedEntry(new, list(range(start, start + len(new))), start, self.kv.block_ids(req.request_id),
                                     None, [len(new) - 1]))
        if not trees:
            return {}
        logits = self.runner.forward_logits(self.runner.feed_inputs(entries))  # [B, V]: each root's next token
        self.num_forwards += 1
        for t in trees:
            t.seq.num_computed_tokens = len(t.seq.all_token_ids)
        expand_rows([(t, -1) for t in trees], logits, self.generator, self.device)

        def run_pass(step: list[tuple[_TreeDraft, list[int]]]) -> None:
            entries = [t.entry(picked, self.kv.block_ids(t.req.request_id)) for t, picked in step]
            logits = self.runner.forward_logits(self.runner.feed_inputs(entries))  # [sum picked, V]
            self.num_forwards += 1
            expand_rows(picked_rows(step), logits, self.generator, self.device)

        later = grow_trees(trees, self.pass_cost_ratio, self.p_min, run_pass)
        out = {}
        for t in trees:
            draft = t.select()
            t.seq.fed = t.fed_tree()
            if draft is not None:
                out[t.req.request_id] = draft
        self.record_timing(t0, later, len(trees))
        return out

    def _entry(self, req: Request, tokens: list[int], start: int) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=req.request_id, token_ids=tokens, start_pos=start,
            block_ids=self.kv.block_ids(req.request_id), draft=None, sample=True,
            sampling_params=req.sampling_params, output_index=req.num_output_tokens,
        )

    def _unsure(
        self, logits: torch.Tensor, toks: list[int], rows: torch.Tensor | None,
        step_reqs: list[tuple[Request, _DraftSeq, int]],
    ) -> list[bool]:
        """Whether each request's new draft token had a draft probability below p_min.

        Greedy rows: the softmax of the raw logits at the argmax. Sampled rows: the probability
        the processed distribution (the one the rejection test uses) gave the drawn token.
        """
        values, _, lse = row_topk(logits.float(), 1)  # greedy rows drew the argmax: its probability
        conf = (values.view(-1) - lse).exp().tolist()
        if rows is not None:  # sampled rows: their processed probabilities
            picked = torch.tensor(toks, device=logits.device).view(-1, 1)
            drawn = rows.gather(1, picked).view(-1).tolist()
            conf = [c if req.sampling_params.is_greedy else d for c, d, (req, _, _) in zip(conf, drawn, step_reqs)]
        return [c < self.p_min for c in conf]

    def _sample(
        self, logits: torch.Tensor, step_reqs: list[tuple[Request, _DraftSeq, int]], j: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """Draft token j of each request: the argmax for greedy and seeded requests (`drafts_ranked`),
        else a draw from the processed draft distribution p. The processed rows are returned for
        the rejection test and the p_min stop."""
        params = [req.sampling_params for req, _, _ in step_reqs]
        steps = [req.num_output_tokens + j for req, _, _ in step_reqs]
        meta = SamplingMetadata.build(params, steps, self.device)
        toks = row_argmax(logits)
        if meta.all_greedy:
            return toks.tolist(), None
        p = logits_to_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.any_top_k, meta.any_top_p,
                            meta.min_p, meta.any_min_p)
        drawn = [i for i, q in enumerate(params) if not drafts_ranked(q)]
        if drawn:  # unseeded sampled rows: one shared generator
            toks[drawn] = sample_from_probs(p[drawn], [None] * len(drawn), [steps[i] for i in drawn], self.generator)
        return toks.tolist(), p
