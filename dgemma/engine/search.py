"""The engine's verifier search: the candidates of one prompt and which of them wins.

What the search does is written once in dgemma.generation.verify (rounds: re-noise what the verifier
rejects, keep the rest as a canvas template; candidates: best of n seeds, the accepted one with the
fewest decoder forwards wins). Here each candidate is an ordinary Request with a verifier; the engine
starts its next round when the verifier rejects its output (Engine._verify) and, once a candidate is
accepted, drops the siblings that already ran as many forwards (they can no longer win), so the winner
does not depend on how the candidates were batched.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgemma.engine.request import Request
from dgemma.generation.verify import candidate_seed, check_search, winner_key


@dataclass
class Search:
    candidates: list[Request]

    @classmethod
    def start(cls, prompt: list[int], sampling, *, seed: int, verifier, max_rounds: int, candidates: int = 1,
              fixed=None, fixed_tokens=None, want_drafts: bool = False, on_event=None) -> "Search":
        """The candidate requests of one prompt (not yet submitted): candidate j has seed candidate_seed(seed, j)."""
        check_search(max_rounds, candidates)
        search = cls([])
        search.candidates = [Request(prompt=list(prompt), sampling=sampling, seed=candidate_seed(seed, j), fixed=fixed,
                                     fixed_tokens=fixed_tokens, want_drafts=want_drafts, on_event=on_event,
                                     verifier=verifier, max_rounds=max_rounds, search=search, candidate=j)
                             for j in range(candidates)]
        return search

    @property
    def done(self) -> bool:
        return all(r.done for r in self.candidates)

    def _best_accepted(self) -> int | None:
        """The fewest forwards an accepted candidate needed so far, or None."""
        return min((r.state.forward_passes for r in self.candidates if r.state.verdict), default=None)

    def cannot_win(self, request: Request) -> bool:
        """A candidate still denoising that has run as many forwards as an accepted sibling will end with more."""
        best = self._best_accepted()
        return best is not None and not request.done and request.state.forward_passes >= best

    @property
    def winner(self) -> Request:
        finished = [r for r in self.candidates if r.state.verdict is not None] or self.candidates
        return min(finished, key=lambda r: winner_key(bool(r.state.verdict), len(r.state.rejected or ()),
                                                      r.state.forward_passes, r.candidate))

    def stats(self) -> dict:
        """accepted, rounds (the winner's), candidate (the winner's index), forwards (decoder forwards of
        every candidate, the search's cost), winner_forwards, rejected (the winner's last verdict)."""
        w = self.winner.state
        return {"accepted": bool(w.verdict), "rounds": w.round, "candidate": self.winner.candidate,
                "candidates": len(self.candidates),
                "forwards": sum(r.state.forward_passes for r in self.candidates),
                "winner_forwards": w.forward_passes, "rejected": list(w.rejected or ())}
