"""What the server and `dgemma chat` read and write for one model: prompts to token ids, token ids to text.

`Codec` is what they know of a model's task. `TextCodec` serves a text model (`tokenizer.json`
plus a chat template: text in, text out); a task with its own format brings its own codec
(`dgemma.tasks.task_codec`, e.g. the sudoku model's), which the server uses the same way.

`TextAssembler` turns the committed tokens of one request into text deltas: it never sends half a
character or the start of what may become a stop string.
"""

from __future__ import annotations

import functools
from typing import Callable

from dgemma.chat import chat_output


class PromptError(ValueError):
    """The prompt cannot be turned into token ids (the message says why); the client gets a 400."""


def user_content(text: str, images: int = 0):
    """A user turn's content for the chat template: the text, after one image part per image."""
    return [{"type": "image"}] * images + [{"type": "text", "text": text}] if images else text


def encode_prompt(tokenizer, text: str, chat: bool, images: int = 0, placeholder: str | None = None) -> list[int]:
    """A prompt's token ids with one image placeholder per image (`placeholder`: its text,
    `dgemma.images.image_placeholder`): with `chat`, a user turn of the chat template whose image parts come
    before the text; else the text, whose placeholders say where the images go, or all of them in front."""
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": user_content(text, images)}],
                                             add_generation_prompt=True)
    if images and placeholder not in text:
        text = placeholder * images + text
    return tokenizer.encode(text)


class Codec:
    """Prompts in (`encode_text`, `encode_chat`, `check_ids`), answers out (`decode`, `piece` for one
    draft token, `check_answer` for what the task can say of a finished answer)."""

    task: str
    fixed_max_tokens: int | None = None  # None: any length the context allows
    answer_ends: frozenset[int] = frozenset()  # tokens that end an answer besides the model's EOS

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size  # the model's: token-id prompts must index its embedding table

    def check_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def decode_chat(self, tokens: list[int]) -> str:
        """A chat answer's text, with the marks its parser reads (chat_output.py)."""
        return self.decode(tokens)

    def unsettled(self, tokens: list[int]) -> int:
        """How many of the last tokens may still decode differently once more tokens follow."""
        return 0

    def token_texts(self, tokens: list[int]) -> list[str]:
        """What each token adds to `decode(tokens)`, in order (joined, they make it)."""
        return [self.decode([t]) for t in tokens]

    def check_answer(self, prompt: list[int], tokens: list[int]) -> dict | None:
        """A task's verdict on a finished answer, sent with its statistics under the task's name; None: none."""
        return None


class TextCodec(Codec):
    task = "text"

    def __init__(self, tokenizer, vocab_size: int):
        super().__init__(vocab_size)
        self.tokenizer = tokenizer
        self.markup = self._known(chat_output.MARKS)
        self.byte_ids = self._known(f"<0x{b:02X}>" for b in range(256))
        self.answer_ends = self._known(chat_output.ANSWER_ENDS)
        # one decode per distinct id, not per draft position per step; bounded like the vocabulary
        self.piece = functools.lru_cache(maxsize=1 << 16)(self._piece)

    def unsettled(self, tokens: list[int]) -> int:
        """How many of the last tokens are byte-fallback tokens (`<0xNN>`): their text may still change."""
        n = 0
        while n < len(tokens) and tokens[-1 - n] in self.byte_ids:
            n += 1
        return n

    def token_texts(self, tokens: list[int]) -> list[str]:
        """Decoded as a stream: a token's text depends on its neighbours (spaces, byte-fallback runs, of which
        the token that completes a character carries it and the others carry "")."""
        from tokenizers.decoders import DecodeStream

        stream, backend = DecodeStream(skip_special_tokens=True), self.tokenizer.backend
        return [stream.step(backend, t) or "" for t in tokens]

    def _known(self, tokens) -> frozenset[int]:
        """The ids of those of `tokens` the vocabulary has as single tokens."""
        return frozenset(i for i in map(self.tokenizer.token_to_id, tokens) if i is not None)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], template_kwargs: dict) -> list[int]:
        from dgemma.tokenizer import TokenizerError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        except TokenizerError as e:
            raise PromptError(str(e)) from None

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def decode_chat(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, keep=self.markup)

    def constraint(self, kind: str, spec: dict | str | None = None):
        """The token automaton for `kind`: "json_object", "json_schema" (spec: the schema) or "regex" (spec:
        the pattern). Raises dgemma.structured.SchemaError / ConstraintError. Building can take seconds on
        a large vocabulary (cached per spec): call it off the event loop."""
        from dgemma.structured import TokenVocabulary, json_object_constraint, json_schema_constraint, regex_constraint

        vocabulary = TokenVocabulary.from_tokenizer(self.tokenizer, size=self.vocab_size)
        if kind == "json_object":
            return json_object_constraint(vocabulary)
        if kind == "regex":
            return regex_constraint(spec, vocabulary)
        return json_schema_constraint(spec, vocabulary)

    def _piece(self, token: int) -> str:
        # special tokens are shown too: a draft is a picture of the canvas, not the final text
        return self.tokenizer.decode([token], skip_special_tokens=False)


class TextAssembler:
    """Committed tokens in, text deltas out, honouring stop strings.

    Text is decoded from all tokens so far (a token's text may depend on its neighbours) and only the
    part past what was already sent goes out. Held back until the next canvas: a trailing U+FFFD (a
    character split across canvases), a tail that could be the start of a stop string, and the text of
    the last `unsettled(tokens)` tokens (byte-fallback tokens decode as one run: a byte that follows can
    turn a run's "é" into three U+FFFD, so a run's text is final only once another token ends it).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str],
                 unsettled: Callable[[list[int]], int] = lambda tokens: 0):
        self.decode = decode
        self.stop = stop
        self.unsettled = unsettled
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.stopped = False  # a stop string was found; the text ends before it

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        # Nothing sent ever ends with the start of a stop string, so a stop cannot begin before `sent`.
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._advance(text[: min(hits)])
        end = len(text) - self._stop_prefix_length(text)
        held = self.unsettled(self.tokens)
        if held:
            end = min(end, len(self.decode(self.tokens[:-held])))
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        return self._advance(text[:end])

    def flush(self) -> str:
        """The request ended: what was held back goes out (a stop string can no longer complete)."""
        if self.stopped:
            return ""
        return self._advance(self.decode(self.tokens))

    def _advance(self, text: str) -> str:
        # Decoding is prefix-stable for the tokenizers we load; were it not, sent text is never retracted.
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[-n:]):
                    longest = n
                    break
        return longest
