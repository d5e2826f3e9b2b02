"""Scored prompts (engine/scoring.py's tensors) as OpenAI's legacy completions `logprobs` object, the shape
evaluation harnesses read:

    {"tokens": [...], "token_logprobs": [null, ...], "top_logprobs": [null, {...}, ...], "text_offset": [...]}

One entry per token: with `echo` the prompt's tokens (the first has no log-probability: nothing comes
before it), then, for max_tokens 1, the causal encoder's most likely next token. `tokens` holds each
token's own text (special tokens written out); `top_logprobs` the `logprobs` most likely tokens at that
position, keyed by their text; `text_offset` where each token's text begins in the choice's `text`.
"""

from __future__ import annotations

from dgemma.engine.scoring import PromptScores


def scored_choice(codec, prompt: list[int], prompt_text: str, scores: PromptScores, *, echo: bool,
                  next_token: bool, top: int) -> dict:
    """The `text` and `logprobs` of one choice of a scoring request (max_tokens 0 or 1)."""
    T = len(prompt)
    ids, logprobs, alternatives = [], [], []
    if echo:
        ids += prompt
        logprobs += [None] + scores.token_logprobs.tolist()
        alternatives += [None] + [_top(codec, scores, t, top) for t in range(T - 1)]
    if next_token:
        ids.append(int(scores.top_ids[T - 1, 0]))
        logprobs.append(float(scores.top_logprobs[T - 1, 0]))
        alternatives.append(_top(codec, scores, T - 1, top))
    # decoded in context: the next token's text is what it adds after the prompt (a space, say)
    texts = codec.token_texts(prompt + ids[-1:] if next_token else prompt)[0 if echo else T:]
    text = (prompt_text if echo else "") + "".join(texts[T:] if echo else texts)
    offsets, at = [], 0
    for piece in texts:
        offsets.append(at)
        at += len(piece)
    return {"text": text, "logprobs": {"tokens": [codec.piece(t) for t in ids], "token_logprobs": logprobs,
                                       "top_logprobs": alternatives, "text_offset": offsets}}


def _top(codec, scores: PromptScores, position: int, top: int) -> dict[str, float]:
    """The `top` most likely tokens at a position, by text (of two tokens with one text, the likelier)."""
    out: dict[str, float] = {}
    for token, logprob in zip(scores.top_ids[position, :top].tolist(), scores.top_logprobs[position, :top].tolist()):
        out.setdefault(codec.piece(token), logprob)
    return out
