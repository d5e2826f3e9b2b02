"""What the routes and the request handlers share: the engine worker, the codec, the model's defaults and
the server's limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dgemma.chat.codec import Codec
from dgemma.config import SamplingConfig
from dgemma.serving.image_urls import ImageReader
from dgemma.serving.worker import EngineWorker

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    worker: EngineWorker
    codec: Codec  # TextCodec, or a task's own (dgemma.tasks.task_codec)
    model_name: str
    sampling: SamplingConfig  # the model's defaults; requests override fields of it
    canvas_length: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    images: ImageReader | None = None  # None: the model reads no images
    created: int = field(default_factory=lambda: int(time.time()))
