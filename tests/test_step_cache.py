"""The step cache (dgemma.generation.step_cache, DiffusionGemma.decode_active): packed positions give what the
whole canvas gives, settled positions keep their keys/values, and the settle rule."""

from __future__ import annotations

import pytest
import torch

import dgemma
from dgemma.model.network import PreviousStep
from dgemma.model.packing import PackedPositions
from tests.conftest import perturb_every_tensor


def _model():
    torch.manual_seed(0)
    return perturb_every_tensor(dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval())


def _setup(model, prompt_lengths=(5, 9, 7)):
    """A cache with prompts of these lengths encoded (left-padded), a random canvas and a previous step."""
    g = torch.Generator().manual_seed(1)
    V, L = model.config.vocab_size, model.config.canvas_length
    longest = max(prompt_lengths)
    ids = torch.randint(1, V, (len(prompt_lengths), longest), generator=g)
    mask = torch.arange(longest)[None] >= longest - torch.tensor(prompt_lengths)[:, None]
    cache = model.new_cache(len(prompt_lengths), longest + 2 * L)
    with torch.no_grad():
        model.encode(ids, cache, attention_mask=mask, return_logits=False)
    canvas = torch.randint(0, V, (len(prompt_lengths), L), generator=g)
    probs = torch.randn(len(prompt_lengths), L, V, generator=g).softmax(-1)
    return cache, canvas, PreviousStep(probs=probs)


@pytest.mark.parametrize("rows", [None, [0, 2], [1, 2]], ids=["all", "scattered rows (copies)", "consecutive (views)"])
def test_every_position_active_gives_the_whole_canvas_logits(rows):
    model = _model()
    cache, canvas, previous = _setup(model)
    if rows is not None:
        canvas, previous = canvas[rows], PreviousStep(probs=previous.probs[rows])
    n, L = canvas.shape
    with torch.no_grad():
        whole = model.denoise(canvas, cache, self_conditioning=previous, rows=rows)
        packed = model.decode_active(canvas, cache, PackedPositions.whole(n, L, canvas.device),
                                     self_conditioning=previous, rows=rows)
    torch.testing.assert_close(packed.view(n, L, -1), whole, rtol=1e-5, atol=1e-5)


def test_a_subset_on_an_unchanged_canvas_reads_the_settled_positions_entries():
    """After a whole step, recomputing only some positions (a different count per row: several buckets, one
    row with none) on the same input gives those positions' whole-canvas logits: the others' keys/values
    were kept in the canvas slots exactly as the whole step wrote them."""
    model = _model()
    cache, canvas, previous = _setup(model)
    n, L = canvas.shape
    with torch.no_grad():
        whole = model.decode_active(canvas, cache, PackedPositions.whole(n, L, canvas.device),
                                    self_conditioning=previous).view(n, L, -1)
        active = torch.zeros(n, L, dtype=torch.bool)
        active[0, [1, 4, 5]] = True
        active[2, ::2] = True  # row 1 has none
        pack = PackedPositions.from_mask(active)
        assert pack.counts == (3, 0, 8) and len(pack.buckets) == 2
        part = model.decode_active(canvas, cache, pack, self_conditioning=previous)
    torch.testing.assert_close(part, whole[active], rtol=1e-5, atol=1e-5)


def test_settled_positions_keys_are_not_recomputed():
    """Changing a settled position's token changes nothing the active positions see."""
    model = _model()
    cache, canvas, previous = _setup(model, (6,))
    L = canvas.shape[1]
    active = torch.zeros(1, L, dtype=torch.bool)
    active[0, :4] = True
    changed = canvas.clone()
    changed[0, 10] = (canvas[0, 10] + 1) % model.config.vocab_size
    with torch.no_grad():
        model.decode_active(canvas, cache, PackedPositions.whole(1, L, canvas.device), self_conditioning=previous)
        pack = PackedPositions.from_mask(active)
        a = model.decode_active(canvas, cache, pack, self_conditioning=previous)
        b = model.decode_active(changed, cache, pack, self_conditioning=previous)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_attention_read_is_attention_written_out():
    """`attention_read`: the output of `attention` (GQA, a mask) and, per key, the softmax weights summed over the
    heads and the valid queries."""
    from dgemma.model.attention import attention, attention_read

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8,
                                                                                                       generator=g)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    valid = torch.tensor([[True, True, False, True, True], [True] * 5])
    out, read = attention_read(q, k, v, mask, valid, chunk_elements=2 * 4 * 7 * 2)  # query blocks of 2
    torch.testing.assert_close(out, attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1) * valid[:, None, :, None]
    torch.testing.assert_close(read, weights.sum((1, 2)), rtol=1e-5, atol=1e-6)


