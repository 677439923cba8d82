"""Kernel 2, verify_grid: every backend against the reference, the reference against a plain
loop-and-BFS oracle, island worst cases, edge-case policies and argument errors.

Every output is discrete (masks, indices, labels), so agreement is bit for bit.
"""
from collections import deque

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import device_backend_pairs
from specdec import ops
from specdec.reference import verification as ref

PAIRS = device_backend_pairs()
ALL_PAIRS = [pytest.param("cpu", "reference", id="cpu-reference")] + PAIRS


# ---------------------------------------------------------------------------------------------
# Independent oracle: per-position loops written straight from docs/design.md, BFS for the islands.
# ---------------------------------------------------------------------------------------------

def bfs_islands(mask):
    """8-connected components of a 2-D bool mask by flood fill; label = smallest raster index."""
    h, w = mask.shape
    m = mask.tolist()
    labels = [[-1] * w for _ in range(h)]
    for i0 in range(h):
        for j0 in range(w):
            if not m[i0][j0] or labels[i0][j0] >= 0:
                continue
            # Raster order visits a component first at its smallest index.
            lab = i0 * w + j0
            labels[i0][j0] = lab
            todo = deque([(i0, j0)])
            while todo:
                i, j = todo.popleft()
                for di in (-1, 0, 1):
                    for dj in (-1, 0, 1):
                        a, b = i + di, j + dj
                        if 0 <= a < h and 0 <= b < w and m[a][b] and labels[a][b] < 0:
                            labels[a][b] = lab
                            todo.append((a, b))
    return torch.tensor(labels, dtype=torch.int32).view(h, w)


def oracle_verdict(p, q, rule, tau, uniforms, mode, radius, valid):
    b, h, w = p.shape
    accept = torch.zeros(b, h, w, dtype=torch.bool)
    resample = torch.zeros(b, h, w, dtype=torch.bool)
    first = torch.zeros(b, dtype=torch.int32)
    islands = torch.zeros(b, h, w, dtype=torch.int32)
    count = torch.zeros(b, dtype=torch.int32)
    for g in range(b):
        rej = set()
        for i in range(h):
            for j in range(w):
                if not valid[g, i, j]:
                    continue
                if rule == "threshold":
                    bad = not bool(p[g, i, j] >= torch.tensor(tau, dtype=torch.float32))
                else:
                    bad = not bool(uniforms[g, i, j] * q[g, i, j] < p[g, i, j])
                if bad:
                    rej.add((i, j))
        f = min((i * w + j for i, j in rej), default=h * w)
        first[g] = f
        for i in range(h):
            for j in range(w):
                if not valid[g, i, j]:
                    continue
                u = i * w + j
                if mode == "raster":
                    rs = u >= f
                elif mode == "independent":
                    rs = (i, j) in rej
                else:
                    rs = u >= f and any(max(abs(i - a), abs(j - c)) <= radius for a, c in rej)
                resample[g, i, j] = rs
                accept[g, i, j] = not rs
        islands[g] = bfs_islands(resample[g])
        count[g] = len({int(x) for x in islands[g].flatten() if x >= 0})
    return accept, resample, first, islands, count


# ---------------------------------------------------------------------------------------------

def make_case(seed, b, h, w, rule, reject_rate, with_valid, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(b, h, w, generator=g)
    q = torch.rand(b, h, w, generator=g)
    u = torch.rand(b, h, w, generator=g)
    if rule == "threshold":
        p = torch.where(torch.rand(b, h, w, generator=g) < reject_rate, p * 0.5, 0.5 + p * 0.5)
    else:
        # Raise q where we want rejections likely (u * q >= p), lower it elsewhere.
        hot = torch.rand(b, h, w, generator=g) < reject_rate
        q = torch.where(hot, torch.ones_like(q), q * p)
        # Sprinkle exact zeros: q = 0 < p must accept, p = 0 must reject.
        zeros = torch.rand(b, h, w, generator=g)
        q = torch.where(zeros < 0.05, torch.zeros_like(q), q)
        p = torch.where(zeros > 0.97, torch.zeros_like(p), p)
    valid = (torch.rand(b, h, w, generator=g) > 0.1) if with_valid else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(p), move(q), move(u), move(valid)


def call(p, q, u, valid, rule, mode, radius, backend, tau=0.5):
    kw = dict(rule=rule, mode=mode, radius=radius, valid=valid, backend=backend)
    if rule == "threshold":
        return ops.verify_grid(p, tau=tau, **kw)
    return ops.verify_grid(p, q, uniforms=u, **kw)


def assert_verdict_equal(got, want):
    for name, a, b in zip(want._fields, got, want):
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs:\n{a}\nvs\n{b}"


@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    rule=st.sampled_from(["threshold", "ratio"]),
    mode=st.sampled_from(["raster", "independent", "local"]),
    radius=st.integers(0, 3),
    reject_rate=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    with_valid=st.booleans(),
)
def test_reference_matches_loop_oracle(seed, b, h, w, rule, mode, radius, reject_rate, with_valid):
    p, q, u, valid = make_case(seed, b, h, w, rule, reject_rate, with_valid)
    got = call(p, q, u, valid, rule, mode, radius, "reference")
    full_valid = valid if valid is not None else torch.ones(b, h, w, dtype=torch.bool)
    want = oracle_verdict(p, q, rule, 0.5, u, mode, radius, full_valid)
    assert_verdict_equal(got, got._make(want))


