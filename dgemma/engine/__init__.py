"""Batched generation: request state, cache rows, the sampler per row, one loop for all requests."""

from dgemma.engine.engine import Engine, QueueFull, positions_needed
from dgemma.engine.request import Event, Request, Status

__all__ = ["Engine", "QueueFull", "Event", "Request", "Status", "positions_needed"]
