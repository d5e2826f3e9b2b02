"""The DiffusionGemma network, its KV cache and checkpoint I/O."""

from dgemma.model.attention import KVCache
from dgemma.model.checkpoint import CheckpointError, save_pretrained
from dgemma.model.compilation import compile_model
from dgemma.model.hub import load_model, resolve_model
from dgemma.model.network import DiffusionGemma, PreviousStep

__all__ = ["DiffusionGemma", "PreviousStep", "KVCache", "load_model", "resolve_model", "save_pretrained", "compile_model",
           "CheckpointError"]
