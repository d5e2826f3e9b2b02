"""LoRA adapters: `dgemma train --lora` writes RUN/adapter in PEFT's format, which peft loads onto the transformers
model (the same logits as the merged export), and `dgemma serve --lora NAME=PATH` serves it by name beside the
base model, with the merged export's tokens for each seed."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from conftest import torch_threads
from test_server import MODEL, ServerProcess
from test_training import reversal_records, write_jsonl

import dgemma


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """A few LoRA steps on the tiny served model (its tokenizer makes it servable): RUN/model merged, RUN/adapter."""
    from dgemma.training.loop import TrainConfig, train

    tmp = tmp_path_factory.mktemp("lora")
    data = write_jsonl(tmp / "task.jsonl", reversal_records(64))
    with torch_threads(1):  # restored after: the tests after this module keep their two threads
        train(TrainConfig(data=str(data), out=str(tmp / "run"), model=str(tiny_model_dir), lora=True, lora_rank=4,
                          lora_alpha=8, steps=6, batch_size=8, lr=2e-2, warmup_steps=1, save_every=6,
                          progress=False))
    return tmp / "run"


@torch.no_grad()
def test_peft_loads_the_adapter_onto_the_transformers_model(lora_run, tiny_model_dir):
    from peft import PeftModel
    from test_model_parity import hf_encode
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    assert {p.name for p in (lora_run / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(tiny_model_dir).eval()
    adapted = PeftModel.from_pretrained(base, lora_run / "adapter").eval()
    merged = DiffusionGemmaForBlockDiffusion.from_pretrained(lora_run / "model").eval()
    ids, canvas = torch.randint(0, 128, (2, 12)), torch.randint(0, 128, (2, 16))
    logits = {}
    for name, hf in (("adapted", adapted.base_model.model), ("merged", merged)):
        cache = DynamicCache(config=hf.config.text_config)
        encoded = hf_encode(hf, ids, cache)
        logits[name] = torch.cat([encoded, hf(decoder_input_ids=canvas, past_key_values=cache).logits], dim=1)
    assert (logits["adapted"] - logits["merged"]).abs().max() <= 1e-4
    with adapted.disable_adapter():  # the adapter is what makes the difference
        cache = DynamicCache(config=base.config.text_config)
        assert (hf_encode(base, ids, cache) - logits["merged"][:, :12]).abs().max() > 1e-3


def test_adapters_served_by_name_beside_the_base_model(lora_run, tiny_model_dir):
    from dgemma.engine import Engine
    from dgemma.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    prompt = "hello world"
    references = {}
    for name, folder in (("ft", lora_run / "model"), (MODEL, tiny_model_dir)):
        model = dgemma.load_model(folder)
        for seed in (1, 2, 3):
            request = Engine(model, max_batch=1, max_length=256).generate(
                [tokenizer.encode(prompt)], model.sampling_config.replace(max_new_tokens=32), seeds=[seed])[0]
            references[name, seed] = tokenizer.decode(request.tokens)
        cached = Engine(model, max_batch=1, max_length=256).generate(  # with the step cache
            [tokenizer.encode(prompt)], model.sampling_config.replace(max_new_tokens=32, step_cache=True), seeds=[4])[0]
        references[name, "step cache"] = tokenizer.decode(cached.tokens)
    assert all(references["ft", s] != references[MODEL, s] for s in (1, 2, 3))  # the adapter changes the answers

    s = ServerProcess(tiny_model_dir, "--eager", "--max-batch", "6", "--lora", f"ft={lora_run / 'adapter'}")
    try:
        client = s.client()
        listed = client.models.list().data
        assert [m.id for m in listed] == [MODEL, "ft"] and listed[1].model_extra["parent"] == MODEL
        jobs = [(name, seed) for seed in (1, 2, 3) for name in ("ft", MODEL)]  # one batch, rows of both

        def ask(job):
            out = client.completions.create(model=job[0], prompt=prompt, max_tokens=32, seed=job[1])
            return out.model, out.choices[0].text

        def ask_with_the_step_cache(name):  # beside the other rows: each packed position takes its row's adapter
            out = client.completions.create(model=name, prompt=prompt, max_tokens=32, seed=4,
                                            extra_body={"step_cache": True})
            return out.model, out.choices[0].text

        with ThreadPoolExecutor(len(jobs) + 2) as pool:
            step_cache = {name: pool.submit(ask_with_the_step_cache, name) for name in (MODEL, "ft")}
            answers = dict(zip(jobs, pool.map(ask, jobs)))
            answers.update({(name, "step cache"): job.result() for name, job in step_cache.items()})
        for job, (served_as, text) in answers.items():
            assert served_as == job[0] and text == references[job], job
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="ft2", prompt=prompt, max_tokens=16)
        assert caught.value.body["code"] == "model_not_found"
    finally:
        s.stop_cleanly()


def test_an_adapter_of_another_base_model_is_refused(lora_run, tmp_path):
    other = tmp_path / "other"
    config = dgemma.get_preset("tiny").replace(max_position_embeddings=512)  # same shapes, another model
    dgemma.save_pretrained(dgemma.DiffusionGemma(config), other)
    proc = subprocess.run([sys.executable, "-m", "dgemma", "serve", "--model", str(other), "--eager",
                           "--lora", f"ft={lora_run / 'adapter'}"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "trained on another base model" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def random_adapter(tiny_model_dir, tmp_path_factory):
    """A random rank-2 adapter of the tiny model's q_proj, as a PEFT folder."""
    from dgemma.weights.peft import write_peft_adapter

    model = dgemma.load_model(tiny_model_dir)
    q = model.layers[0].self_attn.q_proj
    weights = {"layers.0.self_attn.q_proj.lora_A": torch.randn(2, q.in_features),
               "layers.0.self_attn.q_proj.lora_B": torch.randn(q.out_features, 2)}
    return write_peft_adapter(tmp_path_factory.mktemp("adapter") / "a", weights, rank=2, alpha=4, dropout=0.0,
                              base_model=str(tiny_model_dir), config=model.config)


