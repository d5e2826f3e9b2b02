"""/health's body: whether the engine runs, its load, and its prefix cache's counters.

The prefix cache's part is the engine's own `PrefixCacheStats` (dgemma/engine/prefix_cache.py): its fields,
their types and what each counts are read from that dataclass, so a counter the engine adds is published here
without a second list.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pydantic import Field, create_model

from dgemma.engine.prefix_cache import PrefixCacheStats as EnginePrefixCacheStats
from dgemma.serving.responses import Body


def _body_of(stats: type) -> type[Body]:
    """A response model with the fields of the dataclass `stats`, each described by its metadata's "doc"."""
    types = typing.get_type_hints(stats)
    fields = {f.name: (types[f.name], Field(description=f.metadata.get("doc"))) for f in dataclasses.fields(stats)}
    return create_model(stats.__name__, __base__=Body, __module__=__name__, **fields,
                        __doc__=f"The engine's prefix cache ({stats.__module__}.{stats.__qualname__}).")


PrefixCacheStats = _body_of(EnginePrefixCacheStats)


class Health(Body):
    status: Literal["ok", "draining", "unavailable"]
    model: str
    step: Literal["eager", "compiling", "compiled"]  # compiling: the eager step answers meanwhile
    active: int
    waiting: int
    max_batch: int
    max_queue: int
    prefix_cache: PrefixCacheStats | None = Field(description="null when the prefix cache is off")
