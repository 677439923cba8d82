"""The opt-in tree_attention paths (specdec.ops.attention): split-KV decoding with
GQA heads packed into M (Triton and CUDA) and the CUDA tensor-core prefill kernel, each against
the float64 reference with the same inputs and tolerances as tests/kernels/test_tree_attention.py, plus
the dispatcher's routing and argument checks.

Here (no GPU) the Triton decode kernel runs under TRITON_INTERPRET=1; the CUDA cases skip and run
in benchmarks/gpu_check.sh when a GPU is lent."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec
from specdec import masks
from specdec.ops import attention as _attention_paths

from helpers import device_backend_pairs
from test_tree_attention import assert_matches, problem_strategies, random_problem, reference64
from test_tree_attention import run as run_problem


def _path_cases():
    cases = []
    for pair in device_backend_pairs():
        device, backend = pair.values
        if backend == "triton":
            cases.append(pytest.param(device, backend, "decode", id=f"{device}-triton-decode"))
        if backend == "cuda":
            for path in ("decode", "prefill"):
                cases.append(pytest.param(device, backend, path, id=f"{device}-cuda-{path}"))
    return cases


CASES = _path_cases()
needs_cases = pytest.mark.skipif(not CASES, reason="no backend with an opt-in path runs here")


def run(p, backend, path, scale=None, num_splits=None):
    return run_problem(p, backend, scale, op=functools.partial(specdec.ops.attention._tree_attention_on_path, path=path,
                                                               num_splits=num_splits))


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
@settings(max_examples=25)
# Longer caches than tests/kernels/test_tree_attention.py (several splits), GQA groups up to 4.
@given(**problem_strategies(group=st.integers(1, 4), nq=st.integers(1, 24), extra=st.integers(0, 150)),
       num_splits=st.sampled_from([None, 1, 2, 3, 7]))
def test_matches_float64_reference(device, backend, path, seed, b, hkv, group, nq, extra, d, dtype, holes, tree,
                                   shuffle, scale, num_splits):
    gen = torch.Generator().manual_seed(seed)
    p = random_problem(gen, b, hkv * group, hkv, nq, nq + extra, d, dtype, holes=holes, tree=tree,
                       shuffle=shuffle, device=device)
    out, lse = run(p, backend, path, scale, num_splits)
    assert_matches(out, lse, *reference64(p, scale), dtype)


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 5])
def test_long_cache_split_unevenly(device, backend, path, dtype, num_splits):
    """Nk = 333 is a multiple of no split length or key tile; holes, a tree and GQA packing."""
    gen = torch.Generator().manual_seed(11)
    p = random_problem(gen, 2, 8, 2, 9, 333, 40, dtype, holes=True, tree=True, device=device)
    assert_matches(*run(p, backend, path, num_splits=num_splits), *reference64(p), dtype)


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
def test_more_splits_than_key_tiles(device, backend, path):
    # 40 splits asked over 50 keys: the wrapper caps them at one key tile each.
    gen = torch.Generator().manual_seed(12)
    p = random_problem(gen, 1, 2, 1, 3, 50, 16, torch.float32, holes=True, device=device)
    assert_matches(*run(p, backend, path, num_splits=40), *reference64(p), torch.float32)


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_query_seeing_nothing_gives_zeros_and_neg_inf_lse(device, backend, path, num_splits):
    """Rows no split sees (a query before every key, an empty cache) and splits that see nothing
    of a row that others do see (the merge must weigh them 0, not NaN)."""
    gen = torch.Generator().manual_seed(1)
    p = random_problem(gen, 2, 4, 2, 5, 200, 16, torch.float32, device=device)
    p["q_pos"] = p["q_pos"].clone()
    p["q_pos"][0, 1] = -1   # before every key
    p["q_pos"][0, 2] = 3    # sees keys 0-3 only: every split but the first sees nothing
    p["kv_valid"] = torch.ones(2, 200, dtype=torch.bool, device=device)
    p["kv_valid"][1] = False  # batch 1: an empty cache
    out, lse = run(p, backend, path, num_splits=num_splits)
    assert torch.all(out[0, :, 1] == 0) and torch.all(torch.isneginf(lse[0, :, 1]))
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert_matches(out, lse, *reference64(p), torch.float32)


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
@pytest.mark.parametrize("nq", [1, 5, 20])
def test_gqa_packing_equals_repeated_heads(device, backend, path, nq):
    gen = torch.Generator().manual_seed(3)
    p = random_problem(gen, 2, 8, 2, nq, 90, 16, torch.float32, tree=True, holes=True, device=device)
    gqa = run(p, backend, path, num_splits=2)
    p["k"] = p["k"].repeat_interleave(4, dim=1)
    p["v"] = p["v"].repeat_interleave(4, dim=1)
    mha = run(p, backend, path, num_splits=2)
    torch.testing.assert_close(gqa[0], mha[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gqa[1], mha[1], rtol=1e-6, atol=1e-6)


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_garbage_in_invalid_slots_does_not_leak(device, backend, path, dtype):
    gen = torch.Generator().manual_seed(2)
    p = random_problem(gen, 1, 4, 2, 6, 140, 32, dtype, holes=True, device=device)
    clean = run(p, backend, path, num_splits=3)
    hole = ~p["kv_valid"][0]
    for name in ("k", "v"):
        p[name] = p[name].clone()
        p[name][0, :, hole] = float("nan")
    got = run(p, backend, path, num_splits=3)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
def test_tree_over_the_draft_block_and_strided_inputs(device, backend, path):
    """A 40-node tree (two mask words per row) after a 100-slot prefix, q/k/v in [B, N, H, D]
    memory (a fused QKV projection's layout)."""
    gen = torch.Generator().manual_seed(5)
    n, prefix = 40, 100
    parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)])
    tree = masks.tree_from_parents(parents)
    p = random_problem(gen, 1, 6, 3, n, prefix + n, 24, torch.float32, device=device)
    p["q_pos"] = (prefix + tree.depth).unsqueeze(0).to(device)
    p["kv_pos"] = torch.cat([torch.arange(prefix), prefix + tree.depth]).unsqueeze(0).to(device)
    p["tree_mask"] = tree.tree_mask.unsqueeze(0).to(device)
    for name in ("q", "k", "v"):
        p[name] = p[name].transpose(1, 2).contiguous().transpose(1, 2)
    assert_matches(*run(p, backend, path, num_splits=2), *reference64(p), torch.float32)


