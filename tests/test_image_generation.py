"""Generation with images: the plain loop and the engine carry a prompt's images to its encode, a request
with an image yields the same tokens through either (seeded), and batches mixing requests with and
without images of different sizes give each request what it gets alone. Bad image inputs are refused at
submit, and the engine goes on serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import dgemma
from dgemma.engine import Engine, Request
from dgemma.generation import generate
from dgemma.images import ImageInputs, ImageProcessor, expand_image_tokens


@pytest.fixture(scope="module")
def vision_model(gemma4_vision_model_dir):
    return dgemma.load_model(gemma4_vision_model_dir)


@pytest.fixture(scope="module")
def processor(gemma4_vision_model_dir):
    return ImageProcessor.from_folder(gemma4_vision_model_dir)


def picture(height, width, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_prompt(model, processor, ids, images):
    """Token ids with one image token per image -> the expanded prompt and the images' inputs."""
    inputs = processor(images)
    c = model.config
    return expand_image_tokens(ids, inputs.num_soft_tokens, image_token_id=c.image_token_id,
                               boi_token_id=c.boi_token_id, eoi_token_id=c.eoi_token_id), inputs


def sampling(model, **kw):
    return model.sampling_config.replace(max_new_tokens=40, **kw)


def test_processor_settings_come_from_the_folder(processor):
    assert (processor.patch_size, processor.pooling_kernel_size, processor.max_soft_tokens) == (4, 2, 70)


@torch.no_grad()
def test_engine_equals_the_plain_loop_with_an_image(vision_model, processor):
    model = vision_model
    image = model.config.image_token_id
    prompt, inputs = image_prompt(model, processor, [2, 40, image, 41, 42], [picture(37, 53)])
    assert len(prompt) > 40  # the image's soft tokens are in the prompt
    s = sampling(model)
    plain = generate(model, [prompt], s, seed=7, images=inputs)
    engine = Engine(model, max_batch=2, max_length=256)
    (request,) = engine.generate([prompt], s, seeds=[7], images=[inputs])
    assert request.tokens == plain.tokens[0] and len(request.tokens) > 0
    assert request.state.images is None  # released once the prompt was encoded
    # the image matters: the same prompt with another picture answers differently
    _, other = image_prompt(model, processor, [2, 40, image, 41, 42], [picture(37, 53, seed=1)])
    assert generate(model, [prompt], s, seed=7, images=other).tokens != plain.tokens


@torch.no_grad()
def test_a_batch_with_and_without_images_equals_each_alone(vision_model, processor):
    """Requests with one image, two images of other sizes and none, batched in one engine, each yield the
    plain loop's tokens for that prompt alone."""
    model = vision_model
    image = model.config.image_token_id
    cases = [image_prompt(model, processor, [2, 40, image, 41], [picture(37, 53)]),
             image_prompt(model, processor, [2, image, 43, image, 44, 45], [picture(90, 20, 1), picture(500, 30, 2)]),
             ([2, 46, 47, 48], None)]
    assert len({len(p) for p, _ in cases}) == 3
    s = sampling(model)
    alone = [generate(model, [p], s, seed=11 + i, images=inputs).tokens[0] for i, (p, inputs) in enumerate(cases)]
    engine = Engine(model, max_batch=3, max_length=512)
    requests = engine.generate([p for p, _ in cases], s, seeds=[11, 12, 13], images=[i for _, i in cases])
    assert [r.tokens for r in requests] == alone
    assert engine.forwards < sum(sum(r.steps_per_canvas) for r in requests)  # they stepped together


@torch.no_grad()
def test_the_plain_loop_takes_a_batch_of_prompts_with_images(vision_model, processor):
    """Left-padded rows, the images of all rows in one ImageInputs; a row without an image between them."""
    model = vision_model
    image = model.config.image_token_id
    first, a = image_prompt(model, processor, [2, 40, image, 41], [picture(37, 53)])
    second, b = image_prompt(model, processor, [2, image, 43], [picture(90, 20, 1)])
    result = generate(model, [first, [2, 46, 47], second], sampling(model), seed=3, images=ImageInputs.cat([a, b]))
    assert all(result.tokens) and result.sequences.shape[0] == 3


