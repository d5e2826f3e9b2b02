"""Training, in process: the objective against a by-hand computation, data handling and its errors,
training from scratch (diffusion and the AR baseline), LoRA merge, and the exported checkpoint in
transformers. Kill/resume and multi-process runs are in test_training_resume.py / _distributed.py.

    .venv/bin/python -m pytest tests/test_training.py -q
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

import dgemma
from dgemma.cli import main as cli_main
from dgemma.config import ConfigError
from dgemma.model.network import PreviousStep
from dgemma.training import TrainConfig, learning_rate, train
from dgemma.training.data import DataError, Example, TextEncoder, collate, load_jsonl
from dgemma.training.lora import apply_lora
from dgemma.training.objective import diffusion_losses, draw_noise

# The synthetic task: reverse 3..6 "digits" (ids 4..15) between BOS (2) and a separator (3).
# vocab 16, canvas 8: every response is one canvas, EOS-filled (eos 1).
TASK_MODEL = dict(vocab_size=16, hidden_size=32, num_layers=2, canvas_length=8)


def reversal_records(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        digits = [r.randint(4, 15) for _ in range(r.randint(3, 6))]
        out.append({"prompt_ids": [2] + digits + [3], "response_ids": digits[::-1]})
    return out


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def task_config(tmp_path, name: str, **changes) -> TrainConfig:
    data = tmp_path / "task.jsonl"
    if not data.exists():
        write_jsonl(data, reversal_records(512))
    base = dict(data=str(data), out=str(tmp_path / name), init="preset:tiny", model_overrides=dict(TASK_MODEL),
                steps=300, batch_size=16, lr=3e-3, warmup_steps=20, log_every=25, save_every=300, progress=False)
    return TrainConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def scratch_run(tmp_path_factory):
    """A tiny DiffusionGemma trained from scratch on the reversal task (shared by several tests)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("scratch")
    return tmp, train(task_config(tmp, "diffusion"))


# ---------------------------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------------------------
def test_collate_fills_the_response_with_eos_to_a_canvas_boundary():
    examples = [Example([2, 5, 6], [7, 8, 9, 10, 11]), Example([2], [7, 8, 9, 10]), Example([2, 5], [])]
    b = collate(examples, [0, 1, 2], canvas_length=4, pad_id=0, eos_id=1)
    assert b.input_ids[0].tolist() == [2, 5, 6, 7, 8, 9, 10, 11, 1, 1, 1]  # 5 tokens -> 2 canvases of 4
    assert b.input_ids[1].tolist() == [2, 7, 8, 9, 10] + [0] * 6  # a whole canvas: no fill, then padding
    assert b.input_ids[2].tolist() == [2, 5, 1, 1, 1, 1] + [0] * 5  # empty answer: one canvas of EOS
    assert b.num_canvases.tolist() == [2, 1, 1] and b.prompt_length.tolist() == [3, 1, 2]
    assert b.attention_mask.sum(1).tolist() == [11, 5, 6]
    # next-token targets: the response and the first fill EOS, nothing in the prompt or the rest of the fill
    assert b.ar_targets[0].nonzero().squeeze(1).tolist() == [3, 4, 5, 6, 7, 8]
    assert b.ar_targets[1].nonzero().squeeze(1).tolist() == [1, 2, 3, 4]
    assert b.ar_targets[2].nonzero().squeeze(1).tolist() == [2]


def test_noise_depends_only_on_the_stream_position_and_corrupts_at_rate_t():
    examples = [Example([2], list(range(3, 3 + 8 * (i % 3 + 1)))) for i in range(400)]
    batch = collate(examples, list(range(1000, 1400)), canvas_length=8, pad_id=0, eos_id=1)
    kw = dict(run_seed=7, canvas_length=8, vocab_size=50, eps=1e-3, self_cond_prob=0.5)
    noise = draw_noise(batch, **kw)
    half = draw_noise(collate(examples[200:], list(range(1200, 1400)), canvas_length=8, pad_id=0, eos_id=1), **kw)
    assert torch.equal(noise.replace[200:], half.replace) and torch.equal(noise.t[200:], half.t)
    assert ((noise.t >= 1e-3) & (noise.t < 1)).all()
    assert (noise.canvas_index < batch.num_canvases).all() and set(noise.canvas_index.tolist()) == {0, 1, 2}
    # replaced fraction tracks t: sum of 3200 Bernoulli(t_i); its sd is below sqrt(3200)/2 ~ 28 tokens
    assert abs(noise.replace.sum().item() - 8 * noise.t.sum().item()) < 5 * 28
    assert 150 < noise.self_condition.sum().item() < 250  # Binomial(400, 1/2): mean 200, sd 10


