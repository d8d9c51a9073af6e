"""Next-token statistics of a local text corpus: a drafting source that needs no model.

Retrieval-based speculation (REST, He et al. 2023) drafts what followed the context's tail in
a datastore of text. Code repeats itself across projects (``self.``, ``for i in range(``,
``raise ValueError(``), so a corpus of code guesses a coding model's next tokens often enough
to pay where verifying a few extra tokens costs little. Here the datastore is an n-gram table:
for each context of ORDERS tokens seen in the corpus, the TOP tokens that followed it and how
often. A lookup backs off from the longest order that matches; a continuation's share of its
context's count estimates its chance to be right.

The default corpus (``auto``) is the Python standard library's source, which every Python
install carries (nothing is downloaded): 7.9M tokens under Qwen2.5's tokenizer, a 36 MB table
built in about 20 s on two cores. With it goes, once ``specserve build-corpus --model M`` has
written them, the target's own greedy answers to a few hundred generic asks (specserve.spec.asks,
none of them a benchmark's): what a model writes repeats its own habits, and 26k tokens of
Qwen 1.5B's answers predicted its output on held-out coding asks better than the 7.9M tokens of
the stdlib did (offline: 1.50 against 1.43 tokens per step at 4 nodes; together 1.58).
``python`` adds every installed package's source (torch, numpy and whatever else the
environment holds: 74M tokens here, 3 minutes and 8.4 GB to build) and guesses more often. Tables are built once per tokenizer and corpus and kept under
``$SPECSERVE_CACHE/corpus``.
"""

from __future__ import annotations

import contextlib
import hashlib
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specserve.errors import ConfigError
from specserve.files import write_atomic

ORDERS = (1, 2, 3, 4, 6)  # context lengths kept, the longest that matches is used
TOP = 4  # continuations kept per context, the most frequent
MIN_COUNT = 3  # contexts of >= 2 tokens: rarer continuations are dropped (as good, and a quarter of the table)
ENCODE_CHUNK = 64  # files tokenized per call
SELF_WEIGHT = 3  # the target's own answers count this many times each beside the stdlib
SELF_ASKS = 256  # asks `specserve build-corpus` answers by default
TABLE_VERSION = 1  # bump when the table's layout or what it keeps changes
_P = 1_000_003  # polynomial hash base: a context's key = sum t_j * P^(k-1-j) mod 2^64
_MASK = (1 << 64) - 1


def corpus_files(corpus: str | None) -> list[Path]:
    """The corpus's text files in a fixed order: "stdlib" (the default) the standard library's
    .py files, "python" those and every installed package's, else a directory's text files."""
    if corpus in (None, "stdlib", "python"):
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
        if corpus == "python":
            for lib in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
                files += Path(lib).rglob("*.py")
    else:
        root = Path(corpus)
        if not root.is_dir():
            raise ConfigError(f"corpus {corpus} is not a directory; give a directory of text files or 'stdlib'.")
        files = [p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".md", ".rst", ".json", "")]
    files = sorted(files)
    if not files:
        raise ConfigError(f"No text files under {root}.")
    return files


def self_text_path(model_file: str | Path, root: Path | None = None) -> Path:
    """Where `specserve build-corpus` keeps a model's own answers (one text file per model file)."""
    from specserve.models.bundled import cache_dir

    path = Path(model_file).resolve()
    key = hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    return (root or cache_dir() / "corpus" / "self") / f"{path.stem}-{key}.txt"


def write_self_text(llm, path: Path, num_asks: int = SELF_ASKS, max_tokens: int = 256, seed: int = 0) -> dict:  # noqa: ANN001 - LLM
    """Answer num_asks generic asks greedily with the LLM's model and write the answers to path
    (atomically); returns a summary card."""
    import time

    from specserve.sampling_params import SamplingParams
    from specserve.spec.asks import chat_prompts

    asks = chat_prompts(corpus_files("stdlib"), num_asks, seed)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": a}] for a in asks], SamplingParams(max_tokens=max_tokens, temperature=0))
    text = "\n\n".join(o.outputs[0].text for o in outs)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return {"path": str(path), "asks": len(asks), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "seconds": time.perf_counter() - t0}


def _run_starts(keys: np.ndarray) -> np.ndarray:
    """[R] int64: where each run of equal values starts in sorted keys."""
    if not len(keys):
        return np.zeros(0, np.int64)
    return np.r_[0, np.flatnonzero(keys[1:] != keys[:-1]) + 1].astype(np.int64)


