"""The three samplers (dgemma.sampling.samplers) in generation: the engine gives the plain loop's tokens with each,
with templates, the prefix cache and the step cache; what each commits, when it stops, and what a DDIM corrector
sweep reads; their settings in SamplingConfig and generation_config.json."""

from __future__ import annotations

import json

import pytest
import torch

import dgemma
from dgemma.config import ConfigError, SamplingConfig
from dgemma.engine import Engine, Request
from dgemma.generation import CanvasTemplate, generate
from dgemma.sampling.block_refinement import commit_target
from tests.test_generate_loop import FIRST_PLAIN, MockModel
from tests.test_generate_loop import config as mock_config

SAMPLERS = {
    "block-refinement greedy": dict(sampler="block-refinement"),
    "block-refinement editing": dict(sampler="block-refinement", temperature=1.0, editing_threshold=0.05,
                                     commit_threshold=0.5),
    "ddim": dict(sampler="ddim", temperature=0.7),
    "ddim corrector": dict(sampler="ddim", temperature=1.0, corrector_steps=2, corrector_k=3,
                           corrector_selection="lowest_maxprob"),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()


def _sampling(**kw):
    return SamplingConfig(**{**dict(max_new_tokens=40, eos_token_ids=(1,), max_denoising_steps=7), **kw})


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20] * 20]


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_engine_equals_plain_loop_for_each_sampler(model, name):
    """Request by request the engine's tokens and steps are the plain loop's, a template's fixed positions
    included, and a sampler's tokens are not another's (the setting reaches the sampler in both paths)."""
    s = _sampling(**SAMPLERS[name])
    fixed = torch.zeros(24, dtype=torch.bool)
    fixed[::3] = True
    tokens = torch.arange(24) % 90 + 10
    templates = [(None, None), (fixed, tokens), (None, None)]
    plain = [generate(model, [p], s, seed=40 + i, canvas_template=None if t[0] is None else CanvasTemplate(
        t[0][None], t[1][None])) for i, (p, t) in enumerate(zip(PROMPTS, templates))]
    requests = Engine(model, max_batch=2, max_length=256).generate(PROMPTS, s, seeds=[40, 41, 42],
                                                                  templates=templates)
    for p, r in zip(plain, requests):
        assert (r.tokens, r.steps_per_canvas, r.finish_reason) == (p.tokens[0], p.steps_per_canvas[0],
                                                                   p.finish_reasons[0])
    assert torch.equal(plain[1].sequences[0, :24][fixed], tokens[fixed])
    entropy_bound = generate(model, [PROMPTS[0]], _sampling(), seed=40)
    assert entropy_bound.tokens[0] != plain[0].tokens[0]


@pytest.mark.parametrize("name", ["block-refinement editing", "ddim", "ddim corrector"])
def test_prefix_cache_and_step_cache_with_each_sampler(model, name):
    """The prefix cache changes no token with any sampler; the step cache, with the samplers it works with, gives
    the plain loop's tokens with the step cache (and is refused in one line with DDIM's corrector)."""
    s = _sampling(**SAMPLERS[name])
    prompt = PROMPTS[0]
    plain = generate(model, [prompt], s, seed=3)
    engine = Engine(model, max_batch=2, max_length=256, prefix_cache_bytes=1 << 24)
    first = engine.generate([prompt], s, seeds=[3])[0]
    again = engine.generate([prompt + plain.tokens[0][:16] + [7]], s, seeds=[4])[0]
    assert first.tokens == plain.tokens[0]
    assert again.state.cached_tokens > 0
    assert again.tokens == generate(model, [prompt + plain.tokens[0][:16] + [7]], s, seed=4).tokens[0]
    if s.corrector_steps:
        with pytest.raises(ConfigError, match=r"DDIM's corrector sweeps \(corrector_steps > 0\) cannot run with the step cache"):
            s.replace(step_cache=True)
        return
    cached = s.replace(step_cache=True, settle_probability=0.0, settle_steps=1)
    with_cache = generate(model, [prompt], cached, seed=3)
    assert sum(with_cache.decoder_positions) < sum(plain.decoder_positions)
    assert Engine(model, max_batch=2, max_length=256).generate([prompt], cached, seeds=[3])[0].tokens == \
        with_cache.tokens[0]


