"""The three samplers' steps against diffusers 0.42's DiffusionGemma schedulers (the test-only oracle) on shared
inputs: the same logits, canvas and random numbers give the same next canvas, the same committed, edited,
accepted and corrected positions.

diffusers draws categorical samples with torch.multinomial; dgemma draws them by inverse CDF from one uniform per
row. `shared_draws` routes diffusers' multinomial calls to dgemma's draw (same generator, same order), so every
other random number (re-noising tokens, routes, Gumbel keys) must then agree draw for draw."""

from __future__ import annotations

import pytest
import torch

from dgemma.sampling import sample_from_probs, temperature_schedule
from dgemma.sampling.block_refinement import commit_target, refinement_step
from dgemma.sampling.ddim import CORRECTOR_SELECTIONS, corrector_sweep, ddim_step, forward_budget
from dgemma.sampling.sampler import sample_tempered, scan_positions
from tests.conftest import sampler_step
from tests.test_sampling import spread_logits

diffusers = pytest.importorskip("diffusers")


@pytest.fixture
def shared_draws(monkeypatch):
    """diffusers' torch.multinomial(probs (N, V), 1, generator=g) becomes dgemma's inverse-CDF draw from g."""

    def multinomial(probs, num_samples, replacement=False, *, generator=None):
        assert num_samples == 1 and probs.dim() == 2
        return sample_from_probs(probs, generator)[:, None]

    monkeypatch.setattr(torch, "multinomial", multinomial)


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """dgemma's scan at temperature 1: softmax(logits) (B * L, V), as the samplers other than the bound read it."""
    return scan_positions(logits.clone(), 1.0)[0]


# -- entropy bound ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [0.1, 1.0])
def test_entropy_bound_step_matches_diffusers(shared_draws, bound):
    from diffusers import EntropyBoundScheduler

    B, L, V, N = 3, 24, 40, 10
    scheduler = EntropyBoundScheduler(entropy_bound=bound, t_max=0.8, t_min=0.4)
    scheduler.set_timesteps(N)
    canvas = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0))
    partial = 0
    for step in range(N):
        logits = spread_logits(B, L, V, seed=step)
        expected = scheduler.step(logits.clone(), step, canvas, generator=torch.Generator().manual_seed(step))
        buffer = logits.clone()
        ours = sampler_step(buffer, temperature_schedule(step, N, 0.4, 0.8), bound,
                            torch.Generator().manual_seed(step))
        assert torch.equal(ours.accepted, expected.accepted_index)
        assert torch.equal(ours.canvas, expected.prev_sample)
        # what the next step self-conditions on: diffusers passes the scaled logits, dgemma their softmax
        torch.testing.assert_close(buffer, expected.pred_logits.softmax(-1), rtol=1e-5, atol=1e-7)
        partial += int(0 < int(ours.accepted.sum()) < B * L)
        canvas = expected.prev_sample
    assert partial >= N // 2  # the bound accepted some positions, not all, on most steps


# -- block refinement ------------------------------------------------------------------------------
def test_commit_target_spreads_the_canvas_evenly():
    free = torch.tensor([10, 7, 0])
    targets = torch.stack([commit_target(i, 4, free) for i in range(4)])
    assert targets.T.tolist() == [[3, 5, 8, 10], [2, 4, 6, 7], [0, 0, 0, 0]]


@pytest.mark.parametrize("temperature, editing", [(0.0, 0.0), (0.0, 0.6), (1.0, 0.6), (0.7, 0.3)])
def test_block_refinement_steps_match_diffusers(shared_draws, temperature, editing):
    from diffusers import BlockRefinementScheduler

    B, L, V, N = 3, 20, 30, 6
    scheduler = BlockRefinementScheduler(threshold=0.9, editing_threshold=editing or None)
    scheduler.set_timesteps(N, block_length=L)
    canvas = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    committed = torch.zeros(B, L, dtype=torch.bool)
    edits = beyond_quota = 0
    for step in range(N):
        logits = spread_logits(B, L, V, seed=10 + step)
        expected = scheduler.step(logits.clone(), step, canvas, mask_token_id=None, temperature=temperature,
                                  generator=torch.Generator().manual_seed(step))
        g = torch.Generator().manual_seed(step)
        predicted, confidence = sample_tempered(probabilities(logits), temperature, g)
        ours = refinement_step(canvas, committed, predicted.view(B, L), confidence.view(B, L), step, N, g, V,
                               commit_threshold=0.9, editing_threshold=editing)
        assert torch.equal(ours.transfer, expected.transfer_index)
        assert torch.equal(ours.edited, expected.editing_transfer_index)
        assert torch.equal(ours.canvas, expected.prev_sample)
        assert torch.equal(ours.committed, scheduler._committed)
        assert torch.equal(ours.committed.sum(-1) >= commit_target(step, N, torch.tensor(L)), torch.ones(B, dtype=bool))
        edits += int(ours.edited.sum())
        beyond_quota += int((ours.committed.sum(-1) > commit_target(step, N, torch.tensor(L))).sum())
        canvas, committed = ours.canvas, ours.committed
    assert bool(committed.all())  # the last step commits every position
    assert beyond_quota > 0  # the threshold committed past the quota somewhere
    assert (edits > 0) == (editing > 0)


