"""Peak memory of one attention call over a long prefill, at the 26B-A4B full layers' shape, with queries in
one block (SDPA on all T rows at once) and in blocks (`dgemma.model.attention.attention`, the model's path).

Full layers: 16 query heads, 2 KV heads (GQA), head dim 512, a causal boolean mask. On CUDA that
combination rules out the flash (head dim > 256), cuDNN and memory-efficient (no GQA) kernels, so SDPA falls
back to its math kernel, which materialises (B, Hq, T, S) scores and their softmax. A CPU has a flash kernel
that takes all of it; the "math" ways force the math kernel on the CPU to measure what the CUDA fallback
holds, and what query blocks bound it to. Each way runs in a fresh process; its peak resident memory
(getrusage) is taken after the inputs are made, so the figure is what the attention call itself adds.

    python benchmarks/attention_memory.py [--tokens 8192] [--head-dim 512] [--dtype bf16]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


WAYS = ("one-block", "blocks", "math-one-block", "math-blocks")  # "math": SDPA's math kernel forced


def child(args) -> dict:
    import torch

    from dgemma.model.attention import SCORE_CHUNK_ELEMENTS, attention, causal_mask

    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    T = args.tokens
    q = torch.randn(1, args.heads, T, args.head_dim, dtype=dtype)
    k = torch.randn(1, args.kv_heads, T, args.head_dim, dtype=dtype)
    v = torch.randn(1, args.kv_heads, T, args.head_dim, dtype=dtype)
    positions = torch.arange(T)[None]
    mask = causal_mask(positions, positions, None)  # (1, 1, T, T) bool, as the encoder passes it
    out = torch.empty_like(q)  # the output's own memory, counted in the baseline
    del out
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chunk = SCORE_CHUNK_ELEMENTS if args.child.endswith("blocks") else 1 << 62
    backends = [SDPBackend.MATH] if args.child.startswith("math") else [
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    start = time.perf_counter()
    with sdpa_kernel(backends):
        result = attention(q, k, v, mask, chunk_elements=chunk)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = max(1, chunk // (args.heads * T))
    return {"way": args.child, "query_rows_per_call": min(rows, T), "peak_added_bytes": peak - before,
            "seconds": round(seconds, 2), "checksum": float(result.float().sum())}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="prefill length T (= keys S)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    for way in args.ways.split(","):
        cmd = [sys.executable, __file__, "--child", way] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                            if k not in ("child", "ways")]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    scores = args.heads * args.tokens * args.tokens * 4  # one (1, Hq, T, S) fp32 buffer
    print(f"attention of a {args.tokens}-token prefill, {args.heads} query / {args.kv_heads} KV heads, head dim "
          f"{args.head_dim}, {args.dtype}, causal bool mask; one (1, Hq, T, S) fp32 score buffer: {scores / 2**30:.2f} GiB")
    print(f"{'way':>15} {'query rows/call':>16} {'peak added MiB':>15} {'seconds':>8}")
    for r in rows:
        print(f"{r['way']:>15} {r['query_rows_per_call']:>16} {r['peak_added_bytes'] / 2**20:>15,.0f} {r['seconds']:>8}")
    result = {"tokens": args.tokens, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "dtype": args.dtype, "score_buffer_bytes": scores, "results": rows}
    by = {r["way"]: r for r in rows}
    for kernel in ("", "math-"):
        one, blocks = by.get(kernel + "one-block"), by.get(kernel + "blocks")
        if one and blocks:
            result[kernel + "peak_ratio"] = round(one["peak_added_bytes"] / max(blocks["peak_added_bytes"], 1), 2)
            result[kernel + "same_output"] = one["checksum"] == blocks["checksum"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
