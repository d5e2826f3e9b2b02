"""Library int4 kernels on a CPU against torch's, at the 26B-A4B's shapes: one table, ratios side by side.

Every product multiplies bf16 activations (M, K) by one int4 weight (N, K) quantised as dgemma quantises
(`dgemma.quant.quantize`: symmetric, groups of 32, fp16 scales) and returns bf16 (M, N). The systems:

  torch-int4      torch's `_weight_int4pack_mm_for_cpu` (bf16 activations): what an int4 model runs today
  torch-int8      dgemma's int8 compute: the int4 codes widened to int8, then `torch._int_mm`
                  (`dgemma.quant.int8_compute`; the model widens only from 128 rows, timed here at every count)
  torch-bf16/fp32 the dequantised weight, dense `F.linear`
  ort-acc4/acc0   onnxruntime's `com.microsoft::MatMulNBits`, accuracy level 4 (int8 activations, MLAS's
                  VNNI kernels) and 0 (fp32 activations); the codes and scales are dgemma's bytes as they are
  ov-int4[-dq]    OpenVINO's CPU plugin, int4 weight compression (u4 codes, zero point 8), bf16 in and out;
                  -dq: dynamic int8 quantisation of the activations (groups of 32, the plugin's default)
  ov-int4[-dq]-g64 (`--groups-of-64`) the same weight quantised again in groups of 64 (as the hand-over
                  regroups the 26B's experts where groups of 32 do not fit), -dq quantising per group of 64
  torchao-a8w4    torchao's `Int8DynamicActivationIntxWeightConfig` (int4 groups of 32, int8 activations)
Each per-call time includes what sharing the tensors costs: the activations' conversion where a library wants
fp32 (onnxruntime), the binding of torch's buffers (IOBinding on `data_ptr`, OpenVINO tensors over the same
memory: no copies) and the output's conversion back to bf16. The LM head row uses a slice of the vocabulary
(`--head-rows`) and int8 weights for the integer systems (the table is not int4 in dgemma); its figures
scale with the slice.

`--moe` adds a whole MoE layer (router top-8 of 128 experts, 256 tokens) where a library has a fused op:
onnxruntime's `QMoE` (CPU: SwiGLU only, so it runs x * sigmoid(1.702 x) * up in place of Gemma's GELU-tanh
gate: timing only) against dgemma's `QuantExperts` (torch's int4 kernel, int8 compute where it engages).

Accuracy: cosine and max relative error (max |y - ref| / max |ref|) against the fp32 product of the
dequantised weights. Each time is the median of `--repeats` calls, the systems taking turns within a round.

    python benchmarks/cpu_kernels.py [--threads 2] [--repeats 15] [--moe] [--only expert,dense,attention,head]

Prints a table, then one JSON line. Every library is optional (`pip install 'dgemma[kernel-bench]'` installs
them): a missing one is reported, not a crash.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from dgemma import devices
from dgemma.quant import int8_compute
from dgemma.quant import quantize as quant

GROUP = quant.GROUP_SIZE["int4"]
# (part, K, N, row counts): the 26B-A4B's weights (hidden 2816; experts 704 wide, gate|up fused; dense MLP
# 2112 wide, gate|up fused; 16 query heads; sliding layers 8 KV heads of 256, full layers 2 of 512, K = V)
SHAPES = [
    ("expert gate_up", 2816, 1408, (1, 16, 64, 256)),
    ("expert down", 704, 2816, (1, 16, 64, 256)),
    ("dense gate_up", 2816, 4224, (1, 256)),
    ("dense down", 2112, 2816, (1, 256)),
    ("sliding q", 2816, 4096, (1, 256)),
    ("sliding k|v", 2816, 2048, (1, 256)),
    ("sliding o", 4096, 2816, (256,)),
    ("full q", 2816, 8192, (256,)),
    ("full k", 2816, 1024, (256,)),
    ("full o", 8192, 2816, (256,)),
    ("head (slice)", 2816, None, (1, 256)),
]


def missing(module: str) -> str | None:
    return None if importlib.util.find_spec(module) else f"{module} is not installed"


# -- the systems: each `prepare(q, scales, dense)` returns a callable x (M, K) bf16 -> (M, N) bf16 ----------
class TorchInt4:
    name = "torch-int4"

    def prepare(self, q, scales, dense):
        packed, scale_zeros = quant._to_kernel_layout(q, scales, torch.bfloat16)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zeros)


class TorchInt8:
    """dgemma's int8 compute on an int4 weight: widened per call (int4 kernel layout, as the model holds it)."""
    name = "torch-int8"

    def prepare(self, q, scales, dense):
        packed, scale_zeros = quant._to_kernel_layout(q, scales, torch.bfloat16)
        if not devices.int4_kernel_layout_known(packed.shape[0]):
            widener = int8_compute.Int4Widener(scales, kernel=False)
            return lambda x: int8_compute.int8_matmul(x, widener.widen(q), widener.channel())
        widener = int8_compute.Int4Widener(scale_zeros, kernel=True)
        return lambda x: int8_compute.int8_matmul(x, widener.widen(packed), widener.channel())


