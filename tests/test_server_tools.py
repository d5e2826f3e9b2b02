"""Tool calls, thinking, n choices and the other fields clients send, against a real `dgemma serve` on
loopback through the official openai client. The model is a tiny random checkpoint whose tokenizer has
Gemma's shape and whose chat template writes Gemma 4's format (conftest.py, tests/data)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from dgemma.serving.engine_inputs import template_messages, template_variables
from dgemma.serving.requests import ChatCompletionRequest
from dgemma.tokenizer import Tokenizer
from test_server import MODEL, ServerProcess

Q = '<|"|>'

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "description": "Is the service up?"}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "15 C, sunny"},
    {"role": "assistant", "content": "<|channel>thought\nIt is sunny.<channel|>It is 15 C and sunny."},
    {"role": "user", "content": "And tomorrow?"},
]
RENDERED = (
    "<bos><|turn>system\n<|think|>Be brief."
    f"<|tool>declaration:get_weather{{description:{Q}Current weather in a city{Q},parameters:{{"
    f"additionalProperties:false,properties:{{city:{{description:{Q}the city{Q},type:{Q}STRING{Q}}},"
    f"days:{{type:{Q}INTEGER{Q}}},unit:{{enum:[{Q}celsius{Q},{Q}fahrenheit{Q}],type:{Q}STRING{Q}}}}},"
    f"required:[{Q}city{Q}],type:{Q}OBJECT{Q}}}}}<tool|>"
    f"<|tool>declaration:ping{{description:{Q}Is the service up?{Q}}}<tool|><turn|>\n"
    "<|turn>user\nWeather in Paris?<turn|>\n"
    f"<|turn>model\n<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"
    f"<|tool_response>response:get_weather{{value:{Q}15 C, sunny{Q}}}<tool_response|>"
    "It is 15 C and sunny.<turn|>\n"  # the earlier thought is gone
    "<|turn>user\nAnd tomorrow?<turn|>\n<|turn>model\n"
)


@pytest.fixture(scope="module")
def client(gemma4_chat_model_dir):
    server = ServerProcess(gemma4_chat_model_dir, "--max-batch", "8", "--max-queue", "16")
    yield server.client()
    server.stop_cleanly()


@pytest.fixture(scope="module")
def tokenizer(gemma4_chat_model_dir):
    return Tokenizer.from_folder(gemma4_chat_model_dir)


def _prompt(tokenizer, body: dict) -> str:
    request = ChatCompletionRequest.model_validate({"model": MODEL, **body})
    return tokenizer.render_chat(template_messages(request), add_generation_prompt=True, **template_variables(request))


# -- what the template sees -----------------------------------------------------------------------------

def test_tools_calls_and_results_render_as_gemma_4_writes_them(client, tokenizer):
    body = {"messages": CONVERSATION, "tools": [WEATHER, PING], "reasoning_effort": "low"}
    assert _prompt(tokenizer, body) == RENDERED
    out = client.chat.completions.create(model=MODEL, max_tokens=16, seed=0, **body)
    assert out.usage.prompt_tokens == len(tokenizer.encode(RENDERED, add_special_tokens=False))


@pytest.mark.parametrize("switch,thinking", [
    ({}, False), ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "minimal"}, True),
    ({"reasoning_effort": "high"}, True), ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False),
])
def test_thinking_switches(client, tokenizer, switch, thinking):
    body = {"messages": [{"role": "user", "content": "Hi"}], **switch}
    prompt = _prompt(tokenizer, body)
    if thinking:  # a system turn opens with <|think|>; the answer starts free
        assert prompt == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    else:  # no thinking: an empty thought is already written for the model
        assert prompt == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    extra = {k: v for k, v in switch.items() if k == "chat_template_kwargs"}
    kwargs = {k: v for k, v in switch.items() if k != "chat_template_kwargs"}
    out = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=16, seed=0,
                                         extra_body=extra, **kwargs)
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_tool_choice_none_keeps_the_declarations(client, tokenizer):
    """As vLLM does by default: the tools stay in the prompt, and calls in the answer stay text."""
    messages = [{"role": "user", "content": "Weather?"}]
    counts = [client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=choice,
                                             max_tokens=16, seed=1).usage.prompt_tokens for choice in ("none", "auto")]
    prompt = _prompt(tokenizer, {"messages": messages, "tools": [WEATHER]})
    assert counts[0] == counts[1] == len(tokenizer.encode(prompt, add_special_tokens=False))


# -- n choices ------------------------------------------------------------------------------------------

def test_n_choices_are_the_seeds_of_one_prompt(client):
    messages = [{"role": "user", "content": "Name a colour"}]
    many = client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=40, max_tokens=32)
    alone = [client.chat.completions.create(model=MODEL, messages=messages, seed=40 + i, max_tokens=32)
             for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in many.choices] == [a.choices[0].finish_reason for a in alone]
    assert len({c.message.content for c in many.choices}) > 1  # different seeds, different answers
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert [s["seed"] for s in many.model_extra["dgemma"]["choices"]] == [40, 41, 42]

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=40, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["", "", ""], {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert texts == [c.message.content for c in many.choices]
    assert finishes == {i: c.finish_reason for i, c in enumerate(many.choices)}
    assert chunks[-1].usage.completion_tokens == many.usage.completion_tokens

    completions = client.completions.create(model=MODEL, prompt="Colours:", n=2, seed=7, max_tokens=16)
    assert [c.text for c in completions.choices] == [
        client.completions.create(model=MODEL, prompt="Colours:", seed=7 + i, max_tokens=16).choices[0].text
        for i in range(2)]


# -- bad requests ---------------------------------------------------------------------------------------

BAD = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "no tool is named 'get_time'"),
    ({"tool_choice": "required"}, "a required or named tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}], "tool_choice": "required"},
     "unsupported keyword 'minimum'"),
    ({"messages": [{"role": "tool", "content": "15 C"}]}, "needs the tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "user", "content": "x",
      "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]}]}, "only assistant messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "expected a JSON object in a string"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs are not available"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "a required or named tool_choice writes the answer itself"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs: cannot build the token automaton"),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "cannot both shape"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_tool_and_thinking_bodies_are_400(client, change, message):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **change}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=body.pop("messages"), extra_body=body)
    assert message in caught.value.body["message"], caught.value.body


def test_completion_logprobs_are_refused(client):
    for logprobs in (0, 3):
        with pytest.raises(openai.BadRequestError, match="logprobs are not available"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=8, logprobs=logprobs)


# -- stop strings ---------------------------------------------------------------------------------------

def _across_first_boundary(deltas: list[str]) -> str:
    """A stop string that spans the end of the first streamed canvas's text and the start of the next
    (whitespace a chat answer held back at the first canvas's end goes out with the second)."""
    full, cut = "".join(deltas), len(deltas[0])
    after = cut + len(full[cut:]) - len(full[cut:].lstrip())
    return full[cut - 2 : after + 2]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stop_strings_across_canvases_and_never_streamed_past(client, endpoint):
    def run(**kwargs):
        common = dict(model=MODEL, seed=3, max_tokens=64, **kwargs)
        if endpoint == "chat":
            return client.chat.completions.create(messages=[{"role": "user", "content": "Tell a story"}], **common)
        return client.completions.create(prompt="Once upon a time", **common)

    def text_of(choice):
        return choice.message.content if endpoint == "chat" else choice.text

    def deltas(stream):
        pieces = []
        for chunk in stream:
            for choice in chunk.choices:
                piece = choice.delta.content if endpoint == "chat" else choice.text
                if piece:
                    pieces.append(piece)
        return pieces

    full = text_of(run().choices[0])
    streamed = deltas(run(stream=True))
    assert "".join(streamed) == full and len(streamed) >= 2
    stop = _across_first_boundary(streamed)
    expected = full[: full.index(stop)]
    cut = run(stop=[stop, "never written"]).choices[0]
    assert text_of(cut) == expected and cut.finish_reason == "stop"
    pieces = deltas(run(stop=stop, stream=True))
    assert "".join(pieces) == expected


# -- answers that call tools ----------------------------------------------------------------------------

def _forced(text: str) -> dict:
    """extra_body that makes the answer exactly `text`, whatever the weights: a regex matching it alone
    (the marks spelled in ordinary tokens, which decode to the same text)."""
    return {"structured_outputs": {"regex": re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)}}


