"""What an output changes in the text it copies: learned substitutions for prompt lookup.

An edit of code in the prompt ("rename `balance` to `funds`", "replace print with logging")
copies most of the code and changes the same few spans wherever they occur. A copier that only
follows earlier occurrences breaks its run at every such span: the copy says `balance`, the
target writes `funds`, and the run starts again from a short match a few tokens later.

`EditTracker` keeps, per request, the position in its own text that its output was last copying
(the alignment the proposer drafted from). When the output departs from it, the tracker waits
until the output copies again (RESYNC tokens equal to the source's after a span of each) and
notes the substitution: the source span the output skipped, the output span it wrote instead.
Once the same substitution is seen twice (and never the other way round), later copies of the
source offer the substituted text beside the original (the proposer
weighs both; the target decides), so the second and later occurrences of a renamed name are
drafted renamed. Only drafts change: verification keeps the output the target's.

A departure is a hypothesis about where the output was copying from, and the alignment it came
from may have been a chance match (the answer's opening fence matched the fence that ends the
prompt, and the answer then copied the code at its top). While a departure waits, the alignment
a new draft copies from is followed beside it as a rival: if the output copies the rival's text
for CONFIRM tokens (or RESYNC, then departs from it too) before the departure resyncs, the rival
was right and the departure goes
(Qwen2.5-Coder 1.5B renaming `balance` in a class: the opening fence's departure held the
tracker for the first 14 tokens of code, so the first renamed spans taught nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

MAX_SPAN = 6  # tokens a substitution may replace, and write (an identifier, a call's name)
RESYNC = 2  # tokens the output must copy again after the changed span (with the change applied: `x = x`)
MAX_SUBS = 16  # substitutions kept per request, the latest first
SUB_WEIGHT = 2.0  # a substituted copy's weight against the original's 1.0 (drafted first; both kept)
MAX_SUBSTITUTED = 8  # continuations per step the substitutions are applied to (the latest matches)
ALIGN_MIN_MATCH = 2  # a draft sets the alignment only from a match of at least this many tokens
CONFIRM = RESYNC + 1  # tokens a rival alignment must copy, while a departure waits, to replace it

Sub = tuple[tuple[int, ...], tuple[int, ...]]  # (source span, output span)


class EditTracker:
    """One request's alignment with the text it copies and the substitutions learned from it."""

    __slots__ = ("follow", "pending", "refused", "rival", "seen", "subs")

    def __init__(self) -> None:
        self.follow: tuple[int, int] | None = None  # (source position, output position) being copied
        self.pending: tuple[int, int] | None = None  # where the output departed, until it copies again
        # While a departure waits: (source position, output position, tokens it has copied) of the
        # alignment a later draft copied from
        self.rival: tuple[int, int, int] | None = None
        self.subs: list[Sub] = []  # (source span, output span), applied
        self.seen: set[Sub] = set()  # changes seen once
        self.refused: set[frozenset] = set()  # pairs of spans seen changed both ways

    def copying_from(self, source: int, position: int) -> None:
        """The draft for the context of `position` tokens copies the text from `source` on: the
        alignment where there is none (one the output still follows is kept: a short match's
        draft may copy from another place that happens to share a token or two)."""
        if self.pending is None and self.follow is None:
            self.follow = (source, position)
        elif self.pending is not None and self.rival is None and source < position:
            self.rival = (source, position, 0)

    def advance(self, tokens: Sequence[int]) -> None:
        """Follow the output along its alignment; where it departed, learn the substitution once it
        copies again."""
        n = len(tokens)
        if self.follow is not None:
            p, i = _along(tokens, *self.follow)
            if i < n and p < i:
                self.pending, self.follow = (p, i), None
            else:
                self.follow = (p, i)
        if self.pending is not None:
            self._resync(tokens)  # first: a rival that starts where the output copies again is the resync
        if self.pending is None:
            self.rival = None
        elif self.rival is not None:
            p0, i0, copied = self.rival
            p, i = _along(tokens, p0, i0)
            copied += i - i0
            self.rival = (p, i, copied) if i == n else None
            # The output copied the rival's text (CONFIRM tokens, or RESYNC and then departed from
            # it too): the waiting departure was a chance match's, and the rival's own departure,
            # if any, waits instead. One that copied less goes.
            if copied >= CONFIRM or (i < n and copied >= RESYNC):
                self.rival = None
                if i < n:
                    self.pending = (p, i)
                    self._resync(tokens)
                else:
                    self.pending, self.follow = None, (p, i)

    def _resync(self, tokens: Sequence[int]) -> None:
        """The smallest (source span a, output span b) after which the output copies the source
        again; a >= 1 is a substitution (a = 0, an insertion, teaches nothing to copy)."""
        p, i = self.pending  # type: ignore[misc]
        n = len(tokens)
        # Changes met before, which the text after this one may hold too (the seen ones up to MAX_SUBS:
        # the index is built once per call and read at each candidate span).
        known = _by_first([*self.subs, *itertools.islice(self.seen, MAX_SUBS)])
        # The copy's first token is the source's own or the first written by a change (a known one
        # or this span's, whose output starts at tokens[i]): only spans whose next output token is
        # one of them can resync, and only those are tried, in the order of the search (fewest
        # tokens changed, then fewest written). Prose kept a departure pending for most steps,
        # each trying all 72 spans: ~40 us of a prompt-lookup proposal.
        firsts = {dst[0] for subs in known.values() for _, dst in subs}
        spans = []
        for b in range(1, MAX_SPAN + 1):
            if i + b + RESYNC > n:
                break
            after = tokens[i + b]
            anywhere = after in firsts or after == tokens[i]
            spans.extend((a + b, b, a) for a in range(min(MAX_SPAN, i - RESYNC - p) + 1)
                         if anywhere or tokens[p + a] == after)
        for _, b, a in sorted(spans):
            # The output goes on as the source after the span does, the change applied there too
            # (and the changes met before: `.balance = balance` is two renames, not one of three tokens).
            src, dst = tuple(tokens[p : p + a]), tuple(tokens[i : i + b])
            change = (src, dst) if a else None
            if _copied(tokens, p + a, RESYNC, known, i, change)[0] == tokens[i + b : i + b + RESYNC]:
                if a:
                    self._learn(src, dst)
                self.pending, self.follow = None, (p + a + RESYNC, i + b + RESYNC)
                return
        if n - i > 2 * MAX_SPAN + RESYNC:  # no copy resumed nearby: a rewrite, not a substitution
            self.pending = None

    def _learn(self, source: tuple[int, ...], written: tuple[int, ...]) -> None:
        """A change seen once is a candidate; seen again (another occurrence changed alike), it
        is applied. One seen both ways (a -> b and b -> a) is the text alternating, not an edit:
        structured or repetitive text (`return` lines after `def` lines) looks like that."""
        if (written, source) in self.seen or (written, source) in self.subs:
            self.seen.discard((written, source))
            self.subs = [s for s in self.subs if s != (written, source)]
            self.refused.add(frozenset((source, written)))
            return
        if frozenset((source, written)) in self.refused:
            return
        if (source, written) not in self.seen:
            self.seen.add((source, written))
            return
        self.subs = [(source, written)] + [s for s in self.subs if s[0] != source][: MAX_SUBS - 1]

    def substituted(self, tokens: Sequence[int], start: int, k: int) -> list[int] | None:
        """The k tokens copied from `start` with every learned substitution applied (None where
        none applies)."""
        out, changed = _copied(tokens, start, k, _by_first(self.subs), len(tokens))
        return out if changed else None

    def weighed(self, tokens: Sequence[int], starts: Sequence[int], k: int,
                ) -> tuple[list[tuple[list[int], float]], list[int]]:
        """The continuations of `starts` (latest first), each substituted copy before its original,
        and the start each was copied from."""
        conts: list[tuple[list[int], float]] = []
        origins: list[int] = []
        index = _by_first(self.subs)  # once per step, not per continuation
        for idx, s in enumerate(starts):
            if index and idx < MAX_SUBSTITUTED:
                sub, changed = _copied(tokens, s, k, index, len(tokens))
                if changed:
                    conts.append((sub, SUB_WEIGHT))
                    origins.append(s)
            conts.append((list(tokens[s : s + k]), 1.0))
            origins.append(s)
        return conts, origins


