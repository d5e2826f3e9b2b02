"""The sampler pieces, pinned against transformers' DiffusionGemma generation code (the test-only oracle)
on fixed random logits: the same temperatures, entropies, accepted sets (ties included) and stop decisions."""

from __future__ import annotations

import pytest
import torch

from dgemma.config import ConfigError, SamplingConfig
from dgemma.sampling import (
    acceptance_uncertainty,
    adaptive_stop,
    chunk_rows,
    entropy_bound_accept,
    mean_entropy,
    new_argmax_history,
    sample_from_probs,
    temperature_schedule,
    token_entropy,
)

from tests.conftest import sampler_step  # noqa: E402

reference = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")


def spread_logits(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits whose per-position entropies range from ~0 to ~log(V): each position gets its own scale."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.7, batch * length).view(batch, length, 1)
    scale = scale.flatten()[torch.randperm(batch * length, generator=g)].view(batch, length, 1)
    return torch.randn(batch, length, vocab, generator=g) * scale


def reference_accept(logits: torch.Tensor, bound: float) -> torch.Tensor:
    B, L, V = logits.shape
    sampler = reference.EntropyBoundSampler(reference.EntropyBoundSamplerConfig(entropy_bound=bound), L, V, 48)
    canvas = torch.zeros(B, L, dtype=torch.long)
    sampler.accept_canvas(canvas, canvas + 1, logits, cur_step=1)
    return sampler.accepted_token_mask


# -- temperature --------------------------------------------------------------------------------
@pytest.mark.parametrize("num_steps", [1, 7, 48])
def test_temperature_schedule_matches_reference(num_steps):
    t_min, t_max = 0.4, 0.8
    processor = reference.LinearTemperatureScheduleLogitsProcessor(t_min, t_max, num_steps)
    logits = torch.randn(2, 3, 11)
    temperatures = []
    for step_index, steps_left in enumerate(range(num_steps, 0, -1)):  # the reference counts down N..1
        expected = processor(None, logits, cur_step=torch.tensor(steps_left, dtype=torch.int32))
        temperature = temperature_schedule(step_index, num_steps, t_min, t_max)
        assert torch.equal(logits / temperature, expected)  # bit-identical scaled logits
        temperatures.append(temperature)
    assert temperatures[0] == pytest.approx(t_max)
    assert temperatures[-1] == pytest.approx(t_min + (t_max - t_min) / num_steps)
    assert temperatures == sorted(temperatures, reverse=True)


# -- entropy and acceptance ---------------------------------------------------------------------
def test_entropy_is_bit_identical_to_categorical():
    logits = spread_logits(3, 40, 97, seed=0)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(token_entropy(logits), expected)
    assert float(expected.min()) < 0.05 and float(expected.max()) > 4.0  # the spread we wanted


@pytest.mark.parametrize("bound", [0.01, 0.1, 0.5, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accepted_set_matches_reference(bound, seed):
    logits = spread_logits(4, 64, 50, seed)
    ours = entropy_bound_accept(token_entropy(logits), bound)
    assert torch.equal(ours, reference_accept(logits, bound))
    counts = ours.sum(-1)
    assert bool((counts >= 1).all())  # the lowest-entropy position is always accepted
    if bound >= 0.5:
        assert bool((counts > 1).any()) and bool((counts < 64).all())  # a real partial acceptance


def test_acceptance_bound_is_inclusive():
    # sorted: 0.25, 0.25, 0.5, 1.0 -> entropy before each: 0, 0.25, 0.5, 1.0; bound 0.5 admits three
    entropy = torch.tensor([[1.0, 0.25, 0.5, 0.25], [3.0, 2.0, 1.0, 4.0]])
    assert entropy_bound_accept(entropy, 0.5).tolist() == [[False, True, True, True], [False, False, True, False]]


def test_accept_orders_rank_by_their_own_uncertainty():
    """Two positions that entropy and margin rank oppositely: a near tie between two tokens (low entropy,
    margin ~0) and a spread-out but clear winner (higher entropy, wide margin)."""
    probs = torch.tensor([[0.50, 0.49, 0.01, 0.00], [0.70, 0.10, 0.10, 0.10], [1.0, 0.0, 0.0, 0.0]])
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
    assert entropy[0] < entropy[1]
    torch.testing.assert_close(acceptance_uncertainty(probs, entropy, "entropy"), entropy)
    torch.testing.assert_close(acceptance_uncertainty(probs, entropy, "margin"), torch.tensor([0.99, 0.4, 0.0]))
    torch.testing.assert_close(acceptance_uncertainty(probs, entropy, "confidence"), torch.tensor([0.5, 0.3, 0.0]))
    # the bound's rule on each order's uncertainty: with bound 0.1 the sure position always passes, and
    # the one after it passes (the sum before it is 0); the third is then over the bound
    margin = acceptance_uncertainty(probs, entropy, "margin")
    by_margin = entropy_bound_accept(margin[None], 0.1)[0].tolist()
    by_entropy = entropy_bound_accept(entropy[None], 0.1)[0].tolist()
    assert by_margin == [False, True, True] and by_entropy == [True, False, True]
    with pytest.raises(ValueError, match="accept order must be one of"):
        acceptance_uncertainty(probs, entropy, "random")


def test_sampler_step_accepts_by_the_chosen_order_and_keeps_the_entropy():
    logits = spread_logits(2, 32, 50, seed=5)
    steps = {order: sampler_step(logits.clone(), 1.0, 0.3, torch.Generator().manual_seed(0), accept_order=order)
             for order in ("entropy", "margin", "confidence")}
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, -1).values
    expected = {"margin": 1 - (top[..., 0] - top[..., 1]), "confidence": 1 - top[..., 0]}
    for order, uncertainty in expected.items():
        assert torch.equal(steps[order].accepted, entropy_bound_accept(uncertainty, 0.3))
        assert torch.equal(steps[order].entropy, steps["entropy"].entropy)  # the stop rule's input is unchanged
        assert torch.equal(steps[order].argmax, steps["entropy"].argmax)
    assert not torch.equal(steps["margin"].accepted, steps["entropy"].accepted)


def test_accept_order_in_the_config_and_generation_config_json():
    assert SamplingConfig().accept_order == "entropy" and "accept_order" not in SamplingConfig().to_hf_dict()
    margin = SamplingConfig(accept_order="margin")
    assert SamplingConfig.from_hf_dict(margin.to_hf_dict()).accept_order == "margin"
    assert SamplingConfig.from_hf_dict(margin.to_hf_dict(), accept_order="confidence").accept_order == "confidence"
    with pytest.raises(ConfigError, match="accept_order must be one of entropy, margin, confidence"):
        SamplingConfig(accept_order="random")


def test_accepted_set_with_tied_entropies_straddling_the_bound():
    # Row b: 10 positions share one distribution (identical entropy h), the rest are flatter. With bound
    # 2.5 h exactly 3 of the tied positions fit; which 3 depends on how the sort orders ties.
    g = torch.Generator().manual_seed(3)
    B, L, V = 3, 24, 16
    logits = torch.randn(B, L, V, generator=g) * 0.1  # flat: high entropy
    tied_positions = [torch.randperm(L, generator=g)[:10] for _ in range(B)]
    shared = torch.randn(V, generator=g) * 4
    for row, positions in enumerate(tied_positions):
        logits[row, positions] = shared
    entropy = token_entropy(logits)
    h = float(entropy[0, tied_positions[0][0]])
    for row, positions in enumerate(tied_positions):
        assert bool((entropy[row, positions] == h).all())
    bound = 2.5 * h
    ours = entropy_bound_accept(entropy, bound)
    assert torch.equal(ours, reference_accept(logits, bound))
    assert ours.sum(-1).tolist() == [3, 3, 3]


# -- adaptive stopping --------------------------------------------------------------------------
@pytest.mark.parametrize("stability_threshold", [0, 1, 2, 3])
def test_stop_decisions_match_reference(stability_threshold):
    B, L, V, steps = 6, 12, 20, 8
    g = torch.Generator().manual_seed(stability_threshold)
    # Row r's argmax changes only at steps listed in `changes[r]`; its entropy shrinks with the step.
    changes = [{0}, {0, 1}, {0, 3}, {0, 2, 5}, set(range(steps)), {0, 6}]
    base = torch.randint(0, V, (B, L), generator=g)
    threshold = 0.05
    criteria = reference.StableAndConfidentStoppingCriteria(stability_threshold, threshold)
    history = new_argmax_history(stability_threshold, B, L, "cpu")
    decisions = []
    for step in range(steps):
        for row in range(B):
            if step in changes[row]:
                base[row] = torch.randint(0, V, (L,), generator=g)
        sharpness = 1.0 + step * torch.arange(1, B + 1).view(B, 1, 1) * 1.5  # rows converge at different rates
        logits = torch.randn(B, L, V, generator=g) * 0.5 + torch.nn.functional.one_hot(base, V) * sharpness
        argmax = logits.argmax(-1)
        expected = criteria(argmax, logits)
        stop, history = adaptive_stop(history, argmax, token_entropy(logits), threshold)
        assert torch.equal(stop, expected), f"step {step}"
        decisions.append(stop)
    decisions = torch.stack(decisions)
    assert bool(decisions.any()) and not bool(decisions.all())  # both outcomes are exercised


def test_mean_entropy_leaves_fixed_positions_out():
    entropy = torch.tensor([[1.0, 2.0, 0.0, 3.0], [0.5, 0.5, 0.5, 0.5]])
    fixed = torch.tensor([[False, False, True, False], [True, True, True, True]])
    assert mean_entropy(entropy).tolist() == [1.5, 0.5]
    assert mean_entropy(entropy, fixed).tolist() == [2.0, 0.0]  # a fully fixed row counts as certain


# -- the fused step -------------------------------------------------------------------------------
def reference_step(logits, steps_left, num_steps, bound, generator, chunk):
    """The reference's step 1.c.ii-iii with its randomness routed to `generator`: multinomial becomes our
    inverse-CDF draw over the same chunks, the uniform re-noising draws come from the same generator."""
    B, L, V = logits.shape
    processor = reference.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, num_steps)
    scaled = processor(None, logits, cur_step=torch.tensor(steps_left, dtype=torch.int32))
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32).view(-1, V)
    sampled = torch.cat([sample_from_probs(probs[i : i + chunk], generator) for i in range(0, B * L, chunk)])
    sampler = reference.EntropyBoundSampler(reference.EntropyBoundSamplerConfig(entropy_bound=bound), L, V, num_steps)
    sampler.initialize_canvas = lambda batch_size, device: torch.randint(0, V, (batch_size, L), generator=generator)
    current = torch.full((B, L), -1)
    accepted_canvas = sampler.accept_canvas(current, sampled.view(B, L), scaled, steps_left)
    return scaled, scaled.argmax(-1), sampler.renoise_canvas(accepted_canvas, steps_left), sampler.accepted_token_mask


