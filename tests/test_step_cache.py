"""The step cache (dgemma.generation.step_cache, DiffusionGemma.decode_active): packed positions give what the
whole canvas gives, settled positions keep their keys/values, and the settle rule."""

from __future__ import annotations

import pytest
import torch

import dgemma
from dgemma.model import PreviousStep
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
