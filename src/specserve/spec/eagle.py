"""EAGLE: a one-layer drafter that reads the target's own hidden states.

The target's last hidden state f_i (after its final norm: what its LM head reads) at position i
already says most of what token i+1 will be. The head predicts the *next feature* from the pair
(f_i, embedding of x_{i+1}):

    h_i = DecoderLayer(fc([embed(x_{i+1}); f_i]))    trained so that h_i ~ f_{i+1}

and the target's own LM head turns h_i into the distribution of x_{i+2} (restricted to the most
frequent ids, like a draft model's head). One layer over features costs a few percent of a
target step; embedding and LM head are the target's (no copy).

Serving: the head keeps a small paged KV cache of its own, slot i holding (f_i, x_{i+1}) with
true features from the target. After each target step the features of the verified tokens
arrive (`observe_hidden`); the next `propose` feeds them (one pass: the catch-up, whose last
row predicts the root's children) and then grows a tree as EAGLE-2 does: each pass feeds the
most promising unexpanded nodes, a node's feature being the head's own prediction h of its
parent. Tree nodes' KV is dropped after verification: the accepted ones come back next step
with the target's true features.

Exactness never depends on the head: its proposals are verified like any draft model's.

A head file (safetensors) holds fc / layer weights in Hugging Face names, the head's token ids,
and metadata: the method, the layer's shape, and the fingerprint of the target it was trained
for (a head trained for another target is refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import build_attention_metadata
from specserve.errors import (
    ConfigError,
    CorruptModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from specserve.kv_cache.manager import KVCacheManager
from specserve.kv_cache.pages import LayerKV, layer_pages
from specserve.models.arch import ArchConfig
from specserve.models.linear import row_reader, storage_bytes
from specserve.models.llama import DecoderLayer, RestrictedLMHead, RMSNorm, RotaryEmbedding
from specserve.models.registry import unset_weights
from specserve.request import Request
from specserve.spec.draft_model import (
    CHILDREN,
    EXPAND_WIDTH,
    MAX_PASSES,
    CandidateWidth,
    PassTimer,
    _TreeDraft,
    expand_rows,
    grow_trees,
    picked_rows,
)
from specserve.spec.proposer import (
    PromptFeed,
    PromptKVTraveller,
    Proposer,
    ProposerTraits,
    register_proposer,
)
from specserve.spec.tree import DraftTree

HEAD_FORMAT = "specserve-head-1"
# Features kept for a request the head has not consumed (a long prompt waiting for its first
# draft, or a request that does not speculate): beyond this the oldest are dropped and the head
# attends to the most recent window only (a drafter's context, never the output's).
PENDING_CAP = 4096
# A fused head (EAGLE-3's features from several target layers) projects each step's rows to its
# input features once this many are waiting for a request, or when it drafts: per step, for
# the one row of a request the policy holds back, the projection's ~8 tensor operations took
# 0.2 ms of a 3.6 ms SmolLM2 step (2-vCPU Xeon), paid whether it drafted or not.
FUSE_AT = 32
# The most features a drafting request feeds the head in a call: the nodes a call may draft that
# the target accepted, and the token after them. More is a catch-up (see EagleProposer.propose).
STEADY_CATCHUP = EXPAND_WIDTH * MAX_PASSES + 1


# ----------------------------------------------------------------------------- the head
def head_arch(target: ArchConfig, intermediate_size: int | None = None) -> ArchConfig:
    """The head's decoder layer: the target's layer shape (one layer), optionally a narrower MLP."""
    return dataclasses.replace(target, num_layers=1, intermediate_size=intermediate_size or target.intermediate_size,
                               name=f"eagle[{target.name}]")


class EagleHead(nn.Module):
    """fc([embedding; feature]) -> one decoder layer -> the predicted next feature.

    With feature_layers (EAGLE-3's fusion), the target's feature of a verified token is
    fuse([rms(r_a); rms(r_b); ...; f]): its residual streams after layers a, b, ... (each scaled to
    unit RMS) beside its last hidden state f, projected back to one hidden vector (initialised to
    pass f through). Low and middle layers still carry what the top layer has already traded for
    the next token's prediction, which the head needs to guess the token after it. Tree nodes
    below the root read the head's own outputs, as without fusion.
    """

    def __init__(self, arch: ArchConfig, feature_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(arch)
        self.native_stack: object | None = None  # the layer as one native call, once quantized (build_eagle)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        if self.feature_layers:
            k = len(self.feature_layers)
            self.fuse = nn.Linear((k + 1) * h, h, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, k * h :].copy_(torch.eye(h))

    def target_feature(self, rows: torch.Tensor) -> torch.Tensor:  # [..., hidden * (layers + 1)] -> [..., hidden]
        """The head's input feature from the target's (runner.HiddenRows' layout)."""
        if not self.feature_layers:
            return rows
        h = self.arch.hidden_size
        parts = list(rows.split(h, dim=-1))
        eps = self.arch.rms_norm_eps
        low = [p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps) for p in parts[:-1]]
        return self.fuse(torch.cat((*low, parts[-1]), dim=-1))

    def forward_paged(
        self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
        kv: LayerKV, meta: object,
    ) -> torch.Tensor:  # [n, hidden]
        """Serving: new rows over the head's paged cache (tree masks as for any drafter). A quantized
        head's layer runs as one native call: the kernels its native ops call one by one, in the same
        order, so the same values (SmolLM2's head pass: ~10 native calls and their Python a pass)."""
        x = self.project(emb, feat)
        stack = self.native_stack
        if stack is None:
            return self.layer(x, positions, rope, kv, meta)
        return stack.forward(x, positions, rope.cos, rope.sin, list(kv), meta.slot_mapping, meta.block_tables,  # type: ignore[attr-defined]
                             meta.attn_mask, meta.query_index, self.layer.self_attn.scale)

    def project(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """The layer's input from the token's embedding and the feature."""
        return self.fc(torch.cat((emb, feat), dim=-1))

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from the head's output (EAGLE: the predicted feature itself)."""
        return h

    def forward_unrolled(self, emb: torch.Tensor, feat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         depth: int = 1) -> list[torch.Tensor]:
        """Training: `depth` passes over whole sequences, the way serving sees them.

        emb [B, S, H] embeds x_{i+1}, feat [B, S, H] is f_i. Pass 1 reads the true features; pass
        d > 1 reads pass d-1's prediction of f_i (its output at i-1) and attends, as a tree node
        at depth d does when serving, to the true prefix up to i-d+1 and to its own path: pass k's
        key at i-d+k. Returns each pass's output [B, S, H] (row i predicts f_{i+1}).
        """
        b, s, _ = emb.shape
        layer, a = self.layer, self.layer.self_attn
        outs: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        inp = feat
        idx = torch.arange(s)
        for d in range(1, depth + 1):
            x = self.project(emb, inp)
            hn = layer.input_layernorm(x)
            q = a.q_proj(hn).view(b, s, a.num_heads, a.head_dim)
            k = a.k_proj(hn).view(b, s, a.num_kv_heads, a.head_dim)
            v = a.v_proj(hn).view(b, s, a.num_kv_heads, a.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            keys.append(k)
            values.append(v)
            # Mask [S, d*S]: pass-1 keys j <= i-d+1, pass-k keys (k >= 2) at i-d+k exactly.
            parts = [idx[None, :] <= (idx[:, None] - d + 1)]
            parts += [idx[None, :] == (idx[:, None] - d + kk) for kk in range(2, d + 1)]
            mask = torch.cat(parts, dim=1)
            kk_ = torch.cat(keys, dim=1).repeat_interleave(a.num_heads // a.num_kv_heads, dim=2)
            vv_ = torch.cat(values, dim=1).repeat_interleave(a.num_heads // a.num_kv_heads, dim=2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), kk_.transpose(1, 2), vv_.transpose(1, 2),
                                                 attn_mask=mask, scale=a.scale)
            x = x + a.o_proj(att.transpose(1, 2).reshape(b, s, a.q_size))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            outs.append(x)
            # The next pass at i reads this pass's prediction of f_i: its output at i-1.
            inp = torch.cat((feat[:, :1], x[:, :-1]), dim=1)
        return outs


class MTPModule(EagleHead):
    """DeepSeek-V3's multi-token-prediction module: eh_proj([enorm(embedding); hnorm(feature)]) ->
    one decoder layer -> its own final norm -> the target's (shared) LM head. Trained on
    cross-entropy alone; at depth d > 1 it reads its own previous output as the feature, as
    DeepSeek-V3's chained modules do (one module here, applied recursively)."""

    # A checkpoint that ships the module names it as DeepSeek-V3 does; ours -> theirs.
    DEEPSEEK_NAMES = {"fc.": "eh_proj.", "norm.": "shared_head.norm.", "layer.": ""}

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__(arch)
        h = arch.hidden_size
        self.enorm = RMSNorm(h, arch.rms_norm_eps)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps)
        self.norm = RMSNorm(h, arch.rms_norm_eps)

    def project(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embedding); hnorm(feature)])."""
        return self.fc(torch.cat((self.enorm(emb), self.hnorm(feat)), dim=-1))

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """The module's own final norm (DeepSeek-V3's shared_head.norm)."""
        return self.norm(h)


def mtp_in_deepseek_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MTPModule's state under the names DeepSeek-V3's checkpoints give its layer (what
    import_mtp_tensors reads back): `fc` as `eh_proj`, `norm` as `shared_head.norm`, the block's
    tensors without `layer.`."""
    out = {}
    for name, t in state.items():
        ours = next((o for o in MTPModule.DEEPSEEK_NAMES if name.startswith(o)), "")
        out[MTPModule.DEEPSEEK_NAMES.get(ours, "") + name.removeprefix(ours)] = t
    return out


