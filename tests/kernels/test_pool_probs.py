"""Kernel 1 (pool_probs, sampling_probs): every backend against the reference.

Tolerances come from float32 rounding only: the backends sum in different orders, so
probabilities agree to a few ulps, never bit for bit. Two decisions are discrete and could flip
on a rounding difference, and are handled explicitly rather than with loose tolerances:
- the top-k threshold: guided logits are computed op by op on every backend (no FMA), so ties
  are resolved identically and the kept set is compared exactly;
- LANTERN's delta cut: a row whose neighbour prefix sum lies within rounding of delta may cut
  one neighbour earlier or later; such rows are recognised from the reference's own prefix sums.
"""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import device_backend_pairs
import specdec
from specdec import ops
from specdec.reference import pooling as ref

PAIRS = device_backend_pairs()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _make_inputs(seed, n, v, k, dtype, device, cfg, token_dtype=torch.int64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype)
    uncond = (torch.randn(n, v, generator=g) * scale).to(dtype) if cfg else None
    tokens = torch.randint(0, v, (n,), generator=g).to(token_dtype)
    neighbors = None
    if k > 0:
        codebook = torch.randn(v, 3, generator=g)
        neighbors = specdec.neighbors.knn_table(codebook, k)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(logits), move(tokens), move(neighbors), move(uncond)


def _delta_ambiguous_rows(logits, tokens, neighbors, delta, kw, rel=1e-5):
    """Rows where some neighbour prefix sum is within rounding of delta (the cut may differ)."""
    n = logits.shape[0]
    if neighbors is None or delta is None:
        return torch.zeros(n, dtype=torch.bool)
    p = ref.sampling_probs(logits.cpu().double(), **kw).double()
    inclusive = torch.cumsum(p.gather(1, neighbors.cpu().long()[tokens.cpu().long()]), 1)
    return ((inclusive - delta).abs() <= rel * max(delta, 1e-3) + 1e-6).any(1)


def assert_pooled_close(got, want, skip_pooled=None):
    names = ("pooled", "p_token", "row_max", "row_lse")
    for name, a, b in zip(names, got, want):
        a, b = a.cpu(), b.cpu()
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        if name == "pooled" and skip_pooled is not None and skip_pooled.any():
            a, b = a[~skip_pooled], b[~skip_pooled]
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device,backend", PAIRS)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    v=st.sampled_from([1, 2, 7, 100, 257, 1000]),
    k_frac=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    dtype=st.sampled_from(DTYPES),
    cfg=st.booleans(),
    cfg_scale=st.sampled_from([1.0, 2.5, 4.0]),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 1, 5, 50]),
    delta=st.sampled_from([None, 0.0, 0.01, 0.1, 0.5, 2.0]),
    token_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_pool_probs_matches_reference(device, backend, seed, n, v, k_frac, dtype, cfg, cfg_scale,
                                      temperature, top_k, delta, token_dtype):
    k = min(v - 1, int(round(k_frac * (v - 1))))
    logits, tokens, neighbors, uncond = _make_inputs(seed, n, v, k, dtype, device, cfg, token_dtype)
    kw = dict(uncond_logits=uncond, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k)
    got = ops.pool_probs(logits, tokens, neighbors, delta=delta, backend=backend, **kw)
    want = ops.pool_probs(logits.cpu(), tokens.cpu(), None if neighbors is None else neighbors.cpu(),
                          delta=delta, backend="reference",
                          **{**kw, "uncond_logits": None if uncond is None else uncond.cpu()})
    skip = _delta_ambiguous_rows(logits, tokens, neighbors, delta,
                                 {**kw, "uncond_logits": None if uncond is None else uncond.cpu()})
    assert_pooled_close(got, want, skip)


