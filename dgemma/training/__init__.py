"""Training: the DiffusionGemma objective (uniform-state corruption, self-conditioning, encoder next-token
loss), the autoregressive baseline, LoRA, resumable checkpoints and FSDP2 multi-process runs.

    from dgemma.training import TrainConfig, train
    result = train(TrainConfig(data="train.jsonl", out="runs/a", init="preset:tiny", steps=300))
"""

from dgemma.training.config import TrainConfig

__all__ = ["TrainConfig", "TrainResult", "learning_rate", "train"]


def __getattr__(name):
    # Lazy so that the command line can read TrainConfig's fields without importing torch.
    if name in ("TrainResult", "learning_rate", "train"):
        from dgemma.training import loop

        return getattr(loop, name)
    raise AttributeError(name)