@pytest.mark.parametrize("chunk_elements", [1 << 24, 7 * 30])
def test_sampler_step_matches_reference_with_shared_randomness(chunk_elements):
    B, L, V, num_steps = 3, 20, 30, 12
    logits = spread_logits(B, L, V, seed=5)
    for step_index in (0, 5, num_steps - 1):
        ours_logits = logits.clone()
        temperature = temperature_schedule(step_index, num_steps, 0.4, 0.8)
        ours = sampler_step(ours_logits, temperature, 0.5, torch.Generator().manual_seed(9),
                            chunk_elements=chunk_elements)
        scaled, argmax, canvas, accepted = reference_step(
            logits, num_steps - step_index, num_steps, 0.5, torch.Generator().manual_seed(9),
            chunk_rows(V, chunk_elements))
        # in place: the buffer now holds softmax(scaled), what the next step's self-conditioning embeds
        torch.testing.assert_close(ours_logits, scaled.softmax(-1), rtol=1e-6, atol=1e-7)
        assert torch.equal(ours.argmax, argmax)
        assert torch.equal(ours.accepted, accepted)
        torch.testing.assert_close(ours.entropy, token_entropy(scaled), rtol=0, atol=1e-5)  # nats
        assert torch.equal(ours.canvas, canvas)
        assert 1 < int(accepted.sum()) < B * L


