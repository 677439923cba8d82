"""`ssd`: Spatially Speculative Decoding (docs/decoders.md, "ssd"), lossy by design.

Small heads on the frozen target predict its pre-norm hidden state of the token to the right
(horizontal heads, +1..+5) and below (vertical heads, +W, +2W) from `[h ; e(token)]`; the draft
distribution q is the target's own final norm + LM head on the prediction.

- Row 0: raster speculative decoding with the horizontal heads as the drafter (lossless).
- Every later row: the vertical head drafts the whole row at once from the row above (the columns
  are independent); with `vertical_heads=2` the +W and +2W heads draft the next two rows at once
  from the same row above. Then the rows are judged with u < min(1, p/q) position by position
  (`verify_grid(rule="ratio", mode="independent")`) and rejected ones are replaced by residual
  samples (`sample_residual`).
- `commit="write"` (the published rule, the `published` preset): `rounds` rounds of
  verify-and-correct over the group's rows, then one commit pass writes their keys, values and
  hidden states (which the next row's vertical drafts start from). Reading: in later rounds the q
  of a resampled position is the distribution it was resampled from, a kept one keeps the head's.
- `commit="verify"` (our default, exact in distribution while both bounds below are None): every
  judgement uses SJD's rule (a token is judged against the distribution it follows: the head's q
  when freshly drafted, else the p it was last judged against, so it is kept for sure while its
  context holds) and every pass writes keys, values and hidden states. The published rule is not
  exact: a kept token is judged against the head's q again in the next round, and a token right
  of a last-round correction is committed as judged under the old left context. After a pass
  whose first correction is at f, everything up to f is settled; the next pass starts right after
  f and judges only tokens whose context changed. A group makes up to `rounds + 1` such passes;
  what is still open is judged again with the next group's rows, and the last group closes its
  tail with passes of its own. Each pass settles at least one token, so this ends.
- `max_tail` and `final_passes` bound the price of corrections that cascade along a row: open
  tokens more than `max_tail` positions behind a group's rows are fed once more (their keys and
  values then follow the final tokens before them) but kept as last judged, and the last group
  closes its tail with at most `final_passes` passes. Both make the variant lossy again, but only
  in the tokens they keep (`SSDStats.kept_as_judged`).
- Batched: each image has its own open span, settled up to its own first correction; a pass is
  as wide as the longest open span, shorter spans padded with re-feeds of settled tokens
  (`specdec.decoding.blocks`), padding never judged and drawing nothing, so image i's tokens do not
  depend on its batch.

Target passes per image: 1 + C0 (row 0) + ceil((H - 1) / vertical_heads)(rounds + 1) under
commit="write"; under commit="verify" 1 + C0 + the groups' passes (1 to rounds + 1 each) + the
final passes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.ar import plain_ar
from specdec.decoding.batching import check_grid_model, run_batches
from specdec.decoding.blocks import padded_block
from specdec.decoding.drafters import HeadsDrafter
from specdec.decoding.draws import draw
from specdec.decoding.engine import Engine
from specdec.decoding.runner import ModelRunner
from specdec.decoding.speculative import RasterSpeculation
from specdec.decoding.uploads import to_device
from specdec.settings import RunSettings, check_int

COMMIT = ("write", "verify")


def _check_bound(value, name: str):
    """max_tail / final_passes: None (unbounded: exact) or an int >= 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    return value


def check_rounds(rounds) -> int:
    return check_int(rounds, "rounds")


