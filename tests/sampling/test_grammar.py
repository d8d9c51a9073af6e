"""Structured output: grammar masks, draft pruning, and exact constrained speculative sampling.

The exactness test follows test_tree_rejection: the target is a Markov chain over a tiny
vocabulary, drafts are trees drawn from another chain (deterministic, i.i.d. or without
replacement, so some nodes break the grammar), each trial's draft is pruned and its rows masked
by a real GrammarState, and the emitted pairs are compared with constrained sampling from the
target alone: mq_0(x1) * mq_1(x2 | x1), each the target's processed distribution restricted to
what the grammar allows after the path and renormalised.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time

import pytest
import torch
from scipy.stats import chisquare

from specserve.errors import InvalidRequestError
from specserve.sampling.grammar import (
    COMPILES_AT_ONCE,
    STRUCTURED_PARAM,
    GrammarCompiler,
    apply_masks,
    forbid_unless_only,
    never_ending_rules,
)
from specserve.sampling.sampler import SamplingMetadata, logits_to_probs
from specserve.sampling.tree_rejection import verify_trees
from specserve.sampling_params import SamplingParams, StructuredOutput
from specserve.spec.tree import DraftTree, SiblingDraw

VOCAB = ["a", "b", "c", "d", "e", "f", "g", "<eos>"]
V = len(VOCAB)
EOS = 7
# After a or b only c, d or e; after c only a, d or f; d, e and f may be followed by anything
# but the end comes only after f or g: the allowed set depends on the path.
REGEX = "(([ab][cde])|(c[adf])|[defg])*[fg]"
DRAWS = int(os.environ.get("SPECSERVE_GRAMMAR_DRAWS", 300_000))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(VOCAB, V, [EOS])


def allowed_after(compiler: GrammarCompiler, path: list[int]) -> torch.Tensor:  # [V] bool
    """Brute force: which tokens a fresh matcher accepts after `path` (None if path is invalid)."""
    state = compiler.new_state(StructuredOutput.regex(REGEX))
    state.accept(path)
    assert state.num_rejected == 0, path
    return torch.tensor([state.valid(t) for t in range(V)])


def unpack(masks: torch.Tensor) -> torch.Tensor:  # [R, W] int32 -> [R, V] bool
    bits = torch.arange(32, dtype=torch.int32)
    return ((masks.unsqueeze(-1) >> bits) & 1).bool().reshape(masks.shape[0], -1)[:, :V]


def test_masks_follow_each_node_path(compiler: GrammarCompiler) -> None:
    state = compiler.new_state(StructuredOutput.regex(REGEX))
    state.accept([0])  # "a": next must be c, d or e
    tree = DraftTree((2, 3, 0, 1, 5), (-1, -1, 0, 0, 1))  # c, d; c -> a, c -> b; d -> f
    masks = torch.empty(1 + len(tree), state.num_words, dtype=torch.int32)
    state.fill_masks(tree, masks)
    got = unpack(masks)
    assert got[0].tolist() == allowed_after(compiler, [0]).tolist()
    for i in range(len(tree)):
        path = [0] + [tree.token_ids[n] for n in tree.path(i)]
        assert got[1 + i].tolist() == allowed_after(compiler, path).tolist(), path
    assert state.valid(2) and not state.valid(0)  # the matcher is back at the root


def test_forced_text_inside_a_character_is_empty_not_an_error(smollm_checkpoint) -> None:
    """A byte-level token can carry the first byte of a character the grammar forces; the forced
    rest is then no text. It crashed the engine's step (UnicodeDecodeError out of xgrammar)."""
    tok = smollm_checkpoint.tokenizer
    compiler = GrammarCompiler.for_tokenizer(tok, smollm_checkpoint.arch.vocab_size)
    state = compiler.new_state(StructuredOutput.choice(["中文"]))
    assert state.forced_text() == "中文"
    first_byte = tok.token_to_id("ä")  # byte 0xE4, the first of 中's three (GPT-2's byte spelling)
    state.accept([first_byte])
    assert state.num_rejected == 0
    assert state.forced_text() == ""
    assert not state.valid(first_byte)  # inside the character only its own continuation fits


