"""int4 weights on OpenVINO's kernels (dgemma.quant.openvino, the cpu-kernels extra): the codes it is handed, its
products against the fp32 product of the dequantised weights, the one copy (dgemma's codes released, every
row count on the library's), the paths that needed dgemma's copy (run on the library's, or refused in one
line), a whole model's logits against torch's path, and what `dgemma bench` reports as run."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import dgemma
from dgemma import devices, processes
from dgemma.quant import int8_compute, kernels, openvino
from dgemma.quant import quantize as quant
from dgemma.quant.quantize import QuantExperts, QuantLinear, quantize_model, use_cpu_int4_kernel

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                                    reason="openvino is not installed (pip install 'dgemma[cpu-kernels]')")


def _tiny_int4(dtype, seed=0, **changes):
    torch.manual_seed(seed)
    config = dgemma.get_preset("tiny").replace(**changes)
    model = quantize_model(dgemma.DiffusionGemma(config).to(dtype).eval(), "int4")
    use_cpu_int4_kernel(model)  # bf16: torch's kernel layout, which the graphs read back
    return model


def _dense_experts(experts) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's dequantised (gate_up, down) in fp32, read while dgemma still holds the codes."""
    return [tuple(w.float() for w in experts.expert_weights(e)) for e in range(experts.num_experts)]


def _reference(grouped: torch.Tensor, counts: list[int], dense) -> torch.Tensor:
    out, start = torch.empty(grouped.shape[0], dense[0][1].shape[0]), 0
    for e, n in enumerate(counts):
        gate, up = F.linear(grouped[start : start + n].float(), dense[e][0]).chunk(2, -1)
        out[start : start + n] = F.linear(F.gelu(gate, approximate="tanh") * up, dense[e][1])
        start += n
    return out


@pytest.mark.parametrize("kernel", [False, True])
def test_codes_are_handed_over_as_signed_nibbles(kernel):
    """Whichever layout the module holds (dgemma's, or torch's int4 kernel's as AVX-512 packs it), OpenVINO gets
    (N, K/2) bytes: column 2c in the low nibble, 2c + 1 in the high one, the signed value in two's complement."""
    if kernel and not devices.int4_kernel_layout_known(128):
        pytest.skip("torch packs its int4 kernel's layout this way on AVX-512 CPUs only")
    w = torch.randn(128, 96) * 0.02
    q, scales = quant.quantize_tensor(w, "int4")
    if kernel:
        q, scales = quant._to_kernel_layout(q, scales, torch.bfloat16)
    codes = torch.from_numpy(openvino.plain_codes(q, kernel))
    low, high = (codes & 15).to(torch.int8), (codes >> 4).to(torch.int8)
    values = torch.stack([low - 16 * (low > 7), high - 16 * (high > 7)], dim=-1).flatten(-2)  # (128, 96)
    dense = values.float().view(128, 3, 32) * torch.from_numpy(openvino.plain_scales(scales, kernel)).float()[..., None]
    reference = quant.dequantize_tensor(*quant.quantize_tensor(w, "int4"), "int4", torch.float32)
    assert torch.allclose(dense.view(128, 96), reference, rtol=2**-7, atol=0)  # kernel scales are bf16


