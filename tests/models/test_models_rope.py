"""LlamaGen's 2-D rotary embedding, checked against complex multiplication by the angles the
layout defines (rows on the first half of the pairs, columns on the second)."""
import pytest
import torch

from specdec.models.rope import apply_rope, rope_table_2d


@pytest.mark.parametrize("grid, head_dim, prefix", [(4, 8, 1), (3, 16, 2), (5, 12, 1)])
def test_table_layout(grid, head_dim, prefix):
    table = rope_table_2d(grid, head_dim, 10000.0, prefix)
    assert table.shape == (prefix + grid * grid, head_dim // 2, 2)
    assert torch.equal(table[:prefix], torch.zeros(prefix, head_dim // 2, 2))
    q = head_dim // 4
    freqs = torch.tensor([10000.0 ** (-4.0 * k / head_dim) for k in range(q)])
    for i in range(grid):
        for j in range(grid):
            angles = torch.cat([i * freqs, j * freqs])
            row = table[prefix + i * grid + j]
            torch.testing.assert_close(row[:, 0], angles.cos())
            torch.testing.assert_close(row[:, 1], angles.sin())


@pytest.mark.parametrize("grid, head_dim", [((3, 5), 8), ((6, 2), 12), ((1, 4), 8)])
def test_non_square_table_rotates_rows_and_columns(grid, head_dim):
    """An H x W grid: token (i, j) at slot prefix + i W + j rotates the first half of its pairs by
    i, the second half by j (a square grid's table is the same rule with H = W)."""
    H, W = grid
    table = rope_table_2d(grid, head_dim, 10000.0, 1)
    assert table.shape == (1 + H * W, head_dim // 2, 2)
    q = head_dim // 4
    freqs = torch.tensor([10000.0 ** (-4.0 * k / head_dim) for k in range(q)])
    for i in range(H):
        for j in range(W):
            angles = torch.cat([i * freqs, j * freqs])
            torch.testing.assert_close(table[1 + i * W + j, :, 0], angles.cos())
            torch.testing.assert_close(table[1 + i * W + j, :, 1], angles.sin())
    assert torch.equal(rope_table_2d((4, 4), head_dim), rope_table_2d(4, head_dim))


def test_apply_equals_complex_rotation_of_interleaved_pairs():
    torch.manual_seed(0)
    table = rope_table_2d(4, 8, 10000.0, 1)
    x = torch.randn(2, 17, 3, 8)
    out = apply_rope(x, table[None])
    xc = torch.view_as_complex(x.reshape(2, 17, 3, 4, 2))
    rot = torch.complex(table[..., 0], table[..., 1])[None, :, None]
    torch.testing.assert_close(out, torch.view_as_real(xc * rot).flatten(3))
    # grid slots are rotations (norm kept); the prefix slot is zeroed, as in LlamaGen
    torch.testing.assert_close(out[:, 1:].norm(dim=-1), x[:, 1:].norm(dim=-1))
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))


def test_dtype_is_kept_and_math_is_fp32():
    table = rope_table_2d(4, 8, 10000.0, 1)
    x = torch.randn(1, 17, 2, 8).to(torch.bfloat16)
    out = apply_rope(x, table[None])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), apply_rope(x.float(), table[None]), atol=1e-2, rtol=1e-2)


def test_head_dim_must_split_in_four():
    with pytest.raises(ValueError, match="head_dim"):
        rope_table_2d(4, 6)
