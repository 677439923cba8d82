"""The ARImageModel protocol on a tiny random LlamaGen-style GPT: cached incremental decoding
equals a full causal pass; slot writes, invalidation, overwrites, tree masks and the CFG batch."""
import pytest
import torch

import specdec
from specdec.models import ARImageModel, GPTConfig, LlamaGenGPT, cfg_logits, split_cfg
from specdec.models.attention import attend
from specdec.models.kv_cache import SlotKVCache

ATOL = 2e-5


def tiny(grid=4, *, n_kv_head=None, seed=0, vocab=24, classes=3, n_head=2):
    H, W = (grid, grid) if isinstance(grid, int) else grid
    torch.manual_seed(seed)
    m = LlamaGenGPT(GPTConfig(vocab_size=vocab, dim=32, n_layer=2, n_head=n_head, n_kv_head=n_kv_head,
                              multiple_of=16, num_classes=classes, grid_size=H, grid_width=None if H == W else W))
    with torch.no_grad():  # far from LlamaGen's tiny init, so that every position matters
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.eval()


def backends():
    return [None, "reference"] + [b for b in specdec.available_backends(torch.device("cpu"))
                                  if b not in ("reference", "triton")]


def test_satisfies_protocol():
    assert isinstance(tiny(), ARImageModel)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("n_kv_head", [None, 1])
def test_incremental_one_token_equals_full_pass(backend, n_kv_head):
    m = tiny(n_kv_head=n_kv_head)
    tokens = torch.randint(0, 24, (3, 16))
    classes = torch.tensor([0, 2, 3])  # 3 = the null class
    full = m.teacher_forward(tokens, classes)
    cache = m.new_cache(3)
    outs = [m.prefill(cache, classes, backend=backend)]
    for u in range(16):
        outs.append(m.forward_tokens(cache, tokens[:, u:u + 1], torch.tensor([u]), backend=backend))
    torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), full.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([o.hidden for o in outs], 1), full.hidden, atol=ATOL, rtol=0)
    assert cache.valid.all()


@pytest.mark.parametrize("grid", [(3, 5), (5, 2)])
def test_non_square_grid_incremental_equals_full_pass(grid):
    """An H x W grid (H != W): one token at a time through the cache equals the causal pass, the
    2-D rotary embedding over (row, column) of the H x W grid; positions past H W are refused."""
    H, W = grid
    m = tiny(grid)
    assert m.grid == grid and m.n_slots == 1 + H * W
    tokens = torch.randint(0, 24, (2, H * W), generator=torch.Generator().manual_seed(1))
    classes = torch.tensor([1, 0])
    full = m.teacher_forward(tokens, classes)
    cache = m.new_cache(2)
    outs = [m.prefill(cache, classes)]
    for u in range(H * W):
        outs.append(m.forward_tokens(cache, tokens[:, u:u + 1], torch.tensor([u])))
    torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), full.logits, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=f"positions must lie in \\[0, {H * W}\\)"):
        m.forward_tokens(cache, tokens[:, :1], torch.tensor([H * W]))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("split", [1, 5, 15])
