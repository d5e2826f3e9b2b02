"""Prompts with images against transformers 5.23 (fp32, max abs diff <= 1e-4): encode logits over the prompt,
then denoise logits of canvases attending to it; causal and "vision" (bidirectional image) encoder masks;
one image, and a batch of images of different sizes. The reference builds its encoder masks with
`create_masks_for_generate`, as its `generate` does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import dgemma
from dgemma.images import ImageProcessor, expand_image_tokens
from dgemma.model.network import PreviousStep
from tests.conftest import make_hf_model, unperturbed_tensors

TOL = 1e-4
IMAGE, BOI, EOI = 5, 6, 7  # token ids inside the tiny vocabulary
# GQA, two layers, 4-pixel patches pooled 2 x 2, clipped linears and standardisation on
VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=160, use_clipped_linears=True, standardize=True)
PROCESSOR = ImageProcessor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)


def softcap(x, cap=30.0):
    return torch.tanh(x.float() / cap) * cap


def make_pair(bidirectional, tmp_path):
    """A transformers model with a vision tower and every parameter and buffer perturbed, and ours loaded
    from its save."""
    hf = make_hf_model(seed=3, vision=VISION, text=dict(use_bidirectional_attention=bidirectional),
                       image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)
    folder = tmp_path / f"hf-{bidirectional}"
    hf.save_pretrained(folder)
    return hf, dgemma.load_model(folder)


@pytest.fixture(scope="module", params=[None, "vision"], ids=["causal", "vision"])
def pair(request, tmp_path_factory):
    return make_pair(request.param, tmp_path_factory.mktemp("image-parity"))


def pictures(*sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def prompts(rows, counts):
    """Token rows with one IMAGE placeholder per image -> expanded rows, left-padded, and their mask."""
    it = iter(counts)
    expanded = []
    for row in rows:
        n = sum(1 for t in row if t == IMAGE)
        expanded.append(expand_image_tokens(row, [next(it) for _ in range(n)], image_token_id=IMAGE,
                                            boi_token_id=BOI, eoi_token_id=EOI))
    T = max(map(len, expanded))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in expanded])
    mask = torch.tensor([[False] * (T - len(r)) + [True] * len(r) for r in expanded])
    return ids, mask


def hf_encode(hf, ids, cache, batch, attention_mask=None):
    """The reference's encoder call as its `generate` makes it: masks from `create_masks_for_generate`
    (image tokens marked in mm_token_type_ids), positions 0.. T-1."""
    B, T = ids.shape
    positions = torch.arange(T)[None]
    masks = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=torch.empty(B, T, 0), attention_mask=attention_mask, past_key_values=cache,
        position_ids=positions, mm_token_type_ids=(ids == IMAGE).long())
    out = hf.model.encoder(input_ids=ids, pixel_values=batch.pixel_values, image_position_ids=batch.image_position_ids,
                           attention_mask=masks, past_key_values=cache, position_ids=positions)
    return softcap(hf.lm_head(out.last_hidden_state))


def compare(hf, model, rows, images):
    """Encode the prompts (with images), denoise two canvases with and without self-conditioning, committing
    the first in between; returns the encode logits (ours) for further checks."""
    from transformers.cache_utils import DynamicCache

    batch = PROCESSOR(images)
    ids, mask = prompts(rows, batch.num_soft_tokens)
    B, T = ids.shape
    V, L = model.config.vocab_size, model.config.canvas_length
    g = torch.Generator().manual_seed(1)
    hf_cache = DynamicCache(config=hf.config.text_config)
    cache = model.new_cache(B, 256)
    padded = None if bool(mask.all()) else mask
    ref = hf_encode(hf, ids, hf_cache, batch, attention_mask=padded)
    ours = model.encode(ids, cache, attention_mask=padded, pixel_values=batch.pixel_values,
                        image_position_ids=batch.image_position_ids)
    assert (ours[mask] - ref[mask]).abs().max() <= TOL
    dec_mask = torch.cat([mask, torch.ones(B, L, dtype=torch.bool)], dim=1)
    for step in range(2):
        canvas = torch.randint(0, V, (B, L), generator=g)
        for sc in (None, torch.randn(B, L, V, generator=g) * 4):
            expected = hf(decoder_input_ids=canvas, past_key_values=hf_cache, self_conditioning_logits=sc,
                          decoder_attention_mask=dec_mask if padded is not None else None).logits
            previous = None if sc is None else PreviousStep.from_logits(sc)
            assert (model.denoise(canvas, cache, self_conditioning=previous) - expected).abs().max() <= TOL
        if step == 0:  # commit the canvas (no images): the next canvas sees prompt + canvas
            if padded is not None:
                padded = dec_mask
            expected = hf(input_ids=canvas, attention_mask=padded, past_key_values=hf_cache,
                          decoder_input_ids=canvas).encoder_last_hidden_state
            committed = model.encode(canvas, cache, return_hidden=True)
            assert (model.head(committed) - softcap(hf.lm_head(expected))).abs().max() <= TOL
            dec_mask = torch.cat([dec_mask, torch.ones(B, L, dtype=torch.bool)], dim=1)
    return ours


@torch.no_grad()
def test_one_image(pair):
    hf, model = pair
    assert model.vision_tower is not None
    assert not unperturbed_tensors(hf, type(hf)(hf.config))  # clipping bounds, std_bias/std_scale, ... too
    compare(hf, model, [[2, 10, 11, IMAGE, 12, 13]], pictures((37, 53)))


@torch.no_grad()
def test_batch_of_images_of_different_sizes(pair):
    """Row 0: one image; row 1: two images of other sizes (fewer soft tokens, so row 0 is left-padded
    differently); the images' patches are padded to one budget with position -1."""
    hf, model = pair
    images = pictures((37, 53), (90, 20), (500, 30), seed=1)
    assert len({n for n in PROCESSOR(images).num_soft_tokens}) == 3
    compare(hf, model, [[2, 10, IMAGE, 11], [2, IMAGE, 12, IMAGE, 13, 14]], images)


