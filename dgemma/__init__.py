"""dgemma: DiffusionGemma in plain PyTorch."""

from dgemma.config import PRESETS, ConfigError, ModelConfig, SamplingConfig, get_preset

__version__ = "0.2.0"

__all__ = ["ModelConfig", "SamplingConfig", "ConfigError", "PRESETS", "get_preset", "load_model", "save_pretrained", "compile_model",
           "DiffusionGemma", "PreviousStep"]


def __getattr__(name):
    # Lazy so that `import dgemma` (and `dgemma --help`) stays fast and torch-free until needed.
    if name in ("DiffusionGemma", "KVCache", "PreviousStep"):
        from dgemma import model

        return getattr(model, name)
    if name in ("load_model", "save_pretrained"):
        from dgemma import weights

        return getattr(weights, name)
    if name == "compile_model":
        from dgemma.compilation import steps

        return steps.compile_model
    raise AttributeError(name)
