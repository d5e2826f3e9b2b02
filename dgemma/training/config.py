"""`TrainConfig`: every setting of a training run, each written once with its default and its help.

`dgemma train` builds its flags from these fields (dgemma.commands.train): a field's metadata holds its help
text, the group of `dgemma train --help` it shows in, and how the command line spells it where that is not
`--field-name` (choices, a parser for the text, a `--no-...` switch for a default-on bool). Fields without
a group have a hand-written flag (model_overrides: `--set`, `--vocab-size`). Imports nothing heavy, so
the command line stays fast to start.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from dgemma.config import ConfigError

# Module-name suffixes that get LoRA adapters by default: attention and the dense MLP (dgemma.training.lora).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Named per-example augmentations: "module:function", function(prompt, response, rng) -> (prompt, response),
# raising ValueError for an example it cannot transform. Drawn afresh for every example at every step
# (dgemma.training.data.read_examples).
AUGMENTATIONS = {
    "sudoku": "dgemma.tasks.sudoku:random_symmetry_ids",  # one of the 1.2e12 validity-preserving symmetries
}

GROUPS = ("model", "data", "optimisation", "LoRA", "run")  # the sections of `dgemma train --help`


def option(text: str, group: str, default=dataclasses.MISSING, **cli):
    """A field with its help text and --help group; `cli` adds argparse keywords (choices, type, metavar,
    required), `flag` for a field spelled otherwise on the command line (e.g. "--no-progress") and `one_of`
    for fields of which exactly one is given."""
    return field(default=default, metadata={"help": text, "group": group, **cli})


def comma_list(text: str) -> tuple[str, ...]:
    """"a, b,c" -> ("a", "b", "c")."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def byte_size(text: str) -> int:
    """"80GB", "80GiB", "1e9" -> bytes."""
    from dgemma.weights.shards import parse_size

    return parse_size(text)


