"""The released 26B-A4B shape in int4 on a CPU, part by part: build, prefill, AR tokens, one denoising step of
a 256-token canvas (with self-conditioning, as every step after the first), and the parts of that step:
one layer's attention projections, dense MLP and routed experts, the LM head and the self-conditioning soft
embedding; then the tokens/s those imply.

Random weights made directly in int4 (`dgemma.weights.random_weights`), bf16 activations, torch's CPU int4
matmul, and int8 compute where `--cpu-int8-compute` (auto: on with VNNI or AMX) turns it on
(`dgemma.quant.int8_compute`). `dgemma bench --config diffusiongemma-26b-a4b --quantize int4` times the same
model end to end; this measures each piece once (after one untimed call), to say where a step goes.

    python benchmarks/cpu_26b.py [--preset diffusiongemma-26b-a4b] [--steps 16] [--cpu-int8-compute auto|on|off]

Prints the figures, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

import dgemma
from dgemma.model.network import PreviousStep
from dgemma.quant import int8_compute
from dgemma.quant import quantize as quant
from dgemma.weights.random_weights import random_model


def timed(fn):
    """Seconds of one call, after one untimed call (first calls pay for the allocator and kernel setup)."""
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="diffusiongemma-26b-a4b")
    p.add_argument("--steps", type=int, default=16, help="fixed denoising steps per canvas, for the tokens/s")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--cpu-int8-compute", choices=int8_compute.MODES, default="auto")
    args = p.parse_args()
    out = {"preset": args.preset, "steps": args.steps, "prompt_len": args.prompt_len}
    start = time.perf_counter()
    model = random_model(dgemma.get_preset(args.preset), dtype=torch.bfloat16, quantize="int4")
    out["build_s"] = time.perf_counter() - start
    out["weight_bytes"] = quant.loaded_weight_bytes(model)
    out["cpu_int4_kernel"] = bool(model.layers[0].experts.kernel_layout)
    out["cpu_int8_compute"] = int8_compute.enable(model, args.cpu_int8_compute)
    c = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, c.vocab_size, (1, args.prompt_len), generator=g)
    cache = model.new_cache(1, args.prompt_len + 8 + c.canvas_length)
    with torch.no_grad():
        # the prompt once (encoding adds to the cache)
        start = time.perf_counter()
        model.encode(ids, cache, return_logits=False)
        out["prefill_s"] = time.perf_counter() - start
        ar = []
        for _ in range(2):  # AR: one token and its logits, twice (the cache has room); the faster counts
            start = time.perf_counter()
            model.encode(ids[:, :1], cache)
            ar.append(time.perf_counter() - start)
        out["ar_token_s"] = min(ar)
        canvas = torch.randint(3, c.vocab_size, (1, c.canvas_length), generator=g)
        probs = torch.randn(1, c.canvas_length, c.vocab_size, generator=g).mul_(3).softmax(-1)
        out["denoise_step_s"] = timed(lambda: model.denoise(canvas, cache, self_conditioning=PreviousStep(probs=probs)))
        x = torch.randn(1, c.canvas_length, c.hidden_size, dtype=torch.bfloat16, generator=g)
        flat = x[0]
        sliding, full = model.layers[c.layer_types.index("sliding_attention")], model.layers[c.layer_types.index("full_attention")]

        def projections(block):
            attn = block.self_attn
            heads = torch.zeros(1, c.canvas_length, attn.o_proj.in_features, dtype=x.dtype)
            return [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x) if attn.v_proj is not None else None,
                    attn.o_proj(heads)]

        out["attention_projections_sliding_layer_s"] = timed(lambda: projections(sliding))
        out["attention_projections_full_layer_s"] = timed(lambda: projections(full))
        out["dense_mlp_one_layer_s"] = timed(lambda: sliding.mlp(x))
        out["experts_one_layer_canvas_s"] = timed(lambda: sliding.experts(flat, *sliding.router(flat)))
        out["experts_one_layer_one_token_s"] = timed(lambda: sliding.experts(flat[:1], *sliding.router(flat[:1])))
        out["head_canvas_s"] = timed(lambda: model.head(x))
        out["soft_embedding_canvas_s"] = timed(lambda: model.soft_embedding_from_probs(probs))
        layers_s = (c.layer_types.count("sliding_attention") * out["attention_projections_sliding_layer_s"]
                    + c.layer_types.count("full_attention") * out["attention_projections_full_layer_s"]
                    + c.num_layers * (out["dense_mlp_one_layer_s"] + out["experts_one_layer_canvas_s"]))
        out["parts_of_step_s"] = {"projections, dense MLPs and experts (all layers)": layers_s,
                                  "LM head": out["head_canvas_s"], "soft embedding": out["soft_embedding_canvas_s"]}
        out["parts_of_step_s"]["the rest (attention, norms, routing, embedding)"] = \
            out["denoise_step_s"] - sum(out["parts_of_step_s"].values())
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["diffusion_tokens_per_s"] = c.canvas_length / (args.steps * out["denoise_step_s"])
    out["ar_tokens_per_s"] = 1 / out["ar_token_s"]
    out["diffusion_vs_ar"] = out["diffusion_tokens_per_s"] / out["ar_tokens_per_s"]
    print(f"{args.preset}, int4, bf16, CPU ({torch.get_num_threads()} threads), int8 compute "
          f"{'on' if out['cpu_int8_compute'] else 'off'}; weights {out['weight_bytes'] / 2**30:.2f} GiB, "
          f"built in {out['build_s']:.0f} s; peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB")
    for key in ("prefill_s", "ar_token_s", "denoise_step_s", "attention_projections_sliding_layer_s",
                "attention_projections_full_layer_s", "dense_mlp_one_layer_s", "experts_one_layer_canvas_s",
                "experts_one_layer_one_token_s", "head_canvas_s", "soft_embedding_canvas_s"):
        print(f"  {key:40} {out[key]:9.3f}")
    print("  a denoising step, by part:")
    for part, seconds in out["parts_of_step_s"].items():
        print(f"    {part:52} {seconds:7.2f} s  {seconds / out['denoise_step_s']:6.1%}")
    print(f"  diffusion, {args.steps} steps per {c.canvas_length}-token canvas: {out['diffusion_tokens_per_s']:.3f} tok/s; "
          f"AR: {out['ar_tokens_per_s']:.3f} tok/s ({out['diffusion_vs_ar']:.2f}x)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