def test_block_refinement_template_positions_are_committed_and_outside_the_quota():
    B, L, V, N = 2, 12, 20, 4
    fixed = torch.zeros(B, L, dtype=torch.bool)
    fixed[0, :6] = True
    fixed_tokens = torch.full((B, L), 7)
    canvas = torch.where(fixed, fixed_tokens, torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0)))
    committed = fixed.clone()
    g = torch.Generator().manual_seed(0)
    for step in range(N):
        probs = probabilities(spread_logits(B, L, V, seed=step))
        predicted, confidence = sample_tempered(probs, 0.0, g)
        ours = refinement_step(canvas, committed, predicted.view(B, L), confidence.view(B, L), step, N, g, V,
                               commit_threshold=2.0, editing_threshold=0.01, fixed=fixed, fixed_tokens=fixed_tokens)
        assert torch.equal(ours.canvas[fixed], fixed_tokens[fixed]) and bool(ours.committed[fixed].all())
        assert not bool((ours.edited & fixed).any())
        # the free positions are committed evenly: 6 of row 0 and 12 of row 1 over 4 steps
        assert (ours.committed & ~fixed).sum(-1).tolist() == commit_target(step, N, torch.tensor([6, 12])).tolist()
        canvas, committed = ours.canvas, ours.committed


# -- discrete DDIM ---------------------------------------------------------------------------------
def test_forward_budget_matches_the_pipelines_split():
    for forwards in (1, 2, 5, 12, 48):
        for sweeps in (0, 1, 2, 3):
            predictor, corrected = forward_budget(forwards, sweeps)
            assert predictor + corrected * sweeps == forwards and corrected < predictor
            if sweeps:
                assert corrected == (forwards - 1) // (1 + sweeps)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_ddim_steps_match_diffusers(shared_draws, temperature):
    from diffusers import DiscreteDDIMScheduler

    B, L, V, N = 3, 24, 16, 6
    scheduler = DiscreteDDIMScheduler()
    scheduler.set_timesteps(N)
    canvas = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(2))
    routes = {"clean": 0, "kept": 0}
    for step in range(N):
        logits = spread_logits(B, L, V, seed=20 + step)
        expected = scheduler.step(logits.clone(), step, canvas, temperature=temperature,
                                  generator=torch.Generator().manual_seed(step))
        g = torch.Generator().manual_seed(step)
        x0, _ = sample_tempered(probabilities(logits), temperature, g)
        assert torch.equal(x0.view(B, L), expected.sampled_tokens)
        ours = ddim_step(canvas, x0.view(B, L), step, N, g, V)
        assert torch.equal(ours.canvas, expected.prev_sample)
        routes["clean"] += int(ours.clean.sum())
        routes["kept"] += int(((ours.canvas == canvas) & ~ours.clean).sum())
        canvas = ours.canvas
    assert torch.equal(canvas, x0.view(B, L))  # the last step takes x0 everywhere
    assert routes["clean"] > 0 and routes["kept"] > 0


