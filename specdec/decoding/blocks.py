"""The shapes of a pass that images share: blocks padded with re-feeds, and per-image selections.

A forward needs the same number of tokens in every row of the batch, so rows with fewer real
tokens (near the end of the grid, or finished) are padded with *re-feeds*: committed tokens fed
again at their own slots, whose keys and values come out as they were (their context is all
committed), so padding never changes a result.
"""
from __future__ import annotations

import torch

from specdec.decoding.runner import Outputs
from specdec.models.protocol import cfg_rows


def power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1): the sizes passes over some rows come in, one
    compiled graph per size, as a serving engine pads its batch to its graph sizes."""
    return 1 << (n - 1).bit_length()


def padded_block(start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """Positions [B, width]: row b holds start[b] .. start[b] + count[b] - 1, then re-feed slots
    start[b] - 1, start[b] - 2, ...; where those would fall before the grid (a row that has just
    started beside rows further on: a rolling batch), its last position again, which writes the
    same keys and values at the same slot and sees what that token sees."""
    j = torch.arange(width, device=start.device)[None]
    real = start[:, None] + j
    pad = start[:, None] - 1 - (j - count[:, None])
    pad = torch.where(pad >= 0, pad, real[:, :1] + count[:, None] - 1)
    return torch.where(j < count[:, None], real, pad)


def gather_rows(o: Outputs, index: torch.Tensor) -> Outputs:
    """Outputs at one block index per row: index [B] -> Outputs with N = 1."""
    B = o.cond.shape[0]
    ar = torch.arange(B, device=index.device)
    hid_rows = o.hidden.shape[0]
    hid_idx = cfg_rows(index, hid_rows // B)
    return Outputs(o.cond[ar, index][:, None], None if o.uncond is None else o.uncond[ar, index][:, None],
                   o.hidden[torch.arange(hid_rows, device=index.device), hid_idx][:, None],
                   None if o.probs is None else o.probs[ar, index][:, None])


def fit_right(q: torch.Tensor, width: int) -> torch.Tensor:
    """q [B, w, V], right-aligned at a span's end, as `width` columns (cut or zero-padded on the left)."""
    w = q.shape[1]
    if w >= width:
        return q[:, w - width:]
    return torch.cat([q.new_zeros(q.shape[0], width - w, q.shape[2]), q], 1)


__all__ = ["fit_right", "gather_rows", "padded_block", "power_of_two"]
