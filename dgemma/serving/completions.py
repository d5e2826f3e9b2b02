"""A request's run through the engine worker, for the routes of app.py: one engine request per prompt and
choice, then whole answers or a stream of chunks; scoring and echo-only completions too.

What each engine request carries (its sampling config, seed and constraint: a token automaton for
response_format, structured_outputs.regex or a required or named tool_choice) is engine_inputs.py's
translation of the request. A request becomes one engine request per prompt and choice (`n`, see worker.py);
its committed canvases become text through `TextAssembler`, a chat answer's text becomes reasoning, content
and tool calls through `ChatOutput` (dgemma/chat/chat_output.py), its drafts (only when asked for) become
`dgemma_draft` chunks (chunk_writer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from dgemma.chat.chat_output import ChatOutput
from dgemma.chat.codec import TextAssembler
from dgemma.config import SamplingConfig
from dgemma.serving.chunk_writer import ChunkWriter, usage
from dgemma.serving.engine_inputs import answer_constraint, choice_seeds, sampling_for, token_limit
from dgemma.serving.errors import APIError, bad_request
from dgemma.serving.legacy_logprobs import scored_choice
from dgemma.serving.requests import CompletionRequest
from dgemma.serving.state import ServerState
from dgemma.serving.worker import EngineWorker, QueueFull, RequestStream

# -- generation ---------------------------------------------------------------------------------------

@dataclass
class ChoiceInProgress:
    """One choice of a request (n > 1: one per seed) while the engine writes it, and what turns its tokens
    into output."""

    index: int
    stream: RequestStream
    assembler: TextAssembler  # tokens -> text deltas, stop strings
    output: ChatOutput | None  # chat: text -> reasoning, content, tool calls
    echo: str = ""  # a completion with echo: the prompt's text, sent first


async def generate(state: ServerState, request: Request, body, prompts: list[list[int]], *, chat: bool,
                   parse_tools: bool = False, tools_constraint=None, echoes: list[str] | None = None, images=None,
                   adapter: int = 0):
    """Every prompt gets n choices, indexed prompt * n + choice (OpenAI's order); `echoes`: each prompt's
    text, to send before its choices' own; `images`: a chat prompt's ImageInputs; `tools_constraint`: a
    required or named tool_choice's (engine_inputs.tool_constraint)."""
    max_tokens = token_limit(state, body)
    samplings = [sampling_for(state, body, prompt, max_tokens, adapter) for prompt in prompts]
    constraint = await answer_constraint(state, body, tools_constraint)
    streams = _submit(state, body, prompts, samplings, constraint, images, adapter)
    decode = state.codec.decode_chat if chat else state.codec.decode
    choices = [ChoiceInProgress(i, stream, TextAssembler(decode, body.stop or [], state.codec.unsettled),
                                ChatOutput(parse_tools) if chat else None, echoes[i // body.choices] if echoes else "")
               for i, stream in enumerate(streams)]
    writer = ChunkWriter(chat, state.served_name(adapter))
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        cancel = BackgroundTask(_cancel_all, state.worker, streams)  # runs when the response ends or the client leaves
        return StreamingResponse(_stream_chunks(state, body, choices, writer, prompt_tokens),
                                 media_type="text/event-stream", background=cancel,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, streams))
    try:
        answers = await asyncio.gather(*(_answer(state, choice) for choice in choices))
    finally:
        watcher.cancel()
        _cancel_all(state.worker, streams)
    counts = usage(prompt_tokens, sum(len(c.assembler.tokens) for c in choices), _cached_tokens(choices, body.choices))
    stats = _stats(state, choices[0])
    if len(choices) > 1:
        stats["choices"] = [_stats(state, c) for c in choices]
    return writer.response(answers, counts, stats)


def _cached_tokens(choices: list[ChoiceInProgress], n: int) -> int:
    """Prompt tokens read from the prefix cache, each prompt counted once (as prompt_tokens counts it): by
    its first choice."""
    return sum(c.stream.request.cached_tokens for c in choices[::n])


def _submit(state: ServerState, body, prompts: list[list[int]], samplings: list[SamplingConfig], constraint,
            images=None, adapter: int = 0) -> list[RequestStream]:
    """One engine request per prompt and choice, a prompt's choices seeded seed, seed+1, ... (random when
    none is given); all or none."""
    n = body.choices
    if n * len(prompts) > state.worker.max_queue:
        raise bad_request(f"at most {state.worker.max_queue} prompts times n choices fit this server's queue",
                          param="n" if len(prompts) == 1 else "prompt")
    seeds = choice_seeds(body)
    streams: list[RequestStream] = []
    with _engine_errors(state):
        try:
            for prompt, sampling in zip(prompts, samplings):
                for seed in seeds:
                    streams.append(state.worker.submit(prompt, sampling, seed=seed,
                                                       constraint=constraint, want_drafts=body.include_drafts,
                                                       images=images, adapter=adapter))
        except BaseException:
            _cancel_all(state.worker, streams)
            raise
    return streams


@contextlib.contextmanager
def _engine_errors(state: ServerState):
    """What submitting to the engine raises, as the client's errors: queue full, too long, not running."""
    try:
        yield
    except QueueFull as e:
        raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(state.worker.retry_after())}) from None
    except ValueError as e:  # the engine's own length check
        raise bad_request(str(e), code="context_length_exceeded") from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None


