"""Verifier-in-the-loop generation: rounds re-noise the rejected positions and keep the rest, candidates
race with their own seeds, and the engine reproduces the plain loop's search token for token."""

from __future__ import annotations

import pytest
import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine
from dgemma.generation import generate, generate_verified
from dgemma.generation.verify import candidate_seed, next_template

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [20] * 9]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()


@pytest.fixture(scope="module")
def sampling(model):
    # no EOS inside the vocabulary: every output has 20 tokens (two canvases of 16, the second cut)
    return SamplingConfig(max_new_tokens=20, eos_token_ids=(model.config.vocab_size,), max_denoising_steps=6)


def reject_multiples_of_3(tokens):
    """A checker with an answer the model often misses: the first 8 tokens must not be multiples of 3."""
    return [i for i, t in enumerate(tokens[:8]) if t % 3 == 0]


class Recorder:
    """Wraps a verifier and keeps every output it saw with its verdict."""

    def __init__(self, verifier):
        self.verifier, self.calls = verifier, []

    def __call__(self, tokens):
        rejected = list(self.verifier(tokens))
        self.calls.append((list(tokens), rejected))
        return rejected


def test_rejected_positions_are_denoised_again_and_the_rest_kept(model, sampling):
    check = Recorder(reject_multiples_of_3)
    result = generate_verified(model, [PROMPTS[1]], sampling, check, seed=11, max_rounds=4)
    assert len(check.calls) == result.search[0]["rounds"] >= 2
    changed = 0
    for (before, rejected), (after, _) in zip(check.calls, check.calls[1:]):
        assert rejected
        assert all(after[i] == before[i] for i in range(len(before)) if i not in rejected)
        changed += sum(after[i] != before[i] for i in rejected)
    assert changed > 0
    assert result.tokens[0] == check.calls[-1][0]
    assert result.search[0]["forwards"] == sum(result.steps_per_canvas[0])
    assert len(result.steps_per_canvas[0]) == 2 * result.search[0]["rounds"]  # two canvases per round


def test_accepted_first_round_is_the_plain_output(model, sampling):
    plain = generate(model, PROMPTS, sampling, seed=3)
    checked = generate_verified(model, PROMPTS, sampling, lambda tokens: [], seed=3, max_rounds=5)
    assert checked.tokens == plain.tokens
    assert checked.steps_per_canvas == plain.steps_per_canvas
    assert [s["rounds"] for s in checked.search] == [1, 1, 1]
    assert all(s["accepted"] and s["candidate"] == 0 for s in checked.search)


def test_engine_search_equals_plain_loop(model, sampling):
    plain = [generate_verified(model, [p], sampling, reject_multiples_of_3, seed=10 + i, max_rounds=4)
             for i, p in enumerate(PROMPTS)]
    engine = Engine(model, max_batch=2, max_length=128)
    requests = engine.generate(PROMPTS, sampling, seeds=[10, 11, 12], verifier=reject_multiples_of_3, max_rounds=4)
    assert sorted({p.search[0]["rounds"] for p in plain}) != [1]  # some prompt needed another round
    for p, r in zip(plain, requests):
        stats = r.stats()
        assert r.tokens == p.tokens[0]
        assert r.steps_per_canvas == p.steps_per_canvas[0]
        assert stats["tokens_per_forward"] == pytest.approx(p.tokens_per_forward[0])
        for key in ("accepted", "rounds", "candidate", "forwards", "rejected"):
            assert stats["search"][key] == p.search[0][key]
    assert not engine.active and len(engine.free_rows) == 2


def test_candidates_winner_is_a_single_run_with_its_seed(model, sampling):
    check = reject_multiples_of_3
    engine = Engine(model, max_batch=3, max_length=128)  # fewer rows than candidates: they queue
    requests = engine.generate(PROMPTS, sampling, seeds=[10, 11, 12], verifier=check, max_rounds=2, candidates=4)
    winners = [r.stats()["search"] for r in requests]
    assert any(w["candidate"] > 0 for w in winners)
    for i, (r, w) in enumerate(zip(requests, winners)):
        alone = generate_verified(model, [PROMPTS[i]], sampling, check, seed=candidate_seed(10 + i, w["candidate"]),
                                  max_rounds=2)
        assert r.tokens == alone.tokens[0]
        assert w["rounds"] == alone.search[0]["rounds"] and w["accepted"] == alone.search[0]["accepted"]
        plain = generate_verified(model, [PROMPTS[i]], sampling, check, seed=10 + i, max_rounds=2, candidates=4)
        assert plain.search[0]["candidate"] == w["candidate"] and plain.tokens[0] == r.tokens
        assert w["candidates"] == 4 and w["forwards"] >= w["winner_forwards"]


def test_template_of_the_next_round_keeps_the_callers_positions():
    base_fixed = torch.tensor([True, False, False, False, False, True])
    base_tokens = torch.tensor([7, 0, 0, 0, 0, 9])
    fixed, tokens = next_template(base_fixed, base_tokens, [1, 2, 3, 4], [0, 2, 10])
    assert fixed.tolist() == [True, True, False, True, False, True]
    assert tokens[fixed].tolist() == [7, 2, 4, 9]


def test_bad_search_arguments(model, sampling):
    with pytest.raises(ValueError, match=">= 1"):
        generate_verified(model, [PROMPTS[0]], sampling, lambda t: [], max_rounds=0)
    with pytest.raises(ValueError, match=">= 1"):
        Engine(model, max_batch=1).generate([PROMPTS[0]], sampling, verifier=lambda t: [], candidates=0)
