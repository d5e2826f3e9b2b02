"""Sharded training over 2 CPU processes (torchrun, FSDP2, gloo): loading each rank's rows from the
safetensors, DCP checkpoints (SIGKILL one rank, resume; resume on another number of processes), the
streamed export, mixed precision, and the per-process memory plan with its refusal.

    .venv/bin/python -m pytest tests/test_training_sharded.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training import reversal_records, write_jsonl
from test_training_resume import ROOT, subprocess_env

import dgemma
from dgemma.cli import main as cli_main
from dgemma.training.memory import memory_plan
from dgemma.training.model_setup import configure_trainable
from dgemma.training.weights import materialise, meta_model
from dgemma.weights.checkpoint import model_config

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
# odd sizes on purpose: 17 embedding rows and 3 experts do not split evenly over 2 processes
SMALL = dict(vocab_size=17, hidden_size=32, num_layers=2, canvas_length=8, num_experts=3, top_k_experts=2)
LORA_TARGETS = "q_proj,mlp.down_proj,experts"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A random checkpoint stored in bf16 over several safetensors files."""
    folder = tmp_path_factory.mktemp("base") / "model"
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny").replace(
        **SMALL, layer_types=("sliding_attention", "full_attention")))
    model.reset_parameters(seed=3)
    dgemma.save_pretrained(model.to(torch.bfloat16), folder, max_shard_bytes=40_000)
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


