"""The soak's request kinds (benchmarks/soak.py): what each one sends and how its answer is checked.

A kind is a function `(call: Call) -> None` registered with `@kind(name, weight)`. It sends its request
through `call` (`call.chat`, `call.completion`, `call.stream`: each raises `HTTPStatus` for an answer that
is not a 200), raises `Malformed` for an answer that breaks its kind's rules, and hands `call.same(key,
answer)` what must repeat for a key (what was asked, its seed, its model): two different answers to one key
are a determinism failure. Adding a kind (a new request field, a new sampler) is one function here; the
soak's `--mix` picks kinds by name.

The kinds share one pool of seeds, so every answer is asked for again and again, and some cross-check each
other: a stream must equal the whole chat of its seed, choice i of an `n: 2` chat the chat of seed + i.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from typing import Callable

import httpx
import jsonschema

SEEDS = list(range(8))
PROMPTS = ["hello world", "Tell me about the sea.", "Name a colour.", "What is in this picture?"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                              "hours": {"type": "integer"}}, "required": ["city"]}}}]
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from Paris Ada "
         "red blue small large yes no hello world cat name age city").split()
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in few words about {w}." for i, w in
                                                    enumerate(WORDS[:24]))
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # what /v1/completions writes without max_tokens (OpenAI's default)
SCORE_TOLERANCE = 1e-4  # how far one prompt's log-probabilities may move between two scorings


class Malformed(Exception):
    """An answer that breaks its kind's rules (an invalid JSON answer, a call to no tool...)."""


class HTTPStatus(Exception):
    """An answer other than 200."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


@dataclass
class Shared:
    """What every client's calls share: the served model names, the images, the long prompts handed out."""

    models: list[str]  # the base model first, then its LoRA adapters
    images: list[str]  # PNG data URLs, one per seed
    long_count: int = 0
    lock: object = None

    def next_long(self) -> int:
        with self.lock:
            self.long_count += 1
            return self.long_count - 1


@dataclass
class Call:
    """One request of a kind: its seed, its model, the client's HTTP connection, and what it reports."""

    http: httpx.Client
    rng: random.Random
    shared: Shared
    seed: int
    model: str
    same: Callable[..., None]  # (key, answer[, tolerance]): compared with the first answer for key
    note: Callable[[str], None] = lambda what: None  # a count worth reporting (a prefix-cache hit, a cut answer)
    extra: dict = field(default_factory=dict)

    @property
    def base(self) -> str:
        return self.shared.models[0]

    def chat(self, body: dict) -> dict:
        return self._post("/v1/chat/completions", body)

    def completion(self, body: dict) -> dict:
        return self._post("/v1/completions", body)

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise HTTPStatus(r.status_code, r.text)
        return r.json()

    def stream(self, body: dict, *, first_only: bool = False) -> tuple[str, str | None]:
        """A streamed chat: its joined content and finish reason; with `first_only`, the client leaves after
        the first chunk (the server must free the row)."""
        text, reason = [], None
        with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                raise HTTPStatus(r.status_code, r.text)
            for line in r.iter_lines():
                if first_only:
                    return "", None
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise HTTPStatus(500, chunk["error"]["message"])
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    reason = choice["finish_reason"] or reason
        return "".join(text), reason


KINDS: dict[str, tuple[Callable[[Call], None], int]] = {}  # name -> (function, default weight)


def kind(name: str, weight: int):
    def register(fn):
        KINDS[name] = (fn, weight)
        return fn
    return register


def chat_body(call: Call, content, max_tokens: int = 48, **more) -> dict:
    return {"model": call.model, "seed": call.seed, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}], **more}


def plain(message: dict, reason: str) -> str:
    if reason not in ("stop", "length") or not isinstance(message.get("content"), str):
        raise Malformed(f"a chat answer with finish_reason {reason!r} and content {message.get('content')!r}")
    return message["content"]


# -- the kinds ------------------------------------------------------------------------------------------

