"""The compile policy: which commands compile by default, the warm-cache marker, and the fall back to eager
(with one warning line) where compiling is unavailable or fails."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

import dgemma
from dgemma.commands._common import add_compile_arguments, wants_compile
from dgemma.compilation import policy, steps
from dgemma.config import SamplingConfig
from dgemma.engine import Engine


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()


def _args(by_default, *flags):
    p = argparse.ArgumentParser()
    add_compile_arguments(p, by_default=by_default)
    return p.parse_args(list(flags))


def test_compile_policy_flags_environment_and_warm_cache(model, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DGEMMA_EAGER", raising=False)
    # serve, chat, bench: compiled unless --eager (or DGEMMA_EAGER=1)
    assert wants_compile(_args(True), model) and not wants_compile(_args(True, "--eager"), model)
    # generate, sudoku solve and eval: with --compile, or once this model's compiled step is in the cache
    assert not wants_compile(_args("warm"), model) and wants_compile(_args("warm", "--compile"), model)
    with pytest.raises(SystemExit):
        _args(True, "--eager", "--compile")
    assert not policy.is_warm(model)
    policy.mark_warm(model, policy.default_mode(model.device))
    assert policy.is_warm(model) and wants_compile(_args("warm"), model)
    assert not wants_compile(_args("warm", "--compile-mode", "max-autotune"), model)  # another mode: cold
    assert not policy.is_warm(copy.deepcopy(model).to(torch.bfloat16))  # another dtype: cold
    monkeypatch.setenv("DGEMMA_EAGER", "1")
    assert not wants_compile(_args(True), model) and not wants_compile(_args("warm"), model)
    assert wants_compile(_args(True, "--compile"), model)
    # a big model on a CPU: eager unless asked or already compiled once (the tiny one stands in for it)
    monkeypatch.delenv("DGEMMA_EAGER")
    monkeypatch.setattr(policy, "CPU_EAGER_ABOVE_PARAMS", model.config.param_counts()["total"] - 1)
    big = copy.deepcopy(model).to(torch.bfloat16)
    assert not wants_compile(_args(True), big) and wants_compile(_args(True, "--compile"), big)
    policy.mark_warm(big, policy.default_mode(big.device))
    assert wants_compile(_args(True), big)
    # the mode by device (a CUDA device needs no GPU to be named)
    assert policy.default_mode("cpu") == "max-autotune-no-cudagraphs"
    assert policy.default_mode("cuda") == "default"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    assert policy.cache_dir() == tmp_path / "user" / "dgemma" / "torchinductor"
    # inductor writes its /tmp default into TORCHINDUCTOR_CACHE_DIR once asked: that is not the user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(policy, "_USER_CACHE_DIR", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert policy.cache_dir() == tmp_path / "user" / "dgemma" / "torchinductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    assert policy.cache_dir() == tmp_path / "chosen"


def test_compiling_unavailable_or_failing_runs_eagerly_after_one_warning(model, monkeypatch, tmp_path, capfd):
    """No C++ compiler: refused before tracing. A compile that raises (the compiler check passed, the
    compiler did not): the step runs eagerly from then on. Either way one warning line and the eager
    tokens; nothing marks the cache warm."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    s = SamplingConfig(max_new_tokens=32, eos_token_ids=(1,), max_denoising_steps=3)
    prompts = [[5, 6, 7], [9, 8]]
    eager = [r.tokens for r in Engine(model, max_batch=2).generate(prompts, s, seeds=[3, 4])]
    torch._dynamo.reset()  # no compiled code of other tests' models
    no_compiler = torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")})
    with no_compiler, temporary_cache_dir(str(tmp_path)):  # an empty cache: inductor needs its compiler
        refused = steps.compile_model(copy.deepcopy(model))
        assert not steps.is_compiled(refused)
        assert [r.tokens for r in Engine(refused, max_batch=2).generate(prompts, s, seeds=[3, 4])] == eager
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("warning: torch.compile unavailable") and "C++" in err[0], err

        monkeypatch.setattr(steps, "unavailable_reason", lambda device: None)
        failing = steps.compile_model(copy.deepcopy(model))
        assert steps.is_compiled(failing)  # compiles lazily, at the first step
        assert [r.tokens for r in Engine(failing, max_batch=2).generate(prompts, s, seeds=[3, 4])] == eager
        assert not steps.is_compiled(failing)
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("warning: torch.compile unavailable") and "failed" in err[0], err
        assert not policy.is_warm(failing)
    torch._dynamo.reset()


