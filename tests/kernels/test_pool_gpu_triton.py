"""The opt-in Triton pooling kernels (kernel="onchip"): the row read once and
held in registers, top-k and top-p found by a bracket search that snaps to keys present in the row.

They have never run on a GPU. Here they run under the Triton interpreter on CPU tensors (and on
CUDA tensors when a GPU is present), on fresh random inputs, against the reference (the kept set and
p_token > 0 exactly, probabilities to float32 rounding) and against the default kernels (the same
tokens from sample_residual). Both modes are covered: whole rows in registers (V <= ONCHIP_MAX_V)
and the streaming mode of longer rows (ONCHIP_MAX_V and STREAM_BLOCK_V lowered here to reach it
with small rows), as is the fused reduction the GPU runs (FUSED_REDUCE, slow under the interpreter).
"""
import contextlib
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdec
from specdec.reference import pooling as ref
from specdec.reference import verification as ref_verification
from specdec.triton_kernels import pooling as tp
from specdec.triton_kernels import verification as tv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOP_PS = [1e-300, 1e-9, 0.05, 0.3, 0.75, 0.9, 0.99, 1.0 - 2 ** -40, 1.0]
MODES = ["onchip", "stream", "stream-chunked"]


@contextlib.contextmanager
def mode(name, fused=None):
    """Run the onchip kernels in registers ("onchip"), streamed in one chunk ("stream") or in 64-wide
    chunks ("stream-chunked"); `fused` forces the GPU's fused bracket reduction."""
    saved = tp.ONCHIP_MAX_V, tp.STREAM_BLOCK_V, tp.FUSED_REDUCE
    if name != "onchip":
        tp.ONCHIP_MAX_V = 0
        tp.STREAM_BLOCK_V = 64 if name == "stream-chunked" else None
    if fused is not None:
        tp.FUSED_REDUCE = fused
    try:
        yield
    finally:
        tp.ONCHIP_MAX_V, tp.STREAM_BLOCK_V, tp.FUSED_REDUCE = saved


def _rows(seed, n, v, dtype, cfg, scale=3.0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale
    uncond = torch.randn(n, v, generator=g) * scale if cfg else None
    if ties:  # integer logits: exact in every dtype, many ties at every threshold
        logits = logits.round()
        uncond = None if uncond is None else uncond.round()
    logits = logits.to(dtype)
    uncond = None if uncond is None else uncond.to(dtype)
    tokens = torch.randint(0, v, (n,), generator=g)
    return logits, uncond, tokens


def _on(t):
    return None if t is None else t.to(DEVICE)


def sampling(logits, uncond=None, *, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0):
    return tp.sampling_probs(_on(logits), _on(uncond), cfg_scale, temperature, top_k, top_p, kernel="onchip").cpu()


def pooled(logits, tokens, neighbors=None, uncond=None, *, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0,
           delta=None):
    out = tp.pool_probs(_on(logits), _on(tokens), _on(neighbors), _on(uncond), cfg_scale, temperature, top_k, delta,
                        top_p, kernel="onchip")
    return [t.cpu() for t in out]


def check_sampling(logits, uncond=None, **kw):
    got = sampling(logits, uncond, **kw)
    want = ref.sampling_probs(logits, uncond_logits=uncond, **kw)
    assert torch.equal(got > 0, want > 0), "kept sets differ"  # top-k and the nucleus, exactly
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6, equal_nan=True)
    return got


def check_pooled(logits, tokens, neighbors=None, uncond=None, **kw):
    got = pooled(logits, tokens, neighbors, uncond, **kw)
    want = ref.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, **kw)
    assert torch.equal(got[1] > 0, want.p_token > 0)
    skip = torch.zeros(logits.shape[0], dtype=torch.bool)
    if neighbors is not None and kw.get("delta") is not None:  # a neighbour prefix within rounding of delta
        args = {k: v for k, v in kw.items() if k != "delta"}
        p = ref.sampling_probs(logits.double(), uncond_logits=None if uncond is None else uncond.double(), **args)
        inclusive = torch.cumsum(p.double().gather(1, neighbors.long()[tokens]), 1)
        skip = ((inclusive - kw["delta"]).abs() <= 1e-5).any(1)
    for name, a, b in zip(("pooled", "p_token", "row_max", "row_lse"), got, want):
        if name == "pooled":
            a, b = a[~skip], b[~skip]
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, equal_nan=True, msg=lambda m: f"{name}: {m}")


# ---- fresh random inputs ---------------------------------------------------------------------------

@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4), v=st.sampled_from([1, 2, 7, 100, 257, 1000, 2049, 5000]),
       dtype=st.sampled_from(DTYPES), cfg=st.booleans(), temperature=st.sampled_from([1.0, 0.7, 1.6]),
       top_k=st.sampled_from([0, 1, 5, 50, 999, 5000]), top_p=st.sampled_from(TOP_PS), ties=st.booleans(),
       run=st.sampled_from(MODES))