@pytest.mark.parametrize("device,backend", PAIRS)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 5),
    v=st.sampled_from([1, 3, 64, 300, 2049]),
    dtype=st.sampled_from(DTYPES),
    cfg=st.booleans(),
    top_k=st.sampled_from([0, 1, 10, 3000]),
    temperature=st.sampled_from([1.0, 0.5]),
)
def test_sampling_probs_matches_reference(device, backend, seed, n, v, dtype, cfg, top_k, temperature):
    logits, _, _, uncond = _make_inputs(seed, n, v, 0, dtype, device, cfg)
    kw = dict(cfg_scale=3.0, temperature=temperature, top_k=top_k)
    got = ops.sampling_probs(logits, uncond_logits=uncond, backend=backend, **kw).cpu()
    want = ref.sampling_probs(logits.cpu(), uncond_logits=None if uncond is None else uncond.cpu(), **kw)
    # The kept set is decided exactly (same roundings on every backend), probabilities to ulps.
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got.sum(1), torch.ones(n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_top_k_keeps_ties(device, backend):
    # Integer logits are exact in every dtype, so ties at the threshold are real ties.
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (8, 50), generator=g).float().to(device)
    for top_k in (1, 3, 10, 49):
        p = ops.sampling_probs(logits, top_k=top_k, backend=backend).cpu()
        kth = torch.topk(logits.cpu(), top_k, dim=1).values[:, -1:]
        expected_kept = logits.cpu() >= kth
        assert torch.equal(p > 0, expected_kept)
        assert (expected_kept.sum(1) >= top_k).all()
        assert (expected_kept.sum(1) > top_k).any(), "the inputs should contain ties at the threshold"


