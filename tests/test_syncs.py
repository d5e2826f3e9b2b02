"""Host-device syncs on the generation path: the engine reads the device once per denoising step.

On CPU nothing waits, so the CPU tests count what would wait on a GPU: every Python value read from a
tensor (`item`, `tolist`, `bool`, `int`, `float`, `nonzero`) and every `torch.tensor(..., device=...)`
is flagged unless it goes through `dgemma.device_sync.host_read` (counted by reason) or `to_device`.
The routed experts are left out of the CPU count: on CPU they choose between their grid and their loop
from the routing counts (`Experts.route`); their CUDA bf16 path (grouped matmul) reads nothing, which
the CUDA test checks with `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import threading

import pytest
import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.device_sync import count_host_reads, host_read, reading, to_device
from dgemma.engine import Engine
from dgemma.generation import generate
from dgemma.model.experts import Experts

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20] * 20]
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()


class UndeclaredReads:
    """Patches torch so that reads of tensor values outside host_read (and outside the experts' routing)
    are recorded, with the method's name."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self.local = threading.local()
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._flagging(getattr(torch.Tensor, name), name))
        monkeypatch.setattr(torch, "nonzero", self._flagging(torch.nonzero, "torch.nonzero"))
        tensor = torch.tensor

        def flagged_tensor(*args, **kwargs):
            if kwargs.get("device") is not None:  # a blocking copy from the host on a GPU
                self._flag("torch.tensor(device=)")
            return tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", flagged_tensor)
        route = Experts.route

        def route_exempt(module, *args, **kwargs):
            self.local.experts = True
            try:
                return route(module, *args, **kwargs)
            finally:
                self.local.experts = False

        monkeypatch.setattr(Experts, "route", route_exempt)

    def _flag(self, name: str):
        if not reading() and not getattr(self.local, "experts", False):
            self.calls.append(name)

    def _flagging(self, method, name: str):
        def flagged(*args, **kwargs):
            self._flag(name)
            return method(*args, **kwargs)

        return flagged


def _sampling(**kw):
    base = dict(max_new_tokens=40, eos_token_ids=(1,), max_denoising_steps=6)
    return SamplingConfig(**{**base, **kw})


def _run_counting(engine, prompts, sampling, monkeypatch):
    """Submit the prompts, then step until done: per step (undeclared reads, host_read counts)."""
    requests = [engine.submit(dgemma.engine.Request(prompt=p, sampling=sampling, seed=100 + i))
                for i, p in enumerate(prompts)]
    watch = UndeclaredReads(monkeypatch)
    per_step = []
    while not all(r.done for r in requests):
        before = len(watch.calls)
        with count_host_reads() as reads:
            engine.step()
        per_step.append((watch.calls[before:], dict(reads)))
    monkeypatch.undo()
    return requests, per_step


@pytest.mark.parametrize("fixed_steps", [False, True])
def test_an_engine_step_reads_the_device_once(model, monkeypatch, fixed_steps):
    """Admission, denoising, stopping, committing, finishing, rows at different lengths: every step
    reads the device exactly once, and the tokens are those of each request run alone."""
    s = _sampling(fixed_steps=fixed_steps)
    engine = Engine(model, max_batch=2, max_length=256)  # 3 requests, 2 rows: one waits, then takes a freed row
    requests, per_step = _run_counting(engine, PROMPTS, s, monkeypatch)
    assert [undeclared for undeclared, _ in per_step] == [[]] * len(per_step)
    assert [reads for _, reads in per_step] == [{"step": 1}] * len(per_step)
    assert len(per_step) == engine.forwards > 6
    for i, (p, r) in enumerate(zip(PROMPTS, requests)):
        alone = generate(model, [p], s, seed=100 + i)
        assert r.tokens == alone.tokens[0] and r.steps_per_canvas == alone.steps_per_canvas[0]


def test_drafts_and_constraints_read_more_and_say_so(model, monkeypatch):
    """Streaming drafts costs two declared reads per step; nothing is read undeclared."""
    engine = Engine(model, max_batch=2, max_length=256)
    request = dgemma.engine.Request(prompt=[3, 4], sampling=_sampling(max_new_tokens=16), seed=1, want_drafts=True)
    engine.submit(request)
    watch = UndeclaredReads(monkeypatch)
    with count_host_reads() as reads:
        engine.run_until_done([request])
    assert watch.calls == []
    assert reads == {"step": engine.forwards, "drafts": 2 * engine.forwards}


def test_plain_loop_reads_once_per_step_and_once_per_canvas(model, monkeypatch):
    s = _sampling()
    watch = UndeclaredReads(monkeypatch)
    with count_host_reads() as reads:
        result = generate(model, [[5, 6, 7], [8, 9, 10]], s, seed=3)
    monkeypatch.undo()
    assert watch.calls == []
    steps = max(sum(row) for row in result.steps_per_canvas)
    assert reads == {"step": steps, "canvas": result.num_canvases, "result": 1}


