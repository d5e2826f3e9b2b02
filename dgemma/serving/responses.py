"""Response bodies and stream chunks, in the shape of their endpoint (/v1/completions or
/v1/chat/completions); openapi.py describes them for /openapi.json."""

from __future__ import annotations

import time
import uuid

from dgemma.chat.tool_calls import openai_tool_call


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChunkWriter:
    """Builds the bodies and stream chunks of one request, in the shape of its endpoint.

    Drafts ride in ordinary chunks: the choice has empty text / an empty delta and carries an extra
    field `dgemma_draft`, so the official client parses them like any chunk (extra fields are kept,
    readable as `choice.dgemma_draft`) and code that concatenates the text sees nothing.
    """

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _chunk(self, index: int, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [{"index": index, **choice}], **extra}

    def _delta(self, index: int, delta: dict, finish_reason=None, **extra) -> dict:
        body = {"delta": delta} if self.chat else {"text": delta.get("content", ""), "logprobs": None}
        return self._chunk(index, {**body, "finish_reason": finish_reason}, **extra)

    def first(self, index: int = 0) -> dict | None:
        """Chat streams open each choice with the assistant role; completion streams have no such chunk."""
        return self._delta(index, {"role": "assistant", "content": ""}) if self.chat else None

    def text(self, text: str, index: int = 0) -> dict:
        return self._delta(index, {"content": text})

    def reasoning(self, text: str, index: int = 0) -> dict:
        return self._delta(index, {"reasoning_content": text})

    def tool_call(self, call: dict, position: int, index: int = 0) -> dict:
        """One whole call (id, name and arguments in one delta), `position` in the answer's list of calls."""
        return self._delta(index, {"tool_calls": [openai_tool_call(call, position)]})

    def draft(self, draft: dict, index: int = 0) -> dict:
        chunk = self._delta(index, {})
        chunk["choices"][0]["dgemma_draft"] = draft
        return chunk

    def finish(self, reason: str, stats: dict, index: int = 0) -> dict:
        return self._delta(index, {}, reason, dgemma=stats)

    def usage_chunk(self, counts: dict) -> dict:
        return {**self._chunk(0, {}), "choices": [], "usage": counts}

    def response(self, answers: list[tuple[dict | str, str]], counts: dict, stats: dict,
                 logprobs: list[dict] | None = None) -> dict:
        """answers: (chat message or completion text, finish reason) per choice; logprobs: each choice's
        (scoring)."""
        key = "message" if self.chat else "text"
        choices = [{"index": i, key: answer, "logprobs": logprobs[i] if logprobs else None, "finish_reason": reason}
                   for i, (answer, reason) in enumerate(answers)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": counts, "dgemma": stats}