def test_block_refinement_commits_its_canvas_and_edits_what_the_model_changes_its_mind_about():
    """A flat model (never confident) whose every peak moves after the third forward: without editing, the
    positions committed before the move keep their old tokens and the rest take the new ones; with editing, every
    committed token is replaced by the new prediction. Each step commits the quota, no more."""
    L, steps = 8, 6
    results, commits = {}, {}
    for editing in (0.0, 0.04):
        model = MockModel(canvas_length=L, margin=(0.5,), drift_after=3)
        counts, drafts = [], []
        sampling = mock_config(sampler="block-refinement", max_denoising_steps=steps, max_new_tokens=L,
                               editing_threshold=editing)
        results[editing] = generate(model, [[4, 5]], sampling, seed=0, on_draft=lambda step, draft, entropy, accepted,
                                    counts=counts, drafts=drafts: counts.append(int(accepted.sum())) or
                                    drafts.append(draft[0].tolist()))
        commits[editing] = counts
        assert drafts[-1] == results[editing].tokens[0]  # the last draft shows what the canvas commits
        old = model.targets(0, L)
    new = [FIRST_PLAIN + (t + 1 - FIRST_PLAIN) % (32 - FIRST_PLAIN) for t in old]
    expected_counts = [int(commit_target(i, steps, torch.tensor(L))) for i in range(steps)]
    assert commits[0.0] == commits[0.04] == expected_counts
    first_three = expected_counts[2]  # committed by the forwards before the move
    kept = results[0.0].tokens[0]
    assert sum(a == b for a, b in zip(kept, old)) == first_three
    assert sum(a == b for a, b in zip(kept, new)) == L - first_three
    assert results[0.04].tokens[0] == new


@pytest.mark.parametrize("sampler", ["block-refinement", "ddim"])
def test_a_row_the_stop_rule_ends_commits_its_argmax(sampler):
    """A sharp model stops after two steps (stable and confident); the canvas then still holds noise where
    the sampler has not committed yet, and what it commits is the argmax draft, as the pipeline does."""
    model = MockModel(canvas_length=8, margin=(30.0,))
    result = generate(model, [[4, 5]], mock_config(sampler=sampler, max_denoising_steps=8, max_new_tokens=16), seed=1)
    assert result.steps_per_canvas == [[2, 2]]
    assert result.tokens[0] == model.targets(0, 16)
    assert any(call["canvas"][0].tolist() != model.targets(0, 16)[:8] for call in model.denoises[:2])


def test_corrector_sweeps_read_the_last_predictor_steps_self_conditioning():
    """DDIM with one sweep and 7 forwards: predictor, sweep, predictor, sweep, predictor, sweep, predictor. A
    sweep's forward reads the canvas the predictor left and that predictor step's probabilities; the next
    predictor step reads them too (a sweep's logits condition nothing); the budget is exactly 7 forwards."""
    model = MockModel(canvas_length=8, margin=(0.5,))
    sampling = mock_config(sampler="ddim", max_denoising_steps=7, max_new_tokens=8, corrector_steps=1, corrector_k=2)
    drafts = []
    result = generate(model, [[4, 5]], sampling, seed=0, on_draft=lambda *a: drafts.append(a))
    calls = model.denoises
    assert result.steps_per_canvas == [[7]] and len(calls) == 7
    assert calls[0]["sc"] is None
    for sweep in (1, 3, 5):
        assert calls[sweep]["sc_from"] == sweep - 1  # the predictor's buffer, now its probabilities, embedded
        assert calls[sweep + 1]["sc"] is calls[sweep]["sc"]  # the same embedding: a sweep's buffer embeds nothing
        changed = (calls[sweep + 1]["canvas"] != calls[sweep]["canvas"]).sum()
        assert 0 <= int(changed) <= 2  # a sweep redraws 2 positions, the rest held
    assert len(drafts) == 7
    assert all(call["alive"] == [] for call in calls)  # no earlier step's buffer held into a forward


