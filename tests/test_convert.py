"""`dgemma convert gemma4`: tiny random Gemma 4 checkpoints written by transformers 5.23 (the oracle)
convert into DiffusionGemma checkpoints whose encoder reproduces Gemma 4's logits and whose decoder
matches transformers' DiffusionGemma; every refusal is one line, exit code 2, nothing written."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import weakref

import pytest
import torch

import dgemma
from dgemma.cli import main as dgemma_main
from dgemma.model.network import PreviousStep
from dgemma.weights.checkpoint import CheckpointError
from dgemma.weights.convert import convert_gemma4
from tests.conftest import perturb_every_tensor

TOL = 1e-4
S, F = "sliding_attention", "full_attention"

# What every convertible Gemma 4 has: the MoE block, K = V on full layers, soft-capped logits, no PLE.
# initializer_range 0.1 gives logits of a few units, so a 1e-4 tolerance is a tight check.
MOE_TEXT = dict(enable_moe_block=True, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                final_logit_softcapping=30.0, max_position_embeddings=512, initializer_range=0.1)
GEMMA4_CONFIGS = {
    # alternating layers, GQA on both kinds, full layers with their own head dim and one KV head
    "alternating": dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
        layer_types=[S, F, S, F], num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    ),
    # Gemma's 3:1-style pattern, no GQA on sliding layers, top-1 routing, another soft-cap, two eos ids
    "gemma-pattern": dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=12, global_head_dim=24, num_global_key_value_heads=2, sliding_window=6,
        layer_types=[S, S, S, F], num_experts=3, top_k_experts=1, moe_intermediate_size=16,
        final_logit_softcapping=50.0, eos_token_id=[1, 90],
    ),
    # a window longer than the prompt, full layers shaped like sliding ones, plain RoPE everywhere
    "wide-window": dict(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=64,
        layer_types=[S, S, F], num_experts=6, top_k_experts=3, moe_intermediate_size=8,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 500.0},
                         F: {"rope_type": "default", "rope_theta": 20_000.0}},
    ),
}
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8)
TINY_AUDIO = dict(model_type="gemma4_audio", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  subsampling_conv_channels=[8, 4], output_proj_dims=16, conv_kernel_size=3)


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one thread is faster than two fighting over a shared, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def text_config(name="alternating", **changes):
    return {**MOE_TEXT, **GEMMA4_CONFIGS[name], **changes}


def _perturb(model, seed):
    """Every parameter and buffer away from its init, so a missing or misplaced one changes the logits."""
    return perturb_every_tensor(model, seed).eval()


def make_causal_lm(seed=0, **text):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    return _perturb(Gemma4ForCausalLM(Gemma4TextConfig(**text)), seed)


def make_conditional(seed=0, audio=False, **text):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Gemma4Config(text_config=text, vision_config=dict(TINY_VISION),
                       audio_config=dict(TINY_AUDIO) if audio else None)
    return _perturb(Gemma4ForConditionalGeneration(cfg), seed)


def save(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return folder


def cli(*args):
    return dgemma_main(["convert", "gemma4", *map(str, args)])


def refused(capsys, src, out, *extra, match: str):
    """Run the CLI expecting a refusal: exit 2, one line on stderr that matches, nothing written."""
    capsys.readouterr()  # forget what building the source printed (transformers' progress bars)
    code = cli(src, out, *extra)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(match, lines[0]), lines[0]
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return lines[0]


@torch.no_grad()
def encode_logits(model, ids):
    cache = model.new_cache(ids.shape[0], 128)
    return model.encode(ids, cache), cache


@torch.no_grad()
def reference_logits(folder_or_model, ids, cls_name="Gemma4ForCausalLM"):
    import transformers

    model = folder_or_model
    if not isinstance(model, torch.nn.Module):
        model = getattr(transformers, cls_name).from_pretrained(folder_or_model, dtype=torch.float32).eval()
    return model(input_ids=ids).logits


def decoder_parity(out, ours, ids, canvas):
    """Load `out` in transformers' DiffusionGemma -> (max |ours - theirs| over the decoder logits of one
    canvas after `ids`, their model, the keys they had to initialise themselves)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, decoder_input_ids=canvas).logits
        _, cache = encode_logits(ours, ids)
        mine = ours.denoise(canvas, cache)
    return (mine - ref).abs().max().item(), hf, set(info["missing_keys"])


