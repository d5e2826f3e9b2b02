"""The soak's server inputs (benchmarks/soak.py): the small models it serves and random LoRA adapters for them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_model(root: Path) -> Path:
    """The tests' tiny vision model (random weights, tests/conftest.py) with Gemma's tokenizer shape, Gemma 4's
    chat template and an image processor, written under `root`."""
    import dgemma
    from conftest import IMAGE_SPECIALS, SMALL_PROCESSOR, SMALL_VISION, make_hf_model, write_gemma_tokenizer

    words = root / "tokenizer"
    words.mkdir()
    info = write_gemma_tokenizer(words, IMAGE_SPECIALS)
    image, boi, eoi = (info["ids"][t] for t in IMAGE_SPECIALS)
    hf = make_hf_model(seed=5, vision=SMALL_VISION, image_token_id=image, boi_token_id=boi, eoi_token_id=eoi,
                       text=dict(vocab_size=info["vocab_size"], max_position_embeddings=1024,
                                 use_bidirectional_attention="vision"))
    hf.save_pretrained(root / "hf")
    model = dgemma.load_model(root / "hf")
    model.sampling_config = model.sampling_config.replace(
        eos_token_ids=info["eos_token_ids"], pad_token_id=info["pad_token_id"], max_denoising_steps=8)
    folder = root / "model"
    dgemma.save_pretrained(model, folder)
    write_gemma_tokenizer(folder, IMAGE_SPECIALS)
    shutil.copy(ROOT / "tests" / "data" / "gemma4_chat_template.jinja", folder / "chat_template.jinja")
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": SMALL_PROCESSOR}))
    return folder


def build_model_512(root: Path) -> Path:
    """benchmarks/prefix_cache.py's 8-layer, 512-wide model (random weights, bf16 on a CPU with native bf16)
    with the Gemma-shaped tokenizer and its chat template, 2 denoising steps at most; no vision tower."""
    import dgemma
    from conftest import write_gemma_tokenizer
    from prefix_cache import model_512

    model = model_512()
    folder = root / "model-512"
    info = write_gemma_tokenizer(root)
    model.sampling_config = model.sampling_config.replace(
        eos_token_ids=info["eos_token_ids"], pad_token_id=info["pad_token_id"], max_denoising_steps=2)
    dgemma.save_pretrained(model, folder)
    write_gemma_tokenizer(folder)
    return folder


def write_adapters(model_dir: Path, root: Path, count: int) -> list[str]:
    """`count` random LoRA adapters of the text layers' q_proj and o_proj, as PEFT folders: ["NAME=PATH", ...]."""
    import torch

    import dgemma
    from dgemma.weights.peft import write_peft_adapter

    if not count:
        return []
    model = dgemma.load_model(model_dir)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and n.startswith("layers.") and n.endswith(("q_proj", "o_proj"))}
    flags = []
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        weights = {}
        for name, m in linears.items():
            weights[f"{name}.lora_A"] = torch.randn(4, m.in_features, generator=g) * 0.3
            weights[f"{name}.lora_B"] = torch.randn(m.out_features, 4, generator=g) * 0.3
        folder = write_peft_adapter(root / f"adapter-{i}", weights, rank=4, alpha=8, dropout=0.0,
                                    base_model=str(model_dir), config=model.config)
        flags.append(f"lora-{i}={folder}")
    return flags