def test_a_packed_step_reads_the_attention_on_the_canvas_after_the_first_layer():
    """decode_active's read (n, L): what the packed positions' queries put on each canvas slot in layers 1..,
    a share of every query's unit mass (the rest goes to the prefix); a row with no active position reads none."""
    model = _model()
    cache, canvas, previous = _setup(model)
    n, L = canvas.shape
    active = torch.zeros(n, L, dtype=torch.bool)
    active[0, :5] = True
    active[2] = True
    read = torch.zeros(n, L)
    with torch.no_grad():
        model.decode_active(canvas, cache, PackedPositions.whole(n, L, canvas.device), self_conditioning=previous)
        model.decode_active(canvas, cache, PackedPositions.from_mask(active), self_conditioning=previous, read=read)
    heads, layers = model.config.num_heads, model.config.num_layers - 1
    assert not read[1].any() and (read[[0, 2]] > 0).all()
    assert (read.sum(1)[[0, 2]] < active.sum(1)[[0, 2]] * heads * layers).all()  # the prefix takes the rest
    assert read.sum(1)[2] > read.sum(1)[0]  # more queries, more mass


def test_every_position_active_with_adapters_per_row_gives_the_whole_canvas_logits():
    """Served LoRA adapters with the step cache: each packed position takes its row's adapter (rows on the base
    model, adapter 1 and adapter 2 in one packed forward) and every position active gives `denoise`'s logits."""
    from dgemma.model.adapters import Adapter, install_adapters

    model = _model()
    g = torch.Generator().manual_seed(5)
    adapters = []
    for name in ("a", "b"):
        weights = {}
        for module in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "layers.2.self_attn.o_proj"):
            linear = model.get_submodule(module)
            weights[module] = (torch.randn(4, linear.in_features, generator=g) * 0.3,
                               torch.randn(linear.out_features, 4, generator=g) * 0.3)
        adapters.append(Adapter(name, 2.0, weights, None))
    rows = install_adapters(model, adapters)
    cache, canvas, previous = _setup(model)
    n, L = canvas.shape
    ids = torch.tensor([0, 1, 2])
    with torch.no_grad(), rows.set(ids):
        whole = model.denoise(canvas, cache, self_conditioning=previous)
        packed = model.decode_active(canvas, cache, PackedPositions.whole(n, L, canvas.device),
                                     self_conditioning=previous)
    torch.testing.assert_close(packed.view(n, L, -1), whole, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), rows.set(torch.zeros(3, dtype=torch.long)):
        base = model.denoise(canvas, cache, self_conditioning=previous)
    assert (base[1] - whole[1]).abs().max() > 1e-3  # the adapter changed row 1


