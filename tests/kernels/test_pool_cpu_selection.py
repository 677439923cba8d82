"""The CPU kernels' few-pass selection: top-k by radix select on the ordered keys, the
top-p nucleus by the same radix walk over int64 sums of the fixed-point weights, and the
vectorised sample_residual, against the reference on inputs built to stress them.

What the contract makes exact is compared exactly: the kept set (probability > 0 exactly where
the reference's is), sampled token ids and fallback flags; probabilities to float32 rounding. The
rows are drawn fresh each run (hypothesis) from value palettes that make the selection's hard
cases common: many ties at the k-th key, keys that differ only in their last bits (decided by
the radix's last digit), -0.0 next to +0.0 (one key), rows of -inf with a few finite entries,
subnormal and huge logits, V not a multiple of any vector width, V = 1.

Every instruction-set build of the kernels (AVX-512, AVX2, baseline) is run in a subprocess with
ATEN_CPU_CAPABILITY set, and the build that ran is read back from SPECDEC_CPU_KERNELS_VERBOSE.
"""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdec
from helpers import assert_probs_match
from specdec.reference import pooling as ref
from specdec.reference import verification as ref_v

pytestmark = pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Row lengths around the vector widths (4, 8, 16 lanes), the 256-entry residual blocks and beyond.
VS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 100, 255, 256, 257, 1000, 2049]


def _row_values(draw_seed, n, v, palette, neg_inf_frac, dtype):
    """n rows of v logits from one of several palettes (see the module docstring)."""
    g = torch.Generator().manual_seed(draw_seed)
    if palette == "gauss":
        x = torch.randn(n, v, generator=g) * 3
    elif palette == "ties":  # a handful of distinct values, each repeated many times
        x = torch.randint(-3, 4, (n, v), generator=g).float()
    elif palette == "ulps":  # one value and its next few floats: only the last radix digit differs
        base = torch.full((n, v), 1.5)
        steps = torch.randint(0, 5, (n, v), generator=g).float()
        x = torch.nextafter(base, torch.full_like(base, math.inf))
        x = base + (x - base) * steps
    elif palette == "zeros":  # -0.0 and +0.0 (one key) among small values
        x = torch.randint(-1, 2, (n, v), generator=g).float() * 0.5
        x = torch.where(torch.rand(n, v, generator=g) < 0.5, x, torch.zeros_like(x))
        x = torch.where(torch.rand(n, v, generator=g) < 0.5, -x, x)  # -0.0 where x is 0
    elif palette == "wide":  # subnormal to huge magnitudes
        e = torch.randint(-140, 120, (n, v), generator=g).float()
        s = torch.where(torch.rand(n, v, generator=g) < 0.5, -1.0, 1.0)
        x = s * torch.exp2(e)
    else:
        raise ValueError(palette)
    if neg_inf_frac > 0:
        x = torch.where(torch.rand(n, v, generator=g) < neg_inf_frac, torch.full_like(x, -math.inf), x)
        x[:, int(torch.randint(0, v, (1,), generator=g))] = 0.25  # at least one finite entry per row
    return x.to(dtype)


def _kept(p):
    return p > 0


def _sampling(logits, uncond, **kw):
    return torch.ops.specdec.sampling_probs(logits, uncond, kw.get("cfg_scale", 1.0), kw.get("temperature", 1.0),
                                            kw.get("top_k", 0), kw.get("top_p", 1.0))


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4), v=st.sampled_from(VS),
       palette=st.sampled_from(["gauss", "ties", "ulps", "zeros", "wide"]),
       neg_inf_frac=st.sampled_from([0.0, 0.0, 0.5, 0.97]), dtype=st.sampled_from(DTYPES),
       top_k=st.sampled_from([0, 1, 2, 3, 5, 16, 17, 100, 2000, 10**6]),
       top_p=st.sampled_from([1.0, 1.0, 0.9, 0.5, 1e-3, 1e-12, 1.0 - 2**-40]),
       cfg=st.booleans())
