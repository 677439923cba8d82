"""Distribution tests of kernel 2 (docs/design.md, "How correctness is shown", item 3).

Pearson chi-square goodness-of-fit over >= 1e5 samples at a fixed significance ALPHA, with fixed
seeds (so a run is reproducible; a wrong sampler fails by many orders of magnitude in p-value):
- the generator path of sample_residual draws from norm(max(0, p - q)) (on the C++/CUDA/Triton
  backends that is in-kernel Philox; the compiled op's own Philox path is also tested directly);
- raster speculative sampling through our ops (accept with min(1, p/q) via verify_grid, resample
  the first rejection with sample_residual) emits its first token with the target distribution p:
  the lossless property of speculative decoding.

These need one program per sample, too many for the Triton interpreter: Triton runs them only on
a GPU.
"""
import pytest
import torch

from helpers import DEVICES, backends_for, device_backend_pairs
from specdec import ops

ALPHA = 1e-3
SAMPLES = 200_000

PAIRS = [pytest.param("cpu", "reference", id="cpu-reference")] + [
    p for p in device_backend_pairs() if not (p.values[1] == "triton" and p.values[0] == "cpu")
]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's statistic against `probs` (cells with zero probability must be empty)."""
    counts = counts.double()
    probs = probs.double()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of zero probability was sampled"
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def _distributions(v, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g) * 1.5, 0)
    q = torch.softmax(torch.randn(v, generator=g) * 1.5, 0)
    p[3] = 0.0  # a token the target never emits
    q[5] = 0.0  # a token the drafter never proposes (q = 0 < p)
    return p / p.sum(), q / q.sum()


def test_chi_square_detects_a_wrong_distribution():
    # The test must be able to fail: samples of q judged against p are rejected.
    p, q = _distributions(12, 0)
    draws = torch.multinomial(q, SAMPLES, replacement=True, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=12)
    counts[3] = 0  # sidestep the zero-probability assertion: only the statistic is on trial
    assert chi_square_p_value(counts, p) < ALPHA


@pytest.mark.parametrize("device,backend", PAIRS)
def test_sample_residual_generator_follows_residual(device, backend):
    v = 12
    p, q = _distributions(v, 2)
    residual = torch.clamp(p - q, min=0)
    residual = residual / residual.sum()
    gen = torch.Generator(device=device).manual_seed(20240601)
    rows_p = p.to(device).expand(SAMPLES, v).contiguous()
    rows_q = q.to(device).expand(SAMPLES, v).contiguous()
    out = ops.sample_residual(rows_p, rows_q, generator=gen, backend=backend)
    assert not out.fallback.any()
    counts = torch.bincount(out.tokens.long().cpu(), minlength=v)
    assert chi_square_p_value(counts, residual) > ALPHA


@pytest.mark.skipif(not any(b == "cpu" for _, b in [p.values for p in PAIRS]), reason="no C++ extension")
@pytest.mark.parametrize("device", [d for d in DEVICES if "cpu" in backends_for(d) or "cuda" in backends_for(d)])
def test_sample_residual_in_kernel_philox_follows_residual(device):
    # The compiled op with uniforms=None: row r's uniform from Philox (seed, r, offset).
    v = 12
    p, q = _distributions(v, 4)
    residual = torch.clamp(p - q, min=0)
    residual = residual / residual.sum()
    rows_p = p.to(device).expand(SAMPLES, v).contiguous()
    rows_q = q.to(device).expand(SAMPLES, v).contiguous()
    tokens, fallback = torch.ops.specdec.sample_residual(rows_p, rows_q, None, 987654321, 5)
    assert not fallback.any()
    assert chi_square_p_value(torch.bincount(tokens.long().cpu(), minlength=v), residual) > ALPHA
    # q=None samples p itself.
    tokens, _ = torch.ops.specdec.sample_residual(rows_p, None, None, 42, 0)
    assert chi_square_p_value(torch.bincount(tokens.long().cpu(), minlength=v), p) > ALPHA


@pytest.mark.parametrize("device,backend", PAIRS)
def test_raster_speculative_sampling_is_lossless(device, backend):
    v = 12
    p, q = _distributions(v, 3)
    gen = torch.Generator(device=device).manual_seed(777)
    draft = torch.multinomial(q.to(device), SAMPLES, replacement=True, generator=gen)  # x ~ q
    p_dev, q_dev = p.to(device), q.to(device)
    # One 1x1 grid per trial: the first drafted token, verified with u < min(1, p(x)/q(x)).
    verdict = ops.verify_grid(p_dev[draft].view(-1, 1, 1), q_dev[draft].view(-1, 1, 1), rule="ratio",
                              mode="raster", generator=gen, backend=backend)
    rejected = verdict.resample.view(-1)
    assert torch.equal(verdict.first_reject == 0, rejected)
    m = int(rejected.sum())
    fix = ops.sample_residual(p_dev.expand(m, v).contiguous(), q_dev.expand(m, v).contiguous(),
                              generator=gen, backend=backend)
    emitted = draft.clone()
    emitted[rejected] = fix.tokens.long()
    counts = torch.bincount(emitted.cpu(), minlength=v)
    assert chi_square_p_value(counts, p) > ALPHA
    # And the check has teeth: the draft alone (no rejection step) does not pass for p.
    draft_counts = torch.bincount(draft.cpu(), minlength=v)
    draft_counts[3] = 0
    assert chi_square_p_value(draft_counts, p) < ALPHA
