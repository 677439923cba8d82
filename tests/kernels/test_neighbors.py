"""specdec.neighbors.knn_table against brute force (torch.cdist + a stable full sort)."""
import pytest
import torch
from hypothesis import given, strategies as st

from specdec.neighbors import knn_table


@given(seed=st.integers(0, 2**31 - 1), v=st.integers(1, 120), d=st.integers(1, 6), frac=st.floats(0, 1))
def test_matches_brute_force(seed, v, d, frac):
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(v, d, generator=g)
    k = int(frac * (v - 1))
    table = knn_table(codebook, k, chunk_rows=17)  # odd chunking exercises the chunk edges
    dist = torch.cdist(codebook.double(), codebook.double())
    dist.fill_diagonal_(float("inf"))
    want = torch.sort(dist, dim=1, stable=True).indices[:, :k]
    assert table.dtype == torch.int32 and table.shape == (v, k)
    # Equal distances are measure-zero for Gaussian codebooks, so the order is unique.
    assert torch.equal(table.long(), want)
    assert not (table.long() == torch.arange(v)[:, None]).any(), "self must be excluded"


def test_ties_are_ordered_by_id():
    # Points on a line at integer spacing: neighbours at equal distance on both sides.
    codebook = torch.arange(9, dtype=torch.float32)[:, None]
    table = knn_table(codebook, 4)
    assert table[4].tolist() == [3, 5, 2, 6]


def test_int16_and_errors():
    codebook = torch.randn(20, 4)
    assert knn_table(codebook, 5, dtype=torch.int16).dtype == torch.int16
    with pytest.raises(ValueError, match="k"):
        knn_table(codebook, 20)
    with pytest.raises(ValueError, match="k"):
        knn_table(codebook, -1)
    with pytest.raises(ValueError, match="codebook"):
        knn_table(codebook[0], 1)
    bad = codebook.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="codebook"):
        knn_table(bad, 2)
    with pytest.raises(ValueError, match="dtype"):
        knn_table(codebook, 2, dtype=torch.int64)


def test_decoders_table_is_kept_per_codebook_and_rebuilt_after_an_edit():
    """neighbor_table (what lantern and mulo call per decode) keeps the table of a codebook it has
    seen (by contents: families hand out a new normalised tensor per call), and an edited codebook
    gets its own."""
    from specdec.decoding.lantern import neighbor_table

    codebook = torch.randn(30, 4)
    first = neighbor_table(codebook, 5)
    assert neighbor_table(codebook, 5) is first
    assert neighbor_table(codebook.clone(), 5) is first        # the same contents in a new tensor
    assert torch.equal(first, knn_table(codebook, 5))
    assert neighbor_table(codebook, 3).shape == (30, 3)
    codebook[0] += 100.0                       # entry 0 moves far away from every other
    edited = neighbor_table(codebook, 5)
    assert edited is not first and torch.equal(edited, knn_table(codebook, 5))
    assert not torch.equal(edited, first)
    assert neighbor_table(codebook.clone(), 50).shape == (30, 29)   # k capped at V - 1
    with pytest.raises(ValueError, match="k must be"):
        neighbor_table(codebook, -1)
