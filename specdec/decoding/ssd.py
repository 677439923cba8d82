"""`ssd`: Spatially Speculative Decoding (METHODS.md "ssd"), lossy by design.

Small heads on the frozen target predict its pre-norm hidden state of the token to the right
(horizontal heads, +1..+5) and below (vertical heads, +W, +2W) from `[h ; e(token)]`; the draft
distribution q is the target's own final norm + LM head on the prediction.

- Row 0: raster speculative decoding with the horizontal heads as the drafter (lossless), C0 passes.
- Every later row: the vertical head drafts the whole row at once from the row above (the columns
  are independent); with `vertical_heads=2` the +W and +2W heads draft the next two rows at once
  from the same row above. Then `rounds` rounds of verify-and-correct: one target pass over
  [last token of the row above ; rows] (causal; its keys are overwritten later), every position kept with
  u < min(1, p/q) independently (`verify_grid(rule="ratio", mode="independent")`), rejected ones
  replaced by residual samples (`sample_residual`). Reading (`round_q="resampled"`, the default): in
  later rounds the q of a resampled position is the distribution it was resampled from, a kept
  one keeps the head's q. Alternative (`round_q="previous"`, SJD's rule): every position is judged
  against the previous round's p, the distribution it follows after that round's correction, so
  a token whose left context did not change is kept for sure. Then one commit pass writes the row's keys,
  values and hidden states (which the next row's vertical drafts start from).

Target passes per image: 1 + C0 + ceil((H - 1) / vertical_heads)(rounds + 1) (the published
1 + C0 + (H - 1)(r + 1) with one vertical head, the default).
"""
from __future__ import annotations

import torch

from specdec.decoding import heads as _heads
from specdec.decoding.common import ModelRunner, Sampling, check_grid_model, draw, draw_residual, run_batches, verify
from specdec.decoding.speculative import HeadsDrafter, raster_speculate


ROUND_Q = ("resampled", "previous")


def check_rounds(rounds) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an int >= 0, got {rounds!r}")
    return rounds


