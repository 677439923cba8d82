"""Kernel 2, sample_residual: every backend against the reference bit for bit, the reference
against the inverse-CDF definition in exact integer arithmetic, edge cases and errors.
(The distribution of the generator path is tested in test_distribution.py.)
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import device_backend_pairs
from specdec import ops

PAIRS = device_backend_pairs()
ALL_PAIRS = [pytest.param("cpu", "reference", id="cpu-reference")] + PAIRS
UNIT = 2 ** 30
HAS_CPU_OP = any(b == "cpu" for _, b in [p.values for p in PAIRS])


def random_rows(seed, m, v, sparsity, device="cpu", fallback_rows=True):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(m, v, generator=g) * (torch.rand(m, v, generator=g) >= sparsity)
    p[:, int(torch.randint(0, v, (1,), generator=g))] += 0.01  # every row has mass
    p = p / p.sum(1, keepdim=True)
    q = torch.rand(m, v, generator=g) ** 3
    q = q / q.sum(1, keepdim=True)
    if fallback_rows and m > 1:
        q[0] = p[0]  # residual exactly zero: fallback
        q[-1] = torch.maximum(p[-1], q[-1])  # q >= p everywhere: fallback too
    u = torch.rand(m, generator=g)
    u[0] = 0.0
    if m > 2:
        u[1] = 1.0 - 2 ** -24  # the largest float32 below 1
    return p.to(device), q.to(device), u.to(device)


def exact_units(x):
    """trunc(clamp(x, 0, 1) * 2**30) with Python integers."""
    return [int(min(max(float(t), 0.0), 1.0) * UNIT) for t in x]


@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 5), v=st.sampled_from([1, 2, 7, 33, 500]),
       sparsity=st.sampled_from([0.0, 0.5, 0.95]), with_q=st.booleans())
def test_reference_is_inverse_cdf_of_the_residual(seed, m, v, sparsity, with_q):
    p, q, u = random_rows(seed, m, v, sparsity)
    got = ops.sample_residual(p, q if with_q else None, uniforms=u, backend="reference")
    for r in range(m):
        units = exact_units(p[r] - q[r]) if with_q else exact_units(p[r])
        fb = with_q and sum(units) == 0
        if fb:
            units = exact_units(p[r])
        total = sum(units)
        # float(u) * total rounded to float64, as the contract says, then floored.
        threshold = int(float(u[r]) * float(total))
        cum, token = 0, None
        for i, x in enumerate(units):
            cum += x
            if cum > threshold:
                token = i
                break
        assert int(got.tokens[r]) == token
        assert bool(got.fallback[r]) == fb
        assert units[token] > 0  # never a token without (residual) mass


@pytest.mark.parametrize("device,backend", PAIRS)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 6),
       v=st.sampled_from([1, 3, 64, 100, 1000, 2049, 5000]), sparsity=st.sampled_from([0.0, 0.5, 0.99]),
       with_q=st.booleans())
@settings(max_examples=40)  # the Triton interpreter pays per program and op
def test_backend_matches_reference(device, backend, seed, m, v, sparsity, with_q):
    p, q, u = random_rows(seed, m, v, sparsity, device)
    q = q if with_q else None
    got = ops.sample_residual(p, q, uniforms=u, backend=backend)
    want = ops.sample_residual(p.cpu(), None if q is None else q.cpu(), uniforms=u.cpu(), backend="reference")
    assert got.tokens.dtype == torch.int32 and got.fallback.dtype == torch.bool
    assert torch.equal(got.tokens.cpu(), want.tokens)
    assert torch.equal(got.fallback.cpu(), want.fallback)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_last_tile_and_extreme_uniforms_stay_in_range(device, backend):
    # Mass only on the very last entry of rows whose length is not a power of two: any uniform
    # must give V - 1, never V (the out-of-range id of a last partial tile).
    for v in (1, 3, 1025, 2049, 4097):
        p = torch.zeros(3, v)
        p[:, -1] = 1.0
        u = torch.tensor([0.0, 0.5, 1.0 - 2 ** -24])
        got = ops.sample_residual(p.to(device), uniforms=u.to(device), backend=backend)
        assert got.tokens.cpu().tolist() == [v - 1] * 3


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_zero_residual_falls_back_to_p(device, backend):
    p = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.6, 0.6], [0.5, 0.0, 0.5]])
    u = torch.tensor([0.95, 0.2, 0.3])
    got = ops.sample_residual(p.to(device), q.to(device), uniforms=u.to(device), backend=backend)
    assert got.fallback.cpu().tolist() == [True, True, False]
    assert got.tokens.cpu().tolist() == [2, 0, 1]  # rows 0-1 drawn from p, row 2 from the residual
    no_q = ops.sample_residual(p.to(device), uniforms=u.to(device), backend=backend)
    assert not no_q.fallback.any()


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_empty_batch(device, backend):
    got = ops.sample_residual(torch.zeros(0, 5, device=device), torch.zeros(0, 5, device=device), backend=backend)
    assert got.tokens.shape == (0,) and got.fallback.shape == (0,)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_generator_same_seed_same_tokens(device, backend):
    # The kernels draw in-kernel Philox keyed by a seed taken from the generator; the reference
    # draws torch.rand from it. Either way: same seed, same tokens; another seed, other tokens.
    m, v = 16, 300
    p, q, _ = random_rows(5, m, v, 0.3, device)

    def run(seed):
        return ops.sample_residual(p, q, generator=torch.Generator(device=device).manual_seed(seed),
                                   backend=backend)

    a, b, c = run(9), run(9), run(10)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.fallback, b.fallback)
    assert not torch.equal(a.tokens, c.tokens)
    # Fallback flags do not depend on the randomness: those of the reference, for any uniforms.
    want_fallback = ops.sample_residual(p.cpu(), q.cpu(), uniforms=torch.zeros(m), backend="reference").fallback
    assert want_fallback[0] and want_fallback[-1]
    mass = torch.where(want_fallback[:, None], p.cpu(), (p - q).clamp(min=0).cpu())
    for out in (a, c):
        assert out.tokens.dtype == torch.int32 and out.fallback.dtype == torch.bool
        tokens = out.tokens.long().cpu()
        assert bool(((tokens >= 0) & (tokens < v)).all())
        assert torch.equal(out.fallback.cpu(), want_fallback)
        assert bool((mass.gather(1, tokens[:, None]) > 0).all())  # never a token without mass
    # The default generator (generator=None) follows torch.manual_seed the same way.
    torch.manual_seed(3)
    d = ops.sample_residual(p, q, backend=backend)
    torch.manual_seed(3)
    assert torch.equal(d.tokens, ops.sample_residual(p, q, backend=backend).tokens)


def _in_kernel_philox(backend, p, q, seed, offset):
    """A kernel's own sampling path (uniforms=None) with an explicit Philox key and offset."""
    if backend == "triton":
        from specdec.triton_kernels import verification
        return verification.sample_residual(p, q, None, seed, offset)
    return torch.ops.specdec.sample_residual(p, q, None, seed, offset)


