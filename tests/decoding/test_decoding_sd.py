"""The exact decoders keep the target's distribution. `sd`: on a 2x2 grid with a 3-token vocabulary
the empirical distribution of its grids matches the exactly enumerated AR distribution (chi-square
at a fixed significance), and on a 4x4 grid its marginals and pair joints match plain AR's. Under
truncated, tempered sampling (top-k, top-p, temperature) `sd`, `sjd` and exact SSD match the
enumerated distribution of the truncated target.
SSD with commit="verify" passes the 4x4 check; the published SSD rule fails it."""
import dataclasses
import itertools
import math

import pytest
import torch

from decoding_models import lossless_decode, tiny_gpt, tiny_heads, single_thread  # noqa: F401  (autouse fixture)
from grid_statistics import pvalues_against
from specdec import ops
from specdec.decoding import sd, ssd
from specdec.settings import RunSettings, Sampling

VOCAB = 3
SAMPLING = Sampling(cfg_scale=1.5, temperature=1.0)
CLASS = 1


def exact_grid_distribution(model, sampling, cls):
    """P(grid) for all V^4 grids: product of the target's (guided) conditionals, by teacher forcing."""
    grids = torch.tensor(list(itertools.product(range(VOCAB), repeat=4)))
    n = grids.shape[0]
    with torch.no_grad():
        cond = model.teacher_forward(grids, torch.full((n,), cls)).logits[:, model.prefix_len - 1:-1]
        unc = model.teacher_forward(grids, torch.full((n,), model.null_class)).logits[:, model.prefix_len - 1:-1]
    p = ops.sampling_probs(cond.reshape(-1, VOCAB), uncond_logits=unc.reshape(-1, VOCAB), backend="reference",
                           cfg_scale=sampling.cfg_scale, temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p).view(n, 4, VOCAB)
    probs = p.gather(2, grids[..., None])[..., 0].double().prod(1)
    return grids, probs


def chi_square_pvalue(counts, probs):
    """Pearson chi-square p-value (Wilson-Hilferty normal approximation of the chi-square tail).
    Cells expected fewer than 5 times are pooled into one, as the test requires; a grid of
    probability zero that was drawn gives p = 0 (cells of probability zero, such as those outside a
    top-k, are otherwise left out)."""
    total = counts.sum()
    expected = probs * total
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    counts, expected = counts[probs > 0], expected[probs > 0]
    small = expected < 5
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = counts.numel() - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def grid_counts(tokens):
    idx = (tokens.view(-1, 4) * torch.tensor([27, 9, 3, 1])).sum(1)
    return torch.bincount(idx, minlength=VOCAB ** 4).double()


N_SAMPLES = 100_000


def tiny_target():
    return tiny_gpt(2, VOCAB, seed=3, dim=16, layers=1, scale=0.6)


@pytest.fixture(scope="module", params=["model", "heads"])
def sd_counts(request):
    target = tiny_target()
    classes, run = torch.full((N_SAMPLES,), CLASS), RunSettings(seed=11, sampling=SAMPLING, batch_size=N_SAMPLES)
    if request.param == "model":
        return target, lossless_decode("sd", target, classes, run)
    return target, sd.decode(target, classes, heads=tiny_heads(16, seed=5), options=sd.SDOptions(chunk=3), run=run)


def test_sd_reproduces_the_target_distribution(sd_counts):
    target, out = sd_counts
    _, probs = exact_grid_distribution(target, SAMPLING, CLASS)
    # The drafter really disagrees with the target (else the test would be vacuous) ...
    assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)
    # ... and the grids still follow the target's distribution.
    assert chi_square_pvalue(grid_counts(out.tokens), probs) > 1e-3


def test_chi_square_detects_a_wrong_distribution(sd_counts):
    """The same samples against the exact distribution of another CFG scale are rejected: the
    test has the power to fail."""
    target, out = sd_counts
    _, other = exact_grid_distribution(target, Sampling(cfg_scale=2.5), CLASS)
    assert chi_square_pvalue(grid_counts(out.tokens), other) < 1e-3


# ---- truncated and tempered sampling: the lossless methods on the 2x2 grid ---------------------

#: Flattened by the temperature so that the token cut off carries real mass: top-k 2 and (on this
#: model) the nucleus 0.7 each keep 2 of the 3 tokens at every position. Drafts (drawn from the
#: drafter's own truncated distribution) often fall where the target has less mass, or none. Each
#: setting catches a decoder that truncates its target's distribution in one place and not in
#: another (checked by hand: verifying with p without top-k or top-p while drawing with it fails).
TRUNCATED = {"top-k": Sampling(cfg_scale=1.5, temperature=1.5, top_k=2),
             "top-p": Sampling(cfg_scale=1.5, temperature=1.5, top_p=0.7)}
TRUNCATED_SAMPLES = 20_000


@pytest.fixture(scope="module", params=[(m, s) for s in TRUNCATED for m in ("sd", "sjd", "ssd")],
                ids=lambda p: "-".join(p))
def truncated_counts(request):
    method, setting = request.param
    target = tiny_target()
    run = RunSettings(seed=12, sampling=TRUNCATED[setting], batch_size=TRUNCATED_SAMPLES)
    return target, TRUNCATED[setting], lossless_decode(method, target, torch.full((TRUNCATED_SAMPLES,), CLASS), run)


