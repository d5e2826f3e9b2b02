"""Scoring prompts: every prompt token's log-probability under the causal encoder, with the most likely
alternatives at each position, for evaluation harnesses (the log-likelihood of a continuation).

DiffusionGemma's encoder is causal and trained with a next-token loss (it reads committed text left to
right), so one encoder pass over a prompt gives log p(token t | tokens before t) at every position and,
at the last one, the distribution of the token after the prompt.

Scoring requests hold cache rows as generating ones do. Those admitted in one engine step form a
`ScoringBatch`, which runs one chunk of at most `chunk_tokens` tokens per engine step, so denoising
steps go on between the chunks of a long prompt:
  1. prompts that share a long prefix (the choices of one question, the same few-shot examples) form
     clusters (`plan_clusters`); each cluster's shared prefix is encoded once, in its first row, all
     clusters batched;
  2. that row is copied into the cluster's other rows (`KVCache.copy_row`);
  3. every prompt's own rest is encoded on top of its row, all rows batched.
Rows in a batched pass are right-padded: each prompt keeps positions 0, 1, ..., exactly as alone.
Only hidden states leave the encoder; the LM head runs on a few positions at a time and keeps each
position's target log-probability and top k, so no (T, V) logits buffer is ever made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgemma.device_sync import to_device
from dgemma.engine.request import ScoreRequest

# A cluster must save at least this many encoded tokens; below that a row copy is not worth it.
MIN_SHARED_TOKENS = 8
# Encoder tokens per chunk (all rows together): bounds a chunk's time beside the denoising steps and
# its activations; the LM head then runs over HEAD_CHUNK_ELEMENTS // vocab positions at a time.
SCORE_CHUNK_TOKENS = 2048
HEAD_CHUNK_ELEMENTS = 1 << 24


@dataclass
class PromptScores:
    """A prompt of T tokens, scored. Row t of `top_*` is the distribution at position t, which predicts
    token t + 1; its last row is the distribution of the token after the prompt."""

    token_logprobs: torch.Tensor  # (T - 1,) fp32: log p(token t | tokens < t) for t = 1 .. T - 1
    top_ids: torch.Tensor  # (T, k) long, most likely first
    top_logprobs: torch.Tensor  # (T, k) fp32


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def plan_clusters(prompts: list[list[int]], min_shared: int = MIN_SHARED_TOKENS) -> list[tuple[list[int], int]]:
    """Group prompt indices into clusters, each with the number Q of leading tokens encoded once for all
    of its members (0 for a prompt alone).

    Q is one less than the members' common prefix, so that each member encodes at least one token of its
    own, and the position where they part predicts each member's own next token. Prompts are visited in
    sorted order (sharers are neighbours); the next one joins the current cluster when that encodes at
    least `min_shared` fewer tokens than starting a new cluster with it.
    """
    def cost(common: int, lengths: list[int]) -> int:  # tokens encoded for one cluster
        q = max(common - 1, 0) if len(lengths) > 1 else 0
        return q + sum(n - q for n in lengths)

    clusters: list[tuple[list[int], int]] = []
    members: list[int] = []
    common = 0
    for i in sorted(range(len(prompts)), key=lambda i: prompts[i]):
        if members:
            joined = min(common, _common_prefix(prompts[members[-1]], prompts[i]))
            lengths = [len(prompts[m]) for m in members]
            saving = cost(common, lengths) + len(prompts[i]) - cost(joined, lengths + [len(prompts[i])])
            if saving >= min_shared:
                members.append(i)
                common = joined
                continue
            clusters.append((members, max(common - 1, 0) if len(members) > 1 else 0))
        members, common = [i], len(prompts[i])
    if members:
        clusters.append((members, max(common - 1, 0) if len(members) > 1 else 0))
    return clusters


@torch.no_grad()
def score_positions(model, hidden: torch.Tensor, targets: torch.Tensor, k: int):
    """Hidden states (M, H) and the token each position predicts (M,), -1 for none -> the targets'
    log-probabilities (M,) (NaN where none), and the top k (M, k) ids and log-probabilities.

    A target and the top k come from one log-softmax buffer, so when the target is the most likely
    token its log-probability equals the first top value exactly (harnesses test greediness by ==).
    """
    M = hidden.shape[0]
    target_lp = torch.full((M,), float("nan"))
    top_ids = torch.zeros(M, k, dtype=torch.long)
    top_lp = torch.zeros(M, k)
    step = max(1, HEAD_CHUNK_ELEMENTS // model.config.vocab_size)
    for a in range(0, M, step):
        logp = model.head(hidden[a : a + step])  # (m, V) fp32
        logp = logp.sub_(logp.logsumexp(dim=-1, keepdim=True))  # log-softmax, in place
        t = targets[a : a + step].to(logp.device)
        picked = logp.gather(1, t.clamp(min=0)[:, None])[:, 0]
        target_lp[a : a + step] = torch.where(t >= 0, picked, float("nan")).cpu()
        values, ids = logp.topk(k, dim=-1)
        top_ids[a : a + step], top_lp[a : a + step] = ids.cpu(), values.cpu()
    return target_lp, top_ids, top_lp


class ScoringBatch:
    """Scoring requests admitted together, each in its own cache row; `advance` runs one chunk.

    A prompt whose start is in the engine's prefix cache takes it (entries and the encoder's hidden
    states, scored here at once) and encodes the rest alone; the others share prefixes as above."""

    def __init__(self, requests: list[ScoreRequest], chunk_tokens: int, runner):
        self.requests = requests
        self.chunk_tokens = chunk_tokens
        self.runner = runner
        self.k = max(1, max(r.top for r in requests))
        self.scores = {id(r): PromptScores(torch.full((len(r.prompt) - 1,), float("nan")),
                                           torch.zeros(len(r.prompt), self.k, dtype=torch.long),
                                           torch.zeros(len(r.prompt), self.k))
                       for r in requests}
        cached = []
        for r in requests:  # at least the last token is encoded: its row must hold something of its own
            r.state.cached_tokens, _, hidden = runner.start_row(r.state.row, r.prompt, None, r.adapter, len(r.prompt) - 1,
                                                          want_hidden=True)
            if r.cached_tokens:
                cached.append(r)
                self._score_cached(r, hidden)
        rest = [r for r in requests if not r.cached_tokens]
        clusters = plan_clusters([r.prompt for r in rest], MIN_SHARED_TOKENS)
        self.clusters = [([rest[i] for i in members], q) for members, q in clusters]
        self.clusters += [([r], 0) for r in cached]
        self.start = {id(r): q for members, q in self.clusters for r in members}  # where a row's own pass begins
        self.start.update({id(r): r.cached_tokens for r in cached})
        self.phase = "prefix" if any(q > 0 for _, q in self.clusters) else "own"
        self.offset = 0  # positions done in this phase (past each row's start)
        self.encoded_tokens = 0  # real tokens through the encoder, for benchmarks

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def cancelled(self) -> bool:
        return all(r.state.cancel_requested for r in self.requests)

    def _score_cached(self, r: ScoreRequest, hidden: torch.Tensor):
        """Positions 0 .. n - 1 of a prompt from the cached hidden states (n, H)."""
        n = hidden.shape[0]
        targets = torch.tensor(r.prompt[1 : n + 1])
        target_lp, top_ids, top_lp = score_positions(self.runner.model, hidden, targets, self.k)
        s = self.scores[id(r)]
        s.top_ids[:n], s.top_logprobs[:n], s.token_logprobs[:n] = top_ids, top_lp, target_lp

    def advance(self):
        """One chunk of the current phase; the copy of the shared prefixes rides with the last prefix chunk."""
        if self.phase == "prefix":
            # spans: (request whose row and tokens these are, first position, end, who shares the results)
            spans = [(members[0], 0, q, members) for members, q in self.clusters if q > 0]
        else:
            spans = [(r, self.start[id(r)], len(r.prompt), [r]) for r in self.requests]
        spans = [s for s in spans if s[1] + self.offset < s[2]]
        width = max(1, self.chunk_tokens // len(spans))
        if self.phase == "prefix":
            # no padding in this phase: these rows go on, and padding written into a row would take the
            # place of real entries in a sliding layer's ring; so every row takes the same count
            width = min(width, min(end - start - self.offset for _, start, end, _ in spans))
        else:
            # padding ends a row (nothing follows it), but must stay inside the row's positions
            width = min(width, self.runner.cache.max_length - max(start + self.offset for _, start, _, _ in spans))
        self._encode(spans, width)
        self.offset += width
        if all(s[1] + self.offset >= s[2] for s in spans):
            if self.phase == "prefix":
                for members, q in self.clusters:
                    if q > 0 and len(members) > 1:
                        self.runner.copy_row(members[0].state.row, [r.state.row for r in members[1:]])
                self.phase, self.offset = "own", 0
            else:
                self.phase = "done"
                for r in self.requests:
                    r.state.scores = self.scores[id(r)]

    def _encode(self, spans, width: int):
        """Encode positions [start + offset, +width) of every span in its row, right-padded."""
        pieces, positions = [], []
        for r, start, end, _ in spans:
            a = start + self.offset
            pieces.append(r.prompt[a : min(end, a + width)])
            positions.append(range(a, a + len(pieces[-1])))
        c = max(len(p) for p in pieces)
        ids = torch.zeros(len(pieces), c, dtype=torch.long)
        valid = torch.zeros(len(pieces), c, dtype=torch.bool)
        targets = torch.full((len(pieces), c), -1, dtype=torch.long)
        for i, ((r, *_), piece, span) in enumerate(zip(spans, pieces, positions)):
            ids[i, : len(piece)] = torch.tensor(piece)
            valid[i, : len(piece)] = True
            # position j predicts token j + 1; the last position predicts the unknown token after the prompt
            targets[i, : len(piece)] = torch.tensor([r.prompt[j + 1] if j + 1 < len(r.prompt) else -1 for j in span])
        model = self.runner.model
        device = model.device
        rows = [r.state.row for r, *_ in spans]
        hidden = self.runner.encode_rows(ids.to(device), rows, valid.to(device), counts=[len(p) for p in pieces],
                                         tokens=pieces)  # (n, c, H)
        # the positions holding tokens, found on the host (a boolean mask on the device would wait for it)
        filled = to_device(valid.view(-1).nonzero()[:, 0].tolist(), torch.long, device)
        target_lp, top_ids, top_lp = score_positions(model, hidden.flatten(0, 1)[filled], targets[valid], self.k)
        self.encoded_tokens += int(valid.sum())
        at = 0
        for (_, _, _, sharers), span in zip(spans, positions):
            n = len(span)
            lo, hi = span.start, span.stop
            for r in sharers:
                s = self.scores[id(r)]
                s.top_ids[lo:hi], s.top_logprobs[lo:hi] = top_ids[at : at + n], top_lp[at : at + n]
                last = min(hi, len(r.prompt) - 1)  # no target past the prompt
                s.token_logprobs[lo:last] = target_lp[at : at + last - lo]
            at += n
