"""MuLo-SD's rows (`MuloRows`): the scheduler's policy for `mulo` (specdec.decoding.mulo)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from specdec.decoding import upsample as _up
from specdec.decoding.ar import ARRows
from specdec.decoding.engine import Engine
from specdec.decoding.resampling import ResamplePlan, draw_first, island_plan, resample_step
from specdec.decoding.runner import Outputs, count_pass
from specdec.decoding.policy import RowPolicy, move_rows
from specdec.decoding.scheduler import join_conditions
from specdec.decoding.uploads import to_device
from specdec.decoding.zipar import ZipARRows
from specdec.models.conditions import pad_with_first


@dataclass
class MuloStats:
    """MuLo-SD's own figures, one entry per image (`DecodeStats.method_stats`)."""

    num_islands: List[int]              #: islands of R_X
    resampled: List[int]                #: positions of R_X (resampled by the target)
    islands: List[torch.Tensor]         #: int32 [H, W] island labels (-1 outside R_X)
    low_res: List[torch.Tensor]         #: int64 [h, w] low-resolution drafts


#: a row's phase in `MuloRows` ("idle": no image, or its image is done)
IDLE, DRAFT, RESAMPLE, AR = "idle", "draft", "resample", "ar"


class MuloRows(RowPolicy):
    """MuLo-SD over the scheduler's rows, each row in its own phase (`phase[b]`):

    - "draft": its low-resolution draft, one step of the drafting policy (`ARRows` serial,
      `ZipARRows` v2) on the drafter's runner per scheduler step, the drafting rows in one pass;
    - the step its draft completes: up-sampled, its target prefill, one verification pass shared
      with the rows completing theirs (on a runner of those rows alone when others are in other
      phases: `ModelRunner.apart`), the judgement (one host read) and the first resampled token
      (`_verify`); then "resample", or done;
    - "resample": the next pass of its `ResamplePlan` per step, the rows' passes shared
      (`resampling.resample_step`);
    - "ar": at a share of one token per pass, plain AR steps on the target (`ARRows`), after the
      preview a two-stage model is conditioned on.

    Each row's passes are credited to it alone (`Scheduler.credit`): an image's pass counts are
    those of its decode alone, whatever its neighbours are doing (its tokens fed count the width
    of the passes it took part in, padding included)."""

    def __init__(self, engine: Engine, target, drafter, *, tokenizer=None, upsampler=None, neighbors=None,
                 options):
        """`options`: the method's `mulo.MuloOptions`."""
        super().__init__(engine)
        self.target, self.tokenizer, self.upsampler = target, tokenizer, upsampler
        self.neighbors, self.o = neighbors, options
        self.delta = options.delta if neighbors is not None else None
        # The preview is the target model's own output: its passes are target passes (role
        # "preview"), its tokens committed tokens, its grids the result's `preview`.
        self.previewing = options.draft == "preview"
        self.draft_role = "preview" if self.previewing else "drafter"
        self.drunner = engine.runner(drafter, options.draft_sampling, role=self.draft_role)
        self.runner = engine.runner(target)
        B, self.HW = engine.batch, self.runner.H * self.runner.W
        # A share of one token per pass leaves nothing to verify a draft with: plain AR, drafting
        # nothing (a two-stage model still writes the preview its target stage is conditioned on).
        self.plain = engine.run.token_share == 1
        self.ar = ARRows(engine, self.runner) if self.plain else None
        self.drafting = None
        if self.previewing or not self.plain:
            self.drafting = (ARRows(engine, self.drunner) if options.drafting == "serial"
                             else ZipARRows(engine, self.drunner, options.window))
        self.x = torch.zeros(B, self.HW, dtype=torch.long, device=self.runner.device)
        self.tokens = self.ar.tokens if self.plain else self.x
        self.phase = [IDLE] * B
        self.conditions: List[object] = [None] * B        #: each row's condition (a batch of one)
        self.plans: Dict[int, ResamplePlan] = {}          #: the resampling rows' plans
        self.figures: List[Optional[tuple]] = [None] * B  #: (islands, resampled, labels, low-res draft)

    def start(self, rows, conditions):
        for i, b in enumerate(rows):
            self.conditions[b] = conditions[i:i + 1]
            self.phase[b] = DRAFT if self.drafting is not None else AR
        if self.drafting is None:
            self.ar.start(rows, conditions)
            for b in rows:
                self.figures[b] = self._no_islands(torch.zeros(0, dtype=torch.long))
        else:
            self.drafting.start(rows, conditions)

    def move(self, src, dst):
        move_rows(self.engine.batch, src, dst, self.x)
        for rows in (self.drafting, self.ar):
            if rows is not None:
                rows.move(src, dst)
        for values in (self.phase, self.conditions, self.figures):
            values[dst] = values[src]
        self.phase[src] = IDLE
        plan = self.plans.pop(src, None)
        if plan is not None and dst != src:     # (dst == src: the row freed, its plan dropped)
            self.plans[dst] = plan

    def done(self):
        ar_done = self.ar.done() if self.ar is not None else None
        return [p == IDLE or (p == AR and ar_done[b]) for b, p in enumerate(self.phase)]

    def step(self):
        credit = self.engine.rows.credit
        drafting = self._in(DRAFT)
        forwards, fed = self.drunner.forwards, self.drunner.fed
        if drafting:
            self.drafting.step()
        n, f = self.drunner.forwards - forwards, self.drunner.fed - fed
        credit(drafting, self.draft_role, n, f, f // max(n, 1))
        plans = {b: self.plans[b] for b in self._in(RESAMPLE)}
        if plans:
            for rows, width in resample_step(self.engine, self.runner, self.x, plans, self.HW):
                credit(rows, "target", 1, width, width)
            for b, plan in plans.items():
                if plan.done:
                    self.phase[b] = IDLE
                    del self.plans[b]
        stepping = self._in(AR)
        if stepping:
            self.ar.step()
            credit(stepping, "target", 1, 1, 1)
        done = self.drafting.done() if drafting else []
        ready = [b for b in drafting if done[b]]
        if ready:
            self._draft_done(ready)
        credit([], "target", 0, 0, 0)     # (every target pass above is credited to its rows)

    def _draft_done(self, rows: List[int]) -> None:
        """Rows whose draft is complete: up-sampled and verified (a share of one token: plain AR)."""
        e, dev = self.engine, self.runner.device
        h, w = self.drunner.H, self.drunner.W
        index = to_device(rows, dev, torch.long)
        grids = self.drafting.tokens.index_select(0, index).view(len(rows), h, w)
        conditions = join_conditions([self.conditions[b] for b in rows])
        if self.previewing:
            conditions = self.target.condition_on_preview(conditions, grids)
        if self.plain:
            self.ar.start(rows, conditions)
            for b, grid in zip(rows, grids.cpu().unbind(0)):
                self.phase[b], self.figures[b] = AR, self._no_islands(grid)
            return
        # 2. The high-resolution drafts x~ [k, H*W], image by image.
        H, W = self.runner.H, self.runner.W
        x = torch.cat([_up.upsample(grid[None], (H, W), self.o.upsample, tokenizer=self.tokenizer, net=self.upsampler)
                       for grid in grids])
        x = to_device(x.reshape(len(rows), H * W), dev).long().contiguous()
        self.x.index_copy_(0, index, x)
        first, _ = e.prefill_rows(self.runner, rows, conditions)
        verified = self._verify(rows, first, x)
        # (the drafts brought back after the verification's read, not before its passes: on a GPU
        # a copy there would wait for the drafter's last step and leave the device idle)
        low = grids.cpu().unbind(0)
        for b, grid, (islands, resampled, labels, plan) in zip(rows, low, verified):
            self.figures[b] = (islands, resampled, labels, grid)
            if plan is not None and not plan.done:
                self.phase[b], self.plans[b] = RESAMPLE, plan
            else:
                self.phase[b] = IDLE

    def _no_islands(self, low: torch.Tensor) -> tuple:
        """The figures of an image decoded by plain AR (nothing verified): `low`, its draft."""
        return 0, 0, torch.full((self.runner.H, self.runner.W), -1, dtype=torch.int32), low

    def _verify(self, rows: List[int], first: Outputs, x: torch.Tensor) -> list:
        """3.-5. of rows `rows` (their drafts x [k, H*W], `first` their prefill's outputs): one
        target pass over the drafts (output i: the distribution of slot i), the pooled threshold
        and the local rejection windows (the pass's one host read, islands included), R_X's keys
        and values dropped and its first token drawn. Returns per row (islands, resampled count,
        island labels [H, W], its `ResamplePlan` or None)."""
        e, runner, HW = self.engine, self.runner, self.HW
        k, H, W = len(rows), runner.H, runner.W
        # Under a token budget the pass is cut into causal chunks of the image's share (the same
        # outputs, more passes), as an engine chunks a long prefill.
        step = e.narrowed(HW - 1)
        fed, positions = x[:, :HW - 1], torch.arange(HW - 1, device=x.device)
        with runner.apart(rows) as part:
            fed = pad_with_first(fed, part.batch)      # (a compiled runner's part may hold more rows)
            chunks = [part.forward(fed[:, a:a + step], positions[a:a + step]).first(k)
                      for a in range(0, HW - 1, step)]
            if part is not runner:      # (the passes of a part are this runner's too)
                for chunk in chunks:
                    count_pass(runner, chunk.cond.shape[1])
            e.rows.credit(rows, "target", len(chunks), HW - 1, step)
            ver = Outputs.cat([first] + chunks)
            pooled = part.token_probs(ver, x, self.neighbors, self.delta).pooled
            judgement = e.judge(pooled.view(k, H, W), rule="threshold", tau=self.o.tau, mode="local",
                                radius=self.o.radius, islands=True, starts=[0] * k, judged=[HW] * k, rows=rows)
            if any(True in R for R in judgement.resample):
                part.invalidate_where(torch.arange(HW, device=x.device).expand(part.batch, -1),
                                      pad_with_first(torch.tensor(judgement.resample, device=x.device), part.batch))
        # A pass feeds up to two tokens per island it advances: under a token budget, fewer
        # islands at a time.
        share = e.run.token_share
        most = None if share is None else max(1, share // 2)
        # (v1, raster order, is R_X as one island)
        plans = [island_plan(R, [0] * len(R) if self.o.resample == "raster" else isl, most)
                 for R, isl in zip(judgement.resample, judgement.islands)]
        draw_first(e, runner, self.x, ver, rows, plans)
        return [(n, sum(R), torch.tensor(isl, dtype=torch.int32).view(H, W), plan)
                for n, R, isl, plan in zip(judgement.num_islands, judgement.resample, judgement.islands, plans)]

    def final(self, b):
        # (a verified draft's tokens may still be resampled anywhere until its plan is done)
        return self.ar.final(b) if self.phase[b] == AR else 0

    def draft(self, b):
        if self.phase[b] != DRAFT:
            return None
        h, w = self.drunner.H, self.drunner.W
        return self.drafting.tokens[b].view(h, w), self.drafting.final(b)

    def preview(self, b):
        return self.figures[b][3] if self.previewing else None

    def method_stats(self, b):
        islands, resampled, labels, low = self.figures[b]
        return MuloStats([islands], [resampled], [labels], [low])


__all__ = ["MuloRows", "MuloStats"]
