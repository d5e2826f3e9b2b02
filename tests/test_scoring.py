"""Prompt scoring in the engine: the log-probabilities equal a plain encoder pass's log-softmax, whatever
the batch, the chunking and the sharing of prefixes, and scoring leaves generation untouched."""

from __future__ import annotations

import random

import pytest
import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine, Request, ScoreRequest
from dgemma.engine.scoring import plan_clusters
from dgemma.generation import generate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()  # sliding window 8: prompts pass it


def reference(model, prompt: list[int], k: int):
    """log_softmax of one encoder pass over the prompt alone, in a fresh cache."""
    logp = torch.log_softmax(model.encode(torch.tensor([prompt]), model.new_cache(1, len(prompt)))[0], dim=-1)
    return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)], logp.topk(k, dim=-1)


def check(model, requests, k):
    for r in requests:
        assert r.finish_reason == "scored"
        token_lp, top = reference(model, r.prompt, k)
        s = r.scores
        assert s.token_logprobs.shape == (len(r.prompt) - 1,)
        torch.testing.assert_close(s.token_logprobs, token_lp, atol=2e-5, rtol=0)
        torch.testing.assert_close(s.top_logprobs, top.values, atol=2e-5, rtol=0)
        assert torch.equal(s.top_ids, top.indices)


rng = random.Random(0)
FEW_SHOT = [rng.randrange(128) for _ in range(30)]
QUESTIONS = [FEW_SHOT + [rng.randrange(128) for _ in range(12)] for _ in range(2)]
# two questions' choices (one to six tokens) after shared examples, a prompt that is another's prefix,
# one of a single token and one that shares nothing
PROMPTS = ([q + [rng.randrange(128) for _ in range(rng.randint(1, 6))] for q in QUESTIONS for _ in range(3)]
           + [QUESTIONS[0], [7], [rng.randrange(128) for _ in range(25)]])


@pytest.mark.parametrize("chunk_tokens,max_batch", [(3, 8), (5, 3), (2048, 8)])
def test_scores_equal_the_encoder_alone(model, chunk_tokens, max_batch):
    engine = Engine(model, max_batch=max_batch, max_length=128, score_chunk_tokens=chunk_tokens)
    requests = engine.score(PROMPTS, top=4)
    check(model, requests, 4)
    assert not engine.active and not engine.scoring and len(engine.free_rows) == max_batch


def test_shared_prefixes_are_encoded_once(model):
    clusters = plan_clusters(PROMPTS)
    shared = sorted((sorted(m), q) for m, q in clusters if len(m) > 1)
    # each question with its choices: sharing only the examples across both questions would encode the
    # 12 question tokens seven times instead of twice, which costs more than the examples twice
    q = len(QUESTIONS[0]) - 1  # one token is left to each prompt: where they part, each predicts its own
    assert shared == [([0, 1, 2, 6], q), ([3, 4, 5], q)]
    engine = Engine(model, max_batch=len(PROMPTS), max_length=128)
    check(model, engine.score(PROMPTS, top=1), 1)
    assert engine.scored_tokens == 2 * q + sum(len(p) - q for p in PROMPTS[:7]) + len(PROMPTS[7]) + len(PROMPTS[8])
    assert engine.scored_tokens < sum(len(p) for p in PROMPTS) - 4 * q


def test_a_long_prompt_in_chunks_at_the_context_limit(model):
    prompt = [rng.randrange(128) for _ in range(128)]
    engine = Engine(model, max_batch=2, max_length=128, score_chunk_tokens=24)
    check(model, engine.score([prompt, prompt[:70]], top=2), 2)
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit(ScoreRequest(prompt=prompt + [1], top=1))


def test_scoring_beside_generation_changes_neither(model):
    """Generation requests and scoring requests share the engine: tokens equal the plain loop's."""
    s = SamplingConfig(max_new_tokens=40, eos_token_ids=(1,), max_denoising_steps=6)
    gen_prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    plain = [generate(model, [p], s, seed=10 + i) for i, p in enumerate(gen_prompts)]
    engine = Engine(model, max_batch=4, max_length=128, score_chunk_tokens=16)
    gen = [Request(prompt=p, sampling=s, seed=10 + i) for i, p in enumerate(gen_prompts)]
    scored = [ScoreRequest(prompt=p, top=3) for p in PROMPTS]
    engine.submit_all(gen + scored)
    steps_with_both = 0
    while not all(r.done for r in gen + scored):
        steps_with_both += bool(engine.scoring and engine.generating)
        engine.step()
    assert steps_with_both > 1  # scoring ran in chunks between denoising steps
    for r, p in zip(gen, plain):
        assert r.tokens == p.tokens[0]
    check(model, scored, 3)


def test_cancelled_scoring_frees_its_rows(model):
    engine = Engine(model, max_batch=4, max_length=128, score_chunk_tokens=4)
    requests = [ScoreRequest(prompt=p, top=1) for p in PROMPTS[:3]]
    engine.submit_all(requests)
    engine.step()
    assert engine.scoring and len(engine.free_rows) == 1
    for r in requests:
        engine.cancel(r)
    engine.step()
    assert all(r.finish_reason == "cancelled" and r.scores is None for r in requests)
    assert not engine.scoring and len(engine.free_rows) == 4
    check(model, engine.score(PROMPTS[:3], top=1), 1)  # the freed rows score as new


def test_a_group_fits_the_queue_whole_or_not_at_all(model):
    from dgemma.engine import QueueFull

    engine = Engine(model, max_batch=1, max_queue=3)
    engine.submit_all([ScoreRequest(prompt=[1, 2], top=1) for _ in range(2)])
    with pytest.raises(QueueFull):
        engine.submit_all([ScoreRequest(prompt=[1, 2], top=1) for _ in range(2)])
    assert len(engine.waiting) == 2