def test_diffusion_loss_equals_a_by_hand_generation_style_computation():
    """Batched training (keep-all cache, right padding, prefix_length) vs one example at a time with a
    generation cache: encode prompt + clean earlier canvases, denoise the noisy canvas twice."""
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()  # window 8, canvas 16, vocab 128
    r = random.Random(1)
    examples = [Example([r.randrange(3, 128) for _ in range(p)], [r.randrange(3, 128) for _ in range(n)])
                for p, n in ((12, 40), (3, 5), (20, 16), (1, 33))]
    batch = collate(examples, [0, 1, 2, 3], canvas_length=16, pad_id=0, eos_id=1)
    noise = draw_noise(batch, run_seed=3, canvas_length=16, vocab_size=128, eps=1e-3, self_cond_prob=0.5)
    noise.canvas_index = torch.tensor([2, 0, 0, 1])  # later canvases for the long answers
    noise.self_condition = torch.tensor([True, False, True, False])
    with torch.no_grad():
        got = diffusion_losses(model, batch, noise)
        for b, ex in enumerate(examples):
            row = batch.input_ids[b, : int(batch.attention_mask[b].sum())]
            start = len(ex.prompt) + 16 * int(noise.canvas_index[b])
            clean = row[start : start + 16]
            noisy = torch.where(noise.replace[b], noise.random_tokens[b], clean)
            cache = model.new_cache(1, 128)
            model.encode(row[None, :start], cache)
            logits = model.denoise(noisy[None], cache)
            if noise.self_condition[b]:
                logits = model.denoise(noisy[None], cache, self_conditioning=PreviousStep.from_logits(logits))
            diff = F.cross_entropy(logits[0], clean)
            enc = model.encode(row[None], model.new_cache(1, 128))[0]
            targets = batch.ar_targets[b, : len(row)].nonzero().squeeze(1)
            ar = F.cross_entropy(enc[targets - 1], row[targets])
            assert abs(got.diffusion[b].item() - diff.item()) < 1e-4
            assert abs(got.ar[b].item() - ar.item()) < 1e-4
            assert abs(got.total[b].item() - (diff + ar).item()) < 2e-4
        # without the next-token loss the encoder stops at the last prefix: same diffusion loss
        alone = diffusion_losses(model, batch, noise, encoder_loss_weight=0.0)
        assert torch.allclose(alone.diffusion, got.diffusion, atol=1e-5) and not alone.ar.any()


