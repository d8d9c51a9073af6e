"""Text <-> token id conversion for byte-level BPE models, from GGUF metadata or a HF directory.

The heavy lifting (BPE merges, added-token matching, byte-level decoding) is done by the Rust
``tokenizers`` library; this module assembles a ``tokenizers.Tokenizer`` equivalent to the one a
model was trained with, and adds what an inference engine needs around it: BOS handling, the set
of ids that end generation, chat templates, a fingerprint to check two models share a vocabulary,
and streaming detokenisation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from specserve.errors import (
    CorruptModelError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from specserve.models.gguf_file import GGUFFile

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

logger = logging.getLogger(__name__)

# llama.cpp's token_type values (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte.
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# Control tokens that end a turn or a document in the vocabularies we know; generation stops on
# any of them that the model defines, in addition to its declared EOS.
_END_OF_GENERATION_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")

# --- pre-tokenizer split patterns ---------------------------------------------------------------
# A byte-level BPE only merges inside the pieces its pre-tokenizer cuts the text into, so the cut
# must match training exactly. The patterns are assembled from these alternatives; regex
# alternation is ordered, so earlier alternatives win at each position.
_CONTRACTION_ANY_CASE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# A run of letters, optionally preceded by one character that is neither a letter, a digit nor a
# line break (usually the space before a word, but also e.g. the "$" in "$var").
_LETTERS_WITH_LEAD = r"[^\r\n\p{L}\p{N}]?\p{L}+"
# A run of other symbols with an optional leading space, swallowing the line breaks after it.
_SYMBOLS_THEN_NEWLINES = r" ?[^\s\p{L}\p{N}]+[\r\n]*"
# Whitespace ending in line breaks, then trailing whitespace that is not followed by a word (so the
# last space before a word stays attached to the word), then any other whitespace.
_WHITESPACE_TAIL = r"\s*[\r\n]+|\s+(?!\S)|\s+"


# Texts longer than this are tokenized without holding the GIL (see Tokenizer.encode).
LONG_TEXT_CHARS = 4096


def _alternatives(*parts: str) -> str:
    return "|".join(parts)


# Qwen2: every digit on its own.
_QWEN2_SPLIT = _alternatives(
    _CONTRACTION_ANY_CASE, _LETTERS_WITH_LEAD, r"\p{N}", _SYMBOLS_THEN_NEWLINES, _WHITESPACE_TAIL
)
# Llama 3: digits in groups of at most three.
_LLAMA3_SPLIT = _alternatives(
    _CONTRACTION_ANY_CASE,
    _LETTERS_WITH_LEAD,
    r"\p{N}{1,3}",
    _SYMBOLS_THEN_NEWLINES,
    _WHITESPACE_TAIL,
)

# tokenizer.ggml.pre values (as written by llama.cpp's converter) grouped by the split they use.
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen", "megrez", "kormo"}
_PRE_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx", "pixtral"}
# GPT-2's own split, but with each digit isolated first (StarCoder-family vocabularies).
_PRE_DIGITS_THEN_GPT2 = {
    "smollm",
    "starcoder",
    "refact",
    "codeshell",
    "command-r",
    "exaone",
    "minerva",
}
_PRE_GPT2 = {"gpt-2", "gpt2", "default", "mpt", "olmo", "jais", "phi-2", "stablelm2", ""}


def _byte_level_pre_tokenizer(pre: str) -> tuple[Any, bool]:
    """Pre-tokenizer for a llama.cpp ``tokenizer.ggml.pre`` name, and whether BPE ignores merges.

    ``ignore_merges`` makes a piece that is itself a vocabulary entry map straight to that entry;
    Llama 3 was trained that way (and llama.cpp enables it for that family only).
    """
    plain_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_QWEN2:
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, plain_bytes]), False
    if pre in _PRE_LLAMA3:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, plain_bytes]), True
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), False
    if pre not in _PRE_GPT2:
        logger.warning(
            "GGUF pre-tokenizer %r is not known to specserve; splitting text the GPT-2 way, which "
            "may tokenize some inputs differently from llama.cpp.",
            pre,
        )
    return gpt2, False


def _gguf_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: either a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template, vocabulary fingerprint."""

    def __init__(
        self,
        backend: _Backend,
        *,
        merges: Sequence[tuple[str, str]],
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        vocab_size: int | None = None,
        extra_stop_ids: Iterable[int] = (),
        name: str = "",
    ) -> None:
        self._backend = backend
        self._merges = list(merges)
        self.name = name
        self.vocab_size: int = int(
            vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        )
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_id: int | None = eos_token_id
        self.add_bos_token: bool = bool(add_bos_token and bos_token_id is not None)
        self.chat_template: str | None = chat_template or None
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in added.items() if tok.special
        )
        self._added_ids = frozenset(added)  # added tokens are their own text (token_bytes)
        # Tokens spelled in GPT-2's byte alphabet (a byte-level decoder; token_bytes)
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        stops = {i for i in extra_stop_ids if i is not None}
        if eos_token_id is not None:
            stops.add(eos_token_id)
        for text in _END_OF_GENERATION_NAMES:
            tid = backend.token_to_id(text)
            if tid is not None and tid in self.special_token_ids:
                stops.add(tid)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._fingerprint: str | None = None
        self._template: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_id}, stop={sorted(self.stop_token_ids)})"
        )

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: GGUFFile, *, name: str = "") -> Tokenizer:
        """Build the byte-level BPE tokenizer described by a GGUF's ``tokenizer.*`` metadata."""
        name = name or str(_gguf_value(reader, "general.name", "") or "")
        model = _gguf_value(reader, "tokenizer.ggml.model")
        if model is None:
            raise UnsupportedModelError(
                f"GGUF model {name!r} has no tokenizer metadata; load a GGUF converted with its "
                "tokenizer, or pass a HF model directory that has tokenizer.json."
            )
        if model != "gpt2":
            kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram"}.get(
                model, model
            )
            raise UnsupportedModelError(
                f"GGUF model {name!r} uses a {kind} tokenizer (tokenizer.ggml.model={model!r}); "
                "specserve builds only byte-level BPE ('gpt2') tokenizers from GGUF. Use the "
                "model's HF directory (with tokenizer.json) instead, or a model with a byte-level "
                "BPE vocabulary."
            )
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        merge_lines = _gguf_value(reader, "tokenizer.ggml.merges")
        if not tokens or merge_lines is None:
            raise CorruptModelError(
                f"GGUF model {name!r} lacks tokenizer.ggml.tokens or tokenizer.ggml.merges; the "
                "file is incomplete, so download or re-convert it."
            )
        token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise CorruptModelError(
                f"GGUF model {name!r} has {len(tokens)} tokens but {len(token_types)} token types; "
                "the file is damaged, so download or re-convert it."
            )

        vocab: dict[str, int] = {}
        for index, text in enumerate(tokens):
            # A repeated spelling cannot be told apart by the BPE model; the first id keeps it.
            vocab.setdefault(text, index)
        merges = []
        for line in merge_lines:
            left, sep, right = line.partition(" ")
            if not sep:
                raise CorruptModelError(
                    f"GGUF model {name!r} has a malformed merge rule {line!r}; the file is "
                    "damaged, so download or re-convert it."
                )
            merges.append((left, right))

        pre = str(_gguf_value(reader, "tokenizer.ggml.pre", "default") or "default")
        pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(pre)
        backend = _Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()

        # Control tokens (e.g. <|im_start|>) and user-defined ones (e.g. <tool_call>) are matched
        # whole in raw text before any splitting; only control tokens count as special (dropped by
        # decode(skip_special_tokens=True)). Their ids come from the vocabulary entry they spell.
        control, user = [], []
        for text, kind in zip(tokens, token_types, strict=True):
            if not text:
                continue  # an empty spelling cannot be matched in text
            if kind == _CONTROL:
                control.append(AddedToken(text, special=True, normalized=False))
            elif kind == _USER_DEFINED:
                user.append(AddedToken(text, special=False, normalized=False))
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def token_id(key: str) -> int | None:
            value = _gguf_value(reader, key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos = token_id("tokenizer.ggml.bos_token_id")
        eos = token_id("tokenizer.ggml.eos_token_id")
        stops = [token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")]
        # Converters write the flag for every model that wants BOS; byte-level vocabularies without
        # it (GPT-2 style) do not use one, which is also what HF assumes.
        add_bos = bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", False))
        template = _gguf_value(reader, "tokenizer.chat_template")
        return cls(
            backend,
            merges=merges,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=add_bos,
            chat_template=template if isinstance(template, str) else None,
            vocab_size=len(tokens),
            extra_stop_ids=[s for s in stops if s is not None],
            name=name,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a HF directory: tokenizer.json plus optional tokenizer_config.json and friends."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFoundError(
                f"No tokenizer.json in {root}; point specserve at a HF model directory that "
                "contains one (save it with tokenizer.save_pretrained)."
            )
        try:
            text = tok_file.read_text(encoding="utf-8")
            spec = json.loads(text)
            backend = _Backend.from_str(text)
        except Exception as exc:
            raise CorruptModelError(
                f"Cannot read {tok_file}: {exc}. Re-download or re-save the tokenizer files."
            ) from exc
        config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        raw_merges = (spec.get("model") or {}).get("merges") or []
        merges: list[tuple[str, str]] = []
        for item in raw_merges:
            if isinstance(item, str):
                left, _, right = item.partition(" ")
                merges.append((left, right))
            else:
                merges.append((str(item[0]), str(item[1])))

        def id_of(key: str) -> int | None:
            text = _token_content(config.get(key))
            if text is not None:
                tid = backend.token_to_id(text)
                if tid is not None:
                    return tid
            value = model_config.get(f"{key}_id")
            if isinstance(value, list):
                value = value[0] if value else None
            return int(value) if isinstance(value, int) else None

        bos = id_of("bos_token")
        eos = id_of("eos_token")
        extra: list[int] = []
        for source in (gen_config, model_config):
            value = source.get("eos_token_id")
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int):
                    extra.append(item)
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # Without the flag, trust the tokenizer.json post-processor: does it put BOS in front?
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos

        template = config.get("chat_template")
        if isinstance(template, list):
            # Several named templates; the one named "default" is used for plain chat.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend,
            merges=merges,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=add_bos,
            chat_template=template if isinstance(template, str) else None,
            extra_stop_ids=extra,
            name=str(model_config.get("_name_or_path") or root.name),
        )

    # --- encode / decode -----------------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """``encode(t, add_special_tokens=False)`` of each text, tokenized in parallel (Rust
        threads, the GIL released)."""
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special-token spellings in the text map to their ids.

        With ``add_special_tokens`` the BOS id is prepended when the model asks for it
        (``add_bos_token``), unless the text already starts with the BOS token (as rendered chat
        templates often do), so a prompt never carries two.
        """
        if len(text) > LONG_TEXT_CHARS:
            # encode_batch releases the GIL while it works (encode does not): a long prompt
            # tokenized in a server thread leaves the event loop free to answer meanwhile.
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled exactly ``token`` (byte-level spelling), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of ``token_id``, or None if out of range."""
        return self._backend.id_to_token(token_id)

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template into one prompt string."""
        if chat_template is not None:
            template = _compile_template(chat_template)
        else:
            if self.chat_template is None:
                raise InvalidRequestError(
                    f"Model {self.name!r} has no chat template, so chat messages cannot be turned "
                    "into a prompt; send a plain text prompt (completions API) instead, or use an "
                    "instruction-tuned model that ships a template."
                )
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            template = self._template
        context: dict[str, Any] = {
            "bos_token": self._special_text(self.bos_token_id),
            "eos_token": self._special_text(self.eos_token_id),
            "tools": None,
            "documents": None,
        }
        context.update(extra)
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"The chat template rejected these messages: {exc}. Fix the message list "
                "(roles, order, content) to match what the model expects."
            ) from exc

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level token may hold part of a character
        (an emoji is often 2-4 tokens), whose decoded text alone is only U+FFFD. Added and special
        tokens are their text; the rest are read from their byte-level spelling (GPT-2's byte
        alphabet), or a SentencePiece byte (`<0xE2>`), else their decoded text."""
        piece = self._backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass
        sp_byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if sp_byte:
            return bytes([int(sp_byte.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._backend.id_to_token(token_id) or ""

    # --- identity ------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 over vocabulary, merges and special tokens; equal iff ids mean the same text.

        Two tokenizers with equal fingerprints assign every id the same spelling and merge
        bytes identically, so a draft model may propose ids that the target model understands.
        """
        if self._fingerprint is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            added = self._backend.get_added_tokens_decoder()
            # ASCII unit/record/group separators cannot occur inside byte-level spellings, so the
            # serialisation below is unambiguous.
            parts = ["vocab\x1d"]
            parts += [f"{i}\x1f{t}\x1e" for t, i in sorted(vocab.items(), key=lambda kv: kv[1])]
            parts.append("merges\x1d")
            parts += [f"{a}\x1f{b}\x1e" for a, b in self._merges]
            parts.append("special\x1d")
            parts += [f"{i}\x1f{added[i].content}\x1e" for i in sorted(self.special_token_ids)]
            data = "".join(parts).encode("utf-8", "surrogatepass")
            self._fingerprint = hashlib.sha256(data).hexdigest()
        return self._fingerprint


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character: the printable Latin-1
    bytes as themselves, the others shifted to U+0100 and up. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(
            f"Cannot parse {path}: {exc}. Re-download or re-save the model directory."
        ) from exc
    return data if isinstance(data, dict) else {}