@settings(max_examples=300)
def test_sampling_probs_selection_matches_reference(seed, n, v, palette, neg_inf_frac, dtype, top_k, top_p, cfg):
    logits = _row_values(seed, n, v, palette, neg_inf_frac, dtype)
    uncond = _row_values(seed + 1, n, v, palette, 0.0, dtype) if cfg else None
    kw = dict(cfg_scale=2.0 if cfg else 1.0, temperature=1.0, top_k=top_k, top_p=top_p)
    got = _sampling(logits, uncond, **kw)
    want = ref.sampling_probs(logits, uncond_logits=uncond, **kw)
    assert_probs_match(got, want)


@given(seed=st.integers(0, 2**31 - 1), v=st.sampled_from(VS[3:]), k_tie=st.integers(1, 40),
       dtype=st.sampled_from(DTYPES))
@settings(max_examples=60)
def test_top_k_many_ties_at_the_kth_key(seed, v, k_tie, dtype):
    # A row whose k-th largest value is shared by many entries: all of them are kept.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, v, generator=g)
    top = min(v - 1, int(torch.randint(0, max(1, v // 4), (1,), generator=g)))
    tied = min(v - top, k_tie)
    order = torch.randperm(v, generator=g)
    x[:, order[:top]] = 10.0 + torch.rand(top, generator=g)  # above the tie
    x[:, order[top:top + tied]] = 5.0  # the tie
    x[:, order[top + tied:]] = torch.rand(v - top - tied, generator=g)  # below it
    x = x.to(dtype)
    for k in {max(1, top + 1), top + max(1, tied // 2), top + tied}:
        if k >= v:
            continue
        got = _sampling(x, None, top_k=k)
        want = ref.sampling_probs(x, top_k=k)
        assert_probs_match(got, want)
        assert int(_kept(got[0]).sum()) == top + tied, "every tie at the k-th key is kept"


@pytest.mark.parametrize("v", [1, 5, 16, 33])
def test_top_k_at_least_v_keeps_everything(v):
    x = torch.randn(3, v)
    x[1, 0] = -math.inf
    for k in (v, v + 1, 10**9):  # bit for bit (row 1 of V = 1 is all -inf: NaN)
        torch.testing.assert_close(_sampling(x, None, top_k=k), _sampling(x, None, top_k=0), rtol=0, atol=0,
                                   equal_nan=True)


def test_top_k_one_keeps_the_argmax_and_its_ties():
    x = torch.randn(4, 1000)
    x[1, [3, 700, 999]] = 50.0  # three-way tie for the maximum
    p = _sampling(x, None, top_k=1)
    assert torch.equal(_kept(p), x == x.amax(1, keepdim=True))
    torch.testing.assert_close(p[1, [3, 700, 999]], torch.full((3,), 1 / 3))


def test_few_finite_entries():
    # Rows of -inf with 1, 2 or 3 finite entries; top_k above the finite count keeps them all.
    v = 257
    x = torch.full((3, v), -math.inf)
    x[0, 200] = 1.0
    x[1, [0, 256]] = torch.tensor([2.0, 2.0])
    x[2, [5, 6, 7]] = torch.tensor([1.0, 3.0, -1.0])
    for kw in (dict(), dict(top_k=2), dict(top_k=5), dict(top_p=0.5), dict(top_k=2, top_p=0.99)):
        assert_probs_match(_sampling(x, None, **kw), ref.sampling_probs(x, **kw))


def test_nucleus_cut_at_ties():
    # One 3, eight 2s, the rest 0: top_p falls inside the group of 2s, which is kept whole,
    # with V not a multiple of a vector width and the tie spread over several vectors.
    v = 61
    x = torch.zeros(2, v)
    x[:, 40] = 3.0
    x[:, [1, 9, 17, 25, 33, 41, 49, 57]] = 2.0
    e3, e2 = math.exp(3), math.exp(2)
    total = e3 + 8 * e2 + (v - 9)
    for top_p in (e3 / total + 1e-3, (e3 + 4 * e2) / total, (e3 + 8 * e2) / total - 1e-3):
        p = _sampling(x, None, top_p=top_p)
        assert int(_kept(p[0]).sum()) == 9, top_p
        assert_probs_match(p, ref.sampling_probs(x, top_p=top_p))


def test_nucleus_decided_in_the_last_digit():
    # Logits one float apart (the radix walk needs all three digits), top_p between the masses.
    base = torch.tensor(0.75)
    vals = [base]
    for _ in range(40):
        vals.append(torch.nextafter(vals[-1], torch.tensor(-math.inf)))
    x = torch.stack(vals)[None].repeat(2, 1)
    x = x[:, torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(3))].contiguous()
    for top_p in (0.01, 0.26, 0.5, 0.74, 0.99):
        assert_probs_match(_sampling(x, None, top_p=top_p), ref.sampling_probs(x, top_p=top_p))


@pytest.mark.parametrize("top_p", [1e-300, 1e-12, 1e-6])
def test_tiny_top_p_keeps_only_the_maximum(top_p):
    x = torch.randn(3, 1000)
    x[2] = 0.0  # all tied: all kept
    p = _sampling(x, None, top_p=top_p, top_k=100)
    assert torch.equal(_kept(p[:2]), x[:2] == x[:2].amax(1, keepdim=True))
    assert_probs_match(p, ref.sampling_probs(x, top_p=top_p, top_k=100))


@pytest.mark.parametrize("dtype", DTYPES)
def test_poison_rows_stay_in_their_row(dtype):
    v = 300
    x = (torch.randn(6, v) * 3).to(dtype)
    u = (torch.randn(6, v) * 3).to(dtype)
    x[1, 299] = math.nan  # in the last partial vector
    u[2, 17] = math.inf
    x[3] = -math.inf
    x[4, 7] = math.inf
    u[5, 8] = math.nan
    x[5, 8] = -math.inf  # masked in the conditional half: -inf, not NaN (legal)
    tokens = torch.arange(6) * 10
    for kw in (dict(), dict(top_k=7), dict(top_p=0.8), dict(top_k=50, top_p=0.3)):
        p = _sampling(x, u, cfg_scale=3.0, **kw)
        assert torch.isnan(p[1:5]).all() and not torch.isnan(p[[0, 5]]).any()
        assert_probs_match(p, ref.sampling_probs(x, uncond_logits=u, cfg_scale=3.0, **kw))
        out = torch.ops.specdec.pool_probs(x, tokens, None, u, 3.0, 1.0, kw.get("top_k", 0), None, kw.get("top_p", 1.0))
        for t in out:
            assert torch.isnan(t[1:5]).all() and torch.isfinite(t[[0, 5]]).all()


def test_rows_with_a_stride():
    # Rows of a wider tensor (row stride != V, contiguous along V) are read in place.
    wide = torch.randn(5, 140)
    x = wide[:, 3:120]
    u = torch.randn(5, 300)[:, 11:128]
    assert x.stride(0) != x.shape[1]
    for kw in (dict(), dict(top_k=9), dict(top_p=0.6)):
        assert torch.equal(_sampling(x, u, cfg_scale=2.0, **kw),
                           _sampling(x.contiguous(), u.contiguous(), cfg_scale=2.0, **kw))
        assert_probs_match(_sampling(x, u, cfg_scale=2.0, **kw),
                           ref.sampling_probs(x, uncond_logits=u, cfg_scale=2.0, **kw))


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4), v=st.sampled_from(VS),
       palette=st.sampled_from(["gauss", "ties", "ulps", "zeros"]), dtype=st.sampled_from(DTYPES),
       top_k=st.sampled_from([0, 1, 3, 17, 100]), top_p=st.sampled_from([1.0, 0.9, 0.3, 1e-9]),
       k=st.sampled_from([0, 1, 5, 40]), delta=st.sampled_from([None, 0.0, 0.05, 0.5]),
       nb16=st.booleans(), temperature=st.sampled_from([1.0, 0.6]))
@settings(max_examples=150)
def test_pool_probs_matches_reference(seed, n, v, palette, dtype, top_k, top_p, k, delta, nb16, temperature):
    logits = _row_values(seed, n, v, palette, 0.0, dtype)
    uncond = _row_values(seed + 7, n, v, palette, 0.0, dtype)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, v, (n,), generator=g)
    k = min(k, v - 1)
    neighbors = torch.randint(0, v, (v, k), generator=g, dtype=torch.int32) if k > 0 else None
    if neighbors is not None and nb16:
        neighbors = neighbors.to(torch.int16)
    got = torch.ops.specdec.pool_probs(logits, tokens, neighbors, uncond, 2.0, temperature, top_k, delta, top_p)
    want = ref.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, cfg_scale=2.0, temperature=temperature,
                          top_k=top_k, delta=delta, top_p=top_p)
    # The token's probability is 0 exactly where the reference's is (kept set), the rest to rounding.
    assert torch.equal(got[1] > 0, want.p_token > 0)
    skip = torch.zeros(n, dtype=torch.bool)
    if neighbors is not None and delta is not None:  # a neighbour prefix within rounding of delta
        p = ref.sampling_probs(logits.double(), uncond_logits=uncond.double(), cfg_scale=2.0, temperature=temperature,
                               top_k=top_k, top_p=top_p)
        inclusive = torch.cumsum(p.gather(1, neighbors.long()[tokens]), 1)
        skip = ((inclusive - delta).abs() <= 1e-5 * max(delta, 1e-3) + 1e-6).any(1)
    for name, a, b in zip(("pooled", "p_token", "row_max", "row_lse"), got, want):
        if name == "pooled":
            a, b = a[~skip], b[~skip]
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, equal_nan=True, msg=lambda m: f"{name}: {m}")


