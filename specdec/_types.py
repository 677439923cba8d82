"""Result types of specdec's ops (named tuples, so they unpack like the raw op outputs)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class PooledProbs(NamedTuple):
    """Output of :func:`specdec.ops.pool_probs`, all float32 of shape [N]."""

    pooled: torch.Tensor  #: p(x) plus the neighbour mass moved onto x
    p_token: torch.Tensor  #: p(x) alone
    row_max: torch.Tensor  #: max of the guided, top-k-masked logits
    row_lse: torch.Tensor  #: logsumexp of the same, row_max + log(sum): p(v) = exp((l(v) - row_max) - log(sum))


class GridVerdict(NamedTuple):
    """Output of :func:`specdec.ops.verify_grid` for drafts on B grids of H x W positions."""

    accept: torch.Tensor  #: bool [B, H, W]: valid and kept
    resample: torch.Tensor  #: bool [B, H, W]: R_X, the positions to resample
    first_reject: torch.Tensor  #: int32 [B]: smallest rejected raster index (H * W if none)
    #: int32 [B, H, W]: 8-connected component of R_X, labelled by its smallest raster index; -1 outside
    islands: torch.Tensor
    num_islands: torch.Tensor  #: int32 [B]: number of islands


class SampleResult(NamedTuple):
    """Output of :func:`specdec.ops.sample_residual` for M rows."""

    tokens: torch.Tensor  #: int32 [M], always in [0, V)
    fallback: torch.Tensor  #: bool [M]: the residual max(0, p - q) was zero, the token was drawn from p
