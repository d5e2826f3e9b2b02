"""The LM head and the self-conditioning embedding work a block of positions at a time; the block follows
the device: the whole canvas in one matmul on a GPU when the temporary fits, never a handful of rows. On a
CPU the head also takes a slice of the table at a time."""

from __future__ import annotations

import torch

import dgemma
from dgemma.model import network
from dgemma.model.network import VOCAB_MIN_ROWS, vocab_chunk_rows

V26 = 262_144  # the released vocabulary


def test_chunk_choice():
    # CPU: a 262k vocabulary is read once for one canvas (not 64 times, as 4-row blocks did, nor 4 as 64-row ones)
    assert vocab_chunk_rows(256, V26, "cpu") == VOCAB_MIN_ROWS
    assert vocab_chunk_rows(256, 8192, "cpu") == 256  # small vocabularies: a canvas in one block
    assert vocab_chunk_rows(512, 8192, "cpu") == 256
    assert vocab_chunk_rows(3, V26, "cpu") == 3
    # GPU: one matmul when the (rows, V) bf16 temporary takes at most a quarter of the free memory
    assert vocab_chunk_rows(4 * 256, V26, "cuda", free_bytes=80 << 30) == 1024
    assert vocab_chunk_rows(4 * 256, V26, "cuda", free_bytes=1 << 30) == (1 << 30) // 4 // (V26 * 2)
    assert vocab_chunk_rows(4 * 256, V26, "cuda", free_bytes=1 << 20) == 1
    assert vocab_chunk_rows(5, V26, "cuda", free_bytes=None) == 5


@torch.no_grad()
def test_blocks_give_the_one_matmul_result(monkeypatch):
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny")).to(torch.bfloat16).eval()
    hidden = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    chosen = []
    real = network.device_vocab_chunk_rows
    monkeypatch.setattr(network, "device_vocab_chunk_rows", lambda *a, **k: chosen.append(real(*a, **k)) or 5)
    blocked = model.head(hidden)
    monkeypatch.setattr(network, "device_vocab_chunk_rows", lambda rows, *a, **k: rows)
    whole = model.head(hidden)
    assert chosen == [48]  # tiny vocabulary: every position in one block unless forced
    assert torch.equal(blocked, whole)
    # on a CPU each block against a slice of the table at a time (the (block, slice) temporary): the same logits
    monkeypatch.setattr(network, "HEAD_SLICE_ELEMENTS", 5 * 7)  # blocks of 5 positions, slices of 7 entries
    monkeypatch.setattr(network, "device_vocab_chunk_rows", lambda *a, **k: 5)
    assert model.config.vocab_size % 7 and torch.equal(model.head(hidden), whole)
    # the runner's self-conditioning embedding against the model's one-shot one
    from dgemma.engine import runner as runner_module
    from dgemma.engine.runner import Runner

    probs = torch.softmax(torch.randn(16, 128), dim=-1)
    run = Runner(model, 1, 64)
    monkeypatch.setattr(runner_module, "device_vocab_chunk_rows", lambda *a, **k: 3)
    assert torch.equal(run.soft_embedding(probs), model.soft_embedding_from_probs(probs))