def test_learning_rate_warms_up_then_follows_a_cosine_to_the_floor():
    lr = [learning_rate(s, peak=1.0, floor=0.1, warmup=10, total=110) for s in range(110)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[60] == pytest.approx(0.55)  # half-way through the cosine
    assert all(a >= b for a, b in zip(lr[10:], lr[11:])) and lr[-1] == pytest.approx(0.1, abs=1e-3)


# ---------------------------------------------------------------------------------------------
# Training from scratch: the loss falls (diffusion and AR baseline); the checkpoint is a real HF one
# ---------------------------------------------------------------------------------------------
def test_diffusion_training_from_scratch_lowers_the_loss(scratch_run):
    tmp, result = scratch_run
    first, last = result.metrics[0], result.metrics[-1]
    assert [m["step"] for m in result.metrics] == list(range(25, 301, 25))
    # at init both parts sit near ln 16 = 2.77; the trained model must be far below
    assert first["loss"] > 4.5 and last["loss"] < 0.6 * first["loss"]
    assert last["diffusion_loss"] < 0.6 * first["diffusion_loss"] and last["ar_loss"] < 0.6 * first["ar_loss"]
    assert (tmp / "diffusion" / "loss.png").stat().st_size > 1000
    assert (tmp / "diffusion" / "model" / "model.safetensors").is_file()


def test_compiled_training_follows_the_eager_run(tmp_path, monkeypatch, capsys):
    """--compile compiles the blocks on a CPU (the suite's DGEMMA_EAGER=1 lifted here): the same losses as
    --eager step by step, in fp32, within float reassociation. A 4-step run left to the default stays eager
    (it would not pay the compile back) and says so; the compiled run marks its shape warm."""
    from dgemma.compilation import policy

    monkeypatch.delenv("DGEMMA_EAGER", raising=False)
    # warm markers in a folder of the test's own (inductor's cache stays where it is: no cold compile here)
    monkeypatch.setattr(policy, "_marker", lambda model, mode, shape: tmp_path / "warm" /
                        policy.warm_key(model, mode, shape))
    short = dict(steps=4, log_every=1, save_every=4, precision="fp32")
    eager = train(task_config(tmp_path, "eager", compile=False, **short))
    assert "on cpu, eager (--eager)" in capsys.readouterr().err
    train(task_config(tmp_path, "default", **short))
    assert "on cpu, eager (4 steps do not pay back the compile" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--eager and --compile exclude each other"):
        train(task_config(tmp_path, "both", compile=False, force_compile=True, **short))
    assert not list(tmp_path.glob("warm/*"))
    compiled = train(task_config(tmp_path, "compiled", force_compile=True, **short))
    err = capsys.readouterr().err
    assert "on cpu, compiled (--compile)" in err and "warning" not in err
    assert len(list(tmp_path.glob("warm/*"))) == 1  # this shape's step is in the cache now
    for a, b in zip(eager.metrics, compiled.metrics, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)


def test_precision_auto_takes_bf16_only_where_the_cpu_multiplies_it(tmp_path, monkeypatch, capsys):
    """--precision auto: bf16 autocast where `devices.default_dtype` takes bf16 for training (a device that
    multiplies bf16 fast), fp32 elsewhere (an AVX2 CPU emulates bf16 several times slower), with the reason on
    the start line; an explicit bf16 there runs, after one warning line."""
    from dgemma import devices
    from dgemma.training.model_setup import resolve_precision

    cpu = torch.device("cpu")
    auto = devices.default_dtype(cpu, None, training=True)
    assert resolve_precision("fp32", auto) == "fp32" and resolve_precision("bf16", auto) == "bf16"
    assert resolve_precision("auto", auto) == ("bf16" if devices.fast_bf16(cpu) else "fp32")
    short = dict(steps=1, log_every=1, save_every=1, compile=False)
    for fast, asked, runs in [(False, "auto", "fp32"), (True, "auto", "bf16 autocast"), (False, "bf16", "bf16 autocast")]:
        played = devices.DtypeChoice(torch.bfloat16 if fast else torch.float32, f"played {fast}")
        monkeypatch.setattr(devices, "default_dtype", lambda *_, played=played, **__: played)
        train(task_config(tmp_path, f"{fast}-{asked}", precision=asked, **short))
        err = capsys.readouterr().err
        assert f"on cpu, eager (--eager), {runs}" in err
        assert (f"precision: {runs.split()[0]} (--precision auto: played {fast})" in err) == (asked == "auto")
        assert ("warning: bf16 compute asked for where it is slower than fp32 (played False)" in err) == (
            asked == "bf16" and not fast)
    with pytest.raises(ConfigError, match="precision must be 'fp32', 'bf16' or 'auto'"):
        train(task_config(tmp_path, "bad", precision="fp16", **short))


def test_compiled_training_routes_the_experts_by_the_cost_model():
    """Compiled for training, the routed experts leave the graph (a step's thousands of tokens pad a traced
    grid to the busiest expert): `route` runs eagerly, and outputs and gradients match the eager block."""
    from dgemma.model.experts import Experts
    from dgemma.training.model_setup import compile_for_training

    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    model.reset_parameters(seed=1)
    block = model.layers[0]
    x = torch.randn(3, 40, model.config.hidden_size)
    eager_out = block.feed_forward(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    block.zero_grad(set_to_none=True)
    assert compile_for_training(model)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and not any(e.trace_grid for e in experts)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = block.feed_forward(x)
    assert any("routed experts dispatched by the cost model" in reason  # route ran eagerly, between graphs
               for reason in torch._dynamo.utils.counters["graph_break"])
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    grads = [p.grad for p in block.parameters() if p.grad is not None]
    assert len(grads) == len(eager_grads)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)  # float reassociation only


def test_ar_baseline_from_scratch_lowers_the_loss(tmp_path):
    torch.set_num_threads(1)
    result = train(task_config(tmp_path, "ar", objective="ar"))
    first, last = result.metrics[0], result.metrics[-1]
    assert first["diffusion_loss"] == 0 and last["loss"] == last["ar_loss"]
    assert first["loss"] > 2.0 and last["loss"] < 0.6 * first["loss"]
    # the decoder-only self-conditioning block never ran, so it kept its initial weights
    model = dgemma.load_model(result.model_dir)
    fresh = dgemma.DiffusionGemma(model.config)
    fresh.reset_parameters(seed=0)
    assert torch.equal(model.self_conditioning.gate_proj.weight, fresh.self_conditioning.gate_proj.weight)
    assert not torch.equal(model.layers[0].mlp.gate_proj.weight, fresh.layers[0].mlp.gate_proj.weight)


def test_trained_checkpoint_gives_identical_logits_in_transformers(scratch_run):
    from transformers import DiffusionGemmaForBlockDiffusion

    tmp, result = scratch_run
    ours = dgemma.load_model(result.model_dir)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(result.model_dir).eval()
    ids, canvas = torch.randint(0, 16, (2, 9)), torch.randint(0, 16, (2, 8))
    with torch.no_grad():
        cache = ours.new_cache(2, 32)
        ours.encode(ids, cache, return_logits=False)
        mine = ours.denoise(canvas, cache)
        theirs = hf(input_ids=ids, decoder_input_ids=canvas).logits
    assert (mine - theirs).abs().max() <= 1e-4
    # the router was frozen: identical to a fresh seed-0 init
    fresh = dgemma.DiffusionGemma(ours.config)
    fresh.reset_parameters(seed=0)
    assert torch.equal(ours.layers[1].router.proj.weight, fresh.layers[1].router.proj.weight)


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------
def test_lora_merged_export_equals_the_unmerged_adapter_model(scratch_run, tmp_path):
    from dgemma.training.state import read_model_tensors

    torch.set_num_threads(1)
    _, base_run = scratch_run
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "experts")
    config = TrainConfig(data=str(scratch_run[0] / "task.jsonl"), out=str(tmp_path / "lora"),
                         model=str(base_run.model_dir), lora=True, lora_rank=4, lora_alpha=8, lora_targets=targets,
                         steps=12, batch_size=8, lr=1e-2, warmup_steps=2, save_every=12, progress=False)
    train(config)
    # rebuild the adapter model: the base + the stored, unmerged adapters
    adapted = dgemma.load_model(base_run.model_dir)
    apply_lora(adapted, rank=4, alpha=8, targets=targets)
    stored = read_model_tensors(tmp_path / "lora" / "checkpoints" / "step-0000012")  # adapters (+ layer scalars)
    adapters = {n: t for n, t in stored.items() if ".lora_" in n}
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == set(adapters)
    assert any(n.endswith("lora_down_B") for n in adapters)  # the experts were adapted too
    assert all(t.abs().max() > 0 for n, t in adapters.items() if n.endswith("_B"))  # B left zero: it trained
    missing, unexpected = adapted.load_state_dict(adapters, strict=False)
    assert not unexpected
    merged = dgemma.load_model(tmp_path / "lora" / "model")
    base = dgemma.load_model(base_run.model_dir)
    ids, canvas = torch.randint(0, 16, (3, 10)), torch.randint(0, 16, (3, 8))
    with torch.no_grad():
        logits = {}
        for name, model in (("adapted", adapted.eval()), ("merged", merged), ("base", base)):
            cache = model.new_cache(3, 32)
            enc = model.encode(ids, cache)
            logits[name] = torch.cat([enc, model.denoise(canvas, cache)], dim=1)
    assert (logits["adapted"] - logits["merged"]).abs().max() <= 1e-4
    assert (logits["base"] - logits["merged"]).abs().max() > 1e-2  # the adapters changed the model


