"""dgemma.structured on its own: the vocabulary's bytes, the schema subset, the automaton, the canvas DP.

The DP is checked against brute force (every token string, exact scores), its sampler against the exact
constrained distribution, and the guarantee (every answer that ends parses and validates) on random
distributions chained over many canvases with a Gemma-shaped tokenizer. Model-level runs are in
test_structured_generation.py.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import jsonschema
import pytest
import torch

from dgemma.structured import (
    ENDED,
    SchemaError,
    TokenVocabulary,
    constrained_canvas,
    constrained_sample,
    json_object_constraint,
    json_schema_constraint,
    regex_constraint,
)
from dgemma.structured.vocabulary import NOT_SPECIAL
from dgemma.tokenizer import Tokenizer

PAD, EOS = 0, 1
SMALL = (None, None, b"a", b"b", b"ab", b"c", b"\xc3", b"\xa9", b"ba")  # 0 pad, 1 eos; b"\xc3\xa9" is "é"


def _brute_force(automaton, probs, state, budget):
    """Best score over every token string the DP may choose (answer, EOS, then EOS/pad filler)."""
    L, V = probs.shape
    n = min(L, budget)
    best = -math.inf
    for seq in itertools.product(range(V), repeat=n):
        q, ended, ok = state, False, True
        for t in seq:
            if ended:
                ok = t in (PAD, EOS)
            elif t == EOS:
                ok = ended = automaton.is_final(q)
            else:
                q = automaton.next_state(q, t) if t != PAD else None
                ok = q is not None
            if not ok:
                break
        if ok and (ended or automaton.distance[q] + 1 <= budget - n):
            best = max(best, sum(math.log(probs[i, t]) for i, t in enumerate(seq)))
    return best


def _score(probs, tokens, n):
    """Score of a DP answer; filler positions count their best EOS-or-pad probability, as the DP does."""
    total, ended = 0.0, False
    for i, t in enumerate(tokens[:n]):
        total += math.log(max(probs[i, EOS], probs[i, PAD]) if ended else probs[i, t])
        ended = ended or t == EOS
    return total


def test_dp_finds_the_most_probable_accepted_string():
    vocab = TokenVocabulary(SMALL, size=len(SMALL))
    automaton = regex_constraint(r"(ab|é)+c?", vocab)
    torch.manual_seed(0)
    for trial in range(24):
        probs = torch.softmax(torch.randn(4, len(SMALL)) * 2, -1)
        budget = (4, 3, 10)[trial % 3]  # 3: the answer must end inside this canvas
        choice = constrained_canvas(automaton, probs, automaton.initial, budget=budget, eos_token_ids=[EOS],
                                    pad_token_id=PAD)
        n = min(4, budget)
        assert _score(probs, choice.tokens.tolist(), n) == pytest.approx(
            _brute_force(automaton, probs, automaton.initial, budget), abs=1e-4)
        if budget <= 4:
            assert choice.ended
        answer = [t for t in choice.tokens.tolist()[:n]]
        answer = answer[: answer.index(EOS)] if EOS in answer else answer
        state = automaton.walk(answer)
        assert state is not None and (choice.ended == (EOS in choice.tokens.tolist()))
        if not choice.ended:
            assert state == choice.state


def test_sampling_follows_the_constrained_distribution():
    vocab = TokenVocabulary(SMALL, size=len(SMALL))
    automaton = regex_constraint(r"(ab|é|c)+", vocab)
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2, len(SMALL)), -1)
    exact = {}
    for seq in itertools.product(range(len(SMALL)), repeat=2):  # strings of the language, ended or not
        q, ended, ok = automaton.initial, False, True
        for t in seq:
            if ended:
                ok = t in (PAD, EOS)
            elif t == EOS:
                ok = ended = automaton.is_final(q)
            elif t == PAD:
                ok = False
            else:
                q = automaton.next_state(q, t)
                ok = q is not None
            if not ok:
                break
        if ok:
            key = tuple(PAD if (EOS in seq[:i]) else t for i, t in enumerate(seq))  # filler is written as pad
            exact[key] = exact.get(key, 0.0) + math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    total = sum(exact.values())
    generator = torch.Generator().manual_seed(0)
    draws = 2000
    counts: dict[tuple, int] = {}
    for _ in range(draws):
        tokens = constrained_sample(automaton, probs, automaton.initial, budget=100, eos_token_ids=[EOS],
                                    pad_token_id=PAD, generator=generator)
        counts[tuple(tokens.tolist())] = counts.get(tuple(tokens.tolist()), 0) + 1
    assert set(counts) <= set(exact)
    distance = 0.5 * sum(abs(counts.get(k, 0) / draws - v / total) for k, v in exact.items())
    assert distance < 0.06


def test_vocabulary_bytes_match_the_tokenizer(gemma_tokenizer_model_dir):
    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    vocab = TokenVocabulary.from_tokenizer(tokenizer, size=tokenizer.vocab_size + 7)
    assert vocab.size == tokenizer.vocab_size + 7 and len(vocab.token_bytes) == tokenizer.vocab_size
    for special in ("<pad>", "<eos>", "<bos>", "<|turn>", '<|"|>'):
        assert vocab.token_bytes[tokenizer.token_to_id(special)] is None
    assert vocab.token_bytes[tokenizer.token_to_id("<0xC3>")] == b"\xc3"
    assert vocab.token_bytes[tokenizer.token_to_id('":\u2581')] == b'": '
    for text in ['{"name": "Zoë 日本", "tags": ["a, b"]}', "  x\n\ty", "ünïcödé ✓ 🎉"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any(tokenizer.backend.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
        assert vocab.decode(ids) == tokenizer.decode(ids).encode() == text.encode()
    assert TokenVocabulary.from_tokenizer(tokenizer, size=tokenizer.vocab_size + 7) is vocab  # cached


@pytest.mark.parametrize("keyword, schema", [
    ("pattern", {"type": "string", "pattern": "^a+$"}),
    ("format", {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}}),
    ("minimum", {"type": "array", "items": {"type": "integer", "minimum": 3}}),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "null"}]}),
    ("allOf", {"allOf": [{"type": "string"}]}),
    ("uniqueItems", {"type": "array", "uniqueItems": True}),
    ("items", {"type": "array", "items": [{"type": "string"}]}),
    ("additionalProperties", {"type": "object", "properties": {"a": {"type": "string"}},
                              "additionalProperties": {"type": "string"}}),
    ("required", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}),
    ("minLength", {"type": "string", "minLength": 3, "maxLength": 2}),
])
def test_unsupported_schemas_name_the_keyword(keyword, schema):
    vocab = TokenVocabulary(SMALL, size=len(SMALL))
    with pytest.raises(SchemaError) as error:
        json_schema_constraint(schema, vocab)
    assert error.value.keyword == keyword and repr(keyword) in str(error.value) or keyword in str(error.value)


SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "zip": {"type": ["string", "null"], "maxLength": 5}},
                    "required": ["city"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 2}},
        "required": ["tags", "scores"]},
    "choices": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue", 7, None]},
        "kind": {"const": "fixed"},
        "value": {"anyOf": [{"type": "boolean"}, {"type": "integer"},
                            {"type": "object", "properties": {"x": {"type": "null"}}, "required": ["x"]}]}},
        "required": ["color", "kind", "value"]},
    "long": {"type": "object", "properties": {  # at least 3 canvases of 16 tokens
        "text": {"type": "string", "minLength": 30, "maxLength": 40},
        "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 4, "maxItems": 6}},
        "required": ["text", "items"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 "required": ["x", "y"]}},
             "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
}


def _run_random(automaton, vocab_size, budget, seed, canvas=16, sharpness=3.0, sample_steps=False):
    """Canvas after canvas of random peaky distributions through the DP, the state carried along."""
    generator = torch.Generator().manual_seed(seed)
    state, tokens, cut = automaton.initial, [], False
    for start in range(0, budget, canvas):
        probs = torch.softmax(torch.randn(canvas, vocab_size, generator=generator) * sharpness, -1)
        if sample_steps:  # a constrained sample feeds nothing here; it must still be a valid continuation
            drawn = constrained_sample(automaton, probs, state, budget=budget - start, eos_token_ids=[1, 5],
                                       pad_token_id=0, generator=generator).tolist()
            answer = drawn[: drawn.index(1)] if 1 in drawn else drawn
            assert automaton.walk([t for t in answer if t not in (0, 5)], state) is not None
        choice = constrained_canvas(automaton, probs, state, budget=budget - start, eos_token_ids=[1, 5],
                                    pad_token_id=0)
        row = choice.tokens.tolist()[: budget - start]
        ends = [i for i, t in enumerate(row) if t in (1, 5)]
        tokens += row[: ends[0]] if ends else row
        cut = cut or choice.cut
        if choice.state == ENDED:
            return tokens, True, cut
        state = choice.state
    return tokens, False, cut


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_finished_answer_validates(gemma_tokenizer_model_dir, name):
    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    vocab = TokenVocabulary.from_tokenizer(tokenizer)
    schema = SCHEMAS[name]
    automaton = json_schema_constraint(schema, vocab)
    for seed in range(12):
        tokens, ended, cut = _run_random(automaton, vocab.size, budget=160, seed=seed, sample_steps=seed < 2)
        assert ended and not cut, f"seed {seed}: the answer did not end within the budget"
        text = tokenizer.decode(tokens)
        assert text.encode() == vocab.decode(tokens)
        jsonschema.validate(json.loads(text), schema)


def test_budget_closes_answers_and_cuts_only_the_impossible(gemma_tokenizer_model_dir):
    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    vocab = TokenVocabulary.from_tokenizer(tokenizer)
    free_text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    automaton = json_schema_constraint(free_text, vocab)
    for seed in range(6):  # a string of any length: the DP still closes it inside 40 tokens
        tokens, ended, cut = _run_random(automaton, vocab.size, budget=40, seed=seed, sharpness=0.5)
        assert ended and not cut and len(tokens) < 40
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), free_text)
    too_long = {"type": "string", "minLength": 400}  # needs more tokens than the budget allows
    automaton = json_schema_constraint(too_long, vocab)
    tokens, ended, cut = _run_random(automaton, vocab.size, budget=20, seed=0)
    assert not ended and cut and len(tokens) == 20
    assert automaton.walk(tokens) is not None  # the best prefix, still inside the language


def test_json_object_mode_writes_objects(gemma_tokenizer_model_dir):
    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    vocab = TokenVocabulary.from_tokenizer(tokenizer)
    automaton = json_object_constraint(vocab)
    for seed in range(6):
        tokens, ended, _ = _run_random(automaton, vocab.size, budget=96, seed=seed)
        assert ended
        assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


def test_automaton_agrees_with_outlines_index(gemma_tokenizer_model_dir):
    """Our dense, class-grouped table accepts exactly the token strings outlines-core's Index accepts."""
    import outlines_core

    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    vocab = TokenVocabulary.from_tokenizer(tokenizer)
    automaton = json_schema_constraint(SCHEMAS["choices"], vocab)
    index = outlines_core.Index(automaton.regex, outlines_core.Vocabulary(vocab.size, vocab.outlines_tokens()))
    rng = random.Random(0)
    allowed_anywhere = sorted({t for s in index.get_transitions().values() for t in s} - {vocab.size})
    for _ in range(300):
        ours, theirs = automaton.initial, index.get_initial_state()
        for _ in range(30):
            token = rng.choice(allowed_anywhere) if rng.random() < 0.5 else rng.randrange(vocab.size)
            ours, theirs = automaton.next_state(ours, token), index.get_next_state(theirs, token)
            assert (ours is None) == (theirs is None)
            if ours is None:
                break
            assert automaton.is_final(ours) == index.is_final_state(theirs)
            assert len(automaton.allowed_tokens(ours)) == len(set(index.get_allowed_tokens(theirs)) - {vocab.size})


