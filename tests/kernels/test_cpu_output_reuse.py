"""sampling_probs on the CPU hands out the block of an output the caller freed (csrc/cpu/
output_cache.h): no page faults on the next call. What must hold: a reused block never leaks the
old contents into the new result (every kernel path writes every element: the dense softmax, the
sparse top-k rows, the dense top-k/top-p rows and NaN rows), a live output is never handed out
twice, and the tensor behaves as any CPU tensor (resize, free)."""
import math

import pytest
import torch

import specdec
from helpers import assert_probs_match
from specdec.reference import pooling as ref

pytestmark = pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")

# 64 rows of 16,384 float32: 4 MiB, the smallest output the cache keeps.
N, V = 64, 16384


def _sampling(logits, uncond, top_k, top_p):
    return torch.ops.specdec.sampling_probs(logits, uncond, 2.0 if uncond is not None else 1.0, 1.0, top_k, top_p)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 3
    logits[5] = math.nan  # a NaN row: written as NaN
    uncond = torch.randn(N, V, generator=g) * 3
    return logits, uncond


def _assert_matches_reference(got, logits, uncond, top_k, top_p):
    assert_probs_match(got, ref.sampling_probs(logits, uncond_logits=uncond,
                                               cfg_scale=2.0 if uncond is not None else 1.0, top_k=top_k, top_p=top_p))


# top_k 0: the dense softmax; 2000: few kept (zeros, then the kept ids); 8000 and top_p 0.9: the
# dense masked rows.
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2000, 1.0), (8000, 1.0), (0, 0.9)])
@pytest.mark.parametrize("cfg", [True, False])
def test_a_freed_output_is_reused_without_its_old_contents(top_k, top_p, cfg):
    logits, uncond = _inputs(top_k + int(top_p * 10))
    un = uncond if cfg else None
    first = _sampling(logits, un, top_k, top_p)
    address = first.data_ptr()
    first.fill_(7.0)  # what the next output must not show
    del first
    again = _sampling(logits, un, top_k, top_p)
    assert again.data_ptr() == address, "the freed block was not reused"
    _assert_matches_reference(again, logits, un, top_k, top_p)


def test_live_outputs_get_their_own_blocks():
    logits, uncond = _inputs(1)
    first = _sampling(logits, uncond, 0, 1.0)
    kept = first.clone()
    second = _sampling(logits * 0.5, None, 2000, 1.0)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first.nan_to_num(), kept.nan_to_num())
    _assert_matches_reference(second, logits * 0.5, None, 2000, 1.0)


def test_a_reused_block_serves_a_smaller_output_and_resizes():
    logits, uncond = _inputs(2)
    logits, uncond = torch.cat([logits, logits]), torch.cat([uncond, uncond])  # 8 MiB out
    first = _sampling(logits, uncond, 0, 1.0)
    address = first.data_ptr()
    del first
    # 3/4 of the rows (6 MiB): within the block (a block serves outputs down to half its size).
    rows = 2 * N * 3 // 4
    smaller = _sampling(logits[:rows], uncond[:rows], 0, 1.0)
    assert smaller.data_ptr() == address
    _assert_matches_reference(smaller, logits[:rows], uncond[:rows], 0, 1.0)
    smaller.resize_(4 * N, V)  # grows through the same allocator: a new block holding the old rows
    assert smaller.shape == (4 * N, V)
    _assert_matches_reference(smaller[:rows], logits[:rows], uncond[:rows], 0, 1.0)


def test_small_outputs_are_correct():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1000, generator=g)
    for _ in range(3):
        _assert_matches_reference(_sampling(logits, None, 0, 1.0), logits, None, 0, 1.0)
