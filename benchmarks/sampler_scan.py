"""The sampler's eager scan of one canvas's logits on a CPU: dgemma's, against the earlier formulation, side by side.

    python benchmarks/sampler_scan.py [--vocab 262144,8192] [--positions 256] [--rounds 5] [--temperature 0.7]

The scan (`dgemma.sampling.sampler.scan_positions`) turns a step's (B, L, V) fp32 logits into the argmax, the
entropy and, in place, the probabilities. dgemma's goes 2 MB of logits at a time (EAGER_CPU_CHUNK_ELEMENTS), takes
the max and its index from one `max` along the vocabulary, the expected shift E_p[s - m] from `vecdot`, and gives
tokens under log(tiny * V) below the max exactly 0 (where torch's exp would leave its fast path). The
earlier formulation, kept here to measure against: 64 positions of a 262k vocabulary at a time (CHUNK_ELEMENTS),
`amax` then `argmax`, and E_p[s - m] as a batched (n, 1, V) x (n, V, 1) matmul. Both run with the generating
commands' allocator settings (`dgemma.engine.allocator`), turn about, on the same logits (copied in before each
run); the fastest of each is kept. Each entropy is checked against float64. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def earlier_scan(logits: torch.Tensor, temperature: float):
    """The formulation measured against: (B, L, V) -> argmax (B*L,), entropy (B*L,), probabilities in place."""
    from dgemma.sampling.sampler import CHUNK_ELEMENTS, chunk_rows

    B, L, V = logits.shape
    flat = logits.view(B * L, V)
    argmax = torch.empty(B * L, dtype=torch.long)
    entropy = torch.empty(B * L)
    step = chunk_rows(V, CHUNK_ELEMENTS)
    for start in range(0, B * L, step):
        x = flat[start : start + step].div_(temperature)
        top = x.amax(-1, keepdim=True)
        argmax[start : start + step] = x.argmax(-1)
        x.sub_(top).clamp_(min=torch.finfo(x.dtype).min)
        e = torch.exp(x)
        z = e.sum(-1)
        shift = (e[:, None, :] @ x[:, :, None])[:, 0, 0] / z
        entropy[start : start + step] = (z.log() - shift).clamp_(min=0.0)
        torch.div(e, z[:, None], out=x)
    return argmax, entropy


def ours(logits: torch.Tensor, temperature: float):
    from dgemma.sampling.sampler import scan_positions

    _, argmax, entropy, _ = scan_positions(logits, temperature)
    return argmax.flatten(), entropy.flatten()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="262144,8192", help="comma-separated vocabulary sizes")
    parser.add_argument("--positions", type=int, default=256, help="positions (rows of logits): one canvas")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from dgemma.engine import allocator
    from dgemma.sampling import token_entropy

    allocator.bound_kernel_caches()
    allocator.keep_freed_memory()
    g = torch.Generator().manual_seed(0)
    rows = []
    for V in (int(v) for v in args.vocab.split(",")):
        # each position its own spread, from a near-certain token to a flat distribution, soft-capped at 30 as
        # the model's logits are (`final_logit_softcapping`)
        scale = torch.logspace(-1, 1.7, args.positions)[torch.randperm(args.positions, generator=g)]
        logits = 30.0 * torch.tanh(torch.randn(1, args.positions, V, generator=g) * scale[None, :, None] / 30.0)
        exact = token_entropy(logits[0].double() / args.temperature)
        buffer = torch.empty_like(logits)
        best = {"earlier": float("inf"), "dgemma": float("inf")}
        found = {}
        for _ in range(args.rounds):
            for name, scan in (("earlier", earlier_scan), ("dgemma", ours)):
                buffer.copy_(logits)
                start = time.perf_counter()
                argmax, entropy = scan(buffer, args.temperature)
                best[name] = min(best[name], time.perf_counter() - start)
                found[name] = (argmax, entropy)
        same_argmax = torch.equal(found["earlier"][0], found["dgemma"][0])
        errors = {name: float((entropy.double() - exact).abs().max()) for name, (_, entropy) in found.items()}
        rows.append({"vocab": V, "positions": args.positions, "earlier_ms": 1000 * best["earlier"],
                     "dgemma_ms": 1000 * best["dgemma"], "speedup": best["earlier"] / best["dgemma"],
                     "same_argmax": same_argmax, "entropy_error_earlier": errors["earlier"],
                     "entropy_error_dgemma": errors["dgemma"]})

    table = Table(title=f"eager scan of {args.positions} positions, {torch.get_num_threads()} threads (best of "
                        f"{args.rounds})")
    for column in ("vocabulary", "earlier ms", "dgemma ms", "speed-up", "same argmax", "entropy error, earlier",
                   "entropy error, dgemma"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(f"{r['vocab']:,}", f"{r['earlier_ms']:.1f}", f"{r['dgemma_ms']:.1f}", f"{r['speedup']:.2f}x",
                      str(r["same_argmax"]), f"{r['entropy_error_earlier']:.1e}", f"{r['entropy_error_dgemma']:.1e}")
    Console().print(table)
    print(json.dumps({"threads": torch.get_num_threads(), "temperature": args.temperature, "results": rows}))


if __name__ == "__main__":
    main()