async def score(state: ServerState, request: Request, body: CompletionRequest, prompts: list[list[int]],
                echoes: list[str]):
    """Score the prompts together (engine/scoring.py): one choice per prompt, in OpenAI's logprobs shape."""
    too_long = [len(p) for p in prompts if len(p) > state.worker.max_length]
    if too_long:
        raise bad_request(f"a prompt of {too_long[0]} tokens does not fit: the context holds "
                          f"{state.worker.max_length}", param="prompt", code="context_length_exceeded")
    if len(prompts) > state.worker.max_queue:
        raise bad_request(f"at most {state.worker.max_queue} prompts fit this server's queue", param="prompt")
    with _engine_errors(state):
        streams = state.worker.submit_scoring(prompts, body.logprobs)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, streams))
    try:
        for stream in streams:
            while (item := await stream.next()).kind != "finished":
                if item.kind == "error":
                    raise _failure(item)
            if item.finish_reason != "scored":
                raise APIError(500, "the request was cancelled", type="server_error")
    finally:
        watcher.cancel()
        _cancel_all(state.worker, streams)
    writer = ChunkWriter(False, state.model_name)
    choices = [scored_choice(state.codec, prompt, echo, stream.request.scores, echo=body.echo,
                             next_token=body.max_tokens == 1, top=body.logprobs)
               for prompt, echo, stream in zip(prompts, echoes, streams)]
    counts = usage(sum(len(p) for p in prompts), len(prompts) * body.max_tokens,
                   sum(s.request.cached_tokens for s in streams))
    stats = {"elapsed_s": time.perf_counter() - streams[0].request.state.t_submit}
    return writer.response([(c["text"], "length") for c in choices], counts, stats,
                           logprobs=[c["logprobs"] for c in choices])


def echo_only(state: ServerState, body: CompletionRequest, prompts: list[list[int]], echoes: list[str]):
    """max_tokens 0 without logprobs: nothing to generate; the prompts themselves when echoed."""
    if body.stream:
        raise bad_request("max_tokens 0 writes nothing to stream; send stream: false", param="stream")
    texts = [echo if body.echo else "" for echo in echoes for _ in range(body.choices)]
    counts = usage(sum(len(p) for p in prompts), 0)
    return ChunkWriter(False, state.model_name).response([(t, "length") for t in texts], counts, {})


def _failure(failure) -> APIError:
    """A request the engine could not finish (it failed, the server stops, the time limit passed), as its error."""
    kind = "timeout_error" if failure.code == "request_timeout" else "server_error"
    return APIError(failure.status, failure.message, type=kind, code=failure.code)


def _cancel_all(worker: EngineWorker, streams: list[RequestStream]):
    for stream in streams:
        worker.cancel(stream)


# -- answers and streams ------------------------------------------------------------------------------

