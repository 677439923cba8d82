"""Raster speculative decoding (the algorithm: docs/decoders.md, "sd"), the policy shared by `sd`,
`lantern` and SSD's first row. A drafter (`specdec.decoding.drafters`) proposes `n` tokens after
each image's committed prefix and one target pass scores [last committed token ; drafts]. The kept
prefix is lossless for any q that depends only on the committed prefix and earlier drafts
(Leviathan et al.).

Batched: every image has its own committed length; a pass is as wide as the widest block, shorter
rows padded with re-feeds (`specdec.decoding.blocks`). An image that reaches `end` draws nothing
more (SSD goes on from its stream after row 0).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from specdec.decoding.blocks import gather_rows, padded_block
from specdec.decoding.drafters import Drafter
from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine, Judgement, Lengths, Verdict
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.policy import RowPolicy, move_rows
from specdec.decoding.uploads import to_device
from specdec.decoding.widths import widths_for
from specdec.models.protocol import cfg_rows, image_rows


class Round(NamedTuple):
    """One round's drafts and what the target made of them (device tensors)."""

    n: int                      #: drafts per image (the pass's width less one)
    nb: torch.Tensor            #: [B] real drafts per image (fewer near `end`, 0 once there)
    drafts: torch.Tensor        #: [B, n]
    q: torch.Tensor             #: [B, n, V] the drafts' distributions
    dpos: torch.Tensor          #: [B, n] the drafts' raster positions
    out: Outputs                #: the target pass (output j: the distribution of position c + j)


def own_tokens(engine: Engine, target: ModelRunner, probs: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Exact mode: the target's own token at every output of a pass, int64 [B, N] (output j of row
    b: raster position starts[b] + j, clamped to the grid), drawn with each image's key."""
    B, N, V = probs.shape
    positions = (starts[:, None] + torch.arange(N, device=starts.device)).clamp(max=target.H * target.W - 1)
    return draw(probs.reshape(-1, V), engine.streams, target.backend, positions=positions).view(B, N)


def own_verdict(engine: Engine, drafts: torch.Tensor, own: torch.Tensor, *, starts, judged, valid) -> Verdict:
    """Exact mode's verdict on drafts [B, L]: each is kept iff it is the target's own token there
    (own [B, >= L], `own_tokens`), a threshold on the indicator, read like any verdict."""
    return engine.verdict((drafts == own[:, :drafts.shape[1]]).float(), starts=starts, judged=judged, valid=valid,
                          rule="threshold", tau=1.0, mode="raster")


def put_own(x: torch.Tensor, own: torch.Tensor, picks, kept) -> None:
    """Exact mode's correction or bonus token: at each pick (image b, the raster position after
    its kept[b] kept drafts) the target's own token there, own[b, kept[b]] (`own_tokens`)."""
    rows, cols, at = to_device([[b for b, _ in picks], [t for _, t in picks], [kept[b] for b, _ in picks]],
                               x.device, torch.long)
    x[rows, cols] = own[rows, at]


