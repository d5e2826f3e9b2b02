"""Configuration dataclasses and named presets: the model's shape (model.py), the sampler's settings
(sampling.py), the presets (presets.py)."""

from dgemma.config.model import FULL, SLIDING, ConfigError, ModelConfig, VisionConfig
from dgemma.config.presets import PRESETS, get_preset
from dgemma.config.sampling import ACCEPT_ORDERS, STEP_CACHE_KEYS, SamplingConfig

__all__ = ["ACCEPT_ORDERS", "STEP_CACHE_KEYS", "ModelConfig", "VisionConfig", "SamplingConfig", "ConfigError", "PRESETS",
           "get_preset", "SLIDING", "FULL"]
