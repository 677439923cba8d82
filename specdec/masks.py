"""Masks for :func:`specdec.ops.tree_attention` (docs/design.md, "Kernel 3").

tree_attention sees key ``j`` from query ``i`` iff ``kv_valid[j]`` and ``kv_pos[j] <= q_pos[i]`` and,
when a ``tree_mask`` is given and ``j`` lies in the draft block (the last ``Nq`` key slots), bit
``j - (Nk - Nq)`` of row ``i`` of the tree mask is set. The tree mask is packed: row ``i`` holds
``ceil(Nq / 32)`` int32 words, bit ``b`` of word ``w`` (little-endian) is block column ``32 * w + b``.
Bits past column ``Nq - 1`` in the last word are ignored.

This module builds such masks:

- :func:`tree_from_parents`: EAGLE/Medusa draft trees from parent pointers, with depth-based
  position ids;
- :func:`segment_causal`, :func:`row_causal`, :func:`island_causal`: several independent causal
  chains in one block (multi-row drafting, concurrent island resampling);
- :func:`pack` / :func:`unpack`: dense boolean ``[..., Nq, Nq]`` <-> packed words;
- :func:`visibility` / :func:`from_dense`: the full rule as a dense ``[B, Nq, Nk]`` boolean mask, and back;
- :func:`flex_mask_mod`: the same rule as a FlexAttention ``mask_mod``.

Everything works on any device and on batched (leading ``B``) or unbatched inputs where noted.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

WORD_BITS = 32


def num_words(n: int) -> int:
    """Number of int32 words per packed row of an ``n``-column block."""
    return (n + WORD_BITS - 1) // WORD_BITS


def _bit_weights(device) -> torch.Tensor:
    # 1 << b for b in 0..31 as int64, so bit 31 does not overflow before the final int32 cast.
    return torch.ones(WORD_BITS, dtype=torch.int64, device=device) << torch.arange(WORD_BITS, device=device)


def pack(dense: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask ``[..., Nq, N]`` into int32 words ``[..., Nq, ceil(N/32)]``."""
    if dense.dtype != torch.bool:
        raise ValueError(f"dense must be a bool tensor, got {dense.dtype}")
    if dense.dim() < 1:
        raise ValueError("dense must have at least one dimension")
    n = dense.shape[-1]
    words = num_words(n)
    padded = torch.zeros(*dense.shape[:-1], words * WORD_BITS, dtype=torch.int64, device=dense.device)
    padded[..., :n] = dense.to(torch.int64)
    packed = (padded.view(*dense.shape[:-1], words, WORD_BITS) * _bit_weights(dense.device)).sum(-1)
    # Values are in [0, 2^32); reinterpret the top bit as the int32 sign (two's complement).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack int32 words ``[..., Nq, W]`` into a boolean mask ``[..., Nq, n]`` (``W >= ceil(n/32)``)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed must be int32, got {packed.dtype}")
    if packed.shape[-1] < num_words(n):
        raise ValueError(f"packed needs at least {num_words(n)} words per row for n={n}, got {packed.shape[-1]}")
    bits = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(WORD_BITS, device=packed.device)) & 1
    return bits.flatten(-2)[..., :n].bool()


class DraftTree(NamedTuple):
    """A draft tree ready for tree_attention."""

    tree_mask: torch.Tensor  #: int32 [B, N, ceil(N/32)]: each node sees itself and its ancestors
    depth: torch.Tensor  #: int64 [B, N]: 0 for a root (parent -1); q_pos = base + depth


def tree_from_parents(parents: torch.Tensor) -> DraftTree:
    """Tree mask and depths from parent pointers (EAGLE / Medusa draft trees).

    Args:
        parents: int ``[N]`` or ``[B, N]``; ``parents[i]`` is the block index of node ``i``'s
            parent, or -1 for a node hanging directly off the committed prefix. Parents must
            come before their children (``parents[i] < i``), the order every tree drafter emits.

    Node ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors. Use ``depth`` for
    position ids (``q_pos = prefix_len + depth``): siblings share a position, which is what makes
    the ``kv_pos <= q_pos`` part of the rule harmless inside the block (the tree bits decide there)
    as long as the block's keys carry the same depth-based positions.
    """
    if parents.dim() not in (1, 2):
        raise ValueError(f"parents must be [N] or [B, N], got shape {tuple(parents.shape)}")
    if parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be int32 or int64, got {parents.dtype}")
    batched = parents.dim() == 2
    par = (parents if batched else parents.unsqueeze(0)).to(torch.int64)
    b, n = par.shape
    idx = torch.arange(n, device=par.device)
    if n and bool(((par < -1) | (par >= idx)).any()):
        raise ValueError("parents: every entry must be -1 or the index of an earlier node (parents[i] < i)")
    visible = torch.zeros(b, n, n, dtype=torch.bool, device=par.device)
    depth = torch.zeros(b, n, dtype=torch.int64, device=par.device)
    rows = torch.arange(b, device=par.device)
    # Parents come first, so row i = own bit | row of its parent, built in one pass over nodes.
    for i in range(n):
        p = par[:, i]
        has_parent = p >= 0
        safe = p.clamp(min=0)
        inherited = visible[rows, safe] & has_parent.unsqueeze(-1)
        visible[:, i] = inherited
        visible[:, i, i] = True
        depth[:, i] = torch.where(has_parent, depth[rows, safe] + 1, torch.zeros_like(p))
    tree = DraftTree(pack(visible), depth)
    return tree if batched else DraftTree(tree.tree_mask[0], tree.depth[0])