@dataclass(frozen=True)
class SSDOptions:
    rounds: int = 2              #: verify-and-correct rounds per row group (the paper's r)
    chunk: int = 5               #: horizontal drafts per row-0 round (capped at the heads' count)
    vertical_heads: int = 1      #: rows drafted at once below a committed row (1 or 2)
    #: "verify" (exact in distribution while max_tail and final_passes are None; our default) or
    #: "write" (published: the commit pass only writes; the `published` preset)
    commit: str = "verify"
    #: commit="verify": open tokens further than this behind a group's rows are kept as last judged
    max_tail: Optional[int] = 24
    #: commit="verify": at most this many passes close the last group's tail
    final_passes: Optional[int] = 2

    def __post_init__(self):
        check_rounds(self.rounds)
        check_int(self.chunk, "chunk", 1)
        check_int(self.vertical_heads, "vertical_heads", 1)
        if self.commit not in COMMIT:
            raise ValueError(f"commit must be one of {', '.join(COMMIT)}, got {self.commit!r}")
        _check_bound(self.max_tail, "max_tail")
        _check_bound(self.final_passes, "final_passes")


@dataclass
class SSDStats:
    """SSD's own figures, one entry per image (a pass shared by a batch counts for each image)."""

    row0_passes: List[int] = field(default_factory=list)      #: row 0's raster rounds
    group_passes: List[int] = field(default_factory=list)     #: commit="verify": the groups' passes
    final_passes: List[int] = field(default_factory=list)     #: commit="verify": passes closing the tail
    open_at_end: List[int] = field(default_factory=list)      #: tokens left open after the final passes
    kept_as_judged: List[int] = field(default_factory=list)   #: tokens kept under a context that changed


class Span:
    """commit="verify": the open part of each image's span [start, hi) of raster positions, and
    the q each open token follows, right-aligned at hi (column k of a width-w q: hi - w + k)."""

    def __init__(self, starts: List[Optional[int]], hi: int, q: torch.Tensor):
        self.starts, self.hi, self.q = starts, hi, q

    @property
    def settled(self) -> bool:
        return all(s is None for s in self.starts)