def test_lora_target_that_matches_nothing_fails_before_training(scratch_run, tmp_path):
    _, base_run = scratch_run
    config = TrainConfig(data=str(scratch_run[0] / "task.jsonl"), out=str(tmp_path / "x"),
                         model=str(base_run.model_dir), lora=True, lora_targets=("q_proj", "qkv"), steps=5)
    with pytest.raises(ConfigError, match="LoRA target 'qkv' matches no module"):
        train(config)
    assert not (tmp_path / "x" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors before training, one line and exit code 2 on the command line
# ---------------------------------------------------------------------------------------------
def _load(path, **kw):
    return load_jsonl(path, vocab_size=16, canvas_length=8, max_length=64, **kw)


def test_malformed_lines_are_reported_with_their_line_numbers(tmp_path, capsys):
    good = reversal_records(3)
    out_of_vocab = '{"prompt_ids": [2], "response_ids": [99]}'
    path = write_jsonl(tmp_path / "d.jsonl", [good[0], "{not json", good[1], "", out_of_vocab, '["a list"]', good[2]])
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        _load(path)
    data = _load(path, skip_bad_lines=True)
    assert len(data) == 3 and list(data.lines) == [1, 3, 7]
    err = capsys.readouterr().err
    assert "skipped 3 bad line(s)" in err and "line 6: expected a JSON object" in err
    assert "line 5: response_ids holds token id 99 outside the vocabulary 0..15" in err


def test_empty_data_too_long_responses_and_text_without_tokenizer_are_errors(tmp_path):
    with pytest.raises(DataError, match="no usable examples"):
        _load(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    long = {"prompt_ids": [2] * 10, "response_ids": [5] * 60}  # 10 + 8 canvases of 8 = 74 > 64
    with pytest.raises(DataError, match=r"long\.jsonl:1: prompt \(10 tokens\) \+ response \(60 tokens.* = 74 tokens "
                                        r"exceeds the context of 64"):
        _load(write_jsonl(tmp_path / "long.jsonl", [long]))
    with pytest.raises(DataError, match=r"text\.jsonl:1: a text record needs a tokenizer"):
        _load(write_jsonl(tmp_path / "text.jsonl", [{"prompt": "hi", "response": "there"}]))
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the last message must have role 'assistant'"):
        _load(write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]))


