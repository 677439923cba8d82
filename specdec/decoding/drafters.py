"""Drafters of raster speculation (`sd`, `lantern`, SSD's first row): what proposes the next
tokens after each image's committed prefix, behind one interface, `Drafter`:

- `ModelDrafter`: a second ARImageModel on the same grid and vocabulary, sampled serially, with a
  runner and cache of its own;
- `HeadsDrafter`: SSD's horizontal heads on the target (Medusa-style: all n drafts from the
  target's last committed hidden state in one call, no drafter model).
"""
from __future__ import annotations

import abc
from typing import List, Sequence, Tuple

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.blocks import gather_rows, padded_block
from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine, Lengths
from specdec.decoding.runner import ModelRunner
from specdec.models.protocol import cfg_rows


class Drafter(abc.ABC):
    """What raster speculation asks of a drafter; each round: `draft`, `accepted`."""

    #: whether `draft`'s hidden states are what it drafts from (SSD's heads)
    reads_hidden = False

    def start(self, engine: Engine, target: ModelRunner) -> None:
        """Begin a batch: `target` is the batch's target runner."""

    def start_rows(self, rows: List[int], conditions) -> None:
        """Rows `rows` start the images of `conditions` (one each)."""

    @abc.abstractmethod
    def draft(self, x: torch.Tensor, c: Lengths, n: int, going: Sequence[bool],
              hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Drafts [B, n] and their distributions q [B, n, V] after the committed lengths c; images
        not `going` (finished) draw nothing from their streams. hidden [rows, dim]: the target's
        state that gave each image's last committed token."""

    def accepted(self, c: Lengths, a: torch.Tensor, a_host: List[int], n: int) -> None:
        """a [B] (a_host on the host) of each image's n drafts were kept after c."""

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s state to row `dst` (`RowPolicy.move`)."""


class ModelDrafter(Drafter):
    def __init__(self, model):
        self.model = model

    def start(self, engine, target):
        self.engine = engine
        self.runner = engine.runner(self.model, role="drafter")
        # committed tokens seen (a row without an image: all of them)
        self.fed = Lengths([self.runner.H * self.runner.W] * engine.batch, self.runner.device)

    def start_rows(self, rows, conditions):
        self.engine.prefill_rows(self.runner, rows, conditions)
        self.fed.reset_rows(rows, 0)

    def draft(self, x, c, n, going, hidden):
        r, streams = self.runner, self.engine.streams
        HW = x.shape[1]
        # Catch up on the committed tokens the drafter has not seen (1 or 2 per row). The width of
        # that pass is a shape: it comes from the host copies of c and fed, not from a read-back.
        m = max([1] + [cb - fb for cb, fb in zip(c.host, self.fed.host)])
        todo = (c.device - self.fed.device).clamp_min(0)
        todo = torch.where(todo == 0, torch.ones_like(todo), todo)   # finished rows: re-feed the last
        pos = padded_block(c.device - todo, todo, m)
        o = gather_rows(r.forward(x.gather(1, pos), pos), todo - 1)
        self.fed.device = torch.maximum(self.fed.device, c.device)
        self.fed.host = [max(fb, cb) for fb, cb in zip(self.fed.host, c.host)]
        work = x.clone()
        tokens, qs = [], []
        once = [1 if g else 0 for g in going]
        for i in range(n):
            q = r.probs(o)[:, 0]
            p = (c.device + i).clamp(max=HW - 1)       # past the grid: re-feed the last slot
            d = draw(q, streams, r.backend, counts=once, positions=p)
            tokens.append(d)
            qs.append(q)
            if i + 1 < n:
                inside = (c.device + i) < HW
                # Rows past the grid write their slot's own token back (a fixed-shape write).
                work.scatter_(1, p[:, None], torch.where(inside, d, work.gather(1, p[:, None])[:, 0])[:, None])
                o = r.forward(work.gather(1, p[:, None]), p[:, None])
        return torch.stack(tokens, 1), torch.stack(qs, 1)

    def move(self, src, dst):
        self.fed.move(src, dst, self.runner.H * self.runner.W)

    def accepted(self, c, a, a_host, n):
        # The drafter fed its own drafts d_0..d_{n-2}: those that were kept are already correct.
        self.fed.device = c.device + a.clamp(max=n - 1)
        self.fed.host = [cb + min(ab, n - 1) for cb, ab in zip(c.host, a_host)]


class HeadsDrafter(Drafter):
    """Drafts up to len(heads.horizontal) tokens per row from [h_{c-1} ; e(x_{c-1})] in one call."""

    reads_hidden = True

    def __init__(self, heads):
        self.heads = heads

    def start(self, engine, target):
        self.engine, self.target = engine, target

    def draft(self, x, c, n, going, hidden):
        t = self.target
        last = x.gather(1, (c.device - 1).clamp_min(0)[:, None])[:, 0]
        drafting = [b for b, g in enumerate(going) if g] or None      # (the rows done draft nothing)
        if self.engine.rows is not None:     # (a drafter pass of each row drafting)
            self.engine.rows.credit(drafting or [], "drafter", 1, 0, 0)
        q = _heads.draft(t, self.heads, "horizontal", range(1, n + 1), hidden,
                         cfg_rows(last, hidden.shape[0] // last.shape[0]), drafting)   # q [B, n, V]
        B, _, V = q.shape
        positions = (c.device[:, None] + torch.arange(n, device=q.device)).clamp(max=x.shape[1] - 1)
        d = draw(q.reshape(-1, V), self.engine.streams, t.backend, counts=[n if g else 0 for g in going],
                 positions=positions)
        return d.view(B, n), q


__all__ = ["Drafter", "HeadsDrafter", "ModelDrafter"]