@needs_cases
@pytest.mark.parametrize("device,backend,path", CASES)
@pytest.mark.parametrize("nq,nk", [(0, 5), (3, 0)])
def test_empty_queries_or_empty_cache(device, backend, path, nq, nk):
    gen = torch.Generator().manual_seed(10)
    p = random_problem(gen, 2, 2, 1, nq, max(nk, nq), 16, torch.float32, device=device)
    p["k"], p["v"], p["kv_pos"] = p["k"][:, :, :nk], p["v"][:, :, :nk], p["kv_pos"][:, :nk]
    out, lse = run(p, backend, path)
    assert out.shape == (2, 2, nq, 16) and lse.shape == (2, 2, nq)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


# --- the dispatcher ---------------------------------------------------------------------------

def test_unknown_path_raises_value_error_naming_its_source(monkeypatch):
    p = random_problem(torch.Generator().manual_seed(0), 1, 2, 1, 3, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="path must be one of"):
        run(p, None, "fast")
    monkeypatch.setenv("SPECDEC_ATTN_PATH", "fast")
    with pytest.raises(ValueError, match="SPECDEC_ATTN_PATH must be one of"):
        specdec.ops.tree_attention(p["q"], p["k"], p["v"], q_pos=p["q_pos"], kv_pos=p["kv_pos"])


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_num_splits_raises_value_error(bad):
    p = random_problem(torch.Generator().manual_seed(0), 1, 2, 1, 3, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        run(p, "reference", "decode", num_splits=bad)


def test_auto_routes_by_packed_rows():
    assert _attention_paths.resolve_path("auto", 1, 16, 16) == "decode"
    assert _attention_paths.resolve_path("auto", 16, 16, 4) == "decode"      # 16 queries x 4 heads = 64 rows
    assert _attention_paths.resolve_path("auto", 17, 16, 4) == "prefill"
    assert _attention_paths.resolve_path("auto", 1024, 16, 16) == "prefill"
    assert _attention_paths.resolve_path(None, 1, 16, 16) in _attention_paths.PATHS


def test_default_is_the_previous_kernel(monkeypatch):
    monkeypatch.delenv("SPECDEC_ATTN_PATH", raising=False)
    assert _attention_paths.resolve_path(None, 1, 4, 4) == "default"


def test_split_count():
    # Two waves over 132 multiprocessors, no split under two key steps.
    assert _attention_paths.split_count(programs=4, nk=4096, keys_per_step=64, sms=132) == 32
    assert _attention_paths.split_count(programs=4, nk=200, keys_per_step=64, sms=132) == 2
    assert _attention_paths.split_count(programs=4, nk=64, keys_per_step=64, sms=132) == 1
    assert _attention_paths.split_count(programs=1000, nk=4096, keys_per_step=64, sms=132) == 1
    assert _attention_paths.split_count(programs=4, nk=0, keys_per_step=64, sms=132) == 1


@pytest.mark.skipif(not specdec.ops.dispatch.triton_interpreting(), reason="routes CPU tensors to Triton")
def test_env_var_routes_triton_to_the_split_kernel(monkeypatch):
    from specdec.triton_kernels import attention

    calls = []
    real = attention.tree_attention_split_kv
    monkeypatch.setattr(attention, "tree_attention_split_kv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    p = random_problem(torch.Generator().manual_seed(0), 1, 4, 2, 3, 40, 16, torch.float32)
    monkeypatch.setenv("SPECDEC_ATTN_PATH", "auto")
    out = specdec.ops.tree_attention(p["q"], p["k"], p["v"], q_pos=p["q_pos"], kv_pos=p["kv_pos"], backend="triton")
    assert calls == [1]
    torch.testing.assert_close(out.double(), reference64(p)[0], rtol=2e-5, atol=2e-5)
    monkeypatch.setenv("SPECDEC_ATTN_PATH", "default")
    specdec.ops.tree_attention(p["q"], p["k"], p["v"], q_pos=p["q_pos"], kv_pos=p["kv_pos"], backend="triton")
    assert calls == [1]


def test_cpu_backend_ignores_the_path(monkeypatch):
    if "cpu" not in specdec.available_backends(torch.device("cpu")):
        pytest.skip("C++ extension not built")
    p = random_problem(torch.Generator().manual_seed(0), 1, 4, 2, 3, 40, 16, torch.float32)
    want = run(p, "cpu", "default")
    got = run(p, "cpu", "decode")
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_cuda_config():
    q = torch.empty(2, 16, 1, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 4, 4096, 64, dtype=torch.bfloat16)
    # 1 query x 4 heads = 4 rows: 1 row tile per (b, kv head), 8 blocks, 128 keys a step.
    assert _attention_paths.cuda_config("decode", q, k, None) == (1, 16)
    assert _attention_paths.cuda_config("prefill", q, k, None) == (4, 32)
    assert _attention_paths.cuda_config("decode", q, k, 3) == (1, 3)


needs_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and specdec.build_info()["cuda_kernels"]),
    reason="the compiled split op runs on CUDA tensors only (benchmarks/gpu_check.sh runs this)")


def _cuda_problem():
    gen = torch.Generator().manual_seed(9)
    return random_problem(gen, 2, 4, 2, 5, 90, 16, torch.bfloat16, holes=True, tree=True, device="cuda")


@needs_cuda_kernels
@pytest.mark.parametrize("warps_m,splits", [(1, 1), (1, 3), (4, 1), (4, 2)])
def test_opcheck_split_op(warps_m, splits):
    p = _cuda_problem()
    torch.library.opcheck(torch.ops.specdec.tree_attention_split,
                          (p["q"], p["k"], p["v"], p["q_pos"], p["kv_pos"], p["kv_valid"], p["tree_mask"], None,
                           warps_m, splits))


@needs_cuda_kernels
@pytest.mark.parametrize("warps_m,splits,match", [(2, 1, "warps_m"), (1, 0, "splits")])
def test_split_op_checks_its_config(warps_m, splits, match):
    p = _cuda_problem()
    with pytest.raises(ValueError, match=match):
        torch.ops.specdec.tree_attention_split(p["q"], p["k"], p["v"], p["q_pos"], p["kv_pos"], None, None, None,
                                               warps_m, splits)
