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

from typing import Optional

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.common import DecodeStats, ImageStreams, ModelRunner, Outputs, draw, draw_residual, verify


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
                   o.hidden[torch.arange(hid_rows, device=index.device), hid_idx][:, None])


class ModelDrafter:
    def __init__(self, model, sampling, *, backend=None):
        self.model, self.sampling, self.backend = model, sampling, backend
        self.runner: Optional[ModelRunner] = None

    @property
    def forwards(self) -> int:
        return self.runner.forwards if self.runner else 0

    def start(self, classes):
        self.runner = ModelRunner(self.model, self.sampling, batch=classes.shape[0], backend=self.backend)
        self.runner.prefill(classes)
        self.fed = torch.zeros(classes.shape[0], dtype=torch.long, device=self.runner.device)

    def draft(self, x, c, n, gen):
        r = self.runner
        HW = x.shape[1]
        # Catch up on the committed tokens the drafter has not seen (1 or 2 per row).
        todo = (c - self.fed).clamp_min(0)
        m = max(1, int(todo.max()))
        todo = torch.where(todo == 0, torch.ones_like(todo), todo)   # finished rows: re-feed the last
        start = c - todo
        pos = padded_block(start, todo, m)
        o = gather_rows(r.forward(x.gather(1, pos), pos), todo - 1)
        self.fed = torch.maximum(self.fed, c)
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
                work[inside, (c + i)[inside]] = d[inside]
                o = r.forward(work.gather(1, p[:, None]), p[:, None])
        return torch.stack(tokens, 1), torch.stack(qs, 1)

    def accepted(self, c, a, n):
        # The drafter fed its own drafts d_0..d_{n-2}: those that were kept are already correct.
        self.fed = c + a.clamp(max=n - 1)


class HeadsDrafter:
    """Drafts up to len(heads.horizontal) tokens per row from [h_{c-1} ; e(x_{c-1})] in one call."""

    def __init__(self, target: ModelRunner, heads):
        self.target, self.heads = target, heads
        self.forwards = 0
        self.hid_prev: Optional[torch.Tensor] = None   # set by raster_speculate: [rows, dim]

    def start(self, classes):
        pass

    def draft(self, x, c, n, gen):
        t = self.target
        self.forwards += 1
        last = x.gather(1, (c - 1).clamp_min(0)[:, None])[:, 0]
        rows = self.hid_prev.shape[0]
        e = t.model.embed_tokens(last.repeat(rows // last.shape[0]))                    # [rows, dim]
        pred = _heads.predict(self.heads, "horizontal", range(1, n + 1), self.hid_prev, e)  # [rows, n, dim]
        q = t.probs(t.outputs(t.model.head(pred), pred))                                # [B, n, V]
        B, _, V = q.shape
        return draw(q.reshape(-1, V), gen, t.backend).view(B, n), q

    def accepted(self, c, a, n):
        pass


@torch.no_grad()
def raster_speculate(target: ModelRunner, drafter, first: Outputs, x: torch.Tensor, gen, stats: DecodeStats, *,
                     end: int, chunk: int, neighbors=None, delta=None, hidden_out: Optional[torch.Tensor] = None):
    """Fill x[:, 0:end] (x: int64 [B, H*W]) speculatively. `first` is the prefill output (the
    distribution of token 0). With `hidden_out` [rows, end, dim], stores the exact target hidden
    state that gave each token's distribution (SSD's vertical heads need row 0's)."""
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
    ar_b = torch.arange(B, device=device)
    rows_b = torch.arange(rows, device=device) % B
    streams = gen
    per_image = isinstance(streams, ImageStreams) and len(streams) > 1
    while chunk >= 1:
        # The loop-control read: which images are still going (one read per pass, for both uses).
        going = (c < end).tolist()
        if not any(going):
            break
        n = chunk
        nb = (end - c).clamp(min=0, max=n)                                    # real drafts per row
        if per_image:
            # Images that are done draw nothing more here: SSD goes on from this stream after row 0.
            gen = streams.only(going)
        if isinstance(drafter, HeadsDrafter):
            drafter.hid_prev = hid_prev
        d, q = drafter.draft(x, c, n, gen)                                    # [B, n], [B, n, V]
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
        kept = j < a[:, None]
        amap = torch.zeros(B, H * W, dtype=torch.bool, device=device)
        amap.scatter_(1, torch.where(kept, dpos, torch.zeros_like(dpos)), kept)
        stats.acceptance_maps.append(amap.view(B, H, W).cpu())
        stats.extra.setdefault("drafted", []).append(int(nb.sum()))
        stats.extra.setdefault("accepted", []).append(int(a.sum()))
        x.scatter_(1, torch.where(kept, dpos, (c - 1)[:, None].expand(-1, n)),
                   torch.where(kept, d, x.gather(1, (c - 1)[:, None]).expand(-1, n)))
        active = nb > 0
        new = active & (c + a < end)                        # a correction or a bonus token
        # The rejected drafts' keys and values are stale: forget them.
        stale = in_chunk & ~kept
        if bool(stale.any()):
            target.invalidate_where(dpos, stale)
        if hidden_out is not None:
            jj = torch.arange(n + 1, device=device)[None]
            exact = (jj <= a[:, None]) & (c[:, None] + jj < end) & active[:, None]
            hpos = (c[:, None] + jj).clamp(max=end - 1)
            rr, cc = exact.nonzero(as_tuple=True)
            for half in range(rows // B):
                hidden_out[rr + half * B, hpos[rr, cc]] = out.hidden[rr + half * B, cc]
        jstar = torch.where(new, a, (nb - 1).clamp_min(0))
        sel = gather_rows(out, jstar)
        if bool(new.any()):
            p_new = target.probs(sel)[:, 0]                                   # [B, V]
            q_new = torch.where((a < nb)[:, None], q[ar_b, a.clamp(max=n - 1)], torch.zeros_like(p_new))
            tok = draw_residual(p_new, q_new, gen, target.backend)        # q = 0: a bonus draw from p
            x[new, (c + a)[new]] = tok[new]
        upd = active[rows_b]
        hid_prev[upd] = sel.hidden[upd, 0]
        drafter.accepted(c, a, n)
        c = c + torch.where(active, a + new.long(), torch.zeros_like(a))
    return hid_prev
