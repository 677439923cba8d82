"""A progress line on stderr for long work: images done of N, images per second of this run, ETA.
`specdec generate` and `compare` show one per command, `specdec sample` one on rank 0 over all
ranks."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


class ProgressLine:
    """Redrawn in place on stderr, at most every `interval` seconds. `done_before` images were
    already finished by an earlier run: they count towards N but not towards the rate. Calling
    the line with the images done so far updates it (what `RunSettings.progress` takes)."""

    def __init__(self, total: int, done_before: int = 0, *, label: str = "sample", enabled: bool = True,
                 stream: Optional[TextIO] = None, interval: float = 0.5,
                 clock: Callable[[], float] = time.perf_counter):
        self.total, self.before, self.enabled, self.label = total, done_before, enabled, label
        self.stream = stream or sys.stderr
        self.interval, self.clock = interval, clock
        self.start = clock()
        self.last_draw = None
        self.width = 0

    def text(self, new: int) -> str:
        done = min(self.total, self.before + new)
        elapsed = self.clock() - self.start
        rate = new / elapsed if elapsed > 0 and new else 0.0
        eta = _clock((self.total - done) / rate) if rate else "?"
        filled = int(24 * done / max(1, self.total))
        return (f"{self.label} [{'#' * filled}{'.' * (24 - filled)}] {done}/{self.total} images, "
                f"{rate:.2f} img/s, ETA {eta}")

    def update(self, new: int, force: bool = False) -> None:
        """`new`: images finished by this run so far, all ranks together."""
        if not self.enabled:
            return
        now = self.clock()
        if not force and self.last_draw is not None and now - self.last_draw < self.interval:
            return
        self.last_draw = now
        line = self.text(new)
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def __call__(self, new: int) -> None:
        self.update(new)

    def close(self) -> None:
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
