"""Kernel 3 in Triton: tree-masked attention over a raster-slot KV cache (docs/design.md, "Kernel 3").

FlashAttention-2 forward: one program per (tile of BLOCK_M queries, batch x query head). It
walks the keys in BLOCK_N tiles with an online softmax in base 2 (running max `m`, sum `l`,
unnormalised output `acc`, all float32). Before touching K or V, a tile's positions and validity
are read: if no valid key of the tile is at or before the latest query of the program, the tile
is skipped (causal prefill, holes in the cache and draft blocks far ahead all skip work this way).
Invalid slots load as zeros, so garbage (even NaN) in empty cache slots never reaches the output.

fp16/bf16 dots run on tensor cores (mma/wgmma) on a GPU; fp32 dots use IEEE precision (no TF32).
Under TRITON_INTERPRET=1 every dot is done in fp32 (bf16 dots are broken in the interpreter).

Arguments are validated by `specdec.ops`; these wrappers assume valid, unit-stride-along-D input.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._interpreter import interpreting


_POS_FAR = tl.constexpr(2**62)  # a position later than every real one (int64)
_LN2 = 0.6931471805599453
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(q, q_pos, q_rows, row_mask, lo, hi, b, k_base, v_base, sk_n, sv_n, kv_pos_ptr, valid_ptr,
                 tree_ptr, Nq, Nk, words, scale_log2, offs_d, d_mask,
                 HAS_VALID: tl.constexpr, HAS_TREE: tl.constexpr, DOT_FP32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax of the program's rows over key slots [lo, hi): returns the running max
    m (base 2), sum l and unnormalised output acc. `q_rows` is each row's query index (its
    tree-mask row); rows outside `row_mask` are padding."""
    q_last = tl.max(q_pos, axis=0)
    block_start = Nk - Nq  # first key slot of the draft block
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        kv_pos = tl.load(kv_pos_ptr + b * Nk + offs_n, mask=in_range, other=_POS_FAR).to(tl.int64)
        ok = in_range
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + b * Nk + offs_n, mask=in_range, other=0) != 0)
        first_key = tl.min(tl.where(ok, kv_pos, _POS_FAR), axis=0)
        if first_key <= q_last:  # otherwise no query of this program sees any key of the tile
            kv_mask = ok[:, None] & d_mask[None, :]
            k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
            visible = ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
            if HAS_TREE:
                col = offs_n - block_start
                in_block = col >= 0
                safe = tl.where(in_block, col, 0)
                word = tl.load(tree_ptr + (b * Nq + q_rows[:, None]) * words + safe[None, :] // 32,
                               mask=row_mask[:, None] & (in_block & in_range)[None, :], other=0)
                bit = ((word >> (safe % 32).to(tl.int32)[None, :]) & 1) != 0
                visible = visible & (bit | (col < 0)[None, :])
            s = tl.where(visible, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A query that has seen nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if DOT_FP32:
                acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _normalise(acc, m_i, l_i):
    """(out, lse) of a row's (acc, m, l); a row that saw nothing gets zeros and lse = -inf."""
    seen = l_i != 0.0      # (!=, not >: a NaN sum stays NaN, as the reference gives)
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, -float("inf"))
    return out, lse


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, q_pos_ptr, kv_pos_ptr, valid_ptr, tree_ptr, out_ptr, lse_ptr,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    Hq, group, Nq, Nk, D, words, scale_log2,
    HAS_VALID: tl.constexpr, HAS_TREE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < Nq
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = tl.load(q_pos_ptr + b * Nq + offs_m, mask=m_mask, other=-_POS_FAR).to(tl.int64)
    k_base = k_ptr + b.to(tl.int64) * sk_b + hk * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + hk * sv_h
    m_i, l_i, acc = _attend_keys(q, q_pos, offs_m, m_mask, 0, Nk, b, k_base, v_base, sk_n, sv_n, kv_pos_ptr,
                                 valid_ptr, tree_ptr, Nq, Nk, words, scale_log2, offs_d, d_mask,
                                 HAS_VALID, HAS_TREE, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_D)
    out, lse = _normalise(acc, m_i, l_i)
    row = pid_bh.to(tl.int64) * Nq + offs_m
    tl.store(out_ptr + row[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row, lse, mask=m_mask)



def _launch_config(nq: int, d: int, *, fp32_dots: bool, tree: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps): the largest tiles whose program still fits in
    registers on sm_90a. ptxas spills whatever does not fit to local memory, and that decides the
    speed: on an H200 the float32 verification shape ran 8.9 ms at 64x64 tiles (9.8 KB of stack
    per thread). IEEE float32 dots are FMA loops that hold their operands in registers, so they
    take smaller tiles than tensor-core dots; the packed tree mask costs a 16-bit program its
    64-wide key tile. tests/kernels/test_build.py lowers these configs and fails any that spills."""
    block_d = max(16, triton.next_power_of_2(d))
    if fp32_dots:
        block_m = min(32, max(16, triton.next_power_of_2(nq)))
        if block_d >= 128:
            block_n = 16
        elif block_m == 16 and block_d <= 32:
            block_n = 64
        else:
            block_n = 32
    else:
        block_m = min(64, max(16, triton.next_power_of_2(nq)))
        block_n = 32 if tree or block_d >= 128 else 64
    num_warps = 8 if block_d >= 128 else 4
    return block_m, block_n, block_d, num_warps


def _setup(q, q_pos, kv_pos, kv_valid, tree_mask, scale):
    """What both wrappers launch with: the outputs (out, lse), the score scale in base 2, the
    positions and masks as the kernels read them (a mask that is absent is replaced by any
    pointer; its HAS_* flag keeps it unread), and whether dots run in float32."""
    b, hq, nq, d = q.shape
    out = torch.empty((b, hq, nq, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kv_pos = kv_pos.contiguous()
    valid = kv_valid.contiguous().view(torch.uint8) if kv_valid is not None else kv_pos
    tree = tree_mask.contiguous() if tree_mask is not None else kv_pos
    fp32_dots = interpreting() or q.dtype == torch.float32
    return out, lse, float(scale) * _LOG2E, q_pos.contiguous(), kv_pos, valid, tree, fp32_dots


def tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale):
    """Returns (out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] float32)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    out, lse, scale_log2, q_pos, kv_pos, valid, tree, fp32_dots = _setup(q, q_pos, kv_pos, kv_valid, tree_mask, scale)
    if out.numel() == 0:
        return out, lse
    block_m, block_n, block_d, num_warps = _launch_config(nq, d, fp32_dots=fp32_dots, tree=tree_mask is not None)
    grid = (triton.cdiv(nq, block_m), b * hq)
    _tree_attention_kernel[grid](
        q, k, v, q_pos, kv_pos, valid, tree, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        hq, hq // hkv, nq, nk, d, (nq + 31) // 32, scale_log2,
        HAS_VALID=kv_valid is not None, HAS_TREE=tree_mask is not None,
        DOT_FP32=fp32_dots,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=_NUM_STAGES,
    )
    return out, lse


