"""The sudoku models shipped in the package (dgemma/assets/), which `dgemma sudoku solve | eval` run by
default; apart from sudoku.py, which imports numpy, so that the command line names them in its help at no cost."""

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "sudoku"  # the diffusion model
SHIPPED_AR = SHIPPED.parent / "sudoku-ar"  # its AR baseline: the same data, size and steps, next-token loss
