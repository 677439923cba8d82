"""Batch-invariant numerics: results of one image that do not depend on what else is in the batch.

BLAS libraries pick their matrix kernels by shape: on this CPU (MKL), row i of `x @ w.T` comes out
with other low bits for x of 2, 3, 5, 7 or 9 rows than for x of 16 rows, and GPUs do the same with
their split-K heuristics. A decoder that batches images, or pads a window with extra queries, then
feeds slightly different logits to its samplers than the same image decoded alone, and once in a
while a uniform falls between the two CDFs and a token changes.

Inside `batch_invariant()` the embedded models compute every row on its own: linear layers as one
matrix-vector product per row (`RowLinear`), the reference `tree_attention` as one
vector-matrix product per query, and attention reads the whole slot cache (a fixed number of keys)
instead of the prefix the batch has reached. Slower (for tests and for checking a decoder), exact:
image i's tokens are then bit-identical whatever batch it was decoded in (tests/decoding/test_engine.py).
"""
from __future__ import annotations

import contextlib
import threading

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_state = threading.local()


def batch_invariant_enabled() -> bool:
    """True inside `batch_invariant()`, in the thread that entered it (a thread pool's workers do
    not inherit it: enter it in the function they run)."""
    return getattr(_state, "enabled", False)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Compute every row (token, query) independently of the others in its batch while active."""
    previous = batch_invariant_enabled()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def row_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] with each row of the result computed on its own: the products
    summed over K elementwise (one sequential sum per output element), so row m is the same
    whatever M and the batch dimensions are. Not a batched BLAS call, even of one-row products:
    MKL picks its batched kernels by the batch count, and with 257 keys a query's attention
    scores came out with other low bits beside 6 queries than beside 16 (a padded pass), which
    changed an SSD image under continuous batching (tests/kernels/test_reference_runs.py). An
    [..., M, K, N] intermediate: for tests and checks, as batch_invariant() is."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as one vector-matrix product per row of x (its leading dims
    flattened): row i is the same whatever rows are beside it."""
    flat = x.reshape(-1, 1, x.shape[-1])
    out = torch.bmm(flat, weight.t().expand(flat.shape[0], -1, -1))[:, 0]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class RowLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) that computes row by row inside
    `batch_invariant()`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not batch_invariant_enabled():
            return F.linear(x, self.weight, self.bias)
        return row_linear(x, self.weight, self.bias)


class RowWiseLinears(TorchFunctionMode):
    """Every `F.linear` called inside it (the `nn.Linear` layers of a model that is not ours: a
    transformers model's projections and heads) computed row by row (`row_linear`). The
    transformers adapters enter it inside `batch_invariant()`: a token re-fed in a pass of another
    width (ZipAR's padding, SSD's spans) then writes the keys it wrote before, bit for bit."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return row_linear(*args, **kwargs)
        return func(*args, **kwargs)


__all__ = ["RowLinear", "RowWiseLinears", "batch_invariant", "batch_invariant_enabled", "row_linear", "row_matmul"]
