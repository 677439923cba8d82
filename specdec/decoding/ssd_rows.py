"""SSD's rows (`SSDRows`): the scheduler's policy for `ssd` (specdec.decoding.ssd)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.ar import ARRows
from specdec.decoding.blocks import fit_right
from specdec.decoding.drafters import HeadsDrafter
from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine, Judgement, Verdict
from specdec.decoding.policy import RowPolicy, move_rows
from specdec.decoding.speculative import RasterSpeculation
from specdec.decoding.uploads import to_device
from specdec.models.protocol import cfg_rows, image_rows


@dataclass
class SSDStats:
    """SSD's own figures, one entry per image (a pass shared by a batch counts for each image)."""

    row0_passes: List[int] = field(default_factory=list)      #: row 0's raster rounds
    group_passes: List[int] = field(default_factory=list)     #: commit="verify": the groups' passes
    final_passes: List[int] = field(default_factory=list)     #: commit="verify": passes closing the tail
    open_at_end: List[int] = field(default_factory=list)      #: tokens left open after the final passes
    kept_as_judged: List[int] = field(default_factory=list)   #: tokens kept under a context that changed


#: a row's phase in `SSDRows` ("idle": no image, or its image is done)
IDLE, FIRST, ROWS = "idle", "first", "rows"


@dataclass
class Span:
    """The later rows' feed of one step (`SSDRows._span_feed`) and, once made, its pass's outputs."""

    pos: torch.Tensor           #: [B, N] each row's fed positions (its span, then the last slot)
    hi: List[int]               #: each row's group end (0: a row not in the pass)
    count: torch.Tensor         #: [B] each row's span length
    rows: torch.Tensor          #: [B] bool: the rows whose span it is
    out: Optional[object] = None   #: the pass's `Outputs` over the N span columns


@dataclass
class RowState:
    """Where one row is in its rows after row 0 (the groups of `SSDRows.groups`)."""

    group: int = 0                #: its group's index in `SSDRows.groups`
    drafted: bool = False         #: the group's rows are drafted (the vertical heads ran for it)
    passes: int = 0               #: passes made in the group (or, `final`, closing the tail)
    start: Optional[int] = None   #: commit="verify": the open span's first position (None: settled)
    keep: int = 0                 #: commit="verify": tokens at the span's start its next pass feeds, unjudged
    final: bool = False           #: commit="verify": closing the last group's open tail
    stats: SSDStats = field(default_factory=lambda: SSDStats([0], [0], [0], [0], [0]))


