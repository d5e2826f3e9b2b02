"""Tasks the project trains and evaluates on, each independent of any model (see `sudoku`).

A model folder made for a task says so in `dgemma_task.json` ({"task": "sudoku"}); without that file it
is a text model. `dgemma serve` asks `task_codec` how to read a model's prompts and write its answers.
"""

from __future__ import annotations

import json
from pathlib import Path

TASK_FILE = "dgemma_task.json"
TASKS = ("text", "sudoku")


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


def task_codec(task: str, folder: str | Path, vocab_size: int):
    """The codec (dgemma.chat.codec.Codec) a model of `task` in `folder` is served with: a text model's reads the
    folder's tokenizer, another task brings its own. `dgemma serve` hands it to the server as
    `functools.partial(task_codec, task)`, called with the folder and vocabulary of the model it loaded."""
    if task == "text":
        from dgemma.chat.codec import TextCodec
        from dgemma.tokenizer import Tokenizer

        return TextCodec(Tokenizer.from_folder(folder), vocab_size)
    if task == "sudoku":
        from dgemma.tasks.sudoku_codec import SudokuCodec

        return SudokuCodec(vocab_size)
    raise ValueError(f"no codec for task {task!r}")