@needs_openvino
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_one_copy_and_every_row_count_on_it(dtype):
    """After the hand-over dgemma's codes and scales are gone (meta tensors: no storage) and the graph, its copy
    the only one, runs 1 row (an AR token), a few, and many on some experts, none on others: cosine >= 0.999
    against the fp32 product of the weights read before the hand-over (int8 activations in groups of 32 where
    the CPU has no bf16), as torch's path gets. The arrays the graph's constants were built from are freed
    after its first run: these products show OpenVINO reads its own copy from then on."""
    model = _tiny_int4(dtype)
    experts = model.layers[1].experts
    dense = _dense_experts(experts)
    before = quant.loaded_weight_bytes(model)
    assert int8_compute.enable(model, "on", library="openvino")
    handed = [m for m in model.modules() if isinstance(m, (QuantExperts, QuantLinear)) and m.library is not None]
    assert experts in handed and model.layers[0].self_attn.q_proj in handed  # (kernel-layout k/v of 32 rows stay)
    assert all(m.weights_in_library for m in handed)
    assert all(b.is_meta for m in handed for b in m.buffers(recurse=False))  # no storage left on dgemma's side
    held = sum(b.numel() * b.element_size() for m in handed for b in m.buffers(recurse=False))
    assert quant.loaded_weight_bytes(model) == before - held
    g = torch.Generator().manual_seed(3)
    for counts in ([1, 0, 0, 0], [0, 2, 0, 1], [20, 0, 13, 7], [64, 64, 64, 64]):
        grouped = torch.randn(sum(counts), 64, generator=g).to(dtype)
        out = experts.library(grouped, counts).float()
        reference = _reference(grouped, counts, dense)
        assert F.cosine_similarity(out, reference, dim=-1).min() >= 0.999, counts
        assert (out - reference).abs().max() <= 0.03 * reference.abs().max()


@needs_openvino
@torch.no_grad()
def test_canvas_calls_hand_their_intermediate_tensors_back():
    """A graph call of RELEASE_ROWS rows or more hands its intermediate tensors back as it returns (kept, every
    graph would hold those of the largest call it ran: ~56 MiB per experts layer of the 26B at a canvas); a
    one-row call keeps its few bytes and skips the release; a call after a release gives the same product."""
    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on", library="openvino")
    library = model.layers[1].experts.library
    released = []

    class Counted:
        def __init__(self, compiled):
            self.compiled = compiled

        def release_memory(self):
            released.append(True)
            self.compiled.release_memory()

    for graph in library.graphs:
        graph.compiled = Counted(graph.compiled)
    g = torch.Generator().manual_seed(5)
    many = [openvino.RELEASE_ROWS] * library.num_experts  # every graph gets RELEASE_ROWS rows or more
    one = [1] + [0] * (library.num_experts - 1)
    rows, row = torch.randn(sum(many), 64, generator=g).bfloat16(), torch.randn(1, 64, generator=g).bfloat16()
    first = library(rows, many)
    assert len(released) == len(library.graphs)
    library(row, one)
    assert len(released) == len(library.graphs)
    assert torch.equal(library(rows, many), first) and len(released) == 2 * len(library.graphs)


