"""The decoders' fast path of every op (`*_unchecked`) checks nothing and reads nothing back, on
every backend that runs here, and gives the public op's result."""
import pytest
import torch

from specdec import ops
from specdec.ops import dispatch
from specdec.ops.pooling import pool_probs_unchecked, sampling_probs_unchecked
from specdec.ops.verification import sample_residual_unchecked, verify_grid_unchecked
from specdec.profiling import count_host_syncs
from specdec.settings import Sampling

BACKENDS = dispatch.available_backends(torch.device("cpu"))
SAMPLING = Sampling(cfg_scale=2.0, temperature=0.9, top_k=7, top_p=0.8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fast_path_reads_nothing_back_and_matches_the_public_ops(backend):
    g = torch.Generator().manual_seed(0)
    logits, uncond = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    tokens = torch.randint(0, 40, (6,), generator=g)
    neighbors = torch.randint(0, 40, (40, 3), generator=g, dtype=torch.int32)
    grid = torch.rand(3, 3, 1, 2, generator=g)   # p, q, uniforms of one-row grids
    kw = dict(cfg_scale=2.0, temperature=0.9, top_k=7, top_p=0.8)
    with count_host_syncs() as c:
        p = sampling_probs_unchecked(logits, uncond, SAMPLING.args, backend)
        pooled = pool_probs_unchecked(logits, tokens, neighbors, uncond, SAMPLING.args, 0.1, backend)
        drawn = sample_residual_unchecked(p, None, grid[2].reshape(-1)[:6], backend)
        verdict = verify_grid_unchecked(grid[0], grid[1], "ratio", uniforms=grid[2], mode="raster", backend=backend)
    assert c.round_trips == 0, c.by_op
    assert torch.equal(p, ops.sampling_probs(logits, uncond_logits=uncond, backend=backend, **kw))
    want = ops.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, delta=0.1, backend=backend, **kw)
    assert all(torch.equal(a, b) for a, b in zip(pooled, want))
    assert torch.equal(drawn.tokens, ops.sample_residual(p, uniforms=grid[2].reshape(-1)[:6], backend=backend).tokens)
    assert torch.equal(verdict.resample, ops.verify_grid(grid[0], grid[1], rule="ratio", uniforms=grid[2],
                                                         mode="raster", backend=backend).resample)