def _cli(tmp_path, *extra):
    data = tmp_path / "task.jsonl"
    if not data.exists():
        write_jsonl(data, reversal_records(32))
    args = ["train", "--init", "preset:tiny", "--vocab-size", "16", "--set", "hidden_size=32", "--set", "num_layers=2",
            "--set", "canvas_length=8", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "2",
            "--batch-size", "4", "--no-progress", *extra]
    return cli_main(args)


@pytest.mark.parametrize("extra, message", [
    (["--lora", "--lora-targets", "nothing_here"], "LoRA target 'nothing_here' matches no module"),
    (["--set", "hidden_sise=8"], "unknown model field(s) hidden_sise"),
    (["--batch-size", "6", "--micro-batch-size", "4"], "--micro-batch-size 4 does not divide"),
    (["--eos-id", "40"], "eos id 40 is outside the vocabulary"),
])
def test_cli_reports_bad_settings_in_one_line_with_exit_code_2(tmp_path, capsys, extra, message):
    assert _cli(tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dgemma train: error: ") and message in err


def test_cli_flags_are_built_from_train_config(capsys, monkeypatch):
    """Every TrainConfig setting is a flag with the field's default and help; the flags fill its fields."""
    import dataclasses

    from dgemma.cli import build_parser
    from dgemma.commands.train import config_from_args

    parser = build_parser()
    base = ["train", "--init", "preset:tiny", "--data", "d.jsonl", "--out", "o"]
    assert config_from_args(parser.parse_args(base)) == TrainConfig(data="d.jsonl", out="o", init="preset:tiny")
    changed = config_from_args(parser.parse_args(base + [
        "--no-progress", "--no-chat-template", "--lora", "--lora-targets", "q_proj, experts", "--betas", "0.9", "0.9",
        "--memory-per-rank", "2GiB", "--set", "hidden_size=32", "--vocab-size", "16", "--augment", "sudoku"]))
    assert (changed.progress, changed.chat_template, changed.lora) == (False, False, True)
    assert changed.lora_targets == ("q_proj", "experts") and changed.betas == (0.9, 0.9)
    assert changed.memory_per_rank == 2 * 1024**3 and changed.augment == "sudoku"
    assert changed.model_overrides == {"hidden_size": 32, "vocab_size": 16}

    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no words broken at a hyphen
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        if "group" in f.metadata:
            assert f.metadata.get("flag", "--" + f.name.replace("_", "-")) in shown
            assert " ".join(f.metadata["help"].split()) in shown
    assert "(default 1000)" in shown and "(default 0.95 0.99)" in shown and "(default q_proj,k_proj," in shown


def test_cli_refuses_to_overwrite_a_run_and_to_resume_with_other_settings(tmp_path, capsys):
    assert _cli(tmp_path) == 0
    assert _cli(tmp_path) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert _cli(tmp_path, "--resume", "--lr", "1e-3") == 2
    assert "lr: 0.00015 -> 0.001" in capsys.readouterr().err
    assert _cli(tmp_path, "--resume") == 0  # the finished run: nothing left to do, the model is in place
    assert dgemma.load_model(tmp_path / "run" / "model").config.vocab_size == 16


# ---------------------------------------------------------------------------------------------
# Text data through the tokenizer and its chat template (a tiny tokenizer made here), bf16
# ---------------------------------------------------------------------------------------------
def make_tokenizer_folder(folder):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "user", "model", "\n", " "] + \
            "the sky is blue why red green grass what colour".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" |\n"), behavior="isolated")  # words, spaces, newlines
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return folder