def _stream(client, **kwargs) -> dict:
    """A streamed chat answer, gathered: content, reasoning, tool-call deltas, finish reason; no mark leaks."""
    out = {"content": "", "reasoning": "", "calls": [], "finish": None}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["calls"] += [c.model_dump() for c in delta.tool_calls or []]
            out["finish"] = choice.finish_reason or out["finish"]
    assert not re.search(r"<\|(channel|tool_call)>|<(channel|tool_call)\|>", out["content"] + out["reasoning"])
    return out


CALLS = f"Let me check. <|tool_call>call:get_weather{{city:{Q}Paris, FR{Q},days:2}}<tool_call|>\n" \
        "<|tool_call>call:ping{}<tool_call|>"


def test_calls_in_the_answer_become_tool_calls(client):
    request = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, PING], seed=0,
                   max_tokens=160, extra_body=_forced(CALLS))
    out = client.chat.completions.create(model=MODEL, **request)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris, FR", "days": 2}), ("function", "ping", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id

    streamed = _stream(client, **request)
    assert streamed["content"] == "Let me check." and streamed["finish"] == "tool_calls"
    assert [c["index"] for c in streamed["calls"]] == [0, 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["calls"]] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed["calls"])


def test_calls_stay_text_without_parsing_and_when_malformed(client):
    messages = [{"role": "user", "content": "Weather?"}]
    kept = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, PING], tool_choice="none",
                                          max_tokens=160, seed=0, extra_body=_forced(CALLS)).choices[0]
    assert kept.message.content == CALLS and not kept.message.tool_calls and kept.finish_reason == "stop"
    malformed = f"Sure <|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|> done"  # the string never closes
    for tools in ([WEATHER], None):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, seed=0,
                                                extra_body=_forced(malformed), **({"tools": tools} if tools else {}))
        assert answer.choices[0].message.content == malformed and not answer.choices[0].message.tool_calls