@pytest.mark.parametrize("device,backend", PAIRS)
def test_delta_rule_limits(device, backend):
    logits, tokens, neighbors, _ = _make_inputs(1, 6, 64, 63, torch.float32, device, cfg=False)
    none = ops.pool_probs(logits, tokens, neighbors, delta=None, backend=backend)
    zero = ops.pool_probs(logits, tokens, neighbors, delta=0.0, backend=backend)
    large = ops.pool_probs(logits, tokens, neighbors, delta=10.0, backend=backend)
    # delta = 0 moves nothing (neighbour probabilities are all > 0 here).
    torch.testing.assert_close(zero.pooled, zero.p_token, rtol=0, atol=0)
    # All K = V - 1 neighbours plus the token itself make up the whole distribution.
    torch.testing.assert_close(none.pooled.cpu(), torch.ones(6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(large.pooled, none.pooled, rtol=1e-6, atol=1e-7)
    small = ops.pool_probs(logits, tokens, neighbors, delta=0.05, backend=backend)
    moved = (small.pooled - small.p_token).cpu()
    assert (moved >= 0).all() and (moved <= 0.05 + 1e-7).all()


@pytest.mark.parametrize("device,backend", PAIRS)
def test_no_neighbors_means_p_token(device, backend):
    logits, tokens, _, _ = _make_inputs(2, 4, 33, 0, torch.float32, device, cfg=False)
    out = ops.pool_probs(logits, tokens, None, backend=backend)
    assert torch.equal(out.pooled, out.p_token)
    p = torch.softmax(logits.cpu().float(), 1).gather(1, tokens.cpu()[:, None]).squeeze(1)
    torch.testing.assert_close(out.p_token.cpu(), p, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_bad_rows_give_nan_only_there(device, backend):
    logits, tokens, neighbors, uncond = _make_inputs(3, 5, 40, 8, torch.float32, device, cfg=True)
    logits[1, 7] = float("nan")
    uncond[2, 3] = float("inf")
    logits[3, :] = -float("inf")  # no finite logit at all
    logits[4, :10] = -float("inf")  # masking is legal: a finite row
    for kw in (dict(), dict(top_k=5), dict(delta=0.2)):
        out = ops.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, cfg_scale=2.0,
                             backend=backend, **kw)
        for t in out:
            t = t.cpu()
            assert torch.isnan(t[1:4]).all()
            assert torch.isfinite(t[[0, 4]]).all()
        want = ref.pool_probs(logits.cpu(), tokens.cpu(), neighbors.cpu(), uncond_logits=uncond.cpu(),
                              cfg_scale=2.0, **kw)
        assert_pooled_close(out, want)
        p = ops.sampling_probs(logits, uncond_logits=uncond, cfg_scale=2.0, backend=backend,
                               top_k=kw.get("top_k", 0)).cpu()
        assert torch.isnan(p[1:4]).all() and torch.isfinite(p[[0, 4]]).all()


@pytest.mark.parametrize("device,backend", PAIRS)
def test_masked_token_has_zero_probability(device, backend):
    logits, tokens, _, uncond = _make_inputs(4, 3, 20, 0, torch.float32, device, cfg=True)
    rows = torch.arange(3, device=device)
    uncond[rows, tokens.long()] = -float("inf")  # masked in one CFG half -> masked after guidance
    out = ops.pool_probs(logits, tokens, None, uncond_logits=uncond, cfg_scale=3.0, backend=backend)
    assert torch.equal(out.p_token.cpu(), torch.zeros(3))


@pytest.mark.parametrize("device,backend", PAIRS)
def test_large_vocabulary(device, backend):
    # V = 65536 (the contract's minimum), fp16 logits, first and last ids.
    v = 65536
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, v, generator=g) * 4).half().to(device)
    tokens = torch.tensor([0, v - 1], device=device)
    # A full [V, V - 1] table would take 16 GiB: use LlamaGen's K = 1000 with random ids.
    k = 1000
    neighbors = torch.randint(0, v, (v, k), generator=g, dtype=torch.int32).to(device)
    for kw in (dict(delta=0.1), dict(top_k=1000, delta=None)):
        got = ops.pool_probs(logits, tokens, neighbors, backend=backend, **kw)
        want = ref.pool_probs(logits.cpu(), tokens.cpu(), neighbors.cpu(), **kw)
        skip = _delta_ambiguous_rows(logits, tokens, neighbors, kw["delta"], dict(top_k=kw.get("top_k", 0)))
        assert_pooled_close(got, want, skip)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_neighbors_int16_and_int64_tables(device, backend):
    logits, tokens, neighbors, _ = _make_inputs(6, 4, 90, 12, torch.float32, device, cfg=False)
    want = ops.pool_probs(logits, tokens, neighbors, delta=0.3, backend=backend)
    for table in (neighbors.to(torch.int16), neighbors.to(torch.int64)):
        got = ops.pool_probs(logits, tokens, table, delta=0.3, backend=backend)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_non_contiguous_logits(device, backend):
    logits, tokens, neighbors, _ = _make_inputs(7, 4, 50, 5, torch.float32, device, cfg=False)
    wide = torch.zeros(50, 4, device=device)
    wide.copy_(logits.T)
    transposed = wide.T  # stride(1) != 1
    got = ops.pool_probs(transposed, tokens, neighbors, backend=backend)
    want = ops.pool_probs(logits, tokens, neighbors, backend=backend)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    strided_tokens = torch.stack([tokens, tokens], 1)[:, 0]  # stride 2
    got = ops.pool_probs(logits, strided_tokens, neighbors, backend=backend)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _bad_calls(device):
    logits, tokens, neighbors, uncond = _make_inputs(8, 3, 10, 4, torch.float32, device, cfg=True)
    ok = dict(logits=logits, tokens=tokens, neighbors=neighbors)
    return [
        ("tokens", dict(ok, tokens=torch.tensor([0, 1, 10], device=device))),
        ("tokens", dict(ok, tokens=torch.tensor([0, -1, 2], device=device))),
        ("tokens", dict(ok, tokens=tokens[:2])),
        ("tokens", dict(ok, tokens=tokens.float())),
        ("neighbors", dict(ok, neighbors=torch.full((10, 4), 10, dtype=torch.int32, device=device))),
        ("neighbors", dict(ok, neighbors=torch.full((10, 4), -2, dtype=torch.int32, device=device))),
        ("neighbors", dict(ok, neighbors=neighbors[:9])),
        ("neighbors", dict(ok, neighbors=neighbors.float())),
        ("neighbors", dict(ok, neighbors=neighbors.long() + 2 ** 32)),   # (int64 ids were cast to int32 first)
        ("logits", dict(ok, logits=logits[0])),
        ("logits", dict(ok, logits=logits.double())),
        ("uncond_logits", dict(ok, uncond_logits=uncond[:2])),
        ("uncond_logits", dict(ok, uncond_logits=uncond.half())),
        ("temperature", dict(ok, temperature=float("nan"))),
        ("temperature", dict(ok, temperature=float("inf"))),
        ("temperature", dict(ok, temperature=0.0)),
        ("temperature", dict(ok, temperature=-1.0)),
        # (finite Python floats that are inf or 0 in float32, where the kernels compute: a CPU row
        # of a vocabulary that is not a multiple of its vector width turned NaN at 1e39)
        ("temperature", dict(ok, temperature=1e39)),
        ("temperature", dict(ok, temperature=1e-46)),
        ("temperature", dict(ok, temperature=1e-39)),
        ("cfg_scale", dict(ok, uncond_logits=uncond, cfg_scale=float("nan"))),
        ("cfg_scale", dict(ok, uncond_logits=uncond, cfg_scale=-1e39)),
        ("top_k", dict(ok, top_k=-1)),
        ("top_k", dict(ok, top_k=2.5)),
        ("top_k", dict(ok, top_k=2 ** 63)),          # (past an int64: the op's schema failed on it)
        ("temperature", dict(ok, temperature=True)),
        ("cfg_scale", dict(ok, uncond_logits=uncond, cfg_scale="2")),
        ("delta", dict(ok, delta=-0.1)),
        ("delta", dict(ok, delta=float("nan"))),
    ]


