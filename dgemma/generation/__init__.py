"""Generation without the engine: block diffusion's plain loop (the reference the engine reproduces) and
left-to-right decoding with the same weights; `canvas` holds the output semantics both share with the engine."""

from dgemma.generation.ar import generate_ar
from dgemma.generation.canvas import left_pad
from dgemma.generation.diffusion import CanvasTemplate, GenerationResult, generate

__all__ = ["generate", "generate_ar", "CanvasTemplate", "GenerationResult", "left_pad"]
