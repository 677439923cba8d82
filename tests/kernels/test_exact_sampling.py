"""The position-keyed exact sampler (race_sample, race_noise; docs/kernels/exact_sampling.md):

- the noise E bit for bit on every backend against the reference, on fresh random keys (large
  seeds, images, positions, purposes included), and the reference's -ln(u) against float64 on
  every one of its 2**23 inputs;
- the tokens bit for bit on every backend on fresh random rows (zeros, one-hot rows, exact ties of
  the keys, tiny and subnormal probabilities, V not a multiple of any block, V = 1, V = 16384);
- the hash's uniforms: their range and a histogram; the token distribution against p
  (chi-square, >= 1e5 draws, one position per draw) on every backend this machine runs;
- what the noise depends on (seed, image, position, purpose) and what it does not (the row, the
  batch, the other rows, p's scale);
- the argument and value errors, empty batches, the fake implementations (opcheck).
(CUDA tensors: every test parametrised by device_backend_pairs runs on them where there is a GPU;
test_exact_sampling_gpu.py holds the checks at GPU scale and of the lowered Triton code.)
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import device_backend_pairs
from specdec import ops
from specdec.ops import exact_sampling as xs
from specdec.profiling import count_host_syncs
from specdec.reference import exact_sampling as ref
from test_distribution import ALPHA, SAMPLES, chi_square_p_value

PAIRS = device_backend_pairs()
ALL_PAIRS = [pytest.param("cpu", "reference", id="cpu-reference")] + PAIRS
HAS_CPU_OP = any(b == "cpu" for _, b in [p.values for p in PAIRS])
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)
SEEDS = st.one_of(st.integers(0, 10), st.integers(-2 ** 63, 2 ** 64 - 1), st.just(2 ** 64 - 1))


def random_keys(seed, m):
    """Rows of (image, position, purpose): huge, negative and small values mixed."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(-2 ** 63, 2 ** 63 - 1, (m,), generator=g)
    positions = torch.randint(0, 2 ** 62, (m,), generator=g) >> torch.randint(0, 62, (m,), generator=g)
    purposes = torch.randint(-3, 3, (m,), generator=g)
    return images, positions, purposes