class TorchDense:
    def __init__(self, dtype):
        self.dtype, self.name = dtype, {torch.bfloat16: "torch-bf16", torch.float32: "torch-fp32"}[dtype]

    def prepare(self, q, scales, dense):
        w = dense.to(self.dtype)
        return lambda x: F.linear(x.to(self.dtype), w).to(x.dtype)


class OrtNBits:
    """onnxruntime MatMulNBits: one session per weight (the codes and scales are initializers, which MLAS
    packs when the session is made), called through IOBinding on torch's buffers."""

    def __init__(self, accuracy_level: int, spin: bool):
        self.accuracy_level, self.spin, self.name = accuracy_level, spin, f"ort-acc{accuracy_level}"

    def unavailable(self):
        return missing("onnxruntime") or missing("onnx")

    def prepare(self, q, scales, dense, bits: int = 4):
        from onnx import TensorProto, helper, numpy_helper

        N, K = dense.shape
        blob = GROUP * bits // 8
        codes = (q.view(N, K // GROUP, blob) if bits == 4 else (q.to(torch.int16) + 128).to(torch.uint8).view(N, K // GROUP, blob))
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=K, N=N, bits=bits,
                                block_size=GROUP, accuracy_level=self.accuracy_level)
        graph = helper.make_graph(
            [node], "linear", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])],
            initializer=[numpy_helper.from_array(codes.numpy(), "B"),
                         numpy_helper.from_array(scales.float().numpy(), "S")])
        session = ort_session(graph, self.spin)
        binding = session.io_binding()

        def run(x):
            a = x.float().contiguous()
            y = torch.empty(a.shape[0], N)
            binding.bind_input("A", "cpu", 0, torch_to_np_dtype(a), list(a.shape), a.data_ptr())
            binding.bind_output("Y", "cpu", 0, torch_to_np_dtype(y), list(y.shape), y.data_ptr())
            session.run_with_iobinding(binding)
            return y.to(x.dtype)
        return run


def ort_session(graph, spin: bool):
    """An onnxruntime CPU session over `graph` (opset 21 + com.microsoft), torch's thread count; `spin`: its
    threads spin between calls (off by default: spinning threads slow the next system's call down)."""
    import onnxruntime as ort
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def torch_to_np_dtype(t: torch.Tensor):
    import numpy as np

    return {torch.float32: np.float32, torch.float16: np.float16}[t.dtype]