# -- parity ---------------------------------------------------------------------------------------
def _source_plain(tmp_path, name):
    return save(make_causal_lm(seed=1, **text_config(name)), tmp_path / "src"), []


def _source_sharded(tmp_path, name):
    # source in several shards, output too
    return save(make_causal_lm(seed=2, **text_config(name)), tmp_path / "src", max_shard_size="20KB"), [
        "--max-shard-size", "30KB"]


def _source_bf16(tmp_path, name):
    # bfloat16 weights converted to float32; the reference is the same bf16 weights upcast
    return save(make_causal_lm(seed=3, **text_config(name)).to(torch.bfloat16), tmp_path / "src"), [
        "--dtype", "float32"]


def _source_hand_written_config(tmp_path, name):
    """A config.json as people write them by hand (global_head_dim instead of per_layer_config, fields at
    their Gemma 4 default left out): Gemma 4's defaults must fill the gaps, not DiffusionGemma's."""
    folder = save(make_causal_lm(seed=4, **text_config(name)), tmp_path / "src")
    cfg = json.loads((folder / "config.json").read_text())
    full = next(i for i, t in enumerate(cfg["layer_types"]) if t == F)
    over = cfg.pop("per_layer_config").get(str(full), {})
    cfg["global_head_dim"] = over.get("head_dim", cfg["head_dim"])
    cfg["num_global_key_value_heads"] = over.get("num_key_value_heads", cfg["num_key_value_heads"])
    for key in ("attention_bias", "hidden_activation", "rms_norm_eps", "use_double_wide_mlp",
                "num_kv_shared_layers", "tie_word_embeddings", "pad_token_id", "bos_token_id"):
        cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, []


SOURCES = {"plain": _source_plain, "sharded": _source_sharded, "bf16": _source_bf16,
           "hand-written-config": _source_hand_written_config}


@pytest.mark.parametrize(
    "name, source",
    [("alternating", "plain"), ("gemma-pattern", "sharded"), ("wide-window", "bf16"),
     ("alternating", "hand-written-config")],
)
def test_converted_encoder_matches_gemma4_and_decoder_matches_transformers(tmp_path, capsys, name, source):
    src, extra = SOURCES[source](tmp_path, name)
    out = tmp_path / "out"
    assert cli(src, out, "--canvas-length", 16, *extra) == 0, capsys.readouterr().err
    if source == "sharded":
        assert (src / "model.safetensors.index.json").is_file()
        assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()

    ours = dgemma.load_model(out)
    V = ours.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 20), generator=g)  # longer than every sliding window but the wide one
    enc, cache = encode_logits(ours, ids)
    ref = reference_logits(src, ids)
    assert ref.abs().max() > 1.0  # logits large enough for the tolerance to mean something
    assert (enc - ref).abs().max() <= TOL

    canvas = torch.randint(0, V, (2, 16), generator=g)
    diff, _, missing = decoder_parity(out, ours, ids, canvas)
    assert diff <= TOL
    # a text-only Gemma 4 has no vision tower to carry: transformers makes one up, nothing else is missing
    assert missing and all(k.startswith("model.encoder.") and "vision" in k for k in missing)

    # self-conditioning starts as an exact no-op: any previous logits give the same decoder output
    with torch.no_grad():
        plain = ours.denoise(canvas, cache)
        previous = PreviousStep.from_logits(torch.randn(2, 16, V, generator=g) * 5)
        conditioned = ours.denoise(canvas, cache, self_conditioning=previous)
    assert torch.equal(plain, conditioned)
    assert ours.config.canvas_length == 16