def test_training_compiles_when_the_run_pays_the_compile_back():
    """Compiled training pays back its compile only over enough steps: the sudoku recipe's 30 and 200 steps
    stay eager with an empty cache, 300 compile; with this shape's entry in the cache (warm) the compile is
    cheaper and 200 steps compile. More work per step pays back sooner; a model above a billion parameters
    stays eager. The choice says why."""
    import json
    from pathlib import Path

    from dgemma.training.model_setup import config_from_init

    recipe = config_from_init(str(Path(__file__).parents[1] / "scripts" / "sudoku-model.json"), {})
    tokens = 64 * 163  # batch 64 x (82 prompt + 81 canvas tokens)
    assert json.loads((Path(__file__).parents[1] / "scripts" / "sudoku-model.json").read_text())["hidden_size"] == 128

    def choose(steps, warm=False, config=recipe, tokens_per_step=tokens):
        return policy.training_choice(config, steps=steps, tokens_per_step=tokens_per_step, warm=warm)

    assert not choose(30) and not choose(200) and choose(300)
    assert "30 steps do not pay back" in str(choose(30)) and str(choose(30)).startswith("eager (")
    assert str(choose(300)).startswith("compiled (300 steps pay back")
    assert choose(200, warm=True) and not choose(30, warm=True) and "in the compile cache" in str(choose(200, True))
    assert choose(200, tokens_per_step=4 * tokens)  # four times the work per step: pays back sooner
    big = recipe.replace(hidden_size=8192, intermediate_size=32768)
    assert big.param_counts()["total"] > policy.CPU_EAGER_ABOVE_PARAMS
    assert not choose(100_000, warm=True, config=big) and "parameters" in str(choose(100_000, config=big))


def test_training_shape_and_the_warm_marker_follow_the_step(model, monkeypatch, tmp_path):
    """The training marker is keyed by the step's shape: another batch or precision is cold."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    shape = policy.training_shape(objective="diffusion", batch=64, length=163, precision="bf16", lora=False)
    assert not policy.is_warm(model, "training", shape)
    policy.mark_warm(model, "training", shape)
    assert policy.is_warm(model, "training", shape)
    for other in (dict(batch=32), dict(precision="fp32")):
        changed = {**dict(objective="diffusion", batch=64, length=163, precision="bf16", lora=False), **other}
        assert not policy.is_warm(model, "training", policy.training_shape(**changed))
    assert not policy.is_warm(model, policy.default_mode(model.device), shape)  # generation's mode


def test_solve_after_an_eval_compiled_another_shape_runs_eagerly(monkeypatch, tmp_path, capsys):
    """`sudoku eval` marked its shape (batch 32) warm: a `sudoku solve` (batch 1) must not compile, and says
    so on its start line; once solve's own shape is in the cache it compiles. No real compile here:
    compile_model is replaced by a recorder."""
    from dgemma import cli
    from dgemma.compilation.policy import engine_shape
    from dgemma.tasks.sudoku_eval import MAX_LENGTH
    from dgemma.tasks.sudoku_models import SHIPPED
    from dgemma.weights.hub import load_model

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DGEMMA_EAGER", raising=False)
    shipped = load_model(SHIPPED, dtype=torch.float32)
    mode = policy.default_mode("cpu")
    policy.mark_warm(shipped, mode, engine_shape(32, MAX_LENGTH))  # what a compiled eval leaves
    compiled = []
    monkeypatch.setattr(steps, "compile_model", lambda model, *a, **k: compiled.append(k) or model)
    solve = ["sudoku", "solve", "--no-live", "--steps", "2"]
    assert cli.main(solve) in (0, 1)
    assert not compiled
    err = capsys.readouterr().err
    assert "step: eager (this shape (batch 1, length" in err and "not in the compile cache" in err, err
    policy.mark_warm(shipped, mode, engine_shape(1, MAX_LENGTH))  # what a compiled solve leaves
    assert cli.main(solve) in (0, 1)
    assert compiled == [{"shape": engine_shape(1, MAX_LENGTH)}]
    assert "step: compiled (this shape (batch 1, length" in capsys.readouterr().err


def test_an_eager_step_ignores_a_compile_on_another_thread(monkeypatch):
    """torch.compiler.is_compiling() is one flag for the whole process, True on every thread while any thread
    compiles; a server compiles its step on a thread while its engine thread answers eagerly. The model's
    compiled-only branches (GELU's form, the fused projections, the head, the experts' routing, the sampler's
    argmax) ask is_dynamo_compiling instead, so an eager step is the same bits during another thread's compile."""
    from dgemma.generation import generate

    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()  # fp32: the GELU forms differ in the last bits
    L, V = model.config.canvas_length, model.config.vocab_size
    prompt, canvas = torch.randint(3, V, (2, 8)), torch.randint(3, V, (2, L))

    def step():
        with torch.no_grad():
            cache = model.new_cache(2, 8 + L)
            model.encode(prompt, cache, return_logits=False)
            logits = model.denoise(canvas, cache)
        tokens = generate(model, [[5, 6, 7], [8, 9]], model.sampling_config.replace(max_denoising_steps=4), seed=3)
        return logits, tokens.tokens

    alone = step()
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what every thread reads while one compiles
    assert torch.compiler.is_compiling()
    during = step()
    assert torch.equal(during[0], alone[0]) and during[1] == alone[1]
