"""Packed canvas positions: the step cache's decoder input (`DiffusionGemma.decode_active`).

A step with the step cache on (dgemma.generation.step_cache) runs only each row's *active* canvas positions
through the decoder. Rows with different numbers of active positions share one forward: their positions are
laid out one after another as one sequence of N = sum of the counts ("packed"), so every per-token part (norms,
projections, MLP, experts, LM head) runs on N tokens and nothing is padded back to the canvas length.
Attention is the only per-row part: it runs once per bucket of rows with similar active counts (padded to
the bucket's size), each row's queries against its own [canvas slots | prefix] keys.

Shapes: n rows, L canvas length, N packed positions, A a bucket's active count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgemma.device_sync import host_read, to_device


def bucket_size(count: int, length: int) -> int:
    """The attention bucket of a row with `count` active positions of `length`: the next power of two, at most
    the canvas (queries past a row's count repeat its last position and are dropped)."""
    return min(length, 1 << (count - 1).bit_length())


@dataclass(frozen=True)
class PackedPositions:
    """Which canvas positions of each of n rows run through the decoder, packed row after row.

    row_of (N,): each packed position's row (0 .. n-1, an index into the forward's rows); index (N,): its
    canvas position (0 .. L-1); counts: each row's active count on the host (a row may have 0);
    buckets: (A, the rows whose count rounds up to A (g,), their packed positions (g, A)) per bucket size A
    (`bucket_size`: a few sizes, so a step of many rows makes a few attention calls, not one a count).
    """

    row_of: torch.Tensor
    index: torch.Tensor
    counts: tuple[int, ...]
    buckets: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]

    @property
    def total(self) -> int:
        return sum(self.counts)

    @classmethod
    def from_mask(cls, active: torch.Tensor, counts: list[int] | None = None) -> PackedPositions:
        """active (n, L) bool -> the packing of its True positions, row after row, in canvas order.
        `counts`: the rows' active counts when the host already knows them (else one read)."""
        device = active.device
        if counts is None:
            counts = host_read(active.sum(dim=1), "active positions per row")
        length = active.shape[1]
        # row-major: row after row, canvas order within a row; its size known, nonzero_static does not wait
        flat = torch.nonzero_static(active.reshape(-1), size=sum(counts))[:, 0]
        rows, index = flat // length, flat % length
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        by_size: dict[int, list[int]] = {}
        for r, c in enumerate(counts):
            if c:
                by_size.setdefault(bucket_size(c, length), []).append(r)
        buckets = []
        for a, members in sorted(by_size.items()):
            starts = to_device([offsets[r] for r in members], torch.long, device)
            last = to_device([counts[r] - 1 for r in members], torch.long, device)
            # a row with fewer than A positions repeats its last one: the same query twice, the same output
            tokens = starts[:, None] + torch.minimum(torch.arange(a, device=device)[None], last[:, None])  # (g, A)
            buckets.append((a, to_device(members, torch.long, device), tokens))
        return cls(rows, index, tuple(int(c) for c in counts), tuple(buckets))

    @classmethod
    def of_row(cls, index: torch.Tensor) -> PackedPositions:
        """One row's active canvas positions index (N,), for scattering its logits (`scatter`); no buckets."""
        return cls(torch.zeros_like(index), index, (index.shape[0],), ())

    @classmethod
    def whole(cls, n: int, length: int, device) -> PackedPositions:
        """Every position of every row active (the first step of a canvas, a refresh)."""
        return cls.from_mask(torch.ones(n, length, dtype=torch.bool, device=device), [length] * n)

    def gather(self, per_row: torch.Tensor) -> torch.Tensor:
        """(n, L, ...) per-position values -> (N, ...) in packed order."""
        return per_row[self.row_of, self.index]

    def scatter(self, packed: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Write (N, ...) packed values into their places of `into` (n, L, ...), in place; returns it."""
        into[self.row_of, self.index] = packed.to(into.dtype)
        return into