class OpenVinoInt4:
    """OpenVINO: x (bf16) -> FullyConnectedCompressed over the u4 codes (zero point 8) and fp16 group scales."""

    def __init__(self, dynamic_quantization: bool, group: int = GROUP):
        self.dq, self.group = dynamic_quantization, group
        self.name = ("ov-int4-dq" if dynamic_quantization else "ov-int4") + ("" if group == GROUP else f"-g{group}")

    def unavailable(self):
        return missing("openvino")

    def prepare(self, q, scales, dense, bits: int = 4):
        import numpy as np
        import openvino as ov
        import openvino.opset13 as ops

        N, K = dense.shape
        group = self.group if bits == 4 else GROUP
        if group != GROUP:  # dgemma's int4 weight quantised again in wider groups, as `openvino.regroup` does
            q, scales = quant.quantize_tensor(quant.dequantize_tensor(q, scales, "int4", torch.float32), "int4", group)
        G = K // group
        x = ops.parameter([-1, K], ov.Type.bf16, name="x")
        if bits == 4:
            codes = ops.constant(ov.Tensor(q.numpy(), ov.Shape([N, G, group]), ov.Type.u4))
            zero = ops.convert(ops.constant(ov.Tensor(np.array([0x88], dtype=np.uint8), ov.Shape([1]), ov.Type.u4)),
                               ov.Type.f16)
            w = ops.subtract(ops.convert(codes, ov.Type.f16), zero)
        else:
            w = ops.convert(ops.constant(q.numpy().reshape(N, G, GROUP)), ov.Type.f16)
        w = ops.multiply(w, ops.constant(scales.numpy().reshape(N, G, 1)))
        w = ops.convert(ops.reshape(w, ops.constant(np.array([N, K], dtype=np.int64)), False), ov.Type.f32)
        y = ops.convert(ops.matmul(ops.convert(x, ov.Type.f32), w, False, True), ov.Type.bf16)
        compiled = ov.Core().compile_model(ov.Model([y], [x], "linear"), "CPU", {
            "INFERENCE_NUM_THREADS": torch.get_num_threads(), "ENABLE_CPU_PINNING": False,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": group if self.dq else 0})
        request = compiled.create_infer_request()

        def run(x):
            x = x.contiguous()
            y = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
            request.set_input_tensor(ov.Tensor(x.view(torch.int16).numpy(), ov.Shape(list(x.shape)), ov.Type.bf16))
            request.set_output_tensor(ov.Tensor(y.view(torch.int16).numpy(), ov.Shape(list(y.shape)), ov.Type.bf16))
            request.infer()
            return y
        run.constants = q, scales  # the arrays the graph's constants read (regrouped ones are this call's own)
        return run


class TorchaoA8W4:
    name = "torchao-a8w4"

    def unavailable(self):
        return missing("torchao")

    def prepare(self, q, scales, dense):
        import logging

        logging.getLogger("torchao").setLevel(logging.ERROR)
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        linear = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(dense)
        quantize_(linear, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP)))
        return torch.no_grad()(linear)


class TorchInt8Table:
    """The LM head as dgemma runs it with int8 compute: int8 codes per token row, `torch._int_mm`."""
    name = "torch-int8"

    def prepare(self, q, scales, dense):
        table = int8_compute.Int8Table(dense)
        return lambda x: table.logits(x).to(x.dtype)


def systems(args) -> list:
    out = [TorchInt4(), TorchInt8(), TorchDense(torch.bfloat16), TorchDense(torch.float32),
           OrtNBits(4, args.ort_spin), OrtNBits(0, args.ort_spin), OpenVinoInt4(True), OpenVinoInt4(False),
           TorchaoA8W4()]
    if args.groups_of_64:
        out += [OpenVinoInt4(True, 2 * GROUP), OpenVinoInt4(False, 2 * GROUP)]
    return out


# -- measuring -----------------------------------------------------------------------------------------------
def accuracy(y: torch.Tensor, ref: torch.Tensor) -> dict:
    y, ref = y.float(), ref.float()
    return {"cosine": F.cosine_similarity(y.flatten(), ref.flatten(), dim=0).item(),
            "max_rel_err": ((y - ref).abs().max() / ref.abs().max()).item()}


def medians(fns: dict, repeats: int, inner: int = 3) -> dict:
    """Each callable's median seconds: `repeats` rounds, each running every callable `inner` times in a row
    after one untimed call (so that one library's threads, still spinning after its call, do not land in
    the next one's time), the order reversed every round."""
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            fn()
            for _ in range(inner):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def weight(N: int, K: int, head: bool, g: torch.Generator):
    """A random (N, K) weight quantised as dgemma does: int8 rows for the head, int4 otherwise."""
    w = torch.randn(N, K, generator=g) * 0.02
    fmt = "int8" if head else "int4"
    q, scales = quant.quantize_tensor(w, fmt)
    return q, scales, quant.dequantize_tensor(q, scales, fmt, torch.float32)


def head_systems(args, available: list) -> list:
    """The head is an int8 table in dgemma: the int8 systems there, bf16 dense beside them."""
    names = {s.name for s in available}
    out = [TorchDense(torch.bfloat16), TorchInt8Table()]
    if "ort-acc4" in names:
        out.append(_Bits8(OrtNBits(4, args.ort_spin)))
    if "ov-int4-dq" in names:
        out.append(_Bits8(OpenVinoInt4(True)))
    return out


