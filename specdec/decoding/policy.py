"""What the scheduler (`specdec.decoding.scheduler`) asks of every method: `RowPolicy`, and
`move_rows` (`specdec.models.protocol.move_rows`): how a policy's `move` moves its tensors."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Tuple

import torch

from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine
from specdec.decoding.runner import Outputs
from specdec.decoding.uploads import to_device
from specdec.models.protocol import move_rows


class RowPolicy(ABC):
    """A method as a policy over the rows of the scheduler's batch (the engine's `batch` rows): it
    makes its runners in its constructor (`engine.runner(model, role=...)`), keeps per-row state
    explicit (one entry per row) and its grids in `tokens` [rows, H*W]. A row without an image
    (never started, or done) rides along in the steps, changing nothing a row with an image reads."""

    tokens: torch.Tensor

    def __init__(self, engine: Engine):
        self.engine = engine

    @abstractmethod
    def start(self, rows: List[int], conditions) -> None:
        """Rows `rows` (sorted) begin the images of `conditions` (one each): their prefills
        (`engine.prefill_rows`), token 0 from each row's own stream (both: `begin`), their per-row
        state."""

    @abstractmethod
    def step(self) -> None:
        """One step over every row (rows done or without an image change nothing)."""

    @abstractmethod
    def done(self) -> List[bool]:
        """Per row, whether its image is complete (from host state: no read)."""

    @abstractmethod
    def move(self, src: int, dst: int) -> None:
        """Row `src`'s image, in whatever phase, to row `dst` (free); row `src` is then free (its
        state a row's without an image). The scheduler moves the cache rows and the streams. With
        src == dst the row is just freed, its image withdrawn (`Scheduler.cancel`)."""

    def begin(self, runner, rows: List[int], conditions) -> Tuple[Outputs, torch.Tensor]:
        """Rows `rows` begin new grids in `tokens`: their prefill on `runner` (`engine.prefill_rows`),
        token 0 drawn from its distribution with each row's own stream, the rest zeros. Returns the
        prefill's outputs and `rows` as a device index."""
        out, p0 = self.engine.prefill_rows(runner, rows, conditions)
        index = to_device(rows, runner.device, torch.long)
        grids = torch.zeros(len(rows), self.tokens.shape[1], dtype=torch.long, device=runner.device)
        grids[:, 0] = draw(p0, self.engine.streams.rows(rows), runner.backend, positions=torch.zeros_like(index))
        self.tokens.index_copy_(0, index, grids)
        return out, index

    def _in(self, phase: str) -> List[int]:
        """The rows in `phase`, for a policy that keeps each row's phase in `self.phase`."""
        return [b for b, p in enumerate(self.phase) if p == phase]

    def preview(self, b: int) -> Optional[torch.Tensor]:
        """Row b's preview grid [h, w] when the method decoded one itself (MuLo-SD drafted by a
        model's own preview stage), else None."""
        return None

    def method_stats(self, b: int):
        """Row b's figures of the method's own (`DecodeStats.method_stats` of one image), or None."""
        return None

    def final(self, b: int) -> int:
        """How many of row b's raster positions are final now, a prefix known from host state (no
        read): what a partial image of it may show; 0 while its tokens may still change anywhere."""
        return 0

    def draft(self, b: int) -> Optional[Tuple[torch.Tensor, int]]:
        """Row b's draft at another resolution while it forms (MuLo-SD's drafter grid, int64 [h, w]
        on the device, and how many of its positions are final), or None."""
        return None


__all__ = ["RowPolicy", "move_rows"]