@needs_openvino
@torch.no_grad()
def test_experts_run_as_one_graph_per_thread_with_the_same_products():
    """A layer's experts go to as many graphs as threads (at most one per expert), consecutive experts each, one
    thread each, run at once: every split gives the one graph's products exactly, whichever graphs have rows
    (one row, a graph with none, uneven rows); the kernels line says the split."""
    counts_list = ([1, 0, 0, 0], [0, 0, 5, 3], [20, 0, 13, 7], [3, 9, 1, 30])
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(sum(c), 64, generator=g).bfloat16() for c in counts_list]
    products = {}
    for threads in (1, 2, 3, 8):
        experts = _tiny_int4(torch.bfloat16).layers[1].experts
        library = openvino.LibraryExperts(experts, threads)
        E = library.num_experts
        assert len(library.graphs) == min(threads, E)
        assert [(graph.first, graph.last) for graph in library.graphs] == \
            [(E * i // len(library.graphs), E * (i + 1) // len(library.graphs)) for i in range(len(library.graphs))]
        layouts = {1: "one graph per layer", 2: "2 graphs per layer, 2 experts and 1 thread each, side by side",
                   3: "3 graphs per layer, 1-2 experts and 1 thread each, side by side",
                   8: "4 graphs per layer, 1 expert and 2 threads each, side by side"}
        assert library.layout == layouts[threads]
        products[threads] = [library(x, c) for x, c in zip(inputs, counts_list)]
    for threads in (2, 3, 8):
        assert all(torch.equal(a, b) for a, b in zip(products[threads], products[1])), threads


@needs_openvino
@torch.no_grad()
def test_linear_layers_match_their_weights_at_every_row_count():
    """A QuantLinear handed over (DGEMMA_CPU_KERNELS=openvino takes every size) against its dequantised weight,
    at 1 and 256 rows, in a 3-D call as the layers make them."""
    model = _tiny_int4(torch.bfloat16)
    q_proj = model.layers[0].self_attn.q_proj
    weight = q_proj.weight.float()
    int8_compute.enable(model, "on", library="openvino")
    assert q_proj.library is not None and q_proj.qweight.is_meta
    g = torch.Generator().manual_seed(1)
    for rows in (1, 256):
        x = torch.randn(1, rows, weight.shape[1], generator=g).bfloat16()
        out = q_proj(x)
        assert out.shape == (1, rows, weight.shape[0]) and out.dtype == torch.bfloat16
        reference = F.linear(x.float(), weight)
        assert F.cosine_similarity(out.float().flatten(0, 1), reference.flatten(0, 1), dim=-1).min() >= 0.999


@needs_openvino
def test_small_linears_stay_on_dgemmas_path_by_default(monkeypatch):
    """auto gives the library the experts and the linears from MIN_LINEAR_WEIGHTS weights (the tiny preset's are
    below it): those keep dgemma's codes and torch's kernels."""
    monkeypatch.delenv("DGEMMA_CPU_KERNELS", raising=False)
    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on")
    assert model.layers[0].experts.weights_in_library
    q_proj = model.layers[0].self_attn.q_proj
    assert q_proj.library is None and not q_proj.qweight.is_meta


@needs_openvino
def test_paths_that_need_dgemmas_copy_are_refused_in_one_line(tmp_path):
    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on", library="openvino")
    experts, q_proj = model.layers[0].experts, model.layers[0].self_attn.q_proj
    for call in (lambda: dgemma.save_pretrained(model, tmp_path / "out"), lambda: experts.expert_weights(0),
                 lambda: q_proj.weight, lambda: quantize_model(model, "int4"),
                 lambda: experts.dequantized("gate_up_proj"),
                 lambda: experts._one_expert(0, torch.zeros(1, 64, dtype=torch.bfloat16))):
        with pytest.raises(openvino.WeightsInLibrary, match="DGEMMA_CPU_KERNELS=torch") as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@needs_openvino
@torch.no_grad()
def test_lora_adapters_run_on_the_librarys_copy():
    """A served LoRA adapter over a layer the library holds: base(x) on OpenVINO plus the adapter's term."""
    from dgemma.model.adapters import Adapter, install_adapters

    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on", library="openvino")
    name = "layers.0.self_attn.q_proj"
    base = model.get_submodule(name)
    g = torch.Generator().manual_seed(2)
    A, B = torch.randn(4, base.in_features, generator=g), torch.randn(base.out_features, 4, generator=g)
    rows = install_adapters(model, [Adapter(name="a", weights={name: (A, B)}, scale=0.5, base_config_hash=None)])
    x = torch.randn(2, 3, base.in_features, generator=g).bfloat16()
    plain = base(x)
    with rows.set(torch.tensor([0, 1])):
        out = model.get_submodule(name)(x)
    term = (x[1].float() @ A.t() @ B.t() * 0.5)
    assert torch.equal(out[0], plain[0])
    assert torch.allclose(out[1].float(), plain[1].float() + term, rtol=0.02, atol=0.02 * term.abs().max().item())


@needs_openvino
def test_hand_over_declines_without_the_memory(monkeypatch, capsys):
    """Where the memory available cannot hold OpenVINO's extra, everything stays on torch's kernels, one note."""
    monkeypatch.setattr(devices, "available_host_memory", lambda: 1)
    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on", library="openvino")
    assert not openvino.in_library(model) and model.layers[0].experts.library is None
    assert "stay on torch's kernels" in capsys.readouterr().err


@needs_openvino
@torch.no_grad()
def test_sudoku_logits_agree_with_torchs_kernels(monkeypatch):
    """The shipped sudoku model in int4 (trained routers: a random model's flip on any rounding) over 8 puzzles:
    a denoising step (1,296 entries) against torch's int4 kernels, both against the float model: the library's
    logits as close to it as torch's (mean cosine within 0.001, argmax agreement within a point; int4 itself
    costs more here: cosine 0.996, 94% of the argmaxes of these random canvases). An AR-sized call (a few
    entries) runs on the library too: its copy is the only one."""
    from dgemma.tasks.sudoku_models import SHIPPED
    from dgemma.tasks import sudoku

    puzzles = [e.puzzle for e in sudoku.generate_examples(8, seed=4)]
    prompt = torch.tensor([sudoku.encode_prompt(p) for p in puzzles])
    canvas = torch.randint(0, 16, (8, 81), generator=torch.Generator().manual_seed(5))
    reference = dgemma.load_model(SHIPPED, dtype=torch.float32)
    torch_path = dgemma.load_model(SHIPPED, dtype=torch.bfloat16, quantize="int4")
    library = copy.deepcopy(torch_path)
    assert int8_compute.enable(torch_path, "on", library="torch") and torch_path.layers[0].experts.library is None
    assert int8_compute.enable(library, "on", library="openvino") and library.layers[0].experts.library is not None
    logits = []
    for model in (reference, torch_path, library):
        cache = model.new_cache(8, 96)
        model.encode(prompt, cache, return_logits=False)
        logits.append(model.denoise(canvas, cache).float().flatten(0, 1))
    cos = [F.cosine_similarity(logits[0], other, dim=-1).mean() for other in logits[1:]]
    agree = [(logits[0].argmax(-1) == other.argmax(-1)).float().mean() for other in logits[1:]]
    assert cos[1] >= cos[0] - 0.001 and agree[1] >= agree[0] - 0.01, (cos, agree)
    calls = []
    real = openvino.LibraryExperts.__call__
    monkeypatch.setattr(openvino.LibraryExperts, "__call__", lambda self, *a: calls.append(a) or real(self, *a))
    ar = library.encode(prompt[:1, :2], library.new_cache(1, 8)).float()  # 2 tokens, top-2: 4 entries
    expected = torch_path.encode(prompt[:1, :2], torch_path.new_cache(1, 8)).float()
    assert calls and F.cosine_similarity(ar.flatten(0, 1), expected.flatten(0, 1), dim=-1).min() >= 0.99


@needs_openvino
def test_bench_reports_the_kernels_that_ran(monkeypatch):
    """What `dgemma bench` prints and the start line says: OpenVINO for the parts it holds at every row count,
    torch's int4 kernel or widened int8 for the rest, the head's table."""
    monkeypatch.delenv("DGEMMA_CPU_KERNELS", raising=False)
    model = _tiny_int4(torch.bfloat16)
    int8_compute.enable(model, "on")  # auto: the experts; the tiny linears stay
    canvas, token = kernels.kernels(model, 256), kernels.kernels(model, 1)
    assert canvas["experts"].startswith("OpenVINO int4") and token["experts"] == canvas["experts"]
    assert canvas["attention projections"].startswith("torch int4")  # 64 x 96 weights: widening does not pay
    assert canvas["dense MLP"].startswith("torch int4")
    monkeypatch.setattr(int8_compute, "MIN_WEIGHTS_TO_WIDEN", 1)
    assert kernels.kernels(model, 256)["attention projections"].startswith("int8 x int8")
    assert canvas["head"] == canvas["soft embedding"] == "bfloat16 matmul"  # below int8_compute.MIN_TABLE_ENTRIES
    line = kernels.start_line(model)
    assert line.startswith("CPU kernels at a canvas step (16 rows): experts OpenVINO") and "\n" not in line


def test_unknown_library_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="openvino"):
        int8_compute.enable(_tiny_int4(torch.float32), "on", library="onnx")
    monkeypatch.setenv("DGEMMA_CPU_KERNELS", "onnx")
    with pytest.raises(ValueError, match="DGEMMA_CPU_KERNELS"):
        int8_compute.enable(_tiny_int4(torch.float32), "on")


@needs_openvino
@torch.no_grad()
def test_experts_go_over_in_groups_of_64_where_32_do_not_fit(monkeypatch):
    """The hand-over's plan: where dgemma's groups of 32 would take the process past the memory it may use, the
    experts are quantised again in groups of 64 (the library's per-group numbers halve) and still match their
    weights (int4 twice: cosine >= 0.99)."""
    model = _tiny_int4(torch.bfloat16, moe_intermediate_size=64)  # widths of whole groups of 64
    experts = model.layers[1].experts
    dense = _dense_experts(experts)
    chosen = [(m, part) for m in model.modules() if (part := openvino.takes(m, everything=True))]
    held = openvino.held_bytes(m for m, _ in chosen)
    entries = openvino.canvas_entries(model.config)
    size = {g: sum(openvino.library_bytes(m, g if p == "experts" else 32, entries) for m, p in chosen)
            for g in (32, 64)}
    assert size[64] < size[32]
    monkeypatch.setattr(processes, "resident_memory", lambda: {"rss": held})
    monkeypatch.setattr(devices, "available_host_memory", lambda: 1 << 40)
    budget = (size[32] + size[64]) // 2  # the plan keeps rss - held + library + reserve within it
    reserve = openvino.reserve_bytes(model.config)
    monkeypatch.setattr(devices, "total_host_memory", lambda: int((budget + reserve) / openvino.MEMORY_SHARE))
    int8_compute.enable(model, "on", library="openvino")
    assert experts.library.group == 64 and model.layers[0].self_attn.q_proj.library.group == 32
    assert "groups of 64" in kernels.kernels(model, 16)["experts"]
    counts = [5, 0, 9, 2]
    grouped = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = experts.library(grouped, counts).float()
    assert F.cosine_similarity(out, _reference(grouped, counts, dense), dim=-1).min() >= 0.99


def test_the_plan_counts_the_live_memory_not_what_glibc_kept(monkeypatch):
    """The plan collects garbage and hands freed heap memory back before it reads the resident set: what a load
    left behind is not live, and counted it would leave layers on torch's kernels for nothing."""
    model = _tiny_int4(torch.bfloat16)
    calls = []
    monkeypatch.setattr(processes, "release_freed_memory", lambda: calls.append("release"))
    monkeypatch.setattr(processes, "resident_memory", lambda: calls.append("rss") or {"rss": 1 << 30})
    chosen = [(m, part) for m in model.modules() if (part := openvino.takes(m, everything=True))]
    openvino.plan(chosen, model.config)
    assert calls[:2] == ["release", "rss"]


@needs_openvino
def test_the_librarys_threads_share_two_malloc_arenas(monkeypatch):
    """Once the library takes weights, the threads its graphs run on share glibc's arenas (MALLOC_ARENAS): each
    arena would keep its own set of freed intermediate tensors. Declined for want of memory, nothing is set."""
    calls, available = [], [1]
    monkeypatch.setattr(processes, "limit_malloc_arenas", lambda count: calls.append(count) or True)
    monkeypatch.setattr(devices, "available_host_memory", lambda: available[0])
    int8_compute.enable(_tiny_int4(torch.bfloat16), "on", library="openvino")
    assert calls == []
    available[0] = 64 << 30
    int8_compute.enable(_tiny_int4(torch.bfloat16), "on", library="openvino")
    assert calls == [openvino.MALLOC_ARENAS] == [2]


@pytest.mark.skipif(processes.glibc() is None, reason="glibc's malloc arenas")
def test_capping_malloc_arenas_makes_new_threads_share_them():
    """glibc gives threads that allocate at once an arena each (up to 8 a core); after `limit_malloc_arenas(2)`
    six such threads share two (counted by glibc's own malloc_stats). A cap set in the environment is left."""
    script = (
        "import ctypes, os, sys, threading\n"
        "from dgemma import processes\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "print(processes.limit_malloc_arenas(2) if sys.argv[1] == 'capped' else None, flush=True)\n"
        "together, kept = threading.Barrier(6), []\n"
        "def work():\n"
        "    together.wait()\n"  # every thread alive: none can take over an arena another left
        "    kept.append(libc.malloc(1 << 16))\n"
        "    together.wait()\n"
        "threads = [threading.Thread(target=work) for _ in range(6)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "libc.malloc_stats()\n"
    )

    def arenas(mode: str, **env) -> tuple[str, int]:
        unset = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120,
                             env={**unset, **env})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip(), sum(line.startswith("Arena ") for line in out.stderr.splitlines())

    assert arenas("capped") == ("True", 2)
    assert arenas("free")[1] >= 4  # the main thread's and one for (nearly) each of the six
    assert arenas("capped", MALLOC_ARENA_MAX="3") == ("False", 3)


