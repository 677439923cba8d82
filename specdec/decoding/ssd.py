"""`ssd`: Spatially Speculative Decoding (docs/decoders.md, "ssd"), lossy by design.

Small heads on the frozen target predict its pre-norm hidden state of the token to the right
(horizontal heads, +1..+5) and below (vertical heads, +W, +2W) from `[h ; e(token)]`; the draft
distribution q is the target's own final norm + LM head on the prediction.

- Row 0: raster speculative decoding with the horizontal heads as the drafter (lossless), C0 passes.
- Every later row: the vertical head drafts the whole row at once from the row above (the columns
  are independent); with `vertical_heads=2` the +W and +2W heads draft the next two rows at once
  from the same row above. Then `rounds` rounds of verify-and-correct: one target pass over
  [last token of the row above ; rows] (causal; its keys are overwritten later), every position kept with
  u < min(1, p/q) independently (`verify_grid(rule="ratio", mode="independent")`), rejected ones
  replaced by residual samples (`sample_residual`). Reading (under the published `commit="write"`):
  in later rounds the q of a resampled position is the distribution it was resampled from, a kept
  one keeps the head's q. Then one commit pass writes the row's keys, values and hidden states
  (which the next row's vertical drafts start from).
- `commit="verify"` (our deviation from the published rule, and the default: the `published`
  preset is `commit="write"` without the bounds below) makes SSD exact in distribution, like `sd`: every token's last judgment happens under its final left context.
  Why the published rule is not: a kept token is judged against the head's q again in the next
  round (even when its context did not change), and a token right of a last-round correction is
  committed as judged under the old left context. Under "verify" every judgment uses SJD's rule
  (a token is judged against the distribution it follows: the head's q when freshly drafted,
  else the p it was last judged against, so it is kept for sure while its context holds), and
  every pass writes keys, values and hidden states. After a pass whose first correction is at f,
  everything up to f is settled; the next pass starts right after f (re-feeding x_f, whose key
  was written from its old value) and judges only tokens whose context changed. A group makes
  up to `rounds + 1` such passes and stops early when one changes nothing; what is still open
  is judged again with the next group's rows, and the last group closes its tail with passes of
  its own (`stats.extra["final_passes"]`). Each pass settles at least one token, so this ends.
  Tested against AR's distribution on a tiny model (tests/decoding/test_decoding_sd.py). The price, on
  the default family: corrections cascade along a row (a changed token changes its right
  neighbour's p), so tails stay open: passes average about 35 tokens instead of 16, and about
  14 final passes are added (docs/experiments.md).
- Batched (`commit="verify"`): each image has its own open span, settled up to its own first
  correction, and the images share their passes: a pass is as wide as the longest open span,
  shorter spans are padded with re-feeds of settled tokens, an image whose span is settled rides
  along on re-feeds; padding is never judged and draws nothing, so image i's tokens do not
  depend on its batch.
- `max_tail` and `final_passes` bound that price (None: unbounded, exact). Open tokens more than
  `max_tail` positions behind a group's rows are fed once more with that group's first pass, so
  their keys and values follow the final tokens before them, but they are not judged again: they
  are kept as last judged, under a left context that a later correction changed. The last group
  closes its tail with at most `final_passes` passes and keeps what is still open. Both make
  the variant lossy again, but only in the tokens they keep (`stats.extra["kept_as_judged"]`,
  about 40 of 256 on the default family with max_tail=24, final_passes=2, the family's default
  options; each image's spans are its own, so a batch keeps what its images keep alone):
  every other token is judged under its final context, where the
  published rule judges none of them so. docs/experiments.md: passes, wall clock and quality of each setting.

Target passes per image: 1 + C0 + ceil((H - 1) / vertical_heads)(rounds + 1) (the published
1 + C0 + (H - 1)(r + 1) with one vertical head, the default). Under commit="verify": 1 + C0 +
the groups' passes (1 to rounds + 1 each, `stats.extra["group_passes"]`) + the final passes
(at most `final_passes`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.batching import check_grid_model, run_batches
from specdec.decoding.compiled import record_compile_s, runner_for
from specdec.decoding.draws import draw, draw_residual, verify
from specdec.decoding.runner import ModelRunner
from specdec.decoding.speculative import HeadsDrafter, padded_block, raster_speculate
from specdec.decoding.streams import ImageStreams
from specdec.decoding.uploads import to_device
from specdec.ops.verification import verify_grid_unchecked
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


@torch.no_grad()
def decode_rows(runner: ModelRunner, heads, classes, gen, stats, options: SSDOptions) -> torch.Tensor:
    """SSD's rows on `runner` for the batch `classes` -> int64 [B, H*W] (`options.chunk` already
    capped at the heads' horizontal count)."""
    rounds, chunk, vertical_heads = options.rounds, options.chunk, options.vertical_heads
    commit, max_tail, final_passes = options.commit, options.max_tail, options.final_passes
    B = classes.shape[0]
    H, W = runner.H, runner.W
    first = runner.prefill(classes)
    rows = first.hidden.shape[0]
    x = torch.zeros(B, H * W, dtype=torch.long, device=runner.device)
    hid = first.hidden.new_zeros(rows, H * W, first.hidden.shape[-1])   # hid[:, t]: state giving token t
    drafter = HeadsDrafter(runner, heads)
    raster_speculate(runner, drafter, first, x, gen, stats, end=W, chunk=chunk, hidden_out=hid[:, :W])
    stats.extra.setdefault("row0_passes", []).append(runner.forwards - 1)
    draft_calls = drafter.forwards
    # commit="verify": per image, the first open position of the previous group's tail (None: all
    # settled; the whole list None when no image has one), and the q of the open tokens.
    carry_start, carry_q = None, None
    group_passes, kept = 0, [0] * B
    for i in range(1, H, vertical_heads):
        n = min(vertical_heads, H - i)                                               # rows drafted together
        lo, hi = i * W, (i + n) * W                                                  # the n rows, raster order
        above = slice(lo - W, lo)
        # Head k drafts row i + k - 1 from the row above: q [B, nW, V], the rows in raster order.
        _, q = _heads.draft(runner, heads, "vertical", range(1, n + 1), hid[:, above], x[:, above].repeat(rows // B, 1))
        draft_calls += 1
        V = q.shape[-1]
        x[:, lo:hi] = draw(q.reshape(-1, V), gen, runner.backend).view(B, n * W)
        if commit == "verify":
            passes = runner.forwards
            # The span each image judges this group: its open tail from the previous group (those
            # tokens follow the p they were last judged against, their q here), then the rows. q
            # is kept right-aligned at the span's end (column k: position hi - width + k).
            keep = [0] * B
            if carry_q is not None:
                # max_tail: open tokens further behind this group's rows are fed once more (their
                # keys and values then follow the final tokens before them) but kept as last judged.
                keep = [0 if s is None or max_tail is None else max(0, lo - s - max_tail) for s in carry_start]
                q = torch.cat([carry_q, q], 1)
            kept = [k + kb for k, kb in zip(kept, keep)]
            starts = [lo if carry_start is None or s is None else s for s in (carry_start or [None] * B)]
            carry_start, carry_q = _settle(runner, x, hid, starts, hi, q, gen, stats, max_passes=rounds + 1,
                                           keep=keep)
            if all(s is None for s in carry_start):
                carry_start, carry_q = None, None
            group_passes += runner.forwards - passes
            continue
        for _ in range(rounds):
            # The window is contiguous, so writing its keys in place changes nothing a query
            # of this pass sees (each sees the window up to itself, as with write=False), and the
            # next round or the commit pass overwrites them: the cheaper in-place path.
            p = runner.probs(_feed(runner, x, lo, hi))                                # [B, nW, V]
            q, _ = _verify_and_correct(runner, x, lo, hi, p, q, gen, stats)
        _commit_pass(runner, x, hid, lo, hi)
    if commit == "verify":
        # The last group has no next group to carry its open tail into: close it with passes of
        # its own (at most `final_passes`; None: until settled, which ends within the tail's length
        # as each pass settles at least its first token). What is still open is kept as last judged.
        final = runner.forwards
        if carry_start is not None:
            carry_start, _ = _settle(runner, x, hid, carry_start, H * W, carry_q, gen, stats, max_passes=final_passes,
                                     keep=[0] * B)
        # Passes are shared by the batch: final and group passes are counted once per batch (the
        # passes run), the tokens kept as judged per image.
        stats.extra.setdefault("final_passes", []).append(runner.forwards - final)
        stats.extra.setdefault("group_passes", []).append(group_passes)
        open_at_end = [0 if carry_start is None or s is None else H * W - s for s in (carry_start or [None] * B)]
        stats.extra.setdefault("open_at_end", []).extend(open_at_end)
        stats.extra.setdefault("kept_as_judged", []).extend(k + o for k, o in zip(kept, open_at_end))
    stats.draft_forwards = draft_calls * B
    return x


def _feed(runner: ModelRunner, x, lo: int, hi: int):
    """Feed the tokens at raster positions [lo - 1, hi - 1): the outputs give positions [lo, hi)."""
    return runner.forward(x[:, lo - 1:hi - 1], torch.arange(lo - 1, hi - 1, device=runner.device))


def _commit_pass(runner: ModelRunner, x, hid, lo: int, hi: int):
    """Feed the tokens before positions [lo, hi) and write their keys, values and hidden states."""
    out = _feed(runner, x, lo, hi)
    hid[:, lo:hi] = out.hidden
    return out


def _fit(q, width: int):
    """q [B, w, V], right-aligned at a span's end, as `width` columns (cut or zero-padded on the left)."""
    w = q.shape[1]
    if w >= width:
        return q[:, w - width:]
    return torch.cat([q.new_zeros(q.shape[0], width - w, q.shape[2]), q], 1)


def _right_uniforms(gen, counts, width: int) -> torch.Tensor:
    """[B, width]: counts[b] uniforms from image b's stream in the last columns of row b."""
    if isinstance(gen, ImageStreams):
        return gen.rand_padded(counts, width, right=True)
    (c,) = counts                     # a single image with a plain generator
    return torch.cat([torch.zeros(width - c), torch.rand((c,), generator=gen, dtype=torch.float32)])[None]


def _settle(runner: ModelRunner, x, hid, starts, hi: int, q, gen, stats, *, max_passes, keep):
    """commit="verify": passes over the open part of each image's span [starts[b], hi) (raster
    positions; starts[b] None: image b has nothing open), each judging it with SJD's rule and
    writing its keys, values and hidden states, until a pass changes nothing in it or `max_passes`
    (None: no limit) are made. q [B, w, V], right-aligned at hi: the distribution each judged
    token follows (the head's for fresh drafts, the last p it was judged against otherwise). The
    first pass also feeds the first keep[b] tokens of image b's span without judging them (max_tail).

    After a pass whose first correction in image b is at f, every token of b up to f is settled:
    its left context did not change, so it was judged against its final p (and a correction is
    drawn from that p's residual). Image b's next pass starts right after f: it re-feeds x_f,
    whose key was written from its old value, and judges only tokens whose context changed. The
    images share their passes: a pass is as wide as the longest open span, a shorter span is
    padded with re-feeds of settled tokens before it (`speculative.padded_block`: their keys and
    values come out as they were), an image with nothing open rides along on re-feeds of settled
    tokens, and padding is never judged, draws nothing and writes no hidden state. Returns each
    image's first open position (None when settled) and the q of the open tokens (right-aligned
    at hi). (A pass that would judge settled tokens again keeps them for sure: q is the p they
    were kept under. Skipping them is what makes the passes short.)"""
    B = x.shape[0]
    dev = x.device
    rows = hid.shape[0]
    rows_b = torch.arange(rows, device=dev) % B
    lo = [hi if s is None else s for s in starts]
    active = [s is not None for s in starts]
    keep = list(keep)
    passes = 0
    while any(active) and (max_passes is None or passes < max_passes):
        span = [hi - lb if a else 0 for lb, a in zip(lo, active)]
        N = max(span)
        count, start = to_device([span, [lb - 1 if a else hi - 1 for lb, a in zip(lo, active)]], dev, torch.long)
        pos = padded_block(start, count, N)                    # real: the span's feeds; then re-feeds
        out = runner.forward(x.gather(1, pos), pos)
        passes += 1
        j = torch.arange(N, device=dev)[None]
        # Hidden states of the real entries: out j gives position pos + 1 (re-feeds write back
        # what is there; their targets are distinct and below the span).
        real = (j < count[:, None])[rows_b]
        tpos = (pos + 1)[rows_b][..., None].expand(-1, -1, hid.shape[-1])
        hid.scatter_(1, tpos, torch.where(real[..., None], out.hidden, hid.gather(1, tpos)))
        # The frame: column k is position hi - N + k; image b's real output for it is k - (N - span_b).
        p_all = runner.probs(out)                                               # [B, N, V]
        V = p_all.shape[-1]
        offset = N - count
        judged_n = [sp - kb if a else 0 for sp, kb, a in zip(span, keep, active)]
        judged = j >= (N - to_device(judged_n, dev, torch.long))[:, None]
        p = p_all.gather(1, (j - offset[:, None]).clamp(0, N - 1)[..., None].expand(-1, -1, V))
        qf = _fit(q, N)
        xw = x[:, hi - N:hi]
        p_tok = p.gather(2, xw[..., None])[..., 0]
        q_tok = qf.gather(2, xw[..., None])[..., 0]
        u = to_device(_right_uniforms(gen, judged_n, N), dev)
        verdict = verify_grid_unchecked(p_tok.view(B, 1, N), q_tok.view(B, 1, N), "ratio", mode="independent",
                                        uniforms=u.view(B, 1, N), valid=judged.view(B, 1, N), backend=runner.backend)
        # The one host read of the pass: which tokens were kept and which are resampled. How many
        # uniforms each image draws for its corrections depends on it, and so does its next span.
        accept, redo = torch.stack([verdict.accept.view(B, N), verdict.resample.view(B, N)]).tolist()
        amap = torch.zeros(B, runner.H * runner.W, dtype=torch.bool)
        amap[:, hi - N:hi] = torch.tensor(accept, dtype=torch.bool)
        stats.acceptance_maps.append(amap.view(B, runner.H, runner.W))
        stats.extra.setdefault("drafted", []).append(sum(judged_n))
        stats.extra.setdefault("accepted", []).append(sum(map(sum, accept)))
        where = [(b, k) for b in range(B) for k in range(N) if redo[b][k]]    # row-major: each image's in order
        if where:
            rr, kk = to_device([[b for b, _ in where], [k for _, k in where]], dev, torch.long)
            x[rr, hi - N + kk] = draw_residual(p[rr, kk], qf[rr, kk], gen, runner.backend,
                                               counts=[sum(row) for row in redo])
        # After verify-and-correct every token follows this pass's p (kept ones by acceptance,
        # replaced ones by the residual), so the next pass judges it against p.
        q = p
        for b in range(B):
            if not active[b]:
                continue
            if True not in redo[b]:
                active[b] = False                               # nothing changed: all settled
                continue
            lo[b] = hi - N + redo[b].index(True) + 1           # settled up to the first correction
            active[b] = lo[b] < hi
        keep = [0] * B
    return [lb if a else None for lb, a in zip(lo, active)], q


def _verify_and_correct(runner: ModelRunner, x, lo: int, hi: int, p, q, gen, stats):
    """One independent verify-and-correct of the tokens at raster positions [lo, hi) against p
    (commit="write"); returns the q each token is judged against in the next round (the paper's
    reading: a resampled token's own residual distribution, a kept one's head q) and the
    resampled mask [B][L] on the host (from the pass's one read)."""
    B, L, _ = p.shape
    xw = x[:, lo:hi]
    p_tok = p.gather(2, xw[..., None])[..., 0]
    q_tok = q.gather(2, xw[..., None])[..., 0]
    verdict = verify(p_tok.view(B, 1, L), q_tok.view(B, 1, L), rule="ratio", mode="independent",
                     gen=gen, backend=runner.backend)
    # The one host read of the pass: which tokens were kept and which are resampled. How many
    # uniforms each image draws for its corrections depends on it, and so does the next span.
    accept, redo = torch.stack([verdict.accept.view(B, L), verdict.resample.view(B, L)]).tolist()
    amap = torch.zeros(B, runner.H * runner.W, dtype=torch.bool)
    amap[:, lo:hi] = torch.tensor(accept, dtype=torch.bool)
    stats.acceptance_maps.append(amap.view(B, runner.H, runner.W))
    stats.extra.setdefault("drafted", []).append(B * L)
    stats.extra.setdefault("accepted", []).append(sum(map(sum, accept)))
    where = [(b, j) for b in range(B) for j in range(L) if redo[b][j]]    # row-major, as a mask selects
    if where:
        rr, jj = to_device([[b for b, _ in where], [j for _, j in where]], x.device, torch.long)
        tokens, residual = draw_residual(p[rr, jj], q[rr, jj], gen, runner.backend, with_distribution=True,
                                         counts=[sum(row) for row in redo])
        x[rr, lo + jj] = tokens
        q = q.clone()
        q[rr, jj] = residual
    return q, redo


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
    sampling = run.sampling_or_default

    def decode_batch(cls, gen, stats):
        runner = runner_for(target, sampling, cls.shape[0], run.backend, compile=run.compile)
        x = decode_rows(runner, heads, cls, gen, stats, options)
        stats.target_forwards = runner.forwards * cls.shape[0]
        stats.target_tokens_fed = runner.fed * cls.shape[0]
        if run.compile:
            record_compile_s(stats, runner)
        return x

    return run_batches("ssd", target, conditions, decode_batch, run, tokenizer)


OPTIONS = SSDOptions
#: The published reading where the family default differs: the commit pass only writes (and no
#: bound on open tails applies).
PRESETS = {"published": SSDOptions(commit="write", max_tail=None, final_passes=None)}