def test_conditional_generation_with_vision_converts(tmp_path, capsys):
    # as released: image tokens attend bidirectionally in the encoder, text stays causal
    hf = make_conditional(seed=5, **text_config("alternating", use_bidirectional_attention="vision"))
    src = save(hf, tmp_path / "src")
    out = tmp_path / "out"
    assert cli(src, out, "--canvas-length", 16) == 0, capsys.readouterr().err
    ours = dgemma.load_model(out)
    ids = torch.randint(0, 128, (2, 20))
    enc, _ = encode_logits(ours, ids)
    assert (enc - reference_logits(hf, ids)).abs().max() <= TOL

    diff, dg, missing = decoder_parity(out, ours, ids, torch.randint(0, 128, (2, 16)))
    assert diff <= TOL and not missing
    # DiffusionGemma has a Gemma 4 vision tower: it is carried across, weight for weight
    for mine, theirs in ((dg.model.encoder.vision_tower, hf.model.vision_tower),
                         (dg.model.encoder.embed_vision, hf.model.embed_vision)):
        theirs_state = theirs.state_dict()
        assert mine.state_dict().keys() == theirs_state.keys()
        assert all(torch.equal(t, theirs_state[k]) for k, t in mine.state_dict().items())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vision_config"]["hidden_size"] == TINY_VISION["hidden_size"]
    assert cfg["image_token_id"] == hf.config.image_token_id
    assert cfg["text_config"]["use_bidirectional_attention"] == "vision"

    # ... unless dropped: then only the text model is written
    out2 = tmp_path / "text-only"
    assert cli(src, out2, "--drop", "vision") == 0
    index = json.loads((out2 / "model.safetensors.index.json").read_text()) if (
        out2 / "model.safetensors.index.json").is_file() else None
    from safetensors import safe_open

    with safe_open(str(out2 / "model.safetensors"), "pt") as f:
        names = list(f.keys()) if index is None else list(index["weight_map"])
    assert names and not [n for n in names if "vision" in n]
    enc2, _ = encode_logits(dgemma.load_model(out2), ids)
    assert torch.equal(enc, enc2)


# -- parts DiffusionGemma does not have: refused unless dropped --------------------------------------
def test_per_layer_embeddings_refused_then_dropped(tmp_path, capsys):
    text = text_config("alternating", hidden_size_per_layer_input=8, vocab_size_per_layer_input=128)
    hf = make_causal_lm(seed=6, **text)
    src = save(hf, tmp_path / "src")
    out = tmp_path / "out"
    refused(capsys, src, out,
            match=r"per-layer embeddings \(hidden_size_per_layer_input=8\).*--drop per-layer-embeddings")

    assert cli(src, out, "--drop", "per-layer-embeddings") == 0
    # dropping means: exactly the Gemma 4 model without PLE, all other weights unchanged
    without = make_causal_lm(seed=6, **{**text, "hidden_size_per_layer_input": 0})
    missing, unexpected = without.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and unexpected and all("per_layer" in k for k in unexpected)
    ids = torch.randint(0, 128, (2, 20))
    enc, _ = encode_logits(dgemma.load_model(out), ids)
    assert (enc - reference_logits(without, ids)).abs().max() <= TOL
    assert (enc - reference_logits(hf, ids)).abs().max() > 1e-2  # PLE did matter in the source


def test_kv_sharing_refused_then_dropped(tmp_path, capsys):
    # six layers, the last two reuse the K/V of layers 2 (sliding) and 3 (full)
    text = text_config("alternating", num_hidden_layers=6, layer_types=[S, F, S, F, S, F], num_kv_shared_layers=2)
    hf = make_causal_lm(seed=7, **text)
    src = save(hf, tmp_path / "src")
    out = tmp_path / "out"
    refused(capsys, src, out, match=r"KV sharing between layers \(num_kv_shared_layers=2\).*--drop kv-sharing")

    assert cli(src, out, "--drop", "kv-sharing") == 0
    # dropping means: every layer gets its own K/V projections, copied from the layer it shared with
    state = dict(hf.state_dict())
    for consumer, producer in ((4, 2), (5, 3)):
        for part in ("k_proj", "k_norm") + (("v_proj",) if consumer == 4 else ()):
            key = f"model.layers.{{}}.self_attn.{part}.weight"
            state[key.format(consumer)] = state[key.format(producer)]
    unshared = make_causal_lm(seed=7, **{**text, "num_kv_shared_layers": 0})
    unshared.load_state_dict(state, strict=True)
    ids = torch.randint(0, 128, (2, 20))
    enc, _ = encode_logits(dgemma.load_model(out), ids)
    assert (enc - reference_logits(unshared, ids)).abs().max() <= TOL