def test_incremental_n_tokens_equals_full_pass(backend, split):
    m = tiny()
    tokens = torch.randint(0, 24, (2, 16))
    classes = torch.tensor([1, 0])
    full = m.teacher_forward(tokens, classes).logits
    cache = m.new_cache(2)
    m.prefill(cache, classes, backend=backend)
    a = m.forward_tokens(cache, tokens[:, :split], torch.arange(split), backend=backend).logits
    b = m.forward_tokens(cache, tokens[:, split:], torch.arange(split, 16), backend=backend).logits
    torch.testing.assert_close(a, full[:, 1:split + 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(b, full[:, split + 1:], atol=ATOL, rtol=0)


def test_out_of_order_writes_equal_raster_order():
    """A query only sees slots at positions <= its own, so filling later slots first changes nothing."""
    m = tiny()
    tokens = torch.randint(0, 24, (1, 16))
    cls = torch.tensor([1])
    full = m.teacher_forward(tokens, cls).logits
    cache = m.new_cache(1)
    m.prefill(cache, cls)
    m.forward_tokens(cache, tokens[:, 8:12], torch.arange(8, 12))   # a later row first
    early = m.forward_tokens(cache, tokens[:, :8], torch.arange(8)).logits
    torch.testing.assert_close(early, full[:, 1:9], atol=ATOL, rtol=0)


def test_invalidated_slot_is_a_hole():
    """Invalidating slot 5 gives the same outputs as a cache in which 5 was never written."""
    m = tiny()
    tokens = torch.randint(0, 24, (2, 16))
    cls = torch.tensor([0, 1])
    a = m.new_cache(2)
    m.prefill(a, cls)
    m.forward_tokens(a, tokens[:, :6], torch.arange(6))
    a.invalidate(torch.tensor([m.prefix_len + 5]))
    assert not a.valid[:, m.prefix_len + 5].any()
    out_a = m.forward_tokens(a, tokens[:, 6:9], torch.arange(6, 9)).logits

    b = m.new_cache(2)
    m.prefill(b, cls)
    m.forward_tokens(b, tokens[:, :5], torch.arange(5))
    out_b = m.forward_tokens(b, tokens[:, 6:9], torch.arange(6, 9)).logits
    torch.testing.assert_close(out_a, out_b, atol=ATOL, rtol=0)
    # and a hole really changes the result (the test could not pass with an ignored validity vector)
    full = m.teacher_forward(tokens, cls).logits[:, 7:10]
    assert (out_a - full).abs().max() > 1e-3


def test_overwrite_slot_replaces_token():
    m = tiny()
    tokens = torch.randint(0, 23, (1, 16))
    other = tokens.clone()
    other[0, 3] += 1
    cls = torch.tensor([2])
    cache = m.new_cache(1)
    m.prefill(cache, cls)
    m.forward_tokens(cache, tokens[:, :4], torch.arange(4))
    m.forward_tokens(cache, other[:, 3:4], torch.tensor([3]))           # resample slot 3
    out = m.forward_tokens(cache, other[:, 4:8], torch.arange(4, 8)).logits
    torch.testing.assert_close(out, m.teacher_forward(other, cls).logits[:, 5:9], atol=ATOL, rtol=0)


def test_per_row_positions():
    """Each batch row may feed a different raster position (ZipAR rows, islands)."""
    m = tiny()
    tokens = torch.randint(0, 24, (2, 16))
    cls = torch.tensor([0, 1])
    full = m.teacher_forward(tokens, cls).logits
    cache = m.new_cache(2)
    m.prefill(cache, cls)
    m.forward_tokens(cache, tokens[:, :3], torch.arange(3))
    m.forward_tokens(cache, tokens[:, 3:5], torch.tensor([[3, 4], [3, 4]]))
    pos = torch.tensor([[5], [7]])
    m.forward_tokens(cache, tokens[:, 5:7], torch.tensor([[5, 6], [5, 6]]))
    out = m.forward_tokens(cache, torch.gather(tokens, 1, pos), pos).logits
    torch.testing.assert_close(out[0, 0], full[0, 6], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1, 0], full[1, 8], atol=ATOL, rtol=0)


def test_write_false_leaves_cache_untouched():
    m = tiny()
    tokens = torch.randint(0, 24, (1, 16))
    cls = torch.tensor([0])
    cache = m.new_cache(1)
    m.prefill(cache, cls)
    m.forward_tokens(cache, tokens[:, :4], torch.arange(4))
    before = cache.clone()
    out = m.forward_tokens(cache, tokens[:, 4:9], torch.arange(4, 9), write=False).logits
    torch.testing.assert_close(out, m.teacher_forward(tokens, cls).logits[:, 5:10], atol=ATOL, rtol=0)
    assert torch.equal(cache.valid, before.valid)
    for k0, k1 in zip(before.k, cache.k):
        assert torch.equal(k0, k1)


@pytest.mark.parametrize("backend", backends())
def test_tree_mask_branches_equal_their_paths(backend):
    """Block [a@4, b@5, c@5] with c a sibling of b (both children of a): each branch's output is
    the output of the linear path that leads to it."""
    m = tiny()
    tokens = torch.randint(0, 24, (1, 16))
    cls = torch.tensor([1])
    cache = m.new_cache(1)
    m.prefill(cache, cls)
    m.forward_tokens(cache, tokens[:, :4], torch.arange(4))
    a, b, c = 3, 7, 11
    rows = [0b001, 0b011, 0b101]  # bit j of row i: block token j visible to block token i
    mask = torch.tensor(rows, dtype=torch.int32).view(1, 3, 1)
    out = m.forward_tokens(cache, torch.tensor([[a, b, c]]), torch.tensor([4, 5, 5]), tree_mask=mask,
                           write=False, backend=backend).logits
    for idx, path in ((1, [a, b]), (2, [a, c])):
        seq = tokens.clone()
        seq[0, 4:6] = torch.tensor(path)
        ref = m.teacher_forward(seq, cls).logits[:, 6]
        torch.testing.assert_close(out[:, idx], ref, atol=ATOL, rtol=0)


def test_cfg_batch_rows_are_each_image_cond_then_null_class():
    m = tiny()
    tokens = torch.randint(0, 24, (2, 16))
    cls = torch.tensor([0, 2])
    cache = m.new_cache(2, cfg=True)
    assert cache.rows == 4
    first = m.prefill(cache, cls).logits
    out = m.forward_tokens(cache, tokens[:, :6], torch.arange(6)).logits   # [B, N] fed to both halves
    assert out.shape == (4, 6, 24)
    cond, uncond = split_cfg(out)
    torch.testing.assert_close(cond, m.teacher_forward(tokens, cls).logits[:, 1:7], atol=ATOL, rtol=0)
    null = torch.full_like(cls, m.null_class)
    torch.testing.assert_close(uncond, m.teacher_forward(tokens, null).logits[:, 1:7], atol=ATOL, rtol=0)
    s = 3.0
    torch.testing.assert_close(cfg_logits(first, s)[:, 0], first[1::2, 0] + s * (first[0::2, 0] - first[1::2, 0]))


def test_slot_invalidation_with_cfg_hits_both_halves():
    m = tiny()
    cache = m.new_cache(2, cfg=True)
    m.prefill(cache, torch.tensor([0, 1]))
    m.forward_tokens(cache, torch.randint(0, 24, (2, 4)), torch.arange(4))
    cache.invalidate(torch.tensor([[2], [3]]))          # per condition row
    v = cache.valid[:, 1:5]
    assert v.tolist() == [[True, False, True, True]] * 2 + [[True, True, False, True]] * 2   # (each image's two rows)


def test_models_attend_through_the_op():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    q_pos = torch.randint(0, 9, (2, 5), dtype=torch.int32)
    kv_pos = torch.randint(0, 9, (2, 9), dtype=torch.int32)
    valid = torch.rand(2, 9) > 0.3
    tree = torch.randint(0, 2 ** 5, (2, 5, 1), dtype=torch.int32)
    ours = attend(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=valid, tree_mask=tree, backend="reference")
    ref = specdec.ops.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=valid, tree_mask=tree,
                                     backend="reference")
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("call, match", [
    (lambda m, c: m.forward_tokens(c, torch.tensor([[24]]), torch.tensor([0])), "tokens"),
    (lambda m, c: m.forward_tokens(c, torch.tensor([[1]]), torch.tensor([16])), "positions"),
    (lambda m, c: m.forward_tokens(c, torch.tensor([[1]]), torch.tensor([0.0])), "positions"),
    (lambda m, c: m.forward_tokens(c, torch.tensor([[1, 2]]), torch.tensor([0])), "positions"),
    (lambda m, c: m.forward_tokens(c, torch.tensor([[1, 2]]), torch.tensor([3, 3])), "positions"),
    (lambda m, c: m.forward_tokens(c, torch.tensor([[1, 2]]), torch.tensor([0, 1]),
                                   tree_mask=torch.ones(1, 2, 1)), "tree_mask"),
    (lambda m, c: m.forward_tokens(c, torch.tensor([[1], [2]]), torch.tensor([0])), "tokens"),
    (lambda m, c: m.prefill(c, torch.tensor([4])), "classes"),
    (lambda m, c: c.invalidate(torch.tensor([17])), "slots"),
])
def test_bad_arguments_raise_value_error(call, match):
    m = tiny()
    cache = m.new_cache(1)
    with pytest.raises(ValueError, match=match):
        call(m, cache)