@pytest.mark.parametrize("device,backend", PAIRS + [pytest.param("cpu", "reference", id="cpu-reference")])
def test_bad_arguments_raise_value_error_naming_them(device, backend):
    for name, kwargs in _bad_calls(device):
        with pytest.raises(ValueError, match=name):
            ops.pool_probs(**kwargs, backend=backend)


def test_a_table_made_under_inference_mode_is_checked_and_an_edit_is_seen():
    """A neighbour table's range check is kept per table and version; one made under inference_mode
    has no version counter (reading it raised; a verdict kept on it missed an in-place edit, and
    Triton then read out of range), so it is checked at every call."""
    logits, tokens, neighbors, _ = _make_inputs(8, 3, 10, 4, torch.float32, "cpu", cfg=False)
    with torch.inference_mode():
        table = neighbors.clone()
        ops.pool_probs(logits, tokens, table)
        bad = torch.full_like(table, 10)
        with pytest.raises(ValueError, match="neighbors"):
            ops.pool_probs(logits, tokens, bad)
    ops.pool_probs(logits, tokens, table)      # (outside inference_mode too)
    with torch.inference_mode():
        table[0, 1] = 10 ** 6      # (no version counter to see it: such a table is checked every call)
        for backend in specdec.available_backends(torch.device("cpu")):
            with pytest.raises(ValueError, match="neighbors"):
                ops.pool_probs(logits, tokens, table, backend=backend)
    ordinary = neighbors.clone()
    ops.pool_probs(logits, tokens, ordinary)
    ordinary[0, 0] = 10                       # (an in-place torch op: a new version, checked again)
    with pytest.raises(ValueError, match="neighbors"):
        ops.pool_probs(logits, tokens, ordinary)


def test_device_mismatch_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    logits, tokens, neighbors, _ = _make_inputs(9, 3, 10, 4, torch.float32, "cuda", cfg=False)
    with pytest.raises(ValueError, match="tokens"):
        ops.pool_probs(logits, tokens.cpu(), neighbors)


