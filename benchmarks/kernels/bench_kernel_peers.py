"""specdec's kernels against what a user would run instead (docs/design.md, "How speed is
shown"), on the same inputs in the same run:

- pool_probs, sampling_probs, sample_residual and tree_attention against torch.compile of their
  reference (specdec.reference.*: the code a user gets by compiling the definition; inductor
  emits fused, vectorised C++ on a CPU and Triton on a GPU);
- tree_attention also against SDPA with a dense boolean mask and torch.compile(flex_attention);
- on a GPU where `flashinfer` imports, against FlashInfer's softmax / top-k and top-p renorm
  (sampling_probs), sampling_from_probs (sample_residual without q) and
  top_k_top_p_sampling_from_logits (logits to a token: specdec's sampling_probs + sample_residual).

Shapes (SPECDEC_PEERS=full, the default): N in {1, 64, 1024} rows x V in {16384, 32768, 65536}
x top_k in {0, 2000} x top_p in {1.0, 0.9} x CFG on (scale 4) / off; pool_probs with K = 1000
random neighbours per token and delta = 0.4; sample_residual with q (SSD's residual) and without
(MuLo-SD: p itself). SPECDEC_PEERS=headline keeps N 1024, V 16384, CFG on (the issue's bar).
Logits are float32, the dtype the decoders pass and the reference computes in. specdec is timed
through its public ops (specdec.ops.*, what a user calls: the argument checks, and the value
checks that ride in the kernels, included). Each run's record names the machine it ran on, the
CPU model included (machine_info.specdec_device).

Timing: pytest-benchmark, one entry per (case, peer); each timed round of an entry is preceded
by one call of every other peer of its case (pedantic's setup), so the peers of a case run
interleaved on the same inputs, and each entry's median is taken among the others'. The
compiled reference is each group's baseline (make_results.py: speed-up = its median / the
entry's). CPU threads: SPECDEC_BENCH_THREADS (default 2), set for this module only.

torch.compile: one torch.compile(fn, dynamic=True) callable per op, reused for every shape (the
recompile limit is raised so that its guards' branches, CFG on/off, top-k on/off, each top_p,
N = 1, stay compiled instead of falling back to eager); the first call of each case compiles
outside the timed rounds.

Every entry records the bytes the op must move (logits read once, the neighbour ids of each
token, outputs written), the achieved GB/s and its share of the machine's copy bandwidth
measured in this run with the same thread count (machine/device_limits.py); attention entries also
GFLOP/s (dense-equivalent) and the share of the float32 (CPU) / bf16 (GPU) matrix rate.

    python benchmarks/run.py --peers     # results/peers-<machine>-<date>.json, then RESULTS.md
"""
import gc
import os
import warnings

import pytest
import torch

from specdec import ops
from bench_helpers import attention_inputs, bench_devices, record_device_time, synchronize

from machine import device_limits

DEVICE = bench_devices()[0]
THREADS = int(os.environ.get("SPECDEC_BENCH_THREADS", "2"))
SCOPE = os.environ.get("SPECDEC_PEERS", "full")
GROUP = "kernel peers"
CFG_SCALE = 4.0
K_NEIGHBORS = 1000
DELTA = 0.4
LOGITS_DTYPE = torch.float32

if SCOPE == "headline":
    ROWS, VOCABS, CFGS = [1024], [16384], [True]
else:
    ROWS, VOCABS, CFGS = [1, 64, 1024], [16384, 32768, 65536], [True, False]
TOP_KS, TOP_PS = [0, 2000], [1.0, 0.9]

# (op, n, v, top_k, top_p, cfg); grouped by (n, v) so that one set of inputs lives at a time.
POOL_CASES = [(op, n, v, k, p, c) for n in ROWS for v in VOCABS for c in CFGS for k in TOP_KS for p in TOP_PS
              for op in ("pool_probs", "sampling_probs")]
RESIDUAL_CASES = [("sample_residual", n, v, q) for n in ROWS for v in VOCABS for q in (True, False)]
# tree_attention: (name, B, Hq, Hkv, Nq, Nk, D, holes): the 2 x 4 heads, 256 queries over
# 1,280 keys with holes in the cache; a one-token decode step; a 64-query window over 4096 slots.
ATTENTION_CASES = [
    ("B2 H4 D32 Nq256 Nk1280 holes", 2, 4, 4, 256, 1280, 32, True),
    ("B2 H4 D32 Nq1 Nk1280", 2, 4, 4, 1, 1280, 32, False),
    ("B2 H16 D64 Nq64 Nk4096 holes", 2, 16, 16, 64, 4096, 64, True),
]
if SCOPE == "headline":
    ATTENTION_CASES = ATTENTION_CASES[:1]


