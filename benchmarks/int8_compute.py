"""Int8 compute for quantised models on a CPU (`--cpu-int8-compute`), off against on, side by side.

    python benchmarks/int8_compute.py threshold                      # rows where widening int4 to int8 pays
    python benchmarks/int8_compute.py step --quantize int8           # bench-20m's eager step and AR token
    python benchmarks/int8_compute.py layers --layers 1              # a few layers of the 26B-A4B shape
    python benchmarks/int8_compute.py soft-embedding                 # the int8 table's soft embedding, sparse

`threshold` times torch's int4 kernel against widening the same weight to int8 then torch._int_mm, at the
26B's expert shapes and bench-20m's, for 8..256 rows (what `int8_compute.MIN_ROWS_TO_WIDEN` is set from).
`step` times a denoising step (256-token canvas, self-conditioning probabilities in) and one AR token of a
random-weight preset, both models built alike, timed turn about. `layers` builds the released 26B-A4B shape
with `--layers` layers and a `--vocab` table (random int4 weights, bf16), times the parts of a canvas step
off and on, checks each part's output against the float path, and projects the full model's step from them
(30 layers, the 262k table): a projection, not a run of the full model. `soft-embedding` times the int8
table's soft embedding (the 26B's 262,144 x 2,816 table, a canvas's 256 rows) on probabilities from logits of
growing spread, each slice multiplied whole against only the entries some row's code reaches
(`Int8Table.SPARSE_SHARE`), and checks both give the same bits. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

import torch
import torch.nn.functional as F

import dgemma
from dgemma import devices
from dgemma.model.network import PreviousStep
from dgemma.quant import int8_compute
from dgemma.quant import quantize as quant
from dgemma.weights.random_weights import random_model


def best_of(fns: dict, repeats: int) -> dict:
    """Each callable's fastest time over `repeats` rounds, the callables taking turns within a round."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def threshold(args) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    for n, k in ((1408, 2816), (2816, 704), (256, 256), (256, 128)):
        q, scales = quant.quantize_tensor(torch.randn(n, k, generator=g) * 0.02, "int4")
        packed, scale_zeros = quant._to_kernel_layout(q, scales, torch.bfloat16)
        widener = int8_compute.Int4Widener(scale_zeros, kernel=True)
        for rows in (8, 16, 32, 64, 128, 256):
            x = torch.randn(rows, k, generator=g).bfloat16()
            t = best_of({
                "int4_kernel": lambda x=x, p=packed, s=scale_zeros: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, s),
                "widen_int8": lambda x=x, p=packed, w=widener: int8_compute.int8_matmul(x, w.widen(p), w.channel()),
            }, args.repeats)
            out[f"{n}x{k}@{rows}"] = {name: round(s * 1e3, 3) for name, s in t.items()}
            print(f"  weight {n:5} x {k:5}, {rows:3} rows: int4 kernel {t['int4_kernel'] * 1e3:7.3f} ms, "
                  f"widened + int8 {t['widen_int8'] * 1e3:7.3f} ms ({t['int4_kernel'] / t['widen_int8']:.2f}x)")
    return out


