"""Gemma 4's tool-call notation: parsing calls into OpenAI arguments, writing values back, the regular
expression that constrains calls to their schemas, and the split of an answer into reasoning, content
and calls (streamed in any cut)."""

from __future__ import annotations

import itertools
import json
import random
import re

import jsonschema
import pytest

from dgemma.chat.chat_output import ChatOutput
from dgemma.chat.tool_calls import SyntaxProblem, format_value, parse_call, parse_value
from dgemma.chat.tool_schema import CallGrammar, SchemaError, text_without

Q = '<|"|>'


# -- parsing -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,name,arguments", [
    (f"call:get_weather{{city:{Q}Paris{Q}}}", "get_weather", {"city": "Paris"}),
    (f"call:f{{loc:{Q}Paris, \"FR\"{Q},n:3,flag:true,xs:[1,2.5,-3e2],z:null}}", "f",
     {"loc": 'Paris, "FR"', "n": 3, "flag": True, "xs": [1, 2.5, -300.0], "z": None}),
    ("call:no_args{}", "no_args", {}),
    (f"call:a.b-c{{o:{{p:{{q:[{Q}x{Q},{{}}]}}}},e:[]}}", "a.b-c", {"o": {"p": {"q": ["x", {}]}}, "e": []}),
    (f"call:f{{s:{Q}a{{b}}[c],d:e{Q}}}", "f", {"s": "a{b}[c],d:e"}),  # marks inside strings are text
    (f"call:f{{s:{Q}line\none\t\\ \u00e9{Q}}}", "f", {"s": "line\none\t\\ \u00e9"}),
    (f"call:f{{ {Q}quoted key{Q} : {Q}v{Q} , n : 1 }}", "f", {"quoted key": "v", "n": 1}),
    ("call:f{city:Paris,ok:True,none:None}", "f", {"city": "Paris", "ok": True, "none": None}),  # lenient
])
def test_parse_call(text, name, arguments):
    got_name, got_arguments = parse_call(text)
    assert got_name == name and json.loads(got_arguments) == arguments


@pytest.mark.parametrize("text", [
    "", "call:", "get_weather{}", "call:f", "call:f{", f"call:f{{a:{Q}x}}", "call:f{a:1", "call:f{a:1}}",
    "call:f{a:1} extra", "call:f[1]", "call:f{:1}", "call:f{a:}", "call:f{a:1,,b:2}", "call:f{a:[1,2}",
    "call:f{a:{b:1}", "call:f{a:b:c}", "call:f{" * 100 + "}" * 100,
])
def test_malformed_calls_raise(text):
    with pytest.raises(SyntaxProblem):
        parse_call(text)


VALUES = [{"city": "Paris", "n": 3, "x": 2.5, "ok": False, "none": None, "xs": [1, "a", {"k": []}]},
          "text with { } [ ] , : and \"quotes\"", [], {}, 0, -7, 1e-5, True]


@pytest.mark.parametrize("value", VALUES)
def test_format_then_parse_round_trips(value):
    assert parse_value(format_value(value)) == value


def test_format_matches_gemma_templates():
    assert format_value({"b": 1, "a": ["x", True]}) == f"{{a:[{Q}x{Q},true],b:1}}"


# -- the constraint's regular expression --------------------------------------------------------------

@pytest.mark.parametrize("mark,alphabet,longest", [(Q, '<|">a', 8), ("<channel|>", "<chanel|>x", 6)])
def test_text_without_a_mark_excludes_only_the_mark(mark, alphabet, longest):
    body = re.compile(text_without(mark))
    for n in range(longest):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert bool(body.fullmatch(text)) == (mark not in text), text
    for text in ["<channel" * 3 + "|", mark[:-1] + "x" + mark[:-1]]:
        assert bool(body.fullmatch(text)) == (mark not in text), text
    excluding = re.compile(text_without(mark, exclude="\U000F0000-\U000F00FF"))
    assert excluding.fullmatch("ab<") and not excluding.fullmatch("a\U000F0001b")


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 20, "description": "a city"},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"},
    "hourly": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
              "required": ["lat", "lon"], "additionalProperties": False},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "kind": {"const": "forecast"},
    "extra": {},
}, "required": ["city", "kind"], "additionalProperties": False}