def _case_id(case):
    op, n, v = case[:3]
    if op == "sample_residual":
        return f"{op} N{n} V{v} {'q' if case[3] else 'no-q'}"
    _, _, _, k, p, cfg = case
    return f"{op} N{n} V{v} top_k={k} top_p={p} {'cfg' if cfg else 'no-cfg'}"


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        import torch._dynamo.config as dynamo_config

        limit = getattr(dynamo_config, "recompile_limit", None)
        if limit is not None:
            dynamo_config.recompile_limit = max(limit, 64)
    except ImportError:
        pass
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def limits(_threads):
    """The machine's ceilings, measured once per run with the benchmark's thread count."""
    if DEVICE == "cuda":
        return device_limits.measure()
    return device_limits.measure_cpu()


# ---- inputs: one set alive at a time (N 1024 x V 65536 with CFG is 512 MiB of logits) -------------

_INPUTS = {}


def _cached(key, make):
    if key not in _INPUTS:
        _INPUTS.clear()
        gc.collect()
        _INPUTS[key] = make()
    return _INPUTS[key]


def _logits_inputs(n, v):
    def make():
        g = torch.Generator().manual_seed(n * 7919 + v)
        logits = (torch.randn(n, v, generator=g) * 3).to(LOGITS_DTYPE)
        uncond = (torch.randn(n, v, generator=g) * 3).to(LOGITS_DTYPE)
        tokens = torch.randint(0, v, (n,), generator=g)
        # A random table has the memory traffic of a real k-NN table (knn_table over a 65536-entry
        # codebook is not what is measured).
        neighbors = torch.randint(0, v, (v, K_NEIGHBORS), generator=g, dtype=torch.int32)
        return tuple(t.to(DEVICE) for t in (logits, uncond, tokens, neighbors))
    return _cached(("logits", n, v), make)


def _prob_inputs(n, v):
    def make():
        g = torch.Generator().manual_seed(n * 104729 + v)
        p = torch.softmax(torch.randn(n, v, generator=g) * 3, 1)
        q = torch.softmax(torch.randn(n, v, generator=g) * 3, 1)
        u = torch.rand(n, generator=g)
        return tuple(t.to(DEVICE) for t in (p, q, u))
    return _cached(("probs", n, v), make)


# ---- the peers -------------------------------------------------------------------------------------

_COMPILED = {}


def _compiled(name, fn):
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _pool_reference(logits, tokens, neighbors, uncond, top_k, top_p):
    from specdec.reference import pooling

    return pooling.pool_probs(logits, tokens, neighbors, uncond_logits=uncond, cfg_scale=CFG_SCALE,
                              temperature=1.0, top_k=top_k, delta=DELTA, top_p=top_p)


def _sampling_reference(logits, uncond, top_k, top_p):
    from specdec.reference import pooling

    return pooling.sampling_probs(logits, uncond_logits=uncond, cfg_scale=CFG_SCALE, temperature=1.0,
                                  top_k=top_k, top_p=top_p)


def _residual_reference(p, q, u):
    from specdec.reference import verification

    return verification.sample_residual(p, q, u)


def _flashinfer():
    if DEVICE != "cuda":
        return None
    try:
        import flashinfer.sampling as fs  # noqa: F401

        return fs
    except Exception:  # noqa: BLE001  (not installed, or no build for this GPU)
        return None


def _specdec_backends():
    import specdec

    found = specdec.available_backends(torch.device(DEVICE))
    if DEVICE == "cpu":
        return ["cpu"] if "cpu" in found else []
    return [b for b in ("cuda", "triton") if b in found]


def _pool_peers(case):
    """{peer name: zero-argument callable} of one pool_probs / sampling_probs case."""
    op, n, v, top_k, top_p, cfg = case
    logits, uncond, tokens, neighbors = _logits_inputs(n, v)
    un = uncond if cfg else None
    scale = CFG_SCALE if cfg else 1.0
    peers = {}
    for backend in _specdec_backends():
        if op == "pool_probs":
            if backend == "triton":
                continue  # the Triton kernels are reached through specdec.ops; timed in bench_pool_probs
            peers[f"specdec {backend}"] = lambda backend=backend: ops.pool_probs(
                logits, tokens, neighbors, uncond_logits=un, cfg_scale=scale, top_k=top_k, delta=DELTA, top_p=top_p,
                backend=backend)
        elif backend != "triton":
            peers[f"specdec {backend}"] = lambda backend=backend: ops.sampling_probs(
                logits, uncond_logits=un, cfg_scale=scale, top_k=top_k, top_p=top_p, backend=backend)
    if op == "pool_probs":
        fn = _compiled("pool_probs", _pool_reference)
        peers["torch.compile(reference)"] = lambda: fn(logits, tokens, neighbors, un, top_k, top_p)
    else:
        fn = _compiled("sampling_probs", _sampling_reference)
        peers["torch.compile(reference)"] = lambda: fn(logits, un, top_k, top_p)
        fs = _flashinfer()
        if fs is not None:
            def flashinfer_probs():
                from specdec.reference import pooling

                guided = pooling.guided_logits(logits, un, scale, 1.0) if cfg else logits
                probs = fs.softmax(guided)
                if top_k > 0:
                    probs = fs.top_k_renorm_probs(probs, top_k)
                if top_p < 1.0:
                    probs = fs.top_p_renorm_probs(probs, top_p)
                return probs
            peers["flashinfer softmax+renorm"] = flashinfer_probs
    return peers