def import_mtp_tensors(tensors: dict[str, torch.Tensor], hidden_size: int) -> dict[str, torch.Tensor]:
    """MTPModule's state from a checkpoint's MTP layer in DeepSeek-V3's names (`eh_proj`, `enorm`,
    `hnorm`, `shared_head.norm`, and the block's own `self_attn.*` / `mlp.*` / norms), under any
    prefix (`model.layers.61.`, `mtp.`); the embedding and output head are the target's and are
    not read. Refuses a file without one or with another hidden size."""
    anchor = [k for k in tensors if k.endswith("eh_proj.weight")]
    if len(anchor) != 1:
        raise ConfigError(f"Not an MTP checkpoint: expected one '*eh_proj.weight', found {len(anchor)}.")
    prefix = anchor[0].removesuffix("eh_proj.weight")
    ours: dict[str, torch.Tensor] = {}
    theirs = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    for name, t in theirs.items():
        if name.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        if name.startswith("eh_proj."):
            ours["fc." + name.removeprefix("eh_proj.")] = t
        elif name.startswith("shared_head.norm."):
            ours["norm." + name.removeprefix("shared_head.norm.")] = t
        elif name.startswith(("enorm.", "hnorm.")):
            ours[name] = t
        else:
            ours["layer." + name] = t
    w = ours["fc.weight"]
    if tuple(w.shape) != (hidden_size, 2 * hidden_size):
        raise ConfigError(f"The MTP module's eh_proj is {tuple(w.shape)}; this target needs ({hidden_size}, "
                          f"{2 * hidden_size}): it was made for another model.")
    return ours


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, S, h, d], cos [S, d/2]
    half = x.shape[-1] // 2
    c, s_ = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)


