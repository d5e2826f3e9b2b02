"""Shared fixtures: tiny random DiffusionGemma checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `serve`, `chat`, `bench` and `sudoku eval` compile by default (a minute or more per process on CI's two
# cores): the tests run them eagerly, as --eager does, except the few that test compiling itself.
os.environ.setdefault("DGEMMA_EAGER", "1")
# Int8 compute keeps int4 experts on torch's kernels here (the path most tests check); the OpenVINO experts
# of the cpu-kernels extra have their own tests (test_cpu_kernels.py), which ask for them.
os.environ.setdefault("DGEMMA_CPU_KERNELS", "torch")
# Two threads on the CI machine's two cores; one per worker when pytest-xdist runs two (`-n 2`, the README's
# command), and OMP_NUM_THREADS=1 when sharing the machine with other work (oversubscribed OpenMP threads slow
# everything down by an order of magnitude).
_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", _THREADS)))

S, F = "sliding_attention", "full_attention"

# Several shapes: alternating layers with GQA; three sliding + one full, no GQA on sliding layers and
# top-1 routing; a window larger than most prompts.
TINY_TEXT_CONFIGS = {
    "alternating": dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
        layer_types=[S, F, S, F], num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        max_position_embeddings=512,
    ),
    "gemma-pattern": dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=12, global_head_dim=24, num_global_key_value_heads=2, sliding_window=6,
        layer_types=[S, S, S, F], num_experts=3, top_k_experts=1, moe_intermediate_size=16,
        max_position_embeddings=512,
    ),
    "wide-window": dict(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=64,
        layer_types=[S, F], num_experts=6, top_k_experts=3, moe_intermediate_size=8,
        max_position_embeddings=512,
    ),
}
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8)


def sampler_step(logits: torch.Tensor, temperature: float, entropy_bound: float, generator, **kwargs):
    """A whole sampler step (dgemma.sampling's two halves, scan_step then draw_samples), as tests call it."""
    from dgemma.sampling import draw_samples, scan_step

    chunk = {k: kwargs[k] for k in ("chunk_elements",) if k in kwargs}
    return draw_samples(scan_step(logits, temperature, entropy_bound, generator, **kwargs), **chunk)


def wait_until(condition, timeout: float, what: str):
    """Poll `condition()` until it holds; an AssertionError naming `what` once `timeout` seconds have passed.
    For an event another process or thread makes: a test waits for the event itself, never a guessed time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with n torch threads (beside a busy server, two spinning OpenMP threads crawl on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def perturb_every_tensor(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every parameter and persistent buffer of `model` away from its initial value.

    A norm weight of 1, a scale of 1 or a layer scalar equal in both stacks look right whichever copy a
    loader reads; after this, a tensor read from the wrong key or ignored changes the logits. Clipping
    bounds of +-inf become finite. Non-persistent buffers (RoPE frequencies, the embedding scale) are
    functions of the config, not contents of a checkpoint, and stay as they are.
    """
    g = torch.Generator().manual_seed(1000 + seed)
    persistent = set(model.state_dict())
    tensors = [(n, t) for n, t in model.named_parameters()] + [(n, t) for n, t in model.named_buffers()]
    with torch.no_grad():
        for name, t in tensors:
            if name not in persistent or not t.is_floating_point():
                continue
            noise, shift = torch.randn(t.shape, generator=g), torch.randn(t.shape, generator=g)
            bound = torch.sign(t) * (0.5 + torch.rand(t.shape, generator=g))
            if t.dim() >= 2:
                moved = t * (1 + 0.1 * noise) + 0.01 * shift  # already random: keep the scale
            else:
                moved = t * (1 + 0.2 * noise) + 0.1 * shift
            t.copy_(torch.where(torch.isinf(t), bound, moved))
    return model


def unperturbed_tensors(model: torch.nn.Module, fresh: torch.nn.Module) -> list[str]:
    """Names of state-dict tensors of `model` equal to those of `fresh` (the same class, default init)."""
    ours = model.state_dict()
    return [n for n, t in fresh.state_dict().items() if t.is_floating_point() and torch.equal(ours[n], t)]


def hf_config(name: str = "alternating", canvas_length: int = 16, vision: dict | None = None,
              text: dict | None = None, **top):
    """`text` overrides text_config fields, `top` the top-level ones (image token ids, ...)."""
    from transformers import DiffusionGemmaConfig

    return DiffusionGemmaConfig(text_config={**TINY_TEXT_CONFIGS[name], **(text or {})},
                                vision_config=dict(vision or TINY_VISION), canvas_length=canvas_length, **top)


def make_hf_model(name: str = "alternating", canvas_length: int = 16, seed: int = 0, **config):
    """A transformers DiffusionGemmaForBlockDiffusion with random weights and every parameter and buffer
    perturbed (`perturb_every_tensor`): each stack's layer scalars differ, norms and scales are not 1."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(hf_config(name, canvas_length, **config)).eval()
    return perturb_every_tensor(model, seed)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (folder, transformers model) for every tiny config, written once per session."""
    out = {}
    for i, name in enumerate(TINY_TEXT_CONFIGS):
        model = make_hf_model(name, seed=i)
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(folder)
        out[name] = (folder, model)
    return out


# ---------------------------------------------------------------------------------------------
# A tiny model folder with a word-level tokenizer and a chat template, for CLI / server tests.
# ---------------------------------------------------------------------------------------------
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from "
         "or had by hot word but what some we can out other were all there when up use your how said an "
         "each she which do their time if will way about many then them write would like so these her long "
         "make thing see him two has look more day could go come did number sound no most people my over "
         "know water than call first who may down side been now find hello world sudoku diffusion").split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }} {{ m['content'] }} <end_of_turn> "
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}"
)