ENDLESS = [  # (spec, a rule the check must name)
    (StructuredOutput.json({"type": "array", "minItems": 1, "items": {"$ref": "#"}}), "root"),
    (StructuredOutput.json({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}), "root"),
    # The root can end ({} or {"ok": 1}), but a model that opens "loop" could never close it.
    (StructuredOutput.json({"type": "object", "properties": {"ok": {"type": "integer"}, "loop": {
        "type": "object", "properties": {"z": {"$ref": "#/properties/loop"}}, "required": ["z"]}}}), "properties_loop"),
    (StructuredOutput.grammar('root ::= "[" root "]"'), "root"),
    (StructuredOutput.grammar('root ::= "a" | "b" x\nx ::= "c" x+'), "x"),
    # A class no character is in: a matcher there allowed no token at all.
    (StructuredOutput.regex("ab[^\\s\\S]"), "root"),
    (StructuredOutput.json({"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\d\\D]+"}},
                            "required": ["a"]}), "root_prop_0"),
    (StructuredOutput.grammar('root ::= "a" [^\\0-\\x7f\\x80-\\U0010ffff]'), "root"),
]
ENDING = [  # recursive, but each recursion has a way out
    StructuredOutput.json({"type": "object", "properties": {"x": {"$ref": "#"}}}),
    StructuredOutput.json({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}, "required": ["kids"]}}, "$ref": "#/$defs/n"}),
    StructuredOutput.json({"oneOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}),
    StructuredOutput.json({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$", "minLength": 2},
                                                            "n": {"type": "integer", "minimum": 3}}, "required": ["s", "n"]}),
    StructuredOutput.grammar('root ::= obj\nobj ::= "{" (pair ("," pair)*)? "}"\npair ::= [a-z]+ ":" (obj | [0-9]+)'),
    StructuredOutput.grammar('root ::= "a" root "b" | "c" "d"{2,} [x-z]*'),
    StructuredOutput.regex("(ab|c)+[0-9]{2,}"),
    StructuredOutput.regex("[^\\s\\S]?x[^a-z\\-]"),  # an empty class that may be left out
    StructuredOutput.choice(["yes", "no"]),
]


@pytest.mark.parametrize("spec,rule", ENDLESS)
def test_a_grammar_without_a_finite_output_is_refused_naming_its_rules(compiler: GrammarCompiler, spec, rule) -> None:
    """No finite text satisfies these (or a reachable branch of them): a matcher inside such a rule
    has an endless forced continuation, which xgrammar's jump-forward lookup built until the
    server ran out of memory. They are refused when compiled, naming the request field."""
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(spec)
    assert err.value.param == STRUCTURED_PARAM[spec.kind]
    assert rule in str(err.value) and ("no finite" in str(err.value))


@pytest.mark.parametrize("spec", ENDING)
def test_recursive_grammars_with_a_way_out_compile_and_end(compiler: GrammarCompiler, spec) -> None:
    compiled = compiler.compile(spec)
    assert never_ending_rules(str(compiled.grammar)) == []
    compiler.new_state(spec).forced_text()  # returns


def test_grammar_text_the_check_cannot_read_is_never_refused() -> None:
    """A construct it does not know (a later xgrammar's) is taken to end: no refusal on a guess."""
    assert never_ending_rules('root ::= (("a" root))') == ["root"]
    assert never_ending_rules('root ::= (("a" root)) <<unknown>>') == []
    assert never_ending_rules('root ::= ((Future("x)", n=1) root))') == ["root"]  # a call is a terminal
    assert never_ending_rules('root ::= ((Future("x)", n=1)))') == []