def _residual_peers(case):
    _, n, v, with_q = case
    p, q, u = _prob_inputs(n, v)
    qq = q if with_q else None
    peers = {}
    for backend in _specdec_backends():
        if backend != "triton":
            peers[f"specdec {backend}"] = lambda backend=backend: ops.sample_residual(p, qq, uniforms=u,
                                                                                      backend=backend)
    fn = _compiled("sample_residual", _residual_reference)
    peers["torch.compile(reference)"] = lambda: fn(p, qq, u)
    fs = _flashinfer()
    if fs is not None and not with_q:
        peers["flashinfer sampling_from_probs"] = lambda: fs.sampling_from_probs(p)
    return peers


def _attention_inputs(case):
    name, b, hq, hkv, nq, nk, d, holes = case
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return attention_inputs(b, hq, hkv, nq, nk, d, dtype=dtype, holes=holes, device=DEVICE)


def _attention_peers(case):
    from specdec import masks
    from specdec.reference import attention as ref_attention

    name, b, hq, hkv, nq, nk, d, holes = case
    key = ("attention", name)
    if key not in _INPUTS:
        _INPUTS.clear()
        t = _attention_inputs(case)
        dense = masks.visibility(t["q_pos"], t["kv_pos"], t["kv_valid"])  # [B, Nq, Nk]
        t["dense"] = dense[:, None]
        _INPUTS[key] = t
    t = _INPUTS[key]
    peers = {}
    for backend in _specdec_backends():
        peers[f"specdec {backend}"] = lambda backend=backend: ops.tree_attention(
            t["q"], t["k"], t["v"], q_pos=t["q_pos"], kv_pos=t["kv_pos"], kv_valid=t["kv_valid"], backend=backend)

    def sdpa():
        # A query that sees no key gives NaN here (a fully masked row); every query sees itself.
        return torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["dense"],
                                                                enable_gqa=hq != hkv)
    peers["sdpa dense mask"] = sdpa
    try:
        from torch.nn.attention import flex_attention as flex

        mask_mod = masks.flex_mask_mod(t["q_pos"], t["kv_pos"], t["kv_valid"], None)
        if "block_mask" not in t:
            t["block_mask"] = flex.create_block_mask(mask_mod, b, None, nq, nk, device=DEVICE)
        if "flex_attention" not in _COMPILED:  # static shapes, as bench_attention.py compiles it
            _COMPILED["flex_attention"] = torch.compile(flex.flex_attention, dynamic=False)
        flex_fn = _COMPILED["flex_attention"]

        def flex_compiled():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return flex_fn(t["q"], t["k"], t["v"], block_mask=t["block_mask"], enable_gqa=hq != hkv)
        peers["torch.compile(flex_attention)"] = flex_compiled
    except Exception:  # noqa: BLE001  (flex unavailable in this torch)
        pass

    def reference(q, k, v, q_pos, kv_pos, kv_valid):
        return ref_attention.tree_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid)
    ref_fn = _compiled("tree_attention", reference)
    peers["torch.compile(reference)"] = lambda: ref_fn(t["q"], t["k"], t["v"], t["q_pos"], t["kv_pos"], t["kv_valid"])
    return peers


# ---- timing ----------------------------------------------------------------------------------------

def _rounds(n):
    return 5 if n >= 1024 else (10 if n >= 64 else 20)


def _median_s(benchmark):
    extra = benchmark.extra_info
    if extra.get("device_median_s"):
        return extra["device_median_s"]
    return benchmark.stats.stats.median