_NUM_STAGES = 2


# ---------------------------------------------------------------------------------------------
# The decode path (opt-in, see specdec.ops.tree_attention and SPECDEC_ATTN_PATH): flash-decoding.
#
# At the decoders' shapes (1-80 queries per head, hundreds to thousands of keys) the kernel above
# runs one program per (query tile, batch x head): B * Hq programs of mostly empty tiles, far too
# few for a GPU's 132 multiprocessors. Here
#   - the query heads of one GQA group are packed into the M dimension: row r of a program is
#     query i = r // group of head hk * group + r % group, so one K/V tile load serves the whole
#     group and a 1-query step of a group of 4 fills 4 rows instead of 1;
#   - the key range is split across programs (grid axis 2): each split keeps its own online
#     softmax and writes an unnormalised partial (acc, m, l); a second small kernel merges the
#     splits by their log-sum-exp. With one split the first kernel normalises and stores itself.
# Same visibility rule, tile skipping and zero-for-invalid loads as the kernel above.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_pos_ptr, kv_pos_ptr, valid_ptr, tree_ptr, out_ptr, lse_ptr,
    part_o_ptr, part_m_ptr, part_l_ptr,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    Hq, Hkv, group, Nq, Nk, D, words, scale_log2, split_len, rows_total,
    HAS_VALID: tl.constexpr, HAS_TREE: tl.constexpr, DOT_FP32: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bk = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bk // Hkv
    hk = pid_bk % Hkv

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # packed (query, head of the group) rows
    r_mask = offs_r < Nq * group
    qi = offs_r // group
    h = hk * group + offs_r % group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + h[:, None] * sq_h + qi[:, None] * sq_n + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = tl.load(q_pos_ptr + b * Nq + qi, mask=r_mask, other=-_POS_FAR).to(tl.int64)
    k_base = k_ptr + b.to(tl.int64) * sk_b + hk * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + hk * sv_h
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, Nk)
    m_i, l_i, acc = _attend_keys(q, q_pos, qi, r_mask, lo, hi, b, k_base, v_base, sk_n, sv_n, kv_pos_ptr,
                                 valid_ptr, tree_ptr, Nq, Nk, words, scale_log2, offs_d, d_mask,
                                 HAS_VALID, HAS_TREE, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_D)

    row = (b.to(tl.int64) * Hq + h) * Nq + qi   # the row of out [B, Hq, Nq] this packed row is
    out_mask = r_mask[:, None] & d_mask[None, :]
    if SINGLE:
        out, lse = _normalise(acc, m_i, l_i)
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_ptr + row, lse, mask=r_mask)
    else:
        part = pid_s * rows_total + row
        tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part, m_i, mask=r_mask)
        tl.store(part_l_ptr + part, l_i, mask=r_mask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, lse_ptr, rows_total, D, splits,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s (base-2 scores)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rows_total
    offs_d = tl.arange(0, BLOCK_D)
    mask = r_mask[:, None] & (offs_d < D)[None, :]
    m_all = tl.full([BLOCK_R], -float("inf"), tl.float32)
    for s in range(0, splits):
        m_all = tl.maximum(m_all, tl.load(part_m_ptr + s * rows_total + offs_r, mask=r_mask, other=-float("inf")))
    m_sub = tl.where(m_all == -float("inf"), 0.0, m_all)  # a row no split saw: weights 0, not NaN
    l_all = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(0, splits):
        part = s * rows_total + offs_r
        w = tl.exp2(tl.load(part_m_ptr + part, mask=r_mask, other=-float("inf")) - m_sub)
        l_all += w * tl.load(part_l_ptr + part, mask=r_mask, other=0.0)
        acc += w[:, None] * tl.load(part_o_ptr + part.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask,
                                    other=0.0)
    out, lse = _normalise(acc, m_all, l_all)
    tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(lse_ptr + offs_r, lse, mask=r_mask)


def _decode_config(rows: int, d: int, *, fp32_dots: bool, tree: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of the split-KV program: the key tiles of
    `_launch_config`, at most 32 packed rows (16 for float32 dots). Packed rows need their own
    query and tree-mask addresses (no longer an arange), which cost the 64-row 16-bit programs
    48-464 B of spills on sm_90a; the splits, not the row tiles, fill the GPU on this path."""
    block_m = min(16 if fp32_dots else 32, max(16, triton.next_power_of_2(rows)))
    _, block_n, block_d, num_warps = _launch_config(block_m, d, fp32_dots=fp32_dots, tree=tree)
    return block_m, block_n, block_d, num_warps


def tree_attention_split_kv(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale, num_splits=None,
                            choose_splits=None):
    """The decode path: returns (out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] float32).
    `num_splits` None asks `choose_splits(programs, keys, keys_per_step)`, the caller's policy
    (specdec.ops.attention.split_count), given this launcher's own tiles (one split without
    one); tests pass `num_splits` to cover splits that do not divide the key range."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    out, lse, scale_log2, q_pos, kv_pos, valid, tree, fp32_dots = _setup(q, q_pos, kv_pos, kv_valid, tree_mask, scale)
    if out.numel() == 0:
        return out, lse
    rows = nq * group
    block_m, block_n, block_d, num_warps = _decode_config(rows, d, fp32_dots=fp32_dots, tree=tree_mask is not None)
    m_tiles = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = 1 if choose_splits is None else choose_splits(m_tiles * b * hkv, nk, block_n)
    # Splits are whole key tiles (a split past the end of the keys would see nothing), at most
    # 65535 of them (CUDA's limit on grid axis 2).
    num_splits = min(num_splits, 65535)
    split_len = triton.cdiv(triton.cdiv(max(nk, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(nk, split_len))
    rows_total = b * hq * nq
    single = num_splits == 1
    if single:
        part_o = part_m = part_l = lse  # unused
    else:
        part_o = torch.empty((num_splits, rows_total, d), device=q.device, dtype=torch.float32)
        part_m = torch.empty((num_splits, rows_total), device=q.device, dtype=torch.float32)
        part_l = torch.empty((num_splits, rows_total), device=q.device, dtype=torch.float32)
    _split_kv_kernel[(m_tiles, b * hkv, num_splits)](
        q, k, v, q_pos, kv_pos, valid, tree, out, lse, part_o, part_m, part_l,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        hq, hkv, group, nq, nk, d, (nq + 31) // 32, scale_log2, split_len, rows_total,
        HAS_VALID=kv_valid is not None, HAS_TREE=tree_mask is not None, DOT_FP32=fp32_dots, SINGLE=single,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=_NUM_STAGES,
    )
    if not single:
        block_r = _MERGE_ROWS
        _merge_splits_kernel[(triton.cdiv(rows_total, block_r),)](
            part_o, part_m, part_l, out, lse, rows_total, d, num_splits,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out, lse


_MERGE_ROWS = 16


def _lowering_specs():
    """(kernel, signature, constexprs, options) that tests/kernels/test_build.py lowers to sm_90a: the
    launch configs of the shapes that matter (one query; a 1024-query verification block) at
    each head dim, for 16-bit and float32 dots, with every mask input present."""
    specs = []
    for dtype in ("bf16", "fp32"):
        signature = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "q_pos_ptr": "*i64",
                     "kv_pos_ptr": "*i64", "valid_ptr": "*u8", "tree_ptr": "*i32", "out_ptr": f"*{dtype}",
                     "lse_ptr": "*fp32", "sq_b": "i32", "sq_h": "i32", "sq_n": "i32", "sk_b": "i32",
                     "sk_h": "i32", "sk_n": "i32", "sv_b": "i32", "sv_h": "i32", "sv_n": "i32",
                     "Hq": "i32", "group": "i32", "Nq": "i32", "Nk": "i32", "D": "i32", "words": "i32",
                     "scale_log2": "fp32", "HAS_VALID": "constexpr", "HAS_TREE": "constexpr",
                     "DOT_FP32": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                     "BLOCK_D": "constexpr"}
        for d in (32, 64, 128):
            for nq in (1, 1024):
                for masks in (False, True):   # no masks, or kv_valid and a tree mask both
                    block_m, block_n, block_d, num_warps = _launch_config(nq, d, fp32_dots=dtype == "fp32",
                                                                          tree=masks)
                    constexprs = {"HAS_VALID": masks, "HAS_TREE": masks, "DOT_FP32": dtype == "fp32",
                                  "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d}
                    specs.append((_tree_attention_kernel, signature, constexprs,
                                  {"num_warps": num_warps, "num_stages": _NUM_STAGES}))
        # The decode path: 4 and 64 packed rows (one query of a 4-head group; a 16-query window
        # of a 4-head group), partial outputs (SINGLE=False) or the direct store.
        split_sig = dict(signature, part_o_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", Hkv="i32",
                         split_len="i32", rows_total="i32", SINGLE="constexpr")
        split_sig = {n: split_sig[n] for n in _split_kv_kernel.arg_names}
        for d in (32, 64, 128):
            for rows in (4, 64):   # 64 packed rows run as two 32-row tiles
                for masks in (False, True):
                    block_m, block_n, block_d, num_warps = _decode_config(rows, d, fp32_dots=dtype == "fp32",
                                                                          tree=masks)
                    constexprs = {"HAS_VALID": masks, "HAS_TREE": masks, "DOT_FP32": dtype == "fp32",
                                  "SINGLE": masks, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d}
                    spec = (_split_kv_kernel, split_sig, constexprs, {"num_warps": num_warps,
                                                                      "num_stages": _NUM_STAGES})
                    if spec not in specs:  # float32 runs both row counts as one 16-row config
                        specs.append(spec)
    merge_sig = {"part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16",
                 "lse_ptr": "*fp32", "rows_total": "i32", "D": "i32", "splits": "i32",
                 "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    for block_d in (32, 64, 128):
        specs.append((_merge_splits_kernel, merge_sig, {"BLOCK_R": _MERGE_ROWS, "BLOCK_D": block_d},
                      {"num_warps": 4}))
    return specs


LOWERING_SPECS = _lowering_specs()