def test_host_read_counts_by_reason_and_nests():
    t = torch.arange(3)
    with count_host_reads() as outer:
        assert host_read(t, "a") == [0, 1, 2]
        with count_host_reads() as inner:
            host_read(t, "b")
        assert inner == {"b": 1}
    assert outer == {"a": 1, "b": 1}
    assert to_device([[1, 2]], torch.long, "cpu").tolist() == [[1, 2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_steps_wait_only_in_host_read(monkeypatch):
    """On a GPU, in bf16 (the experts' grouped path): with torch's sync debug mode set to "error",
    any operation that waits for the device outside `host_read` raises."""
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).to("cuda", torch.bfloat16).eval()
    engine = Engine(model, max_batch=2, max_length=256)
    s = _sampling()
    engine.generate([[5, 6]], s, seeds=[0])  # warm-up: lazy CUDA initialisation waits once
    requests = [dgemma.engine.Request(prompt=p, sampling=s, seed=i) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.submit(r)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with count_host_reads() as reads:
            engine.run_until_done(requests)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads == {"step": engine.forwards - 1}


def test_cache_decides_on_the_host_what_the_decoder_mask_says(model):
    """`KVCache.prefix_visible` (host) agrees with the decoder mask's own `all()` (device) for rows of
    many lengths, sliding rings wrapped or not (window 8), rows reset and refilled, any row subset."""
    from dgemma.model.attention import canvas_mask

    config = model.config
    cache = model.new_cache(4, 64)
    gen = torch.Generator().manual_seed(0)
    checked = {True: 0, False: 0}
    for _ in range(12):
        rows = sorted(set(torch.randint(0, 4, (3,), generator=gen).tolist()))
        T = int(torch.randint(1, 9, (), generator=gen))
        if max(cache.row_lengths[r] for r in rows) + T > 48:
            cache.reset_rows(rows)
        lengths = torch.tensor([cache.row_lengths[r] for r in rows])
        positions = lengths[:, None] + torch.arange(T)
        cache.commit_positions(rows, positions, torch.ones_like(positions, dtype=torch.bool), padded=False)
        for subset in (rows, [0, 1, 2, 3], [1, 3], [2]):
            for sliding in (False, True):
                window = config.sliding_window if sliding else None
                mask = canvas_mask(cache.cached_positions(sliding, subset), cache.lengths(subset),
                                   config.canvas_length, window)
                assert cache.prefix_visible(sliding, subset) == bool(mask.all())
                checked[bool(mask.all())] += 1
    assert min(checked.values()) > 5  # both answers came up
    cache.commit_positions([0], torch.tensor([[cache.row_lengths[0]]]), torch.tensor([[False]]))
    assert cache.prefix_visible(False, [0]) is None  # padding: the host cannot tell


def test_sampler_halves_equal_the_whole_step():
    """scan_step + draw_samples with the drawn count read beforehand (nonzero_static) = the step that
    finds the drawn positions itself (nonzero)."""
    from dgemma.sampling.sampler import draw_samples, scan_step
    from tests.conftest import sampler_step

    logits = torch.randn(2, 16, 50, generator=torch.Generator().manual_seed(0)) * 3
    fixed = torch.zeros(2, 16, dtype=torch.bool)
    fixed[0, :3] = True
    tokens = torch.full((2, 16), 7)
    whole = sampler_step(logits.clone(), 0.7, 1.0, torch.Generator().manual_seed(1), fixed=fixed, fixed_tokens=tokens,
                         chunk_elements=200)
    scanned = scan_step(logits.clone(), 0.7, 1.0, torch.Generator().manual_seed(1), fixed=fixed, fixed_tokens=tokens,
                        chunk_elements=200)
    halves = draw_samples(scanned, int(scanned.drawn.sum()), chunk_elements=200)
    assert 0 < int(scanned.drawn.sum()) < 32
    for name in ("canvas", "argmax", "entropy", "accepted"):
        assert torch.equal(getattr(whole, name), getattr(halves, name)), name


def test_an_engine_step_with_the_step_cache_reads_its_active_counts_once_more(model, monkeypatch):
    """With the step cache on (settling, the attention-targeted refresh): every step reads the device twice,
    the step's read and the rows' active counts (how many positions each row runs, and which
    positions the packed forward runs: `nonzero_static`); nothing is read undeclared, and the tokens are those of
    each request run alone."""
    s = _sampling(step_cache=True, settle_steps=1, settle_probability=0.0, refresh_share=0.3)  # a random model: no bar
    engine = Engine(model, max_batch=2, max_length=256)
    requests, per_step = _run_counting(engine, PROMPTS, s, monkeypatch)
    assert [undeclared for undeclared, _ in per_step] == [[]] * len(per_step)
    assert [reads for _, reads in per_step] == [{"step": 1, "step cache: active positions": 1}] * len(per_step)
    positions = [r.stats()["decoder_positions"] for r in requests]
    assert sum(positions) < sum(r.stats()["whole_canvas_positions"] for r in requests)  # some settled
    for i, (p, r) in enumerate(zip(PROMPTS, requests)):
        alone = generate(model, [p], s, seed=100 + i)
        assert r.tokens == alone.tokens[0] and r.steps_per_canvas == alone.steps_per_canvas[0]
        assert r.stats()["decoder_positions"] == alone.decoder_positions[0]