@pytest.mark.parametrize("selection", CORRECTOR_SELECTIONS)
def test_corrector_sweeps_match_diffusers(shared_draws, selection):
    from diffusers import DiscreteDDIMScheduler

    B, L, V, N, k = 3, 20, 50, 8, 4
    scheduler = DiscreteDDIMScheduler(corrector_steps=1, corrector_k=k, corrector_selection=selection,
                                      corrector_selection_tau=0.5)
    scheduler.set_timesteps(N)
    canvas = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(3))
    for step in range(N - 1):
        logits = spread_logits(B, L, V, seed=30 + step)
        canvas[:, :5] = logits[:, :5].argmax(-1)  # some positions hold the model's own choice
        expected = scheduler.step_correct(logits.clone(), step, canvas, generator=torch.Generator().manual_seed(step))
        ours = corrector_sweep(logits, canvas, step, N, torch.Generator().manual_seed(step), k=k, selection=selection,
                               tau=0.5)
        assert torch.equal(ours.canvas, expected.prev_sample)
        assert ours.corrected.sum(-1).tolist() == [k] * B
        assert torch.equal(ours.canvas[ours.corrected].view(B, k).sort(-1).values,
                           expected.sampled_tokens.sort(-1).values)
        assert torch.equal(ours.canvas[~ours.corrected], canvas[~ours.corrected])
        assert torch.equal(ours.argmax, logits.argmax(-1))
        torch.testing.assert_close(ours.entropy, torch.distributions.Categorical(logits=logits).entropy())
        canvas = ours.canvas


# -- the whole pipeline: diffusers' DiffusionGemmaPipeline against dgemma's loop ----------------------------
EOS = 127


class PromptProcessor:
    """The processor the pipeline asks for, holding token ids instead of a chat template: left-padded prompts."""

    def __init__(self, prompts: list[list[int]]):
        from dgemma.generation import left_pad

        self.ids, self.mask = left_pad(prompts, 0, "cpu")
        self.tokenizer, self.eos_token_id = self, EOS

    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": self.ids, "attention_mask": self.mask.long()}


def run_pipeline(hf, scheduler, prompts, *, steps: int, canvases: int, seed: int, temperature: float = 0.0):
    """diffusers' pipeline with its multinomial draws routed to dgemma's (see `shared_draws`): -> (its output
    sequences, the canvas each decoder forward read, the last step's logits of each canvas)."""
    from diffusers import DiffusionGemmaPipeline

    pipe = DiffusionGemmaPipeline(model=hf, scheduler=scheduler, processor=PromptProcessor(prompts))
    pipe.set_progress_bar_config(disable=True)
    inputs = []
    handle = hf.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(kwargs["decoder_input_ids"].clone()),
                                          with_kwargs=True)
    try:
        out = pipe(prompt=["-"] * len(prompts), gen_length=canvases * hf.config.canvas_length,
                   num_inference_steps=steps, temperature=temperature, output_type="seq",
                   generator=torch.Generator().manual_seed(seed))
    finally:
        handle.remove()
    return out.sequences, inputs


def run_dgemma(model, prompts, sampling, seed):
    from dgemma.generation import generate

    inputs = []
    denoise = model.denoise
    model.denoise = lambda canvas, *a, **kw: inputs.append(canvas.clone()) or denoise(canvas, *a, **kw)
    try:
        return generate(model, prompts, sampling, seed=seed), inputs
    finally:
        model.denoise = denoise


def assert_same_inputs(inputs, expected_inputs, ours, steps: int):
    """Each forward read the same canvas in both, row by row while the row was generating (dgemma stops
    denoising a row after its EOS; the pipeline runs it on)."""
    assert len(inputs) == len(expected_inputs)
    for forward, (a, b) in enumerate(zip(inputs, expected_inputs)):
        for row, canvases in enumerate(ours.steps_per_canvas):
            if forward // steps < len(canvases):
                assert torch.equal(a[row], b[row]), f"forward {forward}, row {row}"


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """transformers' DiffusionGemmaForBlockDiffusion with every tensor perturbed, and dgemma's model loaded
    from the folder it saved."""
    import dgemma
    from tests.conftest import make_hf_model

    hf = make_hf_model("alternating", canvas_length=16, seed=3)
    folder = tmp_path_factory.mktemp("pipeline-model")
    hf.save_pretrained(folder)
    return hf, dgemma.load_model(folder)


PROMPTS = [[2, 10, 11, 12, 13, 14], [2, 20, 21]]