def test_lossless_methods_keep_the_truncated_target_distribution(truncated_counts):
    """Drafts the truncated target gives no mass (or less than the drafter did) are rejected and
    redrawn from the residual of the truncated distributions: the grids follow the enumerated
    distribution of the target under top-k, top-p and temperature."""
    target, sampling, out = truncated_counts
    _, probs = exact_grid_distribution(target, sampling, CLASS)
    assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)
    assert chi_square_pvalue(grid_counts(out.tokens), probs) > 1e-3


def test_truncation_is_seen_by_the_chi_square_test(truncated_counts):
    """The same samples against the target without top-k and top-p are rejected: the test tells
    truncated sampling from untruncated."""
    target, sampling, out = truncated_counts
    _, untruncated = exact_grid_distribution(target, dataclasses.replace(sampling, top_k=0, top_p=1.0), CLASS)
    assert chi_square_pvalue(grid_counts(out.tokens), untruncated) < 1e-3


# ---- many rounds: a 4x4 grid -----------------------------------------------------------------


GRID_4X4_SAMPLES = 20_000


@pytest.fixture(scope="module")
def ar_4x4():
    target = tiny_gpt(4, 4, seed=3, dim=16, layers=1, scale=0.6)
    from specdec.decoding import ar

    out = ar.decode(
        target,
        torch.full((GRID_4X4_SAMPLES,), CLASS),
        run=RunSettings(seed=1, sampling=SAMPLING, batch_size=GRID_4X4_SAMPLES),
    )
    return target, out.tokens.view(GRID_4X4_SAMPLES, 16)


@pytest.mark.parametrize("drafter", ["model", "heads"])
def test_sd_over_many_rounds_keeps_the_ar_distribution(ar_4x4, drafter):
    """The 2x2 test above covers one drafting round. On a 4x4 grid with chunk 3 every image goes
    through several rounds: rejections, corrections, bonus tokens, the drafter catching up, rows of
    the batch at different progress. Every position's marginal and a few pairs' joints under sd
    match plain AR's (two-sample chi-square, Bonferroni over the 20 statistics)."""
    target, ar_tokens = ar_4x4
    classes = torch.full((GRID_4X4_SAMPLES,), CLASS)
    run = RunSettings(seed=2, sampling=SAMPLING, batch_size=GRID_4X4_SAMPLES)
    out = (lossless_decode("sd", target, classes, run) if drafter == "model"
           else sd.decode(target, classes, heads=tiny_heads(16, seed=5), options=sd.SDOptions(chunk=3), run=run))
    accepted, drafted = sum(out.stats.accepted), sum(out.stats.drafted)
    assert 0.05 < accepted / drafted < 0.95  # real rejections and real acceptances
    sd_tokens = out.tokens.view(GRID_4X4_SAMPLES, 16)
    pvalues = pvalues_against(ar_tokens, sd_tokens)
    assert min(pvalues) > 1e-3 / len(pvalues)


def test_two_sample_test_has_power(ar_4x4):
    """AR at another CFG scale is told apart by the same statistics."""
    target, ar_tokens = ar_4x4
    from specdec.decoding import ar

    other = ar.decode(
        target,
        torch.full((GRID_4X4_SAMPLES,), CLASS),
        run=RunSettings(seed=3, sampling=Sampling(cfg_scale=3.0), batch_size=GRID_4X4_SAMPLES),
    ).tokens.view(GRID_4X4_SAMPLES, 16)
    pvalues = pvalues_against(ar_tokens, other)
    assert min(pvalues) < 1e-3 / len(pvalues)


# ---- SSD: the published rule is lossy, commit="verify" is not ------------------------------------


def _ssd_4x4(commit):
    """20,000 SSD images in one batch: under commit="verify" each row settles its own spans (up to
    its own first correction) in passes shared by the batch, so SSD's rows are exact in
    distribution for each image of a batch, which is what makes a 20,000-sample test affordable."""
    target = tiny_gpt(4, 4, seed=3, dim=16, layers=1, scale=0.6)
    heads = tiny_heads(16, width=4, seed=5)
    classes = torch.full((GRID_4X4_SAMPLES,), CLASS)
    return ssd.decode(
        target,
        classes,
        heads=heads,
        options=ssd.SSDOptions(rounds=1, chunk=2, commit=commit, max_tail=None, final_passes=None),
        run=RunSettings(seed=4, sampling=SAMPLING, batch_size=GRID_4X4_SAMPLES),
    )


def _pvalues_against_ar(ar_tokens, out):
    tokens = out.tokens.view(GRID_4X4_SAMPLES, 16)
    return pvalues_against(ar_tokens, tokens)


def test_ssd_commit_verify_keeps_the_ar_distribution(ar_4x4):
    """commit="verify" (SJD's rule in every judgment, the commit pass judging its whole window, open
    tails re-judged until they hold): the same statistics as the sd test match plain AR's."""
    _, ar_tokens = ar_4x4
    out = _ssd_4x4("verify")
    accepted, drafted = sum(out.stats.accepted), sum(out.stats.drafted)
    assert accepted < drafted  # corrections happened ...
    assert sum(out.stats.method_stats.final_passes) > 0  # ... and left open tails to close
    pvalues = _pvalues_against_ar(ar_tokens, out)
    assert min(pvalues) > 1e-3 / len(pvalues)


def test_the_published_ssd_rule_is_told_apart_from_ar(ar_4x4):
    """The published rule (commit="write", the adopted "resampled" reading) on the same model and
    draws is detectably biased: the statistics have the power to see what "verify" fixes."""
    _, ar_tokens = ar_4x4
    pvalues = _pvalues_against_ar(ar_tokens, _ssd_4x4("write"))
    assert min(pvalues) < 1e-3 / len(pvalues)
