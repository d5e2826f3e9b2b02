"""The prefix cache and chunked prefill give the same tokens as encoding every prompt whole, whatever was
cached or evicted before; the cache stays within its budget; running requests step between chunks."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine, Request
from dgemma.engine.scheduler import PrefillPace
from dgemma.quant.quantize import quantize_model
from tests.conftest import perturb_every_tensor


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)  # the tiny preset: a sliding window of 8 (rings of 7 slots) against blocks of 16
    return perturb_every_tensor(dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval())


def _sampling(**kw):
    # an EOS outside the vocabulary: every canvas but the last is committed into the row
    return SamplingConfig(**{"max_new_tokens": 40, "eos_token_ids": (1000,), "max_denoising_steps": 4, **kw})


BASE = [(7 * i + 3) % 120 + 2 for i in range(40)]


def _one_by_one(engine, prompts, seeds, sampling):
    return [engine.generate([p], sampling, seeds=[s])[0] for p, s in zip(prompts, seeds)]


def _block_bytes(engine) -> int:
    return next(iter(engine.prefix_cache.blocks.values())).nbytes


@pytest.mark.parametrize("quantised", [False, True])
def test_cached_prefixes_give_the_same_tokens(model, quantised):
    if quantised:
        model = quantize_model(perturb_every_tensor(dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()), "int8")
    s = _sampling()
    plain = Engine(model, max_batch=1, max_length=256)
    cached = Engine(model, max_batch=1, max_length=256, prefix_cache_bytes=1 << 24)
    first = _one_by_one(cached, [BASE], [0], s)[0]
    assert first.tokens == _one_by_one(plain, [BASE], [0], s)[0].tokens and first.cached_tokens == 0
    prompts = [
        BASE[:37] + [5, 9, 11],  # parts from the first inside its third block: two blocks (32 tokens) taken
        BASE,  # the same prompt again: its whole blocks
        BASE + first.tokens[:32] + [3, 4, 5],  # the prompt and two committed canvases: 72 tokens, 4 blocks
        [9] + BASE,  # shifted by one: nothing
    ]
    seeds = [1, 2, 3, 4]
    again = _one_by_one(cached, prompts, seeds, s)
    alone = _one_by_one(plain, prompts, seeds, s)
    assert [r.tokens for r in again] == [r.tokens for r in alone]
    assert [r.cached_tokens for r in again] == [32, 32, 64, 0]
    stats = cached.prefix_cache.stats
    assert (stats.lookups, stats.hits, stats.cached_tokens) == (5, 3, 128)


def test_evicted_blocks_and_the_budget(model):
    """A budget of three blocks: requests evict others' blocks, find only what is left (a run of blocks
    ends at the first evicted one), and their tokens are still those of no cache."""
    s = _sampling(max_new_tokens=16)
    probe = Engine(model, max_batch=1, max_length=256, prefix_cache_bytes=1 << 24)
    probe.generate([BASE], s, seeds=[0])
    budget = 3 * _block_bytes(probe)
    engine = Engine(model, max_batch=2, max_length=256, prefix_cache_bytes=budget)
    plain = Engine(model, max_batch=2, max_length=256)
    prompts = [BASE, [4] + BASE, BASE[:20] + [3] * 30, BASE, [4] + BASE[:33]]
    got = engine.generate(prompts, s, seeds=list(range(5)))
    want = plain.generate(prompts, s, seeds=list(range(5)))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    stats = engine.prefix_cache.stats
    assert stats.evictions > 0 and stats.bytes <= budget and stats.blocks <= 3
    assert stats.bytes == sum(b.nbytes for b in engine.prefix_cache.blocks.values())
    # the first two fill 4 blocks: BASE's first goes. The third shares that block's tokens (encoded again)
    # and fills the cache with its own 3; BASE again finds its first block there, its second evicted
    assert [r.cached_tokens for r in got] == [0, 0, 0, 16, 0]


def test_memory_stays_within_the_budget(model):
    """Many requests with different prompts: the blocks held never pass the budget, and rows leave
    nothing behind (without eviction the blocks of 60 prompts would be 20 times the budget)."""
    s = _sampling(max_new_tokens=16, max_denoising_steps=1)
    engine = Engine(model, max_batch=4, max_length=256, prefix_cache_bytes=1 << 24)
    engine.generate([BASE], s, seeds=[0])
    budget = 6 * _block_bytes(engine)
    engine = Engine(model, max_batch=4, max_length=256, prefix_cache_bytes=budget)
    held = []
    for i in range(6):
        prompts = [[(i * 10 + j) % 120 + 2] + BASE[:39] for j in range(10)]
        engine.generate(prompts, s, seeds=list(range(10)))
        held.append(engine.prefix_cache.stats.bytes)
    stats = engine.prefix_cache.stats
    assert stats.inserted == 120 and max(held) <= budget and stats.evictions == 120 - stats.blocks
    assert not engine.runner.trails


def test_auto_takes_the_commands_budget_and_the_default_keeps_none(model, monkeypatch):
    """Engine(prefix_cache_bytes="auto") takes what `dgemma serve`, `chat` and `generate` take without
    --prefix-cache-gib: a quarter of the memory free on the model's device, at most 16 GiB; 0, the default,
    keeps no cache."""
    from dgemma import devices

    free = {"bytes": 3 << 30}
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: free["bytes"])
    assert Engine(model, max_batch=1, max_length=64, prefix_cache_bytes="auto").prefix_cache.budget_bytes == 3 << 28
    free["bytes"] = 100 << 30
    assert Engine(model, max_batch=1, max_length=64, prefix_cache_bytes="auto").prefix_cache.budget_bytes == 16 << 30
    assert Engine(model, max_batch=1, max_length=64).prefix_cache is None


def test_rewinding_a_row_restores_its_ring_and_length(model):
    """The cache undoes a partial span: after `save_overwritten`, an encode and `rewind`, the row's ring
    slots (wrapped: 10 tokens in 7 slots, then 5 more), positions and length are as before, bit for bit."""
    cache = model.new_cache(2, 64)
    with torch.no_grad():
        model.encode(torch.tensor([BASE[:10]] * 2), cache)
        before = [t.clone() for t in cache.keys + cache.values if t is not None]
        positions = {s: p.clone() for s, p in cache.slot_pos.items()}
        saved = cache.save_overwritten(1, 5)
        model.encode(torch.tensor([BASE[10:15]]), cache, rows=[1])
        assert cache.row_lengths == [10, 15]
        cache.rewind(1, saved)
    assert cache.row_lengths == [10, 10]
    assert all(torch.equal(cache.slot_pos[s], positions[s]) for s in positions)
    after = [t for t in cache.keys + cache.values if t is not None]
    for i, (a, b) in enumerate(zip(before, after)):
        sliding = b.shape[2] == cache.canvas_slots + cache.capacity[True]
        if sliding:  # full layers keep what the encode wrote past the length, invisible (position -1)
            assert torch.equal(a, b), i


def test_deterministic_mode_gives_the_same_floats_whatever_was_cached():
    """Deterministic mode (aligned spans): a follow-up turn after a first turn whose answer went into the
    prefix cache, on a fresh engine, and after the cache lost its last block, sees the same entropies at
    every draft (as floats, bit for bit) and gives the same tokens. Spans are a canvas (32 tokens here),
    blocks 16: the cache gives whole spans only, and the first turn's partial last span is read again.
    (Without the mode, on this CPU, the cached run's entropies differ from the fresh run's in the 7th
    digit.)"""
    torch.manual_seed(1)
    model = perturb_every_tensor(dgemma.DiffusionGemma(dgemma.get_preset("tiny").replace(canvas_length=32)).eval())
    s = _sampling(max_new_tokens=64)

    def engine(cache_bytes=0):
        return Engine(model, max_batch=1, max_length=256, prefix_cache_bytes=cache_bytes, deterministic=True)

    def first_turn(engine):
        turn1 = Request(prompt=BASE, sampling=s, seed=0, cache_answer=True)
        engine.submit(turn1)
        engine.run_until_done([turn1])
        return turn1.tokens

    def drafts(engine):
        seen = []
        r = Request(prompt=follow, sampling=s, seed=1, want_drafts=True,
                    on_event=lambda e: seen.append(e.entropy) if e.kind == "draft" else None)
        engine.submit(r)
        engine.run_until_done([r])
        return r, seen

    cached, evicting = engine(1 << 24), engine(1 << 24)
    follow = BASE + first_turn(cached) + [5, 9, 11]  # 40 + 64 + 3 tokens: spans end at 32, 64 and 96
    assert first_turn(evicting) == follow[40:-3]
    evicting.prefix_cache.blocks.popitem(last=True)  # the chain's last block: 80 tokens left, 64 in whole spans
    runs = {"cached": drafts(cached), "fresh": drafts(engine()), "evicted": drafts(evicting)}
    assert [runs[k][0].cached_tokens for k in runs] == [96, 0, 64]
    reference_tokens, reference_drafts = runs["fresh"][0].tokens, runs["fresh"][1]
    assert len(reference_drafts) == 2 * s.max_denoising_steps
    for name, (r, seen) in runs.items():
        assert r.tokens == reference_tokens and seen == reference_drafts, name


def test_deterministic_mode_gives_the_same_floats_whatever_else_runs(model):
    """Deterministic mode: a request's drafts (entropies as floats, bit for bit) and tokens alone, beside a
    longer and a shorter request submitted with it, and joining two that are already denoising. (Without
    the mode, a shared decoder forward pads every row's keys to the longest row's and routes every row's
    tokens together, which moves a row's rounding.)"""
    s = _sampling(max_new_tokens=48)
    target = BASE[:30]

    def drafts(companions, head_start: int = 0):
        engine = Engine(model, max_batch=3, max_length=256, deterministic=True)
        seen = []
        others = [engine.submit(Request(prompt=p, sampling=s, seed=7 + i)) for i, p in enumerate(companions)]
        for _ in range(head_start):
            engine.step()
        r = engine.submit(Request(prompt=target, sampling=s, seed=1, want_drafts=True,
                                  on_event=lambda e: seen.append(e.entropy) if e.kind == "draft" else None))
        engine.run_until_done([r, *others])
        return r.tokens, seen

    alone = drafts([])
    assert len(alone[1]) == 3 * s.max_denoising_steps
    assert drafts([BASE + BASE[:50], [5, 6, 7]]) == alone
    assert drafts([BASE + BASE[:50], [5, 6, 7]], head_start=3) == alone


def _rss_run(budget: int) -> dict:
    child = Path(__file__).with_name("prefix_cache_rss_check.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(child), str(budget)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_resident_memory_over_1000_requests_stays_within_the_budget_plus_slack():
    """1,000 requests with different 256-token prompts (tests/prefix_cache_rss_check.py, a fresh process):
    with an 8 MiB budget the process's resident memory grows by at most the budget plus a fixed slack after
    the first 50; the same run with the bound lifted (a 1 TiB budget) grows past that, so the check is one
    the cache's eviction passes, not one any run would."""
    budget, slack = 8 << 20, 48 << 20
    bounded = _rss_run(budget)
    assert bounded["held_bytes"] <= budget and bounded["rows_left"] == 0
    assert bounded["evictions"] > 0 and bounded["inserted_bytes"] > 4 * (budget + slack)
    assert bounded["peak_rss"] - bounded["start_rss"] <= budget + slack, bounded
    unbounded = _rss_run(1 << 40)
    assert unbounded["evictions"] == 0
    assert unbounded["peak_rss"] - unbounded["start_rss"] > budget + slack, unbounded


def test_scoring_reads_cached_prefixes(model):
    base = BASE + BASE[:10]
    prompts = [base + [5, 6, 7], base + [8, 9]]
    plain = Engine(model, max_batch=2, max_length=256).score(prompts, top=3)
    engine = Engine(model, max_batch=2, max_length=256, prefix_cache_bytes=1 << 24)
    engine.score([base + [1]], top=1)
    got = engine.score(prompts, top=3)
    assert [r.cached_tokens for r in got] == [48, 48]
    for a, b in zip(got, plain):
        torch.testing.assert_close(a.scores.token_logprobs, b.scores.token_logprobs, rtol=0, atol=1e-5)
        assert torch.equal(a.scores.top_ids, b.scores.top_ids)
    # a generating request then finds what scoring left
    r = engine.generate([base], _sampling(max_new_tokens=16), seeds=[0])[0]
    assert r.cached_tokens == 48


def test_chunked_prefill_lets_running_requests_step(model):
    """A long prompt read 8 tokens a step: the running request takes a denoising step after every chunk,
    the long prompt's canvas joins it in the iteration after its last chunk, and both answers are those
    of prompts encoded whole."""
    s = _sampling(max_new_tokens=48, max_denoising_steps=4, fixed_steps=True)
    engine = Engine(model, max_batch=2, max_length=256, prefill_chunk=8)
    log = []
    prefill, denoise = engine.runner.prefill, engine.runner.denoise
    engine.runner.prefill = lambda row, ids, images=None: (log.append(("chunk", row, len(ids))),
                                                           prefill(row, ids, images))[1]
    engine.runner.denoise = lambda rows, *a: (log.append(("step", tuple(rows))), denoise(rows, *a))[1]
    running = engine.submit(Request(prompt=BASE[:5], sampling=s, seed=0))
    engine.step()
    long = engine.submit(Request(prompt=BASE + BASE, sampling=s, seed=1))
    engine.run_until_done([running, long])
    chunks = [i for i, e in enumerate(log) if e[0] == "chunk" and e[1] == 1]  # the long prompt's row
    assert len(chunks) == 10 and all(log[i + 1] == ("step", (0,)) for i in chunks)
    assert log[chunks[-1] + 2] == ("step", (0, 1))  # its canvas starts after the step beside its last chunk
    whole = Engine(model, max_batch=2, max_length=256, prefill_chunk=1000)
    assert [r.tokens for r in whole.generate([BASE[:5], BASE + BASE], s, seeds=[0, 1])] == [running.tokens,
                                                                                         long.tokens]


def test_prefill_pace_sizes_chunks_to_a_step():
    """The engine's chunk beside running requests: one canvas until a step is timed, then as many tokens
    as one usual step takes at the last chunk's rate (rounded to 16), growing at most twice over."""
    pace = PrefillPace(canvas_length=256)
    assert pace.chunk_tokens == 256
    pace.observe(256, 5.0)  # no step timed yet: nothing to compare a chunk with
    assert pace.chunk_tokens == 256
    pace.observe(0, 1.0)
    pace.observe(256, 3.0)  # 2 s for 256 tokens: a 1 s step holds 128
    assert pace.chunk_tokens == 128
    pace.observe(128, 1.125)  # now 1/1024 s a token: 1,024 would fit, the chunk doubles
    assert pace.chunk_tokens == 256
    pace.observe(0, 2.0)  # steps slow down (a running average): 0.7 * 1 + 0.3 * 2
    assert pace.step_seconds == pytest.approx(1.3)
    pace.observe(256, 101.3)  # a very slow chunk: never below 16 tokens
    assert pace.chunk_tokens == 16


@pytest.mark.parametrize("deterministic", [False, True])
def test_chat_turns_encode_only_what_they_add(tiny_model_dir, tmp_path, monkeypatch, capsys, deterministic):
    """`dgemma chat`'s second and third turns start from the previous prompt and answer: the prefix cache
    gives all of it but the last partial block (a span is a block here: the canvas is 16 tokens), and the
    prompt holds the answer as the model wrote it; with --deterministic as without."""
    import io
    import json
    import shutil

    folder = tmp_path / "model"  # the tiny chat template, with the model's turns named as Gemma's are
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "{{ m['role'] }}", "{{ 'model' if m['role'] == 'assistant' else m['role'] }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    from dgemma.cli import main
    from dgemma.engine import engine as engine_module

    seen = []
    submit = engine_module.Engine.submit
    modes = set()
    monkeypatch.setattr(engine_module.Engine, "submit",
                        lambda self, r: (seen.append(r), modes.add(self.deterministic), submit(self, r))[2])
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\nhow are you\nthe day\n"))
    assert main(["chat", "--model", str(folder), "--max-new-tokens", "16", "--steps", "2", "--seed", "0",
                 "--prefix-cache-gib", "0.01", *(["--deterministic"] if deterministic else [])]) == 0
    capsys.readouterr()
    assert len(seen) == 3 and modes == {deterministic}
    for before, after in itertools.pairwise(seen):
        kept = before.prompt + before.tokens
        assert after.prompt[: len(kept)] == kept
        assert after.cached_tokens == len(kept) // 16 * 16 > 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_server_reports_cached_tokens_and_answers_alike(tiny_model_dir, deterministic):
    """16 clients at once, sharing a long system prompt, twice over: the same text per seed whether the
    prefix came from the cache or not, no 5xx, cached_tokens in usage, the counters on /health; scoring
    gives the same log-probabilities from the cache. With --deterministic scoring reads the cache but
    adds nothing to it (its calls are not aligned spans), so a prompt scored twice is read twice."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import WORDS
    from tests.test_server import MODEL, ServerProcess

    system = " ".join(WORDS[i % 40] for i in range(60))
    server = ServerProcess(tiny_model_dir, "--max-batch", "4", "--max-queue", "32", "--prefix-cache-gib", "0.01",
                           *(["--deterministic"] if deterministic else []))
    try:
        client = server.client()

        def ask(seed):
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": system},
                                       {"role": "user", "content": WORDS[seed % 50]}],
                max_tokens=16, seed=seed, extra_body={"steps": 2})
            return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens

        with ThreadPoolExecutor(16) as pool:
            first = list(pool.map(ask, range(16)))
            second = list(pool.map(ask, range(16)))
        assert [text for text, _ in first] == [text for text, _ in second]
        assert all(cached >= 48 for _, cached in second)
        stats = server.health()["prefix_cache"]
        assert stats["hits"] >= 16 and stats["blocks"] > 0 and stats["bytes"] <= stats["budget_bytes"]

        def score():
            return client.completions.create(model=MODEL, prompt=system + " the end", echo=True, logprobs=2,
                                              max_tokens=0)
        cold, warm = score(), score()
        if deterministic:
            assert warm.usage.prompt_tokens_details.cached_tokens == 0
            return
        assert warm.usage.prompt_tokens_details.cached_tokens >= 48
        assert warm.choices[0].logprobs.token_logprobs == pytest.approx(cold.choices[0].logprobs.token_logprobs,
                                                                        abs=1e-5, nan_ok=True)
    finally:
        server.stop_cleanly()
