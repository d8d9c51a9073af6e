"""Per-request logits changes before sampling: OpenAI's logit_bias and presence / frequency
penalties, transformers' / vLLM's repetition penalty, and vLLM's min_tokens.

They run on every logits row a request samples or verifies from (the root row and one per draft
node), before the grammar masks and before temperature / min-p / top-k / top-p. The bias depends
on the request only. The penalties depend on what was generated, so a draft node's row counts
the request's output before the step plus the node and its ancestors: the tokens plain decoding
would have generated on that path. Each row is then changed exactly as plain decoding would
change it after that path, and verification stays exact.

min_tokens masks the ids that end the output in the rows whose path (output before the step, then
the node's depth) is shorter than min_tokens: again what plain decoding would mask at that
position.

All are sparse: only the tokens that occur (or are biased) are touched, so a penalised row of
a 152k vocabulary costs what its few hundred distinct tokens cost, not a pass over the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specserve.spec.tree import DraftTree, SiblingDraw

if TYPE_CHECKING:
    from specserve.engine.scheduler import ScheduledRequest
    from specserve.request import Request


def apply_logit_bias(logits: torch.Tensor, sampled_reqs: Sequence[ScheduledRequest]) -> None:  # [sum(1 + K_i), V]
    """Add each request's logit_bias to every row it samples or verifies from: the batch's
    (row, token) pairs are gathered on the host, then one indexed add."""
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    at = 0
    vocab = logits.shape[1]
    for sr in sampled_reqs:
        n = 1 + sr.num_spec_tokens
        if bias := sr.sampling_params.logit_bias:
            c = torch.tensor(list(bias), dtype=torch.long)
            v = torch.tensor(list(bias.values()), dtype=torch.float32)
            keep = c < vocab
            c, v = c[keep], v[keep]
            rows.append(torch.arange(at, at + n).repeat_interleave(c.numel()))
            cols.append(c.repeat(n))
            vals.append(v.repeat(n))
        at += n
    if rows:
        dev = logits.device
        r, c = torch.cat(rows).to(dev), torch.cat(cols).to(dev)
        logits[r, c] = logits[r, c] + torch.cat(vals).to(device=dev, dtype=logits.dtype)


def apply_penalties(logits: torch.Tensor, sampled_reqs: Sequence[ScheduledRequest]) -> None:  # [sum(1 + K_i), V]
    """Repetition, then frequency and presence penalties (vLLM's order), in every row of each
    request that has them. Every (row, token) pair of the batch is worked out on the host first,
    so the device sees one gather and scatter per kind of penalty per step, not a dozen small
    operations per request (on a GPU each was a launch, and a batch of 32 penalised requests
    decoded at a fifth of the plain rate)."""
    rep: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, cols, factor)
    sub: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, cols, amount)
    at = 0
    vocab = logits.shape[1]
    for sr in sampled_reqs:
        n = 1 + sr.num_spec_tokens
        if sr.penalized_output is not None:  # set for requests with penalties
            _penalty_pairs(sr, at, n, vocab, rep, sub)
        at += n
    dev = logits.device
    if rep:
        r, c, f = (torch.cat(t).to(dev) for t in zip(*rep))
        x = logits[r, c]
        logits[r, c] = torch.where(x > 0, x / f, x * f).to(logits.dtype)
    if sub:
        r, c, v = (torch.cat(t).to(dev) for t in zip(*sub))
        logits[r, c] = (logits[r, c] - v).to(logits.dtype)


def _penalty_pairs(sr: ScheduledRequest, at: int, n: int, vocab: int, rep: list, sub: list) -> None:
    """The pairs one request's rows at..at+n-1 change, appended to `rep` and `sub` (host tensors).

    Row 0 counts the output before the step; row 1 + i also the tokens on draft node i's path
    (its ancestors and itself), as they would be output by then. Each (row, token) pair occurs
    once, with its whole count, so a verified row is changed by the very operations plain
    decoding applies after that path: x / r or x * r once, then x - (freq * count + presence)."""
    params = sr.sampling_params
    out = torch.tensor(sr.penalized_output, dtype=torch.long)  # sampled from rows this wide: all < vocab
    if n > 1:
        p_rows, p_toks = _path_pairs(sr)
        rows = torch.cat([torch.arange(n).repeat_interleave(out.numel()), torch.tensor(p_rows, dtype=torch.long)])
        out = rows * vocab + torch.cat([out.repeat(n), torch.tensor(p_toks, dtype=torch.long)])
    keys, counts = torch.unique(out, return_counts=True)  # row * vocab + token -> occurrences on that row's path
    if params.repetition_penalty != 1.0:
        seen = keys
        if sr.penalized_prompt is not None:
            prompt = sr.penalized_prompt[sr.penalized_prompt < vocab]
            if n > 1:
                prompt = (torch.arange(n)[:, None] * vocab + prompt[None]).flatten()
            seen = torch.unique(torch.cat([prompt, keys]))
        rep.append((at + seen // vocab, seen % vocab,
                    torch.full((seen.numel(),), float(params.repetition_penalty), dtype=torch.float32)))
    if (params.presence_penalty or params.frequency_penalty) and keys.numel():
        amount = params.frequency_penalty * counts + params.presence_penalty  # float32, as plain decoding computes it
        sub.append((at + keys // vocab, keys % vocab, amount.float()))


def min_tokens_rows(sr: ScheduledRequest) -> list[int]:
    """The request's rows (0: its root, 1 + i: after draft node i) whose path is shorter than its
    min_tokens, where its ending ids are held back."""
    if sr.min_tokens_ban is None:
        return []
    short = sr.sampling_params.min_tokens - sr.output_index  # rows of depth < short are masked
    depths = (0,) + (sr.draft.depths if sr.draft is not None else ())
    return [i for i, d in enumerate(depths) if d < short]


def apply_min_tokens(logits: torch.Tensor, sampled_reqs: Sequence[ScheduledRequest]) -> None:  # [sum(1 + K_i), V]
    """Forbid EOS and stop_token_ids in every row of a request whose path is shorter than its
    min_tokens: the root row samples output token output_index, a node's row the one after it.
    One indexed write for the batch. Requests with a grammar are left to its masks
    (`min_tokens_rows`, grammar.forbid_unless_only)."""
    rows: list[int] = []
    cols: list[int] = []
    at = 0
    vocab = logits.shape[1]
    for sr in sampled_reqs:
        n = 1 + sr.num_spec_tokens
        if sr.min_tokens_ban is not None and sr.grammar is None:
            ids = [i for i in sr.min_tokens_ban.tolist() if i < vocab]  # a few ids: host lists, no tensor ops
            for r in min_tokens_rows(sr):
                rows += [at + r] * len(ids)
                cols += ids
        at += n
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


def drafter_logits(logits: torch.Tensor, reqs: Sequence[Request], output_indices: Sequence[int]) -> torch.Tensor:
    """A drafter's rows (row i drafts output token output_indices[i] of reqs[i]) with the
    request's logit_bias, and min_tokens' ban of the ending ids, as the target's rows get them:
    a draft that proposes a token the target bans is rejected there, so drafting it wastes the
    step's tail. (Penalties depend on each node's path and are left to verification: a draft is
    only a proposal, exactness never rests on it.) Returns `logits` itself when nothing applies."""
    out = logits
    for i, (req, index) in enumerate(zip(reqs, output_indices)):
        params = req.sampling_params
        ban = index < params.min_tokens
        if not params.logit_bias and not ban:
            continue
        if out is logits:
            out = logits.float().clone()
        if params.logit_bias:
            _add_bias(out[i : i + 1], params.logit_bias)
        if ban:
            _ban(out, [i], req.end_token_ids)
    return out


BANNED_BIAS = -100.0  # OpenAI: a logit_bias of -100 "should result in a ban or exclusive selection"


def prune_banned(tree: DraftTree, req: Request) -> DraftTree | None:
    """The draft without the nodes, and their subtrees, whose token the target's rows ban at that
    depth (a logit_bias of -100 or below, and the ending ids while the output is shorter than
    min_tokens), and without the ending ids' nodes themselves (EOS unless ignore_eos,
    stop_token_ids) with what follows them. An ending node can never add a token: accepted, it
    ends the output, and its parent's row would have drawn it from the same distribution as the
    step's next token anyway, so it costs a row and nothing below it is ever emitted. Model
    drafters never propose banned ids (drafter_logits); model-free ones (prompt lookup,
    reference, lookahead) copy text without reading the request's parameters. (Qwen2.5-Coder
    1.5B answering an edit with code: at the answer's opening fence, prompt lookup copied what
    followed the prompt's closing one, `<|im_end|>`, a newline, `<|im_start|>assistant` ..., six
    rows none of which could count.) Exactness never rests on this: the rows are masked in
    verification whatever the draft holds. None when nothing is left.

    A drawn node (an unseeded chain's token drawn from the drafter's distribution) keeps its
    ending id, without what follows it: rejection sampling is exact for a draw only if whether
    it is verified does not depend on what was drawn (specserve.spec.tree.drafts_ranked)."""
    params = req.sampling_params
    banned = {t for t, v in params.logit_bias.items() if v <= BANNED_BIAS} if params.logit_bias else set()
    short = params.min_tokens - req.num_output_tokens  # nodes at depth <= short are under min_tokens
    ends = req.end_token_set
    tokens = tree.token_ids
    if not banned and not any(t in ends for t in tokens):
        return tree
    drawn = tree.draw is not SiblingDraw.DETERMINISTIC
    depths = tree.depths
    kept: list[int] = []
    alive = {-1}  # nodes whose children may stay
    for node, (tok, parent) in enumerate(zip(tokens, tree.parents)):
        if parent not in alive or tok in banned:
            continue
        if tok not in ends:
            kept.append(node)
            alive.add(node)
        elif drawn and depths[node] > short:
            kept.append(node)
    if len(kept) == len(tree):
        return tree
    return tree.select(kept) if kept else None


def _add_bias(rows: torch.Tensor, bias: dict[int, float]) -> None:  # rows: [n, V], changed in place
    """One indexed add of a request's logit_bias to all its rows (a dict's keys are distinct); ids
    beyond the rows' width are skipped (a drafter's head may read fewer ids than the target)."""
    cols = torch.tensor(list(bias), dtype=torch.long, device=rows.device)
    vals = torch.tensor(list(bias.values()), dtype=rows.dtype, device=rows.device)
    keep = cols < rows.shape[1]
    rows[:, cols[keep]] += vals[keep][None]


def _ban(logits: torch.Tensor, rows: list[int], ids: torch.Tensor) -> None:  # logits: [N, V], changed in place
    """-inf at `ids` (those within the rows' width) in the given rows."""
    ids = ids[ids < logits.shape[1]].to(logits.device)
    if ids.numel():
        r = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[r[:, None], ids[None, :]] = float("-inf")


def _path_pairs(sr: ScheduledRequest) -> tuple[list[int], list[int]]:
    """(row, token) for every token on the path of every draft node's row: row 1 + i holds node i
    and its ancestors."""
    rows: list[int] = []
    toks: list[int] = []
    if sr.draft is None:
        return rows, toks
    paths: list[list[int]] = []
    for i, (tok, parent) in enumerate(zip(sr.draft.token_ids, sr.draft.parents)):
        path = (paths[parent] if parent >= 0 else []) + [tok]
        paths.append(path)
        rows += [1 + i] * len(path)
        toks += path
    return rows, toks