class SSDRows(RowPolicy):
    """SSD over the scheduler's rows, each row in its own phase (`phase[b]`):

    - "first": row 0 by raster speculation with the horizontal heads (`RasterSpeculation`, up to
      `end`), one round per step (under a narrow token budget the whole grid, or AR: `__init__`);
    - "rows": the later rows, group by group (`RowState`): the step a group begins, the vertical
      heads draft it (`_draft`); every step, each row feeds its own span (`_span_feed`).

    A step makes one target pass over the rows of both phases (`_joint_forward`) and reads both
    verdicts at once (a row whose row 0 completes begins its groups the next step); each row's
    passes are credited to it alone (`Scheduler.credit`), so its pass counts and SSD's figures
    are those of its decode alone. Tokens fed count the width of the passes it took part in, the
    padding and the other rows' spans included, so they depend on its neighbours."""

    def __init__(self, engine: Engine, target, heads, options):
        """`options`: the method's `ssd.SSDOptions` (`chunk` capped at the heads' count)."""
        super().__init__(engine)
        self.runner = runner = engine.runner(target)
        self.heads = heads
        H, W = self.H, self.W = runner.H, runner.W
        B, self.HW = engine.batch, H * W
        # Under a token budget: fewer horizontal drafts per pass, and fewer rows drafted at once
        # (a group of rows is fed whole); with room for less than a row, the horizontal heads draft
        # the whole grid in raster order (sd with SSD's heads), and with room for one token, AR.
        chunk = engine.narrowed(options.chunk + 1) - 1
        share = self.share = engine.run.token_share
        # The exact variant cannot bound its open tails without keeping tokens as judged: under a
        # share below its widest possible span (rows 1 to H - 1) it drafts with its horizontal heads
        # alone, which stays exact.
        exact = options.commit == "verify" and options.max_tail is None and options.final_passes is None
        raster_only = share is not None and (share < W or (exact and share < (H - 1) * W))
        if share is not None and not raster_only and share < W * options.vertical_heads:
            options = dataclasses.replace(options, vertical_heads=share // W)
        self.o = options
        if chunk == 0:
            self.first = ARRows(engine, runner)
        else:
            end = self.HW if raster_only else W
            self.first = RasterSpeculation(engine, runner, HeadsDrafter(heads), end=end, chunk=chunk)
        self.later = chunk > 0 and not raster_only and H > 1
        self.tokens = self.x = self.first.tokens
        self.hid: Optional[torch.Tensor] = None   #: [rows, H*W, dim] the target state that gave each token
        self.q: Optional[torch.Tensor] = None     #: [B, w, V] each row's open tokens' q, right-aligned at its hi
        self.phase = [IDLE] * B
        self.state: List[Optional[RowState]] = [None] * B

    def groups(self) -> List[Tuple[int, int]]:
        """(lo, hi) of each group of rows drafted together, in raster positions."""
        H, W, k = self.H, self.W, self.o.vertical_heads
        return [(i * W, min(i + k, H) * W) for i in range(1, H, k)]

    def start(self, rows, conditions):
        self.first.start(rows, conditions)
        for b in rows:
            self.phase[b], self.state[b] = FIRST, RowState()
        if not self.later:
            return
        hidden = self.first.hid_prev            # [rows, dim]: the state that gave token 0
        if self.hid is None:
            self.hid = hidden.new_zeros(hidden.shape[0], self.HW, hidden.shape[-1])
            self.first.hidden_out = self.hid[:, :self.W]
        index = image_rows(to_device(rows, self.hid.device, torch.long), self.hid.shape[0] // self.engine.batch)
        self.hid[:, 0].index_copy_(0, index, hidden.index_select(0, index))

    def done(self):
        return [p == IDLE for p in self.phase]

    def move(self, src, dst):
        self.first.move(src, dst)
        move_rows(self.engine.batch, src, dst, self.hid, self.q)
        for values in (self.phase, self.state):
            values[dst] = values[src]
        self.phase[src], self.state[src] = IDLE, None

    def final(self, b):
        """Row 0's committed tokens, then the groups settled before the row's current one (a span
        still open in it counts from its start)."""
        if self.phase[b] == FIRST:
            return self.first.final(b)
        if self.phase[b] != ROWS:
            return self.HW
        state = self.state[b]
        lo = self.groups()[state.group][0] if state.group < len(self.groups()) else self.HW
        return lo if state.start is None else min(lo, state.start)

    def step(self):
        credit = self.engine.rows.credit
        first, rows = self._in(FIRST), self._in(ROWS)
        drafting = [b for b in rows if not self.state[b].drafted]
        if drafting:     # (before the pass: the spans it feeds hold the new drafts)
            self._draft(drafting)
        credit(drafting, "drafter", 1, 0, 0)     # (a row drafts once a step; row 0's heads: `HeadsDrafter`)
        span = self._span_feed(rows) if rows else None
        verdicts, ends = [], []
        forwards, fed = self.runner.forwards, self.runner.fed
        if first and isinstance(self.first, ARRows):
            self.first.step()          # (a share of one token: no rows after row 0 to join)
        elif first:
            verdicts.append(self.first.begin_round(self._joint_forward(span)))
            ends.append(self.first.end_round)
        if span is not None:
            if span.out is None:
                span.out = self.runner.forward(self.x.gather(1, span.pos), span.pos)
            verdict = self._span_outputs(rows, span)
            if verdict is not None:
                verdicts.append(verdict)
                ends.append(self._correct)
        width = self.runner.fed - fed
        credit(first + rows, "target", self.runner.forwards - forwards, width, width)
        for end, judgement in zip(ends, self.engine.read_verdicts(verdicts) if verdicts else []):
            end(judgement)
        complete = self.first.done()
        for b in first:
            self.state[b].stats.row0_passes[0] += 1
            if complete[b]:
                self.phase[b] = ROWS if self.later else IDLE
        for b in rows:
            self._advance(b)

    # ---- the later rows ----
    def _draft(self, rows: List[int]) -> None:
        """The vertical heads draft the next group of each of `rows` from the row above it, in one
        call (head k drafts row lo / W + k - 1); their q is joined to each row's open tokens' q and
        each row's span opened (`RowState.start`)."""
        e, x, W, B = self.engine, self.x, self.W, self.engine.batch
        groups, o = self.groups(), self.o
        inside = set(rows)
        lo = [groups[self.state[b].group][0] if b in inside else W for b in range(B)]
        height = {b: groups[self.state[b].group][1] - groups[self.state[b].group][0] for b in rows}
        # the row above each row's group (rows not drafting: row 0, drawing nothing)
        above = to_device([[lb - W + j for j in range(W)] for lb in lo], x.device, torch.long)
        halves = self.hid.shape[0] // B
        h = self.hid.gather(1, cfg_rows(above, halves)[..., None].expand(-1, -1, self.hid.shape[-1]))
        tokens = cfg_rows(x.gather(1, above), halves)
        for n in sorted(set(height.values())):      # (a last group of fewer rows: a call of its own)
            some_set = {b for b in rows if height[b] == n}
            q = _heads.draft(self.runner, self.heads, "vertical", range(1, n // W + 1), h, tokens, sorted(some_set))
            going = [n if b in some_set else 0 for b in range(B)]
            d = draw(q.reshape(-1, q.shape[-1]), e.streams, self.runner.backend, counts=going).view(B, n)
            mine = to_device([b in some_set for b in range(B)], x.device, torch.bool)
            pos = (to_device(lo, x.device, torch.long)[:, None] + torch.arange(n, device=x.device)).clamp(
                max=self.HW - 1)
            x.scatter_(1, pos, torch.where(mine[:, None], d, x.gather(1, pos)))
            # each row's q right-aligned at its new group's end: the open tokens' q, then the drafts'
            old = q.new_zeros(B, 0, q.shape[-1]) if self.q is None else self.q
            self.q = torch.where(mine[:, None, None], torch.cat([old, q], 1), fit_right(old, old.shape[1] + n))
        for b in rows:
            st = self.state[b]
            g_lo, g_hi = groups[st.group]
            st.drafted, st.passes, st.keep = True, 0, 0
            if o.commit == "write" or st.start is None:
                st.start = g_lo
                continue
            # The span goes on from the previous group's open tail (tokens that follow the p they
            # were last judged against). Under a token budget a pass feeds at most `share` tokens
            # per image: open tokens further back are kept as last judged and not fed again (their
            # keys and values stay as their last pass wrote them).
            if self.share is not None:
                cut = max(st.start, g_hi - self.share)
                st.stats.kept_as_judged[0] += cut - st.start
                st.start = cut
            # max_tail: open tokens further behind this group's rows are fed once more (their keys
            # and values then follow the final tokens before them) but kept as last judged.
            st.keep = 0 if o.max_tail is None else max(0, g_lo - st.start - o.max_tail)
            st.stats.kept_as_judged[0] += st.keep

    def _span_feed(self, rows: List[int]) -> "Span":
        """What each of `rows` feeds this step: its span [start - 1, hi - 1) (outputs: the
        distributions of [start, hi)). Padding and the other rows feed the grid's last slot, which
        no span reads (spans feed up to H*W - 2), not re-feeds (why: `RasterSpeculation._feed`)."""
        dev, B = self.x.device, self.engine.batch
        groups = self.groups()
        inside = set(rows)
        hi = [groups[self.state[b].group][1] if b in inside else 0 for b in range(B)]
        count = [hi[b] - self.state[b].start if b in inside else 0 for b in range(B)]
        start = [self.state[b].start - 1 if b in inside else 0 for b in range(B)]
        start_t, count_t = (to_device(v, dev, torch.long) for v in (start, count))
        j = torch.arange(max(count), device=dev)[None]
        pos = torch.where(j < count_t[:, None], start_t[:, None] + j, self.HW - 1)
        return Span(pos, hi, count_t, to_device([b in inside for b in range(B)], dev, torch.bool))

    def _joint_forward(self, span: Optional["Span"]):
        """`RasterSpeculation.begin_round`'s target pass with the later rows' spans joined to it:
        each row feeds its own positions, both padded at the grid's last slot to the wider."""
        if span is None:
            return self.runner.forward
        x, last = self.x, self.HW - 1

        def forward(tokens: torch.Tensor, pos: torch.Tensor):
            N = max(pos.shape[1], span.pos.shape[1])

            def wide(t, fill):
                return torch.cat([t, t.new_full((t.shape[0], N - t.shape[1]), fill)], 1) if t.shape[1] < N else t
            joint = torch.where(span.rows[:, None], wide(span.pos, last), wide(pos, last))
            # the spans and every padding slot feed the grid's tokens; the raster round its drafts
            fed = torch.where(span.rows[:, None] | (joint == last), x.gather(1, joint), wide(tokens, 0))
            out = self.runner.forward(fed, joint)
            span.out = out.select(slice(0, span.pos.shape[1]))
            return out.select(slice(0, pos.shape[1]))
        return forward

    def _span_outputs(self, rows: List[int], span: "Span") -> Optional[Verdict]:
        """The spans' outputs of `rows`: the fed tokens' hidden states written (commit="verify":
        every pass; "write": the pass after the `rounds` judging ones) and the verdict of the rows
        judged, or None: their open tokens judged against p (column k of row b: the distribution of
        position hi[b] - N + k) and the q they follow (not read yet; `_correct` once read)."""
        e, o, x, B, HW = self.engine, self.o, self.x, self.engine.batch, self.HW
        dev = x.device
        pos, hi, count_t, out = span.pos, span.hi, span.count, span.out
        inside = set(rows)
        N = pos.shape[1]
        j = torch.arange(N, device=dev)[None]
        writing = [b in inside and (o.commit == "verify" or self.state[b].passes == o.rounds) for b in range(B)]
        if any(writing):
            halves = self.hid.shape[0] // B
            real = cfg_rows((j < count_t[:, None]) & to_device(writing, dev, torch.bool)[:, None], halves)
            tpos = cfg_rows((pos + 1).clamp(max=HW - 1), halves)[..., None].expand(-1, -1, self.hid.shape[-1])
            self.hid.scatter_(1, tpos, torch.where(real[..., None], out.hidden, self.hid.gather(1, tpos)))
        judging = [b for b in rows if o.commit == "verify" or self.state[b].passes < o.rounds]
        if not judging:
            return None
        # (only the judged rows' [N, V] work: at light load the other rows are nearly all of them)
        index = to_device(judging, dev, torch.long)
        p_rows = self.runner.probs(out.images(index))                                          # [R, N, V]
        offset = (N - count_t).index_select(0, index)
        p = p_rows.gather(1, (j - offset[:, None]).clamp(0, N - 1)[..., None].expand(-1, -1, p_rows.shape[-1]))
        ends = to_device([hi[b] for b in judging], dev, torch.long)
        cols = (ends[:, None] - N + j).clamp(0, HW - 1)
        qf = fit_right(self.q.index_select(0, index), N)
        xw = x.index_select(0, index).gather(1, cols)[..., None]
        judged = [hi[b] - self.state[b].start - self.state[b].keep for b in judging]
        u = to_device(e.streams.rows(judging).rand_padded(judged, N, right=True), dev)
        valid = j >= (N - to_device(judged, dev, torch.long))[:, None]
        self._judged = (judging, p, qf, hi, N, index)
        return e.verdict(p.gather(2, xw)[..., 0], qf.gather(2, xw)[..., 0], starts=[hi[b] - N for b in judging],
                         judged=judged, uniforms=u, mode="independent", valid=valid, rows=judging)

    def _correct(self, judgement: Judgement) -> None:
        """The judged tokens' corrections drawn, then each row's q and (commit="verify") its
        span: settled up to its first correction."""
        e, x, o = self.engine, self.x, self.o
        rows, p, qf, hi, N, index = self._judged
        dev = x.device
        redo = judgement.resample
        picks = [(i, k) for i in range(len(rows)) for k in range(N) if redo[i][k]]    # each row's in order
        if picks:
            ii, kk = to_device([[i for i, _ in picks], [k for _, k in picks]], dev, torch.long)
            at = [(rows[i], hi[rows[i]] - N + k) for i, k in picks]
            if o.commit == "verify":
                e.redraw(x, at, p[ii, kk], qf[ii, kk])
            else:   # (a resampled token follows its residual distribution from now on)
                _, residual = e.redraw(x, at, p[ii, kk], qf[ii, kk], with_distribution=True)
                qf = qf.clone()
                qf[ii, kk] = residual
        # commit="verify": after verify-and-correct every token follows this pass's p (kept ones by
        # acceptance, replaced ones by the residual), so the next pass judges it against p
        self.q = fit_right(self.q, N).index_copy(0, index, p if o.commit == "verify" else qf)
        if o.commit == "verify":
            for i, b in enumerate(rows):
                first = redo[i].index(True) if True in redo[i] else None
                nxt = None if first is None else hi[b] - N + first + 1
                self.state[b].start = nxt if nxt is not None and nxt < hi[b] else None

    def _advance(self, b: int) -> None:
        """Row b after a pass: its group's next pass, the next group, closing its tail, or done."""
        st, o = self.state[b], self.o
        st.passes += 1
        st.keep = 0
        last = st.group + 1 >= len(self.groups())
        if o.commit == "write":
            if st.passes > o.rounds:          # (that was the commit pass)
                if last:
                    self.phase[b] = IDLE
                else:
                    st.group, st.drafted = st.group + 1, False
            return
        settled = st.start is None
        if st.final:
            st.stats.final_passes[0] += 1
            if settled or (o.final_passes is not None and st.passes >= o.final_passes):
                self._finish(b)
            return
        st.stats.group_passes[0] += 1
        if settled or st.passes >= o.rounds + 1:
            # The last group has no next group to carry its open tail into: it closes it with
            # passes of its own (at most `final_passes`; None: until settled).
            if not last:
                st.group, st.drafted = st.group + 1, False
            elif settled or o.final_passes == 0:
                self._finish(b)
            else:
                st.final, st.passes = True, 0

    def _finish(self, b: int) -> None:
        """Row b is done; what is still open is kept as last judged."""
        st = self.state[b]
        left = 0 if st.start is None else self.HW - st.start
        st.stats.open_at_end = [left]
        st.stats.kept_as_judged[0] += left
        self.phase[b] = IDLE

    def method_stats(self, b):
        st = self.state[b]      # (without later rows, its stats are row 0's, the rest [0])
        return SSDStats(list(st.stats.row0_passes)) if self.later and self.o.commit == "write" else st.stats


__all__ = ["RowState", "SSDRows", "SSDStats"]