class RowDecoder:
    """SSD's rows after row 0 on the batch's target runner: vertical drafts, then the judgements
    of `options.commit`. x [B, H*W] the grid, hid [rows, H*W, dim] the target hidden state that
    gave each token (row 0's filled by the raster round)."""

    def __init__(self, engine: Engine, runner: ModelRunner, heads, options: SSDOptions, x, hid):
        self.engine, self.runner, self.heads, self.o = engine, runner, heads, options
        self.share = engine.token_share   #: the most tokens an image may feed one pass (None: no limit)
        self.x, self.hid = x, hid
        self.B = x.shape[0]
        self.H, self.W = runner.H, runner.W
        self.stats = SSDStats(row0_passes=[runner.forwards - 1] * self.B)

    def groups(self):
        """(lo, hi) of each group of rows drafted together, in raster positions."""
        H, W, k = self.H, self.W, self.o.vertical_heads
        return [(i * W, min(i + k, H) * W) for i in range(1, H, k)]

    def draft(self, lo: int, hi: int) -> torch.Tensor:
        """Head k drafts row (lo / W) + k - 1 from the row above: writes the drafts into x and
        returns their q [B, hi - lo, V] (the rows in raster order)."""
        rows, W = self.hid.shape[0], self.W
        above = slice(lo - W, lo)
        _, q = _heads.draft(self.runner, self.heads, "vertical", range(1, (hi - lo) // W + 1), self.hid[:, above],
                            self.x[:, above].repeat(rows // self.B, 1))
        self.engine.head_passes += 1
        self.x[:, lo:hi] = draw(q.reshape(-1, q.shape[-1]), self.engine.streams, self.runner.backend).view(self.B, -1)
        return q

    # ---- commit="write": the published rule ----
    def write_groups(self) -> None:
        for lo, hi in self.groups():
            q = self.draft(lo, hi)
            for _ in range(self.o.rounds):
                # The window is contiguous, so writing its keys in place changes nothing a query
                # of this pass sees (each sees the window up to itself, as with write=False), and
                # the next round or the commit pass overwrites them: the cheaper in-place path.
                p = self.runner.probs(self._feed(lo, hi))                               # [B, nW, V]
                q = self._verify_and_correct(lo, hi, p, q)
            self.hid[:, lo:hi] = self._feed(lo, hi).hidden                              # the commit pass

    def _feed(self, lo: int, hi: int):
        """Feed the tokens at raster positions [lo - 1, hi - 1): the outputs give positions [lo, hi)."""
        return self.runner.forward(self.x[:, lo - 1:hi - 1], torch.arange(lo - 1, hi - 1, device=self.x.device))

    def _verify_and_correct(self, lo: int, hi: int, p, q):
        """One independent verify-and-correct of the tokens at [lo, hi) against p; returns the q
        each token is judged against in the next round (a resampled token's own residual
        distribution, a kept one's head q)."""
        B, L, _ = p.shape
        xw = self.x[:, lo:hi]
        u = to_device(self.engine.streams.rand_padded([L] * B, L), p.device)
        verdict = self.engine.judge(p.gather(2, xw[..., None])[..., 0], q.gather(2, xw[..., None])[..., 0],
                                    starts=[lo] * B, judged=[L] * B, uniforms=u, mode="independent")
        picks = [(b, lo + j) for b in range(B) for j in range(L) if verdict.resample[b][j]]
        if not picks:
            return q
        rr, jj = to_device([[b for b, _ in picks], [t - lo for _, t in picks]], p.device, torch.long)
        _, residual = self.engine.redraw(self.x, picks, p[rr, jj], q[rr, jj], with_distribution=True)
        q = q.clone()
        q[rr, jj] = residual
        return q

    # ---- commit="verify": every judgement under its final left context ----
    def verify_groups(self) -> None:
        B, o = self.B, self.o
        span: Optional[Span] = None
        group_passes, kept = 0, [0] * B
        for lo, hi in self.groups():
            q = self.draft(lo, hi)
            passes = self.runner.forwards
            # The span each image judges this group: its open tail from the previous group (those
            # tokens follow the p they were last judged against, their q here), then the rows.
            keep = [0] * B
            starts = [lo] * B
            if span is not None:
                starts = [lo if s is None else s for s in span.starts]
                # Under a token budget a pass feeds at most `share` tokens per image: open tokens
                # further back are kept as last judged and not fed again (their keys and values
                # stay as their last pass wrote them).
                if self.share is not None:
                    cut = [max(sb, hi - self.share) for sb in starts]
                    kept = [k + c - sb for k, c, sb in zip(kept, cut, starts)]
                    starts = cut
                # max_tail: open tokens further behind this group's rows are fed once more (their
                # keys and values then follow the final tokens before them) but kept as last judged.
                keep = [0 if o.max_tail is None else max(0, lo - sb - o.max_tail) for sb in starts]
                q = torch.cat([span.q, q], 1)
            kept = [k + kb for k, kb in zip(kept, keep)]
            span = self.settle(Span(starts, hi, q), o.rounds + 1, keep)
            span = None if span.settled else span
            group_passes += self.runner.forwards - passes
        # The last group has no next group to carry its open tail into: close it with passes of
        # its own (at most `final_passes`; None: until settled). What is still open is kept as
        # last judged.
        final = self.runner.forwards
        if span is not None:
            span = self.settle(span, o.final_passes, [0] * B)
        open_at_end = [0 if s is None else self.H * self.W - s for s in (span.starts if span else [None] * B)]
        self.stats.group_passes = [group_passes] * B
        self.stats.final_passes = [self.runner.forwards - final] * B
        self.stats.open_at_end = open_at_end
        self.stats.kept_as_judged = [k + e for k, e in zip(kept, open_at_end)]

    def settle(self, span: Span, max_passes: Optional[int], keep: List[int]) -> Span:
        """Passes over the open part of each image's span, each judging it with SJD's rule and
        writing its keys, values and hidden states, until a pass changes nothing in it or
        `max_passes` (None: no limit) are made. The first pass also feeds the first keep[b] tokens
        of image b's span without judging them (max_tail).

        After a pass whose first correction in image b is at f, every token of b up to f is
        settled: its left context did not change, so it was judged against its final p (and a
        correction is drawn from that p's residual). Image b's next pass starts right after f: it
        re-feeds x_f, whose key was written from its old value, and judges only tokens whose
        context changed. The images share their passes (padded with re-feeds of settled tokens
        before each span; an image with nothing open rides along on re-feeds); padding is never
        judged, draws nothing and writes no hidden state."""
        passes = 0
        while not span.settled and (max_passes is None or passes < max_passes):
            span = self._settle_pass(span, keep)
            passes += 1
            keep = [0] * self.B
        return span

    def _settle_pass(self, span: Span, keep: List[int]) -> Span:
        x, hi, B = self.x, span.hi, self.B
        active = [s is not None for s in span.starts]
        lo = [hi if s is None else s for s in span.starts]
        widths = [hi - lb if a else 0 for lb, a in zip(lo, active)]
        N = max(widths)
        count, start = to_device([widths, [lb - 1 if a else hi - 1 for lb, a in zip(lo, active)]], x.device, torch.long)
        p = self._feed_span(count, start, N)
        judged_n = [w - kb if a else 0 for w, kb, a in zip(widths, keep, active)]
        j = torch.arange(N, device=x.device)[None]
        qf = _fit(span.q, N)
        xw = x[:, hi - N:hi]
        u = to_device(self.engine.streams.rand_padded(judged_n, N, right=True), x.device)
        verdict = self.engine.judge(p.gather(2, xw[..., None])[..., 0], qf.gather(2, xw[..., None])[..., 0],
                                    starts=[hi - N] * B, judged=judged_n, uniforms=u, mode="independent",
                                    valid=j >= (N - to_device(judged_n, x.device, torch.long))[:, None])
        redo = verdict.resample
        picks = [(b, hi - N + k) for b in range(B) for k in range(N) if redo[b][k]]    # each image's in order
        if picks:
            rr, kk = to_device([[b for b, _ in picks], [t - hi + N for _, t in picks]], x.device, torch.long)
            self.engine.redraw(x, picks, p[rr, kk], qf[rr, kk])
        # After verify-and-correct every token follows this pass's p (kept ones by acceptance,
        # replaced ones by the residual), so the next pass judges it against p. An image whose
        # pass changed nothing is settled; another is settled up to its first correction.
        starts = []
        for b in range(B):
            first = redo[b].index(True) if active[b] and True in redo[b] else None
            nxt = None if first is None else hi - N + first + 1
            starts.append(nxt if nxt is not None and nxt < hi else None)
        return Span(starts, hi, p)

    def _feed_span(self, count, start, N: int) -> torch.Tensor:
        """One pass over every image's open span (real: the span's feeds; then re-feeds), its
        hidden states written for the real entries; returns p [B, N] aligned at the spans' end
        (column k: position hi - N + k)."""
        pos = padded_block(start, count, N)
        out = self.runner.forward(self.x.gather(1, pos), pos)
        rows_b = torch.arange(self.hid.shape[0], device=pos.device) % self.B
        j = torch.arange(N, device=pos.device)[None]
        # Out j gives position pos + 1 (re-feeds write back what is there; their targets are
        # distinct and below the span).
        real = (j < count[:, None])[rows_b]
        tpos = (pos + 1)[rows_b][..., None].expand(-1, -1, self.hid.shape[-1])
        self.hid.scatter_(1, tpos, torch.where(real[..., None], out.hidden, self.hid.gather(1, tpos)))
        p_all = self.runner.probs(out)                                                  # [B, N, V]
        offset = N - count
        return p_all.gather(1, (j - offset[:, None]).clamp(0, N - 1)[..., None].expand(-1, -1, p_all.shape[-1]))


def _fit(q, width: int):
    """q [B, w, V], right-aligned at a span's end, as `width` columns (cut or zero-padded on the left)."""
    w = q.shape[1]
    if w >= width:
        return q[:, w - width:]
    return torch.cat([q.new_zeros(q.shape[0], width - w, q.shape[2]), q], 1)


@torch.no_grad()
def decode_rows(engine: Engine, runner: ModelRunner, heads, classes, options: SSDOptions) -> torch.Tensor:
    """SSD on `runner` for the batch `classes` -> int64 [B, H*W] (`options.chunk` already capped
    at the heads' horizontal count)."""
    H, W = runner.H, runner.W
    first = runner.prefill(classes)
    x = torch.zeros(classes.shape[0], H * W, dtype=torch.long, device=runner.device)
    # Under a token budget: fewer horizontal drafts per pass, and fewer rows drafted at once
    # (a group of rows is fed whole); with room for less than a row, the horizontal heads draft
    # the whole grid in raster order (sd with SSD's heads), and with room for one token, AR.
    chunk = engine.narrowed(options.chunk + 1) - 1
    share = engine.token_share
    # The exact variant cannot bound its open tails without keeping tokens as judged: under a
    # share below its widest possible span (rows 1 to H - 1) it drafts with its horizontal heads
    # alone, which stays exact.
    exact = options.commit == "verify" and options.max_tail is None and options.final_passes is None
    if chunk == 0 or (share is not None and (share < W or (exact and share < (H - 1) * W))):
        if chunk == 0:
            x = plain_ar(engine, runner, classes, first)
        else:
            RasterSpeculation(engine, runner, HeadsDrafter(heads), end=H * W, chunk=chunk).run(first, x)
        B = classes.shape[0]
        engine.stats.method_stats = SSDStats([runner.forwards - 1] * B, [0] * B, [0] * B, [0] * B, [0] * B)
        return x
    if share is not None and share < W * options.vertical_heads:
        options = dataclasses.replace(options, vertical_heads=share // W)
    hid = first.hidden.new_zeros(first.hidden.shape[0], H * W, first.hidden.shape[-1])   # state giving token t
    RasterSpeculation(engine, runner, HeadsDrafter(heads), end=W, chunk=chunk, hidden_out=hid[:, :W]).run(first, x)
    rows = RowDecoder(engine, runner, heads, options, x, hid)
    if options.commit == "verify":
        rows.verify_groups()
    else:
        rows.write_groups()
    engine.stats.method_stats = rows.stats
    return x


def decode(target, conditions, *, heads, tokenizer=None, options: SSDOptions = SSDOptions(),
           run: RunSettings = RunSettings()):
    """SSD on `target` with its spatial `heads` (module docstring). With `run.compile` every target
    pass runs through compiled graphs padded to bucket widths (specdec.decoding.compiled), and
    each head draft (embedding, heads, LM head, sampling) as one compiled graph per shape."""
    check_grid_model(target, "target")
    if heads is None:
        raise ValueError("ssd needs its spatial heads (heads=...; the default family ships them as ssd_heads)")
    available = _heads.num_heads(heads, "vertical")
    if options.vertical_heads > available:
        raise ValueError(f"vertical_heads must be an int in [1, {available}] (the heads' vertical count), "
                         f"got {options.vertical_heads!r}")
    cfg_w = getattr(getattr(heads, "config", None), "grid_width", None)
    if cfg_w is not None and cfg_w != target.grid[1]:
        raise ValueError(f"ssd heads were trained for grid width {cfg_w}, the target's grid is {tuple(target.grid)}")
    options = dataclasses.replace(options, chunk=min(options.chunk, _heads.num_heads(heads, "horizontal")))

    def decode_batch(cls, engine):
        return decode_rows(engine, engine.runner(target), heads, cls, options)

    return run_batches("ssd", target, conditions, decode_batch, run, tokenizer)


OPTIONS = SSDOptions
#: The published reading where the family default differs: the commit pass only writes (and no
#: bound on open tails applies).
PRESETS = {"published": SSDOptions(commit="write", max_tail=None, final_passes=None)}
#: The models ssd takes besides its target: its spatial heads.
TAKES = ("heads",)


def resources(family, given: dict, options=None) -> dict:
    """The heads given, else the family's (`ssd_heads`)."""
    heads = given.get("heads")
    return {"heads": heads if heads is not None else family.ssd_heads}
