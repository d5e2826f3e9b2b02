"""Logit parity with transformers 5.23 (fp32, max abs diff <= 1e-4) for encode and denoise."""

from __future__ import annotations

import pytest
import torch

import dgemma
from dgemma.model.layers import RMSNorm
from dgemma.model.network import PreviousStep
from tests.conftest import TINY_TEXT_CONFIGS, hf_config, unperturbed_tensors

TOL = 1e-4


def softcap(x, cap=30.0):
    return torch.tanh(x.float() / cap) * cap


def hf_encode(hf, ids, cache, attention_mask=None):
    out = hf.model.encoder(input_ids=ids, past_key_values=cache, attention_mask=attention_mask)
    return softcap(hf.lm_head(out.last_hidden_state))


@pytest.mark.parametrize("name", list(TINY_TEXT_CONFIGS))
def test_reference_models_have_every_tensor_perturbed(hf_checkpoints, name):
    """The oracle's parameters and persistent buffers all differ from a default initialisation, and the
    two stacks' layer scalars differ from each other, so no loading mistake can hide behind a 1."""
    from transformers import DiffusionGemmaForBlockDiffusion

    _, hf = hf_checkpoints[name]
    torch.manual_seed(0)
    fresh = DiffusionGemmaForBlockDiffusion(hf_config(name)).eval()
    assert unperturbed_tensors(hf, fresh) == []
    for enc, dec in zip(hf.model.encoder.language_model.layers, hf.model.decoder.layers):
        assert not torch.equal(enc.layer_scalar, dec.layer_scalar)


@pytest.mark.parametrize("name", list(TINY_TEXT_CONFIGS))
@torch.no_grad()
def test_two_canvases_with_and_without_self_conditioning(hf_checkpoints, name):
    from transformers.cache_utils import DynamicCache

    folder, hf = hf_checkpoints[name]
    model = dgemma.load_model(folder)
    V = model.config.vocab_size
    L = model.config.canvas_length
    g = torch.Generator().manual_seed(1)
    B, T = 3, 2 * model.config.sliding_window + 5  # prompt longer than the sliding window
    ids = torch.randint(0, V, (B, T), generator=g)

    hf_cache = DynamicCache(config=hf.config.text_config)
    cache = model.new_cache(B, 256)
    assert (model.encode(ids, cache) - hf_encode(hf, ids, hf_cache)).abs().max() <= TOL

    for _ in range(2):  # denoise, commit the canvas with encode, denoise the next one
        canvas = torch.randint(0, V, (B, L), generator=g)
        sc_logits = torch.randn(B, L, V, generator=g) * 4
        for sc in (None, sc_logits):
            ref = hf(decoder_input_ids=canvas, past_key_values=hf_cache, self_conditioning_logits=sc).logits
            ours = model.denoise(canvas, cache, self_conditioning=None if sc is None else PreviousStep.from_logits(sc))
            assert ours.dtype == torch.float32 and ours.shape == (B, L, V)
            assert (ours - ref).abs().max() <= TOL
        assert (model.encode(canvas, cache) - hf_encode(hf, canvas, hf_cache)).abs().max() <= TOL
    assert cache.length == T + 2 * L


@torch.no_grad()
def test_self_conditioning_mask_zeroes_rows(hf_checkpoints):
    from transformers.cache_utils import DynamicCache

    folder, hf = hf_checkpoints["alternating"]
    model = dgemma.load_model(folder)
    ids = torch.randint(0, 128, (2, 5))
    hf_cache = DynamicCache(config=hf.config.text_config)
    hf_encode(hf, ids, hf_cache)
    cache = model.new_cache(2, 64)
    model.encode(ids, cache, return_logits=False)
    canvas, sc = torch.randint(0, 128, (2, 16)), torch.randn(2, 16, 128)
    mask = torch.tensor([True, False])
    ref = hf(decoder_input_ids=canvas, past_key_values=hf_cache, self_conditioning_logits=sc,
             self_conditioning_mask=mask).logits
    ours = model.denoise(canvas, cache, self_conditioning=PreviousStep.from_logits(sc, mask=mask))
    assert (ours - ref).abs().max() <= TOL
    # the masked row equals no self-conditioning at all
    assert (ours[1] - model.denoise(canvas, cache)[1]).abs().max() <= 1e-6


