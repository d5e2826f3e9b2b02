"""The reference generation loop (dgemma.generation.generate) on a deterministic mock model: canvases, positions,
EOS/pad handling, max_new_tokens, per-row stopping, fixed steps, canvas templates, self-conditioning,
seeds and statistics."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from dgemma.config import SamplingConfig
from dgemma.generation import CanvasTemplate, generate
from dgemma.sampling import temperature_schedule

PAD, EOS_A, EOS_B = 0, 1, 3
FIRST_PLAIN = 4  # the mock's ordinary tokens are FIRST_PLAIN .. V-1 (never pad or EOS)


class MockCache:
    def __init__(self, batch_size: int, max_length: int):
        self.batch_size, self.max_length, self.length = batch_size, max_length, 0
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, mask) per encode call


class MockModel:
    """Implements new_cache / encode / denoise of docs/model-api.md without a network.

    mode "target": the logits at generated index i of row b peak on target(b, i), a function of the
    row's real prompt tokens and i (so left padding must be masked and positions must be column indices
    for rows to match their solo runs); eos_at[b] = i puts an EOS there. `margin[b]` sets the peak height:
    large -> near-zero entropy (the row converges in 2 steps), small -> never confident.
    mode "copy": the logits peak on the canvas token itself, so the output is the random initial canvas.
    drift_after: from that many denoise calls on, every peak moves to the next token (a row that has
    stopped must not notice).
    """

    def __init__(self, canvas_length=8, vocab_size=32, mode="target", margin=(30.0,), eos_at=None, eos_id=EOS_A,
                 drift_after=None):
        self.config = SimpleNamespace(canvas_length=canvas_length, vocab_size=vocab_size)
        self.device = torch.device("cpu")
        self.mode, self.margin, self.eos_at, self.eos_id = mode, margin, eos_at or {}, eos_id
        self.drift_after = drift_after
        self.encodes: list[dict] = []
        self.denoises: list[dict] = []
        self.embeddings: list[tuple[int, torch.Tensor]] = []  # (the forward whose probabilities, their embedding)

    def new_cache(self, batch_size, max_length):
        self.cache = MockCache(batch_size, max_length)
        return self.cache

    def encode(self, input_ids, cache, attention_mask=None, *, return_logits=True):
        assert not return_logits
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask
        self.encodes.append(dict(ids=input_ids.clone(), mask=mask.clone(), start=cache.length))
        cache.blocks.append((input_ids.clone(), mask.clone()))
        cache.length += input_ids.shape[1]
        assert cache.length <= cache.max_length

    def target(self, row: int, index: int) -> int:
        if self.eos_at.get(row) == index:
            return self.eos_id if not isinstance(self.eos_id, dict) else self.eos_id[row]
        prompt_ids, prompt_mask = self.cache.blocks[0]
        key = int(prompt_ids[row][prompt_mask[row]].sum())
        return FIRST_PLAIN + (7 * key + 3 * index + index * index) % (self.config.vocab_size - FIRST_PLAIN)

    def targets(self, row: int, n: int) -> list[int]:
        return [self.target(row, i) for i in range(n)]

    def denoise(self, canvas_ids, cache, *, self_conditioning=None):
        B, L = canvas_ids.shape
        V = self.config.vocab_size
        prompt_width = cache.blocks[0][0].shape[1]
        first_index = cache.length - prompt_width  # generated index of the canvas's first position
        if self.mode == "copy":
            peaks = canvas_ids
        else:
            peaks = torch.tensor([[self.target(b, first_index + j) for j in range(L)] for b in range(B)])
        if self.drift_after is not None and len(self.denoises) >= self.drift_after:
            peaks = FIRST_PLAIN + (peaks + 1 - FIRST_PLAIN) % (V - FIRST_PLAIN)
        margin = torch.tensor([self.margin[b % len(self.margin)] for b in range(B)]).view(B, 1, 1)
        logits = torch.nn.functional.one_hot(peaks, V).float() * margin
        sc = None if self_conditioning is None else self_conditioning.embedding
        self.denoises.append(dict(
            canvas=canvas_ids.clone(), sc=sc, raw=logits.clone(), start=cache.length,
            sc_from=None if sc is None else next(i for i, e in self.embeddings if e is sc),
            out=weakref.ref(logits),  # the buffer the sampler overwrites with its probabilities
            alive=[i for i, call in enumerate(self.denoises) if call["out"]() is not None]))  # earlier buffers held
        return logits

    def soft_embedding_from_probs(self, probs):
        """The mock's embedding of the probabilities is a copy of them (an identity table), recorded with the
        forward whose buffer they were."""
        source = next(i for i, call in enumerate(self.denoises) if call["out"]() is probs)
        self.embeddings.append((source, probs.clone()))
        return self.embeddings[-1][1]


def config(**kw) -> SamplingConfig:
    base = dict(max_denoising_steps=6, max_new_tokens=16, eos_token_ids=(EOS_A, EOS_B), pad_token_id=PAD)
    return SamplingConfig(**{**base, **kw})


def test_canvases_positions_commits_and_statistics():
    model = MockModel(canvas_length=8)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    result = generate(model, prompts, config(max_new_tokens=20), seed=0)

    assert result.num_canvases == 3  # ceil(20 / 8), not capped to one canvas
    assert result.sequences.shape == (2, 20)
    for row in range(2):
        assert result.tokens[row] == model.targets(row, 20)
        assert result.sequences[row].tolist() == model.targets(row, 20)
    assert result.finish_reasons == ["length", "length"]
    # the prompt is left-padded with its padding masked; then two committed canvases (none after the last)
    first = model.encodes[0]
    assert first["ids"].tolist() == [[PAD, PAD, 5, 6, 7], [9, 10, 11, 12, 13]]
    assert first["mask"].tolist() == [[False, False, True, True, True], [True] * 5]
    assert [e["start"] for e in model.encodes] == [0, 5, 13]
    for canvas_index, e in enumerate(model.encodes[1:]):
        assert bool(e["mask"].all())
        assert e["ids"].tolist() == [model.targets(r, 24)[8 * canvas_index : 8 * canvas_index + 8] for r in range(2)]
    # every canvas is denoised at the next columns; a sharp model stops after 2 steps (stable + confident)
    assert [d["start"] for d in model.denoises] == [5, 5, 13, 13, 21, 21]
    assert result.steps_per_canvas == [[2, 2, 2], [2, 2, 2]]
    assert result.tokens_per_forward == [24 / 6, 24 / 6]  # whole canvases' non-pad tokens / forwards
    assert 0 < result.time_to_first_canvas_s <= result.elapsed_s
    assert result.tokens_per_second > 0 and result.seed == 0


def test_a_batch_gives_each_row_its_solo_tokens():
    prompts = [[4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    batch = generate(MockModel(), prompts, config(max_new_tokens=24), seed=1)
    for row, prompt in enumerate(prompts):
        solo = generate(MockModel(), [prompt], config(max_new_tokens=24), seed=1)
        assert solo.tokens[0] == batch.tokens[row]


def test_eos_pads_the_rest_and_rows_finish_on_their_own():
    # row 0 ends inside the first canvas (EOS id 1), row 1 inside the second (EOS id 3)
    model = MockModel(canvas_length=8, eos_at={0: 5, 1: 13}, eos_id={0: EOS_A, 1: EOS_B})
    streamed = []
    result = generate(model, [[4, 5, 6], [7, 8]], config(max_new_tokens=64), seed=0,
                      on_canvas=lambda i, new, done: streamed.append((i, new, done)))

    assert result.num_canvases == 2  # stops when every row has an EOS, long before 64 tokens
    assert result.sequences.shape == (2, 16)
    assert result.sequences[0].tolist() == model.targets(0, 5) + [EOS_A] + [PAD] * 10
    assert result.sequences[1].tolist() == model.targets(1, 13) + [EOS_B] + [PAD] * 2
    assert result.tokens == [model.targets(0, 5), model.targets(1, 13)]
    assert result.finish_reasons == ["stop", "stop"]
    # the committed first canvas, as encoded into the cache, already has pad after the EOS
    assert model.encodes[1]["ids"][0].tolist() == model.targets(0, 5) + [EOS_A, PAD, PAD]
    # row 0 stopped generating after canvas 0: no steps, no forwards, no tokens counted afterwards
    assert result.steps_per_canvas == [[2], [2, 2]]
    assert result.tokens_per_forward == [6 / 2, 14 / 4]
    # streaming: one call per canvas; a row's pieces concatenate to its tokens
    assert [s[0] for s in streamed] == [0, 1]
    assert streamed[0][2] == [True, False] and streamed[1][2] == [True, True]
    assert streamed[1][1][0] == []
    for row in range(2):
        assert sum((s[1][row] for s in streamed), []) == result.tokens[row]


def test_max_new_tokens_cuts_inside_a_canvas():
    model = MockModel(canvas_length=8, eos_at={0: 14})  # the EOS lies beyond the cut
    result = generate(model, [[4, 5]], config(max_new_tokens=13), seed=0)
    assert result.num_canvases == 2
    assert result.sequences.shape == (1, 13)
    assert result.tokens[0] == model.targets(0, 13)
    assert result.finish_reasons == ["length"]
    # the reference's metric counts the whole committed canvases: 8 + 7 (incl. the EOS), pad excluded
    assert result.tokens_per_forward == [15 / 4]


def test_fixed_steps_runs_every_step_and_finished_rows_stay_out():
    model = MockModel(canvas_length=8, eos_at={0: 2})
    result = generate(model, [[4], [5]], config(max_new_tokens=16, max_denoising_steps=5, fixed_steps=True), seed=0)
    assert result.steps_per_canvas == [[5], [5, 5]]
    assert len(model.denoises) == 10
    assert result.tokens_per_forward == [3 / 5, 16 / 10]


def test_rows_stop_on_their_own_and_stopped_rows_are_frozen():
    # row 0 is sharp (stops after step 2), row 1 is flat (never confident: runs all 6 steps); from the
    # third call on the model changes its mind, which only the still-running row 1 may see
    model = MockModel(canvas_length=8, margin=(30.0, 0.5), drift_after=2)
    drafts = []
    result = generate(model, [[4, 5], [6, 7]], config(max_new_tokens=8), seed=3,
                      on_draft=lambda step, argmax, entropy, accepted: drafts.append((step, argmax.clone())))
    assert result.steps_per_canvas == [[2], [6]]
    assert [d[0] for d in drafts] == list(range(6))
    for _step, argmax in drafts[1:]:
        assert torch.equal(argmax[0], drafts[1][1][0])  # frozen after it stopped
    frozen_canvas = model.denoises[2]["canvas"][0]
    for call in model.denoises[2:]:
        assert torch.equal(call["canvas"][0], frozen_canvas)
    assert result.tokens[0] == model.targets(0, 8)


def test_self_conditioning_is_the_softmax_of_the_previous_steps_temperature_scaled_logits():
    """Each step's forward reads the embedding of softmax(previous logits / T), made after the sampler left those
    probabilities in the logits buffer; the buffer is gone before the next forward (its logits would otherwise be a
    second (B, L, V) buffer at the LM head, a step's peak memory), and the last step of a canvas is embedded by nobody."""
    model = MockModel(canvas_length=8, margin=(0.7,))  # never stops: 6 steps per canvas
    sampling = config(max_new_tokens=16)
    generate(model, [[4, 5, 6]], sampling, seed=0)
    calls = model.denoises
    assert len(calls) == 12
    assert [source for source, _ in model.embeddings] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    for canvas_start in (0, 6):
        assert calls[canvas_start]["sc"] is None  # fresh canvas: no signal
        for step in range(1, 6):
            previous, current = calls[canvas_start + step - 1], calls[canvas_start + step]
            temperature = temperature_schedule(step - 1, 6, sampling.t_min, sampling.t_max)
            assert current["sc_from"] == canvas_start + step - 1
            expected = torch.softmax(previous["raw"] / temperature, dim=-1)
            torch.testing.assert_close(current["sc"], expected, rtol=1e-6, atol=1e-7)
    assert all(call["alive"] == [] for call in calls)


def test_canvas_template_is_never_changed():
    L, V = 8, 32
    model = MockModel(canvas_length=L, vocab_size=V, margin=(0.3,))  # flat: lots of sampling and re-noising
    B, W = 2, 12  # the template reaches into the second canvas
    g = torch.Generator().manual_seed(0)
    fixed = torch.rand(B, W, generator=g) < 0.5
    fixed[:, 9] = True
    fixed_tokens = torch.randint(FIRST_PLAIN, V, (B, W), generator=g)
    drafts = []
    result = generate(model, [[4, 5], [6]], config(max_new_tokens=16), seed=0,
                      canvas_template=CanvasTemplate(fixed, fixed_tokens),
                      on_draft=lambda step, argmax, entropy, accepted: drafts.append((argmax, entropy, accepted)))
    assert torch.equal(result.sequences[:, :W][fixed], fixed_tokens[fixed])
    for call in model.denoises:
        start = call["start"] - 2  # generated index of the canvas's first column (prompt width 2)
        f = fixed[:, start : start + L]
        canvas = call["canvas"][:, : f.shape[1]]
        assert torch.equal(canvas[f], fixed_tokens[:, start : start + L][f])
    first_fixed = fixed[:, :L]
    for argmax, entropy, accepted in drafts[:6]:  # first canvas
        assert torch.equal(argmax[first_fixed], fixed_tokens[:, :L][first_fixed])
        assert bool((entropy[first_fixed] == 0).all()) and bool(accepted[first_fixed].all())
    free_outputs = result.sequences[:, :W][~fixed]
    assert not torch.equal(free_outputs, fixed_tokens[~fixed])


def test_same_seed_same_tokens_and_the_seed_sources():
    def run(call_seed=None, **kw):
        sampling = config(max_new_tokens=24, **kw)
        return generate(MockModel(mode="copy"), [[4, 5], [6, 7, 8]], sampling, seed=call_seed)

    a, b, c = run(7), run(7), run(8)
    assert a.tokens == b.tokens and a.seed == 7
    assert a.tokens != c.tokens
    assert run(seed=7).tokens == a.tokens  # SamplingConfig.seed is used when no seed is passed
    torch.manual_seed(123)
    d = run()
    torch.manual_seed(123)
    e = run()
    assert d.tokens == e.tokens and d.seed == e.seed  # no seed anywhere: drawn from torch's global RNG


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        generate(MockModel(), [[4], []], config())
    with pytest.raises(ValueError, match="canvas template"):
        generate(MockModel(), [[4]], config(), canvas_template=CanvasTemplate(
            torch.ones(2, 8, dtype=torch.bool), torch.zeros(2, 8, dtype=torch.long)))


# -- against transformers' own generate loop, on a tiny random checkpoint ----------------------------
@pytest.mark.slow
def test_matches_transformers_generate_with_shared_randomness(tmp_path, monkeypatch):
    """Our loop vs DiffusionGemmaForBlockDiffusion.generate on the same random weights. The reference
    draws with torch.multinomial and torch.randint from the global RNG; both are rerouted here to our
    inverse-CDF draws and our generator, drawn in the same order, so the tokens themselves must agree."""
    pytest.importorskip("dgemma.model")
    import dgemma
    from dgemma.generation import left_pad
    from dgemma.sampling import chunk_rows, sample_from_probs
    from tests.conftest import make_hf_model

    reference = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    hf = make_hf_model("alternating", canvas_length=16, seed=0)
    hf.save_pretrained(tmp_path)
    model = dgemma.load_model(tmp_path)
    V, L = model.config.vocab_size, model.config.canvas_length
    prompts = [[2, 10, 11, 12, 13, 14, 15], [2, 20, 21], [2, 30, 31, 32, 33]]  # different lengths
    eos_ids, seed, max_new_tokens = (127, 50), 7, 40
    sampling = SamplingConfig(max_denoising_steps=4, max_new_tokens=max_new_tokens, eos_token_ids=eos_ids,
                              pad_token_id=PAD)
    ours = generate(model, prompts, sampling, seed=seed)

    generator = torch.Generator().manual_seed(seed)
    rows_per_chunk = chunk_rows(V)

    def multinomial(probs, num_samples):  # (B*L, V) -> (B*L, 1), over the same chunks as sampler_step
        chunks = [sample_from_probs(probs[i : i + rows_per_chunk], generator)
                  for i in range(0, probs.shape[0], rows_per_chunk)]
        return torch.cat(chunks)[:, None]

    def initialize_canvas(self, batch_size, device):
        return torch.randint(0, self.vocab_size, (batch_size, self.canvas_length), generator=generator, device=device)

    monkeypatch.setattr(torch, "multinomial", multinomial)
    monkeypatch.setattr(reference.EntropyBoundSampler, "initialize_canvas", initialize_canvas)
    input_ids, attention_mask = left_pad(prompts, PAD, "cpu")
    expected = hf.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
        pad_token_id=PAD, max_denoising_steps=sampling.max_denoising_steps, t_min=sampling.t_min, t_max=sampling.t_max,
        stability_threshold=sampling.stability_threshold, confidence_threshold=sampling.confidence_threshold,
        sampler_config=reference.EntropyBoundSamplerConfig(entropy_bound=sampling.entropy_bound),
    )
    generated = expected.sequences[:, input_ids.shape[1] :]  # whole canvases, pad after EOS

    assert ours.num_canvases == generated.shape[1] // L == 3
    assert torch.equal(ours.sequences, generated[:, :max_new_tokens])
    assert ours.tokens_per_forward == pytest.approx(expected.tokens_per_forward.tolist())
    # the case mix this seed produces: one row runs out of tokens, two end at an EOS; a random model never
    # gets confident, so every canvas takes all steps
    assert ours.finish_reasons == ["length", "stop", "stop"]
    assert ours.steps_per_canvas[0] == [4, 4, 4]
    assert all(steps == [4] * len(steps) for steps in ours.steps_per_canvas)
