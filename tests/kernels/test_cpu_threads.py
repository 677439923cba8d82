"""The C++ kernels split large calls over threads and run small ones inline (a grain in
element-operations, csrc/include/specdec/cpu_parallel.h). Rows are independent, so the split must
never change a result: every op gives bit-identical outputs with 1 and 2 threads, on shapes well
above the grain (split) and below it (inline)."""
import pytest
import torch

import specdec
from specdec import ops

pytestmark = pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ kernels not built")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _same_with_1_and_2_threads(threads, fn):
    threads(1)
    one = fn()
    threads(2)
    two = fn()
    for a, b in zip(one, two):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return one


@pytest.mark.parametrize("rows, vocab", [(3, 256), (96, 4096)])
def test_pooling_and_sampling(threads, rows, vocab):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g) * 3
    uncond = torch.randn(rows, vocab, generator=g)
    drafted = torch.randint(0, vocab, (rows,), generator=g)
    nbr = torch.randint(0, vocab, (vocab, 8), generator=g, dtype=torch.int32)
    p = torch.softmax(torch.randn(rows, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=g), -1)
    u = torch.rand(rows, generator=g)
    pooled = _same_with_1_and_2_threads(threads, lambda: tuple(ops.pool_probs(
        logits, drafted, nbr, uncond_logits=uncond, cfg_scale=2.0, top_k=50, delta=0.2, backend="cpu")))
    ref = ops.pool_probs(logits, drafted, nbr, uncond_logits=uncond, cfg_scale=2.0, top_k=50, delta=0.2,
                         backend="reference")
    torch.testing.assert_close(pooled[0], ref.pooled, rtol=1e-5, atol=1e-6)
    _same_with_1_and_2_threads(threads, lambda: (ops.sampling_probs(logits, uncond_logits=uncond, cfg_scale=2.0,
                                                                    backend="cpu"),))
    out = _same_with_1_and_2_threads(threads, lambda: tuple(ops.sample_residual(p, q, uniforms=u, backend="cpu")))
    ref = ops.sample_residual(p, q, uniforms=u, backend="reference")
    assert torch.equal(out[0], ref.tokens)


@pytest.mark.parametrize("batch, side", [(2, 8), (64, 32)])
def test_verify_grid(threads, batch, side):
    g = torch.Generator().manual_seed(side)
    score = torch.rand(batch, side, side, generator=g)
    out = _same_with_1_and_2_threads(threads, lambda: tuple(ops.verify_grid(
        score, rule="threshold", tau=0.1, mode="local", radius=1, backend="cpu")))
    ref = ops.verify_grid(score, rule="threshold", tau=0.1, mode="local", radius=1, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("nq, nk", [(1, 20), (200, 300)])
def test_tree_attention(threads, nq, nk):
    g = torch.Generator().manual_seed(nq)
    q = torch.randn(2, 4, nq, 32, generator=g)
    k = torch.randn(2, 4, nk, 32, generator=g)
    v = torch.randn(2, 4, nk, 32, generator=g)
    q_pos = torch.arange(nk - nq, nk).expand(2, -1).contiguous()
    kv_pos = torch.arange(nk).expand(2, -1).contiguous()
    out = _same_with_1_and_2_threads(threads, lambda: tuple(ops.tree_attention(
        q, k, v, q_pos=q_pos, kv_pos=kv_pos, backend="cpu")))
    ref = ops.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, backend="reference")
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-5)
