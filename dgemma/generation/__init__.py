"""Generation without the engine: block diffusion's plain loop (the reference the engine reproduces), the
verifier search on top of it, and left-to-right decoding with the same weights; `canvas` holds the output
semantics all of them share with the engine."""

from dgemma.generation.ar import generate_ar
from dgemma.generation.canvas import left_pad
from dgemma.generation.diffusion import CanvasTemplate, GenerationResult, generate
from dgemma.generation.verify import generate_verified

__all__ = ["generate", "generate_verified", "generate_ar", "CanvasTemplate", "GenerationResult", "left_pad"]
