"""The CUDA path on fake CUDA tensors, on a machine without a GPU.

Under torch's FakeTensorMode a tensor made with `device="cuda"` carries its shape, dtype and device and no
memory, every op computes only the shapes, dtypes and devices of its outputs, and a CPU tensor meeting a CUDA
one (other than a 0-d scalar) raises FakeTensorDeviceMismatchError, as it would on a GPU. So these tests build
the model (text and vision), its caches and the sampler on CUDA in bf16 (what CUDA runs) and run encode, a
denoising step (whole, and packed for the step cache), the self-conditioning soft embedding, the quantised
layers (int8 and int4: dequantised, then the dense and grouped matmuls CUDA runs) and a training step's
forward and backward under bf16 autocast: the first GPU run's most common failure, a tensor left on the CPU,
shows here. An op that only has a CPU kernel (`_for_cpu`, mkldnn/oneDNN: `CPU_ONLY`) seen on a CUDA tensor
fails the test too.

What fake tensors cannot run, and how the tests step around it:
- a read of device values on the host (`.tolist()`, `int(t)`): the engine's per-step read and the encoder's
  check that a prompt holds as many image tokens as its images give soft tokens. Reads made through
  `dgemma.device_sync.host_read` get a fixed answer per reason (`HOST_READS`); the encoder's image check is
  stepped around by calling `encode_tokens` with the images' soft tokens;
- the CUDA runtime itself: `torch.cuda.mem_get_info` (the LM head's chunking) answers 40 of 80 GiB free,
  pinned memory is not pinned (`pin_memory` returns its tensor), a CUDA generator cannot be made (the
  sampler's draws run with `generator=None`);
- torch's compiled step, FSDP2 over NCCL and the CUDA kernels themselves (their numbers): tests/test_cuda.py,
  on a GPU.
torch 2.13's CPU build has no CUDA device guard; `fake_cuda` installs the no-op one torch keeps for this
(`torch._C._ensureCUDADeviceGuardSet`, which only swaps in over a registered guard that counts no devices).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

import dgemma
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dgemma.config import VisionConfig
from dgemma.model.vision import VisionTower

CPU_ONLY = ("_for_cpu", "mkldnn", "onednn", "_mkl_")  # op names whose only kernels run on a CPU
HOST_READS = {"canvas masks": lambda n: [False] * n}  # reason -> answer of n values (masks kept, not skipped)
# what the host computes on its own tensors (run for real): the vision tower's check of the patches dgemma.images
# made on the host
HOST_SIDE = [(VisionTower, "check")]
VISION = VisionConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                      patch_size=4, pooling_kernel_size=2, position_embedding_size=160)


def _cuda_guard_slot() -> ctypes.c_void_p:
    """CUDA's entry in c10's device guard registry (null in a CPU build)."""
    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    registry = ctypes.addressof(ctypes.c_void_p.in_dll(c10, "_ZN3c104impl26device_guard_impl_registryE"))
    return ctypes.c_void_p.from_address(registry + 8 * 1)  # c10::DeviceType::CUDA is 1


_ANSWER_ZERO = ctypes.CFUNCTYPE(ctypes.c_int64)(lambda: 0)


def _install_fake_cuda_guard():
    """torch's own no-op CUDA guard (`FakeGuardImpl`), swapped in by `_ensureCUDADeviceGuardSet` over a stand-in
    guard whose every virtual call answers 0 (0 devices), which is then no longer referenced."""
    slot = _cuda_guard_slot()
    if slot.value is None:
        vtable = (ctypes.c_void_p * 64)(*[ctypes.cast(_ANSWER_ZERO, ctypes.c_void_p).value] * 64)
        stand_in = (ctypes.c_void_p * 1)(ctypes.addressof(vtable))
        slot.value = ctypes.addressof(stand_in)
        torch._C._ensureCUDADeviceGuardSet()
        assert slot.value != ctypes.addressof(stand_in), "torch did not install its fake CUDA guard"


def _on_the_host(fn):
    """`fn` run outside the fake mode when none of its tensors is fake: work the host does on its own tensors
    (the fake mode would otherwise make them fake, and their values unreadable)."""
    def run(*args, **kwargs):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            return fn(*args, **kwargs)
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return run


class CudaOps(TorchDispatchMode):
    """Records the ops that see a CUDA tensor; an op with only CPU kernels among them raises."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        if any(t.device.type == "cuda" for t in flat):
            name = func.name()
            self.seen.add(name)
            if any(part in name for part in CPU_ONLY):
                raise AssertionError(f"{name} has only CPU kernels and met a CUDA tensor")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_cuda(monkeypatch, data_dependent_shapes: bool = False):
    """Fake CUDA for the block: yields the op recorder (`with ops:` records, once the model is built).
    `data_dependent_shapes`: a boolean mask's selection gets a symbolic size (a ShapeEnv's), instead of
    raising."""
    slot = _cuda_guard_slot()
    saved = slot.value
    _install_fake_cuda_guard()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    from dgemma import device_sync

    def host_read(tensor, reason):
        assert reason in HOST_READS, f"a host read ({reason!r}) on fake CUDA: give HOST_READS its answer"
        return HOST_READS[reason](tensor.numel())

    for owner, name in HOST_SIDE:  # the host's own tensors stay real inside them
        monkeypatch.setattr(owner, name, _on_the_host(getattr(owner, name)))
    original = device_sync.host_read
    for module in [m for name, m in sys.modules.items() if name.startswith("dgemma")]:
        if getattr(module, "host_read", None) is original:
            monkeypatch.setattr(module, "host_read", host_read)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv() if data_dependent_shapes else None):
            yield CudaOps()
    finally:
        slot.value = saved


