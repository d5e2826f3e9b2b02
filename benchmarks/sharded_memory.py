"""Peak host memory per process when 2 processes (torchrun, FSDP2, gloo) load and train a random checkpoint
of a few hundred million parameters: dgemma's sharded load (meta -> fully_shard -> each rank reads its
rows) side by side with loading a full copy and then sharding it, against the full copy's size and the
memory plan.

    python benchmarks/sharded_memory.py --experts 32         # 500M parameters, 2 processes
    python benchmarks/sharded_memory.py --hidden 768 --layers 6

Peak RSS is `resource.getrusage(RUSAGE_SELF).ru_maxrss` in each worker: after the imports (baseline),
after the weights are in place, and after two full fine-tuning steps (AdamW state allocated). Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def bench_config(args):
    from dgemma.config import get_preset

    base = get_preset("bench-20m")
    return base.replace(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        num_layers=args.layers, layer_types=(base.layer_types * args.layers)[: args.layers - 1]
                        + ("full_attention",), num_experts=args.experts, moe_intermediate_size=args.hidden // 2,
                        canvas_length=32)


def write_checkpoint(config, folder: Path):
    """Random bf16 weights, written tensor by tensor (never a full fp32 copy in this process)."""
    import torch

    from dgemma.model.network import DiffusionGemma
    from dgemma.weights.checkpoint import LazyWeights, save_pretrained

    with torch.device("meta"):
        model = DiffusionGemma(config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)

    def read(names):
        return {n: (torch.randn(shapes[n], generator=gen) * 0.02 if len(shapes[n]) >= 2
                    else torch.ones(shapes[n])).to(torch.bfloat16) for n in names}

    sizes = {n: 2 * torch.Size(s).numel() for n, s in shapes.items()}
    save_pretrained(model, folder, max_shard_bytes=256 * 1024**2, weights=LazyWeights(sizes, read))


def worker(model_dir: str, data: str, mode: str, out: str):
    """One torchrun process: load ('sharded' or 'full-then-shard'), then two optimizer steps."""
    import torch

    from dgemma.training import TrainConfig
    from dgemma.training import distributed as D
    from dgemma.training.data import ExampleStream
    from dgemma.training.loop import _accumulate_gradients, _architecture_and_data, _model_and_optimizer, _optimizer
    from dgemma.training.model_setup import configure_trainable

    torch.set_num_threads(1)
    baseline = peak_bytes()
    config = TrainConfig(data=data, out=out, model=model_dir, steps=2, batch_size=2, warmup_steps=1, progress=False,
                         device="cpu")
    env = D.setup("cpu")
    model_config, eos_id, dataset, _ = _architecture_and_data(config)
    t0 = time.perf_counter()
    if mode == "sharded":
        model, optimizer, _ = _model_and_optimizer(config, model_config, eos_id, env)
    else:  # what a plain load does: every process reads the whole checkpoint, then FSDP shards it
        from dgemma.weights.hub import load_model

        model = load_model(model_dir)
        configure_trainable(model, objective="diffusion", lora=None, train_router=False)
        D.shard(model)
        model.train()
        optimizer = _optimizer(model, config)
    D.barrier(env)
    loaded, load_s = peak_bytes(), time.perf_counter() - t0
    stream = ExampleStream(len(dataset), config.seed)
    for step in range(2):
        _accumulate_gradients(config, env, model, dataset, stream, step, model_config, eos_id)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    D.barrier(env)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    result = {"mode": mode, "rank": env.rank, "baseline": baseline, "after_load": loaded, "after_steps": peak_bytes(),
              "load_s": round(load_s, 2), "held_param_bytes": held}
    Path(out, f"{mode}-rank{env.rank}.json").write_text(json.dumps(result))
    D.teardown(env)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--worker", nargs=4, metavar=("MODEL", "DATA", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)

    from dgemma.training.memory import memory_plan

    config = bench_config(args)
    n = config.param_counts()["total"]
    tmp = Path(tempfile.mkdtemp(prefix="sharded-memory-"))
    write_checkpoint(config, tmp / "model")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [2, 5 + i, 7, 3], "response_ids": list(range(4, 4 + 20))}) + "\n"
                            for i in range(8)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    rows = []
    for mode in ("sharded", "full-then-shard"):
        out = tmp / mode
        out.mkdir()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--worker", str(tmp / "model"), str(data), mode, str(out)],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        rows += [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
    plan = memory_plan(config, world_size=2, micro_batch=1, seq=64)
    full_fp32, full_bf16 = 4 * n, 2 * n

    gb = lambda b: f"{b / 1e9:6.2f}"  # noqa: E731
    print(f"random checkpoint: {n / 1e6:.0f}M parameters; full copy {gb(full_fp32)} GB fp32 "
          f"({gb(full_bf16)} GB bf16 on disk); 2 processes, gloo, full fine-tuning")
    print(f"plan per process: parameters {gb(plan['parameters'])}, gradients {gb(plan['gradients'])}, "
          f"optimizer {gb(plan['optimizer'])} GB")
    print("| load path | rank | peak RSS after imports GB | after load GB | after 2 steps GB | held params GB | load s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {gb(r['baseline'])} | {gb(r['after_load'])} | {gb(r['after_steps'])} "
              f"| {gb(r['held_param_bytes'])} | {r['load_s']} |")
    by = {(r["mode"], r["rank"]): r for r in rows}
    load_growth = {m: max(by[m, k]["after_load"] - by[m, k]["baseline"] for k in (0, 1))
                   for m in ("sharded", "full-then-shard")}
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"params": n, "full_copy_fp32_bytes": full_fp32, "plan_parameters_bytes": plan["parameters"],
                      "rows": rows, "load_growth_bytes": load_growth,
                      "sharded_load_growth_vs_full_copy": load_growth["sharded"] / full_fp32,
                      "full_then_shard_load_growth_vs_full_copy": load_growth["full-then-shard"] / full_fp32}))


if __name__ == "__main__":
    main()
