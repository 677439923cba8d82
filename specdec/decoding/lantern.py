"""`lantern`: raster speculative decoding with relaxed acceptance (LANTERN, ICLR 2025).

`sd` with p(x) replaced, in the acceptance ratio only, by the delta-pooled target probability of
kernel 1: the target mass of x's nearest codebook neighbours (by latent distance) is moved onto x
while the moved mass stays <= delta, so each token's distribution moves by at most delta in
total variation. Reading (docs/decoders.md): on rejection the residual is that of the unpooled p.
Defaults are LANTERN's code: k = 1000 neighbours (capped at V - 1), delta = 0.1.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import torch

from specdec.decoding.common import Sampling
from specdec.decoding.sd import speculative_decode
from specdec.neighbors import knn_table


# The tables of the last few codebooks: a decoder call builds its table from the codebook, and
# decoding image by image would rebuild it for every image (a sort over V x V distances; 7 ms,
# 10% of a compiled MuLo-SD image on the embedded family). Keyed by the codebook's contents (a
# digest of its bytes: families hand out a freshly normalised tensor on every call, so its
# storage says nothing), shape, dtype and device.
_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def neighbor_table(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """LANTERN's table: the min(k, V - 1) nearest codebook entries of each token (kept for the
    last few codebooks asked)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if not isinstance(codebook, torch.Tensor) or codebook.dim() != 2:
        return knn_table(codebook, k)   # knn_table names the bad argument
    digest = hashlib.sha1(codebook.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
    key = (digest, tuple(codebook.shape), codebook.dtype, codebook.device, k)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    table = _TABLES[key] = knn_table(codebook, min(k, codebook.shape[0] - 1))
    while len(_TABLES) > 4:
        _TABLES.popitem(last=False)
    return table


def check_delta(delta) -> float:
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not (delta >= 0 and math.isfinite(delta)):
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    return float(delta)


def decode(target, classes, *, codebook=None, neighbors=None, k: int = 1000, delta: float = 0.1, drafter=None,
           heads=None, chunk: int = 4, seed: int = 0, first_index: int = 0, sampling: Sampling = Sampling(), tokenizer=None,
           backend=None, progress=None, batch_size: int = 1, compile: bool = False):
    delta = check_delta(delta)
    if neighbors is None:
        if codebook is None:
            raise ValueError("lantern needs the codebook (or a precomputed neighbors table)")
        if codebook.shape[0] != target.vocab_size:
            raise ValueError(f"codebook has {codebook.shape[0]} entries, the target's vocabulary {target.vocab_size}")
        neighbors = neighbor_table(codebook, k)
    return speculative_decode("lantern", target, classes, drafter=drafter, heads=heads, chunk=chunk, seed=seed,
                              sampling=sampling, tokenizer=tokenizer, backend=backend, progress=progress,
                              batch_size=batch_size, neighbors=neighbors, delta=delta, first_index=first_index,
                              compile=compile)
