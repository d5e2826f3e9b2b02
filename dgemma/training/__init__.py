"""Training: the DiffusionGemma objective (uniform-state corruption, self-conditioning, encoder next-token
loss), the autoregressive baseline, LoRA, resumable checkpoints and FSDP2 multi-process runs.

    from dgemma.training import TrainConfig, train
    result = train(TrainConfig(data="train.jsonl", out="runs/a", init="preset:tiny", steps=300))
"""

from dgemma.training.loop import TrainConfig, TrainResult, learning_rate, train

__all__ = ["TrainConfig", "TrainResult", "learning_rate", "train"]