def test_bad_image_inputs_are_refused_at_submit(vision_model, processor, tiny_model_dir):
    model = vision_model
    image = model.config.image_token_id
    prompt, inputs = image_prompt(model, processor, [2, 40, image, 41], [picture(37, 53)])
    engine = Engine(model, max_batch=1, max_length=256)
    s = sampling(model)
    with pytest.raises(ValueError, match="image tokens for the"):
        engine.submit(Request(prompt=prompt[:-3] + [41], sampling=s, seed=0, images=inputs))
    with pytest.raises(ValueError, match="image tokens for the"):
        engine.submit(Request(prompt=[2, 40, 41], sampling=s, seed=0, images=inputs))
    far = inputs.image_position_ids.clone()
    far[0, 0] = torch.tensor([200, 0])
    with pytest.raises(ValueError, match="exceeds the tower's 160 positions"):
        engine.submit(Request(prompt=prompt, sampling=s, seed=0,
                              images=ImageInputs(inputs.pixel_values, far, inputs.num_soft_tokens)))
    with pytest.raises(ValueError, match="pixel_values must be"):
        engine.submit(Request(prompt=prompt, sampling=s, seed=0,
                              images=ImageInputs(inputs.pixel_values[..., :5], inputs.image_position_ids, [1])))
    assert not engine.has_work()
    (ok,) = engine.generate([prompt], s, seeds=[0], images=[inputs])  # still serving
    assert ok.finish_reason in ("stop", "length")

    text_only = Engine(dgemma.load_model(tiny_model_dir), max_batch=1, max_length=128)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.submit(Request(prompt=prompt, sampling=s, seed=0, images=inputs))


@torch.no_grad()
def test_prefix_cache_keys_images_by_their_pixels(vision_model, processor):
    """A prompt that repeats an earlier one's image takes its blocks through the image; the same tokens
    with other pixels take none; the tokens are those of no cache."""
    model = vision_model
    image = model.config.image_token_id
    first, inputs = image_prompt(model, processor, [2, 40, image, 41, 42] + [43] * 20, [picture(37, 53)])
    other, other_inputs = image_prompt(model, processor, [2, 40, image, 41, 42] + [43] * 20, [picture(37, 53, 1)])
    cases = [(first, inputs), (first + [45, 46], inputs), (other, other_inputs)]
    s = sampling(model)
    cached = Engine(model, max_batch=1, max_length=256, prefix_cache_bytes=1 << 26)
    plain = Engine(model, max_batch=1, max_length=256)
    got = [cached.generate([p], s, seeds=[i], images=[im])[0] for i, (p, im) in enumerate(cases)]
    want = [plain.generate([p], s, seeds=[i], images=[im])[0] for i, (p, im) in enumerate(cases)]
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.cached_tokens for r in got] == [0, len(first) // 16 * 16, 0] and len(first) >= 32


@torch.no_grad()
def test_deterministic_mode_reads_an_image_prompt_in_one_call_and_caches_none_of_it(vision_model, processor):
    """With --deterministic an image prompt is still read in one call (an image is encoded whole), so its
    row leaves the aligned spans: its canvases commit in one call each, the tokens are the default
    engine's, and nothing of the row goes into the prefix cache (its block chain would not match its
    tokens); a text prompt after it feeds the cache as usual."""
    model = vision_model
    prompt, inputs = image_prompt(model, processor, [2, 40, model.config.image_token_id, 41, 42] + [43] * 30,
                                  [picture(37, 53)])
    assert len(prompt) % model.config.canvas_length == 0  # so its canvases could go on in whole spans
    s = sampling(model, eos_token_ids=(model.config.vocab_size,))  # no EOS: 40 tokens, a commit on the way
    deterministic = Engine(model, max_batch=1, max_length=256, prefix_cache_bytes=1 << 26, deterministic=True)
    plain = Engine(model, max_batch=1, max_length=256)
    got = deterministic.generate([prompt], s, seeds=[0], images=[inputs])[0]
    assert got.tokens == plain.generate([prompt], s, seeds=[0], images=[inputs])[0].tokens
    assert len(got.tokens) == 40 and deterministic.prefix_cache.stats.inserted == 0
    text = [2, 40] + [43] * 70
    deterministic.generate([text], s, seeds=[1])
    assert deterministic.prefix_cache.stats.inserted > 0