def write_tiny_tokenizer(folder):
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user", "model"]
    vocab = {tok: i for i, tok in enumerate(specials + list(dict.fromkeys(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    for s in specials[:6]:
        tok.add_special_tokens([s])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return len(vocab)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Random tiny DiffusionGemma (vocab 128, canvas 16, context 256) with a tokenizer, saved by us."""
    import dgemma

    folder = tmp_path_factory.mktemp("tiny-model")
    config = dgemma.get_preset("tiny").replace(max_position_embeddings=256)
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(config)
    model.sampling_config = model.sampling_config.replace(eos_token_ids=(1,), max_denoising_steps=8)
    dgemma.save_pretrained(model, folder)
    assert write_tiny_tokenizer(folder) <= config.vocab_size
    return folder


# ---------------------------------------------------------------------------------------------
# A tiny model folder whose tokenizer has Gemma's shape: SentencePiece-style BPE over '▁'-joined
# text (no pre-tokenizer, so merges cross word and JSON boundaries: '":▁', ',▁"'), byte-fallback
# tokens <0x00>..<0xFF> (characters outside its small alphabet, e.g. 'ü' or '日', are written as
# their UTF-8 bytes), Gemma 4's special tokens and a Gemma 4-style chat template. For structured
# output and tool-call tests.
# ---------------------------------------------------------------------------------------------
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", '<|"|>', "<|tool_call>", "<tool_call|>",
                  "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", "<|channel>", "<channel|>",
                  "<|think|>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _json_corpus(count: int = 400) -> list[str]:
    """JSON-ish lines for training merges (ASCII plus 'é'), written with ', ' and ': ' as people do."""
    import json
    import random

    rng = random.Random(0)
    names = ["name", "age", "city", "tags", "id", "items", "value", "ok", "color", "size", "note", "café"]
    words = ["Paris", "Ada", "red", "blue", "small", "large", "yes", "no", "hello world", "the cat", "é"]
    lines = []
    for _ in range(count):
        obj = {}
        for key in rng.sample(names, rng.randint(1, 4)):
            kind = rng.random()
            obj[key] = (rng.choice(words) if kind < 0.4 else rng.randint(0, 999) if kind < 0.6 else
                        [rng.choice(words) for _ in range(rng.randint(0, 3))] if kind < 0.8 else
                        rng.choice([True, False, None]))
        lines.append(json.dumps(obj, ensure_ascii=False))
    return lines


def write_gemma_tokenizer(folder, extra_specials: tuple[str, ...] = ()) -> dict:
    """Write tokenizer.json + tokenizer_config.json; returns {"vocab_size", "eos_token_ids", "pad_token_id",
    "ids"} (ids: the id of each of `extra_specials`, special tokens placed after all others so that the
    ids of the rest do not move)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    alphabet = [chr(c) for c in range(32, 127) if chr(c) != " "] + ["\u2581", "é"]
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 160, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.train_from_iterator(_json_corpus(), trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    for token in extra_specials:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(GEMMA_SPECIALS + list(extra_specials))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    for needed in ('":\u2581', ',\u2581"'):  # tokens that cross JSON boundaries, as Gemma's vocabulary has
        assert needed in vocab, f"the corpus no longer teaches {needed!r}"
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": GEMMA_CHAT_TEMPLATE}))
    return {"vocab_size": len(vocab), "eos_token_ids": (1, vocab["<turn|>"]), "pad_token_id": 0,
            "ids": {t: vocab[t] for t in extra_specials}}


@pytest.fixture(scope="session")
def gemma_tokenizer_model_dir(tmp_path_factory):
    """Random tiny DiffusionGemma (canvas 16) with a Gemma-shaped tokenizer (~430 tokens, model vocab to match),
    EOS ids (<eos>, <turn|>) and pad 0; 8 denoising steps at most so tests stay fast."""
    import dgemma

    folder = tmp_path_factory.mktemp("gemma-tokenizer-model")
    info = write_gemma_tokenizer(tmp_path_factory.mktemp("gemma-tokenizer"))
    config = dgemma.get_preset("tiny").replace(vocab_size=info["vocab_size"], max_position_embeddings=1024)
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(config)
    model.sampling_config = model.sampling_config.replace(
        eos_token_ids=info["eos_token_ids"], pad_token_id=info["pad_token_id"], max_denoising_steps=8)
    dgemma.save_pretrained(model, folder)  # (it empties the folder first)
    write_gemma_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def gemma4_chat_model_dir(gemma_tokenizer_model_dir, tmp_path_factory):
    """The Gemma-shaped model with a chat template that writes Gemma 4's format: turns, thinking, tool
    declarations, calls and results (tests/data/gemma4_chat_template.jinja)."""
    import shutil
    from pathlib import Path

    folder = tmp_path_factory.mktemp("gemma4-chat") / "model"
    shutil.copytree(gemma_tokenizer_model_dir, folder)
    shutil.copy(Path(__file__).parent / "data" / "gemma4_chat_template.jinja", folder / "chat_template.jinja")
    return folder


# ---------------------------------------------------------------------------------------------
# A tiny model with Gemma 4's vision tower, written by transformers like the image parity tests' models:
# the Gemma-shaped tokenizer plus Gemma 4's image tokens, the Gemma 4-style chat template (an image
# content part becomes <|image|>) and a processor_config.json with a small soft-token budget.
# ---------------------------------------------------------------------------------------------
# GQA, two layers, 4-pixel patches pooled 2 x 2, clipped linears and standardisation on
SMALL_VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                    position_embedding_size=160, use_clipped_linears=True, standardize=True)
IMAGE_SPECIALS = ("<|image|>", "<|image>", "<image|>")  # Gemma 4's placeholder, begin and end of an image
SMALL_PROCESSOR = {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}


@pytest.fixture(scope="session")
def gemma4_vision_model_dir(tmp_path_factory):
    """The tiny "alternating" text model with SMALL_VISION, every tensor perturbed, saved by transformers,
    loaded and saved again by dgemma with EOS (<eos>, <turn|>), pad 0 and 8 denoising steps at most;
    images take at most 70 soft tokens."""
    import json
    import shutil
    from pathlib import Path

    import dgemma

    words = tmp_path_factory.mktemp("gemma4-vision-tokenizer")
    info = write_gemma_tokenizer(words, IMAGE_SPECIALS)
    image, boi, eoi = (info["ids"][t] for t in IMAGE_SPECIALS)
    hf = make_hf_model(seed=5, vision=SMALL_VISION, image_token_id=image, boi_token_id=boi, eoi_token_id=eoi,
                       text=dict(vocab_size=info["vocab_size"], max_position_embeddings=1024,
                                 use_bidirectional_attention="vision"))
    written = tmp_path_factory.mktemp("gemma4-vision-hf")
    hf.save_pretrained(written)
    model = dgemma.load_model(written)
    assert model.vision_tower is not None
    model.sampling_config = model.sampling_config.replace(
        eos_token_ids=info["eos_token_ids"], pad_token_id=info["pad_token_id"], max_denoising_steps=8)
    folder = tmp_path_factory.mktemp("gemma4-vision") / "model"
    dgemma.save_pretrained(model, folder)
    write_gemma_tokenizer(folder, IMAGE_SPECIALS)
    shutil.copy(Path(__file__).parent / "data" / "gemma4_chat_template.jinja", folder / "chat_template.jinja")
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": SMALL_PROCESSOR}))
    return folder


def png_bytes(height: int = 37, width: int = 53, seed: int = 0) -> bytes:
    """A PNG of random pixels."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A decompression bomb's header: a small PNG whose IHDR chunk claims width x height pixels (the CRC
    fixed, so only the pixel count is wrong)."""
    import struct
    import zlib

    data = bytearray(png_bytes(8, 8))
    ihdr = 8  # after the signature: length (4), "IHDR" (4), width, height, ...
    assert data[ihdr + 4 : ihdr + 8] == b"IHDR"
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    body = bytes(data[ihdr + 4 : ihdr + 8 + 13])
    data[ihdr + 8 + 13 : ihdr + 8 + 17] = struct.pack(">I", zlib.crc32(body))
    return bytes(data)
