"""`sjd`: speculative Jacobi decoding (Teng et al., ICLR 2025), lossless in the speculative sense.

No drafter: a window of `window` future slots holds guesses, initialised uniformly at random.
Each iteration one target pass over [last committed token ; window] gives p^(j) at every slot;
the window is verified left to right with u < min(1, p^(j)(y) / p^(j-1)(y)), where p^(j-1) is the
distribution y was drawn from (`verify_grid(rule="ratio", mode="raster")`); at the first rejection
the token is resampled from norm(max(0, p^(j) - p^(j-1))) (`sample_residual`), the accepted prefix
is committed, and the rest of the window is redrawn from p^(j) (Jacobi iteration), new slots
appended at the end uniformly at random. When the whole window is accepted a bonus token is
drawn from the last output.

Batched: every image has its own window start c_b and window length n_b (shorter near the end
of the grid, 0 once finished), and the images share their target passes. A pass is as wide as the
longest window; a row with a shorter window is padded with *re-feeds* (committed tokens fed again
at their own slots, whose keys and values come out as they were: `blocks.padded_block`),
a finished image rides along on re-feeds only. Padded entries are never judged and draw no
uniforms: every image consumes its stream exactly as decoded alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decoding.ar import plain_ar
from specdec.decoding.batching import check_grid_model, run_batches
from specdec.decoding.blocks import padded_block
from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine, Lengths
from specdec.decoding.runner import ModelRunner
from specdec.decoding.uploads import to_device
from specdec.settings import RunSettings, check_int


@dataclass(frozen=True)
class SJDOptions:
    window: int = 16   #: future slots guessed and verified per pass

    def __post_init__(self):
        check_int(self.window, "window", 1)


def _long(values, device) -> torch.Tensor:
    """Host ints -> an int64 tensor on `device` (a host-to-device copy, no read-back)."""
    return to_device(values, device, torch.long)


class JacobiWindows:
    """Every image's window: guesses y [B, L] for positions c_b .. c_b + n_b - 1 and the
    distribution q [B, L, V] each was drawn from (entries beyond n_b are padding, never judged)."""

    def __init__(self, engine: Engine, runner: ModelRunner, x: torch.Tensor, window: int, vocab: int):
        self.engine, self.runner, self.x, self.window = engine, runner, x, window
        self.HW = x.shape[1]
        self.c = Lengths([1] * x.shape[0], x.device)
        self.n_host = [min(window, self.HW - 1)] * x.shape[0]
        self.uniform = torch.full((vocab,), 1.0 / vocab, device=x.device)
        self.q = self.uniform.expand(x.shape[0], self.n_host[0], vocab).clone()
        self.y = self._draw_rows(self.q, self.n_host)

    def _draw_rows(self, probs, counts):
        """One token per entry of probs [B, L, V], the first counts[b] rows of image b from its
        own stream (the rest are padding, drawn with zeros that consume nothing) -> int64 [B, L]."""
        B, L, V = probs.shape
        return draw(probs.reshape(-1, V), self.engine.streams, self.runner.backend, counts=counts).view(B, L)

    def step(self) -> bool:
        """One pass: feed, judge, commit, and the next windows; False once every image is done."""
        x, y, n_host = self.x, self.y, self.n_host
        B, L = y.shape
        c_host = self.c.host
        c, n = self.c.device, _long(n_host, x.device)
        j = torch.arange(L + 1, device=x.device)[None]
        # Row b feeds [x_{c-1} ; y_b] at c_b - 1 .. c_b + n_b - 1, then re-feeds c_b - 2, c_b - 3 ...
        pos = padded_block(c - 1, n + 1, L + 1)
        fed_y = (j >= 1) & (j <= n[:, None])
        p = self.runner.probs(self.runner.forward(torch.where(fed_y, torch.cat([y[:, :1], y], 1), x.gather(1, pos)),
                                                  pos))                        # output j: dist of c_b + j
        ragged = any(nb != L for nb in n_host)
        u = to_device(self.engine.streams.rand_padded(n_host, L), x.device)
        judgement = self.engine.judge(p[:, :L].gather(2, y[..., None])[..., 0], self.q.gather(2, y[..., None])[..., 0],
                                      starts=c_host, judged=n_host, uniforms=u, mode="raster",
                                      valid=(j[:, :L] < n[:, None]) if ragged else None)
        a = torch.minimum(judgement.verdict.first_reject.long(), n)
        a_host = [judgement.kept(b) for b in range(B)]
        self._commit(c, n, a, a_host, p)
        new_c = [cb + ab + (1 if (ab < nb or cb + nb < self.HW) and nb > 0 else 0)
                 for cb, ab, nb in zip(c_host, a_host, n_host)]
        new_n = [min(self.window, self.HW - cb) for cb in new_c]
        self.c = Lengths(new_c, x.device)
        if max(new_n) == 0:
            self.n_host = new_n
            return False
        self._next_windows(p, a, n, new_n)
        return True

    def start_row(self, rows, b: int, condition: torch.Tensor) -> None:
        """Row b of a rolling batch starts the image of `condition` as an image starts alone
        (`specdec.decoding.rolling`): its prefill copied into its cache rows, token 0 and a window
        of uniform guesses drawn from its own stream."""
        x, streams, backend = self.x, self.engine.streams, self.runner.backend
        out = rows.prefill(self.runner, b, condition)
        x[b] = 0
        x[b, 0] = draw(rows.probs(self.runner, out)[:, 0], streams.row(b), backend)[0]
        n = min(self.window, self.HW - 1)
        B, L, V = self.q.shape
        if n > L:      # the other rows' windows have shrunk near their ends: room again
            self.y = torch.cat([self.y, self.y.new_zeros(B, n - L)], 1)
            self.q = torch.cat([self.q, self.uniform.expand(B, n - L, V)], 1)
        self.q[b] = self.uniform
        self.y[b] = 0
        self.y[b, :n] = draw(self.uniform.expand(n, V), streams.row(b), backend)
        self.c.reset_row(b, 1)
        self.n_host[b] = n

    def _commit(self, c, n, a, a_host, p) -> None:
        """Write the kept prefixes, then each image's correction at c + a (from the residual) or,
        with its whole window kept, its bonus token at c + n (from p)."""
        x, y = self.x, self.y
        B, L = y.shape
        jl = torch.arange(L, device=x.device)[None]
        kept = jl < a[:, None]
        dpos = padded_block(c, n, L)                                          # distinct per row
        last = (c - 1)[:, None]
        x.scatter_(
            1, torch.where(kept, dpos, last.expand(-1, L)), torch.where(kept, y, x.gather(1, last).expand(-1, L))
        )
        picks, fix = [], []
        for b, (cb, ab, nb) in enumerate(zip(self.c.host, a_host, self.n_host)):
            if ab < nb:
                picks.append((b, cb + ab))
                fix.append(True)
            elif nb > 0 and cb + nb < self.HW:
                picks.append((b, cb + nb))  # a bonus token
                fix.append(False)
        if any(ab < nb for ab, nb in zip(a_host, self.n_host)):
            self.runner.invalidate_where(dpos, (jl >= a[:, None]) & (jl < n[:, None]))  # stale guesses
        if picks:
            rows = _long([b for b, _ in picks], x.device)
            col = torch.where(a < n, a, n)[rows]
            q_rows = torch.where(_long(fix, x.device)[:, None].bool(), self.q[rows, col.clamp(max=L - 1)], 0.0)
            self.engine.redraw(x, picks, p[rows, col], q_rows)  # q = 0: a bonus draw from p

    def _next_windows(self, p, a, n, new_n) -> None:
        """Jacobi step: after a correction at c + a the window's slots c + a + 1 .. c + n follow
        this pass's p (outputs a + 1 .. n); slots beyond (and after a bonus token) are fresh."""
        L = self.y.shape[1]
        B = self.y.shape[0]
        jn = torch.arange(max(new_n), device=p.device)[None]
        from_p = (a < n)[:, None] & (jn < (n - a)[:, None])
        src = (a[:, None] + 1 + jn).clamp(max=L)
        self.q = torch.where(from_p[..., None], p[torch.arange(B, device=p.device)[:, None], src], self.uniform)
        self.y = self._draw_rows(self.q, new_n)
        self.n_host = new_n