def commit_window(policy: RowPolicy, runner: ModelRunner, rnd: Round, a: torch.Tensor, a_host, nb_host, end: int,
                  p_at: Callable) -> list:
    """A judged window's writes into `policy.tokens` (`sd`'s drafts and `sjd`'s guesses alike;
    `policy.c` its committed lengths): each row's kept drafts (a [B] of its rnd.nb [B]; a_host,
    nb_host on the host), the keys and values of the others forgotten, and where a row with drafts
    is still before `end` its correction at c + a from the residual of p_at(rows, a[rows]) ([M, V],
    the target's distribution there) and rnd.q at a, or with every draft kept its bonus token from
    p (exact: the target's own token there, `policy.own`). Returns which rows drew one (host)."""
    engine, x, c, drafts, dpos, nb, q = policy.engine, policy.tokens, policy.c, rnd.drafts, rnd.dpos, rnd.nb, rnd.q
    L = drafts.shape[1]
    j = torch.arange(L, device=x.device)[None]
    kept = j < a[:, None]
    last = (c.device - 1)[:, None]
    x.scatter_(1, torch.where(kept, dpos, last.expand(-1, L)),
               torch.where(kept, drafts, x.gather(1, last).expand(-1, L)))
    if any(ab < nbb for ab, nbb in zip(a_host, nb_host)):
        runner.invalidate_where(dpos, (j < nb[:, None]) & ~kept)  # stale keys and values
    new = [nbb > 0 and cb + ab < end for cb, ab, nbb in zip(c.host, a_host, nb_host)]
    picks = [(b, cb + ab) for b, (cb, ab, nw) in enumerate(zip(c.host, a_host, new)) if nw]
    if picks and engine.streams.exact:
        put_own(x, policy.own, picks, a_host)
    elif picks:
        rows = to_device([b for b, _ in picks], x.device, torch.long)
        col = a[rows]
        # q = 0 where every draft was kept: a bonus draw from p
        q_rows = torch.where((a < nb)[rows, None], q[rows, col.clamp(max=L - 1)], 0.0)
        engine.redraw(x, picks, p_at(rows, col), q_rows)
    return new


def plain_round(engine: Engine, runner: ModelRunner, x: torch.Tensor, c: Lengths, end: int, *,
                hidden: bool = False):
    """A round without drafts (the width rule's choice under load): each image before `end` draws
    its next token as `ar` does, committed at once (no judgement, no host read); images at `end`
    ride along at the grid's last slot. Returns the pass's outputs and which rows drew; (None, None)
    where an exact round without `hidden` ran `ar`'s step (one compiled graph, the draw inside)."""
    counts = [int(cb < end) for cb in c.host]
    if engine.streams.exact and not hidden and end == x.shape[1]:
        # (a row at the end, or without an image, feeds the grid's last slot again: its c - 1)
        keys = engine.streams.key_tensor(x.device)[:, None]
        moved = runner.ar_step(x, (c.device - 1)[:, None], keys, exact=True)
        c.device, c.host = moved[:, 0] + 1, [cb + n for cb, n in zip(c.host, counts)]
        return None, None
    last = torch.full_like(c.device, x.shape[1] - 1)
    going = c.device < end
    at = torch.where(going, c.device, last)
    out = runner.forward(x.gather(1, (at - going.long())[:, None]), (at - going.long())[:, None])
    drawn = draw(runner.probs(out)[:, 0], engine.streams, runner.backend, counts=counts, positions=at)
    x.scatter_(1, at[:, None], torch.where(going, drawn, x.gather(1, at[:, None])[:, 0])[:, None])
    c.advance(going.long(), counts)
    return out, going


