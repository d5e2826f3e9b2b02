"""Training data: JSONL in, token ids out, batches of [prompt ; response ; EOS fill].

Three line forms, mixed freely in one file:
    {"prompt_ids": [...], "response_ids": [...]}      pre-tokenised (any vocabulary; taken as given)
    {"prompt": "...", "response": "..."}              text, rendered as one user turn + the answer
    {"messages": [{"role": ..., "content": ...}, ...]} chat; the last message is the trained answer

Every example becomes `prompt` and `response` token ids. The response is filled with EOS up to the next
canvas boundary (response-relative, as the published recipe does); an empty response still gets one
canvas of EOS, a response that is already a whole number of canvases gets no fill.

The order examples are seen in is a pure function of (seed, position in the stream): position n is
example perm_e[n mod D] of epoch e = n div D, with perm_e a seeded permutation. A run's data position is
therefore one integer (samples consumed), and any split of a global batch over processes and
micro-batches reads the same examples.
"""

from __future__ import annotations

import importlib
import json
import math
import random
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from dgemma.config import ConfigError
from dgemma.training.config import AUGMENTATIONS


class DataError(ConfigError):
    """Unusable training data; the message names the file and line."""


# ---------------------------------------------------------------------------------------------
# One JSONL record -> (prompt ids, response ids)
# ---------------------------------------------------------------------------------------------
class BadRecord(ValueError):
    """A record that cannot become an example (reported with its line number)."""