def test_special_tokens_take_part_only_where_the_regex_names_them(gemma_tokenizer_model_dir):
    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    quote, call = '<|"|>', "<|tool_call>"
    vocab = TokenVocabulary.from_tokenizer(tokenizer, special_tokens=(call, quote))
    regex = f"{vocab.special(call)}call:get\\{{city:{vocab.special(quote)}{NOT_SPECIAL}{{1,6}}{vocab.special(quote)}\\}}"
    automaton = regex_constraint(regex, vocab)
    quote_id, call_id = tokenizer.token_to_id(quote), tokenizer.token_to_id(call)
    for seed in range(8):
        tokens, ended, _ = _run_random(automaton, vocab.size, budget=48, seed=seed)
        assert ended and tokens[0] == call_id and tokens.count(quote_id) == 2
        assert tokenizer.backend.id_to_token(tokens[0]) == call
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        assert text.startswith('<|tool_call>call:get{city:<|"|>') and text.endswith('<|"|>}')
        assert 1 <= len(text[len('<|tool_call>call:get{city:<|"|>'): -len('<|"|>}')]) <= 6


def test_without_eos_ids_the_answer_fills_the_budget_and_ends_accepted():
    """Fixed-length answers (no EOS ids, as the sudoku task): the last position must leave an accepting state."""
    vocab = TokenVocabulary(SMALL, size=len(SMALL))
    automaton = regex_constraint(r"(ab|c)+", vocab)
    torch.manual_seed(3)
    for _ in range(10):
        probs = torch.softmax(torch.randn(5, len(SMALL)) * 2, -1)
        choice = constrained_canvas(automaton, probs, automaton.initial, budget=5, eos_token_ids=(), pad_token_id=PAD)
        assert not choice.cut and choice.state != ENDED and automaton.is_final(choice.state)
        assert automaton.walk(choice.tokens.tolist()) == choice.state