@torch.no_grad()
def test_left_padding_matches_reference(hf_checkpoints):
    from transformers.cache_utils import DynamicCache

    folder, hf = hf_checkpoints["alternating"]
    model = dgemma.load_model(folder)
    ids = torch.randint(1, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False  # row 1 is left-padded
    hf_cache = DynamicCache(config=hf.config.text_config)
    ref = hf_encode(hf, ids, hf_cache, attention_mask=mask)
    cache = model.new_cache(2, 64)
    ours = model.encode(ids, cache, attention_mask=mask)
    assert (ours[mask] - ref[mask]).abs().max() <= TOL
    canvas = torch.randint(0, 128, (2, 16))
    dec_mask = torch.cat([mask, torch.ones(2, 16, dtype=torch.bool)], dim=1)
    ref = hf(decoder_input_ids=canvas, past_key_values=hf_cache, decoder_attention_mask=dec_mask).logits
    assert (model.denoise(canvas, cache) - ref).abs().max() <= TOL


@torch.no_grad()
def test_cached_equals_uncached_and_cache_is_bounded(hf_checkpoints):
    folder, _ = hf_checkpoints["gemma-pattern"]
    model = dgemma.load_model(folder)
    W = model.config.sliding_window
    ids = torch.randint(0, model.config.vocab_size, (2, 3 * W + 1))
    whole = model.new_cache(2, 128)
    full_logits = model.encode(ids, whole)
    chunked = model.new_cache(2, 128)
    pieces = [model.encode(ids[:, a:b], chunked) for a, b in ((0, 4), (4, 5), (5, 2 * W), (2 * W, 3 * W + 1))]
    assert (torch.cat(pieces, dim=1) - full_logits).abs().max() <= TOL
    canvas = torch.randint(0, model.config.vocab_size, (2, 16))
    assert (model.denoise(canvas, whole) - model.denoise(canvas, chunked)).abs().max() <= TOL
    # sliding layers keep only what the window needs; full layers one slot per position; both reserve
    # one canvas worth of slots for the decoder
    for i in range(model.config.num_layers):
        expected = W - 1 if model.config.is_sliding(i) else 128
        assert whole.keys[i].shape[2] == model.config.canvas_length + expected


@torch.no_grad()
def test_training_cache_with_prefix_length_equals_generation_cache(hf_checkpoints):
    """keep_all + prefix_length (training) sees exactly what a generation cache sees."""
    folder, _ = hf_checkpoints["alternating"]
    model = dgemma.load_model(folder)
    ids = torch.randint(0, 128, (1, 30))
    canvas = torch.randint(0, 128, (1, 16))
    full = model.new_cache(1, 64, keep_all=True)
    model.encode(ids, full, return_logits=False)
    for prefix in (7, 19, 30):
        gen_cache = model.new_cache(1, 64)
        model.encode(ids[:, :prefix], gen_cache, return_logits=False)
        a = model.denoise(canvas, gen_cache)
        b = model.denoise(canvas, full, prefix_length=torch.tensor([prefix]))
        assert (a - b).abs().max() <= TOL


def test_gradients_flow_through_encoder_and_decoder():
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    cache = model.new_cache(2, 64, keep_all=True)
    enc = model.encode(torch.randint(0, 128, (2, 10)), cache)
    dec = model.denoise(torch.randint(0, 128, (2, 16)), cache,
                        self_conditioning=PreviousStep.from_logits(torch.randn(2, 16, 128)))
    (enc.logsumexp(-1).mean() + dec.logsumexp(-1).mean()).backward()
    layer = model.layers[0]
    for p in (layer.self_attn.q_proj.weight, layer.experts.gate_up_proj, model.self_conditioning.gate_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


@torch.no_grad()
def test_rows_at_different_lengths_share_one_cache(hf_checkpoints):
    """An engine keeps requests at different points in one cache: each row must behave as if alone."""
    folder, _ = hf_checkpoints["gemma-pattern"]
    model = dgemma.load_model(folder)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, V, (1, 17), generator=g), torch.randint(0, V, (1, 5), generator=g)
    canvas = torch.randint(0, V, (2, 16), generator=g)
    shared = model.new_cache(3, 64)
    row_a, row_b = torch.tensor([2]), torch.tensor([0])
    enc_a = model.encode(a, shared, rows=row_a)
    enc_b = model.encode(b, shared, rows=row_b)
    model.encode(canvas[1:], shared, rows=row_b)  # row b commits a canvas; row a does not
    both = model.denoise(canvas, shared, rows=torch.tensor([2, 0]))
    for ids, row, extra, enc in ((a, 0, None, enc_a), (b, 1, canvas[1:], enc_b)):
        alone = model.new_cache(1, 64)
        assert (model.encode(ids, alone) - enc).abs().max() <= TOL
        if extra is not None:
            model.encode(extra, alone)
        assert (model.denoise(canvas[row : row + 1], alone) - both[row : row + 1]).abs().max() <= TOL
    assert shared.row_lengths == [5 + 16, 0, 17]


@pytest.mark.parametrize("adapted", [False, True])
def test_batched_experts_equal_one_matmul_per_expert(adapted):
    """The padded (E, C, H) batched path and the per-expert loop are the same function (with LoRA too),
    also for a single token, and the loop is chosen where the grid would cost more (skewed routing)."""
    from dgemma.model.experts import Experts
    from dgemma.training.lora import LoRAExperts

    config = dgemma.get_preset("tiny")
    g = torch.Generator().manual_seed(0)
    experts = Experts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if adapted:
        experts = LoRAExperts(experts, rank=2, alpha=4)
        with torch.no_grad():
            experts.lora_gate_up_B.normal_(generator=g)
            experts.lora_down_B.normal_(generator=g)
    N, k, E = 600, config.top_k_experts, config.num_experts
    x = torch.randn(N, config.hidden_size, generator=g)
    weights = torch.rand(N, k, generator=g)
    balanced = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    skewed = torch.stack([torch.tensor([0, 1 + i % (E - 1)]) for i in range(N)])  # expert 0 takes every token
    calls = []
    experts._per_expert = (lambda f: lambda *a: calls.append("loop") or f(*a))(experts._per_expert)
    for choice in (balanced, skewed, balanced[:1]):
        chosen = experts(x[: len(choice)], weights[: len(choice)], choice)
        experts.grid_preference = 0.0  # force the loop
        looped = experts(x[: len(choice)], weights[: len(choice)], choice)
        experts.grid_preference = 1.0
        torch.testing.assert_close(chosen, looped, rtol=1e-5, atol=1e-5)
    # forced three times, and the skewed routing (a grid of 4 x 600 rows for 1,200 entries) chose it itself
    assert calls == ["loop", "loop", "loop", "loop"]
    if not adapted:  # the CUDA path, grouped GEMM, through torch's CPU implementation of it
        for choice in (balanced, skewed):
            N, k = choice.shape
            order = choice.reshape(-1).argsort(stable=True)
            counts = torch.bincount(choice.reshape(-1), minlength=E)
            grouped = experts._grouped(x[order // k], counts)
            torch.testing.assert_close(grouped, experts._per_expert(x[order // k], counts.tolist()),
                                       rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_generation_cache_layout_k_eq_v_once_and_canvas_slots(hf_checkpoints):
    """Full layers store the raw K = V projection once; a denoising step writes only the canvas slots and
    attends to a view of the cache (no copy of the prefix), for consecutive rows."""
    folder, _ = hf_checkpoints["gemma-pattern"]
    model = dgemma.load_model(folder)
    c = model.config
    cache = model.new_cache(3, 64)
    model.encode(torch.randint(0, c.vocab_size, (3, 20)), cache)
    for i in range(c.num_layers):
        assert (cache.values[i] is None) == (not c.is_sliding(i))
    assert cache.nbytes() == sum(t.numel() * t.element_size() for t in cache.keys) + sum(
        t.numel() * t.element_size() for t in cache.values if t is not None)
    prefix = [k[:, :, c.canvas_length :].clone() for k in cache.keys]
    canvas = torch.randint(0, c.vocab_size, (2, c.canvas_length))
    rows = torch.tensor([1, 2])
    first = model.denoise(canvas, cache, rows=rows)
    assert all(torch.equal(k[:, :, c.canvas_length :], p) for k, p in zip(cache.keys, prefix))
    keys, _ = cache.canvas_buffers(rows)[0]
    assert keys.untyped_storage().data_ptr() == cache.keys[0].untyped_storage().data_ptr()  # a view
    # the reserved slots do not leak between calls: the same canvas again gives the same logits
    model.denoise(torch.randint(0, c.vocab_size, (2, c.canvas_length)), cache, rows=rows)
    torch.testing.assert_close(model.denoise(canvas, cache, rows=rows), first, rtol=0, atol=0)


def test_expert_path_follows_the_cost_model():
    """16 experts: one token on 2 of them runs the loop (a grid would read all 16 experts' weights), a
    64-token prefill runs the grid (the loop would be 16 matmul calls for ~8 rows each)."""
    from dgemma.model.experts import Experts

    experts = Experts(dgemma.get_preset("bench-20m"))
    torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
    torch.nn.init.normal_(experts.down_proj, std=0.02)
    calls = []
    experts._per_expert = (lambda f: lambda *a: calls.append("loop") or f(*a))(experts._per_expert)
    experts._batched = (lambda f: lambda *a: calls.append("grid") or f(*a))(experts._batched)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (1, 64):
            choice = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(n)])
            experts(torch.randn(n, 256, generator=g), torch.rand(n, 2, generator=g), choice)
    assert calls == ["loop", "grid"]


def test_grouped_expert_path_forced_on_cpu_equals_the_default_path():
    """The CUDA expert path (torch._grouped_mm over the entries in expert order, offsets on the device),
    forced through `Experts.route` on the CPU, where torch implements it too: the same outputs and the
    same gradients (input, routing weights, both projections) as the CPU's own path, with an expert that
    gets no token. The opaque op a compiled CUDA graph calls gives the same, and its fake (meta) kernel
    passes torch's op checks."""
    from dgemma.model.experts import Experts, register_for_compile, routed_experts

    config = dgemma.get_preset("tiny")
    g = torch.Generator().manual_seed(0)
    default, grouped = Experts(config), Experts(config)
    with torch.no_grad():
        for p in default.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    grouped.load_state_dict(default.state_dict())
    grouped.grouped_devices, grouped.grouped_dtypes = ("cpu",), (torch.float32,)
    calls = []
    grouped._grouped = (lambda f: lambda *a: calls.append("grouped") or f(*a))(grouped._grouped)
    N, k, E = 40, config.top_k_experts, config.num_experts
    x = torch.randn(N, config.hidden_size, generator=g)
    weights = torch.rand(N, k, generator=g)
    choice = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])  # the last expert idle
    outputs, grads = [], []
    for experts in (default, grouped):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(xi, wi, choice)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        outputs.append(out.detach())
        grads.append([xi.grad, wi.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    assert calls == ["grouped"]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads[1][2][E - 1].abs().max() == 0  # the idle expert's weights get no gradient
    register_for_compile(grouped)
    with torch.no_grad():
        torch.testing.assert_close(routed_experts(grouped.op_key, x, choice), grouped.route(x, choice))
    torch.library.opcheck(routed_experts, (grouped.op_key, x, choice), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 2816), (3, 16, 64), (1, 7)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_on_a_cpu_gives_torchs_bits(dtype, shape, with_scale):
    """Eagerly on a CPU without autograd, RMSNorm multiplies its scale in place (torch's rms_norm is ~5x slower
    there): the output is torch's rms_norm's to the bit; with autograd it is torch's rms_norm itself."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6, with_scale)
    if with_scale:
        norm.weight.data = torch.randn(shape[-1], generator=g) * 0.5 + 1
    norm = norm.to(dtype)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = None if norm.weight is None else norm.weight.float()
    reference = torch.nn.functional.rms_norm(x.float(), (shape[-1],), weight, 1e-6).type_as(x)
    with torch.no_grad():
        assert torch.equal(norm(x), reference)
    assert torch.equal(norm(x.clone().requires_grad_()).detach(), reference)
