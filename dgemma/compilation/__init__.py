"""Compiling the denoising step: whether and how (policy.py: mode by device, on-disk cache, warm marker,
each command's choice) and the compiled functions a model holds (steps.py: compile_model, fallback to eager,
a compile owned by one thread)."""

from dgemma.compilation.steps import compile_model, is_compiled, release_compiled

__all__ = ["compile_model", "is_compiled", "release_compiled"]