@torch.no_grad()
def sjd_grid(engine: Engine, runner: ModelRunner, classes, *, window: int) -> torch.Tensor:
    """Decode the batch `classes` on `runner`; returns int64 [B, H*W]."""
    first = runner.prefill(classes)
    x = torch.zeros(classes.shape[0], runner.H * runner.W, dtype=torch.long, device=runner.device)
    x[:, 0] = draw(runner.probs(first)[:, 0], engine.streams, runner.backend)
    windows = JacobiWindows(engine, runner, x, window, first.cond.shape[-1])
    rows = engine.rolling
    while True:
        if rows is not None:     # a rolling batch: done images leave, queued ones take their rows
            rows.refill(lambda b: windows.n_host[b] == 0, lambda b, cond: windows.start_row(rows, b, cond), x)
            if not rows.busy:
                return x
        elif not any(nb > 0 for nb in windows.n_host):
            return x
        windows.step()


def decode(target, conditions, *, tokenizer=None, options: SJDOptions = SJDOptions(), run: RunSettings = RunSettings()):
    """Speculative Jacobi decoding of `target`. With `run.compile` every target pass runs through
    compiled graphs padded to bucket widths (specdec.decoding.compiled)."""
    check_grid_model(target, "target")

    def decode_batch(cls, engine):
        # Under a token budget the window shrinks to the image's share (a pass feeds the last
        # committed token and the window); with room for no guess, plain AR steps.
        window = engine.narrowed(options.window + 1) - 1
        runner = engine.runner(target)
        if window == 0:
            return plain_ar(engine, runner, cls)
        return sjd_grid(engine, runner, cls, window=window)

    # (every pass has the same shape for every image: a rolling batch under `concurrency`)
    return run_batches("sjd", target, conditions, decode_batch, run, tokenizer, rolling=True)


OPTIONS = SJDOptions
PRESETS = {}
TAKES = ()  #: no model besides the target