@settings(max_examples=60)
def test_sampling_probs_matches_reference(seed, n, v, dtype, cfg, temperature, top_k, top_p, ties, run):
    logits, uncond, _ = _rows(seed, n, v, dtype, cfg, ties=ties)
    with mode(run):
        got = check_sampling(logits, uncond, cfg_scale=2.5, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(got.sum(1), torch.ones(n), rtol=1e-5, atol=1e-5)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4), v=st.sampled_from([1, 3, 33, 300, 1000, 2049]),
       dtype=st.sampled_from(DTYPES), cfg=st.booleans(), top_k=st.sampled_from([0, 1, 3, 40]),
       top_p=st.sampled_from(TOP_PS), k=st.sampled_from([0, 1, 8]), delta=st.sampled_from([None, 0.05, 0.5]),
       ties=st.booleans(), run=st.sampled_from(MODES))
@settings(max_examples=40)
def test_pool_probs_matches_reference(seed, n, v, dtype, cfg, top_k, top_p, k, delta, ties, run):
    logits, uncond, tokens = _rows(seed, n, v, dtype, cfg, ties=ties)
    k = min(k, v - 1)
    neighbors = None
    if k > 0:
        neighbors = specdec.neighbors.knn_table(torch.randn(v, 3, generator=torch.Generator().manual_seed(seed)), k)
    with mode(run):
        check_pooled(logits, tokens, neighbors, uncond, cfg_scale=3.0, temperature=0.9, top_k=top_k, top_p=top_p,
                     delta=delta)


@given(seed=st.integers(0, 2**31 - 1), v=st.sampled_from([1, 5, 40]), top_k=st.sampled_from([0, 1, 4, 39]),
       top_p=st.sampled_from([1e-9, 0.5, 0.9, 1.0]), run=st.sampled_from(["onchip", "stream-chunked"]))
@settings(max_examples=10)  # the interpreter runs the fused reduction's combine function in Python
def test_fused_reduction_matches_reference(seed, v, top_k, top_p, run):
    logits, uncond, tokens = _rows(seed, 2, v, torch.float32, True, ties=seed % 2 == 0)
    kw = dict(cfg_scale=2.0, temperature=0.9, top_k=top_k, top_p=top_p)
    with mode(run, fused=True):
        check_sampling(logits, uncond, **kw)
        check_pooled(logits, tokens, None, uncond, **kw)


# ---- edge cases ------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", MODES)
def test_many_ties_at_the_kth_key_are_kept(run):
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (8, 50), generator=g).float()
    with mode(run):
        for top_k in (1, 3, 10, 49):
            p = sampling(logits, top_k=top_k, cfg_scale=1.0, temperature=1.0)
            kth = torch.topk(logits, top_k, dim=1).values[:, -1:]
            assert torch.equal(p > 0, logits >= kth)
            assert ((logits >= kth).sum(1) > top_k).any(), "the inputs should hold ties at the threshold"
        # A row of one value: every top_k keeps all of it.
        flat = torch.full((2, 37), 1.5)
        assert (sampling(flat, top_k=5) > 0).all()