@pytest.mark.parametrize("order", ["attention", "random", "oldest"])
def test_the_refresh_takes_as_many_settled_positions_as_hold_the_attention_share(order):
    """refresh_share 0.5: row 0's settled positions received 4, 3, 2 and 1 of its attention, so the smallest set
    holding half of it has 2 positions; "attention" takes those two, "oldest" the two computed longest ago,
    "random" two settled ones. A row with nothing settled refreshes nothing. The next step runs them."""
    from dgemma.generation.step_cache import StepCache

    cache = StepCache(_sampling(step_cache=True, refresh_share=0.5, refresh_order=order), 2, 6, 3, "cpu",
                      torch.Generator().manual_seed(0))
    cache.settled = torch.tensor([[True, True, True, True, False, False], [False] * 6])
    cache.read = torch.tensor([[4.0, 3.0, 2.0, 1.0, 9.0, 9.0], [1.0] * 6])
    cache.computed_at = torch.tensor([[3, 1, 2, 1, 4, 4], [0] * 6])
    refresh = cache._to_refresh()
    assert refresh.sum(1).tolist() == [2, 0] and not (refresh & ~cache.settled).any()
    if order == "attention":
        assert refresh[0].tolist() == [True, True, False, False, False, False]
    elif order == "oldest":
        assert refresh[0].tolist() == [False, True, False, True, False, False]
    cache.refreshing, cache.steps = refresh, 1
    assert cache.active(torch.zeros(2, dtype=torch.bool)).tolist() == (~cache.settled | refresh).tolist()


