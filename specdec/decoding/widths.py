"""Draft widths that follow the load: each step, the draft length (`sd`) or window (`sjd`) that
maximises the tokens the rows are expected to commit per second of the step's passes (SmartSpec's
goodput rule). The rule, the pass cost and why it is on by default in exact mode only:
docs/decoders.md, "Widths that follow the load" (under "Exact mode").
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass(frozen=True)
class PassCost:
    """Seconds of one pass that feeds `tokens` image tokens in all (rows x width)."""

    fixed: float
    per_token: float

    def __call__(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _time_passes(runner, widths: Sequence[int], repeats: int = 10) -> List[float]:
    """The fastest of `repeats` passes of each of `widths` tokens over every row of runner's
    (empty) cache, the widths taking turns, after one untimed pass of each (a compiled runner's
    compile). The minimum and the turns, because a noisy machine only ever adds time, and drift
    then falls on every width alike: a median of three, one width after the other, put the cost per
    token anywhere in a range of 5x on a 2-core CPU, and with it the width rule's choice."""
    feeds = [(torch.zeros(runner.batch, w, dtype=torch.long, device=runner.device),
              torch.arange(w, device=runner.device)) for w in widths]
    best = [float("inf")] * len(widths)
    for i in range(repeats + 1):
        for j, (tokens, positions) in enumerate(feeds):
            _sync(runner.device)
            start = time.perf_counter()
            runner.forward(tokens, positions)
            _sync(runner.device)
            if i:
                best[j] = min(best[j], time.perf_counter() - start)
    return best


def measure_pass_cost(runner, widest: int) -> PassCost:
    """`runner`'s `PassCost`, timed on its own cache at widths 1 and `widest` (then emptied, its
    pass counters reset) and kept on the model for the next engine of the same shape."""
    from specdec.decoding.compiled import CompiledRunner
    from specdec.numerics import batch_invariant_enabled

    key = (runner.batch, widest, runner.backend, isinstance(runner, CompiledRunner), batch_invariant_enabled(),
           str(runner.device))
    kept = runner.model.__dict__.setdefault("_specdec_pass_costs", {})
    if key not in kept:
        one, wide = _time_passes(runner, (1, widest))
        per_token = max(0.0, (wide - one) / (runner.batch * max(widest - 1, 1)))
        kept[key] = PassCost(max(0.0, one - per_token * runner.batch), per_token)
        runner.reset()
    return kept[key]


def expected_commits(acceptance: Sequence[float], n: int) -> float:
    """Tokens a row commits in a round of n drafts: the kept prefix and the correction or bonus
    token, with acceptance[j] the chance that draft j is kept given the earlier ones were."""
    total, reach = 1.0, 1.0
    for j in range(n):
        reach *= acceptance[j]
        total += reach
    return total


class Widths:
    """The width rule of one engine: `most` drafts at most, the target's `PassCost`, and the
    drafter's (per draft, a pass of one token per row; None: drafts cost nothing apart)."""

    def __init__(self, most: int, target: PassCost, drafter: Optional[PassCost] = None, *, all_or_none: bool = False):
        """`all_or_none`: the choice is `most` or 0 (`sjd`: a Jacobi window's later guesses ripen
        over iterations, so figures measured at the full window say nothing of a narrower one)."""
        self.most, self.target, self.drafter = most, target, drafter
        self.widths = (0, most) if all_or_none else tuple(range(most + 1))
        self.reached = [2] * most      # (a prior: one kept, one not, at every offset)
        self.kept = [1] * most
        self._chosen: dict = {}        # rows -> width, until the next observation

    @property
    def acceptance(self) -> List[float]:
        return [k / r for k, r in zip(self.kept, self.reached)]

    def observe(self, accept: Sequence[Sequence[bool]], judged: Sequence[int]) -> None:
        """One round's judgement: row b's first judged[b] entries of accept[b]."""
        self._chosen = {}
        for row, n in zip(accept, judged):
            for j in range(min(n, self.most)):
                self.reached[j] += 1
                if not row[j]:
                    break
                self.kept[j] += 1

    def choose(self, rows: int) -> int:
        """The width (drafts per row, 0: a plain AR step) with the most expected commits per second
        over `rows` rows, fixed until the next observation (AR steps observe none: their run decides once)."""
        if rows not in self._chosen:
            acceptance = self.acceptance

            def goodput(n: int) -> float:
                seconds = self.target(rows * (n + 1)) + (n * self.drafter(rows) if self.drafter else 0.0)
                return expected_commits(acceptance, n) / max(seconds, 1e-12)
            self._chosen[rows] = max(self.widths, key=goodput)
        return self._chosen[rows]


def widths_for(engine, most: int, target, drafter=None, *, all_or_none: bool = False) -> Optional[Widths]:
    """The `Widths` of `engine`'s policy (`drafter`: the drafter model's runner, whose passes a draft
    costs); None where the run keeps its widths fixed (`RunSettings.adapts_width`) or `most` < 1."""
    if not engine.run.adapts_width or most < 1:
        return None
    return Widths(most, measure_pass_cost(target, most + 1),
                  None if drafter is None else measure_pass_cost(drafter, 1 + 1), all_or_none=all_or_none)


__all__ = ["PassCost", "Widths", "expected_commits", "measure_pass_cost", "widths_for"]