def step(args) -> dict:
    config = dgemma.get_preset(args.preset)
    off = random_model(config, dtype=torch.bfloat16, quantize=args.quantize, seed=0)
    on = random_model(config, dtype=torch.bfloat16, quantize=args.quantize, seed=0)
    assert int8_compute.enable(on, "on")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, config.vocab_size, (1, args.prompt_len), generator=g)
    canvas = torch.randint(3, config.vocab_size, (1, config.canvas_length), generator=g)
    probs = torch.randn(1, config.canvas_length, config.vocab_size, generator=g).mul(3).softmax(-1)
    caches = {}
    for name, model in (("off", off), ("on", on)):
        caches[name] = model.new_cache(1, args.prompt_len + config.canvas_length + args.repeats + 2)
        with torch.no_grad():
            model.encode(prompt, caches[name], return_logits=False)
    token = prompt[:, :1]

    @torch.no_grad()
    def denoise(name, model):
        return lambda: model.denoise(canvas, caches[name], self_conditioning=PreviousStep(probs=probs))

    @torch.no_grad()
    def ar_token(name, model):
        return lambda: model.encode(token, caches[name])

    t = best_of({f"step_{n}": denoise(n, m) for n, m in (("off", off), ("on", on))}, args.repeats)
    t.update(best_of({f"ar_token_{n}": ar_token(n, m) for n, m in (("off", off), ("on", on))}, args.repeats))
    out = {k: round(v * 1e3, 2) for k, v in t.items()}
    out["step_speedup"] = round(t["step_off"] / t["step_on"], 2)
    out["ar_token_speedup"] = round(t["ar_token_off"] / t["ar_token_on"], 2)
    print(f"{args.preset}, {args.quantize}, bf16, eager, {torch.get_num_threads()} threads (ms, fastest of {args.repeats}):")
    print(f"  denoising step  off {out['step_off']:8.1f}  on {out['step_on']:8.1f}  ({out['step_speedup']:.2f}x)")
    print(f"  AR token        off {out['ar_token_off']:8.1f}  on {out['ar_token_on']:8.1f}  ({out['ar_token_speedup']:.2f}x)")
    return out


def layers(args) -> dict:
    full = dgemma.get_preset(args.preset)
    config = dataclasses.replace(full, num_layers=args.layers, layer_types=full.layer_types[: args.layers],
                                 vocab_size=args.vocab or 65536)
    off, on = (random_model(config, dtype=torch.bfloat16, quantize="int4", seed=0) for _ in range(2))  # alike
    assert int8_compute.enable(on, "on")
    L, H = config.canvas_length, config.hidden_size
    g = torch.Generator().manual_seed(1)
    x = torch.randn(L, H, generator=g).bfloat16()
    heads = torch.randn(1, L, off.layers[0].self_attn.o_proj.in_features, generator=g).bfloat16()
    probs = torch.randn(1, L, config.vocab_size, generator=g).mul(3).softmax(-1)
    parts = {}
    with torch.no_grad():
        for name, fn in {
            "experts_one_layer": lambda m: m.layers[0].experts(x, *m.layers[0].router(x)),
            "attention_projections_one_layer": lambda m: [getattr(m.layers[0].self_attn, p)(x[None]) for p in
                                                          ("q_proj", "k_proj", "v_proj")]
            + [m.layers[0].self_attn.o_proj(heads)],
            "dense_mlp_one_layer": lambda m: m.layers[0].mlp(x[None]),
            "lm_head": lambda m: m.head(x[None]),
            "soft_embedding": lambda m: m.soft_embedding_from_probs(probs),
        }.items():
            pairs = list(zip(*[o if isinstance(o, list) else [o] for o in (fn(off), fn(on))]))
            pairs = [(a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])) for a, b in pairs]
            t = best_of({"off": lambda fn=fn: fn(off), "on": lambda fn=fn: fn(on)}, args.repeats)
            cos = torch.cat([F.cosine_similarity(a, b, dim=-1) for a, b in pairs])
            agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in pairs])
            parts[name] = {"off_s": t["off"], "on_s": t["on"], "cosine_mean": cos.mean().item(),
                           "argmax_agree": agree.mean().item()}
    scale = full.vocab_size / config.vocab_size
    per_layer = {k: sum(parts[p][k] for p in parts if p.endswith("one_layer")) for k in ("off_s", "on_s")}
    projected = {k: full.num_layers * per_layer[k] + scale * (parts["lm_head"][k] + parts["soft_embedding"][k])
                 for k in ("off_s", "on_s")}
    print(f"{args.preset} shape, {args.layers} layers, vocab {config.vocab_size}, int4, bf16, {L}-token canvas, "
          f"{torch.get_num_threads()} threads; fastest of {args.repeats}:")
    for name, p in parts.items():
        print(f"  {name:34} off {p['off_s']:8.3f} s  on {p['on_s']:8.3f} s  ({p['off_s'] / p['on_s']:5.2f}x)  "
              f"cosine {p['cosine_mean']:.5f}  argmax {p['argmax_agree']:.3f}")
    print(f"  PROJECTION to {full.num_layers} layers and the {full.vocab_size}-token table (routed experts, "
          f"attention projections, dense MLPs, head x{scale:g}, soft embedding x{scale:g}; not attention itself, "
          f"norms or routing): off {projected['off_s']:.2f} s, on {projected['on_s']:.2f} s a step "
          f"({projected['off_s'] / projected['on_s']:.2f}x)")
    return {"parts": parts, "projected_step_s": projected, "vocab": config.vocab_size, "layers": args.layers}


