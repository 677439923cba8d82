"""top_p (nucleus) in pool_probs and sampling_probs (docs/design.md "Kernel 1", step 2): every backend
against the reference, the reference against the rule written out independently, edge cases,
argument checks, and decoders that never emit a token outside the nucleus.

The nucleus is a discrete decision, so it is compared exactly: every backend computes the masses
in the same fixed point (specdec.reference.pooling.top_p_weights), so the kept set is the same set
bit for bit; probabilities of the kept set agree to float32 rounding.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import device_backend_pairs
from specdec import ops
from specdec.reference import pooling as ref

PAIRS = device_backend_pairs()
ALL_PAIRS = [pytest.param("cpu", "reference", id="cpu-reference")] + PAIRS
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOP_PS = [1e-12, 0.05, 0.3, 0.5, 0.9, 0.99, 1.0 - 2 ** -40, 1.0]


def _rows(seed, n, v, dtype, cfg, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype)
    uncond = (torch.randn(n, v, generator=g) * scale).to(dtype) if cfg else None
    tokens = torch.randint(0, v, (n,), generator=g)
    return logits, uncond, tokens


def _on(t, device):
    return None if t is None else t.to(device)


def _kept(p):
    return p.cpu() > 0


def brute_force_kept(l: torch.Tensor, top_p: float) -> torch.Tensor:
    """The fixed-point rule written out with Python integers, O(V^2): keep v iff the weight of the
    tokens with a strictly larger logit is < top_p * the total weight."""
    w = ref.top_p_weights(l, l.amax(-1)).tolist()
    rows = []
    for r, row in enumerate(l.tolist()):
        total = sum(w[r])
        rows.append([float(sum(wu for lu, wu in zip(row, w[r]) if lu > lv)) < top_p * float(total) for lv in row])
    return torch.tensor(rows)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4), v=st.sampled_from([1, 2, 5, 40]),
       top_p=st.sampled_from(TOP_PS[:-1]), ties=st.booleans())
@settings(max_examples=60)
def test_reference_mask_is_the_rule(seed, n, v, top_p, ties):
    g = torch.Generator().manual_seed(seed)
    l = torch.randn(n, v, generator=g) * 3
    if ties:
        l = l.round()  # many exact ties
    keep = ref.top_p_mask(l, top_p) > -math.inf
    assert torch.equal(keep, brute_force_kept(l, top_p))


@given(seed=st.integers(0, 2**31 - 1), v=st.sampled_from([3, 50, 500]), top_p=st.sampled_from([0.1, 0.5, 0.9]))
@settings(max_examples=40)
def test_reference_nucleus_is_the_softmax_nucleus(seed, v, top_p):
    # Against float64 softmax masses: the same set except where a mass lies within rounding of top_p.
    g = torch.Generator().manual_seed(seed)
    l = torch.randn(3, v, generator=g) * 2
    keep = ref.top_p_mask(l, top_p) > -math.inf
    p = torch.softmax(l.double(), -1)
    above = torch.stack([(p * (l > l[:, i:i + 1])).sum(-1) for i in range(v)], -1)
    want = above < top_p
    clear = (above - top_p).abs() > 1e-5
    assert torch.equal(keep[clear], want[clear])
    # The smallest set whose mass reaches top_p: the kept mass reaches it, dropping the least
    # probable kept group would not.
    assert bool(((p * keep).sum(-1) >= top_p - 1e-5).all())


def test_weights_are_fixed_point_exp():
    l = -torch.linspace(0, 21, 5001)[None]
    w = ref.top_p_weights(l, l.amax(-1)).double()
    exact = torch.exp(l.double()) * 2 ** 30
    assert w[0, 0] == 2 ** 30  # the max weighs exactly 2^30
    assert bool(((w - exact).abs() <= exact * 3e-7 + 1.0).all())
    assert bool((w[0, 1:] <= w[0, :-1]).all())  # monotone
    assert int(ref.top_p_weights(torch.tensor([[0.0, -float("inf"), -40.0]]), torch.zeros(1))[0, 1:].sum()) == 0


@pytest.mark.parametrize("device,backend", PAIRS)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5), v=st.sampled_from([1, 2, 7, 100, 257, 2049]),
       dtype=st.sampled_from(DTYPES), cfg=st.booleans(), temperature=st.sampled_from([1.0, 0.7, 1.6]),
       top_k=st.sampled_from([0, 1, 5, 50]), top_p=st.sampled_from(TOP_PS), ties=st.booleans())
@settings(max_examples=25)  # the Triton interpreter pays per pass of the bisections
def test_sampling_probs_top_p_matches_reference(device, backend, seed, n, v, dtype, cfg, temperature, top_k,
                                                top_p, ties):
    logits, uncond, _ = _rows(seed, n, v, dtype, cfg)
    if ties:
        logits = logits.float().round().to(dtype)
    kw = dict(cfg_scale=2.5, temperature=temperature, top_k=top_k, top_p=top_p)
    got = ops.sampling_probs(_on(logits, device), uncond_logits=_on(uncond, device), backend=backend, **kw).cpu()
    want = ref.sampling_probs(logits, uncond_logits=uncond, **kw)
    assert torch.equal(_kept(got), _kept(want))  # the nucleus, exactly
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got.sum(1), torch.ones(n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,backend", PAIRS)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5), v=st.sampled_from([2, 33, 300, 1000]),
       dtype=st.sampled_from(DTYPES), cfg=st.booleans(), top_k=st.sampled_from([0, 3, 40]),
       top_p=st.sampled_from(TOP_PS), k=st.sampled_from([0, 1, 8]), delta=st.sampled_from([None, 0.05, 0.5]))
@settings(max_examples=20)
def test_pool_probs_top_p_matches_reference(device, backend, seed, n, v, dtype, cfg, top_k, top_p, k, delta):
    import specdec

    logits, uncond, tokens = _rows(seed, n, v, dtype, cfg)
    k = min(k, v - 1)
    neighbors = None
    if k > 0:
        neighbors = specdec.neighbors.knn_table(torch.randn(v, 3, generator=torch.Generator().manual_seed(seed)), k)
    kw = dict(cfg_scale=3.0, temperature=0.9, top_k=top_k, top_p=top_p, delta=delta)
    got = ops.pool_probs(_on(logits, device), _on(tokens, device), _on(neighbors, device),
                         uncond_logits=_on(uncond, device), backend=backend, **kw)
    want = ref.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, **kw)
    names = ("pooled", "p_token", "row_max", "row_lse")
    # p_token is 0 exactly where the token is outside the nucleus, on every backend.
    assert torch.equal(got.p_token.cpu() > 0, want.p_token > 0)
    skip_pooled = torch.zeros(n, dtype=torch.bool)
    if neighbors is not None and delta is not None:  # a neighbour prefix within rounding of delta
        p = ref.sampling_probs(logits.double(), uncond_logits=None if uncond is None else uncond.double(),
                               cfg_scale=3.0, temperature=0.9, top_k=top_k, top_p=top_p).double()
        inclusive = torch.cumsum(p.gather(1, neighbors.long()[tokens]), 1)
        skip_pooled = ((inclusive - delta).abs() <= 1e-5).any(1)
    for name, a, b in zip(names, got, want):
        a = a.cpu()
        if name == "pooled":
            a, b = a[~skip_pooled], b[~skip_pooled]
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_ties_at_the_threshold_are_kept(device, backend):
    # Integer logits are exact in every dtype. Row: one 3, four 2s, the rest 0: the 3 alone holds
    # less than top_p, so the cut falls inside the group of 2s, and all of them are kept.
    v = 20
    l = torch.zeros(2, v)
    l[:, 0] = 3.0
    l[:, 5:9] = 2.0
    p3 = math.exp(3) / (math.exp(3) + 4 * math.exp(2) + 15)
    for top_p in (p3 + 0.01, p3 + 0.2):
        got = _kept(ops.sampling_probs(l.to(device), top_p=top_p, backend=backend))
        want = torch.zeros(2, v, dtype=torch.bool)
        want[:, 0] = True
        want[:, 5:9] = True
        assert torch.equal(got, want), top_p
    # top_p at or below the max's mass keeps only it.
    assert _kept(ops.sampling_probs(l.to(device), top_p=p3 - 0.01, backend=backend)).sum().item() == 2


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_top_p_one_is_a_no_op(device, backend):
    logits, uncond, tokens = _rows(1, 4, 300, torch.float32, True)
    args = (_on(logits, device),)
    kw = dict(uncond_logits=_on(uncond, device), cfg_scale=2.0, top_k=50, backend=backend)
    assert torch.equal(ops.sampling_probs(*args, top_p=1.0, **kw), ops.sampling_probs(*args, **kw))
    a = ops.pool_probs(*args, _on(tokens, device), None, top_p=1.0, **kw)
    b = ops.pool_probs(*args, _on(tokens, device), None, **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_tiny_top_p_keeps_the_argmax_and_its_ties(device, backend):
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-4, 5, (6, 64), generator=g).float()
    logits[0] = 1.0  # all tied
    for top_p in (1e-300, 1e-9, 1e-3):
        got = _kept(ops.sampling_probs(logits.to(device), top_p=top_p, backend=backend))
        assert torch.equal(got, logits == logits.amax(1, keepdim=True)), top_p
    p = ops.sampling_probs(logits.to(device), top_p=1e-9, backend=backend).cpu()
    ties = (logits == logits.amax(1, keepdim=True)).sum(1, keepdim=True).float()
    torch.testing.assert_close(p, (p > 0) / ties)  # renormalised over the kept logits


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_statistics_describe_the_final_softmax(device, backend):
    logits, uncond, tokens = _rows(3, 5, 200, torch.float32, True)
    kw = dict(uncond_logits=_on(uncond, device), cfg_scale=1.5, top_k=30, top_p=0.6, backend=backend)
    out = ops.pool_probs(_on(logits, device), _on(tokens, device), None, **kw)
    p = ops.sampling_probs(_on(logits, device), **kw).cpu()
    l = ref.guided_logits(logits, uncond, 1.5)
    kept = p > 0
    lse = torch.logsumexp(torch.where(kept, l, torch.full_like(l, -math.inf)), 1)
    torch.testing.assert_close(out.row_lse.cpu(), lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.row_max.cpu(), l.amax(1))
    # Any p(v) is rebuilt from the logits and the two statistics, as the contract promises.
    rebuilt = torch.where(kept, torch.exp(l - out.row_lse.cpu()[:, None]), torch.zeros_like(l))
    torch.testing.assert_close(rebuilt, p, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out.p_token.cpu(), p.gather(1, tokens[:, None])[:, 0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_masked_and_bad_rows_with_top_p(device, backend):
    logits, uncond, tokens = _rows(4, 5, 40, torch.float32, True)
    logits[0, :30] = -float("inf")  # masking is legal: -inf tokens are never in the nucleus
    logits[1, 7] = float("nan")
    uncond[2, 3] = float("inf")
    logits[3, :] = -float("inf")  # no finite logit
    kw = dict(uncond_logits=_on(uncond, device), cfg_scale=2.0, top_p=0.7, backend=backend)
    for top_k in (0, 5):
        p = ops.sampling_probs(_on(logits, device), top_k=top_k, **kw).cpu()
        assert torch.isnan(p[1:4]).all() and torch.isfinite(p[[0, 4]]).all()
        assert (p[0, :30] == 0).all() and p[0].sum() > 0.99
        out = ops.pool_probs(_on(logits, device), _on(tokens, device), None, top_k=top_k, **kw)
        for t in out:
            t = t.cpu()
            assert torch.isnan(t[1:4]).all() and torch.isfinite(t[[0, 4]]).all()


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_large_vocabulary_top_p(device, backend):
    v = 65536
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, v, generator=g) * 4).half()
    for kw in (dict(top_p=0.9), dict(top_p=0.5, top_k=1000)):
        got = ops.sampling_probs(logits.to(device), backend=backend, **kw).cpu()
        want = ref.sampling_probs(logits, **kw)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_bad_top_p_raises_naming_it(device, backend):
    logits, _, tokens = _rows(6, 2, 10, torch.float32, False)
    for bad in (0.0, -0.1, 1.5, float("nan"), float("inf"), "0.5", None, True):
        with pytest.raises(ValueError, match="top_p"):
            ops.sampling_probs(logits.to(device), top_p=bad, backend=backend)
        with pytest.raises(ValueError, match="top_p"):
            ops.pool_probs(logits.to(device), tokens.to(device), None, top_p=bad, backend=backend)


def test_compiled_op_checks_top_p_and_passes_opcheck():
    import specdec

    if not specdec.build_info()["cpu_kernels"]:
        pytest.skip("C++ extension not built")
    logits, uncond, tokens = _rows(7, 4, 30, torch.float32, True)
    nb = specdec.neighbors.knn_table(torch.randn(30, 2), 4)
    with pytest.raises(ValueError, match="top_p"):
        torch.ops.specdec.pool_probs(logits, tokens, None, None, 1.0, 1.0, 0, None, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        torch.ops.specdec.sampling_probs(logits, None, 1.0, 1.0, 0, 1.5)
    torch.library.opcheck(torch.ops.specdec.pool_probs, (logits, tokens, nb, uncond, 2.0, 0.9, 10, 0.2, 0.8))
    torch.library.opcheck(torch.ops.specdec.sampling_probs, (logits, uncond, 2.0, 0.9, 10, 0.5))
    # The schema's default keeps old positional callers working.
    assert torch.equal(torch.ops.specdec.sampling_probs(logits, None, 1.0, 1.0, 0),
                       torch.ops.specdec.sampling_probs(logits, None, 1.0, 1.0, 0, 1.0))


# ---- decoders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ar", "sd"])
def test_decode_never_leaves_the_nucleus(method):
    from decoding_models import tiny_gpt
    from specdec.decoding import ar, sd
    from specdec.settings import RunSettings, Sampling

    torch.set_num_threads(1)
    vocab, grid, top_p = 16, 4, 0.5
    target = tiny_gpt(grid, vocab, seed=1, scale=0.6)
    sampling = Sampling(cfg_scale=1.5, temperature=1.0, top_k=12, top_p=top_p)
    classes = torch.tensor([0, 1, 2, 1])
    if method == "ar":
        out = ar.decode(target, classes, run=RunSettings(seed=3, sampling=sampling))
    else:
        drafter = tiny_gpt(grid, vocab, seed=2, dim=16, layers=1, scale=0.6)
        out = sd.decode(target, classes, drafter=drafter, options=sd.SDOptions(chunk=3),
                        run=RunSettings(seed=3, sampling=sampling))
    grids = out.tokens.reshape(len(classes), -1)
    with torch.no_grad():
        p0 = target.prefix_len - 1
        cond = target.teacher_forward(grids, classes).logits[:, p0:-1].double()
        unc = target.teacher_forward(grids, torch.full_like(classes, target.null_class)).logits[:, p0:-1].double()
    l = unc + 1.5 * (cond - unc)
    kth = l.topk(12, -1).values[..., -1:]
    l = torch.where(l >= kth, l, torch.full_like(l, -math.inf))
    p = torch.softmax(l, -1)
    x = grids[..., None]
    above = (p * (l > l.gather(-1, x))).sum(-1)  # mass of the tokens more probable than the emitted one
    # Teacher forcing rounds differently from the cached decode: a margin far below any real gap.
    assert bool((above < top_p + 1e-4).all()), above.max()
    assert bool((above > 0).any()), "the test should emit tokens other than the argmax"


def test_sampling_validates_top_p():
    from specdec.settings import Sampling

    assert Sampling().top_p == 1.0
    for bad in (0.0, 1.01, float("nan"), "0.9", True):
        with pytest.raises(ValueError, match="top_p"):
            Sampling(top_p=bad)
    s = Sampling(top_p=0.8, top_k=5)
    assert s.args[3] == 0.8


# ---- CUDA v2 (shared-memory) kernels: opt-in, compiled here, run only where a GPU is ---------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the v2 kernels have never run on one)")
@pytest.mark.parametrize("v", [7, 1000, 16384, 65536])  # 65536 float32 exceeds shared memory: v1 fallback
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_shared_memory_kernels_match_the_reference(monkeypatch, v, dtype):
    import specdec

    if not specdec.build_info()["cuda_kernels"]:
        pytest.skip("extension built without CUDA kernels")
    monkeypatch.setenv("SPECDEC_CUDA_POOL", "v2")
    logits, uncond, tokens = _rows(11, 6, v, dtype, True)
    neighbors = torch.randint(0, v, (v, 16), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    for kw in (dict(), dict(top_k=50), dict(top_p=0.8), dict(top_k=100, top_p=0.5, delta=0.2)):
        kw = dict(cfg_scale=2.0, **kw)
        got = ops.pool_probs(logits.cuda(), tokens.cuda(), neighbors.cuda(), uncond_logits=uncond.cuda(),
                             backend="cuda", **kw)
        want = ref.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, **kw)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=2e-5, atol=2e-6, equal_nan=True)
        kw.pop("delta", None)
        p = ops.sampling_probs(logits.cuda(), uncond_logits=uncond.cuda(), backend="cuda", **kw).cpu()
        want_p = ref.sampling_probs(logits, uncond_logits=uncond, **kw)
        assert torch.equal(p > 0, want_p > 0)
        torch.testing.assert_close(p, want_p, rtol=2e-5, atol=2e-6)
        u = torch.rand(6, generator=torch.Generator().manual_seed(2))
        q = torch.softmax(torch.randn(6, v, generator=torch.Generator().manual_seed(3)), 1)
        for qq in (None, q, want_p):  # want_p as q: a zero residual, the fallback
            got_s = ops.sample_residual(p.cuda(), None if qq is None else qq.cuda(), uniforms=u.cuda(), backend="cuda")
            want_s = ops.sample_residual(p, qq, uniforms=u, backend="reference")
            assert torch.equal(got_s.tokens.cpu(), want_s.tokens) and torch.equal(got_s.fallback.cpu(), want_s.fallback)
    # Rows that do not start on a 16-byte boundary take the scalar staging loads.
    wide = torch.cat([torch.zeros(6, 1, dtype=dtype), logits], 1).cuda()[:, 1:]
    got = ops.pool_probs(wide, tokens.cuda(), None, top_p=0.7, backend="cuda")
    want = ref.pool_probs(logits, tokens, None, top_p=0.7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-5, atol=2e-6)
