"""The batched engine reproduces the plain loop token for token, request by request."""

from __future__ import annotations

import threading

import pytest
import torch

import dgemma
from dgemma.config import SamplingConfig
from dgemma.engine import Engine, QueueFull, Request
from dgemma.generation import CanvasTemplate, generate
from dgemma.model.network import PreviousStep


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()


def _sampling(**kw):
    # EOS id 1 for the equality tests; tests that count canvases use an id outside the vocabulary
    base = dict(max_new_tokens=40, eos_token_ids=(1,), max_denoising_steps=6)
    base.update(kw)
    return SamplingConfig(**base)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20] * 20, [9, 8, 7]]


@pytest.mark.parametrize("max_batch", [1, 2, 4])
def test_engine_equals_plain_loop_per_request(model, max_batch):
    s = _sampling()
    plain = [generate(model, [p], s, seed=100 + i) for i, p in enumerate(PROMPTS)]
    engine = Engine(model, max_batch=max_batch, max_length=256)
    requests = engine.generate(PROMPTS, s, seeds=[100 + i for i in range(len(PROMPTS))])
    for p, r in zip(plain, requests):
        assert r.tokens == p.tokens[0]
        assert r.finish_reason == p.finish_reasons[0]
        assert r.steps_per_canvas == p.steps_per_canvas[0]
        assert r.stats()["tokens_per_forward"] == pytest.approx(p.tokens_per_forward[0])
    assert not engine.active and len(engine.free_rows) == max_batch


@pytest.mark.parametrize("order", ["margin", "confidence"])
def test_engine_equals_plain_loop_in_each_accept_order(model, order):
    """Same tokens from both paths in the other acceptance orders, with a template's fixed positions too,
    and not the entropy order's tokens (the option reaches the sampler in both)."""
    s = _sampling(accept_order=order, entropy_bound=0.5)
    fixed = torch.zeros(20, dtype=torch.bool)
    fixed[::4] = True
    tokens = torch.arange(20) % 100 + 10
    templates = [(None, None), (fixed, tokens), (None, None)]
    plain = [generate(model, [p], s, seed=30 + i, canvas_template=None if t[0] is None else CanvasTemplate(
        t[0][None], t[1][None])) for i, (p, t) in enumerate(zip(PROMPTS, templates))]
    requests = Engine(model, max_batch=2).generate(PROMPTS[:3], s, seeds=[30, 31, 32], templates=templates)
    for p, r in zip(plain, requests):
        assert (r.tokens, r.steps_per_canvas) == (p.tokens[0], p.steps_per_canvas[0])
    by_entropy = [generate(model, [p], s.replace(accept_order="entropy"), seed=30 + i) for i, p in
                  enumerate(PROMPTS[:3])]
    assert [r.tokens for r in by_entropy] != [p.tokens[0] for p in plain]


def test_engine_canvas_template_and_fixed_steps(model):
    s = _sampling(fixed_steps=True, max_new_tokens=20)
    fixed = torch.zeros(20, dtype=torch.bool)
    fixed[::3] = True
    tokens = torch.arange(20) % 100 + 10
    plain = generate(model, [PROMPTS[0]], s, seed=7, canvas_template=CanvasTemplate(fixed[None], tokens[None]))
    r = Engine(model, max_batch=2).generate([PROMPTS[0]], s, seeds=[7], templates=[(fixed, tokens)])[0]
    assert r.tokens == plain.tokens[0]
    assert all(r.tokens[i] == int(tokens[i]) for i in range(0, 20, 3))
    assert r.steps_per_canvas == [6, 6]


def test_finished_rows_leave_the_batch(model):
    """A request that ends early stops costing forwards: the forward count is the longest request's."""
    engine = Engine(model, max_batch=4)
    short = _sampling(max_new_tokens=16, eos_token_ids=(999,))
    long_ = _sampling(max_new_tokens=48, eos_token_ids=(999,))
    rs = [Request(prompt=[5, 6], sampling=short, seed=1), Request(prompt=[7, 8], sampling=long_, seed=2)]
    for r in rs:
        engine.submit(r)
    seen_batch_sizes = []
    while engine.has_work():
        engine.step()
        seen_batch_sizes.append(len(engine.active))
    assert engine.forwards == 3 * 6  # three canvases of the long request; the short one rode along for one
    assert seen_batch_sizes[0] == 2 and seen_batch_sizes[-1] == 0 and 1 in seen_batch_sizes


def test_streaming_events_and_drafts(model):
    events = []
    r = Request(prompt=[5, 6], sampling=_sampling(max_new_tokens=32, eos_token_ids=(999,)), seed=3, want_drafts=True,
                on_event=events.append)
    engine = Engine(model, max_batch=2)
    engine.submit(r)
    engine.run_until_done([r])
    kinds = [e.kind for e in events]
    assert kinds.count("draft") == 12 and kinds.count("canvas") == 2 and kinds[-1] == "finished"
    assert sum((e.tokens for e in events if e.kind == "canvas"), []) == r.tokens
    draft = next(e for e in events if e.kind == "draft")
    assert len(draft.tokens) == len(draft.entropy) == len(draft.accepted) == 16