def test_chunking_changes_nothing_on_cpu():
    logits = spread_logits(2, 33, 40, seed=6)
    results = []
    for chunk_elements in (40, 5 * 40, 1 << 24):
        buffer = logits.clone()
        results.append((buffer, sampler_step(buffer, 0.6, 0.3, torch.Generator().manual_seed(1),
                                             chunk_elements=chunk_elements)))
    for buffer, result in results[1:]:
        assert torch.equal(buffer, results[0][0])
        for name in ("canvas", "argmax", "entropy", "accepted"):
            assert torch.equal(getattr(result, name), getattr(results[0][1], name)), name


def test_compiled_scan_matches_the_eager_scan_ties_and_masked_tokens_included():
    """The engine compiles `scan_logits` with a compiled model, where argmax is found as the first index
    holding the row's max: the same indices as torch.argmax, also for tied maxima and -inf logits."""
    from dgemma.sampling.sampler import scan_logits

    logits = spread_logits(1, 12, 50, seed=8)[0]
    logits[0, [3, 17, 40]] = logits[0].max() + 1.0  # a three-way tie: the first must win
    logits[1, :] = 0.0  # all tied: index 0
    logits[2, 10:] = float("-inf")  # masked tokens
    logits[3, -1] = logits[3].max() + 5.0  # the last index
    compiled = torch.compile(scan_logits, dynamic=True)
    temperature = torch.tensor(0.7)
    eager_buffer, compiled_buffer = logits.clone(), logits.clone()
    eager_argmax, eager_entropy = scan_logits(eager_buffer, temperature)
    compiled_argmax, compiled_entropy = compiled(compiled_buffer, temperature)
    assert compiled_argmax.tolist() == eager_argmax.tolist()
    assert eager_argmax[:4].tolist() == [3, 0, int(logits[2, :10].argmax()), 49]
    torch.testing.assert_close(compiled_entropy, eager_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(compiled_buffer, eager_buffer, rtol=1e-6, atol=1e-7)


def test_the_eager_scan_keeps_the_entropy_of_a_long_vocabulary_accurate():
    """Over the released model's 262,144 entries (where the eager scan on a CPU goes two rows at a time): the
    entropy within 2e-6 nats of float64's, where summing e * (s - m) as a batched matmul was off by up to 2e-4;
    the argmax and the probabilities as before (torch's argmax; the softmax in the buffer)."""
    from dgemma.sampling.sampler import scan_positions

    logits = spread_logits(1, 6, 1 << 18, seed=3)
    scaled = logits.double() / 0.7
    expected = token_entropy(scaled)
    buffer = logits.clone()
    probs, argmax, entropy, _ = scan_positions(buffer, 0.7)
    assert float((entropy.double() - expected).abs().max()) < 2e-6
    assert torch.equal(argmax, logits.argmax(-1))
    torch.testing.assert_close(probs.double(), scaled.softmax(-1).view(6, -1), rtol=1e-5, atol=1e-9)


def test_the_eager_scan_gives_negligible_and_masked_tokens_exactly_zero():
    """Tokens whose probability is below the smallest normal float over the vocabulary (where torch's CPU exp
    would leave its fast path) get exactly 0, as masked (-inf) ones do; the rest, the entropy and the argmax are
    float64's."""
    from dgemma.sampling.sampler import scan_positions

    V = 1 << 18
    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(4)) * 3
    logits[0, 0, :1000] = float("-inf")  # masked
    logits[0, 1, 7] = 35.0  # at temperature 0.4 most others are 70-110 below it, where exp(s - m) is subnormal
    scaled = logits.double() / 0.4
    expected_probs = scaled.softmax(-1)[0]
    expected_entropy = token_entropy(scaled)[0]
    probs, argmax, entropy, _ = scan_positions(logits.clone(), 0.4)
    zeroed = probs == 0
    assert bool(zeroed[0, :1000].all())
    assert int(zeroed[1].sum()) > V // 2
    assert float(expected_probs[zeroed].max()) < 1e-30  # only negligible tokens
    assert float(probs[~zeroed].min()) >= torch.finfo(torch.float32).tiny  # and no subnormal probability
    torch.testing.assert_close(probs.double(), expected_probs, rtol=1e-5, atol=1e-30)
    assert float((entropy[0].double() - expected_entropy).abs().max()) < 2e-6
    assert argmax[0].tolist() == [int(logits[0, 0].argmax()), 7, int(logits[0, 2].argmax())]


