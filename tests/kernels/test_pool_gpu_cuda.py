"""The CUDA pooling variants: chosen from Python, never by getenv in C++.

SPECDEC_CUDA_POOL in {"default", "v2", "radix"} picks, on the cuda backend, the plain op
(torch.ops.specdec.pool_probs / sampling_probs / sample_residual: the kernels run on the H200) or the
*_variant op with `variant` 1 or 2 (never run on a GPU). Here without a GPU: the schemas, the fake
implementations, the selection logic and its errors. With a GPU: every variant against the reference
on fresh random inputs and the edge cases (the kept set exactly, probabilities to float32 rounding,
sample_residual's tokens bit for bit).
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdec
from specdec import ops
from specdec.ops import dispatch
from specdec.reference import pooling as ref

HAS_EXT = specdec.build_info()["cpu_kernels"]
HAS_CUDA_KERNELS = specdec.build_info()["cuda_kernels"] and torch.cuda.is_available()
VARIANT_OPS = {
    "pool_probs_variant": "(Tensor logits, Tensor tokens, Tensor? neighbors, Tensor? uncond_logits, float cfg_scale, "
                          "float temperature, int top_k, float? delta, float top_p, int variant)",
    "sampling_probs_variant": "(Tensor logits, Tensor? uncond_logits, float cfg_scale, float temperature, int top_k, "
                              "float top_p, int variant)",
    "sample_residual_variant": "(Tensor p, Tensor? q, Tensor? uniforms, int seed, int offset, int variant)",
}
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="specdec._C not built")
needs_gpu = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a GPU and the CUDA kernels (never run on one)")


# ---- the selection, without a GPU ----------------------------------------------------------------------

def test_default_is_the_kernel_that_ran_on_a_gpu(monkeypatch):
    monkeypatch.delenv("SPECDEC_CUDA_POOL", raising=False)
    assert dispatch.cuda_pool_variant() == 0
    assert dispatch.CUDA_POOL_VARIANTS == {"default": 0, "v2": 1, "radix": 2}


@pytest.mark.parametrize("bad", ["", "1", "V2", "bisect", "radix "])
def test_unknown_variant_is_refused_naming_the_switch(monkeypatch, bad):
    monkeypatch.setenv("SPECDEC_CUDA_POOL", bad)
    with pytest.raises(ValueError, match="SPECDEC_CUDA_POOL"):
        dispatch.cuda_pool_variant()


@needs_ext
@pytest.mark.parametrize("name", ["pool_probs", "sampling_probs", "sample_residual"])
def test_the_switch_picks_the_op(monkeypatch, name):
    for value in ("default", "v2", "radix"):
        monkeypatch.setenv("SPECDEC_CUDA_POOL", value)
        # Only the cuda backend has variants: the cpu backend keeps its op whatever the switch says.
        assert dispatch.pool_op(name, "cpu") is getattr(torch.ops.specdec, name)
        op = dispatch.pool_op(name, "cuda")
        if value == "default":
            assert op is getattr(torch.ops.specdec, name)
        else:
            assert op is not getattr(torch.ops.specdec, name)
    monkeypatch.setenv("SPECDEC_CUDA_POOL", "nope")
    with pytest.raises(ValueError, match="SPECDEC_CUDA_POOL"):
        dispatch.pool_op(name, "cuda")


@needs_ext
@pytest.mark.parametrize("value,variant", [("v2", 1), ("radix", 2)])
def test_variant_reaches_the_variant_op_with_its_number(monkeypatch, value, variant):
    logits = torch.randn(2, 9)
    monkeypatch.setenv("SPECDEC_CUDA_POOL", value)
    # On CPU tensors the variant ops have no kernel: the error names the op that was reached.
    with pytest.raises(NotImplementedError, match="sampling_probs_variant"):
        dispatch.pool_op("sampling_probs", "cuda")(logits, None, 1.0, 1.0, 0, 1.0)
    calls = []
    monkeypatch.setattr(dispatch, "compiled_op", lambda name: lambda *args: calls.append((name, args[-1])))
    dispatch.pool_op("sampling_probs", "cuda")(logits, None, 1.0, 1.0, 0, 1.0)
    assert calls == [("sampling_probs_variant", variant)]


@needs_ext
@pytest.mark.parametrize("name", sorted(VARIANT_OPS))
def test_variant_schemas(name):
    schema = str(getattr(torch.ops.specdec, name).default._schema)
    assert schema.startswith(f"specdec::{name}{VARIANT_OPS[name]}"), schema


@needs_ext
def test_variant_fakes_trace():
    # The fake implementations (specdec/ops/pooling.py, verification.py) let torch.compile trace the variant ops.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits, tokens = torch.empty(3, 11), torch.zeros(3, dtype=torch.int64)
        out = torch.ops.specdec.pool_probs_variant(logits, tokens, None, None, 1.0, 1.0, 2, None, 0.5, 2)
        assert [tuple(t.shape) for t in out] == [(3,)] * 4 and all(t.dtype == torch.float32 for t in out)
        assert torch.ops.specdec.sampling_probs_variant(logits, None, 1.0, 1.0, 2, 0.5, 1).shape == (3, 11)
        tok, fb = torch.ops.specdec.sample_residual_variant(torch.empty(3, 11), None, None, 0, 0, 2)
        assert tok.shape == (3,) and tok.dtype == torch.int32 and fb.dtype == torch.bool


def test_cuda_sources_read_no_environment():
    # The variant is an argument chosen in Python, not an environment read in C++.
    import glob
    import os

    from helpers import ROOT as root
    for path in glob.glob(os.path.join(root, "csrc", "**", "*.cu*"), recursive=True) + glob.glob(
            os.path.join(root, "csrc", "include", "specdec", "*.cuh")):
        text = open(path).read()
        assert "getenv" not in text and "SPECDEC_CUDA_POOL_V2" not in text, path


# ---- on a GPU ----------------------------------------------------------------------------------------

VARIANTS = ["default", "v2", "radix"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOP_PS = [1e-300, 1e-9, 0.3, 0.75, 0.9, 1.0 - 2 ** -40, 1.0]


def _rows(seed, n, v, dtype, cfg, ties=False, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale
    uncond = torch.randn(n, v, generator=g) * scale if cfg else None
    if ties:
        logits = logits.round()
        uncond = None if uncond is None else uncond.round()
    logits = logits.to(dtype)
    uncond = None if uncond is None else uncond.to(dtype)
    return logits, uncond, torch.randint(0, v, (n,), generator=g)


def _cuda(t):
    return None if t is None else t.cuda()


def _check(variant, logits, uncond, tokens, neighbors=None, **kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CUDA_POOL", variant)
        got = ops.pool_probs(_cuda(logits), _cuda(tokens), _cuda(neighbors), uncond_logits=_cuda(uncond),
                             backend="cuda", **kw)
        skw = {k: v for k, v in kw.items() if k != "delta"}
        p = ops.sampling_probs(_cuda(logits), uncond_logits=_cuda(uncond), backend="cuda", **skw).cpu()
    want = ref.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, **kw)
    want_p = ref.sampling_probs(logits, uncond_logits=uncond, **skw)
    assert torch.equal(p > 0, want_p > 0), f"{variant}: kept sets differ"
    torch.testing.assert_close(p, want_p, rtol=2e-5, atol=2e-6, equal_nan=True)
    assert torch.equal(got.p_token.cpu() > 0, want.p_token > 0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-5, atol=2e-6, equal_nan=True)
    return p


@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5), v=st.sampled_from([1, 7, 257, 2049, 16384, 65536]),
       dtype=st.sampled_from(DTYPES), cfg=st.booleans(), top_k=st.sampled_from([0, 1, 5, 2000]),
       top_p=st.sampled_from(TOP_PS), ties=st.booleans())
@settings(max_examples=25)
def test_variants_match_the_reference(variant, seed, n, v, dtype, cfg, top_k, top_p, ties):
    # V = 65536 float32 exceeds shared memory: v2 falls back to the default kernel, radix streams.
    logits, uncond, tokens = _rows(seed, n, v, dtype, cfg, ties)
    _check(variant, logits, uncond, tokens, cfg_scale=2.0, temperature=0.9, top_k=top_k, top_p=top_p)


@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_edge_rows(variant):
    v = 300
    logits = torch.randn(6, v) * 3
    logits[0, :] = -math.inf
    logits[0, [3, 200]] = torch.tensor([1.0, 2.0])  # two finite entries
    logits[1, 7] = math.nan
    logits[2, 3] = math.inf
    logits[3, :] = -math.inf
    logits[4] = logits[4].round()  # ties
    tokens = torch.tensor([200, 0, 1, 2, 5, 9])
    neighbors = torch.randint(0, v, (v, 16), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    for kw in (dict(top_k=5), dict(top_k=1), dict(top_k=v), dict(top_p=1e-9), dict(top_p=0.5),
               dict(top_k=5, top_p=0.9, delta=0.2), dict(delta=0.1)):
        p = _check(variant, logits, None, tokens, neighbors, **kw)
        assert torch.isnan(p[1:4]).all() and torch.isfinite(p[[0, 4, 5]]).all()


@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_sample_residual_bit_for_bit(variant, monkeypatch):
    monkeypatch.setenv("SPECDEC_CUDA_POOL", variant)
    for v in (1, 7, 4096, 16384, 100_000):  # 100000 int32 units exceed shared memory: the v1 kernel
        g = torch.Generator().manual_seed(v)
        p = torch.softmax(torch.randn(6, v, generator=g) * 3, 1)
        q = torch.softmax(torch.randn(6, v, generator=g), 1)
        q[0] = p[0]  # zero residual: fallback
        u = torch.rand(6, generator=g)
        for qq in (None, q):
            got = ops.sample_residual(p.cuda(), _cuda(qq), uniforms=u.cuda(), backend="cuda")
            want = ops.sample_residual(p, qq, uniforms=u, backend="reference")
            assert torch.equal(got.tokens.cpu(), want.tokens) and torch.equal(got.fallback.cpu(), want.fallback)


@needs_gpu
def test_variant_argument_is_checked_in_cpp():
    logits = torch.randn(2, 10, device="cuda")
    with pytest.raises(ValueError, match="variant"):
        torch.ops.specdec.sampling_probs_variant(logits, None, 1.0, 1.0, 0, 1.0, 3)
    with pytest.raises(ValueError, match="variant"):
        torch.ops.specdec.pool_probs_variant(logits, torch.zeros(2, dtype=torch.int64, device="cuda"), None, None,
                                             1.0, 1.0, 0, None, 1.0, -1)
    with pytest.raises(ValueError, match="variant"):
        torch.ops.specdec.sample_residual_variant(torch.softmax(logits, 1), None, None, 0, 0, 7)
    for variant in (0, 1, 2):
        torch.library.opcheck(torch.ops.specdec.sampling_probs_variant, (logits, None, 2.0, 0.9, 3, 0.7, variant))
