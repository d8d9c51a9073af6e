"""Prompt lookup learns what an edit changes in the text it copies (specserve.spec.edits)."""

from __future__ import annotations

import random

from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.spec.edits import MAX_SPAN, EditTracker
from specserve.spec.ngram import NgramProposer

# "a = balance ; b = balance ; c = balance ;" with `balance` two tokens (7, 8), renamed `funds` (9).
CODE = [1, 2, 7, 8, 3, 4, 2, 7, 8, 3, 5, 2, 7, 8, 3, 6, 2, 7, 8, 3]
RENAMED = [1, 2, 9, 3, 4, 2, 9, 3, 5, 2, 9, 3, 6, 2, 9, 3]


def _follow(tracker: EditTracker, prompt: list[int], output: list[int]) -> list[int]:
    toks = list(prompt)
    tracker.copying_from(0, len(toks))
    for t in output:
        toks.append(t)
        tracker.advance(toks)
    return toks


def test_a_substitution_is_learned_where_the_output_copies_again_and_applied_to_later_copies():
    t = EditTracker()
    toks = _follow(t, CODE, RENAMED[:5])  # "a = funds ; b": departs at `balance`, copies again at "; b"
    assert t.subs == [] and t.seen == {((7, 8), (9,))} and t.pending is None  # seen once: a candidate
    toks = _follow(t, CODE, RENAMED[:9])  # "b = funds ; c": the same change again
    assert t.subs == [((7, 8), (9,))] and t.pending is None
    assert t.substituted(toks, 5, 6) == [4, 2, 9, 3, 5, 2]  # the next line's copy, renamed
    assert t.substituted(toks, 0, 2) is None and t.substituted(toks, 5, 1) is None  # nothing substituted in them
    conts, origins = t.weighed(toks, [5, 0], 4)
    assert conts == [([4, 2, 9, 3], 2.0), ([4, 2, 7, 8], 1.0), ([1, 2, 9, 3], 2.0), ([1, 2, 7, 8], 1.0)]
    assert origins == [5, 5, 0, 0]


def test_text_that_alternates_two_spans_teaches_no_substitution():
    """`def` lines and `return` lines one after the other: copying the wrong one looks like a
    change either way round, and that is no edit."""
    t = EditTracker()
    a, b = (7, 8), (9,)
    t._learn(a, b)
    t._learn(b, a)
    t._learn(a, b)
    t._learn(a, b)
    assert t.subs == [] and frozenset((a, b)) in t.refused


def test_an_insertion_or_a_rewrite_teaches_no_substitution():
    t = EditTracker()
    _follow(t, CODE, [1, 2, 40, 41, 7, 8, 3])  # two tokens inserted, then the copy goes on
    assert t.subs == [] and t.pending is None and t.follow is not None
    t = EditTracker()
    rewrite = [1, 2] + [50 + i for i in range(2 * MAX_SPAN + 4)]  # a new passage: no copy resumes
    _follow(t, CODE, rewrite)
    assert t.subs == [] and t.pending is None and t.follow is None


def test_prompt_lookup_drafts_a_renamed_name_renamed():
    """After the output renamed `balance` twice, later copies of the code are drafted with the
    new name (the original is a lighter branch beside it where the node budget reaches it)."""
    ng = NgramProposer(tree=True)
    prompt = CODE
    req = Request("r", list(prompt), SamplingParams())
    drafts = []
    for tok in RENAMED[:-1]:
        req.append_output_tokens([tok])
        drafts.append(ng.propose([req], [4]).get("r"))
    # After "b = funds ; c =" the draft continues "funds ;".
    tree = drafts[9]  # the context ends "... c =" (RENAMED[:10])
    main, node = [], -1
    while tree.children[node + 1]:
        node = tree.children[node + 1][0]
        main.append(tree.token_ids[node])
    assert main[:4] == [9, 3, 6, 2]
    assert drafts[1].token_ids[0] == 7  # before the output renamed anything, the copy was the original
    assert not ng.live_request_ids() or ng.live_request_ids() == ["r"]
    ng.remove_request("r")
    assert ng._edits == {}


def test_random_texts_keep_the_tracker_consistent():
    """Any output against any prompt: every learned substitution's spans are short and non-empty,
    and a substituted copy is k tokens or fewer."""
    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        t = EditTracker()
        toks = list(prompt)
        t.copying_from(rng.randrange(len(prompt)), len(toks))
        for _ in range(rng.randrange(1, 40)):
            toks.append(rng.randrange(6))
            t.advance(toks)
            if rng.random() < 0.2:
                t.copying_from(rng.randrange(len(toks) - 1), len(toks))
        for src, dst in t.subs:
            assert 1 <= len(src) <= MAX_SPAN and 1 <= len(dst) <= MAX_SPAN
        for s in range(len(toks)):
            sub = t.substituted(toks, s, 5)
            assert sub is None or len(sub) <= 5


def test_a_chance_alignment_gives_way_to_the_one_the_output_copies():
    """The answer's opening matched the end of the prompt (a fence), then the answer copied the
    code at the prompt's top: the departure from the chance match must not hold the tracker
    while the first renames go by."""
    fence = [90, 91]
    prompt = CODE + [60, 61] + fence  # ... code, some words, the fence that ends the prompt
    t = EditTracker()
    toks = list(prompt)
    t.copying_from(len(CODE) + 2, len(toks))  # a chance match: copy from the fence on
    toks.append(fence[0])  # ... but the answer writes the fence's first token ...
    t.advance(toks)
    toks.append(77)  # ... and then departs: a departure waits
    t.advance(toks)
    assert t.pending is not None
    t.copying_from(0, len(toks))  # the next draft copies the code at the top
    for tok in RENAMED[:9]:  # "a = funds ; b = funds ; c"
        toks.append(tok)
        t.advance(toks)
    assert t.rival is None
    assert t.subs == [((7, 8), (9,))]  # both renames were seen: the second made it a substitution


def test_a_change_next_to_a_known_one_is_learned_alone():
    """`.balance = balance` -> `.funds = funds` is two renames (the second already met), not one
    substitution of three tokens."""
    t = EditTracker()
    t._learn((8,), (9,))  # ` balance` -> ` funds` met once
    code = [1, 7, 2, 8, 3, 4, 1, 7, 2, 8, 3, 5]  # "self.balance = balance ;" twice (`.balance` = 7)
    out = [1, 6, 2, 9, 3, 4]  # "self.funds = funds ;"
    _follow(t, code, out)
    assert ((7,), (6,)) in t.seen and not any(len(src) > 1 for src, _ in t.seen)
