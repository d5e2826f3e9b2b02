"""Attention over long prefills goes a block of queries at a time: the same output, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dgemma.model.attention import attention, causal_mask

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", [SDPBackend.MATH, None])
@pytest.mark.parametrize("with_mask", [True, False])
def test_query_blocks_give_the_unblocked_output(backend, with_mask):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, S, D = 2, 4, 2, 40, 56, 32
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, T), (Hkv, S), (Hkv, S)))
    key_pos = torch.arange(S).repeat(B, 1)
    key_pos[1, :5] = -1  # left padding in the second row
    mask = causal_mask(key_pos[:, -T:], key_pos, None) if with_mask else None
    backends = [backend] if backend else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
        blocks = attention(q, k, v, mask, chunk_elements=Hq * B * S * 7)  # 7 query rows a call, the last 5
    assert torch.equal(blocks, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()  # the folded path is for passes without autograd
def test_unmasked_query_heads_folded_onto_their_kv_head_give_the_gqa_output(dtype):
    """Without a mask (a canvas that sees its whole prefix) the query heads of one KV head run as one head
    of group * T queries: bit-identical to SDPA's GQA broadcast, query heads from a transposed projection."""
    g = torch.Generator().manual_seed(1)
    for Hq, Hkv in ((4, 2), (8, 1), (4, 4)):
        q = torch.randn(2, 24, Hq, 32, generator=g).to(dtype).transpose(1, 2)  # (B, Hq, T, D), not contiguous
        k, v = (torch.randn(2, Hkv, 40, 32, generator=g).to(dtype) for _ in range(2))
        whole = F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=True)
        assert torch.equal(attention(q, k, v, None), whole)


def test_long_prefill_memory_is_bounded():
    """SDPA's math kernel (what CUDA falls back to at the full layers' head dim 512 with GQA and a mask)
    holds (B, Hq, T, S) fp32 scores and their softmax: ~2.4 such buffers at once, measured. With the
    default block size a 4096-token prefill adds well under one buffer (the process's peak RSS, measured
    after the inputs are made)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "attention_memory.py"), "--child", "math-blocks",
           "--tokens", "4096", "--head-dim", "64", "--dtype", "fp32"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.splitlines()[-1])
    scores = 16 * 4096 * 4096 * 4
    assert out["query_rows_per_call"] < 4096
    assert out["peak_added_bytes"] < 0.75 * scores, out
