"""Loading one rank's part of a split model (`dgemma.parallel`): every split tensor is read as its
slice from the safetensors shards (`safe_open(...).get_slice`), never whole; int8/int4 loads quantise the
slice (or read the slice of the stored codes and scales). Everything is checked (config, headers, every
key's fate, the split's constraints) before the first weight is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dgemma.model.network import DiffusionGemma
from dgemma.parallel.group import TensorParallel
from dgemma.parallel.modules import split_model
from dgemma.parallel.plan import check_split, parameter_slices, stored_slice
from dgemma.quant.quantize import swap_modules, use_cpu_int4_kernel
from dgemma.weights.checkpoint import CheckpointError, open_checkpoint, read_weights


def load_split_model(path, tp: TensorParallel, device="cpu", dtype: torch.dtype = torch.float32, *,
                     quantize: str | None = None, cpu_int4_kernel: bool = True) -> DiffusionGemma:
    """This rank's part of the model in a checkpoint folder (arguments as `dgemma.load_model`)."""
    path = Path(path)
    full, plan, stored = open_checkpoint(path, dtype)  # the whole model on the meta device: headers only
    saved_as = full.quantization
    if saved_as and quantize not in (None, saved_as):
        raise CheckpointError(f"{path}: the weights are stored in {saved_as}; load them as they are (without "
                              f"--quantize) or quantise the unquantised checkpoint to {quantize}")
    fmt = saved_as or quantize
    check_split(full.config, tp.ranks, fmt, str(device))
    with torch.device("meta"):
        model = DiffusionGemma(full.config, full.sampling_config).to(dtype)
    model.hf_config, model.hf_generation_config, model.source_dir = full.hf_config, full.hf_generation_config, path
    split_model(model, tp, fmt)
    quantised = swap_modules(model, fmt) if fmt else {}
    if saved_as:
        model.quantization, quantised = saved_as, {}  # codes and scales are read as stored
    slices = parameter_slices(full.config, tp.ranks, tp.rank, fmt)

    def part(name: str):
        piece = stored_slice(name, slices)
        return None if piece is None else piece.index(stored[plan.sources[name]].shape)

    padded = model.embed_tokens  # this rank's rows of the padded vocabulary; the shards hold V rows
    real = max(0, min(full.config.vocab_size - model.vocab_start, padded.num_embeddings))
    model.embed_tokens = torch.nn.Embedding(real, padded.embedding_dim, device="meta", dtype=dtype)
    read_weights(model, path, plan, stored, device, dtype, quantised, part)
    model.embed_tokens = _padded_embedding(model.embed_tokens.weight, padded.num_embeddings)
    model.quantization = fmt
    if cpu_int4_kernel:
        use_cpu_int4_kernel(model)
    model.load_report = plan.report
    return model.eval()


def _padded_embedding(weight: torch.Tensor, rows: int) -> torch.nn.Embedding:
    """The rows read, followed by zero rows up to `rows` (the padding of a vocabulary N does not divide)."""
    if weight.shape[0] == rows:
        return torch.nn.Embedding.from_pretrained(weight, freeze=False)
    table = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    table[: weight.shape[0]] = weight
    return torch.nn.Embedding.from_pretrained(table, freeze=False)
