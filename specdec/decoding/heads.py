"""SSD's spatial heads: predict the target's pre-norm hidden state of a neighbouring token.

Each head maps `[h ; e]` to a predicted hidden state: `h` is the target's last-layer hidden state
(before the final RMSNorm) that gave token `x` at raster index `t`, `e` the input embedding of `x`.
Horizontal head `k` (k = 1..5) predicts the hidden state giving token `t + k`'s distribution,
vertical head `k` (k = 1..2) token `t + k * W`'s (docs/decoders.md, "ssd"); each computes

    f(z) = W0 z + SwiGLU(RMSNorm(W0 z)),   z = [h ; e]

The heads live in `specdec.models.ssd_heads` (`SSDHeads`); any module with `horizontal` and
`vertical` sequences of heads taking `[h ; e]` works here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec.decoding.blocks import power_of_two
from specdec.decoding.runner import weights_key
from specdec.decoding.uploads import to_device
from specdec.models.protocol import image_rows


def _heads(heads, kind: str):
    found = getattr(heads, kind, None)
    if found is None or len(found) == 0:
        raise ValueError(f"ssd heads: `{kind}` heads missing (expected a sequence of head modules)")
    return found


def num_heads(heads, kind: str) -> int:
    return len(_heads(heads, kind))


def draft(runner, heads, kind: str, offsets, h: torch.Tensor, tokens: torch.Tensor,
          rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """SSD's draft distributions q [B, n * ..., V] (head offsets[0]'s block first) from heads `kind`
    number `offsets` (1-based): the target `runner`'s final norm, LM head and sampling on the heads'
    predictions from h [rows, ..., dim], the target's hidden states that gave `tokens` [rows, ...]
    (CFG rows included). On a compiled runner, one compiled graph per shape instead of some twenty
    eager ops.

    The heads run over the images `rows` alone (sorted; None: those the runner's passes cover,
    `ModelRunner.cover`), padded to a power of two with copies of the first so that a compiled
    runner meets few shapes; every other image gets the first one's q (a valid distribution, for
    rows that draw nothing from it)."""
    offsets = tuple(offsets)
    B = runner.batch
    rows = list(range(runner.covered) if rows is None else rows)
    some = len(rows) < B
    if some:
        count = power_of_two(len(rows))
        index = to_device(rows + rows[:1] * (count - len(rows)), h.device, torch.long)
        cache_rows = image_rows(index, h.shape[0] // B)
        h, tokens = h.index_select(0, cache_rows), tokens.index_select(0, cache_rows)

    def make():
        model, seq = runner.model, _heads(heads, kind)
        if not all(1 <= k <= len(seq) for k in offsets):     # (seq[0 - 1] would be the last head)
            raise ValueError(f"ssd heads: {kind} offsets {list(offsets)} asked, {len(seq)} heads available")

        def fn(h, tokens):
            z = torch.cat([h, model.embed_tokens(tokens).to(h.dtype)], dim=-1)
            pred = torch.stack([seq[k - 1](z) for k in offsets], dim=1)             # [rows, n, ..., dim]
            pred = pred.reshape(pred.shape[0], -1, pred.shape[-1])
            return (runner.probs(runner.outputs(model.head(pred), pred)),)   # (compiled: a tuple of outputs)
        return fn

    # The graphs keep no guards: the key names what they depend on (a heads module cast to another
    # dtype or moved gets new graphs).
    key = ("heads", heads, weights_key(heads), kind, offsets, tuple(h.shape))
    q = runner.function(key, make)(h, tokens)[0]
    if not some:
        return q
    at = {b: i for i, b in enumerate(rows)}
    return q.index_select(0, to_device([at.get(b, 0) for b in range(B)], q.device, torch.long))
