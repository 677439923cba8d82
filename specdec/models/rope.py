"""LlamaGen's 2-D rotary position embedding.

Each head's `head_dim` channels form `head_dim / 2` interleaved pairs (x0, x1), (x2, x3), ...;
the first half of the pairs rotates with the token's row, the second half with its column,
both at frequencies `base ** (-2k / (head_dim / 2))`. The condition (prefix) slots get a zero
"rotation" (cos = sin = 0), which zeroes their q and k: LlamaGen does this, and checkpoints
trained with it depend on it (prefix keys then score 0 against every query).
"""
from __future__ import annotations

import torch


def rope_table_2d(grid_size, head_dim: int, base: float = 10000.0, prefix_len: int = 1) -> torch.Tensor:
    """[prefix_len + H * W, head_dim // 2, 2] table of (cos, sin), indexed by slot. `grid_size`:
    tokens per side (a square grid, LlamaGen's) or (H, W); token (i, j) rotates its first half of
    pairs by row i, its second half by column j."""
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for 2-D rotary embedding, got {head_dim}")
    H, W = (grid_size, grid_size) if isinstance(grid_size, int) else (int(grid_size[0]), int(grid_size[1]))
    if H < 1 or W < 1:
        raise ValueError(f"grid_size must be positive, got {grid_size!r}")
    quarter = head_dim // 4
    # Explicit CPU: the table must be real numbers even when a model is built on the meta device.
    freqs = 1.0 / (base ** (torch.arange(0, 2 * quarter, 2, device="cpu")[:quarter].float() / (2 * quarter)))
    rows = torch.outer(torch.arange(H, device="cpu").float(), freqs)   # [H, head_dim / 4]
    cols = torch.outer(torch.arange(W, device="cpu").float(), freqs)   # [W, head_dim / 4]
    grid = torch.cat([rows[:, None, :].expand(-1, W, -1),      # row frequencies
                      cols[None, :, :].expand(H, -1, -1)],     # column frequencies
                     dim=-1)                                    # [H, W, head_dim / 2]
    table = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(prefix_len, head_dim // 2, 2, device="cpu"), table])


def rotation_factors(cos_sin: torch.Tensor):
    """cos_sin [..., D/2, 2] -> (c, s) [..., 1, D/2, 2] with c = (cos, cos), s = (-sin, sin) per pair,
    for apply_rope; computed once per forward and shared by q and k of every layer."""
    c = cos_sin[..., 0:1].expand(*cos_sin.shape[:-1], 2)
    s = torch.cat([-cos_sin[..., 1:2], cos_sin[..., 1:2]], dim=-1)
    return c.unsqueeze(-3), s.unsqueeze(-3)


def apply_rope(x: torch.Tensor, cos_sin) -> torch.Tensor:
    """Rotate x [B, N, H, D] by cos_sin [B or 1, N, D/2, 2] (or its rotation_factors); computed in
    fp32, returned in x's dtype."""
    # (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) written as x * (c, c) + swap(x) * (-s, s): the same
    # fp32 operations (a + (-b) == a - b exactly), fewer passes over memory.
    c, s = rotation_factors(cos_sin) if isinstance(cos_sin, torch.Tensor) else cos_sin
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    out = pairs * c + pairs.flip(-1) * s
    return out.flatten(3).type_as(x)