def test_out_of_range_neighbour_is_an_error_only_when_reached():
    # The prefix walk stops at the first sum above delta; an id after it is never read.
    v = 40
    x = torch.zeros(1, v)
    x[0, 1] = 10.0  # neighbour 0 of token 0 holds nearly all the mass
    tokens = torch.tensor([0])
    nb = torch.zeros(v, 20, dtype=torch.int32)
    nb[0, 0] = 1
    nb[0, 1:] = 2
    nb[0, 19] = v  # out of range, behind the cut
    out = torch.ops.specdec.pool_probs(x, tokens, nb, None, 1.0, 1.0, 0, 0.5, 1.0)
    torch.testing.assert_close(out[0], out[1])  # the first neighbour's mass is > delta: none moved
    with pytest.raises(ValueError, match="neighbors"):
        torch.ops.specdec.pool_probs(x, tokens, nb, None, 1.0, 1.0, 0, None, 1.0)  # delta=None reaches it


# ---- sample_residual ---------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 5), v=st.sampled_from(VS + [4097, 70000]),
       sparsity=st.sampled_from([0.0, 0.9, 0.999]), with_q=st.booleans(), ties=st.booleans())
@settings(max_examples=120)
def test_sample_residual_matches_reference(seed, m, v, sparsity, with_q, ties):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(m, v, generator=g) * (torch.rand(m, v, generator=g) >= sparsity)
    if ties:
        p = (p * 4).round() / 4
    p[:, int(torch.randint(0, v, (1,), generator=g))] += 0.01
    p = p / p.sum(1, keepdim=True)
    q = torch.softmax(torch.randn(m, v, generator=g), 1)
    if m > 1:
        q[0] = p[0]  # a zero residual: the fallback
    u = torch.rand(m, generator=g)
    u[0] = 0.0
    if m > 2:
        u[-1] = 1.0 - 2**-24
    qq = q if with_q else None
    got = torch.ops.specdec.sample_residual(p, qq, u, 0, 0)
    want = ref_v.sample_residual(p, qq, u)
    assert torch.equal(got[0], want.tokens) and torch.equal(got[1], want.fallback)


