"""Image pre-processing against transformers' Gemma4ImageProcessorPil (the oracle), and bad images."""

from __future__ import annotations

import io
import json
import re
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from dgemma.images import ImageError, ImageProcessor, expand_image_tokens, open_image

TINY = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
# (height, width): down- and up-scaling, a size already on the grid, both thin extremes (one pooled row or
# column), odd sizes
SIZES = [(37, 53), (300, 200), (48, 48), (10, 400), (500, 30), (999, 1000), (7, 7), (1, 700), (900, 3)]


def random_image(h, w, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": None}[mode]
    shape = (h, w) if channels is None else (h, w, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


@pytest.mark.parametrize("settings", [TINY, {}], ids=["tiny", "gemma4-defaults"])
def test_pixels_positions_and_soft_tokens_match_transformers(settings):
    from transformers import Gemma4ImageProcessorPil

    ref, ours = Gemma4ImageProcessorPil(**settings), ImageProcessor(**settings)
    sizes = SIZES if settings else SIZES[:4]
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    images += [random_image(33, 71, "RGBA", seed=50), random_image(61, 20, "L", seed=51)]  # alpha onto white
    for image in images:
        expected = ref(images=[image], return_tensors="pt", input_data_format="channels_last")
        got = ours([image])
        assert got.pixel_values.dtype == torch.float32 and got.pixel_values.shape == expected["pixel_values"].shape
        assert (got.pixel_values - expected["pixel_values"]).abs().max() <= 1e-6
        assert torch.equal(got.image_position_ids, expected["image_position_ids"])
        assert got.num_soft_tokens == expected["num_soft_tokens_per_image"].tolist()
        assert ours.num_soft_tokens(image.height, image.width) == got.num_soft_tokens[0]
    # a batch: every image padded to the same patch budget, in order
    expected = ref(images=images[:3], return_tensors="pt")
    got = ours(images[:3])
    assert (got.pixel_values - expected["pixel_values"]).abs().max() <= 1e-6
    assert torch.equal(got.image_position_ids, expected["image_position_ids"])
    assert got.num_soft_tokens == expected["num_soft_tokens_per_image"].tolist()


def test_placeholder_expansion_matches_gemma4_processor():
    """Gemma4Processor replaces each image token in the text by boi + n image tokens + eoi; on token ids that
    is what expand_image_tokens does (special tokens are single ids either way)."""
    from transformers import Gemma4Processor

    names = SimpleNamespace(boi_token="<boi>", image_token="<img>", eoi_token="<eoi>")
    vocab = {"a": 1, "b": 2, "c": 3, "<boi>": 7, "<img>": 8, "<eoi>": 9}
    counts = [3, 5]
    parts = "a <img> b c <img>".split("<img>")
    pieces = [Gemma4Processor.replace_image_token(names, {"num_soft_tokens_per_image": counts}, i) for i in range(2)]
    text = parts[0] + pieces[0] + parts[1] + pieces[1] + parts[2]
    expected = [vocab[t] for t in re.findall(r"<boi>|<img>|<eoi>|\w+", text)]
    prompt = [1, 8, 2, 3, 8]
    assert expand_image_tokens(prompt, counts, image_token_id=8, boi_token_id=7, eoi_token_id=9) == expected
    assert expected == [1, 7, 8, 8, 8, 9, 2, 3, 7, 8, 8, 8, 8, 8, 9]
    with pytest.raises(ImageError, match="2 image placeholders for 1 images"):
        expand_image_tokens(prompt, [3], image_token_id=8, boi_token_id=7, eoi_token_id=9)


def test_settings_come_from_the_processor_files(tmp_path):
    from transformers import Gemma4ImageProcessorPil

    Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=140, pooling_kernel_size=2).save_pretrained(tmp_path)
    assert (tmp_path / "preprocessor_config.json").is_file()
    got = ImageProcessor.from_folder(tmp_path)
    assert (got.patch_size, got.max_soft_tokens, got.pooling_kernel_size, got.resample) == (8, 140, 2, 3)
    # processor_config.json's nested image_processor entry wins, as in transformers
    nested = {"image_seq_length": 70, "image_processor": {**TINY, "resample": 2}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert ImageProcessor.from_folder(tmp_path) == ImageProcessor(**TINY, resample=2)
    # no processor files: defaults, with the vision tower's patch and pooling sizes
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 4, "pooling_kernel_size": 2}}))
    assert ImageProcessor.from_folder(bare) == ImageProcessor(patch_size=4, pooling_kernel_size=2)
    with pytest.raises(ImageError, match="max_soft_tokens must be one of"):
        ImageProcessor(max_soft_tokens=100)


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def test_exif_orientation_and_formats_as_transformers_loads_them(tmp_path):
    from transformers.image_utils import load_image

    image = random_image(20, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the camera was held upright
    path = tmp_path / "photo.jpg"
    image.save(path, "JPEG", exif=exif)
    ours = open_image(path.read_bytes())
    assert ours.size == (20, 30) and ours.mode == "RGB"
    assert np.array_equal(np.asarray(ours), np.asarray(load_image(str(path))))
    assert np.array_equal(np.asarray(open_image(path)), np.asarray(ours))  # a path works as well as bytes


def test_decompression_bomb_is_refused_from_the_header():
    """PNGs whose header claims 10000 x 10000 or 100000 x 100000 pixels over a few bytes of data: refused from
    the header, not after a multi-gigabyte decode (which would fail differently: the data is 8 x 8)."""
    small = png_bytes(random_image(8, 8))
    for side, message in ((10_000, "10000x10000 pixels exceeds the limit of 50,000,000"),
                          (100_000, "exceeds the limit of 50,000,000 pixels \\(a decompression bomb")):
        data = bytearray(small)
        ihdr = data.index(b"IHDR")
        data[ihdr + 4 : ihdr + 12] = struct.pack(">II", side, side)
        data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
        with pytest.raises(ImageError, match=message):
            open_image(bytes(data))
    with pytest.raises(ImageError, match="60x50 pixels exceeds the limit of 2,000 pixels"):
        open_image(png_bytes(random_image(50, 60)), max_pixels=2000)
    assert open_image(png_bytes(random_image(50, 60)), max_pixels=3000).size == (60, 50)


def test_bad_images_raise_one_clear_error(tmp_path):
    good = png_bytes(random_image(40, 40))
    with pytest.raises(ImageError, match="not an image"):
        open_image(b"hello, this is text")
    with pytest.raises(ImageError, match="cannot decode image"):
        open_image(good[: len(good) // 2])  # truncated
    with pytest.raises(ImageError, match="no such image file"):
        open_image(tmp_path / "missing.png")
    assert isinstance(ImageError("x"), ValueError)
