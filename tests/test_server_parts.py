"""The server's parts in-process: text assembly with stop strings, the draft queue of a stream, task
detection, and an engine failure that must fail its requests but not the worker."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import torch
from conftest import wait_until

import dgemma
from dgemma.chat.codec import TextAssembler
from dgemma.config import SamplingConfig
from dgemma.engine import Engine, Event
from dgemma.serving.worker import EngineWorker, RequestStream
from dgemma.tasks import read_task
from dgemma.tasks.sudoku_codec import SudokuCodec


class CharCodec:
    """Token t is chr(t); token 0 is the first half of a character (decodes to U+FFFD alone)."""

    def decode(self, tokens):
        text = "".join("\ufffd" if t == 0 else chr(t) for t in tokens)
        return text.replace("\ufffd" + chr(1), "é")  # 0 followed by 1 completes the character


def ids(text):
    return [ord(c) for c in text]


def test_text_arrives_whole_and_stops_at_stop_strings():
    a = TextAssembler(CharCodec().decode, stop=["STOP"])
    assert a.add(ids("hello ST")) == "hello "  # "ST" may begin "STOP": held back
    assert a.add(ids("ART ")) == "START "  # it did not
    assert a.add(ids("caf") + [0]) == "caf"  # half a character waits for its other half
    assert a.add([1] + ids(" and STO")) == "é and "
    assert a.add(ids("P and more")) == ""  # the stop string completed across canvases
    assert a.stopped and a.flush() == ""

    b = TextAssembler(CharCodec().decode, stop=["xy", "zzz"])
    assert b.add(ids("abz")) == "ab"
    assert b.flush() == "z"  # the request ended: nothing can complete the stop string any more
    c = TextAssembler(CharCodec().decode, stop=[])
    assert c.add(ids("no stops")) == "no stops" and c.flush() == ""


def test_byte_fallback_runs_are_sent_once_settled(gemma_tokenizer_model_dir):
    """Byte tokens decode as one run: "é" (C3 A9) becomes three U+FFFD when a stray byte joins its run in
    the next canvas. The run's text waits until another token closes it, so the deltas add up to the
    decoded whole however the canvases cut."""
    from dgemma.chat.codec import TextCodec
    from dgemma.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    codec = TextCodec(tokenizer, tokenizer.vocab_size)
    byte = {b: tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0x80, 0xE6, 0x97)}
    words = tokenizer.encode("ab", add_special_tokens=False), tokenizer.encode("cd", add_special_tokens=False)
    tokens = [*words[0], byte[0xC3], byte[0xA9], byte[0x80], *words[1], byte[0xE6], byte[0x97], *words[0]]
    whole = codec.decode(tokens)
    assert "\ufffd\ufffd\ufffd" in whole  # the run C3 A9 80 is not UTF-8: one U+FFFD per byte
    for cuts in itertools.combinations(range(1, len(tokens)), 2):
        assembler = TextAssembler(codec.decode, [], codec.unsettled)
        pieces = [assembler.add(tokens[a:b]) for a, b in zip((0, *cuts), (*cuts, len(tokens)))]
        assert "".join(pieces) + assembler.flush() == whole, cuts


def test_a_slow_reader_gets_the_newest_draft_and_every_canvas():
    async def main():
        stream = RequestStream(request=None, loop=asyncio.get_running_loop())
        for step in range(5):
            stream.push(Event("draft", "r", 0, step=step))
        stream.push(Event("canvas", "r", 0, tokens=[1, 2]))
        stream.push(Event("draft", "r", 1, step=0))
        stream.push(Event("canvas", "r", 1, tokens=[3]))
        stream.push(Event("finished", "r", 1, finish_reason="length"))
        await asyncio.sleep(0)  # let the pushes land before reading
        got = []
        while not got or got[-1].kind != "finished":
            got.append(await stream.next())
        return [(e.kind, e.canvas_index, e.step) for e in got]

    assert asyncio.run(main()) == [("draft", 0, 4), ("canvas", 0, 0), ("draft", 1, 0), ("canvas", 1, 0),
                                   ("finished", 1, 0)]


def test_task_detection(tmp_path):
    assert read_task(tmp_path) == "text"
    (tmp_path / "dgemma_task.json").write_text(json.dumps({"task": "sudoku"}))
    assert read_task(tmp_path) == "sudoku"
    (tmp_path / "dgemma_task.json").write_text(json.dumps({"task": "chess"}))
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        read_task(tmp_path)
    (tmp_path / "dgemma_task.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_task(tmp_path)


def test_sudoku_answers_are_81_cells():
    codec = SudokuCodec()
    assert codec.decode([4, 5, 3, 13]) == "12" + "." * 79  # BLANK and unused ids are blank cells
    solution = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
    puzzle = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
    prompt = codec.encode_text(puzzle)
    tokens = [3 + int(d) for d in solution]
    assert codec.decode(tokens) == solution
    assert codec.check_answer(prompt, tokens)["solved"] is True
    assert codec.check_answer(prompt, tokens[:40])["solved"] is False


def test_an_engine_failure_fails_its_requests_and_the_worker_goes_on():
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()
    sampling = SamplingConfig(max_new_tokens=20, eos_token_ids=(1,), max_denoising_steps=4)
    expected = Engine(model, max_batch=1, max_length=128).generate([[5, 6, 7]], sampling, seeds=[3])[0].tokens
    worker = EngineWorker(model, max_batch=2, max_queue=4, max_length=128)
    broken = worker.engine

    def fail():
        raise RuntimeError("out of memory (simulated)")

    broken.step = fail  # this engine instance only

    async def until_done(stream):
        while True:
            item = await asyncio.wait_for(stream.next(), 60)
            if item.kind in ("error", "finished"):
                return item

    async def main():
        worker.start()
        try:
            failed = await until_done(worker.submit([5, 6, 7], sampling, seed=3))
            assert failed.kind == "error" and "out of memory (simulated)" in failed.message
            assert worker.engine is not broken and worker.failures == 1 and worker.alive
            second = worker.submit([5, 6, 7], sampling, seed=3)
            assert (await until_done(second)).kind == "finished"
            return second.request.tokens
        finally:
            worker.stop()

    assert asyncio.run(main()) == expected
    assert not worker.alive


def test_an_internal_error_is_a_500_that_keeps_the_connection():
    """An unexpected exception is answered 500 in OpenAI's shape, and the client's next request is served on
    the same kept-alive connection: uvicorn closes a connection whose app raised, and the next request sent
    on it fails with a ReadError (seen in the soak, beside a 500)."""
    import socket
    import threading

    import httpx
    import uvicorn
    from fastapi import FastAPI

    from dgemma.serving.errors import InternalErrors

    app = FastAPI()
    app.add_middleware(InternalErrors)

    @app.get("/fails")
    async def fails():
        raise KeyError("a bug")

    @app.get("/works")
    async def works():
        return {"ok": True}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        wait_until(lambda: server.started, 30, "the server started")
        with httpx.Client(base_url=url) as client:
            local_port = lambda r: r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]  # noqa: E731
            failed = client.get("/fails")
            first_port = local_port(failed)
            assert failed.status_code == 500
            assert failed.json() == {"error": {"message": "internal error: KeyError", "type": "server_error",
                                               "param": None, "code": None}}
            # the request's cycle ends after the response's last byte, with the connection closed or kept: once it
            # has, the next request shows which
            wait_until(lambda: not server.server_state.tasks, 30, "the failed request's cycle ended")
            served = client.get("/works")
            assert served.status_code == 200 and served.json() == {"ok": True}
            assert local_port(served) == first_port  # the same connection
    finally:
        server.should_exit = True
        thread.join(10)


def test_bodies_carry_the_fields_given_and_none_left_out():
    """The response models build the bodies: a null that was given stays, an optional field not given is
    absent (no `usage` on a content chunk, no `dgemma_draft` off a draft), and a task's verdict stays in
    `dgemma` before `choices`."""
    from dgemma.serving.chunk_writer import ChunkWriter, usage

    chat = ChunkWriter(chat=True, model="m")
    assert chat.text("hi", index=1)["choices"] == [{"index": 1, "delta": {"content": "hi"}, "finish_reason": None}]
    assert set(chat.text("hi")) == {"id", "object", "created", "model", "choices"}
    draft = {"canvas": 0, "step": 1, "tokens": [5], "pieces": ["a"], "entropy": [0.5], "accepted": [True],
             "edited": [False], "corrected": [False], "phase": "predictor"}
    assert chat.draft(draft)["choices"][0] == {"index": 0, "delta": {}, "finish_reason": None, "dgemma_draft": draft}
    assert chat.usage_chunk(usage(2, 3, 1))["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                                         "prompt_tokens_details": {"cached_tokens": 1}}
    completion = ChunkWriter(chat=False, model="m")
    assert completion.text("x")["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]
    stats = {"seed": 1, "elapsed_s": 0.5, "sudoku": {"solved": True}}
    body = chat.response([({"role": "assistant", "content": None, "tool_calls": []}, "tool_calls")], usage(1, 1),
                         {**stats, "choices": [stats]})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": []}
    assert list(body["dgemma"]) == ["seed", "elapsed_s", "sudoku", "choices"]
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "dgemma"]