def random_rows(seed, m, v):
    """Probability rows with the edge cases of the contract in fixed rows."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(m, v, generator=g) * 3, 1)
    p = p * (torch.rand(m, v, generator=g) > 0.3)            # zeros
    kinds = torch.randint(0, 6, (m,), generator=g)
    p[kinds == 0] = 0.0                                      # all zero: the uniform fallback
    one_hot = torch.zeros(v)
    one_hot[int(torch.randint(0, v, (1,), generator=g))] = 1.0
    p[kinds == 1] = one_hot                                  # one-hot
    p[kinds == 2] = 1.0 / v                                  # equal probabilities
    tiny = torch.tensor([1e-30, 2.0 ** -126, 1e-40, 0.0])    # tiny, the smallest normal, subnormal
    p[kinds == 3] = tiny[torch.randint(0, 4, (v,), generator=g)]
    return p


def tokens(p, seed, keys, backend, device):
    images, positions, purposes = (t.to(device) for t in keys)
    return ops.race_sample(p.to(device), seed, images, positions, purposes, backend=backend).cpu()


# ---- bit-exact -------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", PAIRS)
@given(seed=SEEDS, key_seed=st.integers(0, 2 ** 31 - 1), m=st.integers(1, 7),
       v=st.sampled_from([1, 3, 100, 1000, 1025, 4099]), scalar_purpose=st.booleans())
@settings(max_examples=30)  # the Triton interpreter pays per program and op
def test_noise_is_the_reference_bit_for_bit(device, backend, seed, key_seed, m, v, scalar_purpose):
    images, positions, purposes = random_keys(key_seed, m)
    purpose = int(purposes[0]) if scalar_purpose else purposes
    want = ops.race_noise(seed, images, positions, purpose, v, backend="reference")
    dev = (t.to(device) for t in (images, positions))
    got = ops.race_noise(seed, *dev, purpose if scalar_purpose else purposes.to(device), v, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (m, v)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("device,backend", PAIRS)
@given(seed=SEEDS, row_seed=st.integers(0, 2 ** 31 - 1), m=st.integers(1, 9),
       v=st.sampled_from([1, 2, 7, 100, 1000, 1025, 2049, 5000]))
@settings(max_examples=30)
def test_tokens_are_the_reference_bit_for_bit(device, backend, seed, row_seed, m, v):
    p, keys = random_rows(row_seed, m, v), random_keys(row_seed + 1, m)
    want = tokens(p, seed, keys, "reference", "cpu")
    got = tokens(p, seed, keys, backend, device)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_scalars_at_the_32_and_64_bit_boundaries(device, backend):
    images, positions, _ = random_keys(9, 3)
    p = random_rows(9, 3, 40)
    edges = [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, -1, -2 ** 31 - 1, -2 ** 63, 2 ** 63 - 1]
    for seed, purpose in zip(edges + [2 ** 63, 2 ** 64 - 1], edges[::-1] + [0, 2 ** 31]):
        keys = (images, positions, torch.full((3,), purpose))
        assert torch.equal(tokens(p, seed, keys, backend, device), tokens(p, seed, keys, "reference", "cpu"))
        got = ops.race_noise(seed, images.to(device), positions.to(device), purpose, 40, backend=backend)
        want = ops.race_noise(seed, images, positions, purpose, 40, backend="reference")
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_large_vocabulary(device, backend):
    m, v = 3, 16384
    p, keys = random_rows(7, m, v), random_keys(8, m)
    p[1] = torch.softmax(torch.randn(v) * 5, 0)
    assert torch.equal(tokens(p, 2 ** 64 - 5, keys, backend, device), tokens(p, 2 ** 64 - 5, keys, "reference", "cpu"))


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_edge_rows(device, backend):
    v = 77
    images, positions, purposes = random_keys(3, 6)
    noise = ops.race_noise(11, images, positions, purposes, v, backend="reference")
    p = torch.zeros(6, v)
    p[0] = noise[0] / 32         # E / (E / 32) = 32 exactly for every x: a tie, won by index 0
    p[1] = noise[1] / 32
    p[1, :5] = 0.0               # the same tie without the first five entries: index 5
    p[2, 40] = 1.0               # one-hot
    # row 3 all zero: the first index of the smallest E
    p[4, 10] = 1e-40             # subnormal only: counts as zero
    p[5, 3], p[5, 60] = 1e-45, 2.0 ** -126   # the smallest normal takes part (unless E / p overflows)
    got = tokens(p, 11, (images, positions, purposes), backend, device)
    last = 60 if torch.isfinite(noise[5, 60] / p[5, 60]) else int(torch.argmin(noise[5]))
    assert got.tolist() == [0, 5, 40, int(torch.argmin(noise[3])), int(torch.argmin(noise[4])), last]


def test_neg_log_within_two_ulp_on_every_input():
    u = ((2 * torch.arange(2 ** 23, dtype=torch.int64) + 1).to(torch.float32)) * 2.0 ** -24
    e = ref.neg_log(u)
    exact = -torch.log(u.double())
    ulp = torch.from_numpy(np.spacing(exact.float().numpy()).astype(np.float64))
    assert float(((e.double() - exact).abs() / ulp).max()) <= 2.0
    assert float(e.min()) > 0 and float(e.max()) < 16.7


# ---- the hash ----------------------------------------------------------------------------------

def test_uniforms_lie_strictly_inside_the_unit_interval_and_are_flat():
    m, v = 512, 2048
    images, positions, purposes = random_keys(5, m)
    bits = ref.entry_bits(ref.row_keys(99, images, positions, purposes), v)
    u = ref.uniform_from_bits(bits)
    assert float(u.min()) >= 2.0 ** -24 and float(u.max()) <= 1 - 2.0 ** -24
    bins = 256
    counts = torch.bincount((u * bins).long().reshape(-1), minlength=bins)
    assert chi_square_p_value(counts, torch.full((bins,), 1.0 / bins)) > ALPHA
    for shift in (0, 8, 16, 24):  # every byte of the 32 bits
        counts = torch.bincount(((bits >> shift) & 255).reshape(-1), minlength=256)
        assert chi_square_p_value(counts, torch.full((256,), 1.0 / 256)) > ALPHA
    # neighbours along x and along positions: joint histogram of the top 4 bits
    top = bits >> 28
    for a, b in ((top[:, :-1], top[:, 1:]), (top[:-1], top[1:])):
        counts = torch.bincount((a * 16 + b).reshape(-1), minlength=256)
        assert chi_square_p_value(counts, torch.full((256,), 1.0 / 256)) > ALPHA


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_draws_follow_p(device, backend):
    """Each position is an independent draw: SAMPLES positions of one image, one p."""
    v = 12
    p = torch.softmax(torch.randn(v, generator=torch.Generator().manual_seed(4)) * 1.5, 0)
    p[3] = 0.0
    rows = p.expand(SAMPLES, v).contiguous().to(device)
    positions = torch.arange(SAMPLES, device=device)
    images = torch.full((SAMPLES,), 17, device=device)
    got = ops.race_sample(rows, 2024, images, positions, 1, backend=backend)
    counts = torch.bincount(got.long().cpu(), minlength=v)
    assert chi_square_p_value(counts, p / p.sum()) > ALPHA
    # and the check has teeth: the same draws judged against another distribution fail
    other = torch.roll(p, 1)
    counts[4] = 0
    assert chi_square_p_value(counts, other / other.sum()) < ALPHA


# ---- what the noise depends on ---------------------------------------------------------------

def test_noise_changes_with_each_key_word_and_only_with_them():
    images, positions, purposes = random_keys(6, 4)
    v = 256
    base = ops.race_noise(5, images, positions, purposes, v, backend="reference")
    for changed in (ops.race_noise(6, images, positions, purposes, v, backend="reference"),
                    ops.race_noise(5, images + 1, positions, purposes, v, backend="reference"),
                    ops.race_noise(5, images, positions + 1, purposes, v, backend="reference"),
                    ops.race_noise(5, images, positions, purposes + 1, v, backend="reference")):
        assert float((changed != base).double().mean()) > 0.99
    # a negative seed is its value modulo 2**64; a scalar purpose is the same as a filled tensor
    assert torch.equal(ops.race_noise(-1, images, positions, 2, v, backend="reference"),
                       ops.race_noise(2 ** 64 - 1, images, positions, torch.full((4,), 2), v, backend="reference"))
    # the vocabulary size only truncates a row
    assert torch.equal(ops.race_noise(5, images, positions, purposes, 100, backend="reference"), base[:, :100])


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_a_token_does_not_depend_on_its_row_or_batch(device, backend):
    m, v = 10, 300
    p, (images, positions, purposes) = random_rows(21, m, v), random_keys(22, m)
    alone = torch.stack([tokens(p[r:r + 1], 3, (images[r:r + 1], positions[r:r + 1], purposes[r:r + 1]),
                                backend, device)[0] for r in range(m)])
    order = torch.randperm(m, generator=torch.Generator().manual_seed(0))
    extra_p, (extra_i, extra_pos, extra_pur) = random_rows(23, 5, v), random_keys(24, 5)
    batch = (torch.cat([p[order], extra_p]),
             (torch.cat([images[order], extra_i]), torch.cat([positions[order], extra_pos]),
              torch.cat([purposes[order], extra_pur])))
    assert torch.equal(tokens(batch[0], 3, batch[1], backend, device)[:m], alone[order])
    # rows need not be normalised: a power-of-two scale keeps every key's order exactly
    assert torch.equal(tokens(p * 0.25, 3, (images, positions, purposes), backend, device), alone)


# ---- errors, empty batches, the fast path ------------------------------------------------------

@pytest.mark.parametrize("device,backend", ALL_PAIRS)
@pytest.mark.parametrize("bad,match", [(float("nan"), "NaN"), (1.5, r"\[0, 1\]"), (-0.1, r"\[0, 1\]")])
def test_bad_values_are_refused(device, backend, bad, match):
    p = torch.full((3, 50), 0.02, device=device)
    p[1, 7] = bad
    rows = torch.arange(3, device=device)
    with pytest.raises(ValueError, match=match):
        ops.race_sample(p, 0, rows, rows, backend=backend)


def _call(**over):
    args = dict(p=torch.full((2, 5), 0.2), seed=1, images=torch.arange(2), positions=torch.arange(2), purpose=0)
    args.update(over)
    return ops.race_sample(args["p"], args["seed"], args["images"], args["positions"], args["purpose"])


@pytest.mark.parametrize("over,match", [
    (dict(p=[[0.5, 0.5]]), "p must be a torch.Tensor"),
    (dict(p=torch.full((5,), 0.2)), "p must be 2-D"),
    (dict(p=torch.zeros(2, 0)), "1 <= V"),
    (dict(p=torch.zeros(0, 2 ** 23)), "1 <= V"),
    (dict(p=torch.ones(2, 5, dtype=torch.int32)), "floating-point"),
    (dict(images=torch.arange(3)), r"images must have shape \[M\] = \[2\]"),
    (dict(images=torch.zeros(2, 1, dtype=torch.int64)), "images must be 1-D"),
    (dict(images=torch.zeros(2)), "images must be int32 or int64"),
    (dict(positions=torch.arange(3)), r"positions must have shape \[M\] = \[2\]"),
    (dict(positions=torch.arange(2, device="meta")), "positions must be on the device"),
    (dict(purpose=torch.arange(3)), r"purpose must have shape \[M\]"),
    (dict(purpose=1.5), "purpose must be an int"),
    (dict(purpose=2 ** 63), "purpose must lie in"),
    (dict(seed=2 ** 64), "seed must lie in"),
    (dict(seed=-2 ** 63 - 1), "seed must lie in"),
    (dict(seed=1.0), "seed must be an int"),
    (dict(seed=True), "seed must be an int"),
])
def test_argument_errors_name_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_noise_argument_errors():
    rows = torch.arange(2)
    with pytest.raises(ValueError, match="vocab_size must lie in"):
        ops.race_noise(0, rows, rows, 0, 0)
    with pytest.raises(ValueError, match="vocab_size must be an int"):
        ops.race_noise(0, rows, rows, 0, 4.0)
    with pytest.raises(ValueError, match="positions must have shape"):
        ops.race_noise(0, rows, torch.arange(3), 0, 4)


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_empty_batches(device, backend):
    none = torch.zeros(0, dtype=torch.int64, device=device)
    got = ops.race_sample(torch.zeros(0, 9, device=device), 0, none, none, backend=backend)
    assert got.shape == (0,) and got.dtype == torch.int32
    noise = ops.race_noise(0, none, none, 0, 9, backend=backend)
    assert noise.shape == (0, 9) and noise.dtype == torch.float32


@pytest.mark.parametrize("device,backend", ALL_PAIRS)
def test_fast_path_reads_nothing_back_and_matches_the_op(device, backend):
    p, (images, positions, purposes) = random_rows(31, 6, 65), random_keys(32, 6)
    p, images, positions, purposes = (t.to(device) for t in (p, images, positions, purposes))
    for seed in (0, 2 ** 63 + 3):
        want = ops.race_sample(p, seed, images, positions, purposes, backend=backend)
        with count_host_syncs() as c:
            got = xs.race_sample_unchecked(p, seed, images, positions, purposes, backend=backend)
        assert c.round_trips == 0, c.by_op
        assert torch.equal(got, want)
        small = images % 100_000  # int32 ids are taken as they are
        assert torch.equal(xs.race_sample_unchecked(p, seed, small.int(), positions, 2, backend=backend),
                           ops.race_sample(p, seed, small, positions, 2, backend=backend))


@pytest.mark.skipif(not HAS_CPU_OP, reason="specdec._C not built")
def test_opcheck_and_compiled_op_checks():
    p, (images, positions, purposes) = random_rows(41, 4, 33), random_keys(42, 4)
    errors = torch.zeros(4, dtype=torch.int32)
    torch.library.opcheck(torch.ops.specdec.race_sample_checked, (p, -5, images, positions, purposes, 0, errors))
    torch.library.opcheck(torch.ops.specdec.race_sample, (p, 5, images, positions, None, 3))
    torch.library.opcheck(torch.ops.specdec.race_noise, (7, images, positions, None, 1, 33))
    # compiled whole by inductor (the fake implementation gives the output's shape; an op with one
    # returned tensor and an optional mutated argument would not lower)
    traced = torch.compile(lambda p, i, q: torch.ops.specdec.race_sample(p, 5, i, q, None, 3) + 1, fullgraph=True)
    want = torch.ops.specdec.race_sample(p, 5, images, positions, None, 3) + 1
    assert torch.equal(traced(p, images, positions), want)
    with pytest.raises(ValueError, match="images must be int64"):
        torch.ops.specdec.race_sample(p, 0, images.int(), positions, None, 0)
    with pytest.raises(ValueError, match="p must be contiguous"):
        torch.ops.specdec.race_sample(p.t().contiguous().t(), 0, images, positions, None, 0)
