"""Distribution audits before a rollout: is speculation exact here, and what does a precision cost?

Two checks, both along teacher-forced continuations (each prompt followed by the reference
model's own greedy continuation), so every position is one the model really meets:

- **speculation**: at each position the target's processed next-token distribution q
  (temperature / top-k / top-p as the user asks) is known exactly from one forward pass. The
  audit runs the engine's verification rule on `draws` independent drafts of that position
  (drawn from the draft model's distribution p, or the continuation's next token as a
  deterministic draft for model-free proposers) and histograms the first token each emits.
  An exact sampler emits q: the audit reports total variation and KL(empirical || q) per
  position, and a chi-square goodness-of-fit p-value; it fails when the smallest p-value,
  Bonferroni-corrected over positions, is below `alpha` (1e-3), or when a token of probability 0
  is emitted. Monte-Carlo noise alone leaves TV of order sqrt(support / draws); the p-value is
  what separates noise from bias. Served (`audit_served`, a running server's sampler against a
  reference computed here, maybe on another kind of machine), the tokens next to a truncation
  cut count as one outcome (`truncation_boundary`).
- **precision**: KL(q_reference || q_candidate) and TV per position between two engines (e.g.
  float32 vs `auto` vs `int4`) on the same tokens; it fails above `max_kl` (mean, nats).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specserve.engine.engine import LLMEngine
from specserve.engine.runner import FeedEntry
from specserve.errors import ConfigError
from specserve.sampling.sampler import SamplingMetadata, logits_to_probs
from specserve.sampling.tree_rejection import TreeVerifyResult, verify_trees
from specserve.sampling_params import SamplingParams
from specserve.spec.tree import DraftTree, SiblingDraw

# (target logits rows, trees, meta, generator) -> results: the verification rule under audit.
Verifier = Callable[[torch.Tensor, Sequence[DraftTree], SamplingMetadata, torch.Generator], list[TreeVerifyResult]]


@torch.inference_mode()
def teacher_forced_logits(engine: LLMEngine, token_ids: Sequence[int]) -> torch.Tensor:  # [len(token_ids), V]
    """Next-token logits at every position of `token_ids`, in one forward pass of an idle engine.

    Uses the first blocks of the KV cache as scratch, so it refuses while requests hold any."""
    runner = engine.runner
    if engine.has_unfinished_requests():
        raise RuntimeError("teacher_forced_logits needs an idle engine (it borrows KV blocks).")
    n = len(token_ids)
    blocks = -(-n // runner.block_size)
    if blocks > runner.num_blocks or n > engine.max_model_len:
        raise ValueError(f"{n} tokens do not fit this engine's KV cache or context; shorten the prompt.")
    entry = FeedEntry(list(token_ids), list(range(n)), 0, list(range(blocks)), None, range(n))
    return runner.forward_logits(runner.feed_inputs([entry])).float()


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [N, V] -> [N, V] probs
    """What a request with `params` samples from (temperature, top-k, top-p)."""
    meta = SamplingMetadata.build([params] * logits.shape[0], [0] * logits.shape[0], logits.device)
    # The flags matter: truncating at top_p = 1 in float32 drops the tail where the cumulative
    # sum rounds to 1 (the sampler skips truncation that is off, so must the audit).
    return logits_to_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.any_top_k, meta.any_top_p,
                           meta.min_p, meta.any_min_p)


@dataclass
class PositionAudit:
    """One position's emitted-token statistics against the exact distribution."""

    tv: float
    kl: float  # KL(empirical || exact), nats
    pvalue: float  # chi-square goodness of fit
    impossible: int  # emitted tokens whose exact probability is 0
    acceptance: float  # fraction of draws whose draft was accepted