def test_text_and_chat_records_train_with_the_chat_template(tmp_path):
    from dgemma.tokenizer import Tokenizer

    folder = make_tokenizer_folder(tmp_path / "tok")
    tok = Tokenizer.from_folder(folder)
    lines = [{"prompt": "why is the sky blue", "response": "the sky is blue"},
             {"messages": [{"role": "user", "content": "what colour is grass"},
                           {"role": "assistant", "content": "grass is green"}]}] * 8
    data = load_jsonl(write_jsonl(tmp_path / "chat.jsonl", lines), vocab_size=32, canvas_length=8, max_length=64,
                      text=TextEncoder(tok))
    first = data[0]
    ids = tok.token_to_id
    assert first.prompt[0] == ids("<bos>") and first.prompt[-3:] == [ids("<|turn>"), ids("model"), ids("\n")]
    assert [tok.backend.id_to_token(i) for i in first.response] == \
        ["the", " ", "sky", " ", "is", " ", "blue", "<turn|>", "\n"]  # the answer ends with the end of turn
    assert math.isfinite(train(TrainConfig(
        data=str(tmp_path / "chat.jsonl"), out=str(tmp_path / "run"), init="preset:tiny", tokenizer=str(folder),
        model_overrides=dict(vocab_size=32, hidden_size=32, num_layers=2, canvas_length=8), steps=3, batch_size=4,
        save_every=3, precision="bf16", progress=False)).final_loss)
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()  # exported with the tokenizer


