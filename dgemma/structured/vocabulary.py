"""Token ids -> the bytes each token writes, as a constraint sees them.

A constraint is a language of byte strings (UTF-8 text); a token moves the automaton by the bytes it
adds to the answer. Those bytes come from the tokenizer's decoder, read from `tokenizer.json`:
  * SentencePiece-style (Gemma): tokens are text with '▁' for a space; byte-fallback tokens `<0xNN>`
    write the single byte NN, so a character missing from the vocabulary is several byte tokens
    (its UTF-8 bytes), and the automaton sees each byte;
  * byte-level BPE (GPT-2 style): each character of a token stands for one byte (the fixed
    byte <-> printable-character table of that scheme);
  * anything else: the token's own decoded text.
Special tokens (`<eos>`, `<pad>`, `<|turn>`, ...) write nothing a constraint can match, so they are
left out; EOS and padding are handled by the canvas decoder itself (dgemma.structured.decode).

A caller that needs particular special tokens inside its language (Gemma 4's tool calls quote strings
with the single token `<|"|>`) names them in `special_tokens`; each is then written as one private-use
character (U+F0000, U+F0001, ... in the order given) that `special(text)` returns for use in a regex.
No other token can write those characters: the vocabulary then drops the byte-fallback token of their
UTF-8 lead byte 0xF3, which only starts characters U+C0000-U+FFFFF (private use and unassigned planes),
and any token whose text holds one. Free text between special tokens is written with `NOT_SPECIAL`
(any character but those), so that a special token cannot appear inside it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field

SPECIAL_BASE = 0xF0000  # private use plane 15: never text a model writes
MAX_SPECIAL = 256
NOT_SPECIAL = f"[^{chr(SPECIAL_BASE)}-{chr(SPECIAL_BASE + MAX_SPECIAL - 1)}]"  # any character but those
_SENTINEL_LEAD = 0xF3  # UTF-8 lead byte of U+C0000..U+FFFFF
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class VocabularyError(ValueError):
    """The tokenizer cannot be read as a constraint vocabulary (the message says why)."""


@dataclass(frozen=True, eq=False)
class TokenVocabulary:
    """token_bytes[i]: the bytes token i writes, or None where a constraint never allows it.

    `size` may exceed len(token_bytes) (a model's embedding table is often padded past the tokenizer):
    the extra ids are never allowed. `fingerprint` identifies the content, for caches.
    """

    token_bytes: tuple[bytes | None, ...]
    size: int
    special_tokens: tuple[str, ...] = ()
    fingerprint: str = field(default="", compare=False)

    def __post_init__(self):
        if self.size < len(self.token_bytes):
            raise VocabularyError(f"size {self.size} is smaller than the {len(self.token_bytes)} tokens given")
        if not self.fingerprint:
            digest = hashlib.sha256(repr((self.token_bytes, self.size, self.special_tokens)).encode())
            object.__setattr__(self, "fingerprint", digest.hexdigest()[:16])

    @classmethod
    def from_tokenizer(cls, tokenizer, *, size: int | None = None, special_tokens: tuple[str, ...] = ()
                       ) -> "TokenVocabulary":
        """From a dgemma `Tokenizer` (or a `tokenizers.Tokenizer`); `size` = the model's vocabulary size.
        Cached per tokenizer object, so a server builds it once."""
        return _from_tokenizer(tokenizer, size, tuple(special_tokens))

    def special(self, text: str) -> str:
        """The regex fragment that matches special token `text` (one of `special_tokens`)."""
        if text not in self.special_tokens:
            raise VocabularyError(f"{text!r} is not among this vocabulary's special tokens {self.special_tokens}")
        return chr(SPECIAL_BASE + self.special_tokens.index(text))

    def decode(self, ids) -> bytes:
        """The bytes a token sequence writes (tokens a constraint never allows write nothing)."""
        return b"".join(self.token_bytes[i] or b"" for i in ids if i < len(self.token_bytes))

    def outlines_tokens(self) -> dict[bytes, list[int]]:
        """{bytes: [ids writing them]}, the form outlines-core's Vocabulary takes."""
        out: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            if b:  # tokens that write nothing would loop in every state
                out.setdefault(b, []).append(i)
        return out


@functools.lru_cache(maxsize=8)
def _from_tokenizer(tokenizer, size: int | None, special_tokens: tuple[str, ...]) -> TokenVocabulary:
    backend = getattr(tokenizer, "backend", tokenizer)  # dgemma.tokenizer.Tokenizer wraps tokenizers'
    spec = json.loads(backend.to_str())
    decoders = _decoder_types(spec.get("decoder"))
    n = backend.get_vocab_size(with_added_tokens=True)
    specials = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
    if len(special_tokens) > MAX_SPECIAL:
        raise VocabularyError(f"at most {MAX_SPECIAL} special tokens can take part in a constraint")
    wanted = {}
    for k, text in enumerate(special_tokens):
        token_id = backend.token_to_id(text)
        if token_id is None:
            raise VocabularyError(f"special token {text!r} is not in the tokenizer's vocabulary")
        wanted[token_id] = chr(SPECIAL_BASE + k).encode()

    byte_decoder = _byte_level_table() if "ByteLevel" in decoders else None
    token_bytes: list[bytes | None] = [None] * n
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i in wanted:
            token_bytes[i] = wanted[i]
        elif i in specials:
            continue
        elif byte_decoder is not None:
            token_bytes[i] = bytes(byte_decoder[c] for c in token) if all(c in byte_decoder for c in token) else None
        elif "ByteFallback" in decoders and _BYTE_TOKEN.fullmatch(token):
            token_bytes[i] = bytes([int(token[3:5], 16)])
        elif decoders & {"Replace", "Metaspace"}:
            token_bytes[i] = token.replace("\u2581", " ").encode()
        else:
            token_bytes[i] = backend.decode([i], skip_special_tokens=False).encode()
    if wanted:  # nothing but the named special tokens may write the private-use characters
        for i, b in enumerate(token_bytes):
            if b is not None and i not in wanted and (_SENTINEL_LEAD in b):
                token_bytes[i] = None
    return TokenVocabulary(tuple(token_bytes), max(n, size or 0), special_tokens)


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in decoder.get("decoders", [])))
    return {decoder["type"]}


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's character -> byte table: printable Latin-1 bytes stand for themselves, the
    other bytes (control characters, space, ...) for 256 + their order among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table
