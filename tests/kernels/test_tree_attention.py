"""Kernel 3, tree_attention (docs/design.md, "Kernel 3"): every backend against the float64 reference
on fresh random inputs, two structural oracles (all-ones tree == causal; each root-to-leaf path
of a tree == plain causal attention on that path alone), an independent oracle (FlexAttention
eager with specdec.masks.flex_mask_mod), the edge-case policies and the argument checks."""
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec
from specdec import masks
from specdec.reference import attention as ref

from helpers import device_backend_pairs

PAIRS = device_backend_pairs()
ALL_PAIRS = PAIRS + [pytest.param("cpu", "reference", id="cpu-reference")]

# Output tolerances against the float64 reference on the same (rounded) inputs: float32
# accumulation only for fp32; the output rounding of fp16/bf16 dominates the other two.
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_TOL = 1e-4


def random_problem(gen, b, hq, hkv, nq, nk, d, dtype, *, holes=False, tree=False, shuffle=False,
                   device="cpu"):
    """Random q/k/v and a raster-slot cache: keys at positions 0..Nk-1 (optionally shuffled slots,
    optionally with invalid holes), queries at the positions of the last Nq slots."""
    q = torch.randn(b, hq, nq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=gen).to(dtype)
    if shuffle:
        kv_pos = torch.stack([torch.randperm(nk, generator=gen) for _ in range(b)])
    else:
        kv_pos = torch.arange(nk).expand(b, nk).contiguous()
    q_pos = kv_pos[:, nk - nq:].clone().to(torch.int32)
    kv_valid = torch.rand(b, nk, generator=gen) > 0.3 if holes else None
    tree_mask = masks.pack(torch.rand(b, nq, nq, generator=gen) > 0.5) if tree else None
    t = lambda x: None if x is None else x.to(device)  # noqa: E731
    return dict(q=t(q), k=t(k), v=t(v), q_pos=t(q_pos), kv_pos=t(kv_pos), kv_valid=t(kv_valid),
                tree_mask=t(tree_mask))


def reference64(p, scale=None):
    cpu = {n: (x.cpu() if x is not None else None) for n, x in p.items()}
    return ref.tree_attention(cpu["q"].double(), cpu["k"].double(), cpu["v"].double(), q_pos=cpu["q_pos"],
                              kv_pos=cpu["kv_pos"], kv_valid=cpu["kv_valid"], tree_mask=cpu["tree_mask"],
                              scale=scale, return_lse=True)


def run(p, backend, scale=None, op=None):
    """`op` (default specdec.ops.tree_attention) on the problem `p`, with lse."""
    op = op or specdec.ops.tree_attention
    return op(p["q"], p["k"], p["v"], q_pos=p["q_pos"], kv_pos=p["kv_pos"], kv_valid=p["kv_valid"],
              tree_mask=p["tree_mask"], scale=scale, return_lse=True, backend=backend)


