"""The released 26B-A4B shape in int4 on a CPU, part by part: build, prefill, AR tokens, one denoising step of
a 256-token canvas, one layer's experts and the LM head; then the tokens/s those imply.

Random weights made directly in int4 (`dgemma.model.random_weights`), bf16 activations, torch's CPU int4
matmul. `dgemma bench --config diffusiongemma-26b-a4b --quantize int4` times the same model end to end,
but one of its generations takes many minutes on a small CPU; this measures each piece once.

    python benchmarks/cpu_26b.py [--preset diffusiongemma-26b-a4b] [--steps 16]

Prints the figures, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

import dgemma
from dgemma.model import quant
from dgemma.model.random_weights import random_model


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="diffusiongemma-26b-a4b")
    p.add_argument("--steps", type=int, default=16, help="fixed denoising steps per canvas, for the tokens/s")
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args()
    out = {"preset": args.preset, "steps": args.steps, "prompt_len": args.prompt_len}
    start = time.perf_counter()
    model = random_model(dgemma.get_preset(args.preset), dtype=torch.bfloat16, quantize="int4")
    out["build_s"] = time.perf_counter() - start
    out["weight_bytes"] = quant.weight_bytes(model)
    out["cpu_int4_kernel"] = bool(model.layers[0].experts.kernel_layout)
    c = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, c.vocab_size, (1, args.prompt_len), generator=g)
    cache = model.new_cache(1, args.prompt_len + 8 + c.canvas_length)
    with torch.no_grad():
        out["prefill_s"] = timed(lambda: model.encode(ids, cache, return_logits=False))
        ar = [timed(lambda: model.encode(ids[:, :1], cache)) for _ in range(2)]  # AR: one token, its logits
        out["ar_token_s"] = min(ar)
        canvas = torch.randint(3, c.vocab_size, (1, c.canvas_length), generator=g)
        out["denoise_step_s"] = timed(lambda: model.denoise(canvas, cache))
        x = torch.randn(c.canvas_length, c.hidden_size, dtype=torch.bfloat16, generator=g)
        block = model.layers[0]
        out["experts_one_layer_canvas_s"] = timed(lambda: block.experts(x, *block.router(x)))
        out["experts_one_layer_one_token_s"] = timed(lambda: block.experts(x[:1], *block.router(x[:1])))
        out["head_canvas_s"] = timed(lambda: model.head(x[None]))
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["diffusion_tokens_per_s"] = c.canvas_length / (args.steps * out["denoise_step_s"])
    out["ar_tokens_per_s"] = 1 / out["ar_token_s"]
    out["diffusion_vs_ar"] = out["diffusion_tokens_per_s"] / out["ar_tokens_per_s"]
    print(f"{args.preset}, int4, bf16, CPU ({torch.get_num_threads()} threads); weights {out['weight_bytes'] / 2**30:.2f} GiB, "
          f"built in {out['build_s']:.0f} s; peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB")
    for key in ("prefill_s", "ar_token_s", "denoise_step_s", "experts_one_layer_canvas_s",
                "experts_one_layer_one_token_s", "head_canvas_s"):
        print(f"  {key:32} {out[key]:9.3f}")
    print(f"  diffusion, {args.steps} steps per {c.canvas_length}-token canvas: {out['diffusion_tokens_per_s']:.3f} tok/s; "
          f"AR: {out['ar_tokens_per_s']:.3f} tok/s ({out['diffusion_vs_ar']:.2f}x)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