# ----------------------------------------------------------------------------- files
FINGERPRINT_ROWS = 64  # the embedding rows a target's fingerprint reads


def target_fingerprint(arch: ArchConfig, tokenizer_fp: str | None, embed_weight: torch.Tensor,
                       legacy: bool = False) -> str:
    """What identifies a target for its heads: shape, vocabulary and the embedding table's first rows
    at bfloat16 precision, so a float32 copy of a model (the CPU's default) and a bfloat16 one (a
    GPU's) agree; another model does not. legacy: the fingerprint heads trained before 2026-11-26
    carry (rows at float16: a bfloat16 copy of the model disagreed with a float32 one)."""
    rows = embed_weight[:FINGERPRINT_ROWS].detach().cpu()
    data = rows.float().half() if legacy else rows.to(torch.bfloat16).view(torch.int16)
    ident = json.dumps([arch.architecture, arch.vocab_size, arch.hidden_size, arch.num_layers, tokenizer_fp],
                       sort_keys=True).encode()
    return hashlib.blake2b(ident + data.numpy().tobytes(), digest_size=12).hexdigest()


def target_fingerprints(arch: ArchConfig, tokenizer_fp: str | None, embed_weight: torch.Tensor) -> tuple[str, str]:
    """(current, legacy) fingerprints of a target: a head carrying either was trained for it. The
    first time a target asks, the cache's folders under its legacy fingerprint move to the current
    one and the heads there are re-carded with it (a float32 target computes both, which is what
    proves them the same model), so a bfloat16 copy of the target finds them afterwards too."""
    from specserve.models.bundled import cache_dir

    fps = (target_fingerprint(arch, tokenizer_fp, embed_weight),
           target_fingerprint(arch, tokenizer_fp, embed_weight, legacy=True))
    if fps[0] == fps[1]:
        return fps
    for kind in ("heads", "train"):
        old, new = cache_dir() / kind / fps[1], cache_dir() / kind / fps[0]
        if old.is_dir() and not new.exists():
            with contextlib.suppress(OSError):  # another process moved it first, or a read-only cache
                old.rename(new)
    for path in sorted((cache_dir() / "heads" / fps[0]).glob("*.safetensors")):
        with contextlib.suppress(OSError, ConfigError):  # a foreign or torn file is left as it is
            _recard(path, fps[1], fps[0])
    return fps


def _recard(path: Path, old_fp: str, new_fp: str) -> None:
    """Rewrite a head file (and the JSON card beside it) whose card names old_fp to name new_fp."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != HEAD_FORMAT or json.loads(meta["card"]).get("target") != old_fp:
        return
    tensors, card = load_head_file(path)
    _write_head_file(path, tensors, {**card, "target": new_fp})
    side = path.with_suffix(".json")
    if side.is_file():
        side_card = json.loads(side.read_text())
        side_card["target"] = new_fp
        side.write_text(json.dumps(side_card, indent=2) + "\n")


def save_head(path: str | Path, head: nn.Module, token_ids: torch.Tensor, meta: dict) -> None:
    """Write a head: its weights, its token ids, and metadata (method, shape, target) as JSON."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    tensors["token_ids"] = token_ids.to(torch.int64).contiguous()
    _write_head_file(path, tensors, meta)


