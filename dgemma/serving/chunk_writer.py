"""The bodies and stream chunks of one generation request, written in the shape of its endpoint
(/v1/completions or /v1/chat/completions) with responses.py's models, and sent as `Body.wire()`."""

from __future__ import annotations

import time
import uuid

from dgemma.chat.tool_calls import openai_tool_call
from dgemma.serving.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                      ChatCompletionChunk, ChatDelta, Completion, CompletionChoice,
                                      CompletionChunk, CompletionChunkChoice, Draft, LegacyLogprobs,
                                      PromptTokensDetails, Stats, Usage)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI's usage; `cached_tokens`: prompt tokens the engine's prefix cache gave instead of the encoder."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


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

    def _chunk(self, choices: list, **extra) -> dict:
        if self.chat:
            chunk = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                        model=self.model, choices=choices, **extra)
        else:
            chunk = CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.model,
                                    choices=choices, **extra)
        return chunk.wire()

    def _delta(self, index: int, delta: dict, finish_reason=None, *, draft: dict | None = None, **extra) -> dict:
        """A chunk of one choice: `delta` is a chat delta's fields (a completion chunk takes its content)."""
        drafted = {} if draft is None else {"dgemma_draft": Draft(**draft)}
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=ChatDelta(**delta), finish_reason=finish_reason, **drafted)
        else:
            choice = CompletionChunkChoice(index=index, text=delta.get("content", ""), logprobs=None,
                                           finish_reason=finish_reason, **drafted)
        return self._chunk([choice], **extra)

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
        return self._delta(index, {}, draft=draft)

    def finish(self, reason: str, stats: dict, index: int = 0) -> dict:
        return self._delta(index, {}, reason, dgemma=Stats(**stats))

    def usage_chunk(self, counts: Usage) -> dict:
        return self._chunk([], usage=counts)

    def response(self, answers: list[tuple[dict | str, str]], counts: Usage, stats: dict,
                 logprobs: list[dict] | None = None) -> dict:
        """answers: (chat message or completion text, finish reason) per choice; logprobs: each choice's
        (scoring)."""
        common = dict(id=self.id, created=self.created, model=self.model, usage=counts, dgemma=Stats(**stats))
        if self.chat:
            choices = [ChatChoice(index=i, message=AssistantMessage(**message), logprobs=None, finish_reason=reason)
                       for i, (message, reason) in enumerate(answers)]
            return ChatCompletion(object="chat.completion", choices=choices, **common).wire()
        choices = [CompletionChoice(index=i, text=text, logprobs=LegacyLogprobs(**logprobs[i]) if logprobs else None,
                                    finish_reason=reason) for i, (text, reason) in enumerate(answers)]
        return Completion(object="text_completion", choices=choices, **common).wire()