def test_a_shortened_openmp_spin_stops_idle_threads_burning_a_core():
    """libgomp's idle threads spin ~300,000 times before sleeping; shortened before torch loads, in a loop of
    parallel ops 2 ms apart torch's other OpenMP thread burns far less CPU (the spin OpenVINO's graphs would share a
    core with).
    Set too late (torch loaded) or over the environment's own setting, nothing is changed."""
    script = (
        "import sys, time\n"
        "from dgemma import processes\n"
        "print(processes.shorten_openmp_spin() if sys.argv[1] == 'short' else None, flush=True)\n"
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "x = torch.ones(1 << 20)\n"
        "[x.add_(1) for _ in range(20)]\n"
        "start, own = time.process_time(), time.thread_time()\n"
        "for _ in range(200):\n"
        "    x.add_(1)\n"
        "    time.sleep(0.002)\n"
        "others = (time.process_time() - start) - (time.thread_time() - own)\n"  # the OpenMP thread's CPU
        "print(others, processes.shorten_openmp_spin())\n"
    )

    def cpu_seconds(mode: str, **env) -> tuple[str, float, str]:
        base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120,
                             env={**base, **env})
        assert out.returncode == 0, out.stderr
        first, second = out.stdout.splitlines()
        seconds, again = second.split()[:2]
        return first, float(seconds), again

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores: one for the loop, one for the idle thread")
    default = cpu_seconds("default")
    short = cpu_seconds("short")
    assert default[0] == "None" and short[0] == "True" and short[2] == "False"  # once torch is loaded: too late
    assert short[1] < 0.5 * default[1], (short, default)
    assert cpu_seconds("short", GOMP_SPINCOUNT="300000")[0] == "False"
    assert cpu_seconds("short", OMP_WAIT_POLICY="active")[0] == "False"