@dataclass
class AuditReport:
    """The verdict of one audit and the figures behind it."""

    kind: str  # "speculation" or "precision"
    positions: list[PositionAudit] = field(default_factory=list)
    kl_per_position: list[float] = field(default_factory=list)  # precision audits
    tv_per_position: list[float] = field(default_factory=list)
    passed: bool = True
    reason: str = ""

    def summary(self) -> dict[str, float | int | str | bool]:
        """Aggregates for a table or JSON."""
        if self.kind == "speculation":
            ps = self.positions
            return {"kind": self.kind, "positions": len(ps), "passed": self.passed, "reason": self.reason,
                    "mean_tv": sum(p.tv for p in ps) / max(len(ps), 1),
                    "max_tv": max((p.tv for p in ps), default=0.0),
                    "mean_kl": sum(p.kl for p in ps) / max(len(ps), 1),
                    "min_pvalue": min((p.pvalue for p in ps), default=1.0),
                    "impossible_tokens": sum(p.impossible for p in ps),
                    "mean_acceptance": sum(p.acceptance for p in ps) / max(len(ps), 1)}
        kl, tv = self.kl_per_position, self.tv_per_position
        return {"kind": self.kind, "positions": len(kl), "passed": self.passed, "reason": self.reason,
                "mean_kl": sum(kl) / max(len(kl), 1), "max_kl": max(kl, default=0.0),
                "mean_tv": sum(tv) / max(len(tv), 1), "max_tv": max(tv, default=0.0)}


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:  # [V] counts, [V] exact probs
    from scipy.stats import chisquare

    n = counts.sum()
    keep = probs > 0
    exp = probs[keep].double() * n
    obs = counts[keep].double()
    # Pool cells expected below 5 draws into one, as the test's approximation requires.
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
        exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    if len(exp) < 2:
        return 1.0
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def audit_position(q: torch.Tensor, q_logits: torch.Tensor, drafts: list[DraftTree], params: SamplingParams,
                   verifier: Verifier, generator: torch.Generator) -> PositionAudit:
    """Verify each draft (a one-node tree) against the same target row; compare what comes out with q.

    q: [V] the exact processed distribution; q_logits: [V] the raw logits it came from."""
    n = len(drafts)
    # Verified in chunks of about 256 MB of logits: a root row and a node row per draft (the
    # node's row only feeds the bonus token, which the audit does not count).
    chunk = max(1, (1 << 26) // (2 * q_logits.shape[0]))
    results: list[TreeVerifyResult] = []
    for at in range(0, n, chunk):
        part = drafts[at : at + chunk]
        rows = q_logits.unsqueeze(0).expand(2 * len(part), -1).contiguous()  # [2 * chunk, V]
        meta = SamplingMetadata.build([params] * len(part), [0] * len(part), q_logits.device)
        results += verifier(rows, part, meta, generator)
    first = torch.tensor([r.token_ids[0] for r in results])
    counts = torch.bincount(first, minlength=q.shape[0]).double()
    return _against(counts, q, sum(1 for r in results if r.accepted_nodes) / n)


def _against(counts: torch.Tensor, q: torch.Tensor, acceptance: float, pool: torch.Tensor | None = None) -> PositionAudit:
    """Emitted-token counts ([V]) against the exact distribution q ([V]); the tokens of `pool`
    ([V] bool, if any) count as one outcome, their counts and their mass summed."""
    if pool is not None and bool(pool.any()):
        keep = ~pool
        counts = torch.cat([counts[keep], counts[pool].sum().reshape(1)])
        q = torch.cat([q[keep].double(), q[pool].double().sum().reshape(1)])
    emp = counts / counts.sum()
    exact = q.double()
    impossible = int(counts[exact == 0].sum())
    tv = 0.5 * float((emp - exact).abs().sum())
    nz = emp > 0
    kl = float((emp[nz] * (emp[nz] / exact[nz].clamp_min(1e-300)).log()).sum())
    return PositionAudit(tv, kl, _chi_square_pvalue(counts, exact), impossible, acceptance)


def audit_speculation(
    target_logits: torch.Tensor,  # [T, V] teacher-forced target logits of the audited positions
    next_tokens: Sequence[int],  # [T] the continuation's token after each position
    params: SamplingParams,
    draft_logits: torch.Tensor | None = None,  # [T, V] a draft model's logits there (None: one-hot drafts)
    draws: int = 10_000,
    alpha: float = 1e-3,
    verifier: Verifier = verify_trees,
    seed: int = 0,
) -> AuditReport:
    """Does verification emit the target's distribution at each position? (see the module docstring)"""
    g = torch.Generator().manual_seed(seed)
    q_all = processed(target_logits, params)
    p_all = processed(draft_logits, params) if draft_logits is not None else None
    report = AuditReport("speculation")
    for t in range(target_logits.shape[0]):
        if p_all is None:  # a model-free proposer: the continuation's own next token, one-hot
            drafts = [DraftTree.chain([int(next_tokens[t])])] * draws
        else:
            p = p_all[t]
            toks = torch.multinomial(p, draws, replacement=True, generator=g).tolist()
            dists = p.unsqueeze(0)
            drafts = [DraftTree((x,), (-1,), SiblingDraw.IID, dists, (0,)) for x in toks]
        report.positions.append(audit_position(q_all[t], target_logits[t], drafts, params, verifier, g))
    return _judge(report, alpha)


def _judge(report: AuditReport, alpha: float) -> AuditReport:
    """Fail a speculation audit on any impossible token or a Bonferroni-corrected p below alpha."""
    if report.positions:
        worst = min(p.pvalue for p in report.positions) * len(report.positions)
        impossible = sum(p.impossible for p in report.positions)
        if impossible:
            report.passed, report.reason = False, f"{impossible} emitted tokens have probability 0 under the target"
        elif worst < alpha:
            report.passed = False
            report.reason = (f"emitted tokens differ from the target's distribution: Bonferroni-corrected chi-square "
                             f"p = {worst:.2e} < {alpha:g}")
    return report


class ServedAPI:
    """The few calls an audit makes to a running OpenAI-compatible server (standard library HTTP)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--url {url!r} is not an http(s) address; give e.g. http://127.0.0.1:8000.")
        self.base = url.rstrip("/").removesuffix("/v1")
        self.api_key, self.timeout_s = api_key, timeout_s

    def post(self, path: str, body: dict | None = None) -> dict:
        """The JSON object the server answers (a GET without a body), or a ConfigError saying why not."""
        import json
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base + path, data, headers),
                                        timeout=self.timeout_s) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace")
            raise ConfigError(f"{self.base}{path} answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ConfigError(f"cannot reach {self.base}{path}: {getattr(e, 'reason', e)}; is the server up?") from None
        if not isinstance(out, dict):
            raise ConfigError(f"{self.base}{path} answered with JSON that is not an object; is it OpenAI-compatible?")
        return out

    def model_card(self) -> dict:
        """The server's first entry of /v1/models (with an `id`)."""
        try:
            card = self.post("/v1/models")["data"][0]
            str(card["id"])
            return card
        except (KeyError, IndexError, TypeError, ConfigError) as e:
            raise ConfigError(f"cannot list the models at {self.base}/v1/models ({e}); is --url an "
                              "OpenAI-compatible server?") from None

    def model_name(self) -> str:
        """The id the server serves under (its first model)."""
        return str(self.model_card()["id"])


PRECISION_KEYS = ("quantization", "dtype", "kv_cache_dtype")  # LLM's arguments a specserve server's card names


def served_precision(card: dict) -> dict[str, str] | None:
    """The precision a specserve server's model card says it computes in, or None (another
    server, or a card without one)."""
    said = card.get("precision")
    if not isinstance(said, dict) or not all(isinstance(said.get(k), str) for k in PRECISION_KEYS):
        return None
    return {k: said[k] for k in PRECISION_KEYS}


def _precision_text(precision: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in precision.items())


# Where truncation cuts (top-k, top-p, min-p), another machine's numerics may keep a token the
# reference drops and drop the one it keeps: logits agree across machine kinds to ~1e-3, not to the
# bit. A served audit pools the tokens within this much of the cut (after temperature: logits, and
# top-p's mass) into one outcome, so a swap there is neither "impossible" nor a failed fit.
BOUNDARY_TOL = 1e-2


def truncation_boundary(logits: torch.Tensor, q: torch.Tensor, params: SamplingParams,
                        tol: float = BOUNDARY_TOL) -> torch.Tensor:  # [V] logits, [V] probs -> [V] bool
    """The tokens on either side of where `params`' truncation cuts `logits` (q: what it keeps)
    that a perturbation of `tol` (in temperature-scaled logits, or top-p's mass) could move across
    the cut: those within `tol` of the lowest kept logit, and where top-p's mass before the last
    kept or first dropped token lies within `tol` of top_p, that token and its near-ties. None
    where nothing is truncated."""
    top_k = params.effective_top_k
    if params.is_greedy or not (top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0):
        return torch.zeros_like(q, dtype=torch.bool)
    kept = q > 0
    scaled = logits.double() / params.temperature
    edge = scaled[kept].min()
    near = (scaled - edge).abs() <= tol
    if params.top_p < 1.0:
        # The mass top-p sees, through each rank: after min-p and top-k (vLLM's order).
        order = scaled.argsort(descending=True)
        ranked = scaled[order]
        allowed = torch.ones_like(ranked, dtype=torch.bool)
        if top_k > 0:
            allowed[top_k:] = False
        if params.min_p > 0.0:
            allowed &= ranked >= ranked[0] + math.log(params.min_p)
        mass = torch.softmax(ranked.masked_fill(~allowed, float("-inf")), dim=0).cumsum(0)
        last = int(kept.sum()) - 1
        for r in (last, last + 1):
            if 0 < r < len(order) and abs(float(mass[r - 1]) - params.top_p) <= tol:
                near |= (scaled - ranked[r]).abs() <= tol
    return near


SERVED_N = 16  # samples per request (the server's `n` limit)
SERVED_MIN = 100  # answers a position needs to be judged (fewer pool into one chi-square cell and test nothing)


def audit_served(api: ServedAPI, sequences: Sequence[Sequence[int]], positions: Sequence[int],
                 target_logits: torch.Tensor, params: SamplingParams, draws: int = 2_000,
                 alpha: float = 1e-3) -> tuple[AuditReport, dict[str, int]]:
    """Does the served sampler, speculation and all, emit the target's distribution?

    At each audited position j of a teacher-forced sequence s the exact distribution q of s[j+1]
    given s[:j+1] is known locally (target_logits[k], from the reference model). The server is
    asked for three tokens after s[:j], `n` at a time with speculation asked for; the draws whose
    first token is s[j] make their second token a draw from q, written in a decode step, where a
    server that speculates verifies drafts. Those are histogrammed and tested as the offline audit
    does (`draws` per position; a position whose first token the server rarely writes gets fewer).
    Returns the report and the server's speculation counters over the audit (its `usage`)."""
    q_all = processed(target_logits, params)
    model = api.model_name()
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "min_p": params.min_p,
                "top_k": params.top_k if params.top_k > 0 else -1}
    spec = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "requests": 0, "untested_positions": 0}
    need = min(SERVED_MIN, draws)
    report = AuditReport("speculation")
    for k, (s, j) in enumerate(zip(sequences, positions)):
        counts = torch.zeros(q_all.shape[1], dtype=torch.float64)  # second tokens of the answers that match
        matched, sent, drafted, accepted = 0, 0, spec["draft_tokens"], spec["accepted_tokens"]
        while matched < draws and sent < 8 * -(-draws // SERVED_N):  # (first tokens of probability >= 1/8 fill it)
            # Three tokens, of which the second is counted: a draft is made only for tokens that may
            # still follow it (the last token of an answer is never drafted).
            body = {"model": model, "prompt": list(s[:j]), "max_tokens": 3, "n": SERVED_N, "ignore_eos": True,
                    "speculative": True, "logprobs": 0, "return_tokens_as_token_ids": True, **sampling}
            out = api.post("/v1/completions", body)
            sent += 1
            for c in out.get("choices") or []:
                tokens = ((c.get("logprobs") or {}).get("tokens") or []) if isinstance(c, dict) else []
                if not all(isinstance(t, str) and t.startswith("token_id:") and t[9:].isdigit() for t in tokens):
                    raise ConfigError(f"{api.base} names tokens by their text ({tokens[:3]!r}), not by id: it does not "
                                      "support return_tokens_as_token_ids (vLLM's), which this audit needs.")
                ids = [int(t[9:]) for t in tokens]
                if len(ids) == 3 and ids[0] == s[j] and 0 <= ids[1] < counts.shape[0]:
                    counts[ids[1]] += 1
                    matched += 1
            served = (out.get("usage") or {}).get("speculation") or {}
            for key in ("verify_steps", "draft_tokens", "accepted_tokens"):
                spec[key] += int(served.get(key) or 0)
        spec["requests"] += sent
        drafted, accepted = spec["draft_tokens"] - drafted, spec["accepted_tokens"] - accepted
        if matched >= need:  # (acceptance: of the draft tokens verified for this position's requests)
            pool = truncation_boundary(target_logits[k], q_all[k], params)
            report.positions.append(_against(counts, q_all[k], accepted / drafted if drafted else 0.0, pool))
        else:
            spec["untested_positions"] += 1
    if not report.positions:
        report.passed, report.reason = False, (
            f"in no position did {need} answers begin with the continuation's own token "
            f"({spec['untested_positions']} positions): is the server serving --model, with these sampling settings?")
        return report, spec
    report = _judge(report, alpha)
    if report.passed and not spec["verify_steps"]:  # what was audited, said where it is read
        report.reason = ("the server verified no drafts for these requests (its policy did not speculate): its plain "
                         "sampler was audited; a server run with --spec-policy always audits verification")
    return report, spec


def audit_precision(reference_logits: torch.Tensor, candidate_logits: torch.Tensor,  # [T, V] each
                    params: SamplingParams, max_kl: float = 0.1) -> AuditReport:
    """KL(reference || candidate) and TV of the processed distributions, position by position."""
    q = processed(reference_logits, params).double()
    c = processed(candidate_logits, params).double()
    report = AuditReport("precision")
    for a, b in zip(q, c):
        nz = a > 0
        kl = float((a[nz] * (a[nz].log() - b[nz].clamp_min(1e-300).log())).sum())
        report.kl_per_position.append(kl if math.isfinite(kl) else float("inf"))
        report.tv_per_position.append(0.5 * float((a - b).abs().sum()))
    mean = sum(report.kl_per_position) / max(len(report.kl_per_position), 1)
    if mean > max_kl:
        report.passed, report.reason = False, f"mean KL {mean:.4f} nats exceeds {max_kl:g}"
    return report


def continuations(engine: LLMEngine, prompts: Sequence[str | Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt plus the engine's greedy continuation, as token ids (the teacher-forced sequences)."""
    out = []
    for i, prompt in enumerate(prompts):
        rid = engine.add_request(prompt if isinstance(prompt, str) else list(prompt),
                                 SamplingParams(max_tokens=max_tokens, temperature=0), request_id=f"audit-{i}")
        ids: list[int] = []
        while engine.has_request(rid):
            for o in engine.step():
                if o.request_id == rid:
                    ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        out.append(ids)
    return out


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: JSON lines with a "prompt" (or chat "messages") field, else one per line."""
    import json
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # (a ValueError that names neither the file nor the place)
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}); give prompts one per line, or as JSON "
                         "lines.") from None
    prompts: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}: a line starting with '{{' is not valid JSON: {exc}") from None
            if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str) and obj["prompt"]
                                                 or isinstance(obj.get("messages"), list) and obj["messages"]):
                raise ValueError(f'{path}: each JSON line needs a "prompt" string or a "messages" list.')
            prompts.append(obj.get("prompt") or json.dumps(obj.get("messages", "")))
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompt.")
    return prompts


def run_audit(
    model: str,
    prompts: Sequence[str],
    *,
    spec_method: str = "none",
    draft_model: str | None = None,
    precisions: Sequence[str] = (),
    params: SamplingParams | None = None,
    continuation_tokens: int = 32,
    positions: int = 8,
    draws: int = 10_000,
    alpha: float = 1e-3,
    max_kl: float = 0.1,
    url: str | None = None,
    api_key: str | None = None,
) -> list[dict]:
    """The audits `specserve audit` runs: speculation (when a method or draft is given) on the
    model's default precision, the sampler of the server at `url` (speculation as it serves), and
    each precision in `precisions` against float32."""
    from specserve import LLM

    params = params or SamplingParams(temperature=1.0)
    api = ServedAPI(url, api_key) if url else None
    # A served audit's reference computes as the server says it does (a server on int4 sampled
    # against this machine's `auto` would fail on the precisions' KL alone), unless told otherwise.
    server_precision = served_precision(api.model_card()) if api is not None else None  # (it answers, first)
    reference_precision = {"quantization": precisions[0]} if precisions else server_precision or {}
    rows: list[dict] = []
    try:
        reference = LLM(model, **reference_precision, kv_cache_gib=0.25, profile_spec_costs=False)
    except ConfigError as e:
        if precisions or server_precision is None:
            raise
        raise ConfigError(f"the server at {api.base} computes in {_precision_text(server_precision)}, which the "
                          f"reference cannot here ({e}); give --precisions P to choose the reference's.") from None
    seqs = continuations(reference.engine, prompts, continuation_tokens)
    # The last `positions` positions of each continuation: what the model generated itself.
    spots = [(s, range(max(1, len(s) - positions - 1), len(s) - 1)) for s in seqs]
    ref_logits = [teacher_forced_logits(reference.engine, s)[list(r)] for s, r in spots]
    if spec_method != "none" or draft_model:
        draft_logits = None
        if draft_model:
            draft = LLM(draft_model, kv_cache_gib=0.25, profile_spec_costs=False)
            draft_logits = torch.cat([teacher_forced_logits(draft.engine, s)[list(r)] for s, r in spots])
            v = ref_logits[0].shape[1]
            if draft_logits.shape[1] != v:
                draft_logits = draft_logits[:, :v] if draft_logits.shape[1] > v else torch.nn.functional.pad(
                    draft_logits, (0, v - draft_logits.shape[1]), value=float("-inf"))
        nxt = [s[i + 1] for s, r in spots for i in r]
        rep = audit_speculation(torch.cat(ref_logits), nxt, params, draft_logits, draws=draws, alpha=alpha)
        rows.append({"audit": f"speculation ({draft_model or spec_method})", **rep.summary()})
    if api is not None:
        at = [(s, i) for s, r in spots for i in r]
        rep, spec = audit_served(api, [s for s, _ in at], [i for _, i in at], torch.cat(ref_logits), params,
                                 draws=draws, alpha=alpha)
        ran_in = reference.engine.precision  # as resolved here (what was asked for may be "auto")
        if not rep.passed and server_precision is not None and ran_in != server_precision:
            rep.reason += (f" (the reference ran in {_precision_text(ran_in)}, the server in "
                           f"{_precision_text(server_precision)}: the precisions differ too)")
        elif not rep.passed and server_precision is None and not precisions:
            rep.reason += (" (the server does not say what precision it computes in, so the reference ran in this "
                           f"machine's defaults, {_precision_text(ran_in)}: give --precisions P to match it)")
        rows.append({"audit": f"served sampler at {api.base}", **rep.summary(),
                     **{f"served_{k}": v for k, v in spec.items()},
                     "reference_precision": _precision_text(ran_in),
                     "server_precision": _precision_text(server_precision) if server_precision else "not said"})
    for precision in precisions[1:]:
        cand = LLM(model, quantization=precision, kv_cache_gib=0.25, profile_spec_costs=False)
        cand_logits = [teacher_forced_logits(cand.engine, s)[list(r)] for s, r in spots]
        rep = audit_precision(torch.cat(ref_logits), torch.cat(cand_logits), params, max_kl=max_kl)
        rows.append({"audit": f"precision {precision} vs {precisions[0]}", **rep.summary()})
    return rows