@pytest.mark.parametrize("run", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_extremes(run, dtype):
    logits, uncond, tokens = _rows(1, 3, 300, dtype, True)
    with mode(run):
        for top_k in (1, 299, 300, 301, 10 ** 6):  # >= V keeps everything
            check_sampling(logits, uncond, cfg_scale=2.0, top_k=top_k)
            check_pooled(logits, tokens, None, uncond, cfg_scale=2.0, top_k=top_k)
        assert ((sampling(logits, uncond, top_k=1) > 0).sum(1) == 1).all()


@pytest.mark.parametrize("run", MODES)
def test_rows_of_minus_inf_with_few_finite_entries(run):
    v = 300
    logits = torch.full((4, v), -math.inf)
    logits[0, [3, 200]] = torch.tensor([1.0, 2.0])  # two finite entries: top_k 5 keeps both
    logits[1, 7] = -50.0  # one finite entry
    logits[2, :] = torch.linspace(-5, 5, v)  # finite row beside them
    # row 3: no finite entry at all -> NaN
    tokens = torch.tensor([200, 7, 10, 0])
    with mode(run):
        for kw in (dict(top_k=5), dict(top_k=1), dict(top_p=0.5), dict(top_k=5, top_p=0.9), dict()):
            p = sampling(logits, cfg_scale=1.0, temperature=1.0, **kw)
            want = ref.sampling_probs(logits, **kw)
            assert torch.equal(p > 0, want > 0) and torch.isnan(p[3]).all() and torch.isfinite(p[:3]).all()
            torch.testing.assert_close(p, want, equal_nan=True)
            check_pooled(logits, tokens, None, None, cfg_scale=1.0, temperature=1.0, **kw)


@pytest.mark.parametrize("run", MODES)
def test_vocabulary_of_one(run):
    logits, uncond, tokens = _rows(2, 3, 1, torch.float32, True)
    with mode(run):
        for kw in (dict(), dict(top_k=1), dict(top_p=1e-9)):
            assert torch.equal(sampling(logits, uncond, **kw), torch.ones(3, 1))
            check_pooled(logits, tokens, None, uncond, **kw)


@pytest.mark.parametrize("run", MODES)
def test_nucleus_cut_inside_a_group_of_ties_keeps_the_group(run):
    v = 20
    l = torch.zeros(2, v)
    l[:, 0] = 3.0
    l[:, 5:9] = 2.0
    p3 = math.exp(3) / (math.exp(3) + 4 * math.exp(2) + 15)
    with mode(run):
        for top_p in (p3 + 0.01, p3 + 0.2):
            want = torch.zeros(2, v, dtype=torch.bool)
            want[:, 0] = True
            want[:, 5:9] = True
            assert torch.equal(sampling(l, cfg_scale=1.0, temperature=1.0, top_p=top_p) > 0, want)
        assert (sampling(l, cfg_scale=1.0, temperature=1.0, top_p=p3 - 0.01) > 0).sum() == 2


@pytest.mark.parametrize("run", MODES)
def test_tiny_top_p_keeps_the_argmax_and_its_ties(run):
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-4, 5, (6, 64), generator=g).float()
    logits[0] = 1.0
    with mode(run):
        for top_p in (1e-300, 1e-9, 1e-3):
            got = sampling(logits, cfg_scale=1.0, temperature=1.0, top_p=top_p) > 0
            assert torch.equal(got, logits == logits.amax(1, keepdim=True)), top_p


@pytest.mark.parametrize("run", MODES)
def test_nan_and_inf_rows_stay_in_their_row(run):
    logits, uncond, tokens = _rows(3, 6, 40, torch.float32, True)
    logits[1, 7] = math.nan
    uncond[2, 3] = math.inf
    logits[3, :] = -math.inf
    logits[4, :10] = -math.inf  # masking is legal
    logits[5, 0] = math.inf
    with mode(run):
        for kw in (dict(), dict(top_k=5), dict(top_p=0.7), dict(top_k=5, top_p=0.7)):
            p = sampling(logits, uncond, **kw)
            assert torch.isnan(p[[1, 2, 3, 5]]).all() and torch.isfinite(p[[0, 4]]).all()
            out = pooled(logits, tokens, None, uncond, **kw)
            for t in out:
                assert torch.isnan(t[[1, 2, 3, 5]]).all() and torch.isfinite(t[[0, 4]]).all()
            check_pooled(logits, tokens, None, uncond, **kw)