@torch.no_grad()
def decode_rows(runner: ModelRunner, heads, classes, gen, stats, *, rounds: int, chunk: int,
                vertical_heads: int = 1, round_q: str = "resampled") -> torch.Tensor:
    B = classes.shape[0]
    H, W = runner.H, runner.W
    model = runner.model
    first = runner.prefill(classes)
    rows = first.hidden.shape[0]
    x = torch.zeros(B, H * W, dtype=torch.long, device=runner.device)
    hid = first.hidden.new_zeros(rows, H * W, first.hidden.shape[-1])   # hid[:, t]: state giving token t
    drafter = HeadsDrafter(runner, heads)
    raster_speculate(runner, drafter, first, x, gen, stats, end=W, chunk=chunk, hidden_out=hid[:, :W])
    stats.extra.setdefault("row0_passes", []).append(runner.forwards - 1)
    draft_calls = drafter.forwards
    for i in range(1, H, vertical_heads):
        n = min(vertical_heads, H - i)                                               # rows drafted together
        above = torch.arange((i - 1) * W, i * W, device=runner.device)
        row = torch.arange(i * W, (i + n) * W, device=runner.device)                 # the n rows, raster order
        e = model.embed_tokens(x[:, above].repeat(rows // B, 1))                      # [rows, W, dim]
        pred = _heads.predict(heads, "vertical", range(1, n + 1), hid[:, above], e)  # [rows, W, n, dim]
        pred = pred.transpose(1, 2).reshape(rows, n * W, -1)                         # head k drafts row i + k - 1
        draft_calls += 1
        q = runner.probs(runner.outputs(model.head(pred), pred))                      # [B, nW, V]
        V = q.shape[-1]
        x[:, row] = draw(q.reshape(-1, V), gen, runner.backend).view(B, n * W)
        pos = row - 1                                                                # [last of above ; rows[:-1]]
        for _ in range(rounds):
            # The block is contiguous, so writing its keys in place changes nothing a query
            # of this pass sees (each sees the block up to itself, as with write=False), and the
            # next round or the commit pass overwrites them: the cheaper in-place path.
            out = runner.forward(x[:, pos], pos)
            p = runner.probs(out)                                                    # [B, nW, V]
            xr = x[:, row]
            p_tok = p.gather(2, xr[..., None])[..., 0]
            q_tok = q.gather(2, xr[..., None])[..., 0]
            verdict = verify(p_tok.view(B, n, W), q_tok.view(B, n, W), rule="ratio", mode="independent",
                             gen=gen, backend=runner.backend)
            redo = verdict.resample.view(B, n * W)
            amap = torch.zeros(B, H * W, dtype=torch.bool)
            amap[:, row.cpu()] = verdict.accept.view(B, n * W).cpu()
            stats.acceptance_maps.append(amap.view(B, H, W))
            stats.extra.setdefault("drafted", []).append(B * n * W)
            stats.extra.setdefault("accepted", []).append(int(verdict.accept.sum()))
            if bool(redo.any()):
                tok, resid = draw_residual(p[redo], q[redo], gen, runner.backend)
                xr = xr.clone()
                xr[redo] = tok
                x[:, row] = xr
                if round_q == "resampled":
                    q = q.clone()
                    q[redo] = resid   # reading: later rounds judge a resampled token against its own q
            if round_q == "previous":
                # After verify-and-correct every token of the row follows this round's p (kept ones
                # by acceptance, replaced ones by the residual), so the next round judges it
                # against p: a token whose left context did not change is kept for sure.
                q = p
        out = runner.forward(x[:, pos], pos)                                         # commit pass
        hid[:, row] = out.hidden
    stats.draft_forwards = draft_calls * B
    return x


def decode(target, classes, *, heads, rounds: int = 1, chunk: int = 5, vertical_heads: int = 1,
           round_q: str = "resampled", seed: int = 0, sampling: Sampling = Sampling(), tokenizer=None, backend=None,
           progress=None, batch_size: int = 1):
    """SSD with `rounds` verify-and-correct rounds per row group, `chunk` horizontal drafts per
    row-0 round and `vertical_heads` (1 or 2) rows drafted at once below a committed row.
    `round_q`: the q that rounds >= 2 judge a token against (ROUND_Q; module docstring)."""
    check_grid_model(target, "target")
    if heads is None:
        raise ValueError("ssd needs its spatial heads (heads=...; the default family ships them as ssd_heads)")
    rounds = check_rounds(rounds)
    if round_q not in ROUND_Q:
        raise ValueError(f"round_q must be one of {', '.join(ROUND_Q)}, got {round_q!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    chunk = min(chunk, _heads.num_heads(heads, "horizontal"))
    available = _heads.num_heads(heads, "vertical")
    if isinstance(vertical_heads, bool) or not isinstance(vertical_heads, int) or not 1 <= vertical_heads <= available:
        raise ValueError(f"vertical_heads must be an int in [1, {available}] (the heads' vertical count), "
                         f"got {vertical_heads!r}")
    cfg_w = getattr(getattr(heads, "config", None), "grid_width", None)
    if cfg_w is not None and cfg_w != target.grid[1]:
        raise ValueError(f"ssd heads were trained for grid width {cfg_w}, the target's grid is {tuple(target.grid)}")

    def run(cls, gen, stats):
        runner = ModelRunner(target, sampling, batch=cls.shape[0], backend=backend)
        x = decode_rows(runner, heads, cls, gen, stats, rounds=rounds, chunk=chunk, vertical_heads=vertical_heads,
                        round_q=round_q)
        stats.target_forwards = runner.forwards * cls.shape[0]
        return x

    return run_batches("ssd", target, classes, seed, run, batch_size=batch_size, tokenizer=tokenizer,
                       progress=progress)
