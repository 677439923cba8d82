"""`lantern`: raster speculative decoding with relaxed acceptance (LANTERN, ICLR 2025).

`sd` with p pooled over each token's nearest codebook neighbours (by latent distance; kernel 1) in
the acceptance ratio only; delta, the reading adopted and the defaults: docs/decoders.md, "lantern".
"""
from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec.decoding import sd
from specdec.decoding.sd import speculative_decode
from specdec.neighbors import knn_table
from specdec.settings import RunSettings, check_int


# The tables of the last few codebooks: decoding image by image would otherwise rebuild one per
# image (a sort over V x V distances, a sizeable share of a compiled MuLo-SD image on a small
# model). Keyed by a digest of the codebook's bytes (families hand out a freshly normalised tensor
# on every call, so its storage says nothing), shape, dtype, device and k.
_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLES_LOCK = threading.Lock()


def neighbor_table(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """LANTERN's table: the min(k, V - 1) nearest codebook entries of each token (`_TABLES`)."""
    check_k(k)
    if not isinstance(codebook, torch.Tensor) or codebook.dim() != 2:
        return knn_table(codebook, k)   # knn_table names the bad argument
    digest = hashlib.sha1(codebook.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
    key = (digest, tuple(codebook.shape), codebook.dtype, codebook.device, k)
    with _TABLES_LOCK:      # (decodes in other threads: one's eviction between another's get and move)
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = knn_table(codebook, min(k, codebook.shape[0] - 1))
    with _TABLES_LOCK:
        _TABLES[key] = table
        while len(_TABLES) > 4:
            _TABLES.popitem(last=False)
    return table


def check_delta(delta) -> float:
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not (delta >= 0 and math.isfinite(delta)):
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    return float(delta)


def check_k(k) -> int:
    return check_int(k, "k")


@dataclass(frozen=True)
class LanternOptions:
    chunk: int = 4       #: tokens drafted per target pass
    k: int = 1000        #: neighbours per token in the table (capped at V - 1)
    delta: float = 0.1   #: the total-variation budget of the moved mass (LANTERN's code default)

    def __post_init__(self):
        check_int(self.chunk, "chunk", 1)
        check_k(self.k)
        check_delta(self.delta)


def decode(target, conditions, *, drafter=None, heads=None, codebook=None, neighbors=None, tokenizer=None,
           options: LanternOptions = LanternOptions(), run: RunSettings = RunSettings()):
    """LANTERN on `target`: `sd` (a same-grid `drafter` model or SSD's horizontal `heads`) with
    the delta-pooled p in the acceptance ratio, neighbours from `neighbors` (a [V, K] table) or
    built from the `codebook` [V, D]."""
    if neighbors is None:
        if codebook is None:
            raise ValueError("lantern needs the codebook (or a precomputed neighbors table)")
        if codebook.shape[0] != target.vocab_size:
            raise ValueError(f"codebook has {codebook.shape[0]} entries, the target's vocabulary {target.vocab_size}")
        neighbors = neighbor_table(codebook, options.k)
    return speculative_decode("lantern", target, conditions, drafter=drafter, heads=heads, chunk=options.chunk,
                              run=run, tokenizer=tokenizer, neighbors=neighbors, delta=options.delta)


OPTIONS = LanternOptions
PRESETS = {}
#: The models lantern takes besides its target: sd's drafter or heads, and the codebook or neighbours.
TAKES = ("drafter", "heads", "codebook", "neighbors")


def resources(family, given: dict, options=None) -> dict:
    """sd's drafter or heads (`sd.resources`), and the neighbours given or the family's codebook."""
    res = {"codebook": given.get("codebook"), "neighbors": given.get("neighbors"), **sd.resources(family, given)}
    if res["neighbors"] is None and res["codebook"] is None:
        res["codebook"] = family.codebook
    return res