@torch.no_grad()
def test_vision_mask_lets_an_image_see_itself_both_ways(tmp_path):
    """With "vision", an image's first soft token already sees the last one (so its logits differ from the
    causal model's with the same weights), text before the image is unchanged, and the masks are
    exactly the reference's."""
    hf_causal, causal = make_pair(None, tmp_path)
    hf_both, both = make_pair("vision", tmp_path)
    batch = PROCESSOR(pictures((37, 53)))
    ids, _ = prompts([[2, 10, 11, IMAGE, 12]], batch.num_soft_tokens)
    args = dict(pixel_values=batch.pixel_values, image_position_ids=batch.image_position_ids)
    a = causal.encode(ids, causal.new_cache(1, 128), **args)
    b = both.encode(ids, both.new_cache(1, 128), **args)
    first_image = int((ids[0] == IMAGE).nonzero()[0])
    assert torch.equal(a[:, :first_image], b[:, :first_image])
    assert (a[:, first_image] - b[:, first_image]).abs().max() > 1e-2


@torch.no_grad()
def test_quantisation_leaves_the_vision_tower_alone(pair):
    import copy

    from dgemma.quant.quantize import quantize_model

    hf, model = pair
    batch = PROCESSOR(pictures((37, 53)))
    quantised = quantize_model(copy.deepcopy(model), "int8")
    assert type(quantised.vision_tower.encoder.layers[0].mlp.up_proj.linear) is torch.nn.Linear
    assert type(quantised.embed_vision.embedding_projection) is torch.nn.Linear
    assert type(quantised.layers[0].mlp.up_proj) is not torch.nn.Linear  # the text model is quantised
    expected = model.embed_images(batch.pixel_values, batch.image_position_ids)
    assert torch.equal(quantised.embed_images(batch.pixel_values, batch.image_position_ids), expected)


def test_image_input_errors():
    text_only = dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    patches = torch.zeros(1, 8, 3 * 16 * 16)
    with pytest.raises(ValueError, match="this model has none"):
        text_only.encode(torch.zeros(1, 3, dtype=torch.long), text_only.new_cache(1, 8), pixel_values=patches)
    from dgemma.config import VisionConfig

    config = dgemma.get_preset("tiny").replace(vision=VisionConfig(
        hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, patch_size=4,
        pooling_kernel_size=2, position_embedding_size=160), image_token_id=5)
    model = dgemma.DiffusionGemma(config)
    batch = PROCESSOR(pictures((8, 8)))
    ids = torch.tensor([[2] + [5] * (batch.num_soft_tokens[0] - 1)])
    with pytest.raises(ValueError, match=f"holds {batch.num_soft_tokens[0] - 1} image tokens for the "
                                         f"{batch.num_soft_tokens[0]} soft tokens of 1 images"):
        model.encode(ids, model.new_cache(1, 128), pixel_values=batch.pixel_values,
                     image_position_ids=batch.image_position_ids)
    with pytest.raises(ValueError, match="come with image_position_ids"):
        model.encode(ids, model.new_cache(1, 128), pixel_values=batch.pixel_values)
