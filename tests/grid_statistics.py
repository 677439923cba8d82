"""Two-sample statistics of decoded 4x4 grids: does a decoder keep plain AR's distribution?

Every position's token marginal and a few pairs' joints, compared by a chi-square test on a
2 x k contingency table (the decoders' distribution tests: sd, ssd, and any method under a token
budget)."""
import torch

#: the pairs of raster positions whose joint distributions are compared
PAIRS = [(0, 15), (3, 4), (5, 10), (7, 8)]


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors come from one distribution (2 x k contingency table;
    categories empty in both are dropped). Both in one category (a token every grid has there,
    under top-k or top-p): 1, not the NaN of a test with no degree of freedom."""
    table = torch.stack([a, b]).double()
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def statistics_4x4(tokens, vocab: int = 4):
    """Counts of every position's token (16 x vocab) and of the PAIRS' joints (4 x vocab^2) of
    tokens [N, 16]."""
    marg = [torch.bincount(tokens[:, i], minlength=vocab) for i in range(16)]
    pairs = [torch.bincount(tokens[:, i] * vocab + tokens[:, j], minlength=vocab * vocab) for i, j in PAIRS]
    return marg + pairs


def pvalues_against(reference_tokens, tokens):
    """The p-value of each statistic, `tokens` [N, 16] against `reference_tokens` [M, 16]."""
    return [two_sample_pvalue(a, b) for a, b in zip(statistics_4x4(reference_tokens), statistics_4x4(tokens))]