def _id_list(value, key: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRecord(f"{key} must be a list of integers")
    bad = [i for i in value if not 0 <= i < vocab_size]
    if bad:
        raise BadRecord(f"{key} holds token id {bad[0]} outside the vocabulary 0..{vocab_size - 1}")
    return value


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRecord("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRecord(f"messages[{i}] must be an object with string 'role' and 'content'")
    if messages[-1]["role"] != "assistant":
        raise BadRecord("the last message must have role 'assistant' (it is the trained response)")
    return messages


class TextEncoder:
    """Turns text records into ids with a `dgemma.tokenizer.Tokenizer`.

    Chat records (and prompt/response records when `use_chat_template`) are rendered with the chat
    template: prompt = template(earlier messages + generation prompt), response = the rest of
    template(all messages), so the answer ends with the template's end-of-turn marker. Both parts are
    encoded without extra special tokens (the template writes its own BOS). Without a template a
    prompt/response record is encode(prompt) (BOS from the tokenizer) and response + the first EOS id.
    """

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and tokenizer.chat_template is not None

    def chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        from dgemma.tokenizer import TokenizerError

        tok = self.tokenizer
        if tok.chat_template is None:
            raise BadRecord("a messages record needs a tokenizer with a chat template")
        try:
            prompt = tok.render_chat(messages[:-1], add_generation_prompt=True)
            full = tok.render_chat(messages, add_generation_prompt=False)
        except TokenizerError as e:
            raise BadRecord(str(e)) from None
        if not full.startswith(prompt):
            raise BadRecord("the chat template does not render the conversation as prompt + answer")
        return tok.encode(prompt, add_special_tokens=False), tok.encode(full[len(prompt):], add_special_tokens=False)

    def prompt_response(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        if self.use_chat_template:
            return self.chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
        eos = list(self.tokenizer.eos_token_ids[:1])
        return self.tokenizer.encode(prompt), self.tokenizer.encode(response, add_special_tokens=False) + eos


def encode_record(record, text: TextEncoder | None, vocab_size: int) -> tuple[list[int], list[int]]:
    """One parsed JSONL value -> (prompt ids, response ids). Raises BadRecord."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if "prompt_ids" in record or "response_ids" in record:
        return (_id_list(record.get("prompt_ids"), "prompt_ids", vocab_size),
                _id_list(record.get("response_ids"), "response_ids", vocab_size))
    if "messages" in record:
        messages = _check_messages(record["messages"])
        prompt, response = _text_encoder_or_fail(text).chat(messages)
    elif "prompt" in record or "response" in record:
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("response"), str):
            raise BadRecord("'prompt' and 'response' must both be strings")
        prompt, response = _text_encoder_or_fail(text).prompt_response(record["prompt"], record["response"])
    else:
        raise BadRecord("expected keys prompt_ids/response_ids, prompt/response, or messages")
    return _id_list(prompt, "prompt", vocab_size), _id_list(response, "response", vocab_size)


def _text_encoder_or_fail(text: TextEncoder | None) -> TextEncoder:
    if text is None:
        raise BadRecord("a text record needs a tokenizer (--tokenizer DIR, or a --model folder with one)")
    return text


# ---------------------------------------------------------------------------------------------
# The dataset: all examples as two flat int32 buffers with offsets (compact for millions of lines)
# ---------------------------------------------------------------------------------------------
def num_canvases(response_len: int, canvas_length: int) -> int:
    """Canvases a response fills, EOS fill included; at least one (an empty answer is a canvas of EOS)."""
    return max(1, math.ceil(response_len / canvas_length))


@dataclass
class Example:
    prompt: list[int]
    response: list[int]


class TokenizedDataset:
    def __init__(self):
        self._tokens = {"prompt": array("i"), "response": array("i")}
        self._offsets = {"prompt": array("q", [0]), "response": array("q", [0])}
        self.lines: array = array("q")  # source line number of every example

    def add(self, prompt: list[int], response: list[int], line: int):
        for key, ids in (("prompt", prompt), ("response", response)):
            self._tokens[key].extend(ids)
            self._offsets[key].append(len(self._tokens[key]))
        self.lines.append(line)

    def __len__(self) -> int:
        return len(self.lines)

    def longest_row(self, canvas_length: int) -> int:
        """The longest [prompt ; response ; EOS fill] of the dataset, in tokens (as `collate` lays it out)."""
        P, R = (array("q", (b - a for a, b in zip(o, o[1:]))) for o in (self._offsets["prompt"], self._offsets["response"]))
        return max((p + num_canvases(r, canvas_length) * canvas_length for p, r in zip(P, R)), default=0)

    def _slice(self, key: str, i: int) -> list[int]:
        return self._tokens[key][self._offsets[key][i] : self._offsets[key][i + 1]].tolist()

    def __getitem__(self, i: int) -> Example:
        return Example(self._slice("prompt", i), self._slice("response", i))


def load_jsonl(
    path,
    *,
    vocab_size: int,
    canvas_length: int,
    max_length: int,
    text: TextEncoder | None = None,
    skip_bad_lines: bool = False,
) -> TokenizedDataset:
    """Read and check every line before training starts.

    A bad line (invalid JSON, wrong shape, ids outside the vocabulary, too long for the context) stops
    with `path:line: reason`, or with `skip_bad_lines` is left out and reported on stderr.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    data, skipped = TokenizedDataset(), []
    with path.open("r", encoding="utf-8", errors="strict") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                raw = f.readline()
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
            if not raw:
                break
            if not raw.strip():
                continue
            try:
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise BadRecord(f"not valid JSON ({e.msg} at column {e.colno})") from None
                prompt, response = encode_record(record, text, vocab_size)
                total = len(prompt) + num_canvases(len(response), canvas_length) * canvas_length
                if total > max_length:
                    raise BadRecord(
                        f"prompt ({len(prompt)} tokens) + response ({len(response)} tokens, filled to whole "
                        f"canvases of {canvas_length}) = {total} tokens exceeds the context of {max_length}"
                    )
            except BadRecord as e:
                if not skip_bad_lines:
                    raise DataError(f"{path}:{lineno}: {e}") from None
                skipped.append((lineno, str(e)))
                continue
            data.add(prompt, response, lineno)
    if skipped:
        shown = "; ".join(f"line {n}: {why}" for n, why in skipped[:5])
        more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
        print(f"warning: skipped {len(skipped)} bad line(s) of {path}: {shown}{more}", file=sys.stderr)
    if len(data) == 0:
        raise DataError(f"{path}: no usable examples" + (f" ({len(skipped)} bad lines skipped)" if skipped else ""))
    return data


# ---------------------------------------------------------------------------------------------
# Order and batches
# ---------------------------------------------------------------------------------------------
class ExampleStream:
    """Position n of an endless, reshuffled-every-epoch stream -> dataset index (pure in seed and n)."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, None

    def index(self, n: int) -> int:
        epoch = n // self.size
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.size, generator=gen).tolist()
        return self._perm[n % self.size]


def read_examples(dataset: TokenizedDataset, stream: ExampleStream, positions: list[int], *,
                  augment: str | None = None, seed: int = 0) -> list[Example]:
    """The examples at these stream positions; with `augment`, each transformed by its own draw.

    The draw is seeded by (seed, stream position), like the noise, so a resumed or sharded run sees the
    same transformed examples as an uninterrupted one.
    """
    indices = [stream.index(n) for n in positions]
    examples = [dataset[i] for i in indices]
    if augment is None:
        return examples
    module, name = AUGMENTATIONS[augment].split(":")
    transform = getattr(importlib.import_module(module), name)
    out = []
    for ex, i, n in zip(examples, indices, positions):
        try:
            prompt, response = transform(ex.prompt, ex.response, random.Random(f"augment:{seed}:{n}"))
        except ValueError as e:
            raise DataError(f"line {dataset.lines[i]}: --augment {augment}: {e}") from None
        out.append(Example(prompt, response))
    return out


@dataclass
class Batch:
    """A micro-batch of B examples, right-padded to N = the longest [prompt ; response ; fill]."""

    input_ids: torch.Tensor  # (B, N) long, pad after each row's end
    attention_mask: torch.Tensor  # (B, N) bool, real tokens (fill included)
    ar_targets: torch.Tensor  # (B, N) bool: token at this position is a next-token target
    prompt_length: torch.Tensor  # (B,) long
    num_canvases: torch.Tensor  # (B,) long
    stream_position: torch.Tensor  # (B,) long, the examples' positions in the stream (seed their noise)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.ar_targets,
                                              self.prompt_length, self.num_canvases, self.stream_position)))


def collate(examples: list[Example], positions: list[int], *, canvas_length: int, pad_id: int, eos_id: int) -> Batch:
    """Lay out [prompt ; response ; EOS fill to a canvas boundary] per row.

    Next-token targets are the response plus the first fill EOS (where there is fill): the end of the
    answer is learnt once, the rest of the fill is a canvas artefact the encoder never has to predict.
    """
    rows, targets = [], []
    for ex in examples:
        P, R = len(ex.prompt), len(ex.response)
        M = num_canvases(R, canvas_length)
        rows.append(ex.prompt + ex.response + [eos_id] * (M * canvas_length - R))
        last_target = P + min(R + 1, M * canvas_length)  # exclusive
        targets.append((max(P, 1), last_target))  # position 0 has no predecessor
    B, N = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((B, N), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, N, dtype=torch.bool)
    ar_targets = torch.zeros(B, N, dtype=torch.bool)
    for b, (row, (lo, hi)) in enumerate(zip(rows, targets)):
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, : len(row)] = True
        ar_targets[b, lo:hi] = True
    prompt_length = torch.tensor([len(ex.prompt) for ex in examples], dtype=torch.long)
    canvases = torch.tensor([num_canvases(len(ex.response), canvas_length) for ex in examples], dtype=torch.long)
    return Batch(input_ids, attention_mask, ar_targets, prompt_length, canvases,
                 torch.tensor(positions, dtype=torch.long))