@pytest.mark.parametrize("sampler, scheduler_config, fields, temperature", [
    ("block-refinement", dict(threshold=0.9, editing_threshold=0.5), dict(commit_threshold=0.9, editing_threshold=0.5),
     1.0),
    ("block-refinement", dict(), dict(), 0.0),
    ("ddim", dict(), dict(), 0.7),
    ("ddim", dict(corrector_steps=1, corrector_k=3), dict(corrector_steps=1, corrector_k=3), 1.0),
])
def test_pipeline_and_dgemma_commit_the_same_tokens(shared_draws, random_pair, sampler, scheduler_config, fields,
                                                    temperature):
    """Block refinement and DDIM commit their canvas, as the pipeline does: over three canvases the two read the
    same canvas at every forward (so the same logits, self-conditioning and draws) and commit the same tokens."""
    from diffusers import BlockRefinementScheduler, DiscreteDDIMScheduler

    from dgemma.config import SamplingConfig

    hf, model = random_pair
    scheduler = {"block-refinement": BlockRefinementScheduler, "ddim": DiscreteDDIMScheduler}[sampler](**scheduler_config)
    steps, canvases, L = 7, 3, 16
    expected, expected_inputs = run_pipeline(hf, scheduler, PROMPTS, steps=steps, canvases=canvases, seed=5,
                                             temperature=temperature)
    sampling = SamplingConfig(sampler=sampler, max_denoising_steps=steps, max_new_tokens=canvases * L,
                              eos_token_ids=(EOS,), pad_token_id=0, temperature=temperature, **fields)
    ours, inputs = run_dgemma(model, PROMPTS, sampling, seed=5)
    assert len(inputs) == len(expected_inputs) == steps * ours.num_canvases
    assert_same_inputs(inputs, expected_inputs, ours, steps)
    for row in range(len(PROMPTS)):
        assert ours.tokens[row] + [EOS] * (ours.finish_reasons[row] == "stop") == until_eos(expected[row].tolist())


def test_pipeline_and_dgemma_take_the_same_entropy_bound_steps(shared_draws, random_pair):
    """The entropy bound: every forward of a canvas reads the same canvas in both (the same temperatures,
    acceptances, draws and self-conditioning). At the end of a canvas that used all its steps dgemma commits the
    argmax of the last step, as transformers' loop does, where the pipeline commits its last sampled canvas
    (accepted samples, noise elsewhere); so the runs are compared one canvas long."""
    from diffusers import EntropyBoundScheduler

    from dgemma.config import SamplingConfig

    hf, model = random_pair
    steps = 6
    scheduler = EntropyBoundScheduler(entropy_bound=1.0, t_max=0.9, t_min=0.5)
    expected, expected_inputs = run_pipeline(hf, scheduler, PROMPTS, steps=steps, canvases=1, seed=2)
    sampling = SamplingConfig(max_denoising_steps=steps, max_new_tokens=16, eos_token_ids=(EOS,), pad_token_id=0,
                              entropy_bound=1.0, t_max=0.9, t_min=0.5)
    ours, inputs = run_dgemma(model, PROMPTS, sampling, seed=2)
    assert len(inputs) == len(expected_inputs) == steps
    assert_same_inputs(inputs, expected_inputs, ours, steps)


def test_pipeline_and_dgemma_commit_the_same_entropy_bound_canvases(shared_draws, random_pair):
    """Where the entropy bound accepts every position and its temperature leaves one token per position, the
    pipeline's last canvas is the argmax canvas dgemma commits: three canvases in a row agree, the cache of
    committed canvases and the stop rule included."""
    from diffusers import EntropyBoundScheduler

    from dgemma.config import SamplingConfig

    hf, model = random_pair
    steps, canvases = 5, 3
    scheduler = EntropyBoundScheduler(entropy_bound=1e6, t_max=2e-4, t_min=1e-4)
    expected, expected_inputs = run_pipeline(hf, scheduler, PROMPTS, steps=steps, canvases=canvases, seed=4)
    sampling = SamplingConfig(max_denoising_steps=steps, max_new_tokens=canvases * 16, eos_token_ids=(EOS,),
                              pad_token_id=0, entropy_bound=1e6, t_max=2e-4, t_min=1e-4)
    ours, inputs = run_dgemma(model, PROMPTS, sampling, seed=4)
    assert len(inputs) == len(expected_inputs)
    assert_same_inputs(inputs, expected_inputs, ours, steps)
    for row in range(len(PROMPTS)):
        assert ours.tokens[row] + [EOS] * (ours.finish_reasons[row] == "stop") == until_eos(expected[row].tolist())
