"""What the server reads and writes for one model: prompts to token ids, token ids to text.

Two kinds of model folder:
  * a text model (the usual case): `tokenizer.json` plus a chat template; text in, text out;
  * the sudoku model (`dgemma_task.json` says {"task": "sudoku"}): the prompt is an 81-character
    puzzle ('0' or '.' for blanks) and the answer is 81 digits, '.' where the model wrote a
    non-digit token. Its vocabulary of 16 needs no tokenizer file.

`TextAssembler` turns the committed tokens of one request into text deltas: it never sends half a
character or the start of what may become a stop string.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

from dgemma.serving import chat_output
from dgemma.tasks import sudoku

TASK_FILE = "dgemma_task.json"
TASKS = ("text", "sudoku")


class PromptError(ValueError):
    """The prompt cannot be turned into token ids (the message says why); the client gets a 400."""


def read_task(folder: str | Path) -> str:
    """The task a model folder declares in `dgemma_task.json` ("text" when the file is absent)."""
    path = Path(folder) / TASK_FILE
    if not path.is_file():
        return "text"
    try:
        task = json.loads(path.read_text()).get("task")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{path}: expected a JSON object like {{\"task\": \"sudoku\"}}") from None
    if task not in TASKS:
        raise ValueError(f"{path}: unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return task


class Codec:
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


class SudokuCodec(Codec):
    task = "sudoku"
    fixed_max_tokens = sudoku.SudokuVocab.canvas_length  # an answer is one canvas of 81 cells

    def __init__(self, vocab_size: int = sudoku.SudokuVocab.vocab_size):
        super().__init__(vocab_size)
        self._names = sudoku.SudokuVocab.token_names()

    def encode_text(self, text: str) -> list[int]:
        try:
            return sudoku.encode_prompt(sudoku.parse_puzzle(text))
        except ValueError as e:
            raise PromptError(f"not a sudoku puzzle: {e} (81 cells, digits 1-9, '0' or '.' for blanks)") from None

    def encode_chat(self, messages: list[dict], template_kwargs: dict) -> list[int]:
        """The puzzle is the last user message; earlier turns mean nothing to this model."""
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise PromptError("a sudoku request needs a user message holding the puzzle")
        return self.encode_text(users[-1])

    def grid(self, tokens: list[int]) -> tuple[int, ...]:
        """The answer grid; a cell without a digit is 0, so are the cells after an EOS the model wrote."""
        cells = sudoku.SudokuVocab.canvas_length
        return sudoku.decode_canvas(list(tokens)[:cells] + [sudoku.SudokuVocab.BLANK] * (cells - len(tokens)))

    def decode(self, tokens: list[int]) -> str:
        """81 characters, '.' for a blank cell."""
        return sudoku.grid_to_string(self.grid(tokens), blank=".")

    def piece(self, token: int) -> str:
        return self._names[token] if 0 <= token < len(self._names) else f"<{token}>"

    def check_answer(self, prompt: list[int], tokens: list[int]) -> dict:
        """Whether the answer solves the puzzle in the prompt (the page and clients show it)."""
        puzzle = tuple(t - 3 if t in sudoku.SudokuVocab.DIGIT_IDS else 0 for t in prompt[1:])
        problems = sudoku.solution_errors(puzzle, self.grid(tokens))
        return {"solved": not problems, "problems": problems[:5]}


def make_codec(folder: str | Path, task: str, vocab_size: int):
    if task == "sudoku":
        return SudokuCodec(vocab_size)
    from dgemma.tokenizer import Tokenizer

    return TextCodec(Tokenizer.from_folder(folder), vocab_size)


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