def _damage(folder, how: str):
    import json

    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "config not JSON":
        config.write_text(config.read_text()[:40])
    elif how == "no r":
        config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "r"}))
    else:  # one half of a pair
        from safetensors.torch import load_file, save_file

        save_file({k: v for k, v in load_file(weights).items() if "lora_B" not in k}, weights)


@pytest.mark.parametrize("how, message", [
    ("truncated weights", "adapter_model.safetensors: unreadable safetensors file (Error while deserializing header"),
    ("config not JSON", "adapter_config.json: not valid JSON"),
    ("no r", "adapter_config.json: r and lora_alpha must be numbers, got None and 4"),
    ("half a pair", "q_proj has lora_A but not its other half"),
])
def test_a_damaged_adapter_is_one_line(random_adapter, tmp_path, how, message):
    import shutil

    from dgemma.model.adapters import AdapterError
    from dgemma.weights.peft import read_peft_adapter

    folder = shutil.copytree(random_adapter, tmp_path / "damaged")
    _damage(folder, how)
    with pytest.raises(AdapterError) as caught:
        read_peft_adapter("x", folder)
    assert message in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_serve_with_a_truncated_adapter_is_one_line_and_exit_2(random_adapter, tiny_model_dir, tmp_path):
    import shutil

    folder = shutil.copytree(random_adapter, tmp_path / "damaged")
    _damage(folder, "truncated weights")
    proc = subprocess.run([sys.executable, "-m", "dgemma", "serve", "--model", str(tiny_model_dir), "--eager",
                           "--lora", f"x={folder}"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "adapter_model.safetensors: unreadable safetensors file" in proc.stderr, proc.stderr