def test_inverse_cdf_samples_the_given_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 200_000
    draws = sample_from_probs(probs.expand(n, 5).contiguous(), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.005)
    assert int(freq[4] * n) == 0  # a zero-probability token is never drawn


def test_renoised_positions_are_uniform_and_accepted_ones_are_samples():
    B, L, V = 4, 64, 8
    logits = torch.zeros(B, L, V)
    logits[:, :8, 3] = 40.0  # 8 near-certain positions per row (entropy ~0) -> accepted, token 3
    g = torch.Generator().manual_seed(2)
    renoised = []
    for _ in range(20):
        result = sampler_step(logits.clone(), 0.8, 0.1, g)
        assert bool(result.accepted[:, :8].all())
        assert bool((result.canvas[:, :8] == 3).all())
        # flat positions have entropy log(8) each, so exactly one of them passes the 0.1 bound
        assert result.accepted[:, 8:].sum(-1).tolist() == [1] * B
        renoised.append(result.canvas[:, 8:][~result.accepted[:, 8:]])
    freq = torch.bincount(torch.cat(renoised), minlength=V).double()
    freq /= freq.sum()
    assert torch.allclose(freq, torch.full((V,), 1 / V, dtype=torch.double), atol=0.02)


def test_same_generator_seed_same_step_and_different_seed_differs():
    logits = spread_logits(2, 32, 64, seed=8)
    a = sampler_step(logits.clone(), 0.8, 0.1, torch.Generator().manual_seed(4))
    b = sampler_step(logits.clone(), 0.8, 0.1, torch.Generator().manual_seed(4))
    c = sampler_step(logits.clone(), 0.8, 0.1, torch.Generator().manual_seed(5))
    assert torch.equal(a.canvas, b.canvas)
    assert not torch.equal(a.canvas, c.canvas)


def test_template_positions_are_fixed_free_of_budget_and_never_renoised():
    B, L, V = 3, 30, 25
    logits = spread_logits(B, L, V, seed=10)
    g = torch.Generator().manual_seed(0)
    fixed = torch.rand(B, L, generator=g) < 0.4
    fixed_tokens = torch.randint(0, V, (B, L), generator=g)
    free_entropy = token_entropy(logits / 0.7)
    for seed in range(5):
        result = sampler_step(logits.clone(), 0.7, 0.4, torch.Generator().manual_seed(seed),
                              fixed=fixed, fixed_tokens=fixed_tokens)
        assert torch.equal(result.canvas[fixed], fixed_tokens[fixed])
        assert torch.equal(result.argmax[fixed], fixed_tokens[fixed])
        assert bool(result.accepted[fixed].all()) and bool((result.entropy[fixed] == 0).all())
        # the free positions are accepted exactly as if the fixed ones were absent
        for row in range(B):
            free = ~fixed[row]
            alone = entropy_bound_accept(free_entropy[row, free][None], 0.4)[0]
            assert torch.equal(result.accepted[row, free], alone)