def test_prune_cuts_what_the_grammar_refuses(compiler: GrammarCompiler) -> None:
    state = compiler.new_state(StructuredOutput.regex(REGEX))
    state.accept([0])  # after "a": c, d or e
    # root -> {a (invalid), c}; a -> b; c -> {a, g}; that a -> {b (invalid after "aca"), d}
    parents = (-1, -1, 0, 1, 1, 3, 3)
    tokens = (0, 2, 1, 0, 6, 1, 3)
    det = state.prune(DraftTree(tokens, parents))
    assert det is not None and det.token_ids == (2, 0, 6, 3) and det.parents == (-1, 0, 0, 1)
    dists = torch.full((4, V), 1.0 / V)
    drawn = DraftTree(tokens, parents, SiblingDraw.IID, dists, (0, 0, 1, 2, 2, 3, 3))
    kept = state.prune(drawn)
    # Invalid drawn nodes stay (their rejection shapes the residual), their subtrees go.
    assert kept is not None and kept.token_ids == (0, 2, 0, 6, 1, 3) and kept.parents == (-1, -1, 1, 1, 2, 2)
    assert kept.dist_row == (0, 0, 2, 2, 3, 3)
    assert state.prune(DraftTree((0, 1), (-1, 0))) is None  # nothing valid, deterministic: no draft


def test_min_tokens_holds_the_end_back_only_where_the_grammar_allows_more(compiler: GrammarCompiler) -> None:
    """forbid_unless_only: after "f" the regex may end or go on, so the end is cleared; after the
    last letter of a finished choice only the end is allowed, so it stays (never an empty row)."""
    state = compiler.new_state(StructuredOutput.regex(REGEX))
    state.accept([5])  # "f": anything may follow, or the end
    done = compiler.new_state(StructuredOutput.choice(["fg"]))
    done.accept([5, 6])  # the choice is complete: only the end
    masks = torch.empty(3, state.num_words, dtype=torch.int32)
    state.fill_masks(None, masks[0:1])
    done.fill_masks(None, masks[1:2])
    state.fill_masks(None, masks[2:3])
    before = unpack(masks)
    assert before[0, EOS] and before[0, :EOS].sum() > 0 and before[1].nonzero().flatten().tolist() == [EOS]
    forbid_unless_only(masks, [0, 1], torch.tensor([EOS, 6]))
    after = unpack(masks)
    assert not after[0, EOS] and not after[0, 6] and after[0, :6].tolist() == before[0, :6].tolist()
    assert after[1].tolist() == before[1].tolist()  # the end is all the grammar allows: kept
    assert after[2].tolist() == before[2].tolist()  # a row not listed: untouched
    wide = torch.full((1, 2), -1, dtype=torch.int32)  # 64 tokens, all allowed; ban bit 31 (the sign bit)
    forbid_unless_only(wide, [0], torch.tensor([31, 63]))
    assert wide.tolist() == [[(1 << 31) - 1, (1 << 31) - 1]]


def test_apply_masks_forbids_exactly_the_masked_tokens() -> None:
    logits = torch.zeros(3, 40)
    masks = torch.zeros(1, 2, dtype=torch.int32)
    masks[0, 0] = 0b101
    masks[0, 1] = -(1 << 31)  # bit 31 of the second word: token 63 (outside the 40 logits)
    masks[0, 1] |= 1 << 3  # token 35
    apply_masks(logits, masks, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2, 35]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_specs_validate_and_compile(compiler: GrammarCompiler) -> None:
    compiler.compile(StructuredOutput.json({"type": "object", "properties": {"x": {"type": "integer"}}}))
    compiler.compile(StructuredOutput.json())
    compiler.compile(StructuredOutput.choice(["yes", "no"]))
    with pytest.raises(InvalidRequestError, match="could not be compiled"):
        compiler.compile(StructuredOutput.regex("(unclosed"))
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput.json("{nope")
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput.json())
    SamplingParams(min_tokens=5, structured_output=StructuredOutput.json())  # vLLM accepts it: so do we
    with pytest.raises(InvalidRequestError):
        StructuredOutput("xml", "<a/>")  # type: ignore[arg-type]


