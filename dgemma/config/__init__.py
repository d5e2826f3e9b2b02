"""Configuration dataclasses and named presets: the model's shape (model.py), the sampler's settings
(sampling.py), the presets (presets.py)."""

from dgemma.config.model import FULL, SLIDING, ConfigError, ModelConfig, VisionConfig
from dgemma.config.presets import PRESETS, get_preset
from dgemma.config.sampling import (
    ACCEPT_ORDERS,
    CORRECTOR_SELECTIONS,
    REFRESH_ORDERS,
    SAMPLER_KEYS,
    SAMPLER_SETTINGS,
    SAMPLERS,
    SETTLE_ON,
    STEP_CACHE_KEYS,
    SamplingConfig,
    settings_not_read,
)

__all__ = ["ACCEPT_ORDERS", "REFRESH_ORDERS", "SETTLE_ON", "CORRECTOR_SELECTIONS", "SAMPLERS", "SAMPLER_KEYS", "SAMPLER_SETTINGS", "settings_not_read", "STEP_CACHE_KEYS", "ModelConfig", "VisionConfig", "SamplingConfig", "ConfigError", "PRESETS",
           "get_preset", "SLIDING", "FULL"]