@pytest.mark.skipif(not HAS_CPU_OP, reason="no C++ extension")
@pytest.mark.parametrize("device,backend", PAIRS)
def test_in_kernel_philox_is_one_stream_on_every_kernel_backend(device, backend):
    # Row r's uniform is the first output of Philox4x32-10 with key seed and counter
    # (offset, r) on the C++ CPU, CUDA and Triton kernels alike: same key, same tokens.
    p, q, _ = random_rows(6, 24, 500, 0.3)
    for seed, offset in ((0, 0), (12345, 0), (2 ** 62 + 7, 3), (-5, 2 ** 33)):
        want = torch.ops.specdec.sample_residual(p, q, None, seed, offset)
        got = _in_kernel_philox(backend, p.to(device), q.to(device), seed, offset)
        assert torch.equal(got[0].cpu(), want[0]), (seed, offset)
        assert torch.equal(got[1].cpu(), want[1])
    one = _in_kernel_philox(backend, p.to(device), q.to(device), 1, 0)[0]
    assert not torch.equal(one, _in_kernel_philox(backend, p.to(device), q.to(device), 2, 0)[0])
    assert not torch.equal(one, _in_kernel_philox(backend, p.to(device), q.to(device), 1, 1)[0])


def _bad_calls():
    p = torch.softmax(torch.randn(3, 10), 1)
    q = torch.softmax(torch.randn(3, 10), 1)
    return [
        ("p", lambda: ops.sample_residual(p[0])),
        ("p", lambda: ops.sample_residual(torch.where(p > 0.1, float("nan"), p))),
        ("p", lambda: ops.sample_residual(p * 20)),
        ("p", lambda: ops.sample_residual(-p)),
        ("p", lambda: ops.sample_residual(torch.zeros(3, 10))),
        ("p", lambda: ops.sample_residual(torch.zeros(3, 0))),
        ("q", lambda: ops.sample_residual(p, q[:, :5])),
        ("q", lambda: ops.sample_residual(p, q + float("nan"))),
        ("q", lambda: ops.sample_residual(p, q - 1)),
        ("uniforms", lambda: ops.sample_residual(p, q, uniforms=torch.ones(3))),
        ("uniforms", lambda: ops.sample_residual(p, q, uniforms=torch.full((3,), -0.5))),
        ("uniforms", lambda: ops.sample_residual(p, q, uniforms=torch.rand(4))),
        ("generator", lambda: ops.sample_residual(p, q, uniforms=torch.rand(3), generator=torch.Generator())),
        ("generator", lambda: ops.sample_residual(p, q, generator="seed")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_raise_naming_them(case):
    name, fn = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        fn()


@pytest.mark.skipif(not HAS_CPU_OP, reason="no C++ extension")
def test_compiled_op_checks_arguments_and_passes_opcheck():
    p, q, u = random_rows(1, 4, 37, 0.2)
    op = torch.ops.specdec.sample_residual
    torch.library.opcheck(op, (p, q, u, 0, 0))
    torch.library.opcheck(op, (p, None, u, 0, 0))
    torch.library.opcheck(op, (p, q, None, 123, 4))  # in-kernel Philox
    with pytest.raises(ValueError, match="uniforms"):
        op(p, q, u[:2], 0, 0)
    with pytest.raises(ValueError, match="q"):
        op(p, q.double(), u, 0, 0)
    with pytest.raises(ValueError, match="offset"):
        op(p, q, None, 1, -1)
