"""A chat answer's raw text, split into what OpenAI clients read: reasoning, content and tool calls.

Gemma 4 writes its thoughts as `<|channel>thought\\n...<channel|>` and its tool calls as
`<|tool_call>call:NAME{...}<tool_call|>` (tool_calls.py). `ChatOutput` reads the answer in pieces as
they are committed and gives back parts in order: ("reasoning", text), ("content", text) and
("tool_call", {"id", "name", "arguments"}). It never gives out text that might still turn into a mark (a
tail like "<|tool" waits for the next piece), a call before it is closed and parsed, or whitespace
before a call. A call that does not parse is given back as content, marks included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dgemma.chat.tool_calls import (
    CALL_END,
    CALL_START,
    QUOTE,
    RESPONSE_START,
    SyntaxProblem,
    new_call_id,
    openai_tool_call,
    parse_call,
)

THOUGHT_START, THOUGHT_END = "<|channel>", "<channel|>"
THOUGHT_LABEL = "thought\n"  # the channel's name line, not part of the thought
MARKS = (THOUGHT_START, THOUGHT_END, CALL_START, CALL_END, QUOTE)  # special tokens the parser must see
ANSWER_ENDS = (RESPONSE_START, "<turn|>")  # after its calls the model waits for results; the turn's end


def _partial_mark(text: str, marks: list[str]) -> int:
    """Length of the longest tail of `text` that is the start (not the whole) of one of `marks`."""
    for n in range(min(len(text), max(map(len, marks)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in marks):
            return n
    return 0


def _call_end(text: str) -> int:
    """Where the call's end mark is, outside its strings (a string may hold any text); -1: not yet."""
    at = 0
    while True:
        end, quote = text.find(CALL_END, at), text.find(QUOTE, at)
        if quote < 0 or 0 <= end < quote:
            return end
        close = text.find(QUOTE, quote + len(QUOTE))
        if close < 0:
            return -1
        at = close + len(QUOTE)


@dataclass
class ChatOutput:
    parse_tools: bool  # False: call marks are ordinary text (no tools offered, or tool_choice "none")
    mode: str = "content"  # "content" | "label" | "reasoning" | "call"
    buffer: str = ""
    space: str = ""  # trailing whitespace of the content so far, held until text follows
    calls: int = 0
    parts: list[tuple[str, object]] = field(default_factory=list)

    def add(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        out: list[tuple[str, object]] = []
        while self._step(out):
            pass
        self.parts += out
        return out

    def finish(self) -> list[tuple[str, object]]:
        """The answer ended: what is held back goes out (an unclosed call as content)."""
        out: list[tuple[str, object]] = []
        rest, self.buffer = self.buffer, ""
        if self.mode == "call":
            self._content(out, CALL_START + rest)
        elif self.mode in ("label", "reasoning"):
            if rest:
                out.append(("reasoning", rest))
        else:
            self._content(out, rest)
        if self.space and not self.calls:
            out.append(("content", self.space))
        self.space = ""
        self.parts += out
        return out

    def _step(self, out) -> bool:
        """Consume what can be decided from the buffer; True when the mode changed (look again)."""
        buf = self.buffer
        if self.mode == "content":
            marks = [THOUGHT_START] + ([CALL_START] if self.parse_tools else [])
            found = [(buf.find(m), m) for m in marks if m in buf]
            if found:
                at, mark = min(found)
                self._content(out, buf[:at])
                self.buffer = buf[at + len(mark):]
                self.mode = "label" if mark == THOUGHT_START else "call"
                return True
            keep = _partial_mark(buf, marks)
            self._content(out, buf[: len(buf) - keep])
            self.buffer = buf[len(buf) - keep:]
            return False
        if self.mode == "label":
            if buf.startswith(THOUGHT_LABEL):
                self.buffer, self.mode = buf[len(THOUGHT_LABEL):], "reasoning"
                return True
            if THOUGHT_LABEL.startswith(buf):
                return False  # too short to tell yet
            self.mode = "reasoning"
            return True
        end = THOUGHT_END if self.mode == "reasoning" else CALL_END
        at = buf.find(end) if self.mode == "reasoning" else _call_end(buf)
        if at < 0:
            if self.mode == "reasoning":
                keep = _partial_mark(buf, [end])
                if len(buf) > keep:
                    out.append(("reasoning", buf[: len(buf) - keep]))
                self.buffer = buf[len(buf) - keep:]
            return False
        inner, self.buffer = buf[:at], buf[at + len(end):]
        if self.mode == "reasoning":
            if inner:
                out.append(("reasoning", inner))
        else:
            try:
                name, arguments = parse_call(inner)
            except SyntaxProblem:
                self._content(out, CALL_START + inner + CALL_END)
            else:
                self.space = ""  # whitespace between calls is not an answer
                self.calls += 1
                out.append(("tool_call", {"id": new_call_id(), "name": name, "arguments": arguments}))
        self.mode = "content"
        return True

    def _content(self, out, text: str):
        # trailing whitespace waits: before a call it is dropped, before more text it goes out with it
        body = text.rstrip()
        if body:
            out.append(("content", self.space + body))
            self.space = ""
        self.space += text[len(body):]

    # -- the whole answer ------------------------------------------------------------------------
    def message(self) -> dict:
        """After `finish`: OpenAI's assistant message, `reasoning_content` beside it when there was one."""
        text = {kind: "".join(v for k, v in self.parts if k == kind) for kind in ("content", "reasoning")}
        calls = [v for k, v in self.parts if k == "tool_call"]
        message: dict = {"role": "assistant", "content": text["content"] if text["content"] or not calls else None}
        if text["reasoning"]:
            message["reasoning_content"] = text["reasoning"]
        if calls:
            message["tool_calls"] = [openai_tool_call(call) for call in calls]
        return message