def segment_causal(segment_ids: torch.Tensor) -> torch.Tensor:
    """Packed mask where block query ``i`` sees block key ``j`` iff they share a segment and ``j <= i``.

    ``segment_ids``: int ``[N]`` or ``[B, N]``. Several causal chains (rows drafted at the same
    time, islands resampled concurrently) live in one block without seeing each other.
    """
    if segment_ids.dim() not in (1, 2):
        raise ValueError(f"segment_ids must be [N] or [B, N], got shape {tuple(segment_ids.shape)}")
    n = segment_ids.shape[-1]
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril()
    return pack(same & causal)


def row_causal(q_pos: torch.Tensor, width: int) -> torch.Tensor:
    """Multi-row drafting (ZipAR-style): block tokens at raster positions ``q_pos`` (``[N]`` or
    ``[B, N]``) on a grid of ``width`` columns see earlier block tokens of their own row only."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return segment_causal(torch.div(q_pos, width, rounding_mode="floor"))


def island_causal(q_pos: torch.Tensor, islands: torch.Tensor) -> torch.Tensor:
    """Concurrent island resampling (MuLo-SD v2): block tokens at raster positions ``q_pos``
    (``[B, N]``) see earlier block tokens of their own island only. ``islands`` is the
    ``[B, H, W]`` int32 label grid of :func:`specdec.ops.verify_grid`."""
    if islands.dim() != 3 or q_pos.dim() != 2 or q_pos.shape[0] != islands.shape[0]:
        raise ValueError(f"island_causal needs q_pos [B, N] and islands [B, H, W], got "
                         f"{tuple(q_pos.shape)} and {tuple(islands.shape)}")
    labels = islands.flatten(1).gather(1, q_pos.to(torch.int64))
    return segment_causal(labels)


def visibility(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_valid: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The tree_attention rule as a dense boolean mask ``[B, Nq, Nk]`` (True = visible)."""
    nq, nk = q_pos.shape[-1], kv_pos.shape[-1]
    vis = kv_pos.unsqueeze(-2).to(torch.int64) <= q_pos.unsqueeze(-1).to(torch.int64)
    if kv_valid is not None:
        vis = vis & kv_valid.unsqueeze(-2)
    if tree_mask is not None:
        if nk < nq:
            raise ValueError(f"a tree_mask needs Nk >= Nq (the draft block is the last Nq key slots), got Nk={nk}, "
                             f"Nq={nq}")
        block = unpack(tree_mask, nq)
        vis = torch.cat([vis[..., : nk - nq], vis[..., nk - nq:] & block], dim=-1)
    return vis


def from_dense(
    dense: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The packed tree mask that, with these positions and validity, gives exactly ``dense``.

    ``dense`` is ``[B, Nq, Nk]`` bool. Its draft-block part (last ``Nq`` columns) becomes the tree
    mask; a ValueError is raised when ``dense`` asks for something the rule cannot express
    (a visible key that positions or validity hide, or any difference before the block).
    """
    nq, nk = q_pos.shape[-1], kv_pos.shape[-1]
    if dense.dtype != torch.bool or dense.shape[-2:] != (nq, nk):
        raise ValueError(f"dense must be bool [B, {nq}, {nk}], got {dense.dtype} {tuple(dense.shape)}")
    if nk < nq:
        raise ValueError(f"a tree_mask needs Nk >= Nq, got Nk={nk}, Nq={nq}")
    base = visibility(q_pos, kv_pos, kv_valid)
    tree_mask = pack(dense[..., nk - nq:])
    if not torch.equal(visibility(q_pos, kv_pos, kv_valid, tree_mask), dense.expand_as(base)):
        raise ValueError("dense: this mask is not expressible as positions + validity + a tree mask "
                         "(it shows a key that kv_pos/kv_valid hide, or differs before the draft block)")
    return tree_mask


def flex_mask_mod(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_valid: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
):
    """The tree_attention rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Tensors are captured by the closure, so it works eagerly and under torch.compile; it is
    written without data-dependent Python branches, as FlexAttention's vmap requires.
    """
    nq, nk = q_pos.shape[-1], kv_pos.shape[-1]
    if tree_mask is not None and nk < nq:
        raise ValueError(f"a tree_mask needs Nk >= Nq, got Nk={nk}, Nq={nq}")
    offset = nk - nq

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_pos[b, kv_idx] <= q_pos[b, q_idx]
        if kv_valid is not None:
            ok = ok & kv_valid[b, kv_idx]
        if tree_mask is not None:
            col = kv_idx - offset
            in_block = col >= 0
            safe = torch.where(in_block, col, torch.zeros_like(col))
            word = tree_mask[b, q_idx, safe // WORD_BITS]
            bit = ((word >> (safe % WORD_BITS)) & 1) == 1
            ok = ok & (bit | ~in_block)
        return ok

    return mask_mod


__all__ = ["WORD_BITS", "num_words", "pack", "unpack", "DraftTree", "tree_from_parents",
           "segment_causal", "row_causal", "island_causal", "visibility", "from_dense", "flex_mask_mod"]