def test_sampler_settings_in_the_config_and_generation_config_json(tmp_path):
    default = SamplingConfig()
    assert default.sampler == "entropy-bound" and "dgemma" not in default.to_hf_dict()
    ddim = SamplingConfig(sampler="ddim", temperature=0.5, corrector_steps=2, corrector_k=4,
                          corrector_selection="random", corrector_selection_tau=0.5)
    written = ddim.to_hf_dict()
    assert written["dgemma"]["sampler"] == "ddim" and written["dgemma"]["corrector_steps"] == 2
    assert "step_cache" not in written["dgemma"]  # only the sections that differ from their defaults
    assert written["sampler_config"]["_cls_name"] == "EntropyBoundSamplerConfig"  # transformers still loads it
    loaded = SamplingConfig.from_hf_dict(json.loads(json.dumps(written)))
    assert loaded == ddim
    assert SamplingConfig.from_hf_dict(written, sampler="block-refinement").sampler == "block-refinement"
    for bad, message in [(dict(sampler="beam"), "sampler must be one of entropy-bound, block-refinement, ddim"),
                         (dict(temperature=-1.0), "temperature must be >= 0"),
                         (dict(corrector_k=0), "corrector_k must be >= 1"),
                         (dict(corrector_selection="best"), "corrector_selection must be one of"),
                         (dict(editing_threshold=float("nan")), "editing_threshold must be >= 0")]:
        with pytest.raises(ConfigError, match=message):
            SamplingConfig(**bad)
    # a model folder keeps the setting (save_pretrained -> load_model)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    model.sampling_config = ddim
    dgemma.save_pretrained(model, tmp_path)
    assert dgemma.load_model(tmp_path).sampling_config.sampler == "ddim"


# -- the command line -------------------------------------------------------------------------------------
def _main(capsys, *args) -> tuple[int, str, str]:
    from dgemma.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_and_chat_take_each_sampler_and_its_settings(tiny_model_dir, capsys):
    model = str(tiny_model_dir)
    code, out, err = _main(capsys, "generate", "--model", model, "--prompt", "hello world", "--max-new-tokens", "20",
                           "--seed", "1", "--json", "--sampler", "ddim", "--steps", "5", "--corrector-steps", "1",
                           "--corrector-k", "2", "--temperature", "0.5")
    assert code == 0, err
    result = json.loads(out)
    assert result["steps_per_canvas"] == [5, 5]  # random weights never stop early: the budget is 5 forwards
    code, out, err = _main(capsys, "generate", "--model", model, "--prompt", "hello world", "--max-new-tokens", "20",
                           "--seed", "1", "--json", "--sampler", "block-refinement", "--steps", "4",
                           "--editing-threshold", "0.5")
    assert code == 0, err
    assert json.loads(out)["steps_per_canvas"] == [4, 4]
    with pytest.MonkeyPatch.context() as patch:
        import io
        import sys

        patch.setattr(sys, "stdin", io.StringIO("hello\n"))
        code, out, err = _main(capsys, "chat", "--model", model, "--max-new-tokens", "16", "--steps", "3",
                               "--sampler", "block-refinement", "--eager")
    assert code == 0, err