def test_audio_refused_then_dropped(tmp_path, capsys):
    hf = make_conditional(seed=8, audio=True, **text_config("alternating"))
    src = save(hf, tmp_path / "src")
    out = tmp_path / "out"
    refused(capsys, src, out, match=r"DiffusionGemma has no audio tower \(audio_config\).*--drop audio")
    assert cli(src, out, "--drop", "audio,vision") == 0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [n for n in f.keys() if "audio" in n or "vision" in n]
    ids = torch.randint(0, 128, (1, 12))
    enc, _ = encode_logits(dgemma.load_model(out), ids)
    assert (enc - reference_logits(hf, ids)).abs().max() <= TOL


# -- what cannot be represented: refused, whatever the flags ------------------------------------------
REAL_REFUSALS = {
    "dense": (dict(enable_moe_block=False, num_experts=None, top_k_experts=None, moe_intermediate_size=None),
              r"dense-only Gemma 4 \(enable_moe_block=false\)"),
    "no-k-eq-v": (dict(attention_k_eq_v=False),
                  r"full-attention layers have their own v_proj \(attention_k_eq_v=false"),
    "no-softcap": (dict(final_logit_softcapping=None), r"final_logit_softcapping is unset"),
    "double-wide-shared": (dict(num_hidden_layers=6, layer_types=[S, F, S, F, S, F], num_kv_shared_layers=2,
                                use_double_wide_mlp=True), r"use_double_wide_mlp=true"),
}


@pytest.mark.parametrize("case", list(REAL_REFUSALS))
def test_unrepresentable_models_are_refused(tmp_path, capsys, case):
    changes, match = REAL_REFUSALS[case]
    src = save(make_causal_lm(**text_config("alternating", **changes)), tmp_path / "src")
    line = refused(capsys, src, tmp_path / "out", "--drop", "per-layer-embeddings,kv-sharing,audio,vision",
                   match=match)
    assert line.startswith("dgemma convert: error: ") and "config.json" in line


@pytest.fixture(scope="module")
def good_source(tmp_path_factory):
    return save(make_causal_lm(seed=9, **text_config("alternating")), tmp_path_factory.mktemp("good") / "src")


