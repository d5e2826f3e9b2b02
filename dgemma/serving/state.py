"""What the routes and the request handlers share: the engine worker, the codec, the model's defaults and
the server's limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dgemma.chat.codec import Codec
from dgemma.config import SamplingConfig
from dgemma.serving.image_urls import ImageReader
from dgemma.serving.metrics import ServerMetrics
from dgemma.serving.middleware import Traffic
from dgemma.serving.worker import EngineWorker

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    worker: EngineWorker
    codec: Codec  # text's, or a task's own: what ServerSettings.codec made
    model_name: str
    sampling: SamplingConfig  # the model's defaults; requests override fields of it
    canvas_length: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    images: ImageReader | None = None  # None: the model reads no images
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics | None = None  # made by create_app when not given
    traffic: Traffic | None = None  # the same
    adapters: tuple[str, ...] = ()  # LoRA adapters served by name; adapter i + 1 in the engine is adapters[i]
    adapter_paths: tuple[str, ...] = ()  # where each was read from
    background_compile: object = None  # serving/lifecycle.BackgroundCompile, while one exists
    step_kind: object = None  # () -> "eager" | "compiling" | "compiled" (serving/lifecycle.py); None: fixed

    def served_name(self, adapter: int) -> str:
        """The `model` name of engine adapter index `adapter` (0: the base model)."""
        return self.model_name if adapter == 0 else self.adapters[adapter - 1]