@kind("chat", 3)
def chat(call: Call):
    p = call.rng.randrange(3)
    out = call.chat(chat_body(call, PROMPTS[p]))["choices"][0]
    call.same(("chat", p, call.seed, call.model), plain(out["message"], out["finish_reason"]))


@kind("stream", 3)
def stream(call: Call):
    """A chat streamed: the joined text must be the whole answer's for its prompt and seed."""
    p = call.rng.randrange(3)
    text, reason = call.stream(chat_body(call, PROMPTS[p]))
    if reason not in ("stop", "length"):
        raise Malformed(f"a stream ended with finish_reason {reason!r}")
    call.same(("chat", p, call.seed, call.model), text)


@kind("drop", 1)
def drop(call: Call):
    """A stream the client leaves after its first chunk (the server frees the row)."""
    call.stream(chat_body(call, PROMPTS[call.seed % 3], max_tokens=96), first_only=True)


@kind("n2", 1)
def two_choices(call: Call):
    """n: 2: choice i is the chat of its prompt and seed + i (the server seeds a request's choices seed,
    seed + 1, ...)."""
    p, call.seed = call.rng.randrange(3), call.seed % (len(SEEDS) - 1)
    choices = call.chat(chat_body(call, PROMPTS[p], n=2))["choices"]
    if sorted(c["index"] for c in choices) != [0, 1]:
        raise Malformed(f"n: 2 gave choices {[c['index'] for c in choices]}")
    for c in choices:
        call.same(("chat", p, call.seed + c["index"], call.model), plain(c["message"], c["finish_reason"]))


@kind("structured", 2)
def structured(call: Call):
    """response_format json_schema: a finished answer parses and validates."""
    body = chat_body(call, PROMPTS[call.seed % 3], max_tokens=64,
                     response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    out = call.chat(body)["choices"][0]
    content = out["message"]["content"]
    if out["finish_reason"] == "stop":
        try:
            jsonschema.validate(json.loads(content), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            raise Malformed(f"invalid JSON answer: {type(e).__name__}: {str(e)[:80]}") from None
    else:
        call.note("json cut at max_tokens")
    call.same(("structured", call.seed, call.model), content)


@kind("tools", 2)
def tools(call: Call):
    """tool_choice "required": calls that name one of the tools, with arguments valid for it."""
    body = chat_body(call, "Weather or time in Paris?", tools=TOOLS, tool_choice="required")
    out = call.chat(body)["choices"][0]
    calls = out["message"].get("tool_calls") or []
    if out["finish_reason"] == "tool_calls" and not calls:
        raise Malformed("finish_reason tool_calls without calls")
    if out["finish_reason"] == "stop" and not calls:
        raise Malformed("a required tool choice gave no call")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        name = c["function"]["name"]
        if name not in schemas:
            raise Malformed(f"a call to {name!r}, which is not a tool")
        try:
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[name])
        except (ValueError, jsonschema.ValidationError) as e:
            raise Malformed(f"arguments of {name}: {type(e).__name__}") from None
    call.same(("tools", call.seed, call.model), [(c["function"]["name"], c["function"]["arguments"]) for c in calls])


@kind("image", 2)
def image(call: Call):
    content = [{"type": "image_url", "image_url": {"url": call.shared.images[call.seed]}},
               {"type": "text", "text": PROMPTS[3]}]
    out = call.chat(chat_body(call, content, max_tokens=32))["choices"][0]
    call.same(("image", call.seed, call.model), plain(out["message"], out["finish_reason"]))


@kind("step_cache", 2)
def step_cache(call: Call):
    """The step cache on (the base model: not with adapters yet): repeats per seed like the chats."""
    call.model = call.base
    out = call.chat(chat_body(call, PROMPTS[call.seed % 3], step_cache=True))["choices"][0]
    call.same(("step_cache", call.seed), plain(out["message"], out["finish_reason"]))


def long_prompt(index: int) -> str:
    """Prompt `index`'s text: 105-144 numbered words (~530-720 of the Gemma-shaped tokenizer's tokens)."""
    rng = random.Random(index)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(105 + index % 40))