def test_cancel_and_queue_bound(model):
    engine = Engine(model, max_batch=1, max_queue=2)
    s = _sampling(max_new_tokens=64, eos_token_ids=(999,))
    a, b = Request(prompt=[5], sampling=s, seed=1), Request(prompt=[6], sampling=s, seed=2)
    engine.submit(a)
    engine.submit(b)
    with pytest.raises(QueueFull):
        engine.submit(Request(prompt=[7], sampling=s, seed=3))
    engine.step()  # a is admitted and denoising; b waits
    engine.cancel(a)
    engine.step()  # a leaves at once, b takes its row
    assert a.finish_reason == "cancelled" and a.state.row is None
    assert b.state.row == 0
    engine.run_until_done([b])
    assert b.finish_reason == "length" and len(b.tokens) == 64


def test_submit_from_another_thread(model):
    engine = Engine(model, max_batch=2)
    s = _sampling(max_new_tokens=16)
    requests = [Request(prompt=[5 + i], sampling=s, seed=i) for i in range(4)]
    submitter = threading.Thread(target=lambda: [engine.submit(r) for r in requests])
    submitter.start()
    submitter.join()
    engine.run_until_done(requests)
    assert all(r.finish_reason in ("stop", "length") for r in requests)


def test_request_too_long_is_refused(model):
    engine = Engine(model, max_batch=1, max_length=64)
    with pytest.raises(ValueError, match="needs 86 positions"):
        engine.submit(Request(prompt=[5] * 22, sampling=_sampling(max_new_tokens=64), seed=0))


def test_compiled_decoder_gives_the_same_tokens(model):
    """`compile_model` (torch.compile of the decoder and the encoder's layers, the routed experts'
    grid traced with an unbacked capacity) changes speed, not results: fp32 logits within rounding, and
    the same tokens as the eager plain loop across canvases, batch sizes and prefix lengths (each a
    recompile)."""
    import copy

    from torch._dynamo.utils import counters

    counters.clear()
    dynamo_before = torch._dynamo.config.get_config_copy()
    compiled = dgemma.compile_model(copy.deepcopy(model))
    cache_a, cache_b = model.new_cache(1, 64), compiled.new_cache(1, 64)
    prompt = torch.tensor([PROMPTS[0]])
    canvas = torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length))
    with torch.no_grad():
        model.encode(prompt, cache_a, return_logits=False)
        compiled.encode(prompt, cache_b, return_logits=False)
        torch.testing.assert_close(compiled.denoise(canvas, cache_b), model.denoise(canvas, cache_a),
                                   rtol=1e-4, atol=1e-4)
    s = _sampling()
    plain = [generate(model, [p], s, seed=100 + i) for i, p in enumerate(PROMPTS[:3])]
    engine = Engine(compiled, max_batch=2, max_length=256)
    engine.warm_up()  # what `dgemma serve --compile` does first: it leaves no trace in later requests
    assert not engine.active and sorted(engine.free_rows) == [0, 1] and engine.forwards == 0
    requests = engine.generate(PROMPTS[:3], s, seeds=[100, 101, 102])
    assert [r.tokens for r in requests] == [p.tokens[0] for p in plain]
    assert not counters["graph_break"]  # one graph per shape: the experts did not split it
    # ... with dynamo's capture_scalar_outputs set only while a compiled call runs: no setting left changed
    assert torch._dynamo.config.get_config_copy() == dynamo_before
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    for method in (dgemma.DiffusionGemma.decode_canvas, dgemma.DiffusionGemma.encode_tokens):  # both ran compiled
        assert _debug_get_cache_entry_list(method.__code__), method.__name__
    # decoder and encoder variants (static, then dynamic shapes) + the sampler scan: no recompile storm
    assert 0 < counters["stats"]["unique_graphs"] <= 14

    # On a CPU the compiled step reads q|k|v and gate|up as one fused copy of the weights; a weight changed in
    # place or replaced after compiling is what the next compiled call computes with
    assert all(f.weight is not None for f in compiled.compiled.fused)
    with torch.no_grad():
        for m in (model, compiled):
            m.layers[0].self_attn.v_proj.weight.mul_(1.5)
            m.self_conditioning.up_proj.weight.add_(0.01)
            m.layers[1].mlp.gate_proj.weight = torch.nn.Parameter(m.layers[1].mlp.gate_proj.weight * -1)
        cache_a, cache_b = model.new_cache(1, 64), compiled.new_cache(1, 64)
        model.encode(prompt, cache_a, return_logits=False)
        compiled.encode(prompt, cache_b, return_logits=False)
        soft = torch.randn(1, model.config.canvas_length, model.config.hidden_size)
        previous = PreviousStep(embedding=soft)
        torch.testing.assert_close(compiled.denoise(canvas, cache_b, self_conditioning=previous),
                                   model.denoise(canvas, cache_a, self_conditioning=previous), rtol=1e-4, atol=1e-4)


def test_compiled_quantised_decoder_gives_the_same_tokens(model):
    """Quantised experts dequantise expert by expert, so under compile they run as the opaque custom op
    instead of the traced grid: the same tokens as the eager quantised engine."""
    import copy

    from dgemma.quant.quantize import quantize_model

    quantised = copy.deepcopy(model)
    quantize_model(quantised, "int8")
    s = _sampling()
    eager = Engine(quantised, max_batch=1, max_length=64).generate(PROMPTS[:1], s, seeds=[7])
    compiled = Engine(dgemma.compile_model(copy.deepcopy(quantised)), max_batch=1, max_length=64)
    assert compiled.generate(PROMPTS[:1], s, seeds=[7])[0].tokens == eager[0].tokens
