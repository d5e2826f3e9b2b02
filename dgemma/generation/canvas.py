"""What generated tokens mean, written once for the plain loop (diffusion.py), the engine and AR decoding.

  * prompts of different lengths are left-padded, the padding masked out;
  * a committed canvas holds pad after each row's first EOS (the EOS itself stays);
  * the output is the committed tokens before the first EOS, cut at max_new_tokens;
  * max_new_tokens is made in whole canvases: ceil(max_new_tokens / L) of them, each taking L cache positions;
  * a canvas template (tokens forced into the output) is sliced canvas by canvas.
"""

from __future__ import annotations

import math

import torch


def canvases_for(max_new_tokens: int, canvas_length: int) -> int:
    """Canvases that cover max_new_tokens (the last one may be cut)."""
    return math.ceil(max_new_tokens / canvas_length)


def positions_needed(prompt_len: int, max_new_tokens: int, canvas_length: int) -> int:
    """Cache positions a request takes: its prompt, then whole canvases until max_new_tokens fit."""
    return prompt_len + canvases_for(max_new_tokens, canvas_length) * canvas_length


def most_new_tokens(prompt_len: int, max_length: int, canvas_length: int) -> int:
    """The largest max_new_tokens whose whole canvases fit after the prompt in max_length positions (the
    inverse of positions_needed; 0 when not even one canvas fits)."""
    return max(max_length - prompt_len, 0) // canvas_length * canvas_length


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths -> input_ids (B, P) long, attention_mask (B, P) bool (False = padding)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = True
    return input_ids.to(device), attention_mask.to(device)


def pad_after_eos(argmax: torch.Tensor, eos_ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The canvas as it is committed: argmax (B, L) -> (tokens (B, L) with pad strictly after each row's
    first EOS, has_eos (B,) bool)."""
    is_eos = torch.isin(argmax, eos_ids)
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # an EOS strictly before this position
    return argmax.masked_fill(after_eos, pad_id), is_eos.any(-1)


def pad_after_eos_host(tokens: list[int], eos_ids, pad_id: int) -> list[int]:
    """`pad_after_eos` for one row on the host: the tokens with pad strictly after the first EOS."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1] + [pad_id] * (len(tokens) - i - 1)
    return list(tokens)


def columns_left(max_new_tokens: int, canvas_index: int, canvas_length: int) -> int:
    """How many columns of canvas `canvas_index` fall within max_new_tokens (the rest is cut off); the
    canvas is the last one when this is at most canvas_length."""
    return max_new_tokens - canvas_index * canvas_length


def cut_at_eos(row_tokens: list[int], eos_ids) -> tuple[list[int], bool]:
    """One row's committed tokens -> (the tokens before its first EOS, whether it had an EOS)."""
    for i, token in enumerate(row_tokens):
        if token in eos_ids:
            return row_tokens[:i], True
    return row_tokens, False


def template_slice(fixed: torch.Tensor, tokens: torch.Tensor, canvas_index: int, canvas_length: int):
    """A template's part for one canvas: fixed (B, W) bool and tokens (B, W) -> both (B, L), or
    (None, None) when nothing is fixed there. W may end inside the canvas: the rest is free."""
    start = canvas_index * canvas_length
    fixed = fixed[:, start : start + canvas_length]
    if not bool(fixed.any()):
        return None, None
    missing = canvas_length - fixed.shape[1]
    fixed = torch.nn.functional.pad(fixed, (0, missing), value=False)
    tokens = torch.nn.functional.pad(tokens[:, start : start + canvas_length], (0, missing), value=0)
    return fixed, tokens
