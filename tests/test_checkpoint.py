"""Checkpoint I/O: our saves load in transformers with identical logits and vice versa; bad folders
fail with one clear error that names the file (and key)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import dgemma
from dgemma.weights.checkpoint import CheckpointError

TOL = 1e-4


def _logits(model_or_hf, ids, canvas, ours: bool):
    with torch.no_grad():
        if ours:
            cache = model_or_hf.new_cache(ids.shape[0], 128)
            model_or_hf.encode(ids, cache, return_logits=False)
            return model_or_hf.denoise(canvas, cache)
        return model_or_hf(input_ids=ids, decoder_input_ids=canvas).logits


def test_our_save_loads_in_transformers(tmp_path, hf_checkpoints):
    from transformers import DiffusionGemmaForBlockDiffusion

    folder, _ = hf_checkpoints["gemma-pattern"]
    ours = dgemma.load_model(folder)
    out = tmp_path / "ours"
    dgemma.save_pretrained(ours, out)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(out).eval()
    ids, canvas = torch.randint(0, 96, (2, 9)), torch.randint(0, 96, (2, 16))
    assert (_logits(ours, ids, canvas, True) - _logits(hf, ids, canvas, False)).abs().max() <= TOL
    # and round-trips through us, generation config included
    again = dgemma.load_model(out)
    assert again.sampling_config == ours.sampling_config
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def test_randomly_initialised_model_saves_for_transformers(tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    ours = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).eval()
    dgemma.save_pretrained(ours, tmp_path / "m", max_shard_bytes=60_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "m").eval()
    ids, canvas = torch.randint(0, 128, (1, 11)), torch.randint(0, 128, (1, 16))
    assert (_logits(ours, ids, canvas, True) - _logits(hf, ids, canvas, False)).abs().max() <= TOL


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_transformers_save_loads_in_ours(tmp_path, hf_checkpoints, shard):
    _, hf = hf_checkpoints["alternating"]
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path / "hf", **kwargs)
    if shard:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = dgemma.load_model(tmp_path / "hf")
    ids, canvas = torch.randint(0, 128, (2, 13)), torch.randint(0, 128, (2, 16))
    assert (_logits(ours, ids, canvas, True) - _logits(hf, ids, canvas, False)).abs().max() <= TOL


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_every_checkpoint_key_is_accounted_for(tmp_path, hf_checkpoints, shard):
    """A transformers save: every key it holds is read into the model or skipped for a stated reason,
    and both stacks' layer scalars are read from their own keys."""
    from safetensors import safe_open

    _, hf = hf_checkpoints["alternating"]
    folder = tmp_path / "hf"
    hf.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    model = dgemma.load_model(folder)
    assert set(model.load_report) == keys
    assert all(d == "read" or d.startswith("skipped: ") for d in model.load_report.values())
    read = {k for k, d in model.load_report.items() if d == "read"}
    assert len(read) == len(model.state_dict())
    for i, (ours, enc, dec) in enumerate(zip(model.layers, hf.model.encoder.language_model.layers,
                                             hf.model.decoder.layers)):
        assert f"model.encoder.language_model.layers.{i}.layer_scalar" in read
        assert torch.equal(ours.encoder_layer_scalar, enc.layer_scalar)
        assert torch.equal(ours.layer_scalar, dec.layer_scalar)


def test_both_layer_scalars_saved_as_loaded(tmp_path, hf_checkpoints):
    from safetensors.torch import load_file

    folder, hf = hf_checkpoints["gemma-pattern"]
    dgemma.save_pretrained(dgemma.load_model(folder), tmp_path / "again")
    saved = load_file(tmp_path / "again" / "model.safetensors")
    for i, (enc, dec) in enumerate(zip(hf.model.encoder.language_model.layers, hf.model.decoder.layers)):
        assert torch.equal(saved[f"model.encoder.language_model.layers.{i}.layer_scalar"], enc.layer_scalar)
        assert torch.equal(saved[f"model.decoder.layers.{i}.layer_scalar"], dec.layer_scalar)


def test_unknown_keys_are_refused_by_name(broken):
    from safetensors.torch import load_file, save_file

    shard = _shards(broken)[0]
    tensors = load_file(shard)
    tensors["model.decoder.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.decoder.layers.0.mystery.weight"] = shard.name
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.decoder\.layers\.0\.mystery\.weight: not part of"):
        dgemma.load_model(broken)


