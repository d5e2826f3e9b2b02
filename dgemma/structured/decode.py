"""Choosing a canvas under a token automaton: the most probable token string the automaton accepts.

DiffusionGemma writes a canvas of L tokens at once, so a constraint cannot mask one next token at a
time as left-to-right decoders do. Given the per-position distributions p_i of a canvas (the
sampler's softmax(logits / T), L x V) and the automaton state q0 carried in from the previous
canvas, `constrained_canvas` finds

    argmax over token strings t_1..t_L the automaton can read from q0:  sum_i log p_i(t_i)

by dynamic programming over (position, state) with back-pointers (Viterbi; DINGO, arXiv 2505.23061).
The answer may end inside the canvas: from an accepting state an EOS token leads to a virtual END
state that absorbs the rest of the canvas (scored by its best EOS-or-pad token there, the filler the
commit writes). EOS is allowed nowhere else, so an answer ends only where the language allows.

Budget: a state is kept at position i only if the answer can still end (distance to an accepting
state + the EOS) within the tokens the request has left. A canvas therefore never commits a
prefix that the token budget cannot complete, and every answer ends valid, as the most probable
valid answer that fits; only when no accepted string fits the budget at all is the best prefix
committed instead (the answer is then cut: finish reason "length").

Cost: tokens that move every state alike form one class (dgemma.structured.automaton), so each
position first takes the max of p over each class (one pass over V, as the sampler's own scan), then
the recursion runs over the class edges (E: states x classes allowed, far fewer than states x V).
The L steps of the recursion are sequential; each is a gather, an add and a scatter-max over E.

`constrained_sample` draws a string from the same product distribution restricted to the language
(forward filtering, backward sampling: the same recursion with log-sum-exp in place of max); the
denoising loop uses it for the positions a step accepts (see docs/model-api.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dgemma.sampling.sampler import inverse_cdf
from dgemma.structured.automaton import TokenAutomaton

ENDED = -1  # the state after an answer's EOS
_TINY = 1e-38  # probabilities below float32's normal range count as this (log ~ -87.5)


@dataclass
class CanvasChoice:
    tokens: torch.Tensor  # (L,) long: the answer's tokens, then its EOS and padding if it ended here
    state: int  # automaton state after the canvas, ENDED if the answer ended in it
    cut: bool = False  # no accepted string fits the budget: the tokens are the best prefix instead

    @property
    def ended(self) -> bool:
        return self.state == ENDED


def constrained_canvas(automaton: TokenAutomaton, probs: torch.Tensor, state: int, *, budget: int,
                       eos_token_ids, pad_token_id: int) -> CanvasChoice:
    """The most probable canvas the automaton accepts from `state`: probs (L, V) -> CanvasChoice.

    budget: tokens the request may still write, this canvas included (positions past it become pad).
    """
    if state == ENDED:
        raise ValueError("the answer already ended")
    plan = _Plan(automaton, probs, eos_token_ids, pad_token_id, budget)
    for within_budget in (True, False):
        score, back, end_from = plan.forward(state, within_budget, semiring="max")
        if torch.isfinite(score).any():
            break
    last = int(score.argmax())
    path = plan.backtrack(last, back, end_from)
    return plan.choice(state, path, cut=not within_budget)


def constrained_sample(automaton: TokenAutomaton, probs: torch.Tensor, state: int, *, budget: int,
                       eos_token_ids, pad_token_id: int, generator: torch.Generator | None) -> torch.Tensor:
    """A canvas (L,) drawn from prod_i p_i(t_i) restricted to strings the automaton accepts from `state`."""
    plan = _Plan(automaton, probs, eos_token_ids, pad_token_id, budget)
    for within_budget in (True, False):
        alphas, _, _ = plan.forward(state, within_budget, semiring="sum")
        if torch.isfinite(alphas[-1]).any():
            break
    path = plan.sample_back(alphas, generator)
    return plan.choice(state, path, cut=not within_budget, generator=generator).tokens


class _Plan:
    """One canvas's scores per (position, class), and the recursion over them."""

    def __init__(self, automaton: TokenAutomaton, probs: torch.Tensor, eos_token_ids, pad_token_id: int,
                 budget: int):
        a = automaton.on(probs.device)
        self.a, self.probs = a, probs
        L, V = probs.shape
        if V < a.vocab_size:
            raise ValueError(f"the distributions cover {V} tokens, the automaton's vocabulary {a.vocab_size}")
        self.L, self.n = L, max(0, min(L, budget))
        self.budget = budget
        self.Q, self.C = a.num_states, a.num_classes
        device = probs.device
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
        self.pad = pad_token_id
        self.fill = torch.cat([self.eos, torch.tensor([pad_token_id], device=device)]).unique()
        # the tokens an answer needs past an accepting state: its EOS; without EOS ids the answer ends
        # where the budget does, in an accepting state
        self.eos_cost = 1 if len(self.eos) else 0
        self._scores: dict[str, tuple] = {}

    def scores(self, semiring: str):
        """(per class (n, C), EOS (n,), filler (n,)) log scores: the best probability of each token set
        ("max") or its total probability ("sum"). Tokens allowed nowhere go to a dump column C."""
        if semiring not in self._scores:
            a, p = self.a, self.probs[: self.n, : self.a.vocab_size]
            classes = torch.where(a.token_class >= 0, a.token_class, self.C)
            out = p.new_zeros(self.n, self.C + 1)
            eos = p[:, self.eos] if len(self.eos) else p.new_zeros(self.n, 1)  # no EOS: never ends early
            if semiring == "max":
                out.scatter_reduce_(1, classes.expand(self.n, -1), p, "amax")
                eos, fill = eos.amax(-1), p[:, self.fill].amax(-1)
            else:
                out.index_add_(1, classes, p)
                eos, fill = eos.sum(-1), p[:, self.fill].sum(-1)
            scores = [x.clamp_min(_TINY).log() for x in (out[:, : self.C], eos, fill)]
            if not len(self.eos):
                scores[1] = torch.full_like(scores[1], float("-inf"))
            self._scores[semiring] = tuple(scores)
        return self._scores[semiring]

    def forward(self, state: int, within_budget: bool, *, semiring: str):
        """Scores after each position. semiring "max": (final scores (Q+1,), back-pointers (n, Q+1),
        END's origin (n,)); "sum": (log forward messages (n+1, Q+1), None, None). Index Q is END."""
        a, Q, device = self.a, self.Q, self.probs.device
        neg = torch.tensor(float("-inf"), device=device)
        W = torch.full((Q + 1,), float("-inf"), device=device)
        W[state] = 0.0
        edges = torch.arange(a.num_edges, device=device)
        maximise = semiring == "max"
        class_score, eos_score, fill_score = self.scores(semiring)
        backs, ends, alphas = [], [], [W]
        finals = torch.nonzero(a.final)[:, 0]
        for i in range(self.n):
            cand = W[a.edge_src] + class_score[i, a.edge_class]  # (E,)
            top = torch.full((Q + 1,), float("-inf"), device=device).scatter_reduce_(0, a.edge_dst, cand, "amax")
            into_end = torch.cat([W[finals] + eos_score[i], (W[Q] + fill_score[i])[None]])  # (F+1,)
            if maximise:
                new = top
                new[Q] = into_end.max()
                # the edge that won each state (no boolean indexing: that would wait for the device)
                winner = torch.where((cand == top[a.edge_dst]) & torch.isfinite(cand), edges, -1)
                back = torch.full((Q + 1,), -1, dtype=torch.long, device=device)
                back.scatter_reduce_(0, a.edge_dst, winner, "amax")
                backs.append(back)
                pick = into_end.argmax()
                ends.append(torch.where(pick < len(finals), finals[pick.clamp(max=len(finals) - 1)], -1))
            else:
                safe = torch.where(torch.isfinite(top), top, 0.0)
                total = torch.zeros(Q + 1, device=device).index_add_(0, a.edge_dst, (cand - safe[a.edge_dst]).exp())
                new = torch.where(total > 0, safe + total.log(), neg)
                new[Q] = into_end.logsumexp(0)
            if within_budget:  # the answer must still be able to end inside the budget
                left = self.budget - (i + 1)
                new[:Q] = torch.where(a.distance + self.eos_cost > left, neg, new[:Q])
            W = new
            alphas.append(W)
        if maximise:
            empty = torch.empty(0, Q + 1, dtype=torch.long, device=device)
            return W, torch.stack(backs) if backs else empty, torch.stack(ends) if ends else empty[:, 0]
        return torch.stack(alphas), None, None

    def backtrack(self, last: int, back: torch.Tensor, end_from: torch.Tensor) -> list[tuple[int, int]]:
        """[(kind, value)] per position: (0, class) inside the answer, (1, _) the EOS, (2, _) filler."""
        a, Q = self.a, self.Q
        back, end_from = back.tolist(), end_from.tolist()
        edge_src, edge_class = a.edge_src.tolist(), a.edge_class.tolist()
        path, q = [], last
        for i in range(self.n - 1, -1, -1):
            if q == Q:
                origin = end_from[i]
                path.append((2, 0) if origin < 0 else (1, 0))
                q = Q if origin < 0 else origin
            else:
                e = back[i][q]
                path.append((0, edge_class[e]))
                q = edge_src[e]
        path.reverse()
        self.last = last
        return path

    def sample_back(self, alphas: torch.Tensor, generator) -> list[tuple[int, int]]:
        """Backward sampling through the forward messages: the same path form as `backtrack`. Runs on
        the host: each position looks at the few edges into one state (the automaton's CSR by target)."""
        a, Q = self.a, self.Q
        mass, eos_mass, fill_mass = (x.double().cpu().numpy() for x in self.scores("sum"))
        alphas = alphas.double().cpu().numpy()
        u = torch.rand(self.n + 1, generator=generator, device=self.probs.device).tolist()
        host = a.on("cpu")
        finals = np.nonzero(host.final.numpy())[0]
        into_order, into_offsets = host.edges_into()
        src, cls = host.edge_src.numpy(), host.edge_class.numpy()
        q = _draw(alphas[self.n], u[self.n])
        self.last = q
        path = []
        for i in range(self.n - 1, -1, -1):
            W = alphas[i]
            if q == Q:  # came from END (filler) or from an accepting state (its EOS)
                k = _draw(np.append(W[finals] + eos_mass[i], W[Q] + fill_mass[i]), u[i])
                if k == len(finals):
                    path.append((2, 0))
                else:
                    path.append((1, 0))
                    q = int(finals[k])
            else:
                into = into_order[into_offsets[q]: into_offsets[q + 1]]
                e = into[_draw(W[src[into]] + mass[i, cls[into]], u[i])]
                path.append((0, int(cls[e])))
                q = int(src[e])
        path.reverse()
        return path

    def choice(self, state: int, path: list[tuple[int, int]], *, cut: bool, generator=None) -> CanvasChoice:
        """Tokens for a path: the best (or, with a generator, a sampled) token of each class, the best EOS."""
        a, device = self.a, self.probs.device
        tokens = torch.full((self.L,), self.pad, dtype=torch.long, device=device)
        offsets = a.class_offsets.tolist()
        u = torch.rand(self.n, generator=generator, device=device) if generator is not None else None
        for i, (kind, c) in enumerate(path):
            if kind == 0:  # only this class's tokens: the work is the class's size, not V
                members = a.class_order[offsets[c]: offsets[c + 1]]
                weights = self.probs[i, members]
                if u is None:
                    tokens[i] = members[weights.argmax()]
                else:
                    tokens[i] = members[inverse_cdf(weights[None].clamp_min(_TINY), u[i: i + 1])[0]]
            elif kind == 1:
                tokens[i] = self.eos[self.probs[i, self.eos].argmax()]
        end = ENDED if self.last == self.Q else self.last
        return CanvasChoice(tokens=tokens, state=end if self.n else state, cut=cut)


def _draw(log_weights: np.ndarray, u: float) -> int:
    """Index drawn with probability proportional to exp(log_weights), from the uniform u."""
    finite = np.isfinite(log_weights)
    w = np.where(finite, np.exp(log_weights - log_weights[finite].max()), 0.0)
    cdf = np.cumsum(w)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(w) - 1)