def test_sharded_load_equals_the_full_load_and_bf16_compute_is_near_fp32(base_model, tmp_path):
    env = subprocess_env()
    run = subprocess.run([*TORCHRUN, "2", str(ROOT / "tests" / "sharded_load_check.py"), str(base_model), str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    gathered = load_file(str(tmp_path / "gathered.safetensors"))

    # the same model built in one process: base weights as load_model reads them, adapters from the seed
    from sharded_load_check import LORA

    _, config = model_config(base_model)
    single, plan = meta_model(str(base_model), config, config.eos_token_id, torch.float32)
    configure_trainable(single, objective="diffusion", lora=LORA, train_router=False)
    materialise(single, device=torch.device("cpu"), model_dir=str(base_model), plan=plan, seed=7)
    expected = single.state_dict()
    assert set(gathered) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(gathered[name], tensor), name
    # bf16 compute (FSDP2's MixedPrecisionPolicy): near the fp32 loss and gradients, not equal to them
    from sharded_load_check import batch_loss

    loss = batch_loss(single, lockstep=False)
    loss.backward()
    fp32, mixed = loss.item(), json.loads((tmp_path / "rank0.json").read_text())["loss"]
    assert mixed != fp32 and abs(mixed - fp32) < 0.02 * fp32, (mixed, fp32)
    grads = load_file(str(tmp_path / "grads.safetensors"))
    assert set(grads) == {n for n, p in single.named_parameters() if p.requires_grad}
    for name, g in grads.items():
        ref = dict(single.named_parameters())[name].grad
        assert (g - ref).norm() <= 0.1 * ref.norm() + 1e-6, name  # bf16: ~3 significant digits

    plain = dgemma.load_model(base_model).state_dict()
    assert torch.equal(gathered["embed_tokens.weight"], plain["embed_tokens.weight"])
    assert torch.equal(gathered["layers.1.experts.gate_up_proj"], plain["layers.1.experts.gate_up_proj"])
    assert torch.equal(gathered["layers.0.self_attn.q_proj.base.weight"], plain["layers.0.self_attn.q_proj.weight"])
    assert gathered["layers.0.experts.lora_down_A"].abs().max() > 0  # adapters initialised, per expert

    # each rank held its own rows only: together exactly one copy; rank 0's part is what the plan says
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    params = sum(p.numel() * p.element_size() for p in single.parameters())
    assert sum(r["held_bytes"] for r in ranks) == params
    assert all(r["held_bytes"] < 0.6 * params for r in ranks)
    assert ranks[0]["held_bytes"] == memory_plan(single.config, world_size=2, micro_batch=1, seq=16, lora=LORA)["parameters"]


def _train_args(data: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return ["-m", "dgemma", "train", "--model", str(model), "--data", str(data), "--out", str(out),
            "--lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", LORA_TARGETS,
            "--steps", "12", "--batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2", "--warmup-steps", "2",
            "--log-every", "2", "--save-every", "4", "--keep-checkpoints", "0", "--no-progress", *extra]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


@pytest.mark.slow
def test_killed_rank_resumes_on_the_uninterrupted_curve_on_any_number_of_processes(base_model, tmp_path):
    """Reference: one process. Killed: two processes with activation checkpointing, one rank SIGKILLed after
    the step-4 checkpoint. Resumed on ONE process to step 8 (DCP reshards 2 -> 1), then on TWO to the end
    (1 -> 2). Every logged loss and the exported weights equal the reference's."""
    data = write_jsonl(tmp_path / "task.jsonl", [
        {"prompt_ids": r["prompt_ids"], "response_ids": [min(t, 16) for t in r["response_ids"]]}
        for r in reversal_records(128)])
    env = subprocess_env()
    reference = subprocess.Popen([sys.executable, *_train_args(data, tmp_path / "ref", base_model)],
                                 cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = tmp_path / "killed"
    run = subprocess.Popen([*TORCHRUN, "2", *_train_args(data, killed, base_model, "--activation-checkpointing")],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = killed / "checkpoints" / "step-0000004"
    deadline = time.monotonic() + 180
    while not first.is_dir() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = _children(run.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)  # one rank dies; torchrun takes the other down
    assert run.wait(timeout=120) != 0
    assert not (killed / "checkpoints" / "step-0000012").exists() and not (killed / "model").exists()

    one = subprocess.run([sys.executable, *_train_args(data, killed, base_model, "--resume", "--until", "8")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed from" in one.stderr and "1 process(es)" in one.stderr
    two = subprocess.run([*TORCHRUN, "2", *_train_args(data, killed, base_model, "--resume")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resumed from" in two.stderr and "2 process(es)" in two.stderr
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]
    written_by = {s: json.loads((killed / "checkpoints" / f"step-{s:07d}" / "trainer_state.json").read_text())["world_size"]
                  for s in (4, 8, 12)}
    assert written_by == {4: 2, 8: 1, 12: 2}

    expected, got = _losses(tmp_path / "ref"), _losses(killed)
    assert sorted(got) == sorted(expected) == list(range(2, 13, 2))
    for step in expected:
        assert abs(got[step] - expected[step]) < 1e-4, (step, got[step], expected[step])
    assert expected[12] < expected[2]  # it trained
    a, b = dgemma.load_model(tmp_path / "ref" / "model"), dgemma.load_model(killed / "model")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-4, rtol=0), name

    # the export: dgemma and transformers read it alike; `dgemma export` with small shards gives the same
    from transformers import DiffusionGemmaForBlockDiffusion

    assert cli_main(["export", str(killed), "--out", str(tmp_path / "exported"), "--shard-size", "50kB"]) == 0
    assert len(list((tmp_path / "exported").glob("*.safetensors"))) > 2
    again = dgemma.load_model(tmp_path / "exported")
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "exported").eval()
    ids, canvas = torch.randint(0, 17, (2, 9)), torch.randint(0, 17, (2, 8))
    with torch.no_grad():
        logits = {}
        for name, model in (("ours", b), ("again", again)):
            cache = model.new_cache(2, 32)
            model.encode(ids, cache, return_logits=False)
            logits[name] = model.denoise(canvas, cache)
        theirs = hf(input_ids=ids, decoder_input_ids=canvas).logits
    assert torch.equal(logits["ours"], logits["again"])
    assert (logits["ours"] - theirs).abs().max() <= 1e-4
    base = dgemma.load_model(base_model)
    assert not torch.equal(b.layers[0].experts.down_proj, base.layers[0].experts.down_proj)  # experts merged


def test_memory_plan_is_exact_for_the_states_and_scales_with_processes(capsys):
    config = dgemma.get_preset("tiny")
    with torch.device("meta"):
        model = dgemma.DiffusionGemma(config)
    n = sum(p.numel() for p in model.parameters())
    full1 = memory_plan(config, world_size=1, micro_batch=1, seq=64)
    full8 = memory_plan(config, world_size=8, micro_batch=1, seq=64)
    assert full1["parameters"] == 4 * n and full1["gathered"] == 0
    trainable = full1["trainable_params"]
    assert full1["gradients"] == 4 * trainable and full1["optimizer"] == 8 * trainable
    full2 = memory_plan(config, world_size=2, micro_batch=1, seq=64)
    assert 4 * n / 2 <= full2["parameters"] < 1.01 * 4 * n / 2 and 8 * trainable / 2 <= full2["optimizer"]
    assert full8["parameters"] < full2["parameters"]
    assert full8["activations"] == full1["activations"] and full8["gathered"] > 0
    checkpointed = memory_plan(config, world_size=8, micro_batch=1, seq=64, activation_checkpointing=True)
    assert checkpointed["activations"] < full8["activations"]
    assert memory_plan(config, world_size=8, micro_batch=2, seq=64)["activations"] == 2 * full8["activations"]

    code = cli_main(["info", "--preset", "diffusiongemma-26b-a4b", "--train", "--lora", "--world-size", "8",
                     "--batch", "1", "--seq", "2048"])
    out = capsys.readouterr().out
    assert code == 0 and "training plan    LoRA" in out
    plan = json.loads(out.strip().splitlines()[-1])["training_plan"]
    assert plan["world_size"] == 8 and 25.2e9 < plan["total_params"] < 25.3e9
    assert plan["trainable_params"] < 0.01 * plan["total_params"]  # adapters only
    assert plan["gradients"] < 1e8 and 12e9 < plan["parameters"] < 13e9  # fp32 base / 8
    assert plan["total"] == sum(plan[t] for t in ("parameters", "gradients", "optimizer", "gathered", "activations"))


def test_a_world_size_that_does_not_divide_the_batch_is_refused():
    from dgemma.config import ConfigError
    from dgemma.training import TrainConfig

    config = TrainConfig(data="x.jsonl", out="y", init="preset:tiny", batch_size=4)
    config.check(2)
    with pytest.raises(ConfigError, match="--batch-size 4 is not a multiple of the 3 processes"):
        config.check(3)


def test_a_run_that_cannot_fit_is_refused_before_any_weight_is_read(base_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "task.jsonl", reversal_records(8))
    args = ["train", "--model", str(base_model), "--data", str(data), "--out", str(tmp_path / "run"),
            "--steps", "2", "--batch-size", "2", "--no-progress"]
    assert cli_main([*args, "--memory-per-rank", "100kB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more than --memory-per-rank 100.00 kB" in err, err
    assert "the plan needs" in err and not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as bad:
        cli_main([*args, "--memory-per-rank", "lots"])
    assert bad.value.code == 2 and "cannot read size 'lots'" in capsys.readouterr().err
