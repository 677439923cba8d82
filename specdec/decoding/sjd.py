"""`sjd`: speculative Jacobi decoding (Teng et al., ICLR 2025), lossless in the speculative sense.

The algorithm (a window of guesses, verified against the previous iterate): docs/decoders.md, "sjd".

Batched: every image has its own window start c_b and length n_b (shorter near the end of the grid,
0 once finished); the images share target passes as wide as the longest window, shorter windows
padded with *re-feeds* (committed tokens fed again at their own slots, whose keys and values come
out as they were: `blocks.padded_block`) and a finished image riding along on them. Padded entries
are never judged and draw no uniforms: every image consumes its stream exactly as decoded alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specdec.decoding.ar import ARRows
from specdec.decoding.batching import run_rows
from specdec.decoding.blocks import padded_block
from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine, Lengths
from specdec.decoding.policy import RowPolicy, move_rows
from specdec.decoding.speculative import Round, commit_window, own_tokens, own_verdict, plain_round
from specdec.decoding.widths import widths_for
from specdec.decoding.uploads import to_device
from specdec.settings import RunSettings, check_int


@dataclass(frozen=True)
class SJDOptions:
    window: int = 16   #: future slots guessed and verified per pass

    def __post_init__(self):
        check_int(self.window, "window", 1)


def _long(values, device) -> torch.Tensor:
    return to_device(values, device, torch.long)


class JacobiRows(RowPolicy):
    """SJD over the scheduler's rows: guesses y [B, L] for positions c_b .. c_b + n_b - 1 and the
    distribution q [B, L, V] each was drawn from (beyond n_b: padding); a row without an image, or
    done, has n_b = 0. A step is one Jacobi iteration of every row with window `window` (with the
    run's `adapts_width`: chosen each step up to that by `widths`, 0 meaning a plain AR step)."""

    def __init__(self, engine: Engine, target, window: int):
        super().__init__(engine)
        self.runner = runner = engine.runner(target)
        self.HW = runner.H * runner.W
        self.n = window                 #: this step's window
        B, dev = engine.batch, runner.device
        self.tokens = torch.zeros(B, self.HW, dtype=torch.long, device=dev)
        self.c = Lengths([self.HW] * B, dev)
        self.n_host = [0] * B
        self.uniform = torch.full((target.vocab_size,), 1.0 / target.vocab_size, device=dev)
        self.q = self.uniform.expand(B, 1, target.vocab_size).clone()
        self.y = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.widths = widths_for(engine, min(window, self.HW - 1), runner, all_or_none=True)
        self.own: Optional[torch.Tensor] = None      #: exact mode: the pass's `own_tokens`

    def start(self, rows, conditions):
        """Their windows of uniform guesses come with the next step (`_fit_windows`)."""
        self.begin(self.runner, rows, conditions)
        self.c.reset_rows(rows, 1)
        for b in rows:
            self.n_host[b] = 0

    def done(self):
        return [c >= self.HW for c in self.c.host]

    def move(self, src, dst):
        move_rows(self.engine.batch, src, dst, self.tokens, self.q, self.y)
        self.c.move(src, dst, self.HW)
        self.n_host[dst], self.n_host[src] = self.n_host[src], 0

    def final(self, b):
        return self.c.host[b]

    def _fit_windows(self, n: int) -> None:
        """Every unfinished row's window to n slots (fewer near the end of the grid): cut, or grown
        by fresh uniform guesses from the row's own stream (exact: keyed by their positions)."""
        want = [min(n, self.HW - cb) for cb in self.c.host]
        if want == self.n_host:
            return
        B, L, V = self.q.shape
        if max(want) > L:
            self.y = torch.cat([self.y, self.y.new_zeros(B, max(want) - L)], 1)
            self.q = torch.cat([self.q, self.uniform.expand(B, max(want) - L, V)], 1)
            L = max(want)
        dev, have = self.tokens.device, _long(self.n_host, self.tokens.device)
        k = max(1, max(w - h for w, h in zip(want, self.n_host)))
        positions = ((self.c.device + have)[:, None] + torch.arange(k, device=dev)).clamp(max=self.HW - 1)
        fresh_y = draw(self.uniform.expand(B * k, V), self.engine.streams, self.runner.backend,
                       counts=[max(0, w - h) for w, h in zip(want, self.n_host)], positions=positions).view(B, k)
        j = torch.arange(L, device=dev)[None]
        fresh = (j >= have[:, None]) & (j < _long(want, dev)[:, None])
        self.y = torch.where(fresh, fresh_y.gather(1, (j - have[:, None]).clamp(0, k - 1)), self.y)
        self.q = torch.where(fresh[..., None], self.uniform, self.q)
        self.n_host = want

    def step(self) -> None:
        """One pass: feed, judge, commit, and the next windows."""
        if self.widths is not None:
            self.n = self.widths.choose(self.runner.covered)
            if self.n == 0:
                plain_round(self.engine, self.runner, self.tokens, self.c, self.HW)
                self.n_host = [0] * len(self.n_host)
                return
        self._fit_windows(self.n)
        x, y, n_host = self.tokens, self.y, self.n_host
        B, L = y.shape
        c_host = self.c.host
        c, n = self.c.device, _long(n_host, x.device)
        j = torch.arange(L + 1, device=x.device)[None]
        # Row b feeds [x_{c-1} ; y_b] at c_b - 1 .. c_b + n_b - 1, then re-feeds c_b - 2, c_b - 3 ...
        pos = padded_block(c - 1, n + 1, L + 1)
        fed_y = (j >= 1) & (j <= n[:, None])
        p = self.runner.probs(self.runner.forward(torch.where(fed_y, torch.cat([y[:, :1], y], 1), x.gather(1, pos)),
                                                  pos))                        # output j: dist of c_b + j
        valid = (j[:, :L] < n[:, None]) if any(nb != L for nb in n_host) else None
        if self.engine.streams.exact:   # a guess is kept iff it is the target's own token there
            self.own = own_tokens(self.engine, self.runner, p, c)
            judgement = self.engine.read_verdicts([own_verdict(self.engine, y, self.own, starts=c_host,
                                                               judged=n_host, valid=valid)])[0]
        else:
            u = to_device(self.engine.streams.rand_padded(n_host, L), x.device)
            judgement = self.engine.judge(p[:, :L].gather(2, y[..., None])[..., 0],
                                          self.q.gather(2, y[..., None])[..., 0], starts=c_host, judged=n_host,
                                          uniforms=u, mode="raster", valid=valid)
        a = torch.minimum(judgement.verdict.first_reject.long(), n)
        a_host = [judgement.kept(b) for b in range(B)]
        # (each image's correction at c + a, or with its whole window kept its bonus token there)
        new = commit_window(self, self.runner, Round(L, n, y, self.q, padded_block(c, n, L), None), a, a_host, n_host,
                            self.HW, lambda rows, col: p[rows, col])
        new_c = [cb + ab + nw for cb, ab, nw in zip(c_host, a_host, new)]
        if self.widths is not None:
            self.widths.observe(judgement.accept, n_host)
        new_n = [min(self.n, self.HW - cb) for cb in new_c]
        self.c = Lengths(new_c, x.device)
        if max(new_n) == 0:
            self.n_host = new_n
            return
        self._next_windows(p, a, n, new_n)

    def _next_windows(self, p, a, n, new_n) -> None:
        """Jacobi step: after a correction at c + a the window's slots c + a + 1 .. c + n follow
        this pass's p (outputs a + 1 .. n); slots beyond (and after a bonus token) are fresh."""
        B, L = self.y.shape
        jn = torch.arange(max(new_n), device=p.device)[None]
        from_p = (a < n)[:, None] & (jn < (n - a)[:, None])
        src = (a[:, None] + 1 + jn).clamp(max=L)
        self.q = torch.where(from_p[..., None], p[torch.arange(B, device=p.device)[:, None], src], self.uniform)
        # row b's first new_n[b] slots draw from its stream; the rest are padding and draw nothing
        positions = (self.c.device[:, None] + jn).clamp(max=self.HW - 1)
        V = self.q.shape[-1]
        self.y = draw(self.q.reshape(-1, V), self.engine.streams, self.runner.backend, counts=new_n,
                      positions=positions).view(B, -1)
        self.n_host = new_n


def decode(target, conditions, *, tokenizer=None, options: SJDOptions = SJDOptions(), run: RunSettings = RunSettings()):
    """Speculative Jacobi decoding of `target`. With `run.compile` every target pass runs through
    compiled graphs padded to bucket widths (specdec.decoding.compiled)."""

    def policy(engine):
        # Under a token budget the window shrinks to the image's share (a pass feeds the last
        # committed token and the window); with room for no guess, plain AR steps.
        window = engine.narrowed(options.window + 1) - 1
        return ARRows(engine, engine.runner(target)) if window == 0 else JacobiRows(engine, target, window)

    return run_rows("sjd", target, conditions, policy, run, tokenizer)


OPTIONS = SJDOptions
PRESETS = {}
TAKES = ()  #: no model besides the target