def _along(tokens: Sequence[int], p: int, i: int) -> tuple[int, int]:
    """(source, output) positions after the output's tokens from i on that equal the source's from p on."""
    n = len(tokens)
    while i < n and p < i and tokens[p] == tokens[i]:
        p, i = p + 1, i + 1
    return p, i


def _by_first(subs: Sequence[Sub]) -> dict[int, list[Sub]]:
    """Substitutions by their source span's first token, in their order."""
    index: dict[int, list[Sub]] = {}
    for sub in subs:
        index.setdefault(sub[0][0], []).append(sub)
    return index


def _copied(tokens: Sequence[int], start: int, k: int, by_first: dict[int, list[Sub]], end: int,
            first: Sub | None = None) -> tuple[list[int], bool]:
    """Up to k tokens copied from tokens[start:end], each occurrence of a substitution's source
    span written as its output span (`first`, then the listed ones in order: the first that
    applies wins), and whether one was."""
    out: list[int] = []
    j, changed = start, False
    while j < end and len(out) < k:
        subs = by_first.get(tokens[j], ())
        if first is not None and first[0][0] == tokens[j]:
            subs = [first, *subs]
        for src, dst in subs:
            if tuple(tokens[j : j + len(src)]) == src:
                out.extend(dst)
                j += len(src)
                changed = True
                break
        else:
            out.append(tokens[j])
            j += 1
    return out[:k], changed