@contextlib.contextmanager
def cuda_autocast(dtype=torch.bfloat16):
    """`torch.autocast("cuda")`, which turns itself off where torch sees no GPU: its switches set directly."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def meta_model(config=None, quantize: str | None = None, dtype=torch.bfloat16) -> dgemma.DiffusionGemma:
    """The model on the meta device (no storage), quantised there; `to_empty(device="cuda")` under `fake_cuda`
    gives it fake CUDA tensors (made outside the fake mode: a tensor the mode made cannot be swapped later)."""
    from dgemma.quant.quantize import swap_modules

    with torch.device("meta"):
        model = dgemma.DiffusionGemma(config or dgemma.get_preset("tiny")).to(dtype).eval()
    if quantize:
        swap_modules(model, quantize)
        model.quantization = quantize
    return model


def on_cuda(*tensors):
    for t in tensors:
        assert t.device.type == "cuda", t.device


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_generation_on_cuda(monkeypatch, quantize):
    """Encode a padded batch, then a canvas's steps: whole, self-conditioned (the soft embedding), and packed
    for the step cache; the sampler's scan, draw and stop rule on the logits. With int8/int4 weights the
    projections and the experts run dequantised (the experts all at once into one buffer), then the dense and
    grouped matmuls."""
    from dgemma.model import PreviousStep
    from dgemma.model.packing import PackedPositions
    from dgemma.sampling import draw_samples, scan_step
    from dgemma.sampling.stopping import adaptive_stop, new_argmax_history

    model = meta_model(quantize=quantize)
    with fake_cuda(monkeypatch) as ops:
        model.to_empty(device="cuda")
        c = model.config
        B, L = 2, c.canvas_length
        with ops, torch.no_grad():
            cache = model.new_cache(B, 64)
            ids = torch.randint(3, c.vocab_size, (B, 9), device="cuda")
            mask = torch.ones(B, 9, dtype=torch.bool, device="cuda")
            mask[1, :3] = False
            encoded = model.encode(ids, cache, attention_mask=mask)
            canvas = torch.randint(0, c.vocab_size, (B, L), device="cuda")
            logits = model.denoise(canvas, cache)
            previous = PreviousStep.from_logits(logits)
            conditioned = model.denoise(canvas, cache, self_conditioning=previous)
            soft = model.soft_embedding_from_probs(torch.softmax(logits, -1))
            on_cuda(encoded, logits, conditioned, soft, cache.lengths())
            assert encoded.shape == (B, 9, c.vocab_size) and logits.dtype == torch.float32

            active = torch.zeros(B, L, dtype=torch.bool, device="cuda")  # the step cache: 5 and 11 positions left
            pack = PackedPositions.from_mask(active, [5, 11])
            packed = model.decode_active(canvas, cache, pack, self_conditioning=previous)
            assert packed.shape == (16, c.vocab_size)
            on_cuda(packed, pack.row_of, pack.index)

            step = draw_samples(scan_step(conditioned, 0.8, 0.1, None), count=7)  # the count: the engine's read
            stop, history = adaptive_stop(new_argmax_history(2, B, L, "cuda"), step.argmax, step.entropy, 0.005)
            on_cuda(step.canvas, step.entropy, step.accepted, stop, history)
    assert {"aten::mm", "aten::_grouped_mm"} <= ops.seen  # bf16 on CUDA: the experts' grouped GEMM
    if quantize:  # on CUDA the codes are dequantised for bf16 matmuls: none of the CPU's int4/int8 kernels
        from dgemma.quant.kernels import kernels
        from dgemma.quant.quantize import cpu_int4_kernel_applies

        assert not cpu_int4_kernel_applies(model)
        assert set(kernels(model, 256).values()) >= {f"{quantize} dequantised to bfloat16, then a bfloat16 matmul"}


def test_images_on_cuda(monkeypatch):
    """A prompt with an image: the vision tower and its projection on CUDA from the host's patches (as
    dgemma.images makes them), the soft tokens in the prompt's place, the encoder over it."""
    monkeypatch.setitem(HOST_READS, "image tokens", lambda n: 9)  # the prompt's image tokens, counted
    side = torch.arange(6)
    positions = torch.stack(torch.meshgrid(side, side, indexing="xy"), -1).reshape(1, 36, 2)
    positions = torch.cat([positions, torch.full((1, 4, 2), -1)], dim=1)  # 4 padding slots
    pixels = torch.rand(1, 40, 3 * 4 * 4)
    model = meta_model(dgemma.get_preset("tiny").replace(vision=VISION, image_token_id=5))
    with fake_cuda(monkeypatch) as ops:
        model.to_empty(device="cuda")
        with ops, torch.no_grad():
            soft = model.embed_images(pixels, positions)  # 6 x 6 patches pooled 2 x 2: 9 soft tokens
            assert soft.shape == (9, model.config.hidden_size)
            ids = torch.tensor([[2, 40] + [5] * 9 + [41]], device="cuda")
            logits = model.encode(ids, model.new_cache(1, 64), pixel_values=pixels, image_position_ids=positions)
            on_cuda(soft, logits)


