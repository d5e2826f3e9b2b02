"""Writing safetensors checkpoints shard by shard, one tensor in memory at a time: the one writer that
`save_pretrained` and the Gemma 4 converter share, with the shard packing, the file names, the index and
the byte sizes they print.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range) and the tensors' bytes. The header is written from the tensors' specs before any data, so
each tensor can be read, written and released before the next one is touched.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# torch dtype -> safetensors' dtype code
DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file to write: the key it is stored under, its shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(key, tuple(tensor.shape), tensor.dtype)


Item = TypeVar("Item")


def pack_shards(sizes: Iterable[tuple[Item, int]], max_shard_bytes: int | None) -> list[list[Item]]:
    """Items in their given order, cut into shards of at most `max_shard_bytes` (one item bigger than
    that gets a shard of its own; None: a single shard)."""
    shards: list[list[Item]] = [[]]
    size = 0
    for item, nbytes in sizes:
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def shard_file_name(i: int, n: int) -> str:
    """transformers' names: model.safetensors alone, else model-00001-of-00003.safetensors, ..."""
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_safetensors(path: Path, specs: list[TensorSpec], read: Callable[[TensorSpec], torch.Tensor]):
    """Write one safetensors file tensor by tensor: `read(spec)` is called once per tensor, in order, and
    each tensor is released before the next is read. Raises ValueError when a tensor does not match its spec."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.key] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for spec in specs:
            tensor = read(spec)
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(f"{path}: {spec.key} came out as {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"not {spec.shape} {spec.dtype}")
            # safetensors stores little-endian; every platform torch ships for is little-endian
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            del tensor, data
        f.flush()
        os.fsync(f.fileno())


def write_shards(folder: Path, shards: list[Item],
                 open_shard: Callable[[Item], tuple[list[TensorSpec], Callable[[TensorSpec], torch.Tensor]]],
                 progress: Callable[[str], None] | None = None):
    """Write `shards` into `folder` under transformers' file names, with the index when there are several.
    `open_shard(shard)` -> (the shard's tensor specs, a reader of one tensor), called when that shard is
    written, so only one shard's worth of reading is ever set up at a time."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = shard_file_name(i, len(shards))
        specs, read = open_shard(shard)
        write_safetensors(folder / name, specs, read)
        size = sum(spec.nbytes for spec in specs)
        total += size
        weight_map.update({spec.key: name for spec in specs})
        if progress:
            progress(f"wrote {name} ({human_bytes(size)}, {len(specs)} tensors)")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def human_bytes(n: int) -> str:
    """1234567 -> '1.23 MB' (decimal units, as --max-shard-size reads them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '20KB' -> 2e4, '1GiB' -> 2**30, '123' -> 123 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"cannot read size {text!r} (examples: 5GB, 500MB, 2GiB)")
    number, unit = float(m.group(1)), m.group(2)
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if "I" in unit else 1000
    size = int(number * base ** powers[unit.rstrip("IB")])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size