@pytest.mark.parametrize("run", MODES)
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (40, 1.0), (0, 0.9)])
def test_huge_scaled_logits_ties_split_the_mass_and_near_ties_match_float64(run, top_k, top_p):
    # Guidance 1e4 and temperature 1e-4 (Sampling's limits): guided logits ~1e8 (ties) and 1e5 to
    # 2e7 (near ties). p = exp(l - row_lse) gave each of two tied tokens p = 1 there;
    # p = exp((l - max) - log(sum)) gives 0.5 each (test_pool_probs.py has the other backends).
    g = torch.Generator().manual_seed(5)
    v = 64
    uncond = torch.randn(3, v, generator=g)
    cond = uncond + (torch.randn(3, v, generator=g) * 0.5).clamp(max=1.5)
    cond[:, 3] = uncond[:, 3] + 2.0
    cond[:, 40], uncond[:, 40] = cond[:, 3], uncond[:, 3]
    kw = dict(cfg_scale=1e4, temperature=1e-4, top_k=top_k, top_p=top_p)
    nb = torch.stack([torch.cat([torch.arange(x), torch.arange(x + 1, v)]) for x in range(v)]).int()
    with mode(run):
        p = sampling(cond, uncond, **kw)
        out = pooled(cond, torch.full((3,), 3), nb, uncond, **kw)
    want = torch.zeros(3, v)
    want[:, 3] = want[:, 40] = 0.5
    torch.testing.assert_close(p, want, rtol=0, atol=4e-7)
    torch.testing.assert_close(out[1], torch.full((3,), 0.5), rtol=0, atol=4e-7)  # p_token
    torch.testing.assert_close(out[0], torch.ones(3), rtol=0, atol=4e-7)  # pooled: the row's sum
    # Near ties: guided logits M + d, M in {1e5, 2e6, 2e7}, d in [-4, 0] for six tokens.
    m = torch.tensor([[1e5], [2e6], [2e7]], dtype=torch.float64)
    target = m - 50 - 100 * torch.rand(3, v, generator=g, dtype=torch.float64)
    target[:, 10:16] = m - torch.tensor([0.0, 0.3, 0.7, 1.2, 2.5, 4.0], dtype=torch.float64)
    cond = (target * 1e-4).float()  # cfg 1, temperature 1e-4
    kw = dict(temperature=1e-4, top_k=min(top_k, 3), top_p=top_p)
    l = ref.guided_logits(cond, None, 1.0, 1e-4).double()
    kept = ref.sampling_probs(cond, **kw) > 0
    want = torch.softmax(torch.where(kept, l, torch.full_like(l, -math.inf)), 1)
    with mode(run):
        p = sampling(cond, None, **kw)
        out = pooled(cond, torch.full((3,), 11), nb, None, **kw)
    assert (p[~kept] == 0).all()
    torch.testing.assert_close(p.double(), want, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(out[1].double(), want[:, 11], rtol=2e-6, atol=1e-12)

@pytest.mark.parametrize("v", [16383, 16384, 16385, 40000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_vocabularies_on_and_past_the_register_limit(v, dtype):
    # V <= ONCHIP_MAX_V stays in registers; past it the same kernel streams (both at the real limit).
    logits, uncond, tokens = _rows(5, 2, v, dtype, True, scale=4.0)
    for kw in (dict(top_p=0.9), dict(top_k=2000), dict(top_k=2000, top_p=0.75)):
        check_sampling(logits, uncond, **kw)
        check_pooled(logits, tokens, None, uncond, **kw)


def test_empty_batch():
    logits = torch.zeros(0, 5)
    assert sampling(logits, top_k=2, top_p=0.5).shape == (0, 5)
    assert all(t.shape == (0,) for t in pooled(logits, torch.zeros(0, dtype=torch.int64), top_k=2))


def test_unknown_kernel_is_refused_naming_the_argument():
    logits, _, tokens = _rows(6, 2, 10, torch.float32, False)
    with pytest.raises(ValueError, match="kernel"):
        tp.sampling_probs(logits, None, 1.0, 1.0, 0, 1.0, kernel="radix")
    with pytest.raises(ValueError, match="kernel"):
        tp.pool_probs(logits, tokens, None, None, 1.0, 1.0, 0, None, 1.0, kernel="")
    p = torch.softmax(logits, 1)
    with pytest.raises(ValueError, match="kernel"):
        tv.sample_residual(p, None, torch.rand(2), 0, 0, kernel="v2")


def test_default_kernel_is_the_default():
    # The kernels that have run on a GPU stay the default: no keyword, the default kernels.
    import inspect

    for fn in (tp.pool_probs, tp.sampling_probs, tv.sample_residual):
        assert inspect.signature(fn).parameters["kernel"].default == "default"


# ---- sample_residual ---------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 5), v=st.sampled_from([1, 3, 64, 100, 2049, 5000]),
       sparsity=st.sampled_from([0.0, 0.5, 0.99]), with_q=st.booleans(), with_u=st.booleans())
@settings(max_examples=40)
def test_sample_residual_matches_the_default_kernel_and_reference(seed, m, v, sparsity, with_q, with_u):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(m, v, generator=g) * (torch.rand(m, v, generator=g) >= sparsity)
    p[:, int(torch.randint(0, v, (1,), generator=g))] += 0.01
    p = p / p.sum(1, keepdim=True)
    q = torch.softmax(torch.randn(m, v, generator=g) * 2, 1)
    if m > 1:
        q[0] = p[0]  # a zero residual: the fallback to p
    u = torch.rand(m, generator=g)
    u[0] = 1.0 - 2 ** -24
    q = q if with_q else None
    u = u if with_u else None
    got = tv.sample_residual(_on(p), _on(q), _on(u), 1234, 5, kernel="onchip")
    default = tv.sample_residual(_on(p), _on(q), _on(u), 1234, 5)
    assert torch.equal(got[0].cpu(), default[0].cpu()) and torch.equal(got[1].cpu(), default[1].cpu())
    if u is not None:
        want = ref_verification.sample_residual(p, q, u)
        assert torch.equal(got[0].cpu(), want.tokens) and torch.equal(got[1].cpu(), want.fallback)


def test_sample_residual_last_entry_and_long_rows():
    for v in (1, 3, 2049, 16384, 16385):  # 16385: past the register limit, the default kernel
        p = torch.zeros(3, v)
        p[:, -1] = 1.0
        u = torch.tensor([0.0, 0.5, 1.0 - 2 ** -24])
        got = tv.sample_residual(_on(p), None, _on(u), 0, 0, kernel="onchip")
        assert got[0].cpu().tolist() == [v - 1] * 3
