"""Result types of specdec's ops (named tuples, so they unpack like the raw op outputs)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class PooledProbs(NamedTuple):
    """Output of :func:`specdec.ops.pool_probs`, all float32 of shape [N]."""

    pooled: torch.Tensor  #: p(x) plus the neighbour mass moved onto x
    p_token: torch.Tensor  #: p(x) alone
    row_max: torch.Tensor  #: max of the guided, top-k-masked logits
    row_lse: torch.Tensor  #: logsumexp of the same: p(v) = exp(l(v) - row_lse)
