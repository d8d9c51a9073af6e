"""Prompt-lookup (n-gram) proposer: copy what followed earlier occurrences of the tail, in the
request's own text or in earlier requests' outputs (SuffixDecoding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.request import Request
from specserve.spec.copy_trust import CopyTrust, shared_length
from specserve.spec.edits import ALIGN_MIN_MATCH, EditTracker
from specserve.spec.proposer import (
    RESUME_MATCH,
    Proposer,
    ProposerTraits,
    register_proposer,
)
from specserve.spec.served import ServedOutputs, ServedSource
from specserve.spec.suffix import RepeatWatch, TokenArray, suffix_matches, top_path, weighted_tree
from specserve.spec.tree import DraftTree

if TYPE_CHECKING:
    from specserve.engine.scheduler import SampledTokens

# Occurrences of the matched tail kept per step (the latest ones): enough for the weights.
MAX_OCCURRENCES = 64
SEP = -1  # between a request's reference and its own text in the searched text: never a token
MATCHES_MEASURED = 4  # the request's latest own matches whose shared context is measured


@register_proposer("ngram")
class NgramProposer(ServedSource, Proposer):
    """Searches the request's own prompt and output for its last n tokens; no model, p one-hot.

    As a tree (the default) the draft holds the continuations of every earlier occurrence of
    the longest matching tail, the most frequent first (see specserve.spec.suffix); as a chain,
    the continuation of the latest occurrence. With `served` (SuffixDecoding's global cache,
    see specserve.spec.served) the outputs of earlier requests are searched too, and they draft
    where they share more of the context's tail than the request's own text does. A request's
    reference (`reference_text` / `reference_token_ids`, OpenAI's `prediction`: the file being
    edited) is searched too, as text before its prompt, so a predicted output is copied with
    prompt lookup's trees, trust and learned edits whichever copier the server runs.

    Each node is scored with its chance to be accepted (specserve.spec.copy_trust: the trust in
    its source at its place and shared-context length, learned from the target), and the policy
    verifies the nodes whose scores pay (ProposerTraits.scores_predict_acceptance), so a
    30-token match of an earlier answer drafts long where a one-token match of a common word
    drafts little.
    """

    # Trees by default: on edit prompts (Qwen2.5-Coder 1.5B on auto, AVX2 EPYC, batch 1) a tree of
    # every earlier occurrence beat the latest occurrence's chain, 1.70x vs 1.59x plain.
    traits = ProposerTraits(cost="flat", trees=True, tree_by_default=True, needs_verify_outputs=True,
                            prior_acceptance=0.5, scores_predict_acceptance=True)

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, tree: bool = True,
                 served: ServedOutputs | None = None) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tree = tree
        self.served = served
        self.copies = CopyTrust(("own", "served"))
        self._arrays: dict[str, TokenArray] = {}  # each request's text as an array, grown as it grows
        self._edits: dict[str, EditTracker] = {}  # what each request's output changes in the text it copies
        self._texts: dict[str, list[int]] = {}  # reference, SEP, prompt and output of requests with a reference
        self._repeats = RepeatWatch(RESUME_MATCH)  # copy_resumes' searches
        self._seen: dict[str, tuple[set[int], int]] = {}  # may_draft's: the tokens before each request's last one, and how many

    def remove_request(self, request_id: str, finished: bool = True) -> None:
        """Its last draft is not scored any more (and a finished request's array goes)."""
        self.copies.forget(request_id)
        if finished:
            self._arrays.pop(request_id, None)
            self._texts.pop(request_id, None)
            self._edits.pop(request_id, None)
            self._repeats.forget(request_id)
            self._seen.pop(request_id, None)

    def live_request_ids(self) -> list[str]:
        """Requests whose text is mirrored for the search."""
        return list(self._arrays)

    def may_draft(self, request: Request) -> bool:
        """Whether the request's last token occurs earlier in its text or reference, or an earlier
        output shares its tail: without either, the search finds no match. (Answers kept as a set
        of the tokens seen, grown as the text grows. SmolLM2's coding answers, batch 1: in 207 of
        464 steps the last token was new to the text, and a search and its bookkeeping cost
        ~0.05 ms of a ~4.5 ms step.)"""
        toks = request.all_token_ids
        if not toks:
            return False
        rid = request.request_id
        seen, upto = self._seen.get(rid) or (set(request.sampling_params.reference_token_ids or ()), 0)
        if upto < len(toks) - 1:
            seen.update(toks[upto:-1])
            upto = len(toks) - 1
        self._seen[rid] = (seen, upto)
        return toks[-1] in seen or (self.served is not None and self.served.may_continue(toks))

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> dict[str, DraftTree]:
        """Drafts of up to k nodes for each request with k > 0 (fewer, or none, without matches)."""
        out = {}
        for req, k in zip(requests, num_tokens):
            toks = req.all_token_ids
            self.copies.score_unverified(req.request_id, toks)
            if k <= 0:
                continue
            p = req.sampling_params
            ref = p.reference_token_ids
            text = self._with_reference(req.request_id, ref, toks) if ref else toks
            if (mirror := self._arrays.get(req.request_id)) is None:
                mirror = self._arrays[req.request_id] = TokenArray()
            arr = mirror.view(text)
            # The tail's earlier occurrences, less those an ending id follows (EOS, stop ids:
            # accepted, one adds no token and ends the output, see prune_banned): the longest tail
            # that has others. A chat prompt's text before its `<|im_end|>` is such an occurrence:
            # an answer opening a code fence matched the prompt's closing fence, where "```" alone
            # also matches the opening one, whose "python\n" and code the answer goes on with.
            n, starts = suffix_matches(arr, arr, self.ngram_min, self.ngram_max, exclude_tail=True,
                                       banned_next=req.end_token_set)
            own = shared_length(text, starts[-MATCHES_MEASURED:].tolist(), text) if n else 0
            shared, served = self.served.continuations(toks, k) if self.served is not None else (0, [])
            edits = self._edits.get(req.request_id)
            if edits is None:
                edits = self._edits[req.request_id] = EditTracker()
            edits.advance(text)
            origins: list[int] = []
            if shared > own:  # an earlier output shares more of the context's tail than the request's own text does
                source, conts = "served", served
            else:
                source, shared = "own", own
                conts, origins = edits.weighed(text, starts[::-1][:MAX_OCCURRENCES].tolist(), k) if n else ([], [])
                if ref:  # a copy of the reference ends where the reference does
                    cut = [((c[: c.index(SEP)] if SEP in c else c, w), o) for (c, w), o in zip(conts, origins)]
                    conts, origins = [cw for cw, _ in cut if cw[0]], [o for cw, o in cut if cw[0]]
            tree = weighted_tree(conts, k) if conts else None
            if tree is None:
                continue
            if origins and n >= ALIGN_MIN_MATCH:  # the text the draft's likeliest branch copies: where the output's edits show
                first = tree.token_ids[tree.children[0][0]]
                origin = next((o for (c, _), o in zip(conts, origins) if c and c[0] == first), None)
                if origin is not None:
                    edits.copying_from(origin, len(text))
            if not self.tree:
                tree = top_path(tree)
            out[req.request_id] = self.copies.scored(req.request_id, len(toks), tree, source, shared)
        return out

    def copy_resumes(self, requests: Sequence[Request]) -> bool:
        """A request's last RESUME_MATCH tokens occur earlier in its reference, prompt or output,
        or in an earlier request's output."""
        for req in requests:
            if req.sampling_params.speculative is False:
                continue
            toks = req.all_token_ids
            ref = req.sampling_params.reference_token_ids
            text = self._with_reference(req.request_id, ref, toks) if ref else toks
            if (mirror := self._arrays.get(req.request_id)) is None:
                mirror = self._arrays[req.request_id] = TokenArray()
            arr = mirror.view(text)
            if self._repeats.repeats(req.request_id, arr, arr, exclude_tail=True):
                return True
            if self.served is not None and self.served.continuations(toks, 1)[0] >= RESUME_MATCH:
                return True
        return False

    def _with_reference(self, request_id: str, ref: Sequence[int], toks: Sequence[int]) -> list[int]:
        """The searched text of a request with a reference: the reference, SEP, then its prompt and
        output, kept and grown as they grow (a long reference is not copied every step)."""
        text = self._texts.get(request_id)
        n = len(text) - len(ref) - 1 if text is not None else 0  # own tokens already in it
        if text is None or n > len(toks) or (n and text[-1] != toks[n - 1]):  # new, or not the same text grown
            text, n = [*ref, SEP], 0
            self._texts[request_id] = text
        text.extend(toks[n:])
        return text

    def observe(self, request: Request, draft: DraftTree, result: SampledTokens) -> None:
        """The target's verdict on the draft teaches the trusts."""
        self.copies.observe(request.request_id, draft, result)