def test_bf16_model_keeps_fp32_rotary_table_and_decodes_consistently():
    m = tiny().to(torch.bfloat16)
    assert m.rope_table("cpu").dtype == torch.float32
    tokens = torch.randint(0, 24, (2, 16))
    cls = torch.tensor([0, 1])
    full = m.teacher_forward(tokens, cls).logits
    cache = m.new_cache(2)
    assert cache.k[0].dtype == torch.bfloat16
    m.prefill(cache, cls)
    inc = m.forward_tokens(cache, tokens[:, :15], torch.arange(15)).logits
    assert inc.dtype == torch.float32
    torch.testing.assert_close(inc, full[:, 1:16], atol=0.1, rtol=0.05)


def test_a_cache_prefix_is_a_view_and_move_image_moves_both_cfg_rows():
    """`prefix(k)`: the first k images' rows of the same tensors (each image's two CFG rows
    together), a subclass's row state too; `move_image`: an image's rows copied onto another's."""
    m = tiny()
    cache = m.new_cache(3, cfg=True)
    m.prefill(cache, torch.tensor([0, 1, 2]))
    view = cache.prefix(2)
    assert (view.batch, view.rows) == (2, 4) and view.k[0].data_ptr() == cache.k[0].data_ptr()
    view.valid[3, 0] = False                          # (image 1's unconditional row)
    assert not cache.valid[3, 0] and cache.valid[2, 0]
    with pytest.raises(ValueError, match="k must lie"):
        cache.prefix(4)
    cache.move_image(2, 0)
    for t in cache.k + cache.v + [cache.valid]:
        assert torch.equal(t[0:2], t[4:6])

    class WithPadding(SlotKVCache):
        ROW_STATE = SlotKVCache.ROW_STATE + ("pad",)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pad = torch.arange(self.rows) + 1
    padded = WithPadding(1, 3, 1, 4, 2, cfg=True)
    view, copy = padded.prefix(2), padded.clone()
    assert view.pad.tolist() == [1, 2, 3, 4] and view.pad.data_ptr() == padded.pad.data_ptr()
    assert copy.pad.data_ptr() != padded.pad.data_ptr() and torch.equal(copy.pad, padded.pad)
    view.reset()                                      # (the view's rows only)
    assert padded.pad.tolist() == [0, 0, 0, 0, 5, 6] and copy.pad.tolist() == [1, 2, 3, 4, 5, 6]
