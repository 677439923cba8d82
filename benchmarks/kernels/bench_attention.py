"""Kernel 3 (tree_attention) per backend against the reference and against
torch.compile(flex_attention), at verification shapes and at the tiny-GPT shapes of the demo.

The flex entry is named "flex_compiled": the same rule as a FlexAttention mask_mod, compiled
by torch (its first call compiles for several seconds; pytest-benchmark's warm-up absorbs it).

A pytest-benchmark file: run it through run.py (run directly, its `import bench_helpers` fails):

    python benchmarks/run.py -k attention
"""
import warnings

import pytest
import torch

from bench_helpers import attention_inputs, backend_params, bench_devices, record_device_time, synchronize
from specdec import masks, ops

SHAPES = [
    # (name, B, Hq, Hkv, Nq, Nk, D, tree): chunked verification of 1024 drafted tokens after a
    # 256-token prefix; 64 drafted tokens over a 4096-slot cache (64x64 image) with holes; a
    # 63-node draft tree; the embedded tiny GPT (decode step, full prefill); and the default
    # family's decoding calls, one image with CFG (AR's one-token step, an SSD row window).
    ("verify B2 H16 D64 Nq1024 Nk1280", 2, 16, 16, 1024, 1280, 64, False),
    ("verify B2 H16 D64 Nq64 Nk4096 holes", 2, 16, 16, 64, 4096, 64, False),
    ("tree B2 H16 D64 Nq64 Nk4096", 2, 16, 16, 64, 4096, 64, True),
    ("tinygpt decode B20 H8 D32 Nq1 Nk300", 20, 8, 8, 1, 300, 32, False),
    ("tinygpt prefill B4 H4 D32 Nq256 Nk256", 4, 4, 4, 256, 256, 32, False),
    ("default ar step B2 H4 D32 Nq1 Nk200", 2, 4, 4, 1, 200, 32, False),
    ("default ssd window B2 H4 D32 Nq16 Nk200", 2, 4, 4, 16, 200, 32, False),
]
if torch.cuda.is_available():
    # What a LlamaGen-class model runs on a GPU: bf16 activations, so tensor-core dots (fp32
    # inputs take IEEE fp32 dots by the contract). Not timed on CPUs, which lack the units.
    SHAPES += [("verify B2 H16 D64 Nq1024 Nk1280 bf16", 2, 16, 16, 1024, 1280, 64, False),
               ("tree B2 H16 D64 Nq64 Nk4096 bf16", 2, 16, 16, 64, 4096, 64, True),
               # The decoders' calls at LlamaGen scale: one token over a long cache
               # with GQA, an SSD-style 16-query window, an 80-query MuLo-SD window.
               ("decode B2 H16 Hkv4 D64 Nq1 Nk2048 bf16", 2, 16, 4, 1, 2048, 64, False),
               ("window B2 H16 D64 Nq16 Nk1024 bf16", 2, 16, 16, 16, 1024, 64, False),
               ("window B2 H16 D64 Nq80 Nk4096 holes bf16", 2, 16, 16, 80, 4096, 64, False)]


def _inputs(shape, device):
    name, b, hq, hkv, nq, nk, d, tree = shape
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    return attention_inputs(b, hq, hkv, nq, nk, d, dtype=dtype, holes="holes" in name, tree=tree, device=device)


def _flops(shape):
    _, b, hq, _, nq, nk, d, _ = shape
    return 4 * b * hq * nq * nk * d  # QK^T and PV over all pairs (dense-equivalent)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("device,backend", backend_params())
def test_tree_attention(benchmark, shape, device, backend):
    _time_backend(benchmark, shape, device, backend, label=backend)


def _time_backend(benchmark, shape, device, backend, *, label):
    p = _inputs(shape, device)

    def run():
        out = ops.tree_attention(p["q"], p["k"], p["v"], q_pos=p["q_pos"], kv_pos=p["kv_pos"],
                                 kv_valid=p["kv_valid"], tree_mask=p["tree_mask"], backend=backend)
        synchronize(device)
        return out

    benchmark.group = f"tree_attention {shape[0]}"
    benchmark.extra_info["backend"] = label
    benchmark.extra_info["device"] = device
    benchmark.extra_info["flops"] = _flops(shape)
    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    record_device_time(benchmark, run, device)


def _tiles_before_fit(nq, d, *, fp32_dots, tree):
    """The Triton kernel's tiles before the register-fit rule of 2026-11-30 (the H200 figures of
    that date were taken with them): 64x64 (64x32 at D=128), 4 warps, whatever the dtype."""
    import triton

    block_d = max(16, triton.next_power_of_2(d))
    return min(64, max(16, triton.next_power_of_2(nq))), 64 if block_d <= 64 else 32, block_d, 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an A/B of tile shapes is a GPU timing")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_tree_attention_triton_tiles_before_fit(benchmark, shape, monkeypatch):
    """Timed beside the current rule in the same run: what the register-fit change did."""
    from specdec.triton_kernels import attention as triton_attention

    monkeypatch.setattr(triton_attention, "_launch_config", _tiles_before_fit)
    _time_backend(benchmark, shape, "cuda", "triton", label="triton, 64x64 tiles (before the fit rule)")


# The opt-in kernels (specdec/ops/attention.py, SPECDEC_ATTN_PATH), none of which has run on a GPU
# yet: timed beside the default kernels and flex at every shape. Triton's "prefill" is its
# default kernel, so not repeated.
OPT_IN_PATHS = [("cuda", "decode"), ("cuda", "prefill"), ("cuda", "auto"), ("triton", "decode"), ("triton", "auto")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the opt-in paths are GPU kernels")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("backend,path", OPT_IN_PATHS, ids=[f"{b}-{p}" for b, p in OPT_IN_PATHS])
def test_tree_attention_opt_in_path(benchmark, shape, backend, path, monkeypatch):
    import specdec

    if backend not in specdec.available_backends(torch.device("cuda")):
        pytest.skip(f"backend {backend} unavailable here")
    monkeypatch.setenv("SPECDEC_ATTN_PATH", path)
    _time_backend(benchmark, shape, "cuda", backend, label=f"{backend}, SPECDEC_ATTN_PATH={path}")


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("device", bench_devices())
def test_tree_attention_flex_compiled(benchmark, shape, device):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    p = _inputs(shape, device)
    _, b, hq, hkv, nq, nk, d, _ = shape
    mask_mod = masks.flex_mask_mod(p["q_pos"], p["kv_pos"], p["kv_valid"], p["tree_mask"])
    block_mask = flex.create_block_mask(mask_mod, b, None, nq, nk, device=device)
    compiled = torch.compile(flex.flex_attention, dynamic=False)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled(p["q"], p["k"], p["v"], block_mask=block_mask, enable_gqa=hq != hkv)
        synchronize(device)
        return out

    try:
        run()  # compile outside the timed rounds (seconds on CPU)
    except Exception as exc:  # noqa: BLE001  (inductor may not support a shape on this machine)
        pytest.skip(f"torch.compile(flex_attention) failed here: {type(exc).__name__}: {exc}")
    benchmark.group = f"tree_attention {shape[0]}"
    benchmark.extra_info["backend"] = "flex_compiled"
    benchmark.extra_info["device"] = device
    benchmark.extra_info["flops"] = _flops(shape)
    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    record_device_time(benchmark, run, device)
