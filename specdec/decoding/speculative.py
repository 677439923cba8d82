"""Raster speculative decoding, the loop shared by `sd`, `lantern` and SSD's first row.

Each round a drafter proposes `n` tokens after the committed prefix; one target pass scores
[last committed token ; drafts]; `verify_grid(rule="ratio", mode="raster")` finds the first
rejection; `sample_residual` draws the correction from norm(max(0, p - q)) there (or a bonus
token from p when every draft was kept). The kept prefix is lossless for any q that depends only
on the committed prefix and earlier drafts (Leviathan et al.).

Batched: every image (row of the batch) has its own progress `c[b]`. A forward needs the same
number of tokens in every row, so rows with fewer real tokens (near the end of the grid, or
finished) are padded with *re-feeds*: committed tokens fed again at their own slots, whose keys and
values come out as they were (their context is all committed), so padding never changes a result.

Drafters:
- `ModelDrafter`: a second ARImageModel on the same grid and vocabulary, sampled serially;
- `HeadsDrafter`: SSD's horizontal heads on the target (Medusa-style: all n drafts from the last
  committed hidden state in one call, no drafter model).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.compiled import runner_for
from specdec.decoding.draws import draw, draw_residual, verify
from specdec.decoding.results import DecodeStats
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.streams import ImageStreams


def padded_block(start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """Positions [B, width]: row b holds start[b] .. start[b] + count[b] - 1, then re-feed slots
    start[b] - 1, start[b] - 2, ... (the caller guarantees start[b] >= width - count[b])."""
    j = torch.arange(width, device=start.device)[None]
    real = start[:, None] + j
    pad = start[:, None] - 1 - (j - count[:, None])
    return torch.where(j < count[:, None], real, pad)


def gather_rows(o: Outputs, index: torch.Tensor) -> Outputs:
    """Outputs at one block index per row: index [B] -> Outputs with N = 1."""
    B = o.cond.shape[0]
    ar = torch.arange(B, device=index.device)
    hid_rows = o.hidden.shape[0]
    hid_idx = index.repeat(hid_rows // B)
    return Outputs(o.cond[ar, index][:, None], None if o.uncond is None else o.uncond[ar, index][:, None],
                   o.hidden[torch.arange(hid_rows, device=index.device), hid_idx][:, None],
                   None if o.probs is None else o.probs[ar, index][:, None])


class ModelDrafter:
    def __init__(self, model, sampling, *, backend=None, compile: bool = False):
        self.model, self.sampling, self.backend, self.compile = model, sampling, backend, compile
        self.runner: Optional[ModelRunner] = None

    @property
    def forwards(self) -> int:
        return self.runner.forwards if self.runner else 0

    def start(self, classes):
        self.runner = runner_for(self.model, self.sampling, classes.shape[0], self.backend, compile=self.compile)
        self.runner.prefill(classes)
        self.fed = torch.zeros(classes.shape[0], dtype=torch.long, device=self.runner.device)
        self.fed_host = [0] * classes.shape[0]

    def draft(self, x, c, n, gen, c_host):
        """Drafts [B, n] and their q [B, n, V] after the committed lengths c [B] (c_host: the same
        on the host, from the loop's one read per pass)."""
        r = self.runner
        HW = x.shape[1]
        # Catch up on the committed tokens the drafter has not seen (1 or 2 per row). The width of
        # that pass is a shape: it comes from the host copies of c and fed, not from a read-back.
        m = max([1] + [cb - fb for cb, fb in zip(c_host, self.fed_host)])
        todo = (c - self.fed).clamp_min(0)
        todo = torch.where(todo == 0, torch.ones_like(todo), todo)   # finished rows: re-feed the last
        start = c - todo
        pos = padded_block(start, todo, m)
        o = gather_rows(r.forward(x.gather(1, pos), pos), todo - 1)
        self.fed = torch.maximum(self.fed, c)
        self.fed_host = [max(fb, cb) for fb, cb in zip(self.fed_host, c_host)]
        work = x.clone()
        tokens, qs = [], []
        for i in range(n):
            q = r.probs(o)[:, 0]
            d = draw(q, gen, r.backend)
            tokens.append(d)
            qs.append(q)
            if i + 1 < n:
                p = (c + i).clamp(max=HW - 1)   # past the grid: re-feed the last slot (drafted or committed)
                inside = (c + i) < HW
                # Rows past the grid write their slot's own token back (a fixed-shape write).
                work.scatter_(1, p[:, None], torch.where(inside, d, work.gather(1, p[:, None])[:, 0])[:, None])
                o = r.forward(work.gather(1, p[:, None]), p[:, None])
        return torch.stack(tokens, 1), torch.stack(qs, 1)

    def accepted(self, c, a, n, c_host, a_host):
        # The drafter fed its own drafts d_0..d_{n-2}: those that were kept are already correct.
        self.fed = c + a.clamp(max=n - 1)
        self.fed_host = [cb + min(ab, n - 1) for cb, ab in zip(c_host, a_host)]


class HeadsDrafter:
    """Drafts up to len(heads.horizontal) tokens per row from [h_{c-1} ; e(x_{c-1})] in one call."""

    def __init__(self, target: ModelRunner, heads):
        self.target, self.heads = target, heads
        self.forwards = 0
        self.hid_prev: Optional[torch.Tensor] = None   # set by raster_speculate: [rows, dim]

    def start(self, classes):
        pass

    def draft(self, x, c, n, gen, c_host=None):
        t = self.target
        self.forwards += 1
        last = x.gather(1, (c - 1).clamp_min(0)[:, None])[:, 0]
        rows = self.hid_prev.shape[0]
        _, q = _heads.draft(t, self.heads, "horizontal", range(1, n + 1), self.hid_prev,
                            last.repeat(rows // last.shape[0]))                           # q [B, n, V]
        B, _, V = q.shape
        return draw(q.reshape(-1, V), gen, t.backend).view(B, n), q

    def accepted(self, c, a, n, c_host=None, a_host=None):
        pass


class Relaxation(NamedTuple):
    """LANTERN's relaxed acceptance: the target probability in the ratio is pooled over each
    token's `neighbors` [V, K] with the moved mass at most `delta`."""

    neighbors: torch.Tensor
    delta: Optional[float]


@torch.no_grad()
def raster_speculate(target: ModelRunner, drafter, first: Outputs, x: torch.Tensor, gen, stats: DecodeStats, *,
                     end: int, chunk: int, relax: Optional[Relaxation] = None, hidden_out: Optional[torch.Tensor] = None):
    """Fill x[:, 0:end] (x: int64 [B, H*W]) speculatively. `first` is the prefill output (the
    distribution of token 0); `relax`: LANTERN's pooled acceptance (None: plain `sd`). With
    `hidden_out` [rows, end, dim], stores the exact target hidden state that gave each token's
    distribution (SSD's vertical heads need row 0's)."""
    neighbors, delta = relax if relax is not None else (None, None)
    device = x.device
    B = x.shape[0]
    H, W = target.H, target.W
    rows = first.hidden.shape[0]
    x[:, 0] = draw(target.probs(first)[:, 0], gen, target.backend)
    hid_prev = first.hidden[:, 0].clone()
    if hidden_out is not None:
        hidden_out[:, 0] = hid_prev
    chunk = min(chunk, end - 1)       # re-feed padding needs room before the block (see padded_block)
    c = torch.ones(B, dtype=torch.long, device=device)
    # The committed lengths are kept on the device (for the pass) and on the host (for the loop
    # control, the shapes and the stream consumption), the host copy advanced from the one read
    # of each pass: the acceptance counts.
    c_host = [1] * B
    ar_b = torch.arange(B, device=device)
    rows_b = torch.arange(rows, device=device) % B
    t_end = torch.arange(end, device=device)[None]
    streams = gen
    per_image = isinstance(streams, ImageStreams) and len(streams) > 1
    while chunk >= 1:
        going = [cb < end for cb in c_host]
        if not any(going):
            break
        n = chunk
        nb_host = [min(max(end - cb, 0), n) for cb in c_host]
        nb = (end - c).clamp(min=0, max=n)                                    # real drafts per row
        if per_image:
            # Images that are done draw nothing more here: SSD goes on from this stream after row 0.
            gen = streams.only(going)
        if isinstance(drafter, HeadsDrafter):
            drafter.hid_prev = hid_prev
        d, q = drafter.draft(x, c, n, gen, c_host)                            # [B, n], [B, n, V]
        work = x.clone()
        j = torch.arange(n, device=device)[None]
        in_chunk = j < nb[:, None]
        dpos = (c[:, None] + j).clamp(max=x.shape[1] - 1)
        work.scatter_(1, torch.where(in_chunk, dpos, torch.zeros_like(dpos)),
                      torch.where(in_chunk, d, work[:, :1].expand(-1, n)))
        pos = padded_block(c - 1, nb + 1, n + 1)
        out = target.forward(work.gather(1, pos), pos)                      # real j: dist of c + j
        o = out.select(slice(0, n))
        tp = target.token_probs(o, d, neighbors, delta)
        score = tp.pooled if neighbors is not None else tp.p_token           # LANTERN: pooled p in the ratio
        q_tok = q.gather(2, d[..., None])[..., 0]
        verdict = verify(score.view(B, 1, n), q_tok.view(B, 1, n), rule="ratio", mode="raster",
                         valid=in_chunk.view(B, 1, n), gen=gen, backend=target.backend)
        a = torch.minimum(verdict.first_reject.long(), nb)
        # The one host read of the pass. Whether any image draws a correction or a bonus token
        # decides whether the streams advance, so it cannot be deferred; everything else the host
        # needs (loop control, the drafter's catch-up width, statistics) follows from it.
        a_host = a.tolist()
        new_host = [nbb > 0 and cb + ab < end for cb, ab, nbb in zip(c_host, a_host, nb_host)]
        kept = j < a[:, None]
        amap = torch.zeros(B, H * W, dtype=torch.bool)
        for b, (cb, ab) in enumerate(zip(c_host, a_host)):
            amap[b, cb:cb + ab] = True
        stats.acceptance_maps.append(amap.view(B, H, W))
        stats.extra.setdefault("drafted", []).append(sum(nb_host))
        stats.extra.setdefault("accepted", []).append(sum(a_host))
        x.scatter_(1, torch.where(kept, dpos, (c - 1)[:, None].expand(-1, n)),
                   torch.where(kept, d, x.gather(1, (c - 1)[:, None]).expand(-1, n)))
        active = nb > 0
        new = active & (c + a < end)                        # a correction or a bonus token
        # The rejected drafts' keys and values are stale: forget them.
        if any(ab < nbb for ab, nbb in zip(a_host, nb_host)):
            target.invalidate_where(dpos, in_chunk & ~kept)
        if hidden_out is not None:
            # Output jj of the pass is the exact state of position c + jj for jj <= a (inside the
            # span): a fixed-shape select over the span, no index list.
            jj = t_end - c[:, None]                                           # [B, end]
            exact = ((jj >= 0) & (jj <= a[:, None]) & active[:, None])[rows_b]
            src = out.hidden.gather(1, jj.clamp(0, n)[rows_b][..., None].expand(-1, -1, out.hidden.shape[-1]))
            hidden_out.copy_(torch.where(exact[..., None], src, hidden_out))
        jstar = torch.where(new, a, (nb - 1).clamp_min(0))
        sel = gather_rows(out, jstar)
        if any(new_host):
            p_new = target.probs(sel)[:, 0]                                   # [B, V]
            q_new = torch.where((a < nb)[:, None], q[ar_b, a.clamp(max=n - 1)], torch.zeros_like(p_new))
            # Only images that get a new token draw: one that accepted every draft up to `end`
            # draws nothing alone, and its stream goes on after `end` (SSD's later rows).
            tok = draw_residual(p_new, q_new, streams.only(new_host) if per_image else gen,
                                target.backend)                           # q = 0: a bonus draw from p
            # Rows without a new token write their last committed token back (a fixed-shape write).
            at = torch.where(new, c + a, c - 1)[:, None]
            x.scatter_(1, at, torch.where(new, tok, x.gather(1, (c - 1)[:, None])[:, 0])[:, None])
        upd = active[rows_b]
        hid_prev.copy_(torch.where(upd[:, None], sel.hidden[:, 0], hid_prev))
        drafter.accepted(c, a, n, c_host, a_host)
        c = c + torch.where(active, a + new.long(), torch.zeros_like(a))
        c_host = [cb + (ab + nw if nbb > 0 else 0) for cb, ab, nw, nbb in zip(c_host, a_host, new_host, nb_host)]
    return hid_prev
