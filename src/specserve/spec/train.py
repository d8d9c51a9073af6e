"""`specserve train-draft`: train a feature-level drafter head by self-distillation, on the CPU.

0. Budget: without --tokens, the run takes as many of the default tokens as this machine gets
   through in --budget-minutes (10), timed at its start (_fit_budget), and stops training there.
1. Corpus: text files (default: the Python standard library's own sources, which every Python
   install carries, so nothing is downloaded), split by file into train and held-out, tokenized
   and cut into sequences of `seq_len` tokens.
2. Features: the target's hidden states of every token (its own kernels, as when serving), kept
   as float16 shards in the work directory (a rerun skips shards it has). The conversations'
   come from the forwards that wrote them (the runner's hidden_sink); corpus text takes a pass.
3. Training (EAGLE): the head reads (f_i, x_{i+1}) and learns f_{i+1}: smooth-L1 on the feature
   plus cross-entropy against the target's own next-token distribution (its LM head on f_{i+1},
   over the head's vocabulary), for `depth` unrolled passes that feed the head its own predicted
   features as serving does (EAGLE-3's training-time test). AdamW, warm-up then cosine decay.
   Checkpoints every minute and at the end; a rerun resumes (more --tokens or --epochs extend).
4. Output: the head (safetensors), a JSON card (method, target fingerprint, tokens seen, held-out
   top-1 agreement per depth, timings) and a PNG of the loss and agreement curves.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.defaults import default_head_vocab
from specserve.errors import ConfigError
from specserve.files import output_dir, output_file
from specserve.spec.asks import chat_prompts
from specserve.spec.corpus import corpus_files

METHODS = ("eagle", "medusa", "mtp", "layerskip")
LAYERSKIP_TOKENS = 32_768  # default --tokens for an exit: a least-squares fit of hidden x hidden needs far fewer than a head
CHECKPOINT_EVERY_S = 60.0
# What a run writes in its work directory (--fresh deletes these and nothing else there).
WORK_FILES = ("conversations-*.json", "generated-*.json", "plan-*.json", "train-*.pt", "heldout-*.pt", "state-*.pt",
              "train-*.pt.tmp", "heldout-*.pt.tmp", "state-*.pt.tmp")
BAR_AGREEMENT_EVERY = 16  # optimizer steps between the progress bar's top-1 readings (an argmax over the vocabulary)
# SmolLM2-135M on a 2-vCPU Zen 5, 250k tokens at 3/4 conversations: 600 s (generation 3 min, features
# 1 min, 4 epochs 5.6 min); 220k keeps a fresh run inside 10 minutes.
DEFAULT_TOKENS = 220_000
# A run without --tokens fits this many minutes on the machine it runs on (issue 18's budget for a
# SmolLM2 head on two cores): where the default tokens would take longer (an AVX2-only CPU trains in
# float32, ~6x slower than with AVX512-BF16), fewer are taken, as measured there.
BUDGET_MINUTES = 10.0
# Batched greedy generation costs more per token than the mean of a full batch's decode step per
# request and a prefill's per token (half the tokens are prompts): the batch thins out as answers
# end, and every step pays the engine's own time (SmolLM2, Zen 5: 0.48-0.57 ms a token in two
# default runs, against 0.40-0.44 for that mean).
GENERATION_OVERHEAD = 1.45
BUDGET_USE = 0.9  # share of what is left of the budget that the planned work may take


@dataclass
class TrainConfig:
    """What `specserve train-draft` was asked for."""

    model: str
    method: str = "eagle"
    out: str | None = None  # default: the cache's head path for this target
    corpus: str | None = None  # a directory of text files; default: the Python standard library
    tokens: int | None = None  # training tokens to extract features for (default 220k; layerskip 32k)
    heldout_tokens: int = 8_192
    generated_share: float | None = None  # of --tokens: the target's own conversations (default 0.75, layerskip 0.5)
    generate_max_tokens: int = 256  # longest answer the target writes per conversation
    work_dir: str | None = None  # features, conversations, checkpoint (default: the cache)
    seq_len: int = 256
    epochs: float = 4.0  # SmolLM2 EAGLE, 150k tokens: held-out top-1 0.45 after 2, 0.50 after 5 (still rising)
    batch_tokens: int = 512  # per optimizer step: smaller steps learned more per second (SmolLM2: 0.43 vs 0.39 top-1 at 2048)
    lr: float = 1e-3
    depth: int | None = None  # eagle: unrolled passes per step (default 2); medusa: heads (default 3)
    # Cross-entropy against the target's distribution, beside the feature loss (weight 1). EAGLE's
    # 0.1 suits long runs; in a CPU budget 1.0 gave 0.39 held-out top-1 vs 0.25 (5.0: 0.39).
    ce_weight: float = 1.0
    noise: float = 0.05  # uniform noise on the input features (robustness to the head's own predictions)
    intermediate_size: int | None = None  # the head's MLP width (default: the target's)
    head_vocab: int | None = None  # the head's LM-head ids (default: see default_head_vocab)
    max_minutes: float | None = None  # stop (resumable) after this much wall time
    # Without --tokens: the tokens are cut, as measured on this machine, so that the run fits this
    # many minutes (and training stops there); None or 0: the default tokens whatever they take.
    budget_minutes: float | None = BUDGET_MINUTES
    fresh: bool = False  # ignore a previous run's features and checkpoint
    seed: int = 0
    quantization: str | None = None  # the target's precision (default: as served)
    threads: int | None = None
    layers: int | None = None  # layerskip: the exit layer (default: the best of several candidates)
    # eagle: target layers whose residual streams the head fuses beside the last hidden state
    # (EAGLE-3); None: default_feature_layers, () for the last hidden state alone.
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.tokens_asked = self.tokens is not None  # (a budget cuts only the default)
        if self.tokens is None:
            self.tokens = LAYERSKIP_TOKENS if self.method == "layerskip" else DEFAULT_TOKENS
        if self.generated_share is None:  # (layerskip keeps the share its measured exits were fitted on)
            self.generated_share = 0.5 if self.method == "layerskip" else 0.75


@dataclass
class _History:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_acc: list[list[float]] = field(default_factory=list)  # per depth


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low and middle features: after the 2nd layer and after half the stack."""
    return tuple(sorted({i for i in (2, num_layers // 2) if 0 < i < num_layers}))


def _generated_sequences(llm, files: list[Path], want: int, seq_len: int, seed: int, work: Path,  # noqa: ANN001
                         max_tokens: int, held: bool = False, runner=None,  # noqa: ANN001 - ModelRunner
                         ) -> tuple[list[list[int]], list[list[bool]], list[torch.Tensor | None]]:
    """Conversations the target writes itself (greedy, as most serving is), chat template and
    all, concatenated and cut into seq_len windows, per token whether the target wrote it (an
    answer token, not the template or the ask), and per window the target's features where the
    writing already computed them (with `runner`, whose feature layers are set: its forwards over
    every prompt and answer token are the features a separate pass would compute, so that pass
    is skipped for them), else None. A conversation's last token is never fed, so it has no
    feature and is left out. The stream is kept in work/ so a rerun does not regenerate (its
    features then come from the shards, or from a pass over the stream)."""
    from specserve import SamplingParams

    # (The older generated-*.json files hold conversations from other asks and no answer marks.)
    path = work / f"conversations-{'held' if held else 'train'}-{seed}.json"
    stream: list[int] = []
    answer: list[bool] = []
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            stream, answer = list(saved["ids"]), [bool(a) for a in saved["answer"]]
        except (ValueError, KeyError, TypeError):
            stream, answer = [], []
        if len(answer) != len(stream):
            stream, answer = [], []
    feats: list[tuple[int, torch.Tensor]] = []  # (stream offset, rows) of what this run wrote
    rounds = 0
    while len(stream) < want and rounds < 8:  # a conversation's length is known only once written
        n = max(4, -(-(want - len(stream)) // max_tokens))  # prompt + answer: about max_tokens or more each
        prompts = chat_prompts(files, n, seed + 7919 * rounds + len(stream), held)
        with _captured_rows(runner) as rows:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                            SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=True)
        for o in outs:
            ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1]
            buf = rows.pop(o.request_id, None) if runner is not None else None
            got = buf.take(len(ids)) if buf is not None else None
            if got is not None:
                feats.append((len(stream), got))
            stream += ids
            answer += [False] * len(o.prompt_token_ids) + [True] * (len(ids) - len(o.prompt_token_ids))
        path.write_text(json.dumps({"ids": stream, "answer": [int(a) for a in answer]}))
        rounds += 1
    if rounds:  # what the older files held is rewritten here
        for old in work.glob("generated-*.json"):
            old.unlink(missing_ok=True)
    usable = min(len(stream), want) // seq_len * seq_len
    cuts = range(0, usable, seq_len)
    starts = [off for off, _ in feats]
    return ([stream[i : i + seq_len] for i in cuts], [answer[i : i + seq_len] for i in cuts],
            [_window(feats, starts, i, seq_len) for i in cuts])


class _RowBuffer:
    """One request's captured feature rows by position, float16, in one buffer that doubles as
    it fills. (Keeping each step's rows as a tensor of their own -- one or a few rows each, tens
    of thousands per round -- grew the process by ~30 MB per SmolLM2 conversation, ~20x their
    size: the allocator's heap fragmented between the step's large temporaries, and the default
    run's 1,290-conversation round was killed for memory.)"""

    __slots__ = ("rows", "have")

    def __init__(self, width: int, capacity: int = 256) -> None:
        self.rows = torch.empty(capacity, width, dtype=torch.float16)
        self.have = torch.zeros(capacity, dtype=torch.bool)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start.. (a later write wins where a recomputation after preemption
        repeats positions)."""
        end = start + len(rows)
        if end > len(self.rows):
            size = max(end, 2 * len(self.rows))
            grown = torch.empty(size, self.rows.shape[1], dtype=torch.float16)
            grown[: len(self.rows)] = self.rows
            have = torch.zeros(size, dtype=torch.bool)
            have[: len(self.have)] = self.have
            self.rows, self.have = grown, have
        self.rows[start:end] = rows
        self.have[start:end] = True

    def take(self, n: int) -> torch.Tensor | None:
        """Positions 0..n-1 (a copy of just those rows), or None if any is missing."""
        if n > len(self.rows) or not bool(self.have[:n].all()):
            return None
        return self.rows[:n].clone()


@contextmanager
def _captured_rows(runner) -> Iterator[dict[str, _RowBuffer]]:  # noqa: ANN001 - ModelRunner or None
    """While the block runs, every hidden-state row `runner`'s forwards compute, per request:
    {request id: _RowBuffer} (nothing without a runner)."""
    rows: dict[str, _RowBuffer] = {}
    if runner is None:
        yield rows
        return

    def sink(rid: str, hidden) -> None:  # noqa: ANN001 - HiddenRows
        buf = rows.get(rid)
        if buf is None:
            buf = rows[rid] = _RowBuffer(hidden.rows.shape[-1])
        buf.write(hidden.start_pos, hidden.rows)

    runner.capture_hidden, runner.hidden_sink = True, sink
    try:
        yield rows
    finally:
        runner.capture_hidden, runner.hidden_sink = False, None


def _window(feats: list[tuple[int, torch.Tensor]], starts: list[int], start: int, length: int) -> torch.Tensor | None:
    """Features of stream[start : start + length] if the conversations written here cover it
    (`feats` in stream order, `starts` their offsets)."""
    i = bisect.bisect_right(starts, start) - 1
    parts, at, end = [], start, start + length
    while 0 <= i < len(feats) and at < end:
        off, rows = feats[i]
        if not off <= at < off + len(rows):  # a conversation without features, or none at all
            return None
        parts.append(rows[at - off : end - off])
        at += len(parts[-1])
        i += 1
    if at < end:
        return None
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def split_files(files: list[Path], seed: int) -> tuple[list[Path], list[Path]]:
    """(train, held-out): every 20th file of a seeded shuffle is held out, never trained on."""
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    held = {i for n, i in enumerate(order) if n % 20 == 0}
    return [f for i, f in enumerate(files) if i not in held], [f for i, f in enumerate(files) if i in held]


def _sequences(files: list[Path], encode, seq_len: int, want: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    """Sequences of seq_len tokens from the files (in a seeded order) until `want` tokens."""
    files = list(files)
    random.Random(seed).shuffle(files)
    out: list[list[int]] = []
    have = 0
    for path in files:
        if have >= want:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = encode(text)
        for s in range(0, len(ids) - seq_len + 1, seq_len):
            out.append(ids[s : s + seq_len])
            have += seq_len
            if have >= want:
                break
    return out


class _Extractor:
    """Runs the target over sequences and returns its hidden states (float16)."""

    def __init__(self, engine) -> None:  # noqa: ANN001 - LLMEngine
        self.engine = engine
        self.runner = engine.runner

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> torch.Tensor:  # [n, S, H] float16
        with _owned_entries(self.engine, seqs) as entries:
            h = self.runner.hidden_states(entries)
        return h.view(len(seqs), len(seqs[0]), -1).half()


@contextmanager
def _owned_entries(engine, seqs: list[list[int]]) -> Iterator[list]:  # noqa: ANN001 - LLMEngine
    """Feed entries of whole sequences over blocks taken from the engine's pool for the duration
    (every block back afterwards, also when the pool runs out part-way)."""
    from specserve.engine.runner import FeedEntry

    kv = engine.kv_manager
    owners, entries = [], []
    try:
        for j, ids in enumerate(seqs):
            owner = _Owner(f"train-draft-{j}", len(ids))
            if not kv.allocate_slots(owner, len(ids)):
                raise RuntimeError("the KV pool cannot hold a training batch; lower --batch-tokens")
            owners.append(owner)
            entries.append(FeedEntry(ids, list(range(len(ids))), 0, kv.block_ids(owner.request_id), None, []))
        yield entries
    finally:
        for o in owners:
            kv.free(o)


def _save_atomic(obj: object, path: Path) -> None:
    """torch.save through a temporary file, so a crash never leaves a torn file at `path`."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


class _Owner:
    """A stand-in request that owns the blocks of one extraction sequence."""

    def __init__(self, rid: str, n: int) -> None:
        self.request_id = rid
        self.all_token_ids = [0] * n
        self.num_computed_tokens = 0


def _bar(total: int, desc: str, unit: str):  # noqa: ANN202
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True)


def _extract(cfg: TrainConfig, engine, seqs: list[list[int]], work: Path, name: str,  # noqa: ANN001
             known: dict[int, torch.Tensor] | None = None) -> list[Path]:
    """Feature shards of `seqs` under work/ (name-NNNNN.pt, name-fA-B-NNNNN.pt with the runner's
    feature layers A, B), reusing those already there; `known` gives the features of sequences
    (by index) that need no pass of their own."""
    layers = engine.runner.feature_layers
    known = known or {}
    if layers:
        name = f"{name}-f{'-'.join(map(str, layers))}"
    per_batch = max(1, cfg.batch_tokens // cfg.seq_len)
    shard_seqs = per_batch * 8
    paths = []
    ex = _Extractor(engine)
    todo = []
    for k in range(0, len(seqs), shard_seqs):
        path = work / f"{name}-{k // shard_seqs:05d}.pt"
        paths.append(path)
        chunk = seqs[k : k + shard_seqs]
        if path.is_file():
            try:
                old = torch.load(path, weights_only=True)
                if old["tokens"].tolist() == chunk:
                    continue
            except Exception:  # noqa: BLE001 - a torn shard is redone
                pass
        todo.append((path, k, chunk))
    if not todo:
        return paths
    missing = sum(k + j not in known for _, k, c in todo for j in range(len(c)))
    bar = _bar(missing * cfg.seq_len, f"target features ({name})", "tok")
    for path, k, chunk in todo:
        rows = [known.get(k + j) for j in range(len(chunk))]
        need = [j for j, r in enumerate(rows) if r is None]
        for b in range(0, len(need), per_batch):
            idx = need[b : b + per_batch]
            for j, r in zip(idx, ex([chunk[j] for j in idx])):
                rows[j] = r
            bar.update(len(idx) * cfg.seq_len)
        _save_atomic({"tokens": torch.tensor(chunk, dtype=torch.int32), "feats": torch.stack(rows)}, path)
    bar.close()
    return paths


def _load_shards(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    toks, feats = [], []
    for p in paths:
        d = torch.load(p, weights_only=True)
        toks.append(d["tokens"].long())
        feats.append(d["feats"])
    return torch.cat(toks), torch.cat(feats)


class _Frozen:
    """The target's pieces the head trains against: embedding and the head's LM-head rows."""

    def __init__(self, engine, token_ids: torch.Tensor) -> None:  # noqa: ANN001
        model = engine.runner.model
        self.embed = model.model.embed_tokens.weight.detach().float()
        from specserve.spec.eagle import float_rows

        self.head_w = float_rows(model.lm_head, token_ids)  # [Vh, H]
        self.token_ids = token_ids
        self.feat_rms = 1.0  # the training features' root mean square (set once they are loaded)
        self._w_as: dict[torch.dtype, torch.Tensor] = {torch.float32: self.head_w}

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] @ the head's LM-head rows: one 2-D product (a 3-D one is a batched product
        over a broadcast copy of the weight) with the weight kept in autocast's dtype (autocast
        would otherwise cast the 16k-row weight again at every use: a sixth of a step's time)."""
        dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        w = self._w_as.get(dt)
        if w is None:
            w = self._w_as[dt] = self.head_w.to(dt)
        return (h.reshape(-1, h.shape[-1]).to(dt) @ w.T).reshape(*h.shape[:-1], w.shape[0])


def _top1(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (max's indices: bf16 argmax runs ~6x slower on the CPU)."""
    return x.max(-1).indices


def _eagle_losses(head, frozen: _Frozen, toks: torch.Tensor, feats: torch.Tensor, cos, sin, depth: int,  # noqa: ANN001
                  noise: float, ce_weight: float, feature_weight: float = 1.0,
                  scored: torch.Tensor | None = None, agree: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """EAGLE's loss over a batch [B, S] and the top-1 agreement with the target per depth, as
    (agreeing, counted) predictions (MTP's with feature_weight 0: cross-entropy alone, through the
    module's own readout norm). `scored` [B, S]: which of the target's predictions to count (see
    _agreement); without `agree` no agreement is counted (an empty list: the argmax over the
    vocabulary costs a tenth of an optimizer step).

    The feature loss is taken on features divided by their RMS over the training set: a target
    whose hidden states are large (Qwen2.5's after the final norm: ~10x SmolLM2's) would
    otherwise drown the cross-entropy that decides which token the head proposes."""
    f = feats.float()  # [B, S, hidden * (feature layers + 1)]: the last hidden state last
    emb = frozen.embed[toks[:, 1:]]  # x_{i+1} for i = 0 .. S-2
    inp = head.target_feature(f[:, :-1])
    if noise > 0:
        inp = inp + (torch.rand_like(inp) - 0.5) * (2 * noise)
    target = f[:, 1:, -frozen.embed.shape[1] :]  # f_{i+1}
    outs = head.forward_unrolled(emb, inp, cos[: emb.shape[1]], sin[: emb.shape[1]], depth)
    with torch.no_grad():
        p = torch.softmax(frozen.logits(target), dim=-1)
        want = _top1(p) if agree else None
    total = torch.zeros(())
    accs = []
    for d, h in enumerate(outs, start=1):
        sl = slice(d - 1, None)  # rows whose path starts inside the sequence
        hd, td = h[:, sl], target[:, sl]
        reg = F.smooth_l1_loss(hd / frozen.feat_rms, td / frozen.feat_rms) if feature_weight else 0.0
        logq = torch.log_softmax(frozen.logits(head.readout(hd)), dim=-1)
        ce = -(p[:, sl] * logq).sum(-1).mean()
        total = total + (0.8 ** (d - 1)) * (feature_weight * reg + ce_weight * ce)
        if want is not None:
            accs.append(_agreement(_top1(logq.detach()), want[:, sl], None if scored is None else scored[:, 1:][:, sl]))
    return total, accs


def _agreement(pred: torch.Tensor, want: torch.Tensor, scored: torch.Tensor | None) -> tuple[int, int]:
    """(agreeing, counted) of the head's top-1 `pred` and the target's `want` over the rows
    `scored` marks (all when None): held-out conversations count only the target's predictions of
    its own answers, not of the chat template and the ask (the same few templates in every
    conversation: SmolLM2's default head agrees on 0.49 of the held-out conversations' tokens but
    on 0.43 of their answers)."""
    hit = pred == want
    if scored is None:
        return int(hit.sum()), hit.numel()
    return int((hit & scored).sum()), int(scored.sum())


def _medusa_losses(heads, frozen: _Frozen, feats: torch.Tensor,  # noqa: ANN001
                   scored: torch.Tensor | None = None, agree: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Medusa's loss: head d on f_t against the target's distribution of x_{t+1+d} (its LM head on
    f_{t+d}); top-1 agreement per head, as _eagle_losses gives it."""
    f = feats.float()
    s = f.shape[1]
    with torch.no_grad():
        p_all = torch.softmax(frozen.logits(f), dim=-1)
        want_all = _top1(p_all) if agree else None
    total = torch.zeros(())
    accs = []
    for d, head in enumerate(heads.heads, start=1):
        logq = torch.log_softmax(frozen.logits(head(f[:, : s - d])), dim=-1)
        total = total + (0.8 ** (d - 1)) * -(p_all[:, d:] * logq).sum(-1).mean()
        if want_all is not None:
            accs.append(_agreement(_top1(logq.detach()), want_all[:, d:], None if scored is None else scored[:, d:]))
    return total, accs


class _EagleTrainer:
    """EAGLE's head, its loss and what its card and checkpoint record."""

    def __init__(self, cfg: TrainConfig, arch, frozen: _Frozen) -> None:  # noqa: ANN001
        from specserve.engine.runner import ROPE_SLACK
        from specserve.models.llama import RotaryEmbedding
        from specserve.spec.eagle import EagleHead, head_arch

        self.cfg, self.frozen = cfg, frozen
        self.depth = cfg.depth or 2
        self.arch = head_arch(arch, cfg.intermediate_size)
        self.feature_layers = tuple(cfg.feature_layers or ())
        self.module = EagleHead(self.arch, self.feature_layers)
        rope = RotaryEmbedding(self.arch.head_dim, self.arch.rope_theta, cfg.seq_len + ROPE_SLACK)
        self.cos, self.sin = rope.cos, rope.sin

    def losses(self, toks: torch.Tensor, feats: torch.Tensor, noise: float,
               scored: torch.Tensor | None = None, agree: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        return _eagle_losses(self.module, self.frozen, toks, feats, self.cos, self.sin, self.depth, noise,
                             self.cfg.ce_weight, scored=scored, agree=agree)

    def ident(self) -> dict:
        return {"arch": asdict(self.arch), "depth": self.depth, "ce_weight": self.cfg.ce_weight,
                "feature_layers": list(self.feature_layers)}

    def card(self) -> dict:
        return {"intermediate_size": self.arch.intermediate_size, "depth": self.depth,
                "feature_layers": list(self.feature_layers)}


class _MTPTrainer(_EagleTrainer):
    """DeepSeek-V3's MTP module (spec/eagle.py MTPModule): EAGLE's unrolled training, CE alone."""

    def __init__(self, cfg: TrainConfig, arch, frozen: _Frozen) -> None:  # noqa: ANN001
        from specserve.spec.eagle import MTPModule

        super().__init__(cfg, arch, frozen)
        self.module = MTPModule(self.arch)

    def losses(self, toks: torch.Tensor, feats: torch.Tensor, noise: float,
               scored: torch.Tensor | None = None, agree: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        return _eagle_losses(self.module, self.frozen, toks, feats, self.cos, self.sin, self.depth, noise,
                             1.0, feature_weight=0.0, scored=scored, agree=agree)

    def ident(self) -> dict:
        return {"arch": asdict(self.arch), "depth": self.depth, "objective": "ce"}


class _MedusaTrainer:
    """Medusa's heads (one per depth) and their loss."""

    def __init__(self, cfg: TrainConfig, arch, frozen: _Frozen) -> None:  # noqa: ANN001
        from specserve.spec.medusa import MedusaHeads

        self.frozen = frozen
        self.depth = cfg.depth or 3
        self.module = MedusaHeads(arch.hidden_size, self.depth)

    def losses(self, toks: torch.Tensor, feats: torch.Tensor, noise: float,
               scored: torch.Tensor | None = None, agree: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        del toks, noise  # a Medusa head reads the feature alone, never a fed prediction
        return _medusa_losses(self.module, self.frozen, feats, scored, agree)

    def ident(self) -> dict:
        return {"num_heads": self.depth}

    def card(self) -> dict:
        return {"num_heads": self.depth, "depth": self.depth}


TRAINERS = {"eagle": _EagleTrainer, "medusa": _MedusaTrainer, "mtp": _MTPTrainer}


def _fast_dtype(hidden: int, vocab: int) -> torch.dtype:
    """bfloat16 where this CPU multiplies it faster than float32 (AVX512-BF16 / AMX: 2x and more),
    else float32 (an AVX2-only CPU emulates bfloat16): timed, not guessed."""
    a32, w32 = torch.randn(512, hidden), torch.randn(min(vocab, 8192), hidden)
    best = {}
    for dt in (torch.float32, torch.bfloat16):
        a, w = a32.to(dt), w32.to(dt)
        a @ w.T
        t0 = time.perf_counter()
        for _ in range(3):
            a @ w.T
        best[dt] = time.perf_counter() - t0
    return torch.bfloat16 if best[torch.bfloat16] < 0.7 * best[torch.float32] else torch.float32


def _features(cfg: TrainConfig, llm, work: Path) -> tuple[list[Path], list[Path], int, list[list[bool]]]:  # noqa: ANN001 - LLM
    """Feature shards (train, held-out) of corpus text and of the target's own conversations,
    reusing whatever an earlier run left in `work`, how many held-out sequences (the first) are
    corpus text, and the held-out answer marks. The conversations' features are kept as the
    target writes them (no second pass over them)."""
    train, held = _training_sequences(cfg, llm, work, capture=True)
    return (_extract(cfg, llm.engine, train.seqs, work, "train", train.known),
            _extract(cfg, llm.engine, held.seqs, work, "heldout", held.known), held.num_corpus, held.answers)


@dataclass
class _Sequences:
    """Token sequences to train or evaluate on: corpus text first, then the target's conversations."""

    seqs: list[list[int]]
    answers: list[list[bool]]  # per token: corpus text or an answer the target wrote (what is scored)
    num_corpus: int  # the first num_corpus sequences are corpus text
    known: dict[int, torch.Tensor]  # features computed while the target wrote them, by sequence index


def _training_sequences(cfg: TrainConfig, llm, work: Path, capture: bool = False) -> tuple[_Sequences, _Sequences]:  # noqa: ANN001
    """(train, held-out): corpus text split by file and the target's own conversations
    (generated once, kept in `work`; with `capture`, their features kept as they are written)."""
    tok = llm.engine.tokenizer
    files = corpus_files(cfg.corpus)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    n_gen = int(cfg.tokens * cfg.generated_share)
    train_files, held_files = split_files(files, cfg.seed)
    if not held_files or not train_files:
        raise ConfigError(f"The corpus needs at least 2 files (train and held-out); it has {len(files)}.")
    n_held_text = cfg.heldout_tokens - (cfg.heldout_tokens // 2 if n_gen else 0)
    runner = llm.engine.runner if capture else None
    out = []
    for files_, want_text, want_gen, seed, held in ((train_files, cfg.tokens - n_gen, n_gen, cfg.seed, False),
                                                    (held_files, n_held_text, cfg.heldout_tokens // 2, cfg.seed + 1000, True)):
        seqs = _sequences(files_, encode, cfg.seq_len, want_text, cfg.seed)
        part = _Sequences(seqs, [[True] * len(x) for x in seqs], len(seqs), {})
        if n_gen:
            gen, answers, feats = _generated_sequences(llm, files_, want_gen, cfg.seq_len, seed, work,
                                                       cfg.generate_max_tokens, held=held, runner=runner)
            part.known = {part.num_corpus + j: f for j, f in enumerate(feats) if f is not None}
            part.seqs += gen
            part.answers += answers
        out.append(part)
    train, held = out
    if not train.seqs or not held.seqs:
        raise ConfigError(f"The corpus has too little text for --seq-len {cfg.seq_len} (train {len(train.seqs)}, "
                          f"held-out {len(held.seqs)} sequences).")
    return train, held


@dataclass
class Rates:
    """Seconds per token of a run's phases on this machine (measured by _measure_rates)."""

    generate: float  # a conversation token the target writes (prompt and answer)
    extract: float  # a corpus token's feature pass
    train: float  # a training token, one epoch


def budget_tokens(cfg: TrainConfig, rates: Rates, seconds_left: float) -> int:
    """The most training tokens (whole sequences, at most cfg.tokens) whose generation, features,
    training epochs and held-out evaluations fit `seconds_left`; at least one optimizer step's
    worth, so a run on a very slow machine still writes a head (it can be resumed for more)."""
    share = cfg.generated_share
    per_token = share * rates.generate + (1 - share) * rates.extract + cfg.epochs * rates.train
    held = cfg.heldout_tokens
    # held-out text (half conversations), then ~11 evaluations of it, forward only (~1/3 of a step)
    fixed = held * (rates.generate + rates.extract) / 2 + 11 * held * rates.train / 3
    n = int(max(0.0, seconds_left - fixed) / per_token)
    floor = max(cfg.batch_tokens, cfg.seq_len)
    return max(floor, min(cfg.tokens, n)) // cfg.seq_len * cfg.seq_len


def _measure_rates(cfg: TrainConfig, llm, frozen: _Frozen, layers: tuple[int, ...]) -> Rates:  # noqa: ANN001
    """Time, on this machine, a feature pass over one batch, a batched decode step and two
    optimizer steps of the head on random data, against the run's own frozen target pieces (the
    global random state is left as it was)."""
    engine = llm.engine
    runner = engine.runner
    arch = engine.arch
    per_batch = max(1, cfg.batch_tokens // cfg.seq_len)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed + 1)
        seqs = torch.randint(0, arch.vocab_size, (per_batch, cfg.seq_len)).tolist()
        ex = _Extractor(engine)
        ex(seqs)  # warm-up
        t0 = time.perf_counter()
        ex(seqs)
        extract = (time.perf_counter() - t0) / (per_batch * cfg.seq_len)
        batch = max(1, min(64, engine.config.scheduler.max_num_seqs))
        step = runner.time_decode_step(batch, context=cfg.generate_max_tokens) / batch
        if not math.isfinite(step):  # a pool too small for the batch: a decode token as dear as 3 prompt tokens
            step = 3 * extract
        generate = GENERATION_OVERHEAD * (step + extract) / 2  # about as many prompt tokens as answer tokens
        trainer = TRAINERS[cfg.method](replace(cfg, feature_layers=layers if cfg.method == "eagle" else ()), arch, frozen)
        width = arch.hidden_size * ((len(layers) + 1) if cfg.method == "eagle" else 1)
        toks = torch.randint(0, arch.vocab_size, (per_batch, cfg.seq_len))
        feats = torch.randn(per_batch, cfg.seq_len, width).half()
        opt = torch.optim.AdamW(trainer.module.parameters(), lr=1e-4)
        amp = _fast_dtype(arch.hidden_size, len(frozen.token_ids))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=amp, enabled=amp != torch.float32):
                loss, _ = trainer.losses(toks, feats, cfg.noise, agree=False)  # as training's steps mostly run
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    return Rates(generate, extract, min(times[1:]) / (per_batch * cfg.seq_len))


def _fit_budget(cfg: TrainConfig, llm, work: Path, frozen: _Frozen | None, layers: tuple[int, ...],  # noqa: ANN001
                t_start: float) -> TrainConfig:
    """cfg with its tokens cut to what fits cfg.budget_minutes on this machine (and training
    stopping there), when --tokens was not given. The plan is kept in `work`, so a rerun (a
    resume) trains on the same tokens."""
    if cfg.tokens_asked or not cfg.budget_minutes:
        return cfg
    budget_s = 60 * cfg.budget_minutes
    # One plan per work directory and seed, whatever the method: eagle, medusa and mtp then share the
    # conversations and feature shards (a method with cheaper steps just finishes sooner).
    path = work / f"plan-{cfg.seed}.json"
    saved = None
    with contextlib.suppress(OSError, ValueError, TypeError):
        saved = json.loads(path.read_text())
    if isinstance(saved, dict) and saved.get("budget_minutes") == cfg.budget_minutes and saved.get("default") == cfg.tokens:
        tokens = int(saved["tokens"])
    else:
        rates = _measure_rates(cfg, llm, frozen, layers)
        # A tenth kept back for what the rates leave out (loading the shards, checkpoints, the card):
        # a 3-minute budget on the Zen 5 planned on all of it stopped at 681 of 784 steps.
        tokens = budget_tokens(cfg, rates, BUDGET_USE * (budget_s - (time.perf_counter() - t_start)))
        path.write_text(json.dumps({"budget_minutes": cfg.budget_minutes, "default": cfg.tokens, "tokens": tokens,
                                    "rates_s_per_token": asdict(rates)}) + "\n")
    if tokens < cfg.tokens // cfg.seq_len * cfg.seq_len:  # (whole sequences: the default's own are 219,904)
        print(f"train-draft: {tokens:,} training tokens of the default {cfg.tokens:,}, to fit the "
              f"{cfg.budget_minutes:g}-minute budget on this machine (--tokens {cfg.tokens} for the full run, "
              f"--budget-minutes 0 to lift the budget; a rerun resumes)", file=sys.stderr, flush=True)
    limit = cfg.budget_minutes if cfg.max_minutes is None else min(cfg.max_minutes, cfg.budget_minutes)
    return replace(cfg, tokens=tokens, max_minutes=limit)


def _check_before_loading(cfg: TrainConfig) -> None:
    """Refuse what would fail later, before the target loads, the machine is timed or the work
    directory is made (a missing corpus used to fail after both and leave the directory behind)."""
    checks = (
        (cfg.heldout_tokens >= cfg.seq_len, f"--heldout-tokens must cover one --seq-len sequence, got {cfg.heldout_tokens}"),
        (0.0 <= cfg.generated_share <= 1.0, f"--generated-share must lie in [0, 1], got {cfg.generated_share}"),
        (math.isfinite(cfg.epochs) and cfg.epochs > 0, f"--epochs must be > 0, got {cfg.epochs}"),
        (cfg.batch_tokens >= cfg.seq_len, f"--batch-tokens must hold one --seq-len sequence, got {cfg.batch_tokens}"),
        (math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}"),
        (cfg.depth is None or cfg.depth >= 1, f"--depth must be >= 1, got {cfg.depth}"),
        (cfg.intermediate_size is None or cfg.intermediate_size >= 1,
         f"--intermediate-size must be >= 1, got {cfg.intermediate_size}"),
        (cfg.head_vocab is None or cfg.head_vocab >= 2, f"--head-vocab must be >= 2, got {cfg.head_vocab}"),
        (cfg.max_minutes is None or cfg.max_minutes > 0, f"--max-minutes must be > 0, got {cfg.max_minutes}"),
        (cfg.threads is None or cfg.threads >= 1, f"--threads must be >= 1, got {cfg.threads}"),
        (cfg.layers is None or cfg.layers >= 1, f"--layers must be >= 1, got {cfg.layers}"),
    )
    for ok, message in checks:
        if not ok:
            raise ConfigError(message + ".")
    corpus_files(cfg.corpus)  # it must be there (its held-out part is read whatever the share)
    if cfg.out is not None:  # (tried by writing: os.access says yes to root where nothing can be written)
        output_file(cfg.out, "--out")
    if cfg.work_dir is not None:
        output_dir(cfg.work_dir, "--work-dir")


def train_draft(cfg: TrainConfig) -> dict:
    """Train (or resume) a head for cfg.model; returns its card."""
    from specserve import LLM
    from specserve.models.block_linear import embedding_rows
    from specserve.models.bundled import cache_dir
    from specserve.spec.eagle import FINGERPRINT_ROWS, default_head_path, target_fingerprints

    if cfg.method not in METHODS:
        raise ConfigError(f"--method {cfg.method!r} is not trainable here; use one of {', '.join(METHODS)}.")
    if cfg.seq_len < 16 or cfg.tokens < cfg.seq_len:
        raise ConfigError("--tokens must cover at least one sequence of --seq-len (>= 16) tokens.")
    if cfg.budget_minutes is not None and not cfg.budget_minutes >= 0:
        raise ConfigError(f"--budget-minutes must be >= 0 (0: no budget), got {cfg.budget_minutes}.")
    _check_before_loading(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    # No prefix cache: the conversations' features are taken from the forwards that write them, so
    # every token of every prompt is computed (the shared chat template is a few dozen tokens).
    llm = LLM(cfg.model, spec_method="none", quantization=cfg.quantization, max_model_len=max(cfg.seq_len, 2048),
              max_num_batched_tokens=max(cfg.batch_tokens, cfg.seq_len), enable_prefix_caching=False)
    engine = llm.engine
    tok = engine.tokenizer
    if tok is None:
        raise ConfigError(f"{cfg.model} has no tokenizer; train-draft tokenizes a text corpus.")
    arch = engine.arch
    fp = target_fingerprints(arch, tok.fingerprint(), embedding_rows(engine.runner.model.model.embed_tokens, FINGERPRINT_ROWS))[0]
    out = Path(cfg.out).expanduser() if cfg.out else default_head_path(fp, cfg.method)
    if cfg.method != "layerskip":  # (checked against the target before anything is written)
        layers = default_feature_layers(arch.num_layers) if cfg.feature_layers is None else tuple(cfg.feature_layers)
        engine.runner.feature_layers = layers
    # Features and conversations are the target's, shared by every method; checkpoints are per method.
    work = Path(cfg.work_dir).expanduser() if cfg.work_dir else cache_dir() / "train" / fp
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / f"state-{cfg.method}.pt"
    if cfg.fresh:  # what this command wrote there, not whatever else a --work-dir holds
        for pattern in WORK_FILES:
            for p in work.glob(pattern):
                p.unlink(missing_ok=True)

    from specserve.spec.factory import frequent_token_subset

    head_vocab = cfg.head_vocab or default_head_vocab(arch.vocab_size)
    token_ids = frequent_token_subset(tok, arch.vocab_size, head_vocab)

    if cfg.method == "layerskip":
        return _fit_exit(cfg, llm, work, fp, out, token_ids, t_start)
    # Features are extracted with EAGLE's fusion layers whatever the method (one set of shards
    # serves every method; the others read the last hidden state alone): `layers`, set above.
    # The target's embedding and LM-head rows the head trains against (the budget's timing uses them too).
    frozen = _Frozen(engine, token_ids)
    cfg = _fit_budget(cfg, llm, work, frozen, layers, t_start)
    cfg = replace(cfg, feature_layers=layers if cfg.method == "eagle" else ())
    t0 = time.perf_counter()
    train_paths, held_paths, held_corpus, held_answers = _features(cfg, llm, work)
    extract_s = time.perf_counter() - t0
    toks, feats = _load_shards(train_paths)
    htoks, hfeats = _load_shards(held_paths)
    if not cfg.feature_layers and layers:
        feats, hfeats = feats[..., -arch.hidden_size :].contiguous(), hfeats[..., -arch.hidden_size :].contiguous()
    frozen.feat_rms = float(feats[:64, :, -arch.hidden_size :].float().pow(2).mean().sqrt())
    inside = float(torch.isin(htoks[:, 1:], token_ids).float().mean())  # held-out text the head can draft

    trainer = TRAINERS[cfg.method](cfg, arch, frozen)
    head = trainer.module
    per_step = max(1, cfg.batch_tokens // cfg.seq_len)
    steps_per_epoch = max(1, len(toks) // per_step)
    total_steps = max(1, int(cfg.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, min(100, total_steps // 20))

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm)))))

    amp = _fast_dtype(arch.hidden_size, head_vocab)
    hist = _History()
    step = 0
    train_s = 0.0
    ident = {"method": cfg.method, "vocab": head_vocab, "seq_len": cfg.seq_len, "lr": cfg.lr, **trainer.ident()}
    if state_path.is_file() and not cfg.fresh:
        st = torch.load(state_path, weights_only=False)
        if st.get("ident") == ident:
            head.load_state_dict(st["head"])
            opt.load_state_dict(st["opt"])
            step, train_s = st["step"], st["train_s"]
            hist = _History(**st["hist"])

    # The target's prediction at j (of x_{j+1}) is scored where x_{j+1} is corpus text or an answer.
    answers = torch.tensor(held_answers, dtype=torch.bool)
    hscored = torch.cat((answers[:, 1:], answers[:, -1:]), dim=1)

    def evaluate(rows: slice = slice(None)) -> list[float]:
        """Held-out top-1 agreement by depth over held-out sequences `rows` (all by default)."""
        head.eval()
        hits, counted = [0] * trainer.depth, [0] * trainer.depth
        ht, hf, hs = htoks[rows], hfeats[rows], hscored[rows]
        with torch.no_grad():
            for b in range(0, len(ht), per_step):
                with torch.autocast("cpu", dtype=amp, enabled=amp != torch.float32):
                    _, a = trainer.losses(ht[b : b + per_step], hf[b : b + per_step], 0.0, hs[b : b + per_step])
                for d, (h, n) in enumerate(a):
                    hits[d] += h
                    counted[d] += n
        head.train()
        return [h / max(n, 1) for h, n in zip(hits, counted)]

    def save_state() -> None:
        _save_atomic({"ident": ident, "head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                      "train_s": train_s, "hist": asdict(hist)}, state_path)

    deadline = None if cfg.max_minutes is None else t_start + 60 * cfg.max_minutes
    perm: torch.Tensor | None = None
    head.train()
    bar = _bar(total_steps, f"training {cfg.method} head", "step")
    bar.update(step)
    last_ckpt = time.perf_counter()
    top1: float | None = None  # the training batch's agreement at depth 1, as the bar shows it
    eval_every = max(1, total_steps // 10)
    while step < total_steps:
        if deadline is not None and time.perf_counter() > deadline:
            break
        ts = time.perf_counter()
        epoch_pos = step % steps_per_epoch
        if epoch_pos == 0 or perm is None:
            perm = torch.randperm(len(toks), generator=torch.Generator().manual_seed(cfg.seed + step // steps_per_epoch))
        idx = perm[epoch_pos * per_step : (epoch_pos + 1) * per_step]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=amp, enabled=amp != torch.float32):
            loss, accs = trainer.losses(toks[idx], feats[idx], cfg.noise, agree=top1 is None or step % BAR_AGREEMENT_EVERY == 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        train_s += time.perf_counter() - ts
        hist.steps.append(step)
        hist.loss.append(float(loss.detach()))
        if accs:
            top1 = accs[0][0] / max(accs[0][1], 1)
        bar.set_postfix(loss=f"{hist.loss[-1]:.3f}", top1=f"{top1:.2f}")
        bar.update(1)
        if step % eval_every == 0 or step == total_steps:
            hist.eval_steps.append(step)
            hist.eval_acc.append(evaluate())
        if time.perf_counter() - last_ckpt > CHECKPOINT_EVERY_S:
            save_state()
            last_ckpt = time.perf_counter()
    bar.close()
    save_state()
    if not hist.eval_steps or hist.eval_steps[-1] != step:
        hist.eval_steps.append(step)
        hist.eval_acc.append(evaluate())
    final = hist.eval_acc[-1]
    # By kind: corpus text and the answers in the target's own conversations to asks no training
    # conversation makes (SmolLM2's default head: 0.38 and 0.43 at depth 1).
    kinds = {"corpus": slice(0, held_corpus), "conversations": slice(held_corpus, None)}
    by_kind = {k: [round(a, 4) for a in evaluate(rows)] for k, rows in kinds.items() if len(htoks[rows])}
    card = {
        "method": cfg.method,
        "target": fp,
        "target_name": cfg.model,
        "hidden_size": arch.hidden_size,
        **trainer.card(),
        "head_vocab": int(len(token_ids)),
        "heldout_tokens_in_head_vocab": round(inside, 4),
        "corpus": cfg.corpus or "python-stdlib",
        "seq_len": cfg.seq_len,
        "train_tokens": int(toks.numel()),
        "heldout_tokens": int(htoks.numel()),
        "steps": step,
        "total_steps": total_steps,
        "complete": step >= total_steps,
        "tokens_seen": int(step * per_step * cfg.seq_len),
        "heldout_accept_depth1": round(final[0], 4),
        "heldout_accept_by_depth": [round(a, 4) for a in final],
        "heldout_accept_by_kind": by_kind,
        "train_dtype": str(amp).removeprefix("torch."),
        "extract_s": round(extract_s, 1),
        "train_s": round(train_s, 1),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    return _write_head(out, head, token_ids, card, lambda png: _plot(hist, png, f"{cfg.method} head for {cfg.model}"))


def _write_head(out: Path, module: torch.nn.Module, token_ids: torch.Tensor, card: dict,
                plot: Callable[[Path], None]) -> dict:
    """The head file, its JSON card and its PNG beside it; returns the card with the file's path."""
    from specserve.spec.eagle import save_head

    save_head(out, module, token_ids, card)
    out.with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")
    plot(out.with_suffix(".png"))
    return {**card, "path": str(out)}


def _plot(hist: _History, path: Path, title: str) -> None:
    """Loss (smoothed) and held-out top-1 agreement per depth against training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    if hist.loss:
        w = max(1, len(hist.loss) // 50)
        sm = [sum(hist.loss[max(0, i - w + 1) : i + 1]) / len(hist.loss[max(0, i - w + 1) : i + 1])
              for i in range(len(hist.loss))]
        a.plot(hist.steps, sm)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.set_title("loss")
    for d in range(len(hist.eval_acc[0]) if hist.eval_acc else 0):
        b.plot(hist.eval_steps, [acc[d] for acc in hist.eval_acc], marker="o", label=f"depth {d + 1}")
    b.set_xlabel("step")
    b.set_ylabel("held-out top-1 agreement with the target")
    b.set_ylim(0, 1)
    b.legend()
    b.set_title("held-out agreement")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- layer-skip exits
def exit_candidates(num_layers: int, asked: int | None) -> list[int]:
    """Exit layers to fit: the one asked for, else 1/4 .. 7/8 of the way up in eighths."""
    if asked is not None:
        if not 1 <= asked < num_layers:
            raise ConfigError(f"--layers must be in [1, {num_layers - 1}] (the target has {num_layers} layers), got {asked}.")
        return [asked]
    return sorted({max(1, round(num_layers * f / 8)) for f in range(2, 8)} - {num_layers})


class _LayerStates:
    """The target's residual stream after each candidate layer and its final feature (after the
    norm), one pass per batch of sequences: partial native stacks between the candidates."""

    def __init__(self, engine, cands: list[int]) -> None:  # noqa: ANN001 - LLMEngine
        from specserve.models.block_linear import partial_decoder_stack

        self.engine, self.runner = engine, engine.runner
        self.model = self.runner.model.model
        bounds = [0, *cands, len(self.model.layers)]
        self.segments = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        self.stacks = [partial_decoder_stack(self.model, seg) for seg in self.segments]

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> tuple[list[torch.Tensor], torch.Tensor]:  # per candidate [n, H]; [n, H]
        with _owned_entries(self.engine, seqs) as entries:
            inputs = self.runner.feed_inputs(entries)
            x = self.model.embed_tokens(inputs.input_ids)
            states = []
            for seg, stack in zip(self.segments, self.stacks):
                x = self.model.run_layers(x, inputs.positions, self.runner.kv_caches, inputs.meta, seg, stack)
                states.append(x.float())
            return states[:-1], self.model.norm(x).float()


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """[x / rms(x), 1] in float64: the exit's input with a bias column."""
    from specserve.spec.layerskip import unit_rms

    x = unit_rms(x.double())
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)


def _fit_exit(cfg: TrainConfig, llm, work: Path, fp: str, out: Path, token_ids: torch.Tensor,  # noqa: ANN001
              t_start: float) -> dict:
    """Fit a layer-skip exit (spec/layerskip.py: f = W (x / rms(x)) + b ~ the final feature) at
    each candidate layer by ridge least squares over the target's own states, score each on
    held-out text (top-1 agreement with the target in the head's vocabulary, and the speedup
    that predicts at the layer's cost), keep the best. Resumable: the normal equations are
    checkpointed."""
    from specserve.ops.calc import best_k
    from specserve.spec.eagle import float_rows
    from specserve.spec.layerskip import ExitHead

    engine = llm.engine
    arch = engine.arch
    n_layers, hidden = arch.num_layers, arch.hidden_size
    cands = exit_candidates(n_layers, cfg.layers)
    train, held = _training_sequences(cfg, llm, work)
    train_seqs, held_seqs = train.seqs, held.seqs
    states = _LayerStates(engine, cands)
    per_batch = max(1, cfg.batch_tokens // cfg.seq_len)
    state_path = work / "state-layerskip.pt"
    ident = {"cands": cands, "seq_len": cfg.seq_len, "seqs": len(train_seqs), "first": train_seqs[0][:16]}
    gram = torch.zeros(len(cands), hidden + 1, hidden + 1, dtype=torch.float64)
    cross = torch.zeros(len(cands), hidden + 1, hidden, dtype=torch.float64)
    done = 0
    if state_path.is_file() and not cfg.fresh:
        st = torch.load(state_path, weights_only=False)
        if st.get("ident") == ident:
            gram, cross, done = st["gram"], st["cross"], st["done"]

    def save_state() -> None:
        _save_atomic({"ident": ident, "gram": gram, "cross": cross, "done": done}, state_path)

    deadline = None if cfg.max_minutes is None else t_start + 60 * cfg.max_minutes
    bar = _bar(len(train_seqs) * cfg.seq_len, "fitting layer-skip exits (target states)", "tok")
    bar.update(done * cfg.seq_len)
    last_ckpt = time.perf_counter()
    while done < len(train_seqs) and (deadline is None or time.perf_counter() < deadline):
        batch = train_seqs[done : done + per_batch]
        xs, final = states(batch)
        target = final.double()
        for j, x in enumerate(xs):
            u = _unit_rows(x)
            gram[j] += u.T @ u
            cross[j] += u.T @ target
        done += len(batch)
        bar.update(len(batch) * cfg.seq_len)
        if time.perf_counter() - last_ckpt > CHECKPOINT_EVERY_S:
            save_state()
            last_ckpt = time.perf_counter()
    bar.close()
    save_state()
    if done == 0:
        raise ConfigError("No training sequence was fitted before --max-minutes ran out; raise it.")

    head_w = float_rows(engine.runner.model.lm_head, token_ids)  # [Vh, H]
    norm = engine.runner.model.model.norm
    solved = []
    for j in range(len(cands)):
        ridge = 1e-4 * float(gram[j].diagonal().mean())
        solved.append(torch.linalg.solve(gram[j] + ridge * torch.eye(hidden + 1, dtype=torch.float64), cross[j]))
    hits = [0] * len(cands)
    raw_hits = [0] * len(cands)
    seen = 0
    with torch.inference_mode():
        for b in range(0, len(held_seqs), per_batch):
            xs, final = states(held_seqs[b : b + per_batch])
            label = (final @ head_w.T).argmax(-1)
            for j, x in enumerate(xs):
                fitted = (_unit_rows(x) @ solved[j]).float()
                hits[j] += int(((fitted @ head_w.T).argmax(-1) == label).sum())
                raw_hits[j] += int(((norm(x) @ head_w.T).argmax(-1) == label).sum())
            seen += label.numel()
    rows = []
    for j, layer in enumerate(cands):
        acc = hits[j] / seen
        cost = layer / n_layers  # the draft pass's share of the target's layers
        k = best_k(min(acc, 0.999), cost, 8)
        rows.append({"layer": layer, "heldout_top1": round(acc, 4), "raw_top1": round(raw_hits[j] / seen, 4),
                     "cost_ratio": round(cost, 4), "best_k": k.k, "predicted_speedup": round(k.speedup, 3)})
    best = max(range(len(cands)), key=lambda j: (rows[j]["predicted_speedup"], rows[j]["heldout_top1"]))
    exit_head = ExitHead(hidden)
    with torch.no_grad():
        exit_head.proj.weight.copy_(solved[best][:hidden].T.float())
        exit_head.proj.bias.copy_(solved[best][hidden].float())
    card = {
        "method": "layerskip",
        "target": fp,
        "target_name": cfg.model,
        "hidden_size": hidden,
        "num_layers": cands[best],
        "target_layers": n_layers,
        "candidates": rows,
        "head_vocab": int(len(token_ids)),
        "corpus": cfg.corpus or "python-stdlib",
        "seq_len": cfg.seq_len,
        "train_tokens": len(train_seqs) * cfg.seq_len,
        "heldout_tokens": seen,
        "tokens_seen": done * cfg.seq_len,
        "complete": done >= len(train_seqs),
        "heldout_accept_depth1": rows[best]["heldout_top1"],
        "predicted_speedup": rows[best]["predicted_speedup"],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    return _write_head(out, exit_head, token_ids, card, lambda png: _plot_exits(rows, png, f"layer-skip exits for {cfg.model}"))


def _plot_exits(rows: list[dict], path: Path, title: str) -> None:
    """Held-out agreement (untrained and fitted exit) and predicted speedup by exit layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(layers, [r["raw_top1"] for r in rows], marker="o", label="final norm (untrained)")
    a.plot(layers, [r["heldout_top1"] for r in rows], marker="o", label="fitted exit")
    a.set_xlabel("exit layer")
    a.set_ylabel("held-out top-1 agreement with the target")
    a.set_ylim(0, 1)
    a.legend()
    b.plot(layers, [r["predicted_speedup"] for r in rows], marker="o")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_xlabel("exit layer")
    b.set_ylabel("predicted speedup (best K, cost = layer share)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
