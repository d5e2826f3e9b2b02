"""The server against its own published schema: schemathesis generates bodies from /openapi.json, valid and
invalid, for every operation, and each answer must be no 5xx, an error in OpenAI's shape, and valid against
the schema (streams: every event a chunk of the documented shape or an error, then [DONE]); a body the
schema refuses must be refused (4xx).

The server is `dgemma serve` on the tiny model with a vision tower, Gemma's tokenizer shape and Gemma 4's
chat template (tests/conftest.py), so images, tools, structured output and thinking are all in reach.
Generation is kept short per case (see `_prepare`): what is fuzzed is the HTTP surface, not the sampler.

Bounded for the suite: DGEMMA_FUZZ_EXAMPLES cases per generation route and mode (default 40; fewer for the
other routes: about 220 in all, a minute), the same cases each run. A release check runs more, new ones
each time (docs/serving.md):
    DGEMMA_FUZZ_EXAMPLES=1000 DGEMMA_FUZZ_RANDOM=1 python -m pytest -q tests/test_server_fuzz.py
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

from dgemma.serving import errors, responses  # noqa: E402
from tests.test_server import API_KEY, MODEL, ServerProcess  # noqa: E402

EXAMPLES = int(os.environ.get("DGEMMA_FUZZ_EXAMPLES", "40"))
RANDOM = bool(os.environ.get("DGEMMA_FUZZ_RANDOM"))  # new cases each run (release checks); the suite's are fixed
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# generation bounds per case, each within the schema's ranges (so a valid body stays valid)
SHORT = {"steps": 2, "max_tokens": 16, "max_completion_tokens": 16, "n": 2}


@pytest.fixture(scope="module")
def fuzzed_server(gemma4_vision_model_dir):
    server = ServerProcess(gemma4_vision_model_dir, "--max-batch", "4", "--max-queue", "64", "--max-length", "160")
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def api(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json", headers=AUTH)


def _prepare(body):
    """Caps on the fields that make a case slow (steps, tokens, choices), and the served model's name where a
    name was made up (else nearly every case would stop at model_not_found); applied only where the value is
    valid: it stays valid, and an invalid one is left to be refused."""
    if isinstance(body, dict):
        for field, cap in SHORT.items():
            value = body.get(field)
            if type(value) is int and cap < value <= {"steps": 1000, "n": 16}.get(field, 1 << 62):
                body[field] = cap
        if isinstance(body.get("model"), str):
            body["model"] = MODEL
        # JSON schema cannot say "a string holding a JSON object"
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        for message in messages:
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for call in calls if isinstance(calls, list) else []:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    function["arguments"] = "{}"
    return body


def _error_shape(payload) -> str | None:
    """Why `payload` is not {"error": {"message": str, "type": str, "param", "code"}}, or None."""
    try:
        errors.ErrorResponse.model_validate(payload)
    except Exception as e:  # pydantic's message says which part
        return f"not OpenAI's error shape: {payload!r}: {e}"
    return None


def _stream_events(text: str, chunk_model) -> str | None:
    """Why a server-sent event stream is wrong, or None: every event a chunk or an error, then [DONE]."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE]: {text[-200:]!r}"
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:
            problem = _error_shape(payload)
            if problem:
                return problem
            continue
        try:
            chunk_model.model_validate(payload)
        except Exception as e:
            return f"a chunk off the schema: {event[:300]}: {e}"
    return None


def _content_type(response) -> str:
    value = response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value  # schemathesis keeps each header as a list


STREAM_CHUNKS = {"/v1/chat/completions": responses.ChatCompletionChunk,
                 "/v1/completions": responses.CompletionChunk}


# (method, path, share of the cases): generation routes get most
OPERATIONS = [("POST", "/v1/chat/completions", 1.0), ("POST", "/v1/completions", 1.0), ("POST", "/tokenize", 0.25),
              ("POST", "/detokenize", 0.25), ("GET", "/v1/models", 0.1), ("GET", "/v1/models/{model_id}", 0.25),
              ("GET", "/tokenizer_info", 0.1), ("GET", "/health", 0.1)]
CASES = [(method, path, share, mode) for method, path, share in OPERATIONS for mode in ("positive", "negative")
         if not (path == "/health" and mode == "negative")]  # /health takes nothing: nothing to get wrong
STATUSES: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
CALL_SECONDS: collections.Counter = collections.Counter()  # time in requests, per path (the rest is generation)


@pytest.mark.parametrize("method,path,share,mode", CASES, ids=[f"{m} {p} {mode}" for m, p, _, mode in CASES])
def test_the_server_keeps_to_its_schema(api, fuzzed_server, method, path, share, mode):
    operation = api[path][method]
    strategy = operation.as_strategy(GenerationMode(mode))

    @settings(max_examples=max(1, round(EXAMPLES * share)), deadline=None, derandomize=not RANDOM, database=None,
              print_blob=True, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case):
        case.body = _prepare(case.body)
        case.headers = {**(case.headers or {}), **AUTH}  # the schema's bearer scheme makes up keys: send ours
        start = time.perf_counter()
        response = case.call(timeout=60)
        CALL_SECONDS[path] += time.perf_counter() - start
        STATUSES[path, mode][response.status_code] += 1
        if response.status_code == 400 and os.environ.get("DGEMMA_FUZZ_VERBOSE"):
            print(path, mode, response.json()["error"]["message"][:160])
        assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
        assert response.status_code != 422, "a validation error must be a 400, as OpenAI answers"
        if response.status_code >= 400:
            problem = _error_shape(response.json())
            assert problem is None, problem
        if _content_type(response).startswith("text/event-stream"):
            problem = _stream_events(response.text, STREAM_CHUNKS[path])
            assert problem is None, problem
        case.validate_response(response, checks=[
            openapi_checks.status_code_conformance, openapi_checks.content_type_conformance,
            openapi_checks.response_schema_conformance, openapi_checks.negative_data_rejection])

    one()


def test_fuzzing_reached_generation_and_left_the_server_healthy(fuzzed_server):
    """Valid bodies were answered (not all stopped at some check), and the server is fine afterwards."""
    print({f"{path} {mode}": dict(counts) for (path, mode), counts in STATUSES.items()})
    print({path: round(seconds, 1) for path, seconds in CALL_SECONDS.items()})
    if len(STATUSES) == len(CASES):  # the whole file ran
        for path in ("/v1/chat/completions", "/v1/completions"):
            assert STATUSES[path, "positive"][200] > 0, STATUSES[path, "positive"]
    assert fuzzed_server.health()["status"] == "ok"
    fuzzed_server.wait_idle(timeout=30)