def test_compiled_op_checks_arguments_itself():
    # torch.ops.specdec.pool_probs is usable without the Python wrapper: it validates too.
    logits, tokens, neighbors, _ = _make_inputs(10, 3, 10, 4, torch.float32, "cpu", cfg=False)
    with pytest.raises(ValueError, match="tokens"):
        torch.ops.specdec.pool_probs(logits, tokens[:2], neighbors, None, 1.0, 1.0, 0, None)
    with pytest.raises(ValueError, match="tokens"):
        torch.ops.specdec.pool_probs(logits, tokens + 100, neighbors, None, 1.0, 1.0, 0, None)
    with pytest.raises(ValueError, match="temperature"):
        torch.ops.specdec.pool_probs(logits, tokens, neighbors, None, 1.0, 0.0, 0, None)
    with pytest.raises(ValueError, match="neighbors"):
        torch.ops.specdec.pool_probs(logits, tokens, neighbors + 100, None, 1.0, 1.0, 0, None)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_opcheck(device):
    logits, tokens, neighbors, uncond = _make_inputs(11, 4, 30, 5, torch.float32, device, cfg=True)
    torch.library.opcheck(torch.ops.specdec.pool_probs, (logits, tokens, neighbors, uncond, 2.0, 0.9, 10, 0.2))
    torch.library.opcheck(torch.ops.specdec.pool_probs, (logits, tokens.int(), None, None, 1.0, 1.0, 0, None))
    torch.library.opcheck(torch.ops.specdec.sampling_probs, (logits, uncond, 2.0, 0.9, 10))


def test_torch_compile_fullgraph():
    logits, tokens, neighbors, uncond = _make_inputs(12, 4, 30, 5, torch.float32, "cpu", cfg=True)

    def step(lg, un, tk):
        out = torch.ops.specdec.pool_probs(lg, tk, neighbors, un, 2.0, 1.0, 0, 0.1)
        return out[0] * 2.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(logits, uncond, tokens), step(logits, uncond, tokens))


def test_reference_materialises_but_is_the_definition():
    # Independent check of the reference itself, written from docs/design.md step by step in float64.
    g = torch.Generator().manual_seed(13)
    v, k, delta = 12, 5, 0.15
    cond = torch.randn(1, v, generator=g, dtype=torch.float64)
    uncond = torch.randn(1, v, generator=g, dtype=torch.float64)
    nb = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(v)]).int()
    x = 4
    l = (uncond + 2.0 * (cond - uncond)) / 0.8
    p = torch.softmax(l, 1)[0]
    sums = [0.0]
    for j in range(k):
        sums.append(sums[-1] + float(p[nb[x, j]]))
    m_star = max(m for m in range(k + 1) if sums[m] <= delta)
    expected = float(p[x]) + sums[m_star]
    out = ref.pool_probs(cond.float(), torch.tensor([x]), nb, uncond_logits=uncond.float(), cfg_scale=2.0,
                         temperature=0.8, delta=delta)
    assert math.isclose(float(out.pooled), expected, rel_tol=1e-5)
    assert math.isclose(float(out.row_lse), float(torch.logsumexp(l, 1)), rel_tol=1e-5)


@pytest.mark.parametrize("device,backend", PAIRS + [pytest.param("cpu", "reference", id="cpu-reference")])
def test_empty_batch(device, backend):
    logits, tokens, neighbors, _ = _make_inputs(14, 1, 5, 2, torch.float32, device, cfg=False)
    out = ops.pool_probs(logits[:0], tokens[:0], neighbors, backend=backend)
    assert all(t.shape == (0,) and t.dtype == torch.float32 for t in out)
    assert ops.sampling_probs(logits[:0], backend=backend).shape == (0, 5)


@pytest.mark.parametrize("backend", [b for b in ("cpu", "triton")
                                     if b in specdec.available_backends(torch.device("cpu"))])