@pytest.mark.parametrize("device,backend", PAIRS)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    h=st.integers(1, 40),
    w=st.integers(1, 40),
    rule=st.sampled_from(["threshold", "ratio"]),
    mode=st.sampled_from(["raster", "independent", "local"]),
    radius=st.sampled_from([0, 1, 2, 5, 100]),
    reject_rate=st.sampled_from([0.0, 0.02, 0.05, 0.3, 0.7, 1.0]),
    with_valid=st.booleans(),
)
@settings(max_examples=40)  # the Triton interpreter pays per program and op
def test_backend_matches_reference(device, backend, seed, b, h, w, rule, mode, radius, reject_rate,
                                   with_valid):
    p, q, u, valid = make_case(seed, b, h, w, rule, reject_rate, with_valid, device)
    got = call(p, q, u, valid, rule, mode, radius, backend)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    want = call(cpu(p), cpu(q), cpu(u), cpu(valid), rule, mode, radius, "reference")
    assert_verdict_equal(got, want)


@pytest.mark.parametrize("device,backend", PAIRS)
@pytest.mark.parametrize("shape", [(2, 128, 128), (16, 64, 64), (1, 1, 128), (1, 128, 1)])
def test_backend_matches_reference_large(device, backend, shape):
    for rule, mode, rate in (("threshold", "local", 0.05), ("ratio", "independent", 0.3)):
        p, q, u, _ = make_case(7, *shape, rule, rate, False, device)
        got = call(p, q, u, None, rule, mode, 2, backend)
        want = call(p.cpu(), q.cpu(), u.cpu(), None, rule, mode, 2, "reference")
        assert_verdict_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Island worst cases: resample exactly a given mask (mode="independent", threshold rule).
# ---------------------------------------------------------------------------------------------