def _edited(good_source, tmp_path, edit):
    folder = tmp_path / "src"
    shutil.copytree(good_source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


CONFIG_REFUSALS = {
    "attention-softcap": (lambda c: c.update(attn_logit_softcapping=50.0),
                          r"attn_logit_softcapping=50.0 \(attention logit soft-capping"),
    "activation": (lambda c: c.update(hidden_activation="silu"), r"hidden_activation='silu'"),
    "attention-bias": (lambda c: c.update(attention_bias=True), r"attention_bias=true"),
    "untied": (lambda c: c.update(tie_word_embeddings=False), r"tie_word_embeddings=false"),
    "scaled-rope": (lambda c: c["rope_parameters"][F].update(factor=8.0), r"full_attention rope_parameters"),
    "yarn-rope": (lambda c: c["rope_parameters"][S].update(rope_type="yarn"), r"sliding_attention rope_parameters"),
    "bidirectional": (lambda c: c.update(use_bidirectional_attention="all"), r"use_bidirectional_attention='all'"),
    "quantized": (lambda c: c.update(quantization_config={"quant_method": "fp8"}), r"quantization_config is set"),
    "sliding-override": (lambda c: c["per_layer_config"].update({"0": {"head_dim": 32}}),
                         r"sliding layer 0 has its own attention shape"),
    "other-override": (lambda c: c["per_layer_config"]["1"].update(intermediate_size=8),
                       r"overrides intermediate_size on layer 1"),
    "several-at-once": (lambda c: c.update(attention_bias=True, hidden_activation="relu"),
                        r"hidden_activation='relu' \(.*\); attention_bias=true"),
    "wrong-shape": (lambda c: c.update(intermediate_size=100),
                    r"mlp\.\w+_proj\.weight has shape .* the config implies"),
    "not-gemma4": (lambda c: c.update(model_type="llama"), r"model_type is 'llama'"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_config_refusals(good_source, tmp_path, capsys, case):
    edit, match = CONFIG_REFUSALS[case]
    refused(capsys, _edited(good_source, tmp_path, edit), tmp_path / "out", match=match)


def _rewrite_weights(folder, change):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_folder_refusals(good_source, tmp_path, capsys):
    out = tmp_path / "out"

    missing = _edited(good_source, tmp_path / "a", lambda c: None)
    _rewrite_weights(missing, lambda s: s.pop("model.layers.1.router.per_expert_scale"))
    refused(capsys, missing, out, match=r"model\.layers\.1\.router\.per_expert_scale is missing")

    extra = _edited(good_source, tmp_path / "b", lambda c: None)
    _rewrite_weights(extra, lambda s: s.update({"model.layers.0.adapter.weight": torch.zeros(2, 2)}))
    refused(capsys, extra, out,
            match=r"1 text tensor\(s\) DiffusionGemma has no place for \(model\.layers\.0\.adapter\.weight\)")

    outside = _edited(good_source, tmp_path / "d", lambda c: None)
    _rewrite_weights(outside, lambda s: s.update({"score.weight": torch.zeros(2, 64)}))
    refused(capsys, outside, out, match=r"1 tensor\(s\) outside the Gemma 4 layout \(score\.weight\)")

    quantized = _edited(good_source, tmp_path / "e", lambda c: None)
    _rewrite_weights(quantized, lambda s: s.update(
        {"model.layers.0.mlp.up_proj.weight": s["model.layers.0.mlp.up_proj.weight"].to(torch.int8)}))
    refused(capsys, quantized, out, match=r"model\.layers\.0\.mlp\.up_proj\.weight is stored as I8")

    pickle_only = tmp_path / "c"
    pickle_only.mkdir()
    shutil.copy(good_source / "config.json", pickle_only)
    (pickle_only / "pytorch_model.bin").write_bytes(b"never unpickled")
    refused(capsys, pickle_only, out, match="only pickle weights found")

    refused(capsys, tmp_path / "nope", out, match="no such model folder")
    refused(capsys, good_source, out, "--drop", "audio,ple", match=r"unknown --drop name\(s\) ple")
    refused(capsys, good_source, out, "--max-shard-size", "lots", match="cannot read size 'lots'")

    converted = tmp_path / "converted"
    assert cli(good_source, converted) == 0
    capsys.readouterr()
    refused(capsys, converted, out, match="already a DiffusionGemma checkpoint")


def test_existing_output_needs_overwrite(good_source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli(good_source, out) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert cli(good_source, out, "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_dry_run_writes_nothing(good_source, tmp_path, capsys):
    assert cli(good_source, tmp_path / "out", "--dry-run") == 0
    assert "dry run: nothing written" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


# -- writing: streamed, atomic ---------------------------------------------------------------------
def test_streams_one_source_tensor_at_a_time(good_source, tmp_path, monkeypatch):
    import dgemma.weights.convert as conv

    live, peak, calls = set(), [0], [0]
    real = conv._load_source_tensor

    def tracked(handle, name):
        tensor = real(handle, name)
        calls[0] += 1
        key = calls[0]
        live.add(key)
        weakref.finalize(tensor, live.discard, key)
        peak[0] = max(peak[0], len(live))
        return tensor

    monkeypatch.setattr(conv, "_load_source_tensor", tracked)
    convert_gemma4(good_source, tmp_path / "out")
    assert calls[0] > 50 and peak[0] == 1


def test_failure_midway_leaves_nothing(good_source, tmp_path, monkeypatch):
    import dgemma.weights.convert as conv

    real, calls = conv._load_source_tensor, [0]

    def failing(handle, name):
        calls[0] += 1
        if calls[0] == 30:
            raise OSError("disk went away")
        return real(handle, name)

    monkeypatch.setattr(conv, "_load_source_tensor", failing)
    with pytest.raises(CheckpointError, match="cannot read .*disk went away"):
        convert_gemma4(good_source, tmp_path / "new", max_shard_bytes=20_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    # an existing output is untouched by a failed --overwrite
    monkeypatch.setattr(conv, "_load_source_tensor", real)
    convert_gemma4(good_source, tmp_path / "out", seed=1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls[0] = 0
    monkeypatch.setattr(conv, "_load_source_tensor", failing)
    with pytest.raises(CheckpointError):
        convert_gemma4(good_source, tmp_path / "out", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_tokenizer_generation_config_and_command_line(tmp_path):
    src = save(make_causal_lm(seed=10, **text_config("gemma-pattern")), tmp_path / "src")
    files = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"model_max_length": 512}',
             "chat_template.jinja": "{{ messages }}"}
    for name, text in files.items():
        (src / name).write_text(text)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 90, 50], "top_k": 64}))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dgemma", "convert", "gemma4", str(src), str(out),
                           "--canvas-length", "32", "--dtype", "bfloat16"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "4 new (self-conditioning, down_proj = 0)" in proc.stdout
    for name, text in files.items():
        assert (out / name).read_text() == text
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 90, 50] and "top_k" not in gen  # AR sampling knobs do not carry over
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["canvas_length"] == 32 and cfg["text_config"]["final_logit_softcapping"] == 50.0
    model = dgemma.load_model(out, dtype=torch.bfloat16)
    assert model.sampling_config.eos_token_ids == (1, 90, 50)
    assert model.config.canvas_length == 32
    sc = model.self_conditioning
    assert sc.down_proj.weight.dtype == torch.bfloat16 and not sc.down_proj.weight.any()
    assert sc.gate_proj.weight.std() > 0.05 and torch.equal(sc.pre_norm.weight, torch.ones(48, dtype=torch.bfloat16))


# -- the recipe: `dgemma train` adapts the converted model ------------------------------------------
def reversal_records(n: int, seed: int) -> list[dict]:
    """The tiny synthetic task of docs/convert-gemma4.md: reverse 3..6 "digits" (ids 4..19) written
    between BOS (2) and a separator (3); every answer fits one canvas of 8."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        digits = [r.randint(4, 19) for _ in range(r.randint(3, 6))]
        out.append({"prompt_ids": [2] + digits + [3], "response_ids": digits[::-1]})
    return out


def held_out_diffusion_loss(model_dir, data_file):
    """The trainer's own diffusion loss on held-out examples, with noise fixed by a seed."""
    from dgemma.training.data import collate, load_jsonl
    from dgemma.training.objective import diffusion_losses, draw_noise

    model = dgemma.load_model(model_dir)
    L, V = model.config.canvas_length, model.config.vocab_size
    data = load_jsonl(data_file, vocab_size=V, canvas_length=L, max_length=64)
    examples = [data[i] for i in range(len(data))]
    batch = collate(examples, list(range(len(examples))), canvas_length=L, pad_id=0, eos_id=1)
    noise = draw_noise(batch, run_seed=99, canvas_length=L, vocab_size=V, eps=1e-3, self_cond_prob=0.5)
    with torch.no_grad():
        return diffusion_losses(model, batch, noise).diffusion.mean().item(), model


def test_dgemma_train_adapts_the_converted_model(good_source, tmp_path, capsys):
    """A short `dgemma train` run (diffusion objective) lowers the held-out diffusion loss clearly from
    the converted starting point, and the zero-initialised self-conditioning block starts to learn."""
    converted = tmp_path / "converted"
    assert cli(good_source, converted, "--canvas-length", 8) == 0
    train_file, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    for path, records in ((train_file, reversal_records(512, seed=0)), (held_out, reversal_records(64, seed=1))):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    before, _ = held_out_diffusion_loss(converted, held_out)
    code = dgemma_main(["train", "--model", str(converted), "--data", str(train_file), "--out", str(tmp_path / "run"),
                        "--steps", "40", "--batch-size", "16", "--lr", "3e-3", "--warmup-steps", "5",
                        "--log-every", "10", "--save-every", "40", "--no-progress", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    after, adapted = held_out_diffusion_loss(tmp_path / "run" / "model", held_out)
    assert after < 0.6 * before, (before, after)  # measured: 4.43 -> 1.58
    assert adapted.self_conditioning.down_proj.weight.abs().max() > 0