def _random_instance(schema, rng: random.Random, depth=0):
    """A random value valid under the schemas of this file (a small generator for the test)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return _random_instance(rng.choice(schema["anyOf"]), rng, depth)
    kind = schema.get("type", rng.choice(["string", "integer", "boolean", "null"] + (["array"] if depth < 1 else [])))
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 12)
        alphabet = "ab <|\"{}[],:\n\u00e9" if "maxLength" not in schema else "ab {}[],:\n\u00e9"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))
    if kind == "integer":
        return rng.randint(-1000, 1000)
    if kind == "number":
        return rng.choice([rng.randint(-9, 9), round(rng.uniform(-100, 100), 3)])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        items = schema.get("items", {})
        return [_random_instance(items, rng, depth + 1)
                for _ in range(rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3)))]
    props = schema["properties"]
    return {k: _random_instance(v, rng, depth + 1) for k, v in props.items()
            if k in schema.get("required", []) or rng.random() < 0.5}


def test_every_valid_call_matches_and_invalid_ones_do_not():
    regex = re.compile(CallGrammar().calls([("get_weather", WEATHER), ("ping", None)]))
    rng = random.Random(0)
    for _ in range(300):
        arguments = _random_instance(WEATHER, rng)
        jsonschema.validate(arguments, WEATHER)
        text = f"<|tool_call>call:get_weather{format_value(arguments)}<tool_call|>"
        assert regex.fullmatch(text), text
        assert regex.fullmatch(text + "<|tool_call>call:ping{}<tool_call|>")  # several calls
    city, kind = f"city:{Q}Paris{Q}", f"kind:{Q}forecast{Q}"
    for bad in [f"{{{kind}}}", f"{{{city}}}", f"{{{city},{kind},zzz:1}}", f"{{{kind},{city}}}",
                f"{{city:{Q}{Q},{kind}}}", f"{{city:{Q}{'x' * 21}{Q},{kind}}}", f"{{{city},days:1.5,{kind}}}",
                f"{{{city},{kind},tags:[]}}", f"{{{city},{kind},unit:{Q}kelvin{Q}}}",
                f"{{{city},{kind},where:{{lat:1}}}}", f"{{{city},hourly:1,{kind}}}"]:
        assert not regex.fullmatch(f"<|tool_call>call:get_weather{bad}<tool_call|>"), bad
    assert not regex.fullmatch("<|tool_call>call:other{}<tool_call|>")
    assert not regex.fullmatch("")


def test_every_match_parses_and_validates():
    """The other direction: strings the expression accepts are calls whose arguments validate."""
    from outlines_core import Index, Vocabulary

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 3},
                                               "b": {"type": ["boolean", "null"]}}, "required": ["n"]}
    chars = sorted(set('<|"tool_cal>:{}[],-0123456789.eEntrufsN' + "ab"))
    vocabulary = Vocabulary(len(chars), {c: [i] for i, c in enumerate(chars)})
    index = Index(CallGrammar().calls([("f", schema)], several=False), vocabulary)
    rng = random.Random(1)
    for _ in range(200):  # random walks through the automaton to accepting states
        state, text = index.get_initial_state(), ""
        while not (index.is_final_state(state) and rng.random() < 0.3):
            allowed = [t for t in index.get_allowed_tokens(state) if t < len(chars)]
            if not allowed:
                break
            token = rng.choice(allowed)
            text += chars[token]
            state = index.get_next_state(state, token)
        if not index.is_final_state(state):
            continue
        name, arguments = parse_call(text.removeprefix("<|tool_call>").removesuffix("<tool_call|>"))
        assert name == "f"
        jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}, "unsupported keyword 'minimum'"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}, "unsupported keyword 'pattern'"),
    ({"type": "object", "oneOf": []}, "unsupported keyword 'oneOf'"),
    ({"type": "array"}, "parameters must be an object"),
    ({"type": "object", "properties": {"a": {"type": "int"}}}, "parameters.properties.a.type"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b' is not among the properties"),
    ({"type": "object", "properties": {"a b": {}}}, "cannot be a bare key"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}, "#/$defs/b is not defined"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"anyOf": [
        {"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/a"}}]}}}, "recursive schemas"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json"}}}, "only local references"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}, "less than"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "non-empty list"),
])
def test_unsupported_schemas_name_the_problem(schema, message):
    with pytest.raises(SchemaError, match=re.escape(message)):
        CallGrammar().arguments(schema)


def test_no_parameters_means_no_arguments_and_other_object_forms():
    grammar = CallGrammar()
    assert re.fullmatch(grammar.arguments(None), "{}") and re.fullmatch(grammar.arguments({}), "{}")
    free = re.compile(grammar.arguments({"type": "object"}))
    assert free.fullmatch("{}") and free.fullmatch(f"{{a:1,b:[{Q}x{Q}],c:{{d:null}}}}")
    counts = re.compile(grammar.arguments({"type": "object", "additionalProperties": {"type": "integer"}}))
    assert counts.fullmatch("{a:1,b:-2}") and not counts.fullmatch(f"{{a:{Q}x{Q}}}")
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    refs = re.compile(grammar.arguments({"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}},
                                         "required": ["p"], "$defs": {"point": point}}))
    assert refs.fullmatch("{p:{x:1.5}}") and not refs.fullmatch("{p:{}}")


# -- splitting an answer --------------------------------------------------------------------------------

CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"
ANSWER = ("<|channel>thought\nThe user wants <b>weather</b>; call the tool.<channel|>Let me check. "
          + CALL + "\n" + "<|tool_call>call:ping{}<tool_call|>")


def _split(text: str, cuts: list[int], parse_tools=True):
    out = ChatOutput(parse_tools)
    pieces, last = [], 0
    for cut in [*cuts, len(text)]:
        pieces += out.add(text[last:cut])
        last = cut
    pieces += out.finish()
    return out, pieces


def _joined(parts):
    text = {k: "".join(v for kind, v in parts if kind == k) for k in ("reasoning", "content")}
    return text, [v for kind, v in parts if kind == "tool_call"]


def test_answer_splits_into_reasoning_content_and_calls_however_it_is_cut():
    whole, parts = _split(ANSWER, [])
    text, calls = _joined(parts)
    assert text == {"reasoning": "The user wants <b>weather</b>; call the tool.", "content": "Let me check."}
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                      ("ping", {})]
    message = whole.message()
    assert message["content"] == "Let me check." and message["reasoning_content"] == text["reasoning"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "ping"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 12)))
        out, streamed = _split(ANSWER, cuts)
        assert _joined(streamed)[0] == text
        assert [(c["name"], c["arguments"]) for c in _joined(streamed)[1]] == [(c["name"], c["arguments"])
                                                                             for c in calls]
        # nothing ever leaks a piece of a mark
        assert not any(kind != "tool_call" and re.search(r"<\||\|>", value) for kind, value in streamed)


def test_only_calls_means_no_content():
    out, _ = _split("\n" + CALL + "\n\n" + CALL + " ", [3, 40])
    message = out.message()
    assert message["content"] is None and len(message["tool_calls"]) == 2
    assert "reasoning_content" not in message


def test_a_string_may_hold_the_end_mark():
    call = f"<|tool_call>call:say{{text:{Q}write <tool_call|> to end a call{Q}}}<tool_call|>"
    out, parts = _split(call + "after", [30, 60])
    assert json.loads(out.message()["tool_calls"][0]["function"]["arguments"]) == {
        "text": "write <tool_call|> to end a call"}
    assert out.message()["content"] == "after"


@pytest.mark.parametrize("bad", [
    "<|tool_call>call:get_weather{city:<|\"|>Paris}<tool_call|>",  # an unclosed string
    "<|tool_call>get_weather{}<tool_call|>",
    "<|tool_call>call:f{a:1}",  # the answer ended inside the call
])
def test_malformed_calls_stay_content(bad):
    out, parts = _split("Hi " + bad, [5])
    assert out.message() == {"role": "assistant", "content": "Hi " + bad}


def test_calls_are_text_when_tools_are_not_parsed():
    out, _ = _split(ANSWER, [10], parse_tools=False)
    message = out.message()
    assert "tool_calls" not in message and message["content"].startswith("Let me check. <|tool_call>call:get_weather")


def test_unclosed_thought_is_reasoning_and_other_text_is_untouched():
    out, _ = _split("<|channel>thought\nstill thinking", [12])
    assert out.message() == {"role": "assistant", "content": "", "reasoning_content": "still thinking"}
    out, _ = _split("a < b, x |> y, <|tool and <|channel", [3, 20])
    assert out.message()["content"] == "a < b, x |> y, <|tool and <|channel"


# -- the constraint over a Gemma-shaped vocabulary ---------------------------------------------------------

@pytest.mark.parametrize("thought", [False, True])
def test_constrained_canvases_are_valid_calls_whatever_the_distributions(gemma_tokenizer_model_dir, thought):
    """Random peaky distributions, canvas after canvas through the DP under the calls' automaton: every
    answer is one or more calls to the tools, with arguments valid under their schemas, marks as tokens."""
    import torch

    from dgemma.chat.chat_output import MARKS
    from dgemma.chat.tool_schema import calls_constraint
    from dgemma.structured import ENDED, constrained_canvas
    from dgemma.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    automaton = calls_constraint(tokenizer, tokenizer.vocab_size, [("get_weather", WEATHER), ("ping", None)],
                                 several=True, thought=thought)
    marks = {tokenizer.token_to_id(m) for m in MARKS}
    thoughts = 0
    for seed in range(12):
        generator, state, tokens = torch.Generator().manual_seed(seed), automaton.initial, []
        for start in range(0, 240, 16):
            probs = torch.softmax(torch.randn(16, tokenizer.vocab_size, generator=generator) * 3.0, -1)
            choice = constrained_canvas(automaton, probs, state, budget=240 - start, eos_token_ids=[1],
                                        pad_token_id=0)
            row = choice.tokens.tolist()
            tokens += row[: row.index(1)] if 1 in row else row
            if choice.state == ENDED:
                break
            state = choice.state
        assert choice.state == ENDED
        out = ChatOutput(parse_tools=True)
        out.add(tokenizer.decode(tokens, keep=marks))
        out.finish()
        message = out.message()
        assert message["content"] is None and message["tool_calls"], message
        thoughts += "reasoning_content" in message
        for call in message["tool_calls"]:
            assert call["function"]["name"] in ("get_weather", "ping")
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                WEATHER if call["function"]["name"] == "get_weather" else {"maxProperties": 0})
    assert (thoughts > 0) == thought
