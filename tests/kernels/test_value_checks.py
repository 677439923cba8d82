"""The value checks of sample_residual ride in its kernel: each backend's kernel writes one code
per row (specdec.reference.verification.sample_residual_row_errors defines them) in the pass it
makes over the rows anyway, and the public op reads one flag from those codes; only when it is
set does the op look again, to raise the message that names what is wrong, the same on every
backend. verify_grid does the same with one code per grid."""
import pytest
import torch

from specdec import ops
from specdec.ops import dispatch
from specdec.ops.verification import _sample_residual, _verify_grid
from specdec.profiling import count_host_syncs
from specdec.reference import verification as ref

CPU = torch.device("cpu")
BACKENDS = dispatch.available_backends(CPU)


def _rows(seed: int, m: int = 12, v: int = 37):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(m, v, generator=g), 1)
    q = torch.softmax(torch.randn(m, v, generator=g), 1)
    u = torch.rand(m, generator=g)
    return p, q, u


def _spoiled(seed: int):
    """Rows with one fault each (and clean rows between): NaN, out of range, no mass, bad uniform."""
    p, q, u = _rows(seed)
    p[1, 3] = float("nan")
    p[3, 0] = 1.5
    p[4, 7] = -1e-3
    p[5] = 2.0 ** -31                      # every entry below 2**-30: no mass
    q[6, 2] = float("nan")
    q[7, 5] = -0.5
    u[8], u[9], u[10] = 1.0, -0.25, float("nan")
    p[11, 36] = float("inf")
    return p, q, u


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_q", [True, False])
def test_every_kernel_writes_the_reference_row_codes(backend, with_q):
    p, q, u = _spoiled(0)
    q = q if with_q else None
    codes = torch.full((p.shape[0],), -1, dtype=torch.int32)
    _sample_residual(backend, p, q, u, 0, codes)
    want = ref.sample_residual_row_errors(p, q, u)
    assert torch.equal(codes, want), (codes.tolist(), want.tolist())
    assert int(want[0]) == 0 and int(want[2]) == 0          # clean rows stay clean
    clean = torch.full_like(codes, -1)
    _sample_residual(backend, *(t for t in _rows(1)[:1]), None, _rows(1)[2], 0, clean)
    assert not bool(clean.any())


def _messages(backend):
    """The message of each bad call on `backend`."""
    p, q, u = _rows(2, m=3, v=10)
    calls = [
        lambda: ops.sample_residual(torch.where(p > 0.1, float("nan"), p), backend=backend),
        lambda: ops.sample_residual(p * 20, backend=backend),
        lambda: ops.sample_residual(-p, uniforms=u, backend=backend),
        lambda: ops.sample_residual(torch.zeros(3, 10), backend=backend),
        lambda: ops.sample_residual(p, q + float("nan"), uniforms=u, backend=backend),
        lambda: ops.sample_residual(p, q - 1, backend=backend),
        lambda: ops.sample_residual(p, q, uniforms=torch.ones(3), backend=backend),
        lambda: ops.sample_residual(p, q, uniforms=torch.full((3,), -0.5), backend=backend),
    ]
    return _raised(calls)


def _raised(calls):
    """The ValueError message of each call."""
    out = []
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        out.append(str(e.value))
    return out


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_bad_values_raise_the_same_message_on_every_backend(backend):
    got = _messages(backend)
    assert got == _messages("reference")
    assert [m.split(" ")[0].rstrip(":") for m in got] == ["p", "p", "p", "p", "q", "q", "uniforms", "uniforms"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_public_op_reads_back_once(backend):
    p, q, u = _rows(3)
    with count_host_syncs() as c:
        out = ops.sample_residual(p, q, uniforms=u, backend=backend)
    assert c.round_trips == 1, c.by_op
    assert torch.equal(out.tokens, ref.sample_residual(p, q, u).tokens)


def _grids(seed: int, b: int = 5, h: int = 3, w: int = 7):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, h, w, generator=g), torch.rand(b, h, w, generator=g), torch.rand(b, h, w, generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["ratio", "threshold"])
def test_every_verify_kernel_writes_the_reference_grid_codes(backend, rule):
    p, q, u = _grids(4)
    p[1, 0, 3] = float("nan")
    q[2, 2, 6] = float("nan")
    u[3, 1, 1] = 1.0
    u[4, 0, 0] = float("nan")
    if rule == "threshold":
        q = u = None
    codes = torch.full((p.shape[0],), -1, dtype=torch.int32)
    _verify_grid(backend, p, q, rule, 0.5 if rule == "threshold" else 0.0, u, "local", 1, None, codes)
    want = ref.verify_grid_errors(p, q, u)
    assert torch.equal(codes, want), (codes.tolist(), want.tolist())
    assert int(want[0]) == 0 and int(want[1]) == ref.NAN_P


def _verify_messages(backend):
    p, q, u = _grids(5, b=2)
    nan = torch.full_like(p, float("nan"))
    calls = [
        lambda: ops.verify_grid(nan, tau=0.5, backend=backend),
        lambda: ops.verify_grid(nan, q, rule="ratio", uniforms=u, backend=backend),
        lambda: ops.verify_grid(p, nan, rule="ratio", backend=backend),
        lambda: ops.verify_grid(p, q, rule="ratio", uniforms=-u, backend=backend),
        lambda: ops.verify_grid(p, q, rule="ratio", uniforms=nan, backend=backend),
    ]
    return _raised(calls)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_bad_grid_values_raise_the_same_message_on_every_backend(backend):
    got = _verify_messages(backend)
    assert got == _verify_messages("reference")
    assert [m.split(" ")[0] for m in got] == ["p", "p", "q", "uniforms", "uniforms"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_public_verify_reads_back_once(backend):
    p, q, u = _grids(6, h=1)   # one-row grids: the reference labels them without a read too
    with count_host_syncs() as c:
        out = ops.verify_grid(p, q, rule="ratio", uniforms=u, mode="raster", backend=backend)
    assert c.round_trips == 1, c.by_op
    assert torch.equal(out.accept, ref.verify_grid(p, q, rule="ratio", uniforms=u, mode="raster").accept)


def test_scalars_traced_as_symbols_by_torch_compile_are_checked_without_a_break():
    """math.isfinite cannot take a symbolic float: a scale that changed between calls (or any
    scalar under dynamic=True) broke torch.compile(fullgraph=True)."""
    logits = torch.randn(3, 10)
    torch._dynamo.reset()
    probs = torch.compile(lambda x, t: ops.sampling_probs(x, temperature=t, backend="reference"),
                          fullgraph=True, dynamic=True, backend="eager")
    for t in (0.7, 1.3):
        torch.testing.assert_close(probs(logits, t), ops.sampling_probs(logits, temperature=t, backend="reference"))