class RasterSpeculation(RowPolicy):
    """Raster speculation with `drafter` on `target`, over the scheduler's rows: per row, its
    committed length `c` and the hidden state that gave its last token. A step is one round of
    every row (draft, one target pass, judge, commit); a row at `end` rides along at the grid's last
    slot (`_feed`). `neighbors` [V, K] and `delta`: LANTERN's pooled acceptance (None: plain `sd`).
    SSD decodes row 0 with it (end = W) and sets `hidden_out` [rows, end, dim]: each round stores
    there the exact target state behind each token's distribution (for SSD's vertical heads; SSD
    stores token 0's)."""

    def __init__(self, engine: Engine, target: ModelRunner, drafter: Drafter, *, end: int, chunk: int,
                 neighbors: Optional[torch.Tensor] = None, delta: Optional[float] = None, adaptive: bool = False):
        """`adaptive`: the drafts per round chosen each step, `chunk` at most (`widths`; with the
        run's `adapts_width`)."""
        super().__init__(engine)
        self.target, self.drafter = target, drafter
        self.end = end
        self.chunk = min(chunk, end - 1)     # re-feed padding needs room before the block (see padded_block)
        self.n = self.chunk                  #: drafts per row this round
        self.neighbors, self.delta = neighbors, delta
        self.hidden_out: Optional[torch.Tensor] = None
        self.own: Optional[torch.Tensor] = None      #: exact mode: the round's `own_tokens`
        B = engine.batch
        self.tokens = torch.zeros(B, target.H * target.W, dtype=torch.long, device=target.device)
        self.c = Lengths([end] * B, target.device)     # (a row without an image: done)
        self.hid_prev: Optional[torch.Tensor] = None    # [rows, dim], made at the first start
        drafter.start(engine, target)
        self.widths = widths_for(engine, self.chunk, target, getattr(drafter, "runner", None)) if adaptive else None

    def start(self, rows, conditions):
        out, index = self.begin(self.target, rows, conditions)
        self.drafter.start_rows(rows, conditions)
        hidden = out.hidden[:, 0]           # the state that gave token 0, [k or 2k (CFG), dim]
        B = self.tokens.shape[0]
        halves = hidden.shape[0] // len(rows)            # (CFG: image b's rows 2b and 2b + 1)
        if self.hid_prev is None:
            self.hid_prev = hidden.new_zeros(halves * B, hidden.shape[-1])
        self.hid_prev.index_copy_(0, image_rows(index, halves), hidden)
        self.c.reset_rows(rows, 1)

    def done(self):
        return [c >= self.end for c in self.c.host]

    def move(self, src, dst):
        move_rows(self.engine.batch, src, dst, self.tokens, self.hid_prev)
        self.c.move(src, dst, self.end)
        self.drafter.move(src, dst)

    def final(self, b):
        return self.c.host[b]

    def step(self):
        if self.widths is not None:
            self.n = self.widths.choose(self.target.covered)
            if self.n == 0:
                reads = self.drafter.reads_hidden
                out, going = plain_round(self.engine, self.target, self.tokens, self.c, self.end, hidden=reads)
                if reads:
                    self._keep_last_hidden(out.hidden[:, 0], going)
                return
        self.end_round(self.engine.read_verdicts([self.begin_round()])[0])

    def begin_round(self, forward: Optional[Callable] = None) -> Verdict:
        """A round's device half: draft, one target pass, the verdict (not read yet: SSD reads it
        with its later rows', `Engine.read_verdicts`). `forward(tokens, positions [B, n + 1]) ->
        Outputs`: the pass (default: the target's; SSD's joins its later rows' spans to it)."""
        c = self.c
        going = [cb < self.end for cb in c.host]
        self._nb_host = [min(max(self.end - cb, 0), self.n) for cb in c.host]
        self._rnd = self._feed(self.tokens, c, going, forward or self.target.forward)
        return self._judge(self._rnd, c, going, self._nb_host)

    def end_round(self, judgement: Judgement) -> None:
        """A round's host half, once its verdict is read: commit the kept drafts and the
        correction or bonus token, advance the committed lengths."""
        c, rnd, nb_host = self.c, self._rnd, self._nb_host
        a = torch.minimum(judgement.verdict.first_reject.long(), rnd.nb)
        a_host = [judgement.kept(b) for b in range(len(nb_host))]
        new, new_host = self._commit(c, rnd, a, a_host, nb_host)
        self.drafter.accepted(c, a, a_host, rnd.n)
        if self.widths is not None:
            self.widths.observe(judgement.accept, nb_host)
        # (an image with no drafts, nb = 0, kept a = 0 and draws nothing new)
        c.advance(a + new.long(), [ab + nw for ab, nw in zip(a_host, new_host)])

    def _feed(self, x: torch.Tensor, c: Lengths, going, forward: Callable) -> Round:
        """Draft n tokens per image and feed [last committed ; drafts] to the target."""
        n = self.n
        nb = (self.end - c.device).clamp(min=0, max=n)
        d, q = self.drafter.draft(x, c, n, going, self.hid_prev)
        j = torch.arange(n, device=x.device)[None]
        in_chunk = j < nb[:, None]
        dpos = (c.device[:, None] + j).clamp(max=x.shape[1] - 1)
        work = x.clone()
        work.scatter_(1, torch.where(in_chunk, dpos, torch.zeros_like(dpos)),
                      torch.where(in_chunk, d, work[:, :1].expand(-1, n)))
        # A row with nothing to draft rides along at the grid's last slot, which no query of an
        # image reads: re-feeding its committed tokens would write their keys again from passes
        # of other shapes (a CPU kernel's query tiles then differ), so SSD's rows below row 0
        # would not keep the keys their decode alone has.
        last = torch.full_like(c.device, x.shape[1] - 1)
        pos = torch.where((nb > 0)[:, None], padded_block(c.device - 1, nb + 1, n + 1), last[:, None])
        return Round(n, nb, d, q, dpos, forward(work.gather(1, pos), pos))

    def _judge(self, rnd: Round, c: Lengths, going, nb_host):
        """The ratio test on the real drafts (LANTERN: on the pooled p; exact: `own_verdict`)."""
        valid = torch.arange(rnd.n, device=rnd.drafts.device)[None] < rnd.nb[:, None]
        if self.engine.streams.exact:
            self.own = own_tokens(self.engine, self.target, self.target.probs(rnd.out), c.device)
            return own_verdict(self.engine, rnd.drafts, self.own, starts=c.host, judged=nb_host, valid=valid)
        tp = self.target.token_probs(rnd.out.select(slice(0, rnd.n)), rnd.drafts, self.neighbors, self.delta)
        score = tp.pooled if self.neighbors is not None else tp.p_token
        q_tok = rnd.q.gather(2, rnd.drafts[..., None])[..., 0]
        # An image that is done draws no uniforms: its stream goes on after `end` (SSD's later rows).
        u = to_device(self.engine.streams.rand_padded([rnd.n if g else 0 for g in going], rnd.n), score.device)
        return self.engine.verdict(score, q_tok, starts=c.host, judged=nb_host, uniforms=u, valid=valid,
                                   mode="raster")

    def _commit(self, c: Lengths, rnd: Round, a, a_host, nb_host):
        """`end_round`'s writes (`commit_window`), and the hidden state behind each image's last
        committed token. Returns which images drew a correction or a bonus token, [B] bool and on
        the host."""
        active = rnd.nb > 0
        new = active & (c.device + a < self.end)
        if self.hidden_out is not None:
            self._keep_hidden(rnd.out, c, a, active)
        sel = gather_rows(rnd.out, torch.where(new, a, (rnd.nb - 1).clamp_min(0)))
        new_host = commit_window(self, self.target, rnd, a, a_host, nb_host, self.end,
                                 lambda rows, _: self.target.probs(sel)[:, 0][rows])
        self._keep_last_hidden(sel.hidden[:, 0], active)
        return new, new_host

    def _keep_last_hidden(self, hidden: torch.Tensor, active: torch.Tensor) -> None:
        """hidden [rows, dim]: the states that gave each active image's last committed token."""
        active = cfg_rows(active, self.hid_prev.shape[0] // active.shape[0])
        self.hid_prev.copy_(torch.where(active[:, None], hidden, self.hid_prev))

    def _keep_hidden(self, out: Outputs, c: Lengths, a, active) -> None:
        """Output jj of the pass is the exact state of position c + jj for jj <= a (inside the
        span): a fixed-shape select over the span, no index list."""
        hidden_out = self.hidden_out
        halves = hidden_out.shape[0] // a.shape[0]
        jj = torch.arange(self.end, device=a.device)[None] - c.device[:, None]  # [B, end]
        exact = cfg_rows((jj >= 0) & (jj <= a[:, None]) & active[:, None], halves)
        src = out.hidden.gather(1, cfg_rows(jj.clamp(0, self.chunk), halves)[..., None].expand(-1, -1,
                                                                                               out.hidden.shape[-1]))
        hidden_out.copy_(torch.where(exact[..., None], src, hidden_out))


__all__ = ["RasterSpeculation"]
