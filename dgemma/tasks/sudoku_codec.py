"""The sudoku model served: the prompt is an 81-character puzzle ('0' or '.' for blanks), the answer is 81
digits, '.' where the model wrote a non-digit token, and every answer says whether it solves the puzzle.
Its vocabulary of 16 needs no tokenizer file."""

from __future__ import annotations

from dgemma.chat.codec import Codec, PromptError
from dgemma.tasks import sudoku


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