def _keys(tokens: np.ndarray, k: int) -> np.ndarray:
    """[len - k + 1] uint64: the key of every k-token window of tokens."""
    n = len(tokens) - k + 1
    h = np.zeros(max(n, 0), dtype=np.uint64)
    for j in range(k):
        h = h * np.uint64(_P) + tokens[j : j + n].astype(np.uint64)
    return h


class _Table:
    """One order's table: sorted unique context keys, and per key its continuations, most
    frequent first (CSR: continuations of keys[i] are toks[start[i]:start[i + 1]])."""

    __slots__ = ("keys", "start", "toks", "counts", "totals")

    def __init__(self, keys: np.ndarray, start: np.ndarray, toks: np.ndarray, counts: np.ndarray,
                 totals: np.ndarray) -> None:
        self.keys = keys  # [K] uint64, ascending
        self.start = start  # [K + 1] int64
        self.toks = toks  # [N] int32
        self.counts = counts  # [N] int32
        self.totals = totals  # [K] int32: how often the context occurred (all continuations, before TOP)

    @classmethod
    def build(cls, docs: Sequence[np.ndarray], k: int, min_count: int) -> _Table:
        keys = np.concatenate([_keys(d[:-1], k) for d in docs if len(d) > k] or [np.zeros(0, np.uint64)])
        nxt = np.concatenate([d[k:] for d in docs if len(d) > k] or [np.zeros(0, np.int64)])
        order = np.lexsort((nxt, keys))
        keys, nxt = keys[order], nxt[order]
        # Runs of equal (key, next): one row each with its count.
        edge = np.flatnonzero((keys[1:] != keys[:-1]) | (nxt[1:] != nxt[:-1])) + 1
        first = np.r_[0, edge].astype(np.int64) if len(keys) else np.zeros(0, np.int64)
        cnt = np.diff(np.r_[first, len(keys)]).astype(np.int64)
        pk, pn = keys[first], nxt[first]
        # Totals per key, before any continuation is dropped.
        kedge = _run_starts(pk)
        ktot = np.add.reduceat(cnt, kedge) if len(pk) else np.zeros(0, np.int64)
        tot = np.repeat(ktot, np.diff(np.r_[kedge, len(pk)]))
        keep = cnt >= min_count
        pk, pn, cnt, tot = pk[keep], pn[keep], cnt[keep], tot[keep]
        order = np.lexsort((-cnt, pk))  # per key, most frequent first
        pk, pn, cnt, tot = pk[order], pn[order], cnt[order], tot[order]
        kedge = _run_starts(pk)
        rank = np.arange(len(pk)) - np.repeat(kedge, np.diff(np.r_[kedge, len(pk)]))
        top = rank < TOP
        pk, pn, cnt, tot = pk[top], pn[top], cnt[top], tot[top]
        kedge = _run_starts(pk)
        return cls(pk[kedge].astype(np.uint64), np.r_[kedge, len(pk)].astype(np.int64), pn.astype(np.int32),
                   cnt.astype(np.int32), tot[kedge].astype(np.int32))

    def lookup(self, key: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(tokens, counts, total) of the context with this key, or None."""
        i = int(np.searchsorted(self.keys, np.uint64(key)))
        if i >= len(self.keys) or int(self.keys[i]) != key:
            return None
        a, b = int(self.start[i]), int(self.start[i + 1])
        return self.toks[a:b], self.counts[a:b], int(self.totals[i])


class CorpusNgrams:
    """The n-gram tables of one corpus under one tokenizer."""

    def __init__(self, tables: dict[int, _Table], num_tokens: int) -> None:
        self.tables = tables
        self.num_tokens = num_tokens  # corpus size in tokens
        self._orders = sorted(tables, reverse=True)

    @classmethod
    def from_token_docs(cls, docs: Sequence[Sequence[int] | np.ndarray], min_count: int = MIN_COUNT) -> CorpusNgrams:
        """Tables over already tokenized documents (an n-gram never spans two documents)."""
        arrays = [np.asarray(d, dtype=np.int32) for d in docs]
        tables = {k: _Table.build(arrays, k, 1 if k == 1 else min_count) for k in ORDERS}
        return cls(tables, sum(len(a) for a in arrays))

    def next_tokens(self, context: Sequence[int]) -> tuple[int, list[tuple[int, float]]]:
        """(order, [(token, share)]): what followed the longest of the context's tails the
        corpus has, most frequent first; share = count / the context's occurrences. (0, []) when
        not even the last token occurred."""
        h, power = 0, 1
        longest = min(len(context), self._orders[0])
        hashes = [0] * (longest + 1)  # hashes[m]: key of the last m tokens, built from the end
        for m in range(1, longest + 1):
            h = (h + int(context[-m]) * power) & _MASK
            power = (power * _P) & _MASK
            hashes[m] = h
        for k in self._orders:
            if k > longest:
                continue
            hit = self.tables[k].lookup(hashes[k])
            if hit is None:
                continue
            toks, counts, total = hit
            return k, [(int(t), int(c) / total) for t, c in zip(toks, counts)]
        return 0, []

    # ------------------------------------------------------------------ persistence
    def save(self, path: Path) -> None:
        """Write atomically (a crash never leaves a half table under the final name)."""
        arrays: dict[str, np.ndarray] = {"num_tokens": np.asarray(self.num_tokens)}
        for k, t in self.tables.items():
            for name in _Table.__slots__:
                arrays[f"{k}_{name}"] = getattr(t, name)
        write_atomic(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: Path) -> CorpusNgrams:
        """Read a table written by save()."""
        with np.load(path) as z:
            tables = {k: _Table(*(z[f"{k}_{name}"] for name in _Table.__slots__)) for k in ORDERS}
            return cls(tables, int(z["num_tokens"]))


def corpus_fingerprint(files: Sequence[Path], tokenizer_id: str) -> str:
    """Names the table: the tokenizer, the files (path, size, mtime) and the table's layout."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{TABLE_VERSION}|{ORDERS}|{TOP}|{MIN_COUNT}|{tokenizer_id}".encode())
    for p in files:
        st = p.stat()
        h.update(f"|{p}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def corpus_note(corpus: str, table: CorpusNgrams | None, self_text: Path | None, model: str) -> str:
    """What lookahead drafts from, for the start-up summary; under `auto` without the model's own
    answers, the command that writes them (a model's text repeats its own habits: on a Zen 5, Qwen2.5-Coder-1.5B's
    lookahead trees went from 1.07x to 1.31-1.36x plain on coding prompts with them, README)."""
    if table is None:
        return "no corpus"
    size = f"{table.num_tokens:,} corpus tokens"
    if corpus != "auto":
        return f"corpus {corpus}, {size}"
    if self_text is None:  # a model without a file of its own (a checkpoint given in memory): no answers to add
        return f"corpus: the stdlib, {size}"
    if self_text.is_file():
        return f"corpus: the stdlib and the model's own answers, {size}"
    return (f"corpus: the stdlib only, {size}; `specserve build-corpus --model {model}` adds the model's "
            "own answers, which predict its text far better (a few minutes, once)")


def load_corpus(corpus: str | None, encode_many: Callable[[list[str]], list[list[int]]], tokenizer_id: str,
                cache_root: Path | None = None, self_text: Path | None = None) -> CorpusNgrams:
    """The corpus's tables for this tokenizer (encode_many: texts -> their token ids, no special
    tokens added): from the cache, or built (and cached) now. Corpus "auto": the stdlib, and
    self_text (the model's own answers, see write_self_text) SELF_WEIGHT times where it exists."""
    from specserve.models.bundled import cache_dir
    from specserve.progress import bar, spinner

    files = corpus_files("stdlib" if corpus == "auto" else corpus)
    if corpus == "auto" and self_text is not None and self_text.is_file():
        files += [self_text] * SELF_WEIGHT
    root = cache_root or cache_dir() / "corpus"
    # One table per tokenizer and corpus: a table built after the corpus changed replaces the last.
    kind = hashlib.blake2b(f"{tokenizer_id}|{corpus}|{self_text}".encode(), digest_size=4).hexdigest()
    path = root / f"{kind}-{corpus_fingerprint(files, tokenizer_id)}.npz"
    if path.exists():
        try:
            return CorpusNgrams.load(path)
        except (OSError, KeyError, ValueError):
            path.unlink(missing_ok=True)  # damaged: build it again
    docs: list[np.ndarray] = []  # int32 arrays: a list of Python ints per token took 9 GB for 74M tokens
    for i in bar(range(0, len(files), ENCODE_CHUNK), desc=f"corpus n-grams: tokenizing {len(files)} files", unit="chunk"):
        texts = [_read(p) for p in files[i : i + ENCODE_CHUNK]]
        docs += [np.asarray(ids, dtype=np.int32) for ids in encode_many(texts)]
    with spinner("corpus n-grams: building the tables"):
        table = CorpusNgrams.from_token_docs(docs)
    with contextlib.suppress(OSError):  # a read-only cache: use the table without keeping it
        table.save(path)
        for old in root.glob(f"{kind}-*.npz"):
            if old != path:
                old.unlink(missing_ok=True)
    return table


def _read(path: Path) -> str:
    """A corpus file's text ("" where it cannot be read: one unreadable file skips, not fails)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
