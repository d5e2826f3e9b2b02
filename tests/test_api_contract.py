"""The public Python API as README's "Use it from Python" shows it, run as written, and the forms 0.1 had that
0.2 keeps for one release behind a DeprecationWarning (CHANGELOG.md)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import dgemma
from dgemma.model import DiffusionGemma, PreviousStep

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_example() -> str:
    section = README.read_text().split("## Use it from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_runs_as_written(tmp_path):
    """Only the model's name (a tiny local folder for the hub id) and the device (no GPU here) are replaced; a
    DeprecationWarning fails the test, so the README shows the current API."""
    # a canvas of 256 (the example asks for 512 tokens: two canvases) and 4 steps in its generation_config.json
    model = DiffusionGemma(dgemma.get_preset("tiny").replace(canvas_length=256),
                           dgemma.SamplingConfig(max_denoising_steps=4, eos_token_ids=(1,)))
    dgemma.save_pretrained(model, tmp_path / "tiny")
    code = readme_python_example()
    assert '"google/diffusiongemma-26B-A4B-it"' in code and 'device="cuda"' in code
    code = code.replace('"google/diffusiongemma-26B-A4B-it"', repr(str(tmp_path / "tiny"))).replace(
        'device="cuda"', 'device="cpu"').replace('"out"', repr(str(tmp_path / "out")))
    L = model.config.canvas_length
    g = torch.Generator().manual_seed(0)
    names = {"input_ids": torch.randint(0, 128, (1, 5), generator=g), "canvas_ids": torch.randint(0, 128, (1, L), generator=g),
             "prompt_ids": [5, 6, 7]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        with torch._dynamo.config.patch(disable=True):  # compile_model as written, without a minute of compiling
            exec(compile(code, str(README), "exec"), names)
    assert [str(w.message) for w in caught if "dgemma" in str(w.message)] == []
    assert len(names["requests"][0].tokens) > 0 and (tmp_path / "out" / "config.json").is_file()


def test_self_conditioning_logits_still_works_with_a_deprecation_warning():
    model = DiffusionGemma(dgemma.get_preset("tiny")).eval()
    cache = model.new_cache(batch_size=1, max_length=64)
    model.encode(torch.tensor([[3, 4, 5]]), cache)
    canvas = torch.randint(0, 128, (1, model.config.canvas_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        previous = model.denoise(canvas, cache)
        new = model.denoise(canvas, cache, self_conditioning=PreviousStep.from_logits(previous))
        with pytest.warns(DeprecationWarning, match="self_conditioning=dgemma.PreviousStep.from_logits"):
            old = model.denoise(canvas, cache, self_conditioning_logits=previous)
    assert torch.equal(old, new)
    with pytest.raises(TypeError, match="not both"):
        model.denoise(canvas, cache, self_conditioning=PreviousStep.from_logits(previous),
                      self_conditioning_logits=previous)


def test_names_that_moved_still_import_with_a_deprecation_warning():
    import dgemma.model

    for name, new in [("load_model", dgemma.load_model), ("save_pretrained", dgemma.save_pretrained),
                      ("compile_model", dgemma.compile_model)]:
        with pytest.warns(DeprecationWarning, match=f"dgemma.model.{name} has moved"):
            assert getattr(dgemma.model, name) is new
    with pytest.raises(AttributeError):
        dgemma.model.no_such_name  # noqa: B018