def test_vision_weights_load_and_save_back_under_their_names(tmp_path, hf_checkpoints):
    """The vision tower and its projection load from `model.encoder.*` (parameters and buffers) and are
    written back under the same names, with the same values; a checkpoint without them gives a text model."""
    from safetensors.torch import load_file

    folder, hf = hf_checkpoints["alternating"]
    ours = dgemma.load_model(folder)
    assert ours.config.vision is not None and ours.vision_tower is not None
    theirs = {k: v for k, v in hf.state_dict().items() if k.startswith(("model.encoder.vision_tower.",
                                                                         "model.encoder.embed_vision."))}
    mine = {"model.encoder." + k: v for k, v in ours.state_dict().items()
            if k.startswith(("vision_tower.", "embed_vision."))}
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    dgemma.save_pretrained(ours, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(saved[k], theirs[k]) for k in theirs)
    # a text-only checkpoint (ours, saved without a tower) stays text-only, though its config.json
    # describes the minimal tower transformers needs
    dgemma.save_pretrained(dgemma.DiffusionGemma(dgemma.get_preset("tiny")), tmp_path / "text")
    assert "vision_config" in json.loads((tmp_path / "text" / "config.json").read_text())
    text_only = dgemma.load_model(tmp_path / "text")
    assert text_only.config.vision is None and text_only.vision_tower is None
    # and a training run's memory plan, read from the folder before any weight, counts no tower either
    from dgemma.training.model_setup import resolve_model_config

    assert resolve_model_config(str(tmp_path / "text"), None, {}).vision is None
    assert resolve_model_config(folder, None, {}).vision is not None


def test_bf16_load(hf_checkpoints):
    folder, _ = hf_checkpoints["alternating"]
    model = dgemma.load_model(folder, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    cache = model.new_cache(1, 64)
    model.encode(torch.randint(0, 128, (1, 5)), cache)
    assert model.denoise(torch.randint(0, 128, (1, 16)), cache).dtype == torch.float32


@pytest.fixture
def broken(tmp_path, hf_checkpoints):
    """A fresh, sharded copy of a checkpoint to break in one way per test."""
    _, hf = hf_checkpoints["alternating"]
    folder = tmp_path / "broken"
    hf.save_pretrained(folder, max_shard_size="20KB")
    return folder


def _shards(folder):
    """Shards that hold text weights (vision-only shards are skipped by design)."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted({folder / f for k, f in weight_map.items() if k.startswith("model.decoder.")})


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no such model folder"):
        dgemma.load_model(tmp_path / "nope")


def test_other_model_type(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gemma4"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: model_type is 'gemma4'"):
        dgemma.load_model(broken)


def test_missing_shard(broken):
    victim = _shards(broken)[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: shard listed in .* is missing"):
        dgemma.load_model(broken)


def test_wrong_shape(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 100
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"safetensors: model\.decoder\.layers\.\d+\.mlp\.\w+_proj\.weight has shape"):
        dgemma.load_model(broken)


def test_truncated_file(broken):
    victim = _shards(broken)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim.name):
        dgemma.load_model(broken)


def test_pickle_only_folder_is_refused(tmp_path, hf_checkpoints):
    folder, _ = hf_checkpoints["alternating"]
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        dgemma.load_model(tmp_path)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    dgemma.save_pretrained(model, tmp_path / "m")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("dgemma.weights.shards.write_safetensors", boom)
    with pytest.raises(OSError):
        dgemma.save_pretrained(model, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left behind


def test_cli_reports_bad_folder_without_traceback(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc = subprocess.run([sys.executable, "-m", "dgemma", "info", "--model", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "config.json" in proc.stderr and "llama" in proc.stderr


@pytest.mark.parametrize("damage", ["truncate", "delete", "unlisted key"])
def test_info_checks_every_shard_header_without_reading_weights(broken, damage):
    """`dgemma info --model` checks the headers of every shard against the index and the file sizes:
    a truncated, missing or inconsistent shard is one line on stderr and exit code 2."""
    victim = _shards(broken)[-1]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-7])
    elif damage == "delete":
        victim.unlink()
    else:
        index = json.loads((broken / "model.safetensors.index.json").read_text())
        key = next(k for k, f in index["weight_map"].items() if f == victim.name)
        del index["weight_map"][key]
        (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = subprocess.run([sys.executable, "-m", "dgemma", "info", "--model", str(broken)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and victim.name in proc.stderr


@pytest.mark.parametrize("change,message", [
    ({"final_logit_softcapping": 0}, "final_logit_softcapping must be a positive number"),
    ({"per_layer_config": {"3": {"head_dim": 32, "num_key_value_heads": 1}}}, "different shapes"),
])
def test_configs_we_cannot_run_are_refused(broken, change, message):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["text_config"].update(change)  # the second: layer 1 (full) keeps the base shape, layer 3 does not
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        dgemma.load_model(broken)
