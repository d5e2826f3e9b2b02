"""Left-to-right decoding with the encoder and the LM head: the autoregressive baseline's sampler.

The same network and KV cache as block diffusion, used as a plain causal LM: encode the prompts once
(left-padded; padding is masked out and, since RoPE is relative, shifts nothing), then feed one token per
step. Rows that reach an EOS leave the batch: later steps run only the cache rows still generating
(`encode(..., rows=)`), so finished rows cost nothing.
Compares diffusion and left-to-right decoding at an identical weight budget.
"""

from __future__ import annotations

import torch

from dgemma.generation.canvas import left_pad


def _next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) fp32 -> token ids (B,): argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate_ar(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    eos_token_ids=None,
    seed: int | None = None,
) -> list[list[int]]:
    """Continue every prompt by up to `max_new_tokens` tokens; row b stops at its first EOS.

    Returns the new tokens of each row, the EOS that ended it left out (as block diffusion's `generate` does).
    `eos_token_ids` defaults to the model's generation config; `seed` makes sampling reproducible.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    eos_ids = model.sampling_config.eos_token_ids if eos_token_ids is None else eos_token_ids
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=model.device)
    # left padding: every row's last prompt token is in the last column
    ids, mask = left_pad(prompts, model.config.pad_token_id, model.device)  # (B, P) each
    B, P = ids.shape
    generator = torch.Generator(model.device).manual_seed(seed) if seed is not None else None

    cache = model.new_cache(B, P + max_new_tokens)
    hidden = model.encode(ids, cache, mask, return_hidden=True)  # (B, P, H)
    logits = model.head(hidden[:, -1])  # (B, V): only the last column predicts
    out: list[list[int]] = [[] for _ in prompts]
    rows = torch.arange(B, device=model.device)  # cache rows (= prompts) still generating
    for step in range(max_new_tokens):
        token = _next_tokens(logits, temperature, generator)  # (b,)
        finished = torch.isin(token, eos)
        for row, tok, done in zip(rows.tolist(), token.tolist(), finished.tolist()):
            if not done:
                out[row].append(tok)
        if step == max_new_tokens - 1 or finished.all():
            break
        if finished.any():
            rows, token = rows[~finished], token[~finished]
        logits = model.encode(token[:, None], cache, rows=rows)[:, -1]  # (b, V)
    return out