def test_until_stops_early_on_the_full_schedule_and_resumes_to_the_same_weights(tmp_path):
    """--until N ends a run at step N with a checkpoint, its learning rate still following --steps; a
    resume runs on to the end and lands on the weights of an uninterrupted run."""
    whole = train(task_config(tmp_path, "whole", steps=8, log_every=1, save_every=100))
    part = train(task_config(tmp_path, "split", steps=8, until=3, log_every=1, save_every=100))
    assert part.steps == 3 and [m["step"] for m in part.metrics] == [1, 2, 3]
    assert [m["lr"] for m in part.metrics] == [m["lr"] for m in whole.metrics[:3]]
    assert (tmp_path / "split" / "checkpoints" / "step-0000003").is_dir()
    rest = train(task_config(tmp_path, "split", steps=8, log_every=1, save_every=100, resume=True))
    assert [m["loss"] for m in rest.metrics] == [m["loss"] for m in whole.metrics]
    a, b = (dgemma.load_model(tmp_path / name / "model").state_dict() for name in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sudoku_augmentation_draws_a_fresh_valid_symmetry_per_example_and_step(tmp_path):
    from dgemma.tasks import sudoku as S
    from dgemma.training.data import ExampleStream, read_examples

    examples = S.generate_examples(3, seed=5)
    data = write_jsonl(tmp_path / "sudoku.jsonl", [
        {"prompt_ids": S.encode_prompt(e.puzzle), "response_ids": S.encode_solution(e.solution)} for e in examples])
    dataset = load_jsonl(data, vocab_size=16, canvas_length=81, max_length=256)
    stream = ExampleStream(len(dataset), seed=0)
    first = read_examples(dataset, stream, list(range(6)), augment="sudoku", seed=0)
    assert read_examples(dataset, stream, list(range(6)), augment="sudoku", seed=0) == first  # pure in (seed, n)
    assert read_examples(dataset, stream, list(range(6)), augment="sudoku", seed=1) != first
    plain = read_examples(dataset, stream, list(range(6)))
    for ex, original in zip(first, plain):
        puzzle, solution = S.decode_prompt(ex.prompt), S.decode_canvas(ex.response)
        assert S.is_valid_solution(puzzle, solution)
        assert S.are_equivalent(puzzle, S.decode_prompt(original.prompt))
    # a puzzle met again in the next epoch is transformed afresh
    again = [(a, b) for a in range(6) for b in range(a + 1, 6) if stream.index(a) == stream.index(b)]
    assert len(again) == 3 and all(first[a].prompt != first[b].prompt for a, b in again)

    not_sudoku = write_jsonl(tmp_path / "other.jsonl", reversal_records(4))
    other = load_jsonl(not_sudoku, vocab_size=16, canvas_length=8, max_length=64)
    with pytest.raises(DataError, match=r"line \d+: --augment sudoku: not a sudoku example"):
        read_examples(other, ExampleStream(4, 0), [0], augment="sudoku")
    with pytest.raises(ConfigError, match="--augment must be one of sudoku"):
        task_config(tmp_path, "x", augment="rotate").check(1)


def test_cache_aware_pass_reads_what_the_step_cache_hands_over():
    """--cache-aware: pass 2's logits at the positions it computes are generation's with the step cache: the
    earlier canvas denoised twice into a generation cache's canvas slots (no signal, then self-conditioned),
    its sure positions settled, then only the others run (`decode_active`), reading the settled ones' kept
    keys/values; the loss is the mean over the positions that run."""
    from dgemma.model.packing import PackedPositions
    from dgemma.training.objective import corrupt

    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()  # window 8, canvas 16, vocab 128
    r = random.Random(2)
    examples = [Example([r.randrange(3, 128) for _ in range(p)], [r.randrange(3, 128) for _ in range(16)])
                for p in (5, 9, 3)]
    batch = collate(examples, [0, 1, 2], canvas_length=16, pad_id=0, eos_id=1)
    noise = draw_noise(batch, run_seed=3, canvas_length=16, vocab_size=128, eps=1e-3, self_cond_prob=1.0,
                       cache_aware=1.0)
    noise.stale = torch.tensor([True, True, False])
    want, settle = [], None
    for b, ex in enumerate(examples):
        p = len(ex.prompt)
        clean = batch.input_ids[b, p : p + 16]
        noisy = corrupt(clean, noise.replace[b], noise.random_tokens[b])
        earlier = torch.where(noise.earlier_replace[b], noise.earlier_tokens[b], clean)
        with torch.no_grad():
            gen = model.new_cache(1, p + 16)
            model.encode(batch.input_ids[b : b + 1, :p], gen)
            first = model.denoise(noisy[None], gen)  # pass 1 on x_t: the self-conditioning of pass 2
            computed = torch.ones(1, 16, dtype=torch.bool)
            if noise.stale[b]:  # the earlier canvas's steps write its entries into the canvas slots
                e1 = model.denoise(earlier[None], gen)
                top = model.denoise(earlier[None], gen, self_conditioning=PreviousStep.from_logits(e1)).softmax(
                    -1).amax(-1)
                if settle is None:  # a random model is never sure: half of the first row settles
                    settle = top.median().item() + 1e-6
                computed = top < settle
            pack = PackedPositions.from_mask(computed)
            logits = model.decode_active(noisy[None], gen, pack, self_conditioning=PreviousStep.from_logits(first))
        assert 0 < pack.total <= 16
        want.append(F.cross_entropy(logits, clean[computed[0]]).item())
    with torch.no_grad():
        got = diffusion_losses(model, batch, noise, encoder_loss_weight=0.0, cache_aware_settle=settle)
    assert got.diffusion.tolist() == pytest.approx(want, abs=1e-4)