# -- the rule and the plain loop, on a model whose logits at a position depend only on its own token ---------------
class PositionwiseModel:
    """logits[b, j] = table[canvas[b, j]] + bias[j]: no position sees another, so keeping a position's logits
    while its token is unchanged is exact. Tokens >= V // 2 map strongly onto themselves (they settle); the
    rest are spread out (they keep changing). `rows_margin` scales each row (small: a row never stops)."""

    def __init__(self, canvas_length=12, vocab_size=24, rows_margin=(1.0,), seed=0):
        from types import SimpleNamespace

        g = torch.Generator().manual_seed(seed)
        V = vocab_size
        self.config = SimpleNamespace(canvas_length=canvas_length, vocab_size=V)
        self.device = torch.device("cpu")
        self.table = torch.randn(V, V, generator=g) * 2
        self.table[V // 2 :, V // 2 :] += torch.eye(V - V // 2) * 12
        self.bias = torch.randn(canvas_length, V, generator=g)
        self.rows_margin = rows_margin
        self.packs: list[list[int]] = []  # per forward: each row's count of positions run

    def new_cache(self, batch_size, max_length):
        return None

    def encode(self, input_ids, cache, attention_mask=None, **_):
        return None

    def _logits(self, canvas):
        margin = torch.tensor([self.rows_margin[b % len(self.rows_margin)] for b in range(canvas.shape[0])])
        return (self.table[canvas] + self.bias) * margin[:, None, None]

    def denoise(self, canvas_ids, cache, *, self_conditioning=None, rows=None):
        self.packs.append([canvas_ids.shape[1]] * canvas_ids.shape[0])  # a whole-canvas step
        return self._logits(canvas_ids)

    def soft_embedding_from_probs(self, probs):  # self-conditioning changes nothing here
        return probs.new_zeros(*probs.shape[:-1], 1)

    def decode_active(self, canvas_ids, cache, pack, *, self_conditioning=None, rows=None, read=None):
        self.packs.append(list(pack.counts))
        return self._logits(canvas_ids)[pack.row_of, pack.index]


def _sampling(**kw):
    base = dict(max_denoising_steps=12, max_new_tokens=24, eos_token_ids=(1,), pad_token_id=0, entropy_bound=2.0)
    return dgemma.SamplingConfig(**{**base, **kw})


def test_with_positionwise_logits_the_cache_changes_no_token_and_saves_positions():
    from dgemma.generation import generate

    prompts = [[5, 6], [7, 8, 9]]
    model = PositionwiseModel()
    # every position accepted at every step: no settled position is re-noised, so the cache is exact here
    exact = dict(entropy_bound=1e9)
    off = generate(PositionwiseModel(), prompts, _sampling(**exact), seed=3)
    on = generate(model, prompts, _sampling(step_cache=True, settle_probability=0.9, **exact), seed=3)
    assert on.tokens == off.tokens and on.steps_per_canvas == off.steps_per_canvas
    assert sum(on.decoder_positions) < sum(off.decoder_positions)
    # without the cache the plain loop runs every row's whole canvas at every step the batch takes
    assert off.decoder_positions[0] == off.decoder_positions[1] == 12 * sum(
        max(s[c] for s in off.steps_per_canvas if c < len(s)) for c in range(off.num_canvases))
    assert sum(on.decoder_positions) == sum(sum(c) for c in model.packs)


def test_a_stopped_row_is_not_computed():
    from dgemma.generation import generate

    model = PositionwiseModel(rows_margin=(2.0, 0.05))  # row 1 is never confident: it runs every step
    result = generate(model, [[5], [6]], _sampling(step_cache=True, max_new_tokens=12), seed=0)
    steps = result.steps_per_canvas
    assert steps[0][0] < steps[1][0] == 12
    assert all(counts[0] == 0 for counts in model.packs[steps[0][0]:])
    assert result.decoder_positions[1] == 12 * 12  # never settles: every position every step


def test_settle_rule():
    from dgemma.generation.step_cache import StepCache

    sampling = _sampling(step_cache=True, settle_steps=2, settle_probability=0.9)
    cache = StepCache(sampling, 1, 4, 3, "cpu")
    done = torch.zeros(1, dtype=torch.bool)
    assert cache.active(done).all()  # the first step computes everything
    cache.computed_with = torch.tensor([[0, 0, 0, 7]])
    cache.steps = 1
    sure = torch.tensor([0.95, 0.02, 0.03])
    probs = sure.expand(1, 4, 3).clone()
    probs[0, 2] = torch.tensor([0.5, 0.3, 0.2])  # position 2: stable but not sure enough
    argmax = torch.zeros(1, 4, dtype=torch.long)
    drawn = torch.tensor([[True, False, True, True]])  # position 1 is re-noised; 3 draws 0, computed with 7
    next_canvas = torch.tensor([[0, 9, 0, 0]])
    cache.settle(argmax, probs, drawn, next_canvas, done)
    assert not cache.settled.any()  # one step of the same argmax is not yet stable
    cache.settle(argmax, probs, drawn, next_canvas, done)
    assert cache.settled.tolist() == [[True, True, False, False]]  # 3 waits until computed with its sample
    assert cache.active(done).tolist() == [[False, False, True, True]]
    assert not cache.active(torch.ones(1, dtype=torch.bool)).any()  # a stopped row: nothing
    # position 1 is re-noised again: it stays settled; position 0 draws another token than the one it was
    # computed with: it wakes
    cache.settle(argmax, probs, drawn, torch.tensor([[2, 5, 0, 0]]), done)
    assert cache.settled.tolist() == [[False, True, False, False]]
    cache.refresh, cache.steps = 4, 4
    assert cache.active(done).all()  # a refresh step computes everything


def test_the_sampler_may_overwrite_a_steps_logits_without_touching_the_kept_ones():
    """A whole step hands the sampler the forward's own logits, a partial step a copy of the kept ones: either
    way what the sampler writes there is not what the next step keeps."""
    from dgemma.generation.step_cache import StepCache

    cache = StepCache(_sampling(step_cache=True), 2, 4, 3, "cpu")
    canvas = torch.zeros(2, 4, dtype=torch.long)
    whole = torch.ones(2, 4, dtype=torch.bool)
    computed = torch.randn(8, 3)
    step = cache.record(computed.clone(), whole.nonzero()[:, 1], [4, 4], canvas, whole)
    assert torch.equal(step, computed.view(2, 4, 3)) and torch.equal(cache.logits, step)
    step.fill_(-1.0)  # the sampler tempers, masks, overwrites
    assert torch.equal(cache.logits, computed.view(2, 4, 3))
    some = torch.tensor([[True, False, False, True], [False, True, False, False]])
    fresh = torch.randn(3, 3)
    step = cache.record(fresh.clone(), some.nonzero()[:, 1], [2, 1], canvas, some)
    expected = computed.view(2, 4, 3).clone()
    expected[some] = fresh
    assert torch.equal(step, expected)
    step.fill_(-1.0)
    assert torch.equal(cache.logits, expected)
    assert cache.decoder_positions == [6, 5]


def test_generation_config_keeps_the_step_cache_in_its_dgemma_section(tmp_path):
    import json

    assert "dgemma" not in dgemma.SamplingConfig().to_hf_dict()  # off: the file stays as it was
    on = dgemma.SamplingConfig(step_cache=True, settle_steps=3, settle_probability=0.95, cache_refresh=4,
                               refresh_share=0.2, refresh_order="random", settle_on="model")
    written = on.to_hf_dict()
    assert written["dgemma"] == dict(step_cache=True, settle_steps=3, settle_probability=0.95, settle_on="model",
                                     cache_refresh=4, refresh_share=0.2, refresh_order="random")
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny"), on)
    dgemma.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["dgemma"] == written["dgemma"]
    loaded = dgemma.load_model(tmp_path).sampling_config
    assert (loaded.step_cache, loaded.settle_steps, loaded.settle_probability, loaded.cache_refresh,
            loaded.refresh_share, loaded.refresh_order, loaded.settle_on) == (True, 3, 0.95, 4, 0.2, "random", "model")
    with pytest.raises(dgemma.ConfigError, match="settle_probability"):
        dgemma.SamplingConfig(settle_probability=1.5)
    with pytest.raises(dgemma.ConfigError, match="refresh_order"):
        dgemma.SamplingConfig(refresh_order="newest")
    # what training wrote in the section stays through a save; the step cache's keys follow the sampler's settings
    note = {"cache_aware_training": {"probability": 0.5, "settle": 0.9}}
    model.hf_generation_config = {"dgemma": {**written["dgemma"], **note}}
    model.sampling_config = dgemma.SamplingConfig()  # the cache off again: its keys go, the note stays
    dgemma.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["dgemma"] == note


def test_the_flags_reach_the_sampling_config_and_ar_is_refused(capsys, tmp_path):
    import argparse

    from dgemma.cli import main
    from dgemma.commands._common import add_sampling_arguments, step_cache_overrides

    p = argparse.ArgumentParser()
    add_sampling_arguments(p)
    args = p.parse_args(["--step-cache", "on", "--settle-steps", "3", "--settle-probability", "0.9",
                         "--cache-refresh", "4", "--refresh-share", "0.1", "--refresh-order", "oldest",
                         "--settle-on", "model"])
    assert step_cache_overrides(args) == dict(step_cache=True, settle_steps=3, settle_probability=0.9, cache_refresh=4,
                                              refresh_share=0.1, refresh_order="oldest", settle_on="model")
    assert step_cache_overrides(p.parse_args([]))["step_cache"] is None  # the model's setting
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--ar", "--step-cache", "on"]) == 2
    assert "--step-cache works with the diffusion samplers, not with --ar" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--prompt", "x", "--settle-probability", "2"])
    assert e.value.code == 2 and "must be in [0, 1]" in capsys.readouterr().err


# -- the engine against the plain loop, with the cache on ----------------------------------------------------------
PUZZLES = [
    "530070000600195000098000060800060003400803001700020006060000280000419005000080079",
    "000260701680070090190004500820100040004602900050003028009300074040050036703018000",
    "100489006730000040000001295007120600500703008006095700914600000020000037800512004",
    "020810740700003100090002805009040087400208003160030200302700060005600008076051090",
]


@pytest.fixture(scope="module")
def sudoku_model():
    from dgemma.tasks.sudoku_models import SHIPPED

    return dgemma.load_model(SHIPPED)


def test_sudoku_engine_equals_the_plain_loop_with_the_cache_on(sudoku_model):
    """Rows with different numbers of active positions share each engine step (packed); every request's
    tokens, steps and decoder positions are the plain loop's, and fewer positions run than without the cache."""
    from dgemma.engine import Engine
    from dgemma.generation import generate
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import MAX_LENGTH, sudoku_sampling

    prompts = [sudoku.encode_prompt(sudoku.parse_puzzle(p)) for p in PUZZLES]
    on = sudoku_sampling(sudoku_model, 0, step_cache=True)
    plain = [generate(sudoku_model, [p], on, seed=7 + i) for i, p in enumerate(prompts)]
    engine = Engine(sudoku_model, max_batch=4, max_length=MAX_LENGTH)
    requests = engine.generate(prompts, on, seeds=[7 + i for i in range(len(prompts))])
    for p, r in zip(plain, requests):
        assert (r.tokens, r.steps_per_canvas) == (p.tokens[0], p.steps_per_canvas[0])
        assert r.stats()["decoder_positions"] == p.decoder_positions[0]
    off = engine.generate(prompts, on.replace(step_cache=False), seeds=[7 + i for i in range(len(prompts))])
    positions_off = [r.stats()["decoder_positions"] for r in off]
    assert positions_off == [81 * s for r in off for s in r.steps_per_canvas]
    assert sum(r.stats()["decoder_positions"] for r in requests) < 0.5 * sum(positions_off)
    assert engine.decoder_positions == sum(positions_off) + sum(r.stats()["decoder_positions"] for r in requests)


RULES = {
    "settle only": dict(),
    "periodic": dict(cache_refresh=3),
    "attention": dict(refresh_share=0.3),
    "random": dict(refresh_share=0.3, refresh_order="random"),
    "oldest": dict(refresh_share=0.3, refresh_order="oldest"),
    "settle on the model's probability": dict(settle_on="model"),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_engine_equals_the_plain_loop_for_every_rule(sudoku_model, rule):
    """Every refresh rule and settling reading on the sudoku model (whose probabilities are decisive, so float
    sums that differ in their last bits with a batch's shape settle the same positions): rows of different
    active counts share each engine step, and each request's tokens, steps and decoder positions are the plain
    loop's for its puzzle alone, with fewer positions run than whole canvases."""
    from dgemma.engine import Engine
    from dgemma.generation import generate
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import MAX_LENGTH, sudoku_sampling

    prompts = [sudoku.encode_prompt(sudoku.parse_puzzle(p)) for p in PUZZLES[:3]]
    on = sudoku_sampling(sudoku_model, 0, step_cache=True).replace(**RULES[rule])
    plain = [generate(sudoku_model, [p], on, seed=30 + i) for i, p in enumerate(prompts)]
    requests = Engine(sudoku_model, max_batch=3, max_length=MAX_LENGTH).generate(prompts, on, seeds=[30, 31, 32])
    for p, r in zip(plain, requests):
        assert (r.tokens, r.steps_per_canvas) == (p.tokens[0], p.steps_per_canvas[0])
        assert r.stats()["decoder_positions"] == p.decoder_positions[0]
    assert sum(r.stats()["decoder_positions"] for r in requests) < sum(
        r.stats()["whole_canvas_positions"] for r in requests)


def test_an_int8_model_with_the_prefix_cache_and_the_step_cache_gives_the_plain_loops_tokens():
    """int8 weights, the prefix cache (the second request reads its prompt's cached blocks) and rows of different
    active counts in one step: the engine's tokens are the plain loop's, with the step cache on."""
    from dgemma.engine import Engine
    from dgemma.generation import generate
    from dgemma.quant.quantize import quantize_model

    model = quantize_model(_model(), "int8")
    on = dgemma.SamplingConfig(max_new_tokens=32, eos_token_ids=(1,), max_denoising_steps=6, step_cache=True,
                               settle_steps=1, settle_probability=0.3)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [3, 4, 9]]
    plain = [generate(model, [p], on, seed=20 + i) for i, p in enumerate(prompts)]
    engine = Engine(model, max_batch=2, max_length=256, prefix_cache_bytes=1 << 24)
    engine.generate(prompts[:1], on, seeds=[99])  # fills the prefix cache
    requests = engine.generate(prompts, on, seeds=[20, 21])
    assert requests[0].cached_tokens > 0
    for p, r in zip(plain, requests):
        assert (r.tokens, r.steps_per_canvas) == (p.tokens[0], p.steps_per_canvas[0])
        assert r.stats()["decoder_positions"] == p.decoder_positions[0]