@kind("long", 1)
def long(call: Call):
    """A ~600-token prompt no other request has: new prompt lengths and prefix-cache blocks every time, which
    keeps the prefix cache at its budget (evicting)."""
    out = call.chat(chat_body(call, long_prompt(call.shared.next_long()), max_tokens=16))["choices"][0]
    plain(out["message"], out["finish_reason"])


@kind("followup", 1)
def followup(call: Call):
    """Two turns after one long system prompt: the second reads the first turn from the prefix cache when its
    blocks are still there (counted; the cache evicts at its budget)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[call.seed % 3]}]
    body = {"model": call.model, "seed": call.seed, "max_tokens": 16, "messages": messages}
    first = call.chat(body)
    messages += [{"role": "assistant", "content": plain(first["choices"][0]["message"], "stop")},
                 {"role": "user", "content": "And then?"}]
    second = call.chat(body)
    usage = second["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if not 0 <= cached <= usage["prompt_tokens"]:
        raise Malformed(f"cached_tokens {cached} of {usage['prompt_tokens']} prompt tokens")
    call.note("follow-up read from the prefix cache" if cached else "follow-up encoded afresh")
    call.same(("followup", call.seed, call.model), plain(second["choices"][0]["message"],
                                                         second["choices"][0]["finish_reason"]))


@kind("logprobs", 1)
def logprobs(call: Call):
    """A prompt scored (echo, logprobs 2, max_tokens 1: what evaluation harnesses send; the base model): one
    entry per prompt token plus the next, the first without a log-probability, the rest <= 0."""
    call.model = call.base
    prompt = PROMPTS[call.seed % len(PROMPTS)]
    out = call.completion({"model": call.model, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1})
    choice, usage = out["choices"][0], out["usage"]
    lp = choice["logprobs"]
    n = usage["prompt_tokens"] + 1
    if not (len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n):
        raise Malformed(f"{len(lp['tokens'])} scored tokens for a prompt of {usage['prompt_tokens']}")
    if lp["token_logprobs"][0] is not None or not all(x <= 0 for x in lp["token_logprobs"][1:]):
        raise Malformed("log-probabilities out of range")
    if not all(top is None or len(top) <= 2 for top in lp["top_logprobs"]):
        raise Malformed("more alternatives than logprobs: 2 asked for")
    # equal to rounding: scoring reads whole spans from the prefix cache, which --deterministic does not cover
    # (docs/serving.md); a float kernel rounds a row by where it sits in its call, ~1e-6 a layer
    call.same(("logprobs", prompt), lp["token_logprobs"], tolerance=SCORE_TOLERANCE)


@kind("completion", 1)
def completion(call: Call):
    """/v1/completions without max_tokens: OpenAI's default of 16 tokens."""
    out = call.completion({"model": call.model, "prompt": PROMPTS[call.seed % 3], "seed": call.seed})
    choice, tokens = out["choices"][0], out["usage"]["completion_tokens"]
    if tokens > COMPLETIONS_DEFAULT_MAX_TOKENS or (tokens == COMPLETIONS_DEFAULT_MAX_TOKENS) != \
            (choice["finish_reason"] == "length"):
        raise Malformed(f"{tokens} tokens, finish_reason {choice['finish_reason']!r} without max_tokens")
    call.same(("completion", call.seed, call.model), choice["text"])


# -- the model and its inputs --------------------------------------------------------------------------

def png_urls(count: int) -> list[str]:
    from conftest import png_bytes

    return ["data:image/png;base64," + base64.b64encode(png_bytes(24 + s, 30 + s, seed=s)).decode()
            for s in range(count)]


def parse_mix(text: str) -> dict[str, int]:
    """"chat=3,stream=1" -> {kind: weight}; ValueError naming a part that is not KIND=WEIGHT."""
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name not in KINDS or not weight.isdigit():
            raise ValueError(f"{part!r}: want KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        mix[name] = int(weight)
    return mix
