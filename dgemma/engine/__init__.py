"""Batched generation: request state, the scheduler (queue, cache rows, cancellation), the runner (model
and cache), one loop for all requests."""

from dgemma.engine.engine import Engine
from dgemma.engine.request import Event, Request, ScoreRequest, Status
from dgemma.engine.scheduler import QueueFull

__all__ = ["Engine", "QueueFull", "Event", "Request", "ScoreRequest", "Status"]
