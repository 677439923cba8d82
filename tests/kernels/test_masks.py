"""specdec.masks: packing round trips, tree / segment / row / island masks against direct
definitions written out with Python loops, the dense <-> packed conversions and the
FlexAttention mask_mod against the dense rule."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import masks


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), nq=st.integers(1, 70), n=st.integers(1, 100))
def test_pack_unpack_round_trip(seed, b, nq, n):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(b, nq, n, generator=gen) > 0.5
    packed = masks.pack(dense)
    assert packed.dtype == torch.int32 and packed.shape == (b, nq, (n + 31) // 32)
    assert torch.equal(masks.unpack(packed, n), dense)


def test_pack_is_little_endian_per_word():
    dense = torch.zeros(1, 40, dtype=torch.bool)
    for col in (0, 5, 31, 32, 39):
        dense[0, col] = True
    packed = masks.pack(dense)
    words = [int(w) & 0xFFFFFFFF for w in packed[0]]
    assert words[0] == (1 << 0) | (1 << 5) | (1 << 31)
    assert words[1] == (1 << 0) | (1 << 7)


def test_unpack_ignores_bits_past_the_block():
    packed = torch.tensor([[-1]], dtype=torch.int32)  # all 32 bits set
    assert torch.equal(masks.unpack(packed, 3), torch.ones(1, 3, dtype=torch.bool))


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = int(parents[i])
        out.add(i)
    return out


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 70), b=st.integers(1, 2))
def test_tree_from_parents_is_the_ancestor_relation(seed, n, b):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([
        torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)])
        for _ in range(b)])
    tree = masks.tree_from_parents(parents)
    dense = masks.unpack(tree.tree_mask, n)
    for bi in range(b):
        par = parents[bi].tolist()
        for i in range(n):
            anc = ancestors(par, i)
            assert dense[bi, i].tolist() == [j in anc for j in range(n)]
            assert int(tree.depth[bi, i]) == len(anc) - 1


def test_tree_from_parents_unbatched_and_bad_parents():
    tree = masks.tree_from_parents(torch.tensor([-1, 0, 0, 1]))
    assert tree.tree_mask.shape == (4, 1) and tree.depth.tolist() == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="parents"):
        masks.tree_from_parents(torch.tensor([-1, 2, 0]))  # a parent after its child
    with pytest.raises(ValueError, match="parents"):
        masks.tree_from_parents(torch.tensor([-1, -2]))


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 70), segments=st.integers(1, 5))
def test_segment_causal(seed, n, segments):
    gen = torch.Generator().manual_seed(seed)
    seg = torch.randint(0, segments, (2, n), generator=gen)
    dense = masks.unpack(masks.segment_causal(seg), n)
    for b in range(2):
        for i in range(n):
            assert dense[b, i].tolist() == [bool(seg[b, j] == seg[b, i] and j <= i) for j in range(n)]


def test_row_causal_and_island_causal():
    width = 4
    q_pos = torch.tensor([[1, 2, 5, 6, 3, 7]])
    dense = masks.unpack(masks.row_causal(q_pos, width), 6)
    rows = (q_pos // width)[0].tolist()
    for i in range(6):
        assert dense[0, i].tolist() == [rows[j] == rows[i] and j <= i for j in range(6)]
    islands = torch.full((1, 3, 4), -1, dtype=torch.int32)
    islands[0, 0, 1:3] = 1  # positions 1, 2
    islands[0, 1, 1:3] = 1  # positions 5, 6
    islands[0, 0, 3] = 3
    islands[0, 1, 3] = 3  # positions 3, 7
    dense = masks.unpack(masks.island_causal(q_pos, islands), 6)
    label = islands.flatten(1)[0, q_pos[0]].tolist()
    for i in range(6):
        assert dense[0, i].tolist() == [label[j] == label[i] and j <= i for j in range(6)]


def brute_visibility(q_pos, kv_pos, kv_valid, tree_dense):
    b, nq = q_pos.shape
    nk = kv_pos.shape[1]
    out = torch.zeros(b, nq, nk, dtype=torch.bool)
    for bi in range(b):
        for i in range(nq):
            for j in range(nk):
                ok = bool(kv_pos[bi, j] <= q_pos[bi, i]) and (kv_valid is None or bool(kv_valid[bi, j]))
                if tree_dense is not None and j >= nk - nq:
                    ok = ok and bool(tree_dense[bi, i, j - (nk - nq)])
                out[bi, i, j] = ok
    return out


def random_rule(gen, b=2, nq=9, nk=20):
    kv_pos = torch.stack([torch.randperm(nk, generator=gen) for _ in range(b)])
    q_pos = torch.randint(-2, nk + 2, (b, nq), generator=gen)
    kv_valid = torch.rand(b, nk, generator=gen) > 0.3
    tree_dense = torch.rand(b, nq, nq, generator=gen) > 0.4
    return q_pos, kv_pos, kv_valid, tree_dense


@pytest.mark.parametrize("seed", range(4))
def test_visibility_matches_the_rule_and_from_dense_inverts_it(seed):
    gen = torch.Generator().manual_seed(seed)
    q_pos, kv_pos, kv_valid, tree_dense = random_rule(gen)
    tree = masks.pack(tree_dense)
    dense = masks.visibility(q_pos, kv_pos, kv_valid, tree)
    assert torch.equal(dense, brute_visibility(q_pos, kv_pos, kv_valid, tree_dense))
    assert torch.equal(masks.visibility(q_pos, kv_pos, kv_valid), brute_visibility(q_pos, kv_pos, kv_valid, None))
    back = masks.from_dense(dense, q_pos, kv_pos, kv_valid)
    assert torch.equal(masks.visibility(q_pos, kv_pos, kv_valid, back), dense)


def test_from_dense_rejects_masks_the_rule_cannot_express():
    q_pos = torch.tensor([[3, 4]])
    kv_pos = torch.arange(5).unsqueeze(0)
    dense = masks.visibility(q_pos, kv_pos)
    dense[0, 0, 0] = False  # hides a prefix key that positions show
    with pytest.raises(ValueError, match="not expressible"):
        masks.from_dense(dense, q_pos, kv_pos)
    dense = masks.visibility(q_pos, kv_pos)
    dense[0, 0, 4] = True  # shows a later key
    with pytest.raises(ValueError, match="not expressible"):
        masks.from_dense(dense, q_pos, kv_pos)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_valid,with_tree", [(False, False), (True, False), (True, True)])
def test_flex_mask_mod_matches_visibility(seed, with_valid, with_tree):
    gen = torch.Generator().manual_seed(seed)
    q_pos, kv_pos, kv_valid, tree_dense = random_rule(gen, nq=40, nk=50)
    kv_valid = kv_valid if with_valid else None
    tree = masks.pack(tree_dense) if with_tree else None
    mask_mod = masks.flex_mask_mod(q_pos, kv_pos, kv_valid, tree)
    b = torch.arange(2).view(2, 1, 1)
    qi = torch.arange(40).view(1, 40, 1)
    ki = torch.arange(50).view(1, 1, 50)
    got = mask_mod(b, torch.zeros((), dtype=torch.int64), qi, ki)
    assert torch.equal(got, masks.visibility(q_pos, kv_pos, kv_valid, tree))