# --- chat template environment ------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes "<", ">" and "&", which would corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured the way HF transformers renders them."""
    cached = _TEMPLATE_CACHE.get(source)
    if cached is not None:
        return cached
    # Templates come from model files, i.e. untrusted input: the immutable sandbox stops them
    # from reaching Python internals or mutating our objects. trim_blocks/lstrip_blocks match
    # the whitespace handling template authors test against.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as exc:
        raise UnsupportedModelError(
            f"The model's chat template does not compile ({exc}); pass a corrected template "
            "or use a plain text prompt."
        ) from exc
    _TEMPLATE_CACHE[source] = template
    return template


# --- streaming detokenisation -------------------------------------------------------------------

# Prompt tokens decoded in front of the first generated token, so the first piece of output is
# decoded in context (some decoders treat the very first token of a sequence specially).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas, holding back incomplete UTF-8 characters.

    The id window holds, before ``read``, the ids whose text was emitted last (the context that
    determines how the next ones render) and, from ``read`` on, ids not yet emitted. New text is
    the decode of the window minus the decode of ``[:read]``. Older ids are dropped at each
    emission, so each call costs O(tokens since the last emitted text), not O(output length).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._window)
        self._pieces: list[str] = []
        self._text_cache = ""
        self._n_cached = 0
        self.num_tokens = 0

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta

    def append(self, new_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text that is now final (possibly empty)."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        self.num_tokens += len(new_ids)
        window = self._window
        decode = self._tokenizer.decode
        before = decode(window[: self._read], self._skip)
        end = len(window)
        after = decode(window, self._skip)
        # A trailing U+FFFD means the last token ended part-way through a multi-byte character:
        # its bytes wait for the rest. The chunk's tokens before it are emitted as fed one at a
        # time they would have been: up to the last of them that ends a character (a
        # speculative step's tokens that end inside one must not hold back all of their text).
        while after.endswith("\ufffd") and end - 1 > self._read:
            end -= 1
            after = decode(window[:end], self._skip)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        delta = after[len(before) :]
        # The emitted tokens become the context of the next decode; everything older is dropped.
        del window[: self._read]
        self._read = end - self._read
        return self._emit(delta)

    def flush(self) -> str:
        """At end of stream, emit whatever is still held back (e.g. a truly invalid byte run)."""
        if self._read >= len(self._window):
            return ""
        before = self._tokenizer.decode(self._window[: self._read], self._skip)
        after = self._tokenizer.decode(self._window, self._skip)
        delta = after[len(before) :] if len(after) > len(before) else ""
        del self._window[: self._read]
        self._read = len(self._window)
        return self._emit(delta)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._n_cached != len(self._pieces):
            self._text_cache += "".join(self._pieces[self._n_cached :])
            self._n_cached = len(self._pieces)
        return self._text_cache