def test_backward_through_the_pooling_kernels_raises_and_the_reference_differentiates(backend):
    """The kernels have no backward: the cpu backend dropped the logits' gradients with a warning,
    Triton's outputs did not even require grad. Now backward raises, naming the op."""
    logits, tokens, neighbors, _ = _make_inputs(6, 3, 10, 4, torch.float32, "cpu", cfg=False)
    logits.requires_grad_(True)
    for op, call in (("pool_probs", lambda b: ops.pool_probs(logits, tokens, neighbors, backend=b).pooled),
                     ("sampling_probs", lambda b: ops.sampling_probs(logits, backend=b))):
        out = call(backend)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match=f"{op} has no backward on the {backend} backend"):
            out.sum().backward()
        logits.grad = None
        call("reference").sum().backward()
        assert logits.grad is not None and logits.grad.abs().sum() > 0
        logits.grad = None
        with torch.no_grad():
            assert call(backend).grad_fn is None


# ---- huge scaled logits (temperature 1e-4, guidance 1e4: |l| up to ~1e8) -----------------------
# p(v) = exp(l(v) - row_lse) lost precision there: row_lse is rounded to float32 at the size of l,
# so at l ~ 2e8 two tied tokens each got p = 1 (the row summed to 2) and near-tied tokens at
# l ~ 1e5 were off by up to ~0.4%. Every backend now computes p = exp((l - max) - log(sum)).
HUGE_CFG, HUGE_TEMPERATURE = 1e4, 1e-4  # the limits of Sampling (MAX_CFG_SCALE, MIN_TEMPERATURE)
HUGE_BACKENDS = PAIRS + [pytest.param("cpu", "reference", id="cpu-reference")]


def _huge_tie_rows(v=64, seed=0):
    """Rows whose guided logits (cfg 1e4, temperature 1e-4) are ~1e8 with two exactly tied maxima
    (tokens 3 and 40 share cond and uncond), the rest at least ~2e7 below: p = 0.5, 0.5, 0..."""
    g = torch.Generator().manual_seed(seed)
    uncond = torch.randn(4, v, generator=g)
    cond = uncond + (torch.randn(4, v, generator=g) * 0.5).clamp(max=1.5)
    uncond[0] = 0.0  # one row without an unconditional part
    cond[0] = torch.rand(v, generator=g) * 1.5
    cond[:, 3] = uncond[:, 3] + 2.0
    cond[:, 40], uncond[:, 40] = cond[:, 3], uncond[:, 3]
    return cond, uncond


def _near_tie_rows(v=48, seed=1):
    """(cond, uncond, cfg_scale): rows at cfg 1e4 / temperature 1e-4 (uncond 0) and at cfg 1 /
    temperature 1e-4 whose guided logits are M + d, M in {1e5, 2e6, 2e7}, with six near-tied
    tokens (d in [-4, 0]) and the others 50 to 150 below."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for m in (1e5, 2e6, 2e7):
        d = -50.0 - 100.0 * torch.rand(v, generator=g, dtype=torch.float64)
        d[:6] = torch.tensor([0.0, -0.3, -0.7, -1.2, -2.5, -4.0], dtype=torch.float64)
        d[:6] += 0.05 * torch.rand(6, generator=g, dtype=torch.float64)
        rows.append((m + d)[torch.randperm(v, generator=g)])
    target = torch.stack(rows)
    cases = []
    for cfg_scale in (HUGE_CFG, 1.0):
        # l = (u + s * (c - u)) / t with u = 0: c = l * t / s
        cond = (target * (HUGE_TEMPERATURE / cfg_scale)).float()
        cases.append((cond, torch.zeros_like(cond) if cfg_scale != 1.0 else None, cfg_scale))
    return cases


def _all_other_tokens(v):
    """A neighbour table that lists every other token: with delta=None, pooled is the row's sum."""
    ids = torch.arange(v, dtype=torch.int32)
    return torch.stack([torch.cat([ids[:x], ids[x + 1:]]) for x in range(v)])


