"""A model with random weights, made tensor by tensor on its device in its dtype.

`DiffusionGemma(config).to(device, dtype)` makes every weight in fp32 on the host first: 101 GB for the
26B-A4B shape. Here the model is built on the meta device, then each tensor is created where and as it will
live (quantised ones directly in their int8 / int4 format), so the process never holds more than the model
plus one tensor. Used by `dgemma bench` for presets with random weights.
"""

from __future__ import annotations

import torch

from dgemma.config import ModelConfig, SamplingConfig
from dgemma.model.network import DiffusionGemma
from dgemma.quant.quantize import (QuantExperts, cpu_int4_kernel_applies, fits_int4_kernel, kernel_scales,
                                 random_quantized, swap_modules, use_cpu_int4_kernel)


@torch.no_grad()
def random_model(config: ModelConfig, *, device="cpu", dtype: torch.dtype = torch.float32,
                 quantize: str | None = None, seed: int = 0,
                 sampling_config: SamplingConfig | None = None, reshape=None) -> DiffusionGemma:
    """Matrices normal(0, initializer_range) (quantised: codes uniform over the levels, the same spread),
    norms and scales ones, as `DiffusionGemma.reset_parameters` does; the values depend on `seed` and on
    the device's generator. `reshape(model)` changes the meta-device model before it is filled (a rank's
    part of a split model: `dgemma.parallel.modules.split_model`)."""
    with torch.device("meta"):
        model = DiffusionGemma(config, sampling_config).to(dtype)
    if reshape is not None:
        model = reshape(model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    quantised = swap_modules(model, quantize) if quantize else {}
    gen = torch.Generator(device=device).manual_seed(seed)
    # bf16 int4 on a CPU runs torch's int4 matmul: random codes are random in its layout too, so only the
    # scales are made in its form (no repacking)
    kernel = (quantize == "int4" and cpu_int4_kernel_applies(model, torch.device(device), dtype)
              and all(fits_int4_kernel(shapes[n][-1]) for n in quantised))
    std = config.initializer_range
    tensors = {}
    for name, shape in shapes.items():
        module = quantised.get(name)
        if module is None:
            tensors[name] = (torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std)
                             if len(shape) >= 2 else torch.ones(shape, device=device, dtype=dtype))
        elif isinstance(module, QuantExperts):
            which = name.rsplit(".", 1)[1]
            q, scales = random_quantized(shape, quantize, std, gen, device)
            setattr(module, f"{which}_q", q)
            setattr(module, f"{which}_scales", kernel_scales(scales, dtype) if kernel else scales)
            module.kernel_layout = kernel
        else:
            q, scales = random_quantized(shape, quantize, std, gen, device)
            module.qweight, module.scales = q, kernel_scales(scales, dtype) if kernel else scales
            module.kernel_layout = kernel
    missing, unexpected = model.load_state_dict(tensors, assign=True, strict=False)
    left = [k for k in missing if not k.endswith(("qweight", "scales", "_q"))]
    assert not left and not unexpected, (left, unexpected)
    model.quantization = quantize
    use_cpu_int4_kernel(model)  # bf16 int4 on a CPU: torch's int4 matmul (repacked expert by expert)
    return model.eval()