def test_the_cli_shortens_the_spin_only_where_openvino_may_take_int4_weights(tmp_path, monkeypatch):
    """Known from the flags before torch loads: int4 by --quantize or a folder saved in int4, the library installed
    and not turned off (DGEMMA_CPU_KERNELS=torch, --cpu-int8-compute off), no GPU asked for."""
    import argparse
    import importlib.util
    import json

    from dgemma.cli import openvino_may_run

    saved = {}
    for fmt in ("int4", "int8"):
        saved[fmt] = tmp_path / fmt
        saved[fmt].mkdir()
        (saved[fmt] / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "dgemma",
                                                                                    "format": fmt}}))

    def may(**flags) -> bool:
        return openvino_may_run(argparse.Namespace(**{"cpu_int8_compute": "auto", "device": "auto", **flags}))

    monkeypatch.delenv("DGEMMA_CPU_KERNELS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # installed
    assert may(quantize="int4", model=None) and may(quantize=None, model=str(saved["int4"]))
    assert not may(quantize=None, model=str(saved["int8"])) and not may(quantize="int8", model=None)
    assert not may(quantize=None, model=str(tmp_path / "missing")) and not may(quantize=None, model=None)
    assert not may(quantize="int4", model=None, cpu_int8_compute="off")
    assert not may(quantize="int4", model=None, device="cuda:1")
    monkeypatch.setenv("DGEMMA_CPU_KERNELS", "torch")
    assert not may(quantize="int4", model=None)
    monkeypatch.setenv("DGEMMA_CPU_KERNELS", "openvino")
    assert may(quantize="int4", model=None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # not installed
    assert not may(quantize="int4", model=None)


@needs_openvino
def test_layers_memory_cannot_hold_stay_on_torchs_kernels(monkeypatch, capsys):
    """Where not every layer's experts fit, the linears and as many experts as fit go over, the rest keep
    dgemma's copy and torch's kernels; the note and the kernels say how many."""
    model = _tiny_int4(torch.bfloat16)
    chosen = [(m, part) for m in model.modules() if (part := openvino.takes(m, everything=True))]
    held = openvino.held_bytes(m for m, _ in chosen)

    def growth(pairs):
        entries = openvino.canvas_entries(model.config)
        return sum(openvino.library_bytes(m, 32, entries) - openvino.held_bytes([m]) for m, _ in pairs)

    linears, experts = [c for c in chosen if c[1] == "linears"], [c for c in chosen if c[1] == "experts"]
    room = growth(linears) + growth(experts[:1]) + 1  # the linears and one layer's experts (groups of 32: tiny)
    monkeypatch.setattr(processes, "resident_memory", lambda: {"rss": held})
    monkeypatch.setattr(devices, "available_host_memory", lambda: 1 << 40)
    total = (held + room + openvino.reserve_bytes(model.config)) / openvino.MEMORY_SHARE
    monkeypatch.setattr(devices, "total_host_memory", lambda: int(total) + 1)
    int8_compute.enable(model, "on", library="openvino")
    on = [block.experts.library is not None for block in model.layers]
    assert on == [True, False, False, False]
    err = capsys.readouterr().err
    assert f"{len(chosen) - len(linears) - 1} of {len(chosen)} int4 weights stay" in err
    assert f"(the process may use {(int(total) + 1) * openvino.MEMORY_SHARE / 2**30:.2f} GiB: 85% of the machine's" in err
    assert "in 1 of 4 layers, the others torch int4" in kernels.kernels(model, 16)["experts"]
    assert not model.layers[1].experts.gate_up_proj_q.is_meta  # dgemma's copy, still in use


@needs_openvino
@pytest.mark.parametrize("quantise", [True, False])
@torch.no_grad()
def test_the_activations_named_are_what_the_graphs_multiply(monkeypatch, request, quantise):
    """The start line names what OpenVINO multiplies the int4 weights by, asked of a probe (its precision hint
    does not say). Checked on the model's own graphs, experts in groups of 64 and a linear in 32: where it says
    int8, values of 1/1024 beside a 1 in its group are quantised away (the output is that of the 1 alone); where
    it names a float type, they are not. Each graph quantises per the weights' own group (a wider group would
    leave the products unquantised); with the quantisation turned off, the probe must name a float type."""
    if not quantise:
        real = openvino.compile_config
        monkeypatch.setattr(openvino, "compile_config",
                            lambda threads, group: real(threads, group) | {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    openvino.activations.cache_clear()  # the probe's answers are for the settings it ran with
    request.addfinalizer(openvino.activations.cache_clear)
    model = _tiny_int4(torch.bfloat16, moe_intermediate_size=64)
    monkeypatch.setattr(openvino, "plan", lambda chosen, config: (64, chosen, "test"))
    int8_compute.enable(model, "on", library="openvino")
    experts, linear = model.layers[1].experts.library, model.layers[0].self_attn.q_proj.library
    assert experts.group == 64 and linear.group == 32
    for graph in (*experts.graphs, linear):
        assert graph.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == (graph.group if quantise else 0)
    if not quantise:
        assert not experts.activations.startswith("int8") and not linear.activations.startswith("int8")
    assert experts.activations == openvino.activations(torch.bfloat16, 64) and linear.activations == \
        openvino.activations(torch.bfloat16, 32)
    assert kernels.kernels(model, 256)["experts"].startswith(f"OpenVINO int4 x {experts.activations}, groups of 64")

    def pair(run, width, group):
        rows = torch.zeros(2, width, dtype=torch.bfloat16)
        rows[:, 0], rows[1, 1:group] = 1.0, 1 / 1024  # unquantised, ~0.5% of each output: seen in bf16
        return [run(rows[i : i + 1]).float() for i in range(2)]

    checks = [(experts.activations, pair(lambda row: experts(row, [1] + [0] * (experts.num_experts - 1)),
                                         experts.hidden, 64)),
              (linear.activations, pair(linear, linear.in_features, 32))]
    for named, (alone, beside) in checks:
        assert torch.equal(alone, beside) == named.startswith("int8"), named