def test_thoughts_are_reasoning_content_streamed_or_not(client):
    thought = "<|channel>thought\nThe user greets me; be warm.<channel|>Hello there, friend!"
    request = dict(messages=[{"role": "user", "content": "Hi"}], reasoning_effort="high", seed=0, max_tokens=96,
                   extra_body=_forced(thought))
    message = client.chat.completions.create(model=MODEL, **request).choices[0].message
    assert message.content == "Hello there, friend!"
    assert message.model_extra["reasoning_content"] == "The user greets me; be warm."
    streamed = _stream(client, **request)
    assert (streamed["reasoning"], streamed["content"]) == ("The user greets me; be warm.", "Hello there, friend!")


@pytest.mark.parametrize("choice,thinking", [("required", False), ("required", True), ("get_weather", False)])
def test_required_and_named_calls_are_valid_whatever_the_weights(client, choice, thinking):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    request = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, PING],
                   tool_choice=tool_choice, max_tokens=96, reasoning_effort="medium" if thinking else "none",
                   extra_body={"steps": 3})
    allowed = {"get_weather": WEATHER["function"]["parameters"], "ping": {"maxProperties": 0}}
    if choice != "required":
        allowed = {choice: allowed[choice]}
    thoughts = 0
    for seed in (0, 100):  # sixteen answers
        out = client.chat.completions.create(model=MODEL, n=8, seed=seed, **request)
        for answer in out.choices:
            assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
            calls = answer.message.tool_calls
            assert calls and (len(calls) == 1 or choice == "required")
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])
            thoughts += bool((answer.message.model_extra or {}).get("reasoning_content"))
    assert (thoughts > 0) == thinking  # a thought may come first only with thinking on
    streamed = _stream(client, seed=7, **request)
    alone = client.chat.completions.create(model=MODEL, seed=7, **request).choices[0].message
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["calls"]] == [
        (c.function.name, c.function.arguments) for c in alone.tool_calls]


def test_tool_response_and_turn_end_ends_an_answer(client, tokenizer):
    """After its calls Gemma 4 writes <|tool_response> and waits: the server stops there (and at <turn|>),
    besides the model's own EOS. Drafts show each committed canvas; the text is what precedes the first end."""
    ends = {tokenizer.token_to_id(t) for t in ("<eos>", "<turn|>", "<|tool_response>")}
    stream = client.completions.create(model=MODEL, prompt="Weather?", n=16, seed=0, max_tokens=64, stream=True,
                                       stream_options={"include_drafts": True}, extra_body={"steps": 2})
    canvases, texts = [{} for _ in range(16)], [""] * 16
    for chunk in stream:
        for choice in chunk.choices:
            draft = (choice.model_extra or {}).get("dgemma_draft")
            if draft is not None:
                canvases[choice.index][draft["canvas"]] = draft["tokens"]  # the last one is the committed canvas
            texts[choice.index] += choice.text or ""
    enders = []
    for tokens_by_canvas, text in zip(canvases, texts):
        tokens = [t for k in sorted(tokens_by_canvas) for t in tokens_by_canvas[k]][:64]
        cut = next((i for i, t in enumerate(tokens) if t in ends), len(tokens))
        assert text == tokenizer.decode(tokens[:cut])
        enders.append(tokens[cut] if cut < len(tokens) else None)
    assert tokenizer.token_to_id("<|tool_response>") in enders  # seen at least once with these seeds