@pytest.mark.parametrize("args, message", [
    (["--sampler", "block-refinement", "--corrector-steps", "1"],
     "--corrector-steps: a setting of the ddim sampler, not of block-refinement"),
    (["--temperature", "0.5"], "--temperature: a setting of the block-refinement and ddim samplers, not of entropy-bound"),
    (["--sampler", "ddim", "--entropy-bound", "0.3"], "--entropy-bound: a setting of the entropy-bound sampler, not of ddim"),
    (["--sampler", "ddim", "--corrector-steps", "1", "--step-cache", "on"],
     "DDIM's corrector sweeps (corrector_steps > 0) cannot run with the step cache"),
    (["--ar", "--sampler", "ddim"], "--sampler works with the diffusion samplers, not with --ar"),
    (["--sampler", "beam"], "invalid choice: 'beam'"),
    (["--sampler", "ddim", "--corrector-selection", "best"], "invalid choice: 'best'"),
    (["--sampler", "ddim", "--corrector-selection-tau", "0"], "must be > 0"),
])
def test_a_setting_the_chosen_sampler_does_not_read_is_one_line_and_exit_2(tiny_model_dir, capsys, args, message):
    from dgemma.cli import main

    try:
        code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) in (1, 2)  # argparse adds its usage line


def test_sudoku_eval_with_each_sampler_on_the_shipped_model(tmp_path, capsys):
    from dgemma.tasks import sudoku

    puzzles = tmp_path / "p.txt"
    puzzles.write_text("\n".join(sudoku.grid_to_string(e.puzzle)
                                 for e in sudoku.generate_examples(4, givens=(40, 45), seed=3)))
    solved = {}
    for args in (["--sampler", "block-refinement", "--steps", "12"], ["--sampler", "ddim", "--steps", "12"],
                 ["--sampler", "ddim", "--steps", "12", "--corrector-steps", "1"]):
        code, out, err = _main(capsys, "sudoku", "eval", "--file", str(puzzles), "--batch", "4", "--eager", *args)
        assert code == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["forwards_per_puzzle"] <= 12
        solved[" ".join(args)] = result["solved"]
    assert all(n >= 3 for n in solved.values()), solved  # easy puzzles: the model solves them with any sampler


def test_bench_times_several_samplers_side_by_side(capsys):
    code, out, err = _main(capsys, "bench", "--config", "tiny", "--batch", "1", "--steps", "2", "--repeats", "1",
                           "--prompt-len", "8", "--eager", "--no-startup", "--no-ar", "--no-adaptive",
                           "--sampler", "entropy-bound,block-refinement,ddim")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    systems = {r["system"] for r in result["results"]}
    assert {"engine-fixed", "engine-fixed-block-refinement", "engine-fixed-ddim", "transformers"} <= systems
    assert set(result["sampler_speed"]) == {"block-refinement", "ddim"} and result["sampler"] == "entropy-bound"
    code, out, err = _main(capsys, "bench", "--config", "tiny", "--batch", "1", "--steps", "2", "--repeats", "1",
                           "--prompt-len", "8", "--eager", "--no-startup", "--no-ar", "--no-adaptive",
                           "--sampler", "ddim")
    assert code == 0, err
    assert "transformers: skipped (its generate samples with the entropy bound, not ddim)" in err
    assert {r["system"] for r in json.loads(out.strip().splitlines()[-1])["results"]} == {"engine-fixed"}


# -- the server -----------------------------------------------------------------------------------------
DRAFT_MARKS = ((dict(sampler="ddim", corrector_steps=1, corrector_k=3, temperature=1.0), "corrected"),
               (dict(sampler="block-refinement", editing_threshold=0.01, temperature=1.0), "edited"))


def _phase(sampler: str, forward: int) -> str:
    """The phase of a canvas's `forward`-th decoder forward (1, 2, ...) at 7 steps and one DDIM corrector sweep:
    a sweep after each of the first 3 predictor steps."""
    return "corrector" if sampler == "ddim" and forward % 2 == 0 else "predictor"