@pytest.mark.parametrize("device,backend", HUGE_BACKENDS)
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (40, 1.0), (0, 0.9), (5, 0.95)])
def test_huge_scaled_logits_tied_tokens_split_the_mass(device, backend, top_k, top_p):
    cond, uncond = _huge_tie_rows()
    n, v = cond.shape
    kw = dict(uncond_logits=uncond.to(device), cfg_scale=HUGE_CFG, temperature=HUGE_TEMPERATURE,
              top_k=top_k, top_p=top_p)
    l = ref.guided_logits(cond, uncond, HUGE_CFG, HUGE_TEMPERATURE)
    assert (l.abs().amax(1) > 1e7).all() and torch.equal(l[:, 3], l[:, 40]) and (l.argmax(1) == 3).all()
    p = ops.sampling_probs(cond.to(device), backend=backend, **kw).cpu()
    want = torch.zeros(n, v)
    want[:, 3] = want[:, 40] = 0.5
    torch.testing.assert_close(p, want, rtol=0, atol=4e-7)
    torch.testing.assert_close(p.sum(1), torch.ones(n), rtol=0, atol=4e-7)
    out = ops.pool_probs(cond.to(device), torch.full((n,), 40, device=device), _all_other_tokens(v).to(device),
                         backend=backend, **kw)
    torch.testing.assert_close(out.p_token.cpu(), torch.full((n,), 0.5), rtol=0, atol=4e-7)
    torch.testing.assert_close(out.pooled.cpu(), torch.ones(n), rtol=0, atol=4e-7)  # the row's sum
    torch.testing.assert_close(out.row_max.cpu(), l[:, 3], rtol=0, atol=0)
    lse = (l[:, 3].double() + math.log(2.0)).float()  # rounded to float32 at the size of l
    torch.testing.assert_close(out.row_lse.cpu(), lse, rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("device,backend", HUGE_BACKENDS)
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.999)])
def test_huge_scaled_logits_near_ties_match_float64(device, backend, top_k, top_p):
    for cond, uncond, cfg_scale in _near_tie_rows():
        n, v = cond.shape
        kw = dict(cfg_scale=cfg_scale, temperature=HUGE_TEMPERATURE, top_k=top_k, top_p=top_p)
        # The float32 guided logits are the same bits on every backend (no FMA, IEEE division): the
        # float64 softmax of those over the kept set (decided exactly, as the reference does) is
        # the truth.
        l = ref.guided_logits(cond, uncond, cfg_scale, HUGE_TEMPERATURE).double()
        assert (l.amax(1) >= 9e4).all()
        kept = ref.sampling_probs(cond, uncond_logits=uncond, **kw) > 0
        assert (kept.sum(1) >= min(top_k or 6, 3)).all(), "the near ties should be kept"
        lk = torch.where(kept, l, torch.full_like(l, -math.inf))
        want = torch.softmax(lk, 1)
        dev = lambda t: None if t is None else t.to(device)  # noqa: E731
        p = ops.sampling_probs(dev(cond), uncond_logits=dev(uncond), backend=backend, **kw).cpu()
        assert (p[~kept] == 0).all()  # (a kept token may underflow to 0, as in float32 it should)
        torch.testing.assert_close(p.double(), want, rtol=2e-6, atol=1e-12)
        torch.testing.assert_close(p.sum(1).double(), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-6)
        tokens = torch.stack([lk[r].argsort(descending=True)[r % 3] for r in range(n)])  # near-tied ones
        out = ops.pool_probs(dev(cond), dev(tokens), dev(_all_other_tokens(v)), uncond_logits=dev(uncond),
                             backend=backend, **kw)
        torch.testing.assert_close(out.p_token.cpu().double(), want.gather(1, tokens[:, None])[:, 0],
                                   rtol=2e-6, atol=1e-12)
        torch.testing.assert_close(out.pooled.cpu().double(), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(out.row_lse.cpu().double(), torch.logsumexp(lk, 1), rtol=2.5e-7, atol=0)
