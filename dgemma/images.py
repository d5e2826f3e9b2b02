"""Images -> what the vision tower reads, and the prompt tokens that make room for them.

The Gemma 4 image pre-processing, with Pillow and numpy:
  1. open: refuse an image with more than `max_pixels` pixels from its header, before decoding it; apply the
     EXIF orientation; composite transparency onto white and convert to RGB
  2. resize (bicubic), keeping the aspect ratio, to the largest size whose sides are multiples of
     patch_size * pooling_kernel_size and that holds at most max_soft_tokens * pooling_kernel_size^2 patches
  3. scale to [0, 1]; cut into patch_size x patch_size patches, row-major, each flattened (row, column,
     channel); each patch's position is (column, row); pad to the patch budget with zero patches at
     position (-1, -1)
  4. one soft token per pooling_kernel_size^2 patches: in the prompt, each image placeholder token becomes
     <boi> + that many image tokens + <eoi> (`expand_image_tokens`)

Settings come from the model folder's `processor_config.json` (its "image_processor" entry) or
`preprocessor_config.json`, as transformers writes them; without either, transformers' defaults with the
patch and pooling sizes of config.json's vision_config.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# An image larger than this (in pixels, from its header) is refused before it is decoded: about a
# 48-megapixel photo, ~150 MB once decoded, where a decompression bomb would ask for gigabytes.
DEFAULT_MAX_PIXELS = 50_000_000
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets Gemma 4 was trained with
# The formats images are read in: the common raster ones (JPEG includes a camera's multi-picture MPO).
# Pillow can open many more, some through outside programs (EPS runs Ghostscript), which untrusted input
# from a server's clients must not reach.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class ImageError(ValueError):
    """An image that cannot be used: not an image, truncated, too many pixels, too small to resize."""


def open_image(source: bytes | str | Path | BinaryIO, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image file (bytes, a path or a binary file object; one of IMAGE_FORMATS) into an RGB PIL image.

    The pixel count is read from the header and checked before anything is decoded, so a small file that
    claims a huge image (a decompression bomb) costs nothing. Any other failure (not an image, truncated
    data, an unsupported format) is one `ImageError`.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    try:
        with warnings.catch_warnings():
            # Pillow warns above its own limit and raises above twice it; ours is checked just below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source, formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"image of {width}x{height} pixels exceeds the limit of {max_pixels:,} pixels")
        if width < 1 or height < 1:
            raise ImageError(f"image of {width}x{height} pixels is empty")
        image.load()
        image = ImageOps.exif_transpose(image)  # as a camera meant it to be seen
        return to_rgb(image)
    except ImageError:
        raise
    except Image.DecompressionBombError:  # Pillow's own header check, far above ours
        raise ImageError(f"image exceeds the limit of {max_pixels:,} pixels (a decompression bomb?)") from None
    except FileNotFoundError:
        raise ImageError(f"no such image file: {source}") from None
    except UnidentifiedImageError:
        raise ImageError(f"not an image, or not in a format read here ({', '.join(IMAGE_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ImageError(f"cannot decode image: {e}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto a white background (what Gemma 4's processor does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass
class ImageInputs:
    """A batch of pre-processed images: the arguments `DiffusionGemma.encode` takes with the prompt."""

    pixel_values: torch.Tensor  # (N, P, 3 * patch_size^2) float32 in [0, 1]; zero patches pad every image to P
    image_position_ids: torch.Tensor  # (N, P, 2) long: (column, row) of each patch, (-1, -1) on padding
    num_soft_tokens: list[int]  # per image: the image tokens its placeholder expands to

    @staticmethod
    def cat(parts: Sequence["ImageInputs"]) -> "ImageInputs":
        """Batches of the same processor, one after the other (e.g. the images of several prompts)."""
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_position_ids for p in parts]),
                           [n for p in parts for n in p.num_soft_tokens])


@dataclass(frozen=True)
class ImageProcessor:
    """Gemma 4's image pre-processing (transformers' `Gemma4ImageProcessorPil`), with its settings."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = 3  # a PIL resampling filter: bicubic
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False  # Gemma 4 reads pixels in [0, 1]
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self):
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ImageError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens}")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    @classmethod
    def from_folder(cls, folder: str | Path, **overrides) -> "ImageProcessor":
        """The settings a model folder's processor files hold (see the module docstring)."""
        folder = Path(folder)
        settings = _read_json(folder / "processor_config.json").get("image_processor")
        if not isinstance(settings, dict):
            settings = _read_json(folder / "preprocessor_config.json")
        if not settings:  # no processor files: the defaults, sized to the checkpoint's vision tower
            vision = _read_json(folder / "config.json").get("vision_config") or {}
            settings = {k: vision[k] for k in ("patch_size", "pooling_kernel_size") if k in vision}
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in settings.items() if k in fields}
        for key in ("image_mean", "image_std"):
            if key in kwargs:
                value = kwargs[key]
                kwargs[key] = tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
        kwargs.update(overrides)
        return cls(**kwargs)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the aspect-preserving resize: the largest multiples of patch_size *
        pooling_kernel_size within the patch budget (a very thin image gets one pooled row or column)."""
        if not self.do_resize:
            return height, width
        side = self.patch_size * self.pooling_kernel_size
        budget = self.max_patches * self.patch_size**2  # pixels
        factor = math.sqrt(budget / (height * width))
        new_h = int(math.floor(factor * height / side)) * side
        new_w = int(math.floor(factor * width / side)) * side
        longest = (self.max_patches // self.pooling_kernel_size**2) * side
        if new_h == 0 and new_w == 0:
            raise ImageError(f"image of {width}x{height} pixels cannot be resized to at least {side}x{side}")
        if new_h == 0:
            new_h, new_w = side, min(int(math.floor(width / height)) * side, longest)
        elif new_w == 0:
            new_h, new_w = min(int(math.floor(height / width)) * side, longest), side
        if new_h * new_w > budget:
            raise ImageError(f"image of {width}x{height} pixels is too elongated for {self.max_soft_tokens} "
                             "soft tokens")
        return new_h, new_w

    def num_soft_tokens(self, height: int, width: int) -> int:
        """Image tokens an image of this size becomes (before it is decoded: from its header's size)."""
        h, w = self.resized_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.pooling_kernel_size**2

    def __call__(self, images: Sequence[Image.Image]) -> ImageInputs:
        """RGB PIL images (`open_image`) -> one batch, every image padded to `max_patches` patches."""
        pixels, positions, counts = [], [], []
        p, P = self.patch_size, self.max_patches
        for image in images:
            image = to_rgb(image)
            h, w = self.resized_size(image.height, image.width)
            if (h, w) != (image.height, image.width):
                image = image.resize((w, h), resample=self.resample)
            array = np.asarray(image)  # (h, w, 3) uint8
            if self.do_rescale:
                array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
            if self.do_normalize:
                array = ((array - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32))
            array = np.asarray(array, dtype=np.float32)
            rows, cols = h // p, w // p
            if h % p or w % p or rows * cols > P:
                raise ImageError(f"image of {w}x{h} pixels does not fit {P} patches of {p}x{p}")
            # (rows, p, cols, p, 3) -> (rows, cols, p, p, 3): each patch flattened (pixel row, pixel column, channel)
            patches = array.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
            grid = np.stack(np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy"), axis=-1).reshape(-1, 2)
            padded = np.zeros((P, patches.shape[1]), dtype=np.float32)
            padded[: len(patches)] = patches
            where = np.full((P, 2), -1, dtype=np.int64)
            where[: len(grid)] = grid
            pixels.append(padded)
            positions.append(where)
            counts.append(rows * cols // self.pooling_kernel_size**2)
        if not pixels:
            shape = (0, P, 3 * p * p)
            return ImageInputs(torch.zeros(shape), torch.zeros(0, P, 2, dtype=torch.long), [])
        return ImageInputs(torch.from_numpy(np.stack(pixels)), torch.from_numpy(np.stack(positions)), counts)


def expand_image_tokens(ids: Sequence[int], num_soft_tokens: Sequence[int], *, image_token_id: int,
                        boi_token_id: int, eoi_token_id: int) -> list[int]:
    """Each image placeholder (one `image_token_id` per image, in order) -> <boi> + n image tokens + <eoi>."""
    placeholders = sum(1 for t in ids if t == image_token_id)
    if placeholders != len(num_soft_tokens):
        raise ImageError(f"the prompt has {placeholders} image placeholders for {len(num_soft_tokens)} images")
    out: list[int] = []
    counts = iter(num_soft_tokens)
    for t in ids:
        if t == image_token_id:
            out += [boi_token_id] + [image_token_id] * next(counts) + [eoi_token_id]
        else:
            out.append(t)
    return out


def prompt_with_images(ids: Sequence[int], images: Sequence[Image.Image], processor: ImageProcessor,
                       config) -> tuple[list[int], ImageInputs | None]:
    """A prompt holding one image placeholder per image (what a chat template writes for an image part),
    and the images (`open_image`) -> the prompt with each placeholder expanded, and the images' inputs
    (None without images). `config`: the model's (image_token_id, boi_token_id, eoi_token_id)."""
    if not images:
        return list(ids), None
    inputs = processor(images)
    return expand_image_tokens(ids, inputs.num_soft_tokens, image_token_id=config.image_token_id,
                               boi_token_id=config.boi_token_id, eoi_token_id=config.eoi_token_id), inputs


def image_placeholder(model, tokenizer) -> str:
    """The text of the model's image placeholder token (Gemma 4: <|image|>), which a prompt writes where an
    image goes. ImageError for a model without a vision tower, or a tokenizer without the token."""
    if model.vision_tower is None:
        raise ImageError("this model has no vision tower: it cannot read images")
    placeholder = tokenizer.backend.id_to_token(model.config.image_token_id)
    if placeholder is None:
        raise ImageError(f"the tokenizer has no token for the image placeholder id {model.config.image_token_id}")
    return placeholder


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ImageError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}