def assert_matches(out, lse, want_out, want_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "fully masked queries differ"
    scale = max(1.0, want_out.abs().max().item())
    torch.testing.assert_close(out, want_out, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=LSE_TOL, atol=LSE_TOL)
    assert torch.all(out[~finite] == 0)


def problem_strategies(**overrides):
    """hypothesis strategies of random_problem's sizes and options (plus seed and scale)."""
    return dict(dict(
        seed=st.integers(0, 2**31 - 1),
        b=st.integers(1, 2),
        hkv=st.integers(1, 2),
        group=st.integers(1, 3),
        nq=st.integers(1, 40),
        extra=st.integers(0, 80),
        d=st.sampled_from([1, 16, 24, 64, 128]),
        dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
        holes=st.booleans(),
        tree=st.booleans(),
        shuffle=st.booleans(),
        scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    ), **overrides)


@pytest.mark.parametrize("device,backend", PAIRS)
@settings(max_examples=20)
@given(**problem_strategies())
def test_matches_float64_reference(device, backend, seed, b, hkv, group, nq, extra, d, dtype, holes, tree,
                                   shuffle, scale):
    gen = torch.Generator().manual_seed(seed)
    p = random_problem(gen, b, hkv * group, hkv, nq, nq + extra, d, dtype, holes=holes, tree=tree,
                       shuffle=shuffle, device=device)
    out, lse = run(p, backend, scale)
    want_out, want_lse = reference64(p, scale)
    assert_matches(out, lse, want_out, want_lse, dtype)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_verification_shape_with_long_cache(device, backend):
    # Several key tiles, some skipped (holes, future keys) and a tree over the draft block.
    gen = torch.Generator().manual_seed(7)
    p = random_problem(gen, 1, 4, 2, 70, 300, 64, torch.float32, holes=True, tree=True, device=device)
    assert_matches(*run(p, backend), *reference64(p), torch.float32)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_query_seeing_nothing_gives_zeros_and_neg_inf_lse(device, backend):
    gen = torch.Generator().manual_seed(1)
    p = random_problem(gen, 2, 2, 1, 5, 9, 16, torch.float32, device=device)
    p["q_pos"] = p["q_pos"].clone()
    p["q_pos"][0, 1] = -1  # before every key
    p["kv_valid"] = torch.ones(2, 9, dtype=torch.bool, device=device)
    p["kv_valid"][1] = False  # batch 1: an empty cache
    out, lse = run(p, backend)
    assert torch.all(out[0, :, 1] == 0) and torch.all(torch.isneginf(lse[0, :, 1]))
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.all(torch.isfinite(lse[0, :, [0, 2, 3, 4]]))


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("nq", [1, 6, 20])     # (the CPU kernel's few-query and row-block paths)
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_nan_in_a_row_gives_nan_for_that_row_only(device, backend, nq, where):
    """The edge-case policy (docs/design.md): a NaN a query sees makes its output and lse NaN,
    never a finite number (the CPU and Triton kernels once gave it zeros and lse = -inf, as if it
    had seen no key); the other rows are untouched."""
    gen = torch.Generator().manual_seed(3)
    p = random_problem(gen, 2, 2, 1, nq, 40, 16, torch.float32, device=device)
    clean_out, clean_lse = run(p, backend)
    name = {"query": "q", "key": "k", "value": "v"}[where]
    p[name] = p[name].clone()
    if where == "query":
        p["q"][0, 1, nq - 1, 3] = float("nan")        # image 0, head 1, its last query
        hit = torch.zeros_like(clean_lse, dtype=torch.bool)
        hit[0, 1, nq - 1] = True
    else:
        p[name][1, 0, 2, 5] = float("nan")            # image 1's key or value in slot 2: every query sees it
        hit = torch.zeros_like(clean_lse, dtype=torch.bool)
        hit[1] = True
    out, lse = run(p, backend)
    assert torch.equal(out[~hit], clean_out[~hit]) and torch.equal(lse[~hit], clean_lse[~hit])
    if where == "value":          # (a NaN value spoils its own channel; the weights, hence lse, stay)
        assert torch.isnan(out[hit][:, 5]).all() and torch.equal(lse[hit], clean_lse[hit])
    else:
        assert torch.isnan(out[hit]).all() and torch.isnan(lse[hit]).all()


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("nq,nk", [(0, 5), (3, 0)])
def test_empty_queries_or_empty_cache(device, backend, nq, nk):
    gen = torch.Generator().manual_seed(10)
    p = random_problem(gen, 2, 2, 1, nq, max(nk, nq), 16, torch.float32, device=device)
    p["k"], p["v"], p["kv_pos"] = p["k"][:, :, :nk], p["v"][:, :, :nk], p["kv_pos"][:, :nk]
    out, lse = run(p, backend)
    assert out.shape == (2, 2, nq, 16) and lse.shape == (2, 2, nq)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
# The CPU kernel has one code path for up to 4 queries and one per 16 query rows above that;
# float32 K is read in place on all of them, 16-bit K is converted first.
@pytest.mark.parametrize("nq,dtype", [(1, torch.float32), (6, torch.float32), (20, torch.float32),
                                      (6, torch.bfloat16), (20, torch.float16)])
def test_garbage_in_invalid_slots_does_not_leak(device, backend, nq, dtype):
    gen = torch.Generator().manual_seed(2)
    p = random_problem(gen, 1, 2, 2, nq, 100, 32, dtype, holes=True, device=device)
    clean_out, clean_lse = run(p, backend)
    hole = ~p["kv_valid"][0]
    for name in ("k", "v"):
        p[name] = p[name].clone()
        p[name][0, :, hole] = float("nan")
    out, lse = run(p, backend)
    assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("nq", [1, 31, 33, 70])
def test_all_ones_tree_equals_causal(device, backend, nq):
    gen = torch.Generator().manual_seed(nq)
    p = random_problem(gen, 2, 4, 2, nq, nq + 20, 32, torch.float32, holes=True, device=device)
    plain = run(p, backend)
    p["tree_mask"] = masks.pack(torch.ones(2, nq, nq, dtype=torch.bool)).to(device)
    tree = run(p, backend)
    torch.testing.assert_close(tree[0], plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tree[1], plain[1], rtol=1e-6, atol=1e-6)


def random_parents(gen, n):
    return torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)])


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_branch_equals_causal_attention_on_the_path(device, backend, seed):
    """EAGLE-style tree after a committed prefix: each node's output equals plain causal
    attention over prefix + its root-to-node path alone."""
    gen = torch.Generator().manual_seed(seed)
    n, prefix, hq, hkv, d = 12, 17, 4, 2, 32
    parents = random_parents(gen, n)
    tree = masks.tree_from_parents(parents)
    nk = prefix + n
    q = torch.randn(1, hq, n, d, generator=gen)
    k = torch.randn(1, hkv, nk, d, generator=gen)
    v = torch.randn(1, hkv, nk, d, generator=gen)
    node_pos = prefix + tree.depth
    kv_pos = torch.cat([torch.arange(prefix), node_pos]).unsqueeze(0)
    dev = lambda x: x.to(device)  # noqa: E731
    out, lse = specdec.ops.tree_attention(dev(q), dev(k), dev(v), q_pos=dev(node_pos.unsqueeze(0)),
                                          kv_pos=dev(kv_pos), tree_mask=dev(tree.tree_mask.unsqueeze(0)),
                                          return_lse=True, backend=backend)
    for node in range(n):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        path = path[::-1]
        slots = list(range(prefix)) + [prefix + j for j in path]
        m = len(path)
        pos = torch.arange(prefix + m).unsqueeze(0)
        want, want_lse = specdec.ops.tree_attention(
            dev(q[:, :, path]), dev(k[:, :, slots]), dev(v[:, :, slots]), q_pos=dev(pos[:, prefix:]),
            kv_pos=dev(pos), return_lse=True, backend=backend)
        torch.testing.assert_close(out[:, :, node], want[:, :, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, :, node], want_lse[:, :, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_gqa_equals_repeated_heads(device, backend):
    gen = torch.Generator().manual_seed(3)
    p = random_problem(gen, 2, 6, 2, 9, 30, 16, torch.float32, tree=True, device=device)
    gqa = run(p, backend)
    p["k"] = p["k"].repeat_interleave(3, dim=1)
    p["v"] = p["v"].repeat_interleave(3, dim=1)
    mha = run(p, backend)
    torch.testing.assert_close(gqa[0], mha[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("nq,holes", [(7, True), (2, True), (2, False)])   # staged and in-place K / V
def test_strided_inputs(device, backend, nq, holes):
    """q/k/v in [B, N, H, D] memory viewed as [B, H, N, D] (the layout of a fused QKV projection)."""
    gen = torch.Generator().manual_seed(4)
    p = random_problem(gen, 2, 4, 2, nq, 25, 16, torch.float32, holes=holes, device=device)
    want = run(p, backend)
    for name in ("q", "k", "v"):
        p[name] = p[name].transpose(1, 2).contiguous().transpose(1, 2)
    got = run(p, backend)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_reference_agrees_with_flex_attention():
    """Independent oracle: torch's FlexAttention (eager) with the mask as a mask_mod."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator().manual_seed(5)
    for holes, tree, shuffle in ((False, False, False), (True, True, False), (True, True, True)):
        p = random_problem(gen, 2, 4, 2, 37, 100, 16, torch.float32, holes=holes, tree=tree, shuffle=shuffle)
        if p["kv_valid"] is not None:
            p["kv_valid"][:, p["kv_pos"][0].argmin()] = True  # FlexAttention's fully masked rows differ by version
            p["kv_valid"][1, p["kv_pos"][1].argmin()] = True
        p["q_pos"] = torch.maximum(p["q_pos"], torch.full_like(p["q_pos"], 0))
        mask_mod = masks.flex_mask_mod(p["q_pos"], p["kv_pos"], p["kv_valid"], p["tree_mask"])
        block_mask = flex.create_block_mask(mask_mod, 2, None, 37, 100, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want, aux = flex.flex_attention(p["q"].double(), p["k"].double(), p["v"].double(),
                                            block_mask=block_mask, enable_gqa=True,
                                            return_aux=flex.AuxRequest(lse=True))
        got, lse = reference64(p)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, aux.lse, rtol=1e-10, atol=1e-10)


def test_default_scale_is_inverse_sqrt_head_dim():
    gen = torch.Generator().manual_seed(6)
    p = random_problem(gen, 1, 2, 2, 4, 8, 16, torch.float32)
    a = run(p, "reference")
    b = run(p, "reference", scale=1 / math.sqrt(16))
    assert torch.equal(a[0], b[0])


def test_returns_only_out_without_return_lse():
    gen = torch.Generator().manual_seed(8)
    p = random_problem(gen, 1, 2, 1, 3, 5, 16, torch.float32)
    out = specdec.ops.tree_attention(p["q"], p["k"], p["v"], q_pos=p["q_pos"], kv_pos=p["kv_pos"])
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 3, 16)


def _good():
    gen = torch.Generator().manual_seed(9)
    return random_problem(gen, 2, 4, 2, 5, 9, 16, torch.float32, holes=True, tree=True)


BAD_ARGS = [
    ("q 3-D", lambda p: {"q": p["q"][0]}, "q must be 4-D"),
    ("q float64", lambda p: {"q": p["q"].double()}, "q must be float32"),
    ("k dtype", lambda p: {"k": p["k"].half()}, "k must have the dtype"),
    ("head dims differ", lambda p: {"q": p["q"][..., :8]}, "k must have shape .* D=8"),
    ("head dim too big", lambda p: {"q": torch.randn(2, 4, 5, 129), "k": torch.randn(2, 2, 9, 129),
                                    "v": torch.randn(2, 2, 9, 129)}, "head dim D must be in"),
    ("v shape", lambda p: {"v": p["v"][:, :, :4]}, "k and v must have the same shape"),
    ("gqa", lambda p: {"k": torch.randn(2, 3, 9, 16), "v": torch.randn(2, 3, 9, 16)}, "Hq % Hkv"),
    ("q_pos length", lambda p: {"q_pos": p["q_pos"][:, :4]}, "q_pos must have shape"),
    ("q_pos dtype", lambda p: {"q_pos": p["q_pos"].float()}, "q_pos must be int32 or int64"),
    ("kv_pos length", lambda p: {"kv_pos": p["kv_pos"][:, :8]}, "kv_pos must have shape"),
    ("kv_valid dtype", lambda p: {"kv_valid": p["kv_valid"].int()}, "kv_valid must be bool"),
    ("kv_valid length", lambda p: {"kv_valid": p["kv_valid"][:, :3]}, "kv_valid must have shape"),
    ("tree words", lambda p: {"tree_mask": torch.zeros(2, 5, 2, dtype=torch.int32)}, "tree_mask must have shape"),
    ("tree dtype", lambda p: {"tree_mask": p["tree_mask"].long()}, "tree_mask must be int32"),
]


@pytest.mark.parametrize("backend", ["reference", None])
@pytest.mark.parametrize("what,make_bad,match", BAD_ARGS, ids=[a[0] for a in BAD_ARGS])
def test_bad_arguments_raise_value_error(backend, what, make_bad, match):
    p = _good()
    p.update(make_bad(p))
    with pytest.raises(ValueError, match=match):
        run(p, backend)


def test_tree_mask_needs_keys_for_the_draft_block():
    p = _good()
    p["k"], p["v"] = p["k"][:, :, :3], p["v"][:, :, :3]
    p["kv_pos"], p["kv_valid"] = p["kv_pos"][:, :3], p["kv_valid"][:, :3]
    with pytest.raises(ValueError, match="tree_mask needs Nk >= Nq"):
        run(p, None)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e39])   # (1e39: inf in float32)
def test_non_finite_scale_raises(scale):
    with pytest.raises(ValueError, match="scale"):
        run(_good(), None, scale=scale)


@pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")
def test_compiled_op_checks_arguments_itself():
    p = _good()
    with pytest.raises(ValueError, match="Hq % Hkv"):
        torch.ops.specdec.tree_attention(p["q"], torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16),
                                         p["q_pos"], p["kv_pos"], None, None, None)


@pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")
@pytest.mark.parametrize("device", sorted({pair.values[0] for pair in PAIRS if pair.values[1] in ("cpu", "cuda")}))
def test_opcheck(device):
    p = {n: (x.to(device) if x is not None else None) for n, x in _good().items()}
    torch.library.opcheck(torch.ops.specdec.tree_attention,
                          (p["q"], p["k"], p["v"], p["q_pos"], p["kv_pos"], p["kv_valid"], p["tree_mask"], None))
    torch.library.opcheck(torch.ops.specdec.tree_attention,
                          (p["q"], p["k"], p["v"], p["q_pos"], p["kv_pos"], None, None, 0.3))


@pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")
def test_backward_through_a_kernel_raises_and_the_reference_backend_differentiates():
    # (the kernels have no backward: autograd would otherwise leave q, k and v without gradients)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, requires_grad=True)
    q_pos, kv_pos = torch.tensor([[2, 3, 4]]), torch.arange(5)[None]
    out, lse = specdec.ops.tree_attention(q, k, k, q_pos=q_pos, kv_pos=kv_pos, return_lse=True, backend="cpu")
    with pytest.raises(RuntimeError, match="no backward on the cpu backend"):
        (out.sum() + lse.sum()).backward()
    specdec.ops.tree_attention(q, k, k, q_pos=q_pos, kv_pos=kv_pos, backend="reference").sum().backward()
    assert q.grad is not None and k.grad is not None and q.grad.abs().sum() > 0
    with torch.no_grad():     # (inference: the outputs as they were, no graph)
        plain = specdec.ops.tree_attention(q, k, k, q_pos=q_pos, kv_pos=kv_pos, backend="cpu")
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, out.detach(), rtol=0, atol=0)


def test_the_reference_computes_in_float32_under_autocast():
    """Autocast ran the reference's products in bfloat16: lse came back bfloat16, off by 1e-2."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    q_pos, kv_pos = torch.tensor([[2, 3, 4]]), torch.arange(5)[None]
    plain = specdec.ops.tree_attention(q, k, k, q_pos=q_pos, kv_pos=kv_pos, return_lse=True, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = specdec.ops.tree_attention(q, k, k, q_pos=q_pos, kv_pos=kv_pos, return_lse=True, backend="reference")
    assert [t.dtype for t in cast] == [torch.float32, torch.float32]
    torch.testing.assert_close(cast, plain, rtol=0, atol=0)