@dataclass
class TrainConfig:
    data: str = option("JSONL: prompt_ids/response_ids, prompt/response, or messages", "data", required=True)
    out: str = option("run folder: checkpoints/, model/, metrics.jsonl, loss.png", "run", required=True)
    model: str | None = option("Hugging Face format folder or Hugging Face id to fine-tune", "model", None,
                               one_of="source")
    init: str | None = option("train from scratch: preset:NAME (e.g. preset:tiny) or a config JSON file", "model",
                              None, one_of="source")
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields for --init (--set, --vocab-size)
    tokenizer: str | None = option("folder with tokenizer.json for text data (default: the --model folder)", "data",
                                   None)
    chat_template: bool = option("tokenise prompt/response records as plain text (BOS + prompt, response + EOS) "
                                 "instead of with the chat template", "data", True, flag="--no-chat-template")
    objective: str = option("diffusion (DiffusionGemma) or ar (autoregressive baseline: encoder + LM head)", "model",
                            "diffusion", choices=("diffusion", "ar"))
    steps: int = option("optimizer steps: the length of the learning-rate schedule", "optimisation", 1000)
    until: int | None = option("stop after this step with a checkpoint, keeping the --steps schedule (resume to go "
                               "on)", "optimisation", None, metavar="STEP")
    batch_size: int = option("global examples per optimizer step, over all processes", "optimisation", 8)
    micro_batch_size: int | None = option("examples per process and forward (gradient accumulation; default: all of "
                                          "the process's share)", "optimisation", None)
    lr: float = option("peak learning rate", "optimisation", 1.5e-4)
    min_lr: float | None = option("learning rate at the end of the cosine (default lr/10)", "optimisation", None)
    warmup_steps: int = option("linear warmup steps before the cosine", "optimisation", 100)
    weight_decay: float = option("AdamW weight decay of the matrices (norms and scales are not decayed)",
                                 "optimisation", 1e-4)
    betas: tuple[float, float] = option("AdamW betas", "optimisation", (0.95, 0.99), nargs=2, metavar=("B1", "B2"))
    grad_clip: float = option("max global gradient norm, 0 = off", "optimisation", 1.0)
    precision: str = option("bf16 = autocast (fp32 master weights and optimizer); auto = bf16 where the device "
                            "multiplies bf16 faster than fp32 (CUDA; CPUs with AMX or AVX512_BF16 where a short "
                            "measurement says so), else fp32", "optimisation", "fp32",
                            choices=("fp32", "bf16", "auto"))
    compile: bool = option("never torch.compile the training step (also DGEMMA_EAGER=1); by default its blocks "
                           "compile on a CPU in one process when the run is long enough to pay the compile back "
                           "(minutes once with an empty cache, less with this shape's entry in it; the start "
                           "line says the choice and why; where compiling is unavailable or fails, eager after "
                           "one warning line)", "optimisation", True, flag="--eager")
    force_compile: bool = option("compile the training step whatever the run's length (not with --eager)",
                                 "optimisation", False, flag="--compile")
    mixed_precision: str | None = option(
        "FSDP2 MixedPrecisionPolicy (torchrun, 2+ processes): bf16 gathered weights and compute, fp32 gradient "
        "reduction, fp32 sharded master weights and AdamW", "optimisation", None, choices=("bf16",))
    activation_checkpointing: bool = option("keep only each block's input; recompute its activations in the "
                                            "backward", "optimisation", False)
    memory_per_rank: int | None = option(
        "memory each process may use (e.g. 80GB, 80GiB): a run whose plan (see `dgemma info --train`) needs more "
        "is refused before any weight is loaded", "run", None, type=byte_size, metavar="SIZE")
    seed: int = option("seed of the data order, noise and initialisation", "optimisation", 0)
    noise_eps: float = option("t ~ U(eps, 1)", "optimisation", 1e-3)
    self_cond_prob: float = option("probability of a self-conditioning pass per example", "optimisation", 0.5)
    encoder_loss_weight: float = option("weight of the encoder's next-token loss", "optimisation", 1.0)
    cache_aware: float = option(
        "probability that an example with self-conditioning trains its second pass on what the step cache hands "
        "over: keys/values of an earlier, noisier canvas for the positions that would have settled (0: off; two "
        "more decoder forwards without gradient per step; the exported model runs with the step cache on and "
        "says so in generation_config.json)", "optimisation", 0.0, metavar="P")
    cache_aware_settle: float = option("top probability at which a position of the earlier canvas counts as "
                                       "settled (--cache-aware)", "optimisation", 0.9, metavar="P")
    train_router: bool = option("let the MoE routers learn (frozen by default)", "optimisation", False)
    lora: bool = option("train low-rank adapters only (merged on export)", "LoRA", False)
    lora_rank: int = option("adapter rank", "LoRA", 16)
    lora_alpha: float = option("adapter scale numerator (scale = alpha / rank)", "LoRA", 32.0)
    lora_targets: tuple[str, ...] = option(
        "comma-separated module-name suffixes (attention and the dense MLP by default); add 'experts' for the "
        "fused experts", "LoRA", DEFAULT_TARGETS, type=comma_list)
    lora_dropout: float = option("dropout on the adapters' input", "LoRA", 0.0)
    max_length: int | None = option("longest prompt + filled response (default: model context)", "data", None)
    eos_id: int | None = option("token that fills the response to a canvas boundary (default: the model's EOS)",
                                "data", None)
    augment: str | None = option("draw a fresh random transform of every example at every step (sudoku: a "
                                 "symmetry)", "data", None, choices=tuple(AUGMENTATIONS))
    skip_bad_lines: bool = option("leave out malformed lines (reported on stderr) instead of stopping at the first",
                                  "data", False)
    save_every: int = option("steps between checkpoints", "run", 500)
    keep_checkpoints: int = option("newest checkpoints kept (0: all)", "run", 2)
    log_every: int = option("steps between logged losses", "run", 10)
    resume: bool = option("continue from the latest checkpoint in --out", "run", False)
    device: str = option("auto, cpu or cuda", "run", "auto")
    progress: bool = option("no progress bar or lines", "run", True, flag="--no-progress")

    # fields a resumed run may change: they do not alter the numbers (the global batch fixes the math)
    RESUMABLE_CHANGES = ("out", "resume", "progress", "log_every", "save_every", "keep_checkpoints",
                         "micro_batch_size", "device", "skip_bad_lines", "until", "activation_checkpointing",
                         "memory_per_rank", "compile", "force_compile")

    def as_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, saved: dict) -> TrainConfig:
        """The inverse of as_json (JSON turned the tuples into lists)."""
        return cls(**{k: tuple(v) if k in ("betas", "lora_targets") else v for k, v in saved.items()})

    def check(self, world_size: int):
        problems = [
            (self.objective in ("diffusion", "ar"), f"objective must be 'diffusion' or 'ar', not {self.objective!r}"),
            (self.precision in ("fp32", "bf16", "auto"),
             f"precision must be 'fp32', 'bf16' or 'auto', not {self.precision!r}"),
            (self.mixed_precision in (None, "bf16"), f"mixed precision must be 'bf16', not {self.mixed_precision!r}"),
            (self.mixed_precision is None or world_size > 1,
             "--mixed-precision is FSDP2's policy and needs torchrun with 2+ processes; one process: --precision bf16"),
            (self.steps >= 1, "--steps must be >= 1"),
            (self.compile or not self.force_compile, "--eager and --compile exclude each other"),
            (self.until is None or 1 <= self.until <= self.steps, "--until must be between 1 and --steps"),
            (self.augment is None or self.augment in AUGMENTATIONS,
             f"--augment must be one of {', '.join(AUGMENTATIONS)}, not {self.augment!r}"),
            (self.lr > 0 and (self.min_lr is None or 0 <= self.min_lr <= self.lr), "need lr > 0 and 0 <= min-lr <= lr"),
            (self.warmup_steps >= 0 and self.grad_clip >= 0, "warmup and grad-clip must be >= 0"),
            (0 < self.noise_eps < 1, "noise-eps must be in (0, 1)"),
            (0 <= self.self_cond_prob <= 1, "self-cond-prob must be in [0, 1]"),
            (0 <= self.cache_aware <= 1 and 0 < self.cache_aware_settle <= 1,
             "cache-aware must be in [0, 1] and cache-aware-settle in (0, 1]"),
            (self.cache_aware == 0 or self.objective == "diffusion", "--cache-aware trains the diffusion objective"),
            (self.save_every >= 1 and self.log_every >= 1, "save-every and log-every must be >= 1"),
        ]
        for ok, message in problems:
            if not ok:
                raise ConfigError(message)
        if self.batch_size < world_size or self.batch_size % world_size:
            raise ConfigError(f"--batch-size {self.batch_size} is not a multiple of the {world_size} processes")
        share = self.batch_size // world_size
        if self.micro_batch_size is not None and (self.micro_batch_size < 1 or share % self.micro_batch_size):
            raise ConfigError(f"--micro-batch-size {self.micro_batch_size} does not divide the per-process "
                              f"batch of {share} (--batch-size {self.batch_size} over {world_size} processes)")
