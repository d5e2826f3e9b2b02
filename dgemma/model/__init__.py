"""The DiffusionGemma network: its modules top to bottom (network.py), attention and the KV cache, the
routed experts, the vision tower, the step cache's packed positions and served LoRA adapters. Loading and
saving weights live in `dgemma.weights`, quantisation in `dgemma.quant`, the split over ranks in
`dgemma.parallel`, compiling in `dgemma.compilation`."""

import importlib
import warnings

from dgemma.model.attention import KVCache
from dgemma.model.network import DiffusionGemma, PreviousStep

__all__ = ["DiffusionGemma", "PreviousStep", "KVCache"]

# Names this package exported before 0.2, where they live now. `from dgemma.model import load_model` keeps
# working until 0.3, with a DeprecationWarning naming the new place (CHANGELOG.md).
_MOVED = {"load_model": "dgemma.weights.hub", "resolve_model": "dgemma.weights.hub",
          "save_pretrained": "dgemma.weights.checkpoint", "CheckpointError": "dgemma.weights.checkpoint",
          "compile_model": "dgemma.compilation.steps"}


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(f"dgemma.model.{name} has moved: import it from {_MOVED[name]} (or as dgemma.{name}); "
                      f"the old name goes in dgemma 0.3", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'dgemma.model' has no attribute {name!r}")