@pytest.mark.parametrize("v", [255, 256, 257, 512, 1000])
def test_sample_residual_crossing_at_block_edges(v):
    # Mass only on entries next to the 256-entry block edges, uniforms on each CDF step.
    p = torch.zeros(6, v)
    edges = [i for i in (0, 1, 254, 255, 256, 257, 511, 512, v - 1) if i < v]
    p[:, edges] = 1.0 / len(edges)
    cum = torch.cumsum(ref_v.mass_units(p[0]).long(), 0)
    total = int(cum[-1])
    u = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.999, 1.0 - 2**-24])
    got = torch.ops.specdec.sample_residual(p, None, u, 0, 0)
    want = ref_v.sample_residual(p, None, u)
    assert torch.equal(got[0], want.tokens)
    assert set(got[0].tolist()) <= set(edges) and total > 0


# ---- every instruction-set build ------------------------------------------------------------------

_SCRIPT = textwrap.dedent(r"""
    import math, sys, torch
    import specdec
    from specdec.reference import pooling as ref, verification as ref_v
    bad = []
    for seed in range(int(sys.argv[1])):
        g = torch.Generator().manual_seed(seed)
        v = [1, 3, 7, 15, 17, 33, 257, 1000, 2049][seed % 9]
        n = 1 + seed % 3
        dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
        x = (torch.randn(n, v, generator=g) * 4).to(dtype)
        if seed % 4 == 1:
            x = x.float().round().to(dtype)  # ties
        u = (torch.randn(n, v, generator=g) * 4).to(dtype)
        if seed % 5 == 2:
            x[0, : v // 2] = -math.inf
        for k, p in ((0, 1.0), (1, 1.0), (5, 1.0), (v // 2, 0.9), (0, 0.3), (3, 1e-9)):
            for un in (None, u):
                got = torch.ops.specdec.sampling_probs(x, un, 2.5, 0.8, k, p)
                want = ref.sampling_probs(x, uncond_logits=un, cfg_scale=2.5, temperature=0.8, top_k=k, top_p=p)
                if not (torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=2e-5, atol=2e-6)):
                    bad.append(("sampling_probs", seed, k, p, un is None))
                tokens = torch.randint(0, v, (n,), generator=g)
                nb = torch.randint(0, v, (v, min(v, 24)), generator=g, dtype=torch.int32)
                got = torch.ops.specdec.pool_probs(x, tokens, nb, un, 2.5, 0.8, k, None, p)
                want = ref.pool_probs(x, tokens, nb, uncond_logits=un, cfg_scale=2.5, temperature=0.8, top_k=k, top_p=p)
                if not all(torch.allclose(a, b, rtol=2e-5, atol=2e-6, equal_nan=True) for a, b in zip(got, want)):
                    bad.append(("pool_probs", seed, k, p, un is None))
        pr = torch.softmax(torch.randn(n, v, generator=g) * 3, 1)
        qr = torch.softmax(torch.randn(n, v, generator=g) * 3, 1)
        ur = torch.rand(n, generator=g)
        for qq in (None, qr, pr):
            got = torch.ops.specdec.sample_residual(pr, qq, ur, 0, 0)
            want = ref_v.sample_residual(pr, qq, ur)
            if not (torch.equal(got[0], want.tokens) and torch.equal(got[1], want.fallback)):
                bad.append(("sample_residual", seed))
    print("BAD", bad) if bad else print("OK")
""")

_CAPABILITIES = {"default": 0, "avx2": 1, "avx512": 2}


@pytest.mark.parametrize("capability", list(_CAPABILITIES))
def test_every_instruction_set_build_matches_reference(capability):
    have = torch.backends.cpu.get_cpu_capability().lower()
    if _CAPABILITIES.get(have, 0) < _CAPABILITIES[capability]:
        pytest.skip(f"this CPU runs {have}")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, SPECDEC_CPU_KERNELS_VERBOSE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "60"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"CPU pooling/sampling kernels: {capability} " in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.strip() == "OK", proc.stdout[-3000:]


def test_the_comparison_can_fail():
    # The helper rejects a kept set that differs by one token, and a probability off by 1e-4.
    x = torch.randn(2, 100)
    p = ref.sampling_probs(x, top_k=10)
    with pytest.raises(AssertionError):
        assert_probs_match(ref.sampling_probs(x, top_k=11), p)
    with pytest.raises(AssertionError):
        assert_probs_match(p * (1 + 1e-4), p)