def serpentine(n):
    m = torch.zeros(n, n, dtype=torch.bool)
    m[::2] = True  # full rows joined at alternating ends: one path of about n * n / 2 pixels
    for i in range(1, n, 2):
        m[i, n - 1 if (i // 2) % 2 == 0 else 0] = True
    return m


def spiral(n):
    """A square spiral, one pixel wide with one-pixel gaps, walked inwards from the corner."""
    m = torch.zeros(n, n, dtype=torch.bool)
    i, j, di, dj = 0, 0, 0, 1
    m[0, 0] = True
    while True:
        moved = False
        for _ in range(4):
            a, b = i + 2 * di, j + 2 * dj
            if 0 <= a < n and 0 <= b < n and not m[a, b]:
                m[i + di, j + dj] = True
                m[a, b] = True
                i, j = a, b
                moved = True
                break
            di, dj = dj, -di  # turn clockwise
        if not moved:
            return m


SHAPES = {
    "serpentine64": lambda: serpentine(64),
    "spiral64": lambda: spiral(64),
    "spiral_odd": lambda: spiral(37),
    "full128": lambda: torch.ones(128, 128, dtype=torch.bool),
    "checkerboard": lambda: (torch.arange(48)[:, None] + torch.arange(48)) % 2 == 0,
    "single_pixels": lambda: (torch.arange(30)[:, None] % 2 == 0) & (torch.arange(31) % 2 == 0),
    "diagonals": lambda: (torch.arange(40)[:, None] - torch.arange(40)) % 3 == 0,
    "anti_diagonal": lambda: torch.eye(50, dtype=torch.bool).flip(1),
    "empty": lambda: torch.zeros(9, 13, dtype=torch.bool),
}


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_islands_worst_cases(device, backend, name):
    mask = SHAPES[name]()
    p = torch.where(mask, 0.0, 1.0)[None].to(device)  # rejected exactly where mask is set
    got = ops.verify_grid(p, tau=0.5, mode="independent", backend=backend)
    want = bfs_islands(mask)
    assert torch.equal(got.resample[0].cpu(), mask)
    assert torch.equal(got.islands[0].cpu(), want)
    assert int(got.num_islands[0]) == len(set(want[want >= 0].tolist()))


def test_serpentine_is_one_island_in_few_rounds():
    mask = serpentine(64)
    labels, rounds = ref.label_islands(mask[None], return_rounds=True)
    assert set(labels[labels >= 0].tolist()) == {0}
    # Hooking + pointer jumping: a handful of rounds, not one per pixel of the 2000-pixel path.
    assert rounds <= 12
    for name in ("spiral64", "checkerboard", "full128"):
        _, rounds = ref.label_islands(SHAPES[name]()[None], return_rounds=True)
        assert rounds <= 12, name


def test_checkerboard_is_one_component():
    mask = SHAPES["checkerboard"]()
    got = ops.verify_grid(torch.where(mask, 0.0, 1.0)[None], tau=0.5, mode="independent", backend="reference")
    assert int(got.num_islands[0]) == 1


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_ratio_zero_probabilities(device, backend):
    # q = 0 < p accepts whatever u is; p = 0 rejects whatever q and u are.
    p = torch.tensor([[[0.3, 0.3, 0.0, 0.0, 1e-30]]], device=device)
    q = torch.tensor([[[0.0, 0.0, 0.0, 0.5, 0.0]]], device=device)
    u = torch.tensor([[[0.0, 0.999999, 0.0, 0.0, 0.9999]]], device=device)
    got = ops.verify_grid(p, q, rule="ratio", uniforms=u, mode="independent", backend=backend)
    assert got.accept[0, 0].cpu().tolist() == [True, True, False, False, True]
    assert int(got.first_reject[0]) == 2


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_no_rejection_and_invalid_positions(device, backend):
    p = torch.ones(2, 3, 4, device=device)
    valid = torch.ones(2, 3, 4, dtype=torch.bool, device=device)
    valid[1, 1:] = False
    p[1, 2, 3] = 0.0  # rejected score at an invalid position: ignored
    got = ops.verify_grid(p, tau=0.5, valid=valid, backend=backend)
    assert got.first_reject.cpu().tolist() == [12, 12]
    assert not got.resample.any()
    assert torch.equal(got.accept.cpu(), valid.cpu())
    assert (got.islands == -1).all() and got.num_islands.cpu().tolist() == [0, 0]


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_local_window_is_clipped_to_first_reject_and_valid(device, backend):
    p = torch.ones(1, 5, 5, device=device)
    p[0, 2, 2] = 0.0
    valid = torch.ones(1, 5, 5, dtype=torch.bool, device=device)
    valid[0, 3, 3] = False
    got = ops.verify_grid(p, tau=0.5, mode="local", radius=1, valid=valid, backend=backend)
    want = torch.zeros(5, 5, dtype=torch.bool)
    want[2, 2:4] = True  # (2, 1) precedes the first rejection (2, 2) in raster order
    want[3, 1:3] = True  # (3, 3) is not valid
    assert torch.equal(got.resample[0].cpu(), want)
    assert int(got.num_islands[0]) == 1 and int(got.islands[0, 2, 2]) == 12


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_generator_same_seed_same_result(device, backend):
    g = torch.Generator().manual_seed(3)
    p = torch.rand(2, 6, 7, generator=g).to(device)
    q = torch.rand(2, 6, 7, generator=g).to(device)
    runs = []
    for _ in range(2):
        gen = torch.Generator(device=device).manual_seed(1234)
        runs.append(ops.verify_grid(p, q, rule="ratio", generator=gen, backend=backend))
    assert_verdict_equal(runs[0], runs[1]._make(t.cpu() for t in runs[1]))
    # The generator's uniforms are drawn by the API, so every backend on one device agrees.
    gen = torch.Generator(device=device).manual_seed(1234)
    want = ops.verify_grid(p, q, rule="ratio", generator=gen, backend="reference")
    assert_verdict_equal(runs[0], want._make(t.cpu() for t in want))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _bad_calls():
    p = torch.rand(2, 3, 4)
    q = torch.rand(2, 3, 4)
    u = torch.rand(2, 3, 4)
    return [
        ("p", lambda: ops.verify_grid(torch.rand(3, 4), tau=0.5)),
        ("q", lambda: ops.verify_grid(p, torch.rand(2, 3, 5), rule="ratio")),
        ("q", lambda: ops.verify_grid(p, rule="ratio")),
        ("tau", lambda: ops.verify_grid(p, rule="threshold")),
        ("tau", lambda: ops.verify_grid(p, tau=float("nan"))),
        ("tau", lambda: ops.verify_grid(p, q, rule="ratio", tau=0.5)),
        ("uniforms", lambda: ops.verify_grid(p, q, rule="ratio", uniforms=torch.ones(2, 3, 4))),
        ("uniforms", lambda: ops.verify_grid(p, q, rule="ratio", uniforms=-u)),
        ("uniforms", lambda: ops.verify_grid(p, q, rule="ratio", uniforms=torch.full((2, 3, 4), float("nan")))),
        ("uniforms", lambda: ops.verify_grid(p, q, rule="ratio", uniforms=u[:1])),
        ("uniforms", lambda: ops.verify_grid(p, q, rule="ratio", uniforms=u.double())),
        ("generator", lambda: ops.verify_grid(p, q, rule="ratio", uniforms=u, generator=torch.Generator())),
        ("radius", lambda: ops.verify_grid(p, tau=0.5, radius=-1)),
        ("radius", lambda: ops.verify_grid(p, tau=0.5, radius=1.5)),
        ("rule", lambda: ops.verify_grid(p, tau=0.5, rule="min")),
        ("mode", lambda: ops.verify_grid(p, tau=0.5, mode="global")),
        ("valid", lambda: ops.verify_grid(p, tau=0.5, valid=torch.ones(2, 3, 4))),
        ("valid", lambda: ops.verify_grid(p, tau=0.5, valid=torch.ones(2, 4, 3, dtype=torch.bool))),
        ("p", lambda: ops.verify_grid(torch.full((2, 3, 4), float("nan")), tau=0.5)),
        ("q", lambda: ops.verify_grid(p, torch.full((2, 3, 4), float("nan")), rule="ratio")),
        ("p", lambda: ops.verify_grid(torch.rand(2, 0, 4), tau=0.5)),
        ("radius", lambda: ops.verify_grid(p, tau=0.5, mode="local", radius=2 ** 63)),   # (past an int64)
    ]


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("rule", ["threshold", "ratio"])
@pytest.mark.parametrize("mode", ["raster", "local", "independent"])
def test_a_batch_of_no_grids_gives_empty_verdicts(device, backend, rule, mode):
    """(The reference failed on it: reshape(0, -1) cannot infer a size.)"""
    p = torch.rand(0, 3, 4, device=device)
    q = torch.rand(0, 3, 4, device=device) if rule == "ratio" else None
    v = ops.verify_grid(p, q, rule=rule, tau=0.5 if rule == "threshold" else None, mode=mode, backend=backend)
    assert [tuple(t.shape) for t in v] == [(0, 3, 4), (0, 3, 4), (0,), (0, 3, 4), (0,)]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_raise_naming_them(case):
    name, fn = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        fn()


@pytest.mark.skipif(not any(b == "cpu" for _, b in [p.values for p in PAIRS]), reason="no C++ extension")
def test_compiled_op_checks_arguments_and_passes_opcheck():
    p = torch.rand(2, 5, 6)
    q = torch.rand(2, 5, 6)
    u = torch.rand(2, 5, 6)
    valid = torch.rand(2, 5, 6) > 0.2
    op = torch.ops.specdec.verify_grid
    for args in ((p, q, u, valid, "ratio", 0.0, "local", 1), (p, None, None, None, "threshold", 0.4, "raster", 0),
                 (p, None, None, valid, "threshold", 0.4, "independent", 3)):
        torch.library.opcheck(op, args)
    with pytest.raises(ValueError, match="mode"):
        op(p, None, None, None, "threshold", 0.5, "nope", 1)
    with pytest.raises(ValueError, match="radius"):
        op(p, None, None, None, "threshold", 0.5, "local", -2)
    with pytest.raises(ValueError, match="uniforms"):
        op(p, q, None, None, "ratio", 0.0, "local", 1)
    with pytest.raises(ValueError, match="valid"):
        op(p, None, None, valid.float(), "threshold", 0.5, "local", 1)
