"""Reading and writing weights: checkpoint folders (loading with every tensor accounted for, saving in
shards), Hugging Face ids, PEFT adapter folders, Gemma 4 -> DiffusionGemma conversion, random models."""

from dgemma.weights.checkpoint import CheckpointError, save_pretrained
from dgemma.weights.hub import load_model, resolve_model

__all__ = ["CheckpointError", "load_model", "resolve_model", "save_pretrained"]
