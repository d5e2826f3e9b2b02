"""Structured output end to end on a tiny random model with a Gemma-shaped tokenizer: the Python engine,
the plain loop, `dgemma generate --json-schema`, and a real `dgemma serve` driven by the openai client.

The guarantee under test: with any weights (here random ones), every answer that finishes with "stop"
parses with json.loads and validates against its schema (jsonschema is the checker), answers longer than
one canvas included; only "length" may cut an answer short (never, here: answers are kept within budget).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from dgemma.structured import TokenVocabulary, json_object_constraint, json_schema_constraint
from dgemma.tokenizer import Tokenizer
from test_server import ServerProcess
from test_structured import SCHEMAS


@pytest.fixture(scope="module")
def gemma_model(gemma_tokenizer_model_dir):
    import dgemma

    model = dgemma.load_model(gemma_tokenizer_model_dir)
    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    return model, tokenizer, TokenVocabulary.from_tokenizer(tokenizer, size=model.config.vocab_size)


def _prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])


def test_engine_answers_validate_for_many_seeds_and_schemas(gemma_model):
    from dgemma.engine import Engine

    model, tokenizer, vocab = gemma_model
    engine = Engine(model, max_batch=4, max_length=256)
    sampling = model.sampling_config.replace(max_new_tokens=160, max_denoising_steps=4)
    longer_than_a_canvas = 0
    for name in ("nested", "array", "choices", "long"):
        automaton = json_schema_constraint(SCHEMAS[name], vocab)
        requests = engine.generate([_prompt(tokenizer)] * 4, sampling, seeds=[10, 11, 12, 13],
                                   constraints=[automaton] * 4)
        for r in requests:
            assert r.finish_reason == "stop", (name, r.seed)
            jsonschema.validate(json.loads(tokenizer.decode(r.tokens)), SCHEMAS[name])
            longer_than_a_canvas += len(r.tokens) > model.config.canvas_length
    assert longer_than_a_canvas >= 8


def test_plain_loop_matches_the_engine_and_mixes_with_free_rows(gemma_model):
    from dgemma.engine import Engine
    from dgemma.generation import generate

    model, tokenizer, vocab = gemma_model
    sampling = model.sampling_config.replace(max_new_tokens=64, max_denoising_steps=4)
    automaton = json_object_constraint(vocab)
    prompt = _prompt(tokenizer)
    engine = Engine(model, max_batch=2, max_length=256)
    for seed in (0, 1):
        plain = generate(model, [prompt], sampling, seed=seed, constraint=automaton)
        (request,) = engine.generate([prompt], sampling, seeds=[seed], constraints=[automaton])
        assert plain.tokens[0] == request.tokens and plain.finish_reasons[0] == request.finish_reason == "stop"
        assert isinstance(json.loads(tokenizer.decode(request.tokens)), dict)
    # a constrained row beside a free one in a batch (they share the batch's generator)
    both = generate(model, [prompt, prompt], sampling, seed=5, constraint=[automaton, None])
    assert isinstance(json.loads(tokenizer.decode(both.tokens[0])), dict) and both.finish_reasons[0] == "stop"
    with pytest.raises(ValueError, match="constraints for"):
        generate(model, [prompt, prompt], sampling, seed=5, constraint=[automaton])


def test_with_the_step_cache_constrained_positions_settle_only_on_the_tokens_the_guide_placed(gemma_model,
                                                                                             monkeypatch):
    """Settling as eagerly as the rule allows: a settled position the sampler keeps was computed with the token
    it reads, which at a constrained row's accepted positions is the guide's (a valid answer's) token; answers
    still validate."""
    from dgemma.generation import generate
    from dgemma.generation.step_cache import StepCache

    model, tokenizer, vocab = gemma_model
    sampling = model.sampling_config.replace(max_new_tokens=64, max_denoising_steps=6, step_cache=True,
                                             settle_steps=1, settle_probability=0.0)
    checks = {"settled": 0, "guided": 0}
    settle = StepCache.settle

    def checked(self, argmax, probs, drawn, next_canvas, done, *args, **kwargs):
        settle(self, argmax, probs, drawn, next_canvas, done, *args, **kwargs)
        kept = self.settled & drawn  # settled positions the sampler keeps read the guide's token, computed with it
        assert (next_canvas[kept] == self.computed_with[kept]).all()
        checks["settled"] += int(kept.sum())
        checks["guided"] += int((drawn & (next_canvas != argmax)).sum())  # the guide overrode the argmax

    monkeypatch.setattr(StepCache, "settle", checked)
    result = generate(model, [_prompt(tokenizer)] * 2, sampling, seed=3, constraint=json_object_constraint(vocab))
    assert result.finish_reasons == ["stop", "stop"]
    assert all(isinstance(json.loads(tokenizer.decode(t)), dict) for t in result.tokens)
    assert checks["settled"] > 0 and checks["guided"] > 0
    assert sum(result.decoder_positions) < 2 * model.config.canvas_length * sum(map(sum, result.steps_per_canvas))


def test_budget_too_small_for_any_answer_is_cut_with_length(gemma_model):
    from dgemma.engine import Engine

    model, tokenizer, vocab = gemma_model
    automaton = json_schema_constraint({"type": "object", "properties": {"t": {"type": "string", "minLength": 400}},
                                        "required": ["t"]}, vocab)
    engine = Engine(model, max_batch=1, max_length=256)
    (request,) = engine.generate([_prompt(tokenizer)], model.sampling_config.replace(max_new_tokens=24),
                                 seeds=[0], constraints=[automaton])
    assert request.finish_reason == "length" and len(request.tokens) == 24
    assert automaton.walk(request.tokens) is not None  # a prefix of a valid answer


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dgemma", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_json_schema(gemma_tokenizer_model_dir, tmp_path):
    schema = SCHEMAS["choices"]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    base = ["--model", str(gemma_tokenizer_model_dir), "--prompt", "a colour", "--chat", "--steps", "4"]
    out = _cli(*base, "--json-schema", str(path), "--seed", "3", "--max-new-tokens", "96", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "stop"
    jsonschema.validate(json.loads(result["text"]), schema)
    plain = _cli(*base, "--json-object", "--seed", "3", "--max-new-tokens", "64")
    assert plain.returncode == 0 and isinstance(json.loads(plain.stdout.strip()), dict)

    path.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}))
    bad = _cli(*base, "--json-schema", str(path))
    assert bad.returncode == 2 and "'format'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def gemma_server(gemma_tokenizer_model_dir):
    server = ServerProcess(gemma_tokenizer_model_dir, "--max-batch", "4")
    yield server
    server.stop()


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_server_chat_and_completions_streamed_equal_non_streamed(gemma_server):
    client = gemma_server.client()
    extra = {"steps": 4}
    for name in ("nested", "array"):
        schema = SCHEMAS[name]
        for seed in (1, 2):
            chat = dict(model="tiny", messages=[{"role": "user", "content": "JSON please"}], seed=seed,
                        max_tokens=128, response_format=_schema_format(schema), extra_body=extra)
            whole = client.chat.completions.create(**chat)
            choice = whole.choices[0]
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
            parts, reasons = [], []
            for chunk in client.chat.completions.create(**chat, stream=True):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    reasons.append(chunk.choices[0].finish_reason)
            assert "".join(parts) == choice.message.content and reasons[-1] == "stop"

    completion = dict(model="tiny", prompt="Some JSON:", seed=7, max_tokens=96,
                      extra_body={**extra, "response_format": {"type": "json_object"}})  # not in the client's API
    whole = client.completions.create(**completion)
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].text), dict)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**completion, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_server_refuses_unsupported_schemas_naming_the_keyword(gemma_server):
    client = gemma_server.client()
    messages = [{"role": "user", "content": "hi"}]
    for keyword, schema in [("pattern", {"type": "string", "pattern": "a+"}),
                            ("oneOf", {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}})]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=messages, response_format=_schema_format(schema))
        assert repr(keyword) in error.value.body["message"] or keyword in error.value.body["message"]
        assert error.value.body["param"] == "response_format"
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}):
        response = gemma_server.post("/v1/chat/completions", {"messages": messages, "response_format": bad})
        assert response.status_code == 400 and "response_format" in response.json()["error"]["message"]
    assert gemma_server.health()["status"] == "ok"


def test_server_prebuilds_json_object_into_its_disk_cache(gemma_tokenizer_model_dir, tmp_path):
    """--prebuild-json-object builds json_object's automaton at start into --automaton-cache; a second server
    reads it from there and answers json_object at once."""
    import time

    cache = tmp_path / "automata"
    first = ServerProcess(gemma_tokenizer_model_dir, "--prebuild-json-object", "--automaton-cache", str(cache))
    try:
        deadline = time.monotonic() + 60
        while not list(cache.glob("*.pt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(cache.glob("*.pt"))) == 1
    finally:
        first.stop()
    written = next(cache.glob("*.pt")).stat().st_mtime_ns
    second = ServerProcess(gemma_tokenizer_model_dir, "--automaton-cache", str(cache))
    try:
        out = second.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "JSON please"}], seed=3, max_tokens=64,
            response_format={"type": "json_object"})
        assert out.choices[0].finish_reason != "stop" or isinstance(json.loads(out.choices[0].message.content), dict)
        assert [p.stat().st_mtime_ns for p in cache.glob("*.pt")] == [written]  # read, not built again
    finally:
        second.stop_cleanly()


@pytest.mark.parametrize("fields", [dict(sampler="block-refinement", temperature=1.0, editing_threshold=0.05),
                                    dict(sampler="ddim", temperature=1.0, corrector_steps=1, corrector_k=4)],
                         ids=["block-refinement editing", "ddim corrector"])
def test_each_sampler_writes_valid_answers_and_the_engine_equals_the_plain_loop(gemma_model, fields):
    """Block refinement (editing committed tokens) and DDIM (its corrector sweeps redrawing positions) commit
    answers that validate, the engine's tokens the plain loop's."""
    from dgemma.engine import Engine
    from dgemma.generation import generate

    model, tokenizer, vocab = gemma_model
    sampling = model.sampling_config.replace(max_new_tokens=160, max_denoising_steps=5, **fields)
    automaton = json_schema_constraint(SCHEMAS["nested"], vocab)
    prompt = _prompt(tokenizer)
    requests = Engine(model, max_batch=2, max_length=256).generate([prompt] * 2, sampling, seeds=[20, 21],
                                                                 constraints=[automaton] * 2)
    for seed, request in zip((20, 21), requests):
        assert request.finish_reason == "stop", seed
        jsonschema.validate(json.loads(tokenizer.decode(request.tokens)), SCHEMAS["nested"])
        assert generate(model, [prompt], sampling, seed=seed, constraint=automaton).tokens[0] == request.tokens