def _time_peer(benchmark, peers, peer, rounds, info, limits):
    if peer not in peers:
        pytest.skip(f"{peer}: not available here")
    fn = peers[peer]
    try:
        fn()  # compile (first call) outside the timed rounds
        synchronize(DEVICE)
    except Exception as exc:  # noqa: BLE001  (a peer that cannot run this case here)
        pytest.skip(f"{peer}: {type(exc).__name__}: {str(exc)[:300]}")
    others = []
    for name, other in peers.items():
        if name == peer:
            continue
        try:
            other()
            synchronize(DEVICE)
            others.append(other)
        except Exception:  # noqa: BLE001  (its own entry reports the failure)
            pass

    def run():
        out = fn()
        synchronize(DEVICE)
        return out

    def setup():  # one call of every other peer of the case before each timed round: interleaved
        for other in others:
            other()
        synchronize(DEVICE)

    benchmark.group = f"{GROUP} {info.pop('case')}"
    benchmark.extra_info.update(info)
    benchmark.extra_info["backend"] = peer
    benchmark.extra_info["device"] = DEVICE
    benchmark.extra_info["threads"] = torch.get_num_threads() if DEVICE == "cpu" else None
    if peer == "torch.compile(reference)":
        benchmark.extra_info["baseline"] = True
    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=1, iterations=1)
    record_device_time(benchmark, run, DEVICE)
    seconds = _median_s(benchmark)
    gbs = info["bytes"] / seconds / 1e9
    benchmark.extra_info["gbs"] = round(gbs, 2)
    copy = limits.get("copy_bandwidth_gbs")
    if copy:
        benchmark.extra_info["copy_bandwidth_gbs"] = copy
        benchmark.extra_info["copy_share"] = round(gbs / copy, 3)
    if "flops" in info:
        gflops = info["flops"] / seconds / 1e9
        benchmark.extra_info["gflops"] = round(gflops, 1)
        rate = limits.get("fp32_matmul_gflops") or (limits.get("bf16_matmul_tflops") or 0) * 1e3
        if rate:
            benchmark.extra_info["matmul_share"] = round(gflops / rate, 3)


def _peer_names(kind):
    """The peers timed for one kind of case on this machine (collected, so no skipped entries)."""
    ours = [f"specdec {b}" for b in _specdec_backends()]
    if kind != "attention":
        ours = [name for name in ours if name != "specdec triton"]
    names = ours + ["torch.compile(reference)"]
    if kind == "attention":
        names += ["sdpa dense mask", "torch.compile(flex_attention)"]
    elif _flashinfer() is not None:
        names += ["flashinfer softmax+renorm"] if kind == "pool" else ["flashinfer sampling_from_probs"]
    return names


@pytest.mark.parametrize("peer", _peer_names("pool"))
@pytest.mark.parametrize("case", POOL_CASES, ids=[_case_id(c) for c in POOL_CASES])
def test_pool_peers(benchmark, case, peer, limits):
    op, n, v, top_k, top_p, cfg = case
    peers = _pool_peers(case)
    item = 4  # float32 logits
    read = n * v * item * (2 if cfg else 1)
    if op == "pool_probs":
        nbytes = read + n * K_NEIGHBORS * 4 + n * 8 + 4 * n * 4  # + neighbour ids, tokens, 4 outputs
    else:
        nbytes = read + n * v * 4  # + the probability rows written
    info = dict(case=_case_id(case), op=op, n=n, v=v, top_k=top_k, top_p=top_p, cfg=cfg, dtype="float32",
                bytes=nbytes, k=K_NEIGHBORS if op == "pool_probs" else None,
                delta=DELTA if op == "pool_probs" else None)
    _time_peer(benchmark, peers, peer, _rounds(n), info, limits)


@pytest.mark.parametrize("peer", _peer_names("residual"))
@pytest.mark.parametrize("case", RESIDUAL_CASES, ids=[_case_id(c) for c in RESIDUAL_CASES])
def test_residual_peers(benchmark, case, peer, limits):
    _, n, v, with_q = case
    peers = _residual_peers(case)
    nbytes = n * v * 4 * (2 if with_q else 1) + n * 4 + n * 4 + n  # p (and q), uniforms, tokens, fallback
    info = dict(case=_case_id(case), op="sample_residual", n=n, v=v, q=with_q, bytes=nbytes)
    _time_peer(benchmark, peers, peer, _rounds(n), info, limits)


@pytest.mark.parametrize("peer", _peer_names("attention"))
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_peers(benchmark, case, peer, limits):
    name, b, hq, hkv, nq, nk, d, holes = case
    peers = _attention_peers(case)
    item = 2 if DEVICE == "cuda" else 4
    nbytes = (2 * b * hq * nq * d + 2 * b * hkv * nk * d) * item + b * nk * 9 + b * nq * 8  # q, out, k, v, positions
    info = dict(case=f"tree_attention {name}", op="tree_attention", bytes=nbytes, flops=4 * b * hq * nq * nk * d,
                dtype="bfloat16" if DEVICE == "cuda" else "float32")
    _time_peer(benchmark, peers, peer, 5 if nq > 1 else 20, info, limits)