class _Bits8:
    """A library system given int8 weights (groups of 64 rescaled to 32: the same values)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name.replace("int4", "int8") + ("-int8" if "ort" in inner.name else "")

    def prepare(self, q, scales, dense):
        return self.inner.prepare(q, scales.repeat_interleave(2, dim=-1), dense, bits=8)


def measure(args) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(0)
    candidates = systems(args)
    skipped = {s.name: s.unavailable() for s in candidates if getattr(s, "unavailable", lambda: None)()}
    if missing("kt_kernel"):  # KTransformers' CPU MoE kernels: see benchmarks/README.md for what they run
        skipped["kt-kernel"] = "not installed (kt-kernel 0.7.2 pins torch==2.9.1; its MoE ops gate with SiLU only)"
    available = [s for s in candidates if s.name not in skipped]
    rows = []
    for part, K, N, counts in SHAPES:
        if args.only and not any(part.startswith(o) for o in args.only):
            continue
        head = N is None
        N = N or args.head_rows
        q, scales, dense = weight(N, K, head, g)
        prepared = {}
        for s in (head_systems(args, available) if head else available):
            try:
                prepared[s.name] = s.prepare(q, scales, dense)
            except Exception as e:  # a library that cannot run this shape: reported, not a crash
                skipped[f"{s.name} ({part})"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        for M in counts:
            x = torch.randn(M, K, generator=g).bfloat16()
            ref = x.float() @ dense.t()
            with torch.no_grad():
                t = medians({name: (lambda fn=fn, x=x: fn(x)) for name, fn in prepared.items()}, args.repeats)
                acc = {name: accuracy(fn(x), ref) for name, fn in prepared.items()}
            base = t.get("torch-int4") or t["torch-int8"]  # the head: dgemma's int8 table
            for name in prepared:
                rows.append({"part": part, "rows": M, "K": K, "N": N, "system": name, "ms": t[name] * 1e3,
                             "vs_torch_int4": base / t[name], **acc[name]})
            print(f"  {part} {M}x{K}->{N}: " + ", ".join(f"{n} {t[n] * 1e3:.2f}" for n in prepared), flush=True)
        del prepared
    return rows, skipped


# -- a whole MoE layer ----------------------------------------------------------------------------------------
def moe_layer(args) -> dict:
    """Router + 128 experts top-8 over each of `--moe-tokens` token counts: dgemma's QuantExperts on torch's int4
    kernel (int8 compute off and on: it widens experts with 128 rows or more), on OpenVINO
    (`dgemma.quant.openvino`: a copy of the layer is handed over, which keeps the original's codes for the
    other two), and onnxruntime's QMoE (its CPU op gates with SwiGLU only: timing, not parity)."""
    import copy
    import dataclasses

    import dgemma
    from dgemma.quant import openvino
    from dgemma.weights.random_weights import random_model

    full = dgemma.get_preset("diffusiongemma-26b-a4b")
    config = dataclasses.replace(full, num_layers=1, layer_types=full.layer_types[:1], vocab_size=1024)
    model = random_model(config, dtype=torch.bfloat16, quantize="int4", seed=0)
    skipped, library = {}, None
    block = model.layers[0]
    if openvino.unavailable():
        skipped["dgemma-openvino"] = openvino.unavailable()
    else:
        library = openvino.LibraryExperts(copy.deepcopy(block.experts), torch.get_num_threads())
    int8_compute.enable(model, "on", library="torch")
    prepared = block.experts.int8

    def dgemma_layer(x, int8, ov):
        def run():
            block.experts.int8, block.experts.library = (prepared if int8 else None), (library if ov else None)
            return block.experts(x, *block.router(x))
        return run

    qmoe_missing = missing("onnxruntime") or missing("onnx")
    if qmoe_missing:
        skipped["ort-qmoe"] = qmoe_missing
    out = {}
    for tokens in args.moe_tokens:
        x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        fns = {"dgemma-int4": dgemma_layer(x, False, False), "dgemma-int8-compute": dgemma_layer(x, True, False)}
        if library is not None:
            fns["dgemma-openvino"] = dgemma_layer(x, False, True)
        if not qmoe_missing:
            for level in (4, 0):
                fns[f"ort-qmoe-acc{level}"] = _qmoe(config, block.router, x, level, args)
        with torch.no_grad():
            t = medians(fns, max(3, args.repeats // 3), inner=1)
        out[str(tokens)] = {name: {"ms": s * 1e3, "vs_dgemma_int4": t["dgemma-int4"] / s} for name, s in t.items()}
        print(f"  MoE layer, {tokens} tokens, top-{config.top_k_experts} of {config.num_experts}: " + ", ".join(
            f"{n} {v['ms']:.1f} ms ({v['vs_dgemma_int4']:.2f}x)" for n, v in out[str(tokens)].items()), flush=True)
    return {"times": out, "skipped": skipped}


def _qmoe(config, router, x, accuracy_level: int, args):
    """onnxruntime's QMoE over random int4 experts of the 26B's shape (dgemma's layout: groups of 32, zero
    point 8, fc1 = gate and up interleaved), routed by dgemma's router scores."""
    from onnx import TensorProto, helper, numpy_helper

    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    g = torch.Generator().manual_seed(2)
    inits = []
    for name, (n, k) in (("fc1", (2 * I, H)), ("fc2", (H, I))):
        q, scales = quant.random_quantized((E, n, k), "int4", config.initializer_range, g)
        inits += [numpy_helper.from_array(q.numpy(), f"{name}_w"), numpy_helper.from_array(scales.float().numpy(), f"{name}_s")]
    node = helper.make_node("QMoE", ["x", "router", "fc1_w", "fc1_s", "", "fc2_w", "fc2_s"], ["y"], domain="com.microsoft",
                            k=config.top_k_experts, activation_type="swiglu", swiglu_fusion=1, expert_weight_bits=4,
                            block_size=GROUP, accuracy_level=accuracy_level, normalize_routing_weights=1)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", H]),
                                               helper.make_tensor_value_info("router", TensorProto.FLOAT, ["N", E])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", H])], initializer=inits)
    session = ort_session(graph, args.ort_spin)
    binding = session.io_binding()

    def run():
        scores = router.proj(router.norm(x) * router.scale * router.root_size).float().contiguous()
        a, y = x.float().contiguous(), torch.empty(x.shape[0], H)
        for name, t in (("x", a), ("router", scores)):
            binding.bind_input(name, "cpu", 0, torch_to_np_dtype(t), list(t.shape), t.data_ptr())
        binding.bind_output("y", "cpu", 0, torch_to_np_dtype(y), list(y.shape), y.data_ptr())
        session.run_with_iobinding(binding)
        return y.to(x.dtype)
    return run


def table(rows: list):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="int4 products at the 26B-A4B's shapes: median ms per call (x: speed against torch-int4; "
                    "the head: against torch-int8, dgemma's int8 table)")
    systems_seen = list(dict.fromkeys(r["system"] for r in rows))
    for col in ("part", "M x K -> N", *systems_seen):
        t.add_column(col, justify="right", no_wrap=True)
    for (part, M, K, N) in dict.fromkeys((r["part"], r["rows"], r["K"], r["N"]) for r in rows):
        cells = {r["system"]: r for r in rows if (r["part"], r["rows"]) == (part, M)}
        t.add_row(part, f"{M} x {K} -> {N}", *(
            f"{cells[s]['ms']:.2f} ({cells[s]['vs_torch_int4']:.2f}x)" if s in cells else "-" for s in systems_seen))
    Console(width=250).print(t)
    worst = {s: min(r["cosine"] for r in rows if r["system"] == s) for s in systems_seen}
    print("accuracy against the fp32 product of the dequantised weights (worst over shapes): " + ", ".join(
        f"{s} cosine {worst[s]:.6f} max rel err "
        f"{max(r['max_rel_err'] for r in rows if r['system'] == s):.4f}" for s in systems_seen))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--head-rows", type=int, default=32768, help="vocabulary entries of the head's slice")
    p.add_argument("--only", default="", help="comma-separated parts (prefixes): expert, dense, sliding, full, head")
    p.add_argument("--moe", action="store_true", help="also a whole MoE layer (fused library ops)")
    p.add_argument("--moe-tokens", type=lambda text: [int(t) for t in text.split(",")], default=[1, 4, 16, 64, 256],
                   help="comma-separated token counts for --moe (default 1,4,16,64,256)")
    p.add_argument("--ort-spin", action="store_true", help="let onnxruntime's threads spin between calls")
    p.add_argument("--groups-of-64", action="store_true", help="also OpenVINO on the weights quantised again in groups of 64")
    args = p.parse_args()
    args.only = [o for o in args.only.split(",") if o]
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "repeats": args.repeats, "load_before": os.getloadavg(),
           "int8_dot_products": devices.cpu_has_int8_dot(), "torch": torch.__version__,
           "cpu_capability": devices.cpu_capability(), "versions": versions()}
    print(f"{args.threads} threads, load average {out['load_before'][0]:.2f}; {out['versions']}", flush=True)
    rows, skipped = measure(args)
    if args.moe:
        out["moe_layer"] = moe_layer(args)
    out.update(rows=rows, skipped=skipped, load_after=os.getloadavg())
    table(rows)
    for name, why in skipped.items():
        print(f"  not measured: {name}: {why}")
    print(json.dumps(out))


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("onnxruntime", "openvino", "torchao", "kt-kernel"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


if __name__ == "__main__":
    main()