def test_a_long_compile_keeps_no_other_compile_waiting() -> None:
    """A guided_choice of thousands of options compiles for a second or more; a small spec sent
    meanwhile (another request's thread) compiles at once, not after it."""
    compiler = GrammarCompiler(VOCAB, V, [EOS])
    rng = random.Random(0)
    big = StructuredOutput.choice(["".join(rng.choice("abcdefg") for _ in range(12)) for _ in range(8_000)])
    started, took = threading.Event(), []

    def compile_big() -> None:
        started.set()
        t = time.perf_counter()
        compiler.compile(big)
        took.append(time.perf_counter() - t)

    worker = threading.Thread(target=compile_big)
    worker.start()
    started.wait()
    time.sleep(0.05)
    t = time.perf_counter()
    compiler.compile(StructuredOutput.regex("[ab]c*d"))
    small = time.perf_counter() - t
    worker.join()
    assert small < took[0] / 4, (small, took)


def test_compiles_at_once_are_bounded(monkeypatch) -> None:
    """However many requests compile at once, at most COMPILES_AT_ONCE compiles run (their
    memory is bounded); the rest wait for a slot and then compile."""
    compiler = GrammarCompiler(VOCAB, V, [EOS])
    real, lock, running, most = compiler._compiler, threading.Lock(), [0], [0]

    class Slow:  # the library's compiler, slowed down, counting the compiles in it
        def compile_regex(self, text: str):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.1)
            with lock:
                running[0] -= 1
            return real.compile_regex(text)

    monkeypatch.setattr(compiler, "_compiler", Slow())
    workers = [threading.Thread(target=compiler.compile, args=(StructuredOutput.regex(f"a{{{i + 1}}}"),)) for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert most[0] == COMPILES_AT_ONCE
    assert all(compiler.compile(StructuredOutput.regex(f"a{{{i + 1}}}")) is not None for i in range(6))


def test_a_refused_spec_names_the_request_field_it_came_from(compiler: GrammarCompiler) -> None:
    """By its kind (response_format, guided_*), or the field that made it: the tools' schema of
    tool_choice required is refused as `tools`, and the field is no part of the constraint."""
    bad = StructuredOutput.json({"type": 7})
    with pytest.raises(InvalidRequestError, match="could not be compiled") as e:
        compiler.compile(bad)
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(StructuredOutput.regex("(unclosed"))
    assert e.value.param == "guided_regex"
    made = dataclasses.replace(bad, param="tools")
    with pytest.raises(InvalidRequestError, match="^tools: the json schema could not be compiled") as e:
        compiler.compile(made)
    assert e.value.param == "tools"
    assert made == bad and hash(made) == hash(bad)


def processed(table: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [..., V] logits -> probs
    flat = table.reshape(-1, V)
    meta = SamplingMetadata.build([params] * flat.shape[0], [0] * flat.shape[0], torch.device("cpu"))
    return logits_to_probs(flat, meta.temperature, meta.top_k, meta.top_p).reshape(table.shape)


WIDTH = 3
PARENTS = (-1,) * WIDTH + (0,) * WIDTH + (1,) * WIDTH  # root and its first two children get WIDTH children


def draft_tokens(kind: SiblingDraw, p: torch.Tensor, root: int, n: int, g: torch.Generator) -> torch.Tensor:
    """[n, len(PARENTS)] node tokens of n trials, children drawn from p[depth, parent token] as `kind` says."""
    tokens = torch.zeros(n, len(PARENTS), dtype=torch.long)
    for group, parent in enumerate((-1, 0, 1)):
        dist = p[0, root].expand(n, V) if parent < 0 else p[1, tokens[:, parent]]  # [n, V]
        if kind is SiblingDraw.DETERMINISTIC:
            picked = dist.topk(WIDTH, dim=1).indices  # a function of the context
        else:
            picked = torch.multinomial(dist, WIDTH, replacement=kind is SiblingDraw.IID, generator=g)
        tokens[:, group * WIDTH : (group + 1) * WIDTH] = picked
    return tokens


def as_tree(kind: SiblingDraw, tokens: tuple[int, ...], p: torch.Tensor, root: int) -> DraftTree:
    if kind is SiblingDraw.DETERMINISTIC:
        return DraftTree(tokens, PARENTS)
    dists = torch.stack([p[0, root], p[1, tokens[0]], p[1, tokens[1]]])  # the rows children were drawn from
    return DraftTree(tokens, PARENTS, kind, dists, tuple(i // WIDTH for i in range(len(PARENTS))))


@pytest.mark.parametrize("kind,temperature,top_k", [
    pytest.param(SiblingDraw.DETERMINISTIC, 1.0, 0, id="deterministic"),
    pytest.param(SiblingDraw.IID, 0.8, 0, id="iid-T0.8", marks=pytest.mark.slow),
    pytest.param(SiblingDraw.WITHOUT_REPLACEMENT, 1.2, 5, id="without-replacement-T1.2-k5", marks=pytest.mark.slow),
])
def test_constrained_tree_speculation_emits_constrained_target(compiler, kind, temperature, top_k) -> None:
    g = torch.Generator().manual_seed(5)
    q_logits = torch.randn(3, V, V, generator=g) * 1.5  # [depth, last token, next]
    p_logits = q_logits + torch.randn(3, V, V, generator=g) * 1.5  # a draft that often breaks the grammar
    params = SamplingParams(temperature=temperature, top_k=top_k)
    p = processed(p_logits, params)
    prefix = [0]  # "a": the root's children must be c, d or e
    root = prefix[-1]
    # The exact law of the first two emitted tokens under constrained sampling from the target.
    m0 = allowed_after(compiler, prefix)
    q0 = processed(q_logits[0, root].masked_fill(~m0, float("-inf")).unsqueeze(0), params)[0]
    expected = torch.zeros(V, V, dtype=torch.float64)
    q1 = torch.zeros(V, V)
    for x1 in range(V):
        if m0[x1]:
            m1 = allowed_after(compiler, prefix + [x1])
            q1[x1] = processed(q_logits[1, x1].masked_fill(~m1, float("-inf")).unsqueeze(0), params)[0]
            expected[x1] = q0[x1].double() * q1[x1].double()
    state = compiler.new_state(StructuredOutput.regex(REGEX))
    state.accept(prefix)
    counts = torch.zeros(V, V, dtype=torch.float64)
    invalid_nodes = 0
    steps: dict[tuple[int, ...], tuple[DraftTree, torch.Tensor]] = {}  # drawn tokens -> pruned tree, masked rows
    gen = torch.Generator().manual_seed(11)
    chunk = 50_000
    for _ in range(DRAWS // chunk):
        trees, rows = [], []
        for tokens in map(tuple, draft_tokens(kind, p, root, chunk, g).tolist()):
            if tokens not in steps:  # what the engine does for this draft: prune, then mask every row
                pruned = state.prune(as_tree(kind, tokens, p, root)) or DraftTree((), ())
                masks = torch.empty(1 + len(pruned), state.num_words, dtype=torch.int32)
                state.fill_masks(pruned, masks)
                logits = torch.stack([q_logits[0, root]] + [q_logits[d, t] for d, t in zip(pruned.depths, pruned.token_ids)])
                apply_masks(logits, masks, range(len(logits)))
                steps[tokens] = (pruned, logits)
            invalid_nodes += sum(not m0[t] for t in tokens[:WIDTH])
            pruned, logits = steps[tokens]
            trees.append(pruned)
            rows.append(logits)
        meta = SamplingMetadata.build([params] * chunk, [0] * chunk, torch.device("cpu"))
        results = verify_trees(torch.cat(rows), trees, meta, gen)
        first = torch.tensor([r.token_ids[0] for r in results])
        second = torch.multinomial(q1[first], 1, generator=g).squeeze(1)  # the next step, constrained
        walked = torch.tensor([len(r.token_ids) > 1 for r in results])
        second[walked] = torch.tensor([r.token_ids[1] for r in results if len(r.token_ids) > 1], dtype=torch.long)
        counts += torch.bincount(first * V + second, minlength=V * V).reshape(V, V).double()
    assert invalid_nodes > 0  # the drafts did break the grammar: the test is not vacuous
    zero = expected == 0
    assert counts[zero].sum() == 0, "a token the grammar forbids was emitted"
    exp = expected[~zero] * counts.sum() / expected.sum()
    stat = chisquare(counts[~zero].numpy(), exp.numpy())
    assert stat.pvalue > 1e-3, f"chi-square p = {stat.pvalue:.2e} over {int(counts.sum())} draws"