def test_training_step_on_cuda(monkeypatch):
    """One step of the diffusion objective (encoder next-token loss too) under bf16 autocast, as `dgemma
    train` runs on a GPU, and the graph its backward runs: every weight reached, every tensor saved for the
    backward on CUDA."""
    from dgemma.training.data import Batch
    from dgemma.training.objective import diffusion_losses, draw_noise

    config = dgemma.get_preset("tiny")
    B, L = 2, config.canvas_length
    ids = torch.randint(3, config.vocab_size, (B, 5 + 2 * L))
    targets = torch.zeros_like(ids, dtype=torch.bool)
    targets[:, 5:] = True
    batch = Batch(ids, torch.ones_like(targets), targets, torch.tensor([5, 5]), torch.tensor([2, 2]),
                  torch.tensor([0, 1]))
    noise = draw_noise(batch, run_seed=0, canvas_length=L, vocab_size=config.vocab_size, eps=1e-3, self_cond_prob=0.5)
    model = meta_model(config, dtype=torch.float32).train()  # fp32 weights: autocast computes in bf16
    with fake_cuda(monkeypatch, data_dependent_shapes=True) as ops:  # the next-token loss's target rows
        model.to_empty(device="cuda")
        with ops:
            with cuda_autocast():
                losses = diffusion_losses(model, batch.to("cuda"), noise, cache_dtype=torch.bfloat16, lockstep=True)
            nodes, saved = backward_graph(losses.total.sum())
    on_cuda(losses.total, *saved)
    learns = {id(p) for p in model.parameters()}
    assert learns <= {id(node.variable) for node in nodes if hasattr(node, "variable")}  # every weight gets a grad
    assert "aten::_grouped_mm" in ops.seen  # the experts in autocast's bf16


def backward_graph(loss: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
    """The nodes of the graph `loss.backward()` would run, and the tensors they saved for it other than 0-d
    scalars (a CPU tensor saved by a CUDA op fails on a GPU when the backward runs). The backward itself does
    not run here: torch's autograd engine needs a real device for CUDA tensors."""
    nodes, saved, todo, seen = [], [], [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        for name in dir(node):
            value = getattr(node, name) if name.startswith("_saved_") else None
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    saved.append(t)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return nodes, saved