def _write_head_file(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """A head file's bytes, written atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": HEAD_FORMAT, "card": json.dumps(meta, sort_keys=True)})
        tmp.replace(path)
    except BaseException:  # a full disk, a folder in the way: no partial file stays behind
        tmp.unlink(missing_ok=True)
        raise


def load_head_file(path: str | Path, method: str = "eagle") -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, card) of a head file, refusing what is not one."""
    from safetensors import safe_open

    path = Path(path)
    model_dir = path.is_dir() and (path / "config.json").is_file()
    if not path.is_file() and not model_dir:
        raise ConfigError(f"No drafter head at {path}; train one with `specserve train-draft --method {method} "
                          f"--model M --out {path}`.")
    if model_dir or _is_gguf(path):  # a model: the MTP layer it ships
        from specserve.models.loader import gguf_mtp_tensors, hf_mtp_tensors

        try:
            if model_dir:
                return hf_mtp_tensors(path), {"method": "mtp", "imported": True, "source": "directory"}
            return gguf_mtp_tensors(path), {"method": "mtp", "imported": True, "source": "gguf"}
        except (ModelNotFoundError, CorruptModelError, UnsupportedModelError) as exc:
            raise ConfigError(str(exc)) from exc
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file
        raise ConfigError(f"{path} is not a readable safetensors head file ({exc}).") from exc
    if meta.get("format") != HEAD_FORMAT:
        if any(k.endswith("eh_proj.weight") for k in tensors):  # a checkpoint's own MTP module
            return tensors, {"method": "mtp", "imported": True}
        raise ConfigError(f"{path} is not a specserve drafter head (format {meta.get('format')!r}).")
    try:
        card = json.loads(meta["card"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{path} is a drafter head without a readable card ({type(exc).__name__}: {exc}); "
                          "train it again with `specserve train-draft`.") from None
    if not isinstance(card, dict):
        raise ConfigError(f"{path}: its card is {type(card).__name__}, not a JSON object; train it again.")
    return tensors, card


def head_token_ids(path: str | Path, tensors: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor:
    """A head file's `token_ids` (the target's LM-head rows it drafts over), taken out of
    `tensors`: distinct ids in [0, vocab_size), refused by name otherwise (an id past the
    vocabulary failed as an IndexError inside the LM head, an empty list as a ZeroDivisionError)."""
    ids = tensors.pop("token_ids", None)
    if ids is None:
        raise ConfigError(f"{path} holds no token_ids (the LM-head rows it drafts over); train it again.")
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ConfigError(f"{path}: token_ids must be a non-empty list of integer ids, got {ids.dtype} of shape "
                          f"{tuple(ids.shape)}; train it again.")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"{path}: token_ids holds ids outside this target's vocabulary [0, {vocab_size}); "
                          "it was trained for another model.")
    return ids.long()


def card_size(path: str | Path, card: dict, key: str) -> int:
    """A positive integer a head's card must give (intermediate_size, num_heads), refused by name."""
    value = card.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: its card's {key} is {value!r}, not a positive integer; train it again.")
    return value


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def float_rows(linear: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of any linear layer's weight in float32: read alone where the layout allows
    (row_reader), else from the dequantized weight or a packed backend (recovered as linear(I)^T,
    exact for a bias-free layer)."""
    read = row_reader(linear)
    if read is not None:
        return read(ids)
    if hasattr(linear, "dequantized_weight"):
        w = linear.dequantized_weight().float()
        return w.index_select(0, ids.to(w.device))
    eye = torch.eye(linear.in_features)
    bias = getattr(linear, "bias", None)
    w = (linear(eye) - (bias if bias is not None else 0)).T
    return w.float().index_select(0, ids).contiguous()


def default_head_path(fingerprint: str, method: str) -> Path:
    """Where `train-draft` puts a head by default, and where `--draft-model auto` looks for it."""
    from specserve.models.bundled import cache_dir

    return cache_dir() / "heads" / fingerprint / f"{method}.safetensors"


# ----------------------------------------------------------------------------- serving
class _Rows:
    """Tensors of consecutive rows, in order, with their total row count kept as they are added: a
    step that drafts nothing asks for the counts several times, and summing a list of up to FUSE_AT
    one-row tensors each time cost ~20 us a call once the forward had left the caches cold."""

    __slots__ = ("parts", "count")

    def __init__(self, parts: Sequence[torch.Tensor] = ()) -> None:
        self.parts = list(parts)
        self.count = sum(int(t.shape[0]) for t in self.parts)

    def add(self, rows: torch.Tensor) -> None:
        self.parts.append(rows)
        self.count += int(rows.shape[0])


class _HeadSeq:
    """A request as the head sees it: head slots filled with true features, then features waiting."""

    __slots__ = ("request_id", "all_token_ids", "base", "num_computed_tokens", "pending", "raw")

    def __init__(self, request_id: str, base: int) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = []  # the manager's protocol; the head cache keeps no prefix hashes
        self.base = base  # position of head slot 0 (earlier positions came without features)
        self.num_computed_tokens = 0  # head slots holding (f_p, x_{p+1}) for p = base, base + 1, ...
        self.pending = _Rows()  # features of the positions after those, in order
        self.raw = _Rows()  # then the target's rows of the newest ones, not yet fused (FUSE_AT)

    @property
    def num_pending(self) -> int:
        return self.pending.count + self.raw.count

    @property
    def next_pos(self) -> int:
        """The position whose feature is expected next."""
        return self.base + self.num_computed_tokens + self.num_pending


class _EagleTree(_TreeDraft):
    """A tree being grown by the head: each distribution row also keeps the head output h that
    produced it (a child's input feature)."""

    def __init__(self, req: Request, seq: _HeadSeq, budget: int, cap: int) -> None:
        super().__init__(req, seq, budget, cap)  # type: ignore[arg-type]
        self.hid: list[torch.Tensor] = []

    def feed(self, picked: list[int]) -> tuple[list[int], torch.Tensor, list[int], int, torch.Tensor]:
        """(tokens, features, positions, first slot, tail mask) of the picked nodes: a node at depth d
        sits at head position root - 1 + d and sees the head's prefix, its fed ancestors and itself."""
        root = len(self.req.all_token_ids) - 1
        start = self.seq.num_computed_tokens + len(self.fed) - len(picked)
        feats = torch.stack([self.hid[self.cands[c].row] for c in picked])
        return ([self.cands[c].token for c in picked], feats, [root - 1 + self.depth(c) for c in picked], start,
                self.tail_mask(picked))


@register_proposer("eagle")
class EagleProposer(PassTimer, CandidateWidth, PromptKVTraveller, Proposer):
    """Trees from a one-layer head over the target's features (see the module docstring)."""

    traits = ProposerTraits(cost="per_pass", trees=True, tree_by_default=True, needs_hidden_states=True,
                            prior_acceptance=0.6, prompt_kv_travels=True)

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: nn.Module, num_blocks: int, block_size: int,
                 max_positions: int, p_min: float = 0.0, tree: bool = True, seed: int = 0,
                 card: dict | None = None) -> None:
        self.head = head.eval()
        self.embed = embed
        self.lm_head = lm_head
        self.card = card or {}
        self.weight_format = "float32"  # of its matrices (build_eagle: Q8_0 or 4-bit blocks on the native kernels)
        arch = head.arch
        self.device = next(itertools.chain(embed.parameters(), embed.buffers())).device  # (a BlockEmbedding has no weight)
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions).to(self.device)
        self.block_size = block_size
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_cache = layer_pages(1, [(shape, torch.float32)] * 2, self.device)[0]
        self.kv = KVCacheManager(num_blocks, block_size, False, name="eagle")
        self.p_min = p_min
        self.children = CHILDREN if tree else 1
        self._seqs: dict[str, _HeadSeq] = {}
        self._arriving: set[str] = set()  # head KV of the prompt coming from a prefill worker
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + 2)
        self.num_forwards = 0

    # ------------------------------------------------------------------ features in
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers the head's fusion reads beside the last (EagleHead)."""
        return self.head.feature_layers

    @torch.inference_mode()
    def observe_hidden(self, hidden: dict) -> None:
        """The target's hidden states of the tokens each request just verified (HiddenRows)."""
        hidden = {rid: hr for rid, hr in hidden.items() if hr.rows.shape[0]}
        if not hidden:
            return
        # Kept as the target's rows (a copy: the runner reuses its buffers); fused into the head's
        # input features in batches (_fuse).
        joined = torch.cat([hr.rows for hr in hidden.values()]).float()
        copies = [joined] if len(hidden) == 1 else joined.split([hr.rows.shape[0] for hr in hidden.values()])
        touched = []
        for (rid, hr), rows in zip(hidden.items(), copies):
            start = hr.start_pos
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._seqs[rid] = _HeadSeq(rid, start)
            expected = seq.next_pos
            if start < expected:  # already seen (cannot happen in order; keep only what is new)
                rows = rows[expected - start :]
                start = expected
                if rows.shape[0] == 0:
                    continue
            if start > expected:  # a gap (features never computed here): the head restarts at start
                self._arriving.discard(rid)
                self.kv.free(seq)
                seq = self._seqs[rid] = _HeadSeq(rid, start)
            seq.raw.add(rows)
            if seq.num_pending > PENDING_CAP:  # keep a recent window; the head's older KV is dropped
                self._fuse([seq])
                tail = torch.cat(seq.pending.parts)[-PENDING_CAP // 2 :]
                self._arriving.discard(rid)
                self.kv.free(seq)
                seq = self._seqs[rid] = _HeadSeq(rid, start + rows.shape[0] - tail.shape[0])
                seq.pending = _Rows([tail])
            touched.append(seq)
        self._fuse([seq for seq in touched if seq.raw.count >= FUSE_AT])

    def _fuse(self, seqs: Sequence[_HeadSeq]) -> None:
        """Project the waiting target rows of `seqs` to the head's input features, in one call
        (per request, the fusion cost 1.64 ms a step at batch 16 on Qwen 1.5B's shapes, against
        0.33 ms at once)."""
        seqs = [seq for seq in seqs if seq.raw.count]
        if not seqs:
            return
        counts = [seq.raw.count for seq in seqs]
        feats = self.head.target_feature(torch.cat([t for seq in seqs for t in seq.raw.parts])).split(counts)
        for seq, f in zip(seqs, feats):
            seq.pending.add(f)
            seq.raw = _Rows()

    def catchup_tokens(self, request: Request) -> int:
        """Features the head has not fed yet (at least the root's each step; a prompt at first)."""
        seq = self._seqs.get(request.request_id)
        return seq.num_pending if seq is not None else 0

    # ------------------------------------------------------------------ lifecycle
    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Drop the request's head KV and features (a preempted request's come back with its recompute)."""
        self._arriving.discard(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    # ------------------------------------------------------------------ prompt KV across workers
    # Disaggregated serving: a prefill worker holding the same head feeds it the prompt's
    # features as its target computes them and sends the head's KV (one layer: slot p holds
    # (f_p, x_{p+1}), so the last slot needs the prompt's token after the m that travel); the
    # decode worker's head then drafts with the whole prompt in view from its first drafts on,
    # where without it the head would start at the first decoded position, blind to the prompt.
    def prompt_kv_caches(self) -> list[LayerKV]:
        """The head's paged KV: one layer."""
        return [self.kv_cache]

    def prompt_kv_shape(self) -> dict:
        """The head's KV per token."""
        arch = self.head.arch
        return {"num_layers": 1, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
                "dtype": str(self.kv_cache.k.dtype).replace("torch.", ""), "kv_cache_dtype": "auto"}

    def prompt_kv_identity(self) -> dict:
        """The head's training (its file is the engine's setting)."""
        return {"target": self.card.get("target"), "tokens_seen": self.card.get("tokens_seen"),
                "head_vocab": int(getattr(self.lm_head, "token_ids", torch.empty(0)).numel())}

    def prompt_kv_slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of the request's head positions [start, end) (the sequence starts at 0)."""
        return self.kv.slots(request_id, start, end)

    @torch.inference_mode()
    def feed_prompts(self, feeds: Sequence[PromptFeed]) -> dict[str, int]:
        """Fill each request's head slots [0, upto) from the target's features observed so far
        (one batched pass); a request whose features, next token or head room are missing is
        left out."""
        tokens: list[int] = []
        feats: list[torch.Tensor] = []
        positions: list[int] = []
        starts, counts, tables = [], [], []
        fed: list[tuple[_HeadSeq, int, torch.Tensor]] = []
        done: dict[str, int] = {}
        self._fuse([self._seqs[req.request_id] for req, _, _ in feeds if req.request_id in self._seqs])
        for req, n, nxt in feeds:
            seq = self._seqs.get(req.request_id)
            if seq is None or seq.base != 0 or nxt is None or seq.next_pos < n or n > len(req.prompt_token_ids):
                continue
            c = seq.num_computed_tokens
            if c >= n:
                done[req.request_id] = c
                continue
            if not self.kv.allocate_slots(seq, n - c):
                continue
            pending = torch.cat(seq.pending.parts)
            ids = [*req.prompt_token_ids, nxt]  # nxt follows the whole prompt, not a pass's end
            tokens += ids[c + 1 : n + 1]
            feats.append(pending[: n - c])
            positions += range(c, n)
            starts.append(c)
            counts.append(n - c)
            tables.append(self.kv.block_ids(req.request_id))
            fed.append((seq, n, pending[n - c :]))
        if fed:
            self._pass(tokens, torch.cat(feats), positions, starts, counts, tables, [None] * len(fed))
        for seq, n, rest in fed:
            seq.num_computed_tokens = n
            seq.pending = _Rows([rest] if rest.shape[0] else [])
            done[seq.request_id] = n
        return done

    def expect_prompt_kv(self, request: Request, num_tokens: int) -> int | None:
        """Hold head slots [0, num_tokens) for KV arriving from a prefill worker. The features of
        the decode worker's first steps queue behind them meanwhile; no draft until it is in."""
        rid = request.request_id
        if rid in self._seqs or num_tokens <= 0:
            return None
        seq = _HeadSeq(rid, 0)
        if not self.kv.allocate_slots(seq, num_tokens):
            return None
        seq.num_computed_tokens = num_tokens
        self._seqs[rid] = seq
        self._arriving.add(rid)
        return 0

    def prompt_kv_pending(self, request_id: str) -> bool:
        """Head slots are held for this request's arriving KV."""
        return request_id in self._arriving

    def prompt_kv_arrived(self, request_id: str) -> None:
        """The head's prompt KV is in its slots: draft from there on."""
        self._arriving.discard(request_id)

    def drop_prompt_kv(self, request_id: str) -> None:
        """The KV will not come: free its slots; the head goes on from the features queued since
        (as it would have without the transfer)."""
        if request_id not in self._arriving:
            return
        self._arriving.discard(request_id)
        seq = self._seqs.pop(request_id)
        self.kv.free(seq)
        fresh = self._seqs[request_id] = _HeadSeq(request_id, seq.base + seq.num_computed_tokens)
        fresh.pending, fresh.raw = seq.pending, seq.raw

    def live_request_ids(self) -> list[str]:
        """Requests the head holds KV or features for."""
        return list(self._seqs)

    def check_integrity(self) -> bool:
        """The head cache's blocks are free or held by a live request."""
        return self.kv.check_integrity([rid for rid in self._seqs])

    def describe(self) -> str:
        """The head's shape and training, for the start-up summary."""
        arch = self.head.arch
        head_vocab = len(self.lm_head.token_ids) if hasattr(self.lm_head, "token_ids") else arch.vocab_size
        acc = self.card.get("heldout_accept_depth1")
        trained = f", trained on {self.card['tokens_seen']:,} tokens" if "tokens_seen" in self.card else ""
        held = f", held-out top-1 {acc:.2f}" if isinstance(acc, (int, float)) else ""
        return f"1 layer (MLP {arch.intermediate_size}, {self.weight_format}), {head_vocab:,}-token head{trained}{held}"

    def memory_bytes(self) -> int:
        """The head's own weights (embedding and most of the LM head are the target's) and KV cache."""
        own = storage_bytes([*self.head.parameters(), *self.head.buffers()])
        head = storage_bytes([*self.lm_head.parameters(), *self.lm_head.buffers()])
        return own + head + sum(t.numel() * t.element_size() for t in self.kv_cache)

    # ------------------------------------------------------------------ passes
    def _pass(self, tokens: list[int], feats: torch.Tensor, positions: list[int], starts: list[int],
              counts: list[int], tables: list[list[int]], tails: list[torch.Tensor | None]) -> torch.Tensor:
        """One head pass over several requests' rows: the head outputs h [rows, hidden]."""
        meta = build_attention_metadata(counts, starts, tables, self.block_size, self.device,
                                        tails if any(t is not None for t in tails) else None)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        emb = self.embed(ids).float()
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.num_forwards += 1
        return self.head.forward_paged(emb, feats, pos, self.rope, self.kv_cache, meta)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head(self.head.readout(h)).float()

    @torch.inference_mode()
    def time_pass(self, batch: int, tokens_per_req: int = 1) -> float:
        """Seconds of one head pass over `batch` requests (start-up profiling, cache empty)."""
        context = 32
        n_blocks = -(-(context + tokens_per_req) // self.block_size)
        if n_blocks > self.kv.num_blocks:
            return float("nan")
        table = list(range(n_blocks))
        n = batch * tokens_per_req
        feats = torch.zeros(n, self.head.arch.hidden_size, device=self.device)
        positions = [context + j for _ in range(batch) for j in range(tokens_per_req)]

        def run() -> None:
            h = self._pass([1] * n, feats, positions, [context] * batch, [tokens_per_req] * batch, [table] * batch,
                           [None] * batch)
            self._logits(h[tokens_per_req - 1 :: tokens_per_req])

        return self.best_of(run)

    def time_catchup(self, tokens: int) -> float:
        """Seconds to feed one request `tokens` features in one pass."""
        return self.time_pass(1, tokens)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """Catch every request's head cache up on its new features (one batched pass whose last
        row per request gives the root's children), then grow trees (EAGLE-2's dynamic
        expansion, see draft_model._TreeDraft) with the head's own predicted features."""
        t0 = time.perf_counter()
        trees: list[_EagleTree] = []
        tokens: list[int] = []
        feats: list[torch.Tensor] = []
        positions: list[int] = []
        starts, counts, tables = [], [], []
        self._fuse([self._seqs[r.request_id] for r, k in zip(requests, num_tokens) if k > 0 and r.request_id in self._seqs])
        for req, k in zip(requests, num_tokens):
            seq = self._seqs.get(req.request_id)
            if k <= 0 or seq is None or req.request_id in self._arriving:  # no draft until its prompt KV is in
                continue
            self.kv.rollback(seq, seq.num_computed_tokens)  # last step's tree nodes
            all_ids = req.all_token_ids
            n_new = seq.num_pending
            # Every feature up to the root's parent (position len - 2) must be here: slot p pairs f_p
            # with x_{p+1}, and the newest slot's output predicts the root's children.
            if n_new == 0 or seq.next_pos != len(all_ids) - 1:
                continue
            cap = min(k, EXPAND_WIDTH * MAX_PASSES)
            if not self.kv.allocate_slots(seq, n_new, num_lookahead_tokens=cap):
                continue
            first = seq.base + seq.num_computed_tokens
            tokens += all_ids[first + 1 : first + 1 + n_new]
            feats += seq.pending.parts
            positions += range(first, first + n_new)
            starts.append(seq.num_computed_tokens)
            counts.append(n_new)
            tables.append(self.kv.block_ids(seq.request_id))
            trees.append(_EagleTree(req, seq, k, cap))  # type: ignore[arg-type]
        if not trees:
            return {}
        h = self._pass(tokens, torch.cat(feats), positions, starts, counts, tables, [None] * len(trees))
        last = torch.tensor(list(itertools.accumulate(counts)), device=h.device) - 1  # each request's last row
        h_root = h.index_select(0, last)
        logits = self._logits(h_root)
        for i, t in enumerate(trees):
            seq = t.seq
            seq.num_computed_tokens += counts[i]
            seq.pending = _Rows()
        self._expand([(t, -1) for t in trees], logits, h_root)

        def run_pass(step: list[tuple[_EagleTree, list[int]]]) -> None:
            toks, feats, pos, starts, tails = zip(*(t.feed(picked) for t, picked in step))
            h = self._pass([x for ts in toks for x in ts], torch.cat(feats), [x for ps in pos for x in ps], list(starts),
                           [len(picked) for _, picked in step], [self.kv.block_ids(t.req.request_id) for t, _ in step],
                           list(tails))
            self._expand(picked_rows(step), self._logits(h), h)

        later = grow_trees(trees, self.pass_cost_ratio, self.p_min, run_pass)
        out = {}
        for t in trees:
            draft = t.select()
            if draft is not None:
                out[t.req.request_id] = draft
        # What the policy charges per pass: the whole call (catch-up, tree building and selection
        # included: a head pass is short enough that they are a large share) over its passes. Not
        # from a call that fed a request more features than steady drafting leaves (its accepted
        # nodes and the next token): that one caught up on a prompt, or on steps that drafted
        # nothing, and the cost model charges catch-up apart (catchup_s_per_token). Counted as a
        # pass, a SmolLM2 request's first draft (48-54 prompt features) read as a 4.5-13 ms pass
        # against ~2-3 steady, and the policy's draft cost stayed high until the next drafts.
        per_pass = (time.perf_counter() - t0) / (1 + len(later))
        steady = max(counts) <= STEADY_CATCHUP
        self.record_timing(t0, [per_pass] * (1 + len(later)) if steady else [], len(trees))
        return out

    def _expand(self, rows: list[tuple[_EagleTree, int]], logits: torch.Tensor, h: torch.Tensor) -> None:
        """Each row's children (`expand_rows`); the row's feature becomes the tree's next
        parent feature, in candidate-row order."""
        expand_rows(rows, logits, self.generator, self.device, self.children)  # type: ignore[arg-type]
        for (t, _), feat in zip(rows, h):
            t.hid.append(feat)


@register_proposer("mtp")
class MTPProposer(EagleProposer):
    """Trees from a multi-token-prediction module (DeepSeek-V3's form, MTPModule) over the target's
    features: the same serving path as EAGLE, the module's own norms around it."""

    def describe(self) -> str:
        """The module's origin and shape, for the start-up summary."""
        origin = {"gguf": "shipped in the GGUF file", "directory": "shipped in the model directory"}.get(
            self.card.get("source", ""), "imported from a checkpoint" if self.card.get("imported") else "trained here")
        return f"MTP module (DeepSeek-V3 form, {origin}): " + super().describe()


# ----------------------------------------------------------------------------- building
def load_head_for(path: str | Path, method: str, target_fp: str | tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, card) of a `method` head file trained for the target with fingerprint target_fp
    (any of them, for a tuple: target_fingerprints) (or, for mtp, a checkpoint's own MTP module:
    its shapes are checked, it carries no fingerprint)."""
    accepted = (target_fp,) if isinstance(target_fp, str) else tuple(target_fp)
    tensors, card = load_head_file(path, method)
    if card.get("imported") and method == "mtp":
        return tensors, card
    if card.get("method") != method:
        raise ConfigError(f"{path} is a {card.get('method')!r} head, not a {method!r} head; use --spec-method "
                          f"{card.get('method')}.")
    if card.get("target") not in accepted:
        raise ConfigError(
            f"The head {path} was trained for another target ({card.get('target_name', '?')}, fingerprint "
            f"{card.get('target')}); this model's fingerprint is {accepted[0]}. Train one for it: "
            f"`specserve train-draft --method {method} --model MODEL`."
        )
    return tensors, card


def restricted_lm_head(target_runner: object, token_ids: torch.Tensor, four_bit: bool = False) -> RestrictedLMHead:
    """The target's LM head over token_ids only: its rows, blocks kept as they are (no dequantizing),
    or requantized to 4 bits (four_bit: Q6_K / Q8_0 rows as Q4_K / Q4_0, requantize_4bit)."""
    from specserve.models.block_linear import BlockQuantLinear, requantize_4bit

    lm = target_runner.model.lm_head
    if isinstance(lm, BlockQuantLinear):
        pw = lm.packed()
        rows = pw.data.index_select(0, token_ids)
        sub = pw._replace(data=rows, shape=(rows.shape[0], pw.shape[1]))
        proj: nn.Module | torch.Tensor = BlockQuantLinear(requantize_4bit(sub) if four_bit else sub)
    else:
        proj = float_rows(lm, token_ids)
    # It learns no ids beyond token_ids (RestrictedLMHead.learn, as a draft model's head does): a
    # head trained against the target's distribution over the subset alone moves its features away
    # from every other id. SmolLM2's EAGLE head (16,384 ids) given the target's rows of the ids its
    # requests had used ranked those ids 6th to 9,432nd (median ~120) where the target wrote them
    # next (34 steps over 16 prose and coding asks): never among its candidates.
    return RestrictedLMHead(proj, token_ids, target_runner.arch.vocab_size)


def quantize_linears(modules: list[nn.Module], four_bit: bool = False) -> None:
    """Every nn.Linear child of `modules` whose rows split into 32-value blocks -> Q8_0 blocks, or
    4-bit ones (four_bit: Q4_K where rows split into 256 values, else Q4_0)."""
    from specserve.models.block_linear import BlockQuantLinear, quantize_4bit, quantize_q8_0

    quantize = quantize_4bit if four_bit else quantize_q8_0
    for mod in modules:
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
                setattr(mod, name, BlockQuantLinear(quantize(child.weight), child.bias))


def build_eagle(path: str | Path, target_runner: object, target_fp: str | tuple[str, ...], cache_block_size: int, num_blocks: int,
                max_positions: int, p_min: float, tree: bool, seed: int, quantize: bool, method: str = "eagle",
                default_ids: torch.Tensor | None = None, four_bit: bool = False) -> EagleProposer:
    """Load an EAGLE head (or an MTP module) file for the target behind `target_runner`; quantize
    its matrices to Q8_0 blocks for the native kernels when the target runs them, or (four_bit) its
    matrices and its rows of the target's LM head to 4-bit blocks. default_ids: the LM-head rows for
    an imported MTP module (None: every id).

    A head's precision moves only its acceptance, never the output, and on a CPU its pass is a
    read of its weights: Qwen2.5-Coder-1.5B's head (MLP 4480, 32k LM-head rows) reads ~80 MB a pass
    in Q8_0 / Q6_K and ~45 MB in 4 bits. Measured on a 2-vCPU Zen 4 (propose() median, two
    alternating rounds): 4.29 / 4.00 -> 3.20 / 2.97 ms; SmolLM2's head (its weights fit the L3)
    1.55 / 1.61 -> 1.47 / 1.37 ms, drafting as many tokens per forward (1.53 / 1.75 / 1.35 / 1.52
    -> 1.51 / 1.73 / 1.35 / 1.54, chain / tree on 8 coding and 8 prose prompts)."""
    tensors, card = load_head_for(path, method, target_fp)
    if card.get("imported"):
        tensors = import_mtp_tensors(tensors, target_runner.arch.hidden_size)
        inter = tensors["layer.mlp.gate_proj.weight"].shape[0] if "layer.mlp.gate_proj.weight" in tensors else None
        card = {**card, "intermediate_size": inter or target_runner.arch.intermediate_size}
        token_ids = default_ids if default_ids is not None else torch.arange(target_runner.arch.vocab_size)
    else:
        token_ids = head_token_ids(path, tensors, target_runner.arch.vocab_size)
    arch = head_arch(target_runner.arch, card["intermediate_size"] if card.get("imported")
                     else card_size(path, card, "intermediate_size"))
    with unset_weights(target_runner.device):
        head = MTPModule(arch) if method == "mtp" else EagleHead(arch, card.get("feature_layers", ()))
    try:
        head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True, assign=True)
    except RuntimeError as exc:  # missing / extra / misshapen tensors
        raise ConfigError(f"{path} does not hold a {method} module for this target: {str(exc)[:300]}") from exc
    head.to(target_runner.device)  # float32 wherever the target runs: the head is small
    four_bit = quantize and four_bit
    lm_head = restricted_lm_head(target_runner, token_ids, four_bit=four_bit)
    if quantize:
        from specserve.models.block_linear import enable_native_ops, layers_stack

        quantize_linears([head, head.layer.self_attn, head.layer.mlp], four_bit=four_bit)
        enable_native_ops(head)
        head.native_stack = layers_stack([head.layer], arch.rms_norm_eps)
    cls = MTPProposer if method == "mtp" else EagleProposer
    proposer = cls(head, target_runner.model.model.embed_tokens, lm_head, num_blocks, cache_block_size,
                   max_positions, p_min=p_min, tree=tree, seed=seed, card=card)
    proposer.weight_format = "4-bit" if four_bit else "Q8_0" if quantize else "float32"
    return proposer
