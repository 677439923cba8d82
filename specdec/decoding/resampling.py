"""MuLo-SD's step 6: the rejected region R_X of an image resampled with the target, pass by pass.

An image's resampling (`island_plan`: `specdec.decoding.mulo`, step 6) is a `ResamplePlan` worked
out on the host from its judgement alone (R_X and its island labels), so the passes read nothing
back. Its first position t0 is drawn from the verification outputs
(`draw_first`); each later pass feeds the positions resolved last (writing their keys and values)
and the tokens just before the positions it resolves. `resample_step` makes one pass of every
plan, in as few shared passes as the rows' blocks allow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from specdec import masks
from specdec.decoding.engine import Engine
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.uploads import to_device


def island_schedule(resample: list, islands: list) -> list:
    """v2's passes from R_X (host bools over the grid) and its island labels (host ints): pass m
    resolves the m-th position (raster order) of every island longer than m, in label order."""
    by_island = {}
    for t, r in enumerate(resample):
        if r:
            by_island.setdefault(islands[t], []).append(t)
    order = [by_island[label] for label in sorted(by_island)]
    depth = max(map(len, order), default=0)
    return [[island[m] for island in order if m < len(island)] for m in range(depth)]


@dataclass
class ResamplePlan:
    """One image's resampling after its first position `t0`: `steps[m]`, the positions pass m
    resolves (`m`: the next); `resolved`, host bools over the grid; `last`, resolved last (keys not
    yet written)."""

    t0: int
    steps: List[List[int]]
    resolved: List[bool]
    last: List[int]
    m: int = 0

    @property
    def done(self) -> bool:
        return self.m >= len(self.steps)

    def block(self) -> Tuple[List[int], List[int], List[bool]]:
        """This pass: (positions it resolves, the slots it feeds, which of those are resolved)."""
        now = self.steps[self.m]
        block = sorted(set(self.last) | {u - 1 for u in now})
        return now, block, [self.resolved[t] for t in block]

    def advance(self) -> None:
        now = self.steps[self.m]
        for u in now:
            self.resolved[u] = True
        self.last, self.m = now, self.m + 1


def island_plan(resample: List[bool], islands: List[int], most: Optional[int] = None) -> Optional[ResamplePlan]:
    """v2: every island of R_X one position per pass (`most`: at most that many islands a pass, a
    step of more split into passes of `most`, islands in label order); None when R_X is empty.
    v1 (raster order, one position per pass) is R_X as one island: `islands` all 0."""
    if True not in resample:
        return None
    t0 = resample.index(True)                   # the first rejection: R_X starts there
    sched = island_schedule(resample, islands)
    steps = [now for now in [[u for u in sched[0] if u != t0]] + sched[1:] if now]
    if most is not None:
        steps = [now[i:i + most] for now in steps for i in range(0, len(now), most)]
    resolved = [not r for r in resample]
    resolved[t0] = True
    return ResamplePlan(t0, steps, resolved, [t0])


def draw_first(engine: Engine, runner: ModelRunner, x: torch.Tensor, ver: Outputs, rows: List[int],
               plans: List[Optional[ResamplePlan]]) -> None:
    """Each plan's first position t0 drawn from the verification outputs `ver` (row i: batch row
    rows[i], output t: the distribution of position t) into x [B, H*W], from its row's stream."""
    picks = [(i, b, plan.t0) for i, (b, plan) in enumerate(zip(rows, plans)) if plan is not None]
    if picks:
        ii, tt = to_device([[i for i, _, _ in picks], [t for _, _, t in picks]], ver.cond.device, torch.long)
        probs = runner.probs(ver.map(lambda t: t[ii, tt][None]))[0]
        engine.redraw(x, [(b, t) for _, b, t in picks], probs)


def _resample_pass(engine: Engine, runner: ModelRunner, x, work: dict, *, tree: bool, end: int) -> None:
    """One shared pass of the images `work` holds (b -> `ResamplePlan.block()`; the others ride
    along); `tree`: a block holds another island's unresolved token, which a tree mask hides."""
    B, dev = x.shape[0], x.device
    N = max(len(block) for _, block, _ in work.values())
    pos = to_device([work[b][1] + [end - 1] * (N - len(work[b][1])) if b in work else [end - 1] * N
                     for b in range(B)], dev, torch.long)
    mask = None
    if tree:
        # Another island's unresolved token is seen by its own query only; riders see themselves.
        dense = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
        for b, (_, _, trusted) in work.items():
            dense[b] |= torch.tensor(trusted, dtype=torch.bool)[None, :]
        mask = masks.pack(to_device(dense, dev))
    out = runner.forward(x.gather(1, pos), pos, tree_mask=mask)
    if mask is not None:
        stale = torch.zeros(B, N, dtype=torch.bool)
        for b, (_, _, trusted) in work.items():
            stale[b, :len(trusted)] = torch.tensor([not ok for ok in trusted])
        runner.invalidate_where(pos, to_device(stale, dev))
    picks = [(b, block.index(u - 1), u) for b, (now, block, _) in work.items() for u in now]
    rr, cc = to_device([[b for b, _, _ in picks], [c for _, c, _ in picks]], dev, torch.long)
    probs = runner.probs(out.map(lambda t: t[rr, cc][None]))[0]
    engine.redraw(x, [(b, t) for b, _, t in picks], probs)


def resample_step(engine: Engine, runner: ModelRunner, x: torch.Tensor, plans: Dict[int, ResamplePlan],
                  end: int) -> List[Tuple[List[int], int]]:
    """The next pass of every plan (batch row -> plan, not done) into x [B, H*W]; returns each
    pass made as (its rows, its width).

    A pass has one width and one attention path for all its rows. Rows whose block is all resolved
    take the in-place path (attention over the cache alone, at any width); rows with another
    island's unresolved token need a tree mask, whose attention also reads the block, so they share
    a pass only with rows of the same block width (a wider block would change that reduction's
    length, and so the logits' last bit). A row not in a pass rides along at slot end - 1, seen only
    by a query there, whose output (past the block) nothing reads."""
    work = {b: plans[b].block() for b in sorted(plans)}
    groups: Dict[Optional[int], List[int]] = {}
    for b, (_, block, trusted) in work.items():
        groups.setdefault(None if all(trusted) else len(block), []).append(b)
    made = []
    for key in sorted(groups, key=lambda k: -1 if k is None else k):
        rows = groups[key]
        _resample_pass(engine, runner, x, {b: work[b] for b in rows}, tree=key is not None, end=end)
        made.append((rows, max(len(work[b][1]) for b in rows)))
    for b in work:
        plans[b].advance()
    return made


__all__ = ["ResamplePlan", "draw_first", "island_plan", "island_schedule", "resample_step"]
