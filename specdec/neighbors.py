"""Codebook k-nearest-neighbour tables for LANTERN-style probability pooling."""
from __future__ import annotations

import torch


def knn_table(codebook: torch.Tensor, k: int, *, dtype: torch.dtype = torch.int32,
              chunk_rows: int = 1024) -> torch.Tensor:
    """neighbors[x] = the k codebook entries nearest to entry x by L2 distance, self excluded.

    Ordered by ascending distance; among the selected neighbours, equal distances are ordered
    by ascending id, so the table is deterministic. Distances are computed in float64, `chunk_rows`
    rows at a time (memory chunk_rows x V), so tables for V = 16384 codebooks fit on a laptop.

    Args:
        codebook: [V, D] codebook vectors (the VQ's embedding table, as the decoder sees it).
        k: neighbours per entry, 0 <= k <= V - 1.
        dtype: torch.int32 (default) or torch.int16 (V <= 32767).
    Returns:
        [V, k] tensor of ids on the codebook's device.
    """
    if not isinstance(codebook, torch.Tensor) or codebook.dim() != 2:
        raise ValueError(f"codebook must be a 2-D [V, D] tensor, got {getattr(codebook, 'shape', codebook)!r}")
    v = codebook.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= v - 1:
        raise ValueError(f"k must be an int in [0, V - 1] = [0, {v - 1}], got {k!r}")
    if dtype not in (torch.int32, torch.int16):
        raise ValueError(f"dtype must be torch.int32 or torch.int16, got {dtype}")
    if dtype == torch.int16 and v > 32767:
        raise ValueError(f"dtype=torch.int16 needs V <= 32767, got V = {v}")
    if not torch.isfinite(codebook).all():
        raise ValueError("codebook holds NaN or inf entries")
    cb = codebook.detach().to(torch.float64)
    sq = (cb * cb).sum(1)
    out = torch.empty(v, k, dtype=torch.int64, device=codebook.device)
    ids = torch.arange(v, device=codebook.device)
    for start in range(0, v, chunk_rows):
        rows = cb[start:start + chunk_rows]
        d = sq[start:start + chunk_rows, None] + sq[None, :] - 2.0 * rows @ cb.T
        d = d.clamp_min_(0.0)
        local = torch.arange(rows.shape[0], device=codebook.device)
        d[local, ids[start:start + rows.shape[0]]] = float("inf")  # self excluded
        if k == 0:
            continue
        # topk selects; the (id, then stable distance) sorts fix the order of equal distances.
        dist, idx = torch.topk(d, k, dim=1, largest=False, sorted=False)
        idx, by_id = torch.sort(idx, dim=1)
        dist = dist.gather(1, by_id)
        order = torch.sort(dist, dim=1, stable=True).indices
        out[start:start + rows.shape[0]] = idx.gather(1, order)
    return out.to(dtype)