def _sse(payload: dict) -> str:
    """One server-sent event: `payload` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _outputs(state: ServerState, choice: ChoiceInProgress) -> AsyncIterator[tuple[str, object]]:
    """("draft", payload) / ("content" | "reasoning", text) / ("tool_call", call) / ("end", finish_reason)."""
    stream, assembler, output = choice.stream, choice.assembler, choice.output
    while True:
        item = await stream.next()
        if item.kind == "error":
            raise _failure(item)
        if item.kind == "draft":
            yield "draft", _draft_payload(state.codec, item)
            continue
        if item.kind not in ("canvas", "finished"):
            continue
        ended = item.kind == "finished"
        text = assembler.flush() if ended else assembler.add(item.tokens)
        if assembler.stopped:  # a stop string: the rest is not wanted, free the row now
            state.worker.cancel(stream)
            ended = True
        if output is None:
            if text:
                yield "content", text
        else:
            for part in output.add(text) + (output.finish() if ended else []):
                yield part
        if ended:
            reason = "stop" if assembler.stopped or item.finish_reason != "length" else "length"
            yield "end", "tool_calls" if output is not None and output.calls else reason
            return


async def _answer(state: ServerState, choice: ChoiceInProgress) -> tuple[dict | str, str]:
    """A whole answer: (chat message or completion text, finish reason)."""
    texts, reason = [choice.echo], None
    async for kind, value in _outputs(state, choice):
        if kind == "content":
            texts.append(value)
        elif kind == "end":
            reason = value
    return (choice.output.message() if choice.output is not None else "".join(texts)), reason


async def _merged(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(i, item) from several async iterators as their items come."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()


async def _stream_chunks(state, body, choices: list[ChoiceInProgress], writer: ChunkWriter, prompt_tokens: int):
    try:
        for choice in choices:
            first = writer.first(choice.index)
            if first is not None:
                yield _sse(first)
            if choice.echo:
                yield _sse(writer.text(choice.echo, choice.index))
        calls = [0] * len(choices)  # tool calls sent so far, per choice
        async for i, (kind, value) in _merged([_outputs(state, choice) for choice in choices]):
            if kind == "draft":
                yield _sse(writer.draft(value, i))
            elif kind == "content":
                yield _sse(writer.text(value, i))
            elif kind == "reasoning":
                yield _sse(writer.reasoning(value, i))
            elif kind == "tool_call":
                yield _sse(writer.tool_call(value, calls[i], i))
                calls[i] += 1
            else:
                yield _sse(writer.finish(value, _stats(state, choices[i]), i))
        if body.include_usage:
            completion = sum(len(c.assembler.tokens) for c in choices)
            yield _sse(writer.usage_chunk(usage(prompt_tokens, completion, _cached_tokens(choices, body.choices))))
    except APIError as e:  # the headers are gone; the error travels as an event (the client raises it)
        yield _sse(e.body())
    finally:
        _cancel_all(state.worker, [c.stream for c in choices])  # the client left mid-stream: free the rows at once
    yield "data: [DONE]\n\n"


async def _cancel_on_disconnect(request: Request, worker: EngineWorker, streams: list[RequestStream]):
    """After the body is read, the next message is the disconnect: a client that gave up frees its rows."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            _cancel_all(worker, streams)
            return


def _draft_payload(codec, event) -> dict:
    kept = {} if event.settled is None else {"settled": event.settled}
    return {"canvas": event.canvas_index, "step": event.step + 1, "tokens": event.tokens,
            "pieces": [codec.piece(t) for t in event.tokens],
            "entropy": [round(e, 4) for e in event.entropy], "accepted": event.accepted,
            "edited": event.edited or [False] * len(event.tokens),
            "corrected": event.corrected or [False] * len(event.tokens), "phase": event.phase, **kept}


def _stats(state: ServerState, choice: ChoiceInProgress) -> dict:
    request = choice.stream.request
    stats = {"seed": request.seed, **request.stats()}
    verdict = state.codec.check_answer(request.prompt, choice.assembler.tokens)
    if verdict is not None:
        stats[state.codec.task] = verdict
    return stats