@pytest.mark.parametrize("fields,mark", DRAFT_MARKS, ids=["ddim", "block-refinement"])
def test_every_forward_reports_a_draft_with_its_phase_and_its_marks(model, fields, mark):
    """In process every decoder forward reports its draft: DDIM's corrector sweeps say so and mark the k positions
    they drew again; block refinement marks the committed tokens it replaced."""
    events = []
    sampling = _sampling(max_new_tokens=16, eos_token_ids=(999,), **fields)
    request = Request(prompt=[5, 6, 7], sampling=sampling, seed=3, want_drafts=True, on_event=events.append)
    engine = Engine(model, max_batch=2)
    engine.submit(request)
    engine.run_until_done([request])
    drafts = [e for e in events if e.kind == "draft"]
    assert request.steps_per_canvas == [7] and [d.step for d in drafts] == list(range(7))
    assert [d.phase for d in drafts] == [_phase(fields["sampler"], d.step + 1) for d in drafts]
    assert any(any(getattr(d, mark)) for d in drafts), mark
    if fields["sampler"] == "ddim":
        assert [sum(d.corrected) for d in drafts] == [3 if d.phase == "corrector" else 0 for d in drafts]


def test_server_takes_the_sampler_per_request_and_streams_its_drafts(tiny_model_dir):
    """`sampler` and its settings on a request: the streamed answer equals the plain one, its drafts say each
    forward's phase (a reader the engine outpaces gets only the newest draft, never a canvas's last); OpenAI's
    temperature changes nothing with the entropy bound; the model card says the default sampler."""
    from tests.test_server import MODEL, ServerProcess

    server = ServerProcess(tiny_model_dir, api_key=None)
    try:
        client = server.client()
        assert server.client().models.retrieve(MODEL).model_extra["dgemma"]["defaults"]["sampler"] == "entropy-bound"
        for fields, _ in DRAFT_MARKS:
            body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=16, seed=3)
            extra = dict(steps=7, **fields)
            plain = client.completions.create(**body, extra_body=extra)
            drafts, text = [], ""
            for chunk in client.completions.create(**body, stream=True, extra_body={
                    **extra, "stream_options": {"include_drafts": True}}):
                choice = chunk.choices[0]
                draft = (choice.model_extra or {}).get("dgemma_draft")
                if draft:
                    drafts.append(draft)
                text += choice.text or ""
            assert text == plain.choices[0].text
            canvases = plain.model_extra["dgemma"]["canvases"]
            assert plain.model_extra["dgemma"]["steps_per_canvas"] == [7] * canvases
            for canvas in range(canvases):
                steps = [d["step"] for d in drafts if d["canvas"] == canvas]
                assert steps == sorted(set(steps)) and steps[-1] == 7 and steps[0] >= 1
            assert [d["phase"] for d in drafts] == [_phase(fields["sampler"], d["step"]) for d in drafts]
            assert all(sum(d["corrected"]) == (3 if d["phase"] == "corrector" else 0) for d in drafts)
        same = [client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=16, seed=4, **t).choices[0].text
                for t in ({}, {"temperature": 0.7})]
        assert same[0] == same[1]  # the entropy bound anneals its own temperature
    finally:
        server.stop_cleanly()


def test_serve_takes_the_default_sampler_and_refuses_a_setting_it_does_not_read(tiny_model_dir, capsys):
    from tests.test_server import MODEL, ServerProcess

    server = ServerProcess(tiny_model_dir, "--sampler", "block-refinement", "--commit-threshold", "0.5",
                           api_key=None)
    try:
        card = server.client().models.retrieve(MODEL).model_extra["dgemma"]
        assert card["defaults"]["sampler"] == "block-refinement"
        with pytest.raises(Exception, match="corrector_steps: a setting of the ddim sampler"):
            server.client().completions.create(model=MODEL, prompt="hello", max_tokens=8,
                                               extra_body={"corrector_steps": 2})
    finally:
        server.stop_cleanly()
    for args, message in ((["--corrector-steps", "1"], "--corrector-steps: a setting of the ddim sampler, not of "
                           "entropy-bound"),
                          (["--sampler", "ddim", "--corrector-steps", "1", "--step-cache", "on"],
                           "cannot run with the step cache")):
        code, _, err = _main(capsys, "serve", "--model", str(tiny_model_dir), "--port", "0", "--eager", *args)
        assert code == 2 and message in err and "Traceback" not in err, err