def soft_embedding(args) -> dict:
    """The int8 table's soft embedding, whole slices against the entries reached, on softmax(spread * N(0, 1))
    logits: the wider the spread, the fewer entries any row's int8 code reaches."""
    from dgemma.engine.allocator import keep_freed_memory

    keep_freed_memory()  # as the engine runs: a fresh (256, slice) temporary each call costs page faults otherwise
    config = dgemma.get_preset(args.preset)
    V, H = args.vocab or config.vocab_size, config.hidden_size
    g = torch.Generator().manual_seed(0)
    table = int8_compute.Int8Table(torch.randn(V, H, generator=g, dtype=torch.bfloat16))
    out = {"vocab": V, "hidden": H, "rows": config.canvas_length}
    print(f"  soft embedding, {config.canvas_length} rows x {V:,} entries x {H:,} (int8 table), ms")
    shipped = int8_compute.Int8Table.SPARSE_SHARE
    for spread in (1, 3, 6, 12):
        probs = torch.randn(config.canvas_length, V, generator=g).mul_(spread).softmax(-1)
        results = {}
        t = best_of({name: _soft_embedding_call(table, probs, share, results, name)
                     for name, share in (("whole", -1.0), ("reached", shipped))},
                    args.repeats)
        flat = probs * table.scale
        codes = flat.div_(flat.amax(-1, keepdim=True) / 127).round_()
        reached = codes.amax(0).gt(0).float().mean().item()
        out[f"spread_{spread}"] = {"reached_share": round(reached, 4), "whole_ms": round(t["whole"] * 1e3, 1),
                                   "reached_ms": round(t["reached"] * 1e3, 1),
                                   "same_bits": torch.equal(results["whole"], results["reached"])}
        print(f"  logits N(0, {spread:>2}^2): {reached:6.1%} of entries reached, whole {t['whole'] * 1e3:6.1f}, "
              f"reached only {t['reached'] * 1e3:6.1f} ({t['whole'] / t['reached']:.2f}x), "
              f"same bits: {out[f'spread_{spread}']['same_bits']}")
    int8_compute.Int8Table.SPARSE_SHARE = shipped
    return out


def _soft_embedding_call(table, probs, share: float, results: dict, name: str):
    """A call of the table's soft embedding with SPARSE_SHARE = `share`, its result kept in results[name]."""
    def call():
        int8_compute.Int8Table.SPARSE_SHARE = share
        results[name] = table.soft_embedding(probs, torch.bfloat16)
    return call


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["threshold", "step", "layers", "soft-embedding"])
    p.add_argument("--preset", default=None,
                   help="default bench-20m (step), diffusiongemma-26b-a4b (layers, soft-embedding)")
    p.add_argument("--quantize", choices=["int8", "int4"], default="int8")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=None,
                   help="table rows: `layers` 65,536 (projected to the full one), `soft-embedding` the preset's")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    args.preset = args.preset or ("bench-20m" if args.what == "step" else "diffusiongemma-26b-a4b")
    out = {"what": args.what, "preset": args.preset, "threads": torch.get_num_threads(),
           "int8_dot_products": devices.cpu_has_int8_dot()}
    out.update({"threshold": threshold, "step": step, "layers": layers,
                "soft-embedding": soft_embedding}[args.what](args))
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