def _fresh_memory():
    """Forget the in-process automata, so the next call reads the disk or builds."""
    from dgemma.structured import automaton as module

    with module._cache_lock:
        module._cache.clear()


def test_disk_cache_gives_back_the_same_automaton(gemma_tokenizer_model_dir, tmp_path, monkeypatch):
    """A second start reads the built automaton from --automaton-cache instead of building it; a file that is
    not the automaton's (cut short, or written for another regex) is built again and overwritten."""
    from dgemma.structured import automaton as module
    from dgemma.structured import set_disk_cache

    vocab = TokenVocabulary.from_tokenizer(Tokenizer.from_folder(gemma_tokenizer_model_dir))
    built = []
    build = module._build
    monkeypatch.setattr(module, "_build", lambda *a: built.append(a[0]) or build(*a))
    set_disk_cache(tmp_path)
    try:
        _fresh_memory()
        first = json_object_constraint(vocab)
        (path,) = tmp_path.glob("*.pt")
        _fresh_memory()
        again = json_object_constraint(vocab)
        assert len(built) == 1 and again is not first  # read from disk, not built
        for name in ("final", "distance", "token_class", "edge_src", "edge_class", "edge_dst", "class_order",
                     "class_offsets"):
            assert torch.equal(getattr(first, name), getattr(again, name)), name
        assert (again.initial, again._next, again.description) == (first.initial, first._next, first.description)
        path.write_bytes(path.read_bytes()[:100])  # cut short: built again
        _fresh_memory()
        assert torch.equal(json_object_constraint(vocab).edge_dst, first.edge_dst) and len(built) == 2
        other = regex_constraint("a+", vocab)
        assert len(list(tmp_path.glob("*.pt"))) == 2 and other.regex == "a+"
    finally:
        set_disk_cache(None)
        _fresh_memory()


def test_concurrent_requests_for_one_automaton_share_one_build(gemma_tokenizer_model_dir, monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dgemma.structured import automaton as module

    vocab = TokenVocabulary.from_tokenizer(Tokenizer.from_folder(gemma_tokenizer_model_dir))
    started, release, built = threading.Event(), threading.Event(), []
    build = module._build

    def slow_build(*args):
        built.append(args[0])
        started.set()
        release.wait(30)
        return build(*args)

    monkeypatch.setattr(module, "_build", slow_build)
    _fresh_memory()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(regex_constraint, "(ab|ba){1,3}c", vocab) for _ in range(4)]
        started.wait(30)
        release.set()
        results = [f.result(30) for f in futures]
    assert len(built) == 1 and all(r is results[0] for r in results)
    with pytest.raises(Exception, match="cannot build"):  # a failed build fails every waiter, and is not kept
        regex_constraint("(unclosed", vocab)
    assert not module._building
