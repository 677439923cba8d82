// Kernel 3 on CUDA, the opt-in paths (specdec/ops/attention.py, SPECDEC_ATTN_PATH): one kernel for
// split-KV decoding and for tensor-core prefill, with the output accumulated in registers.
//
// Rows. The query heads of one GQA group are packed into the M dimension: for (batch b, kv head
// hk), packed row r is query i = r / group of query head hk * group + r % group. A decoding
// step of a 4-head group thus fills 4 rows of a tile instead of 1, and one K/V tile serves the
// whole group. Query-major order keeps a tile's positions together, so causal tile skipping
// still works in prefill.
//
// Blocks. 4 warps; warp w works on rows 16 * (w % WM) .. +15 and on the keys (w / WM) * BN ..
// +BN-1 of each step of WN * BN keys (WM * WN = 4):
//   decode  (WM = 1, WN = 4): 16 rows, 4 warps along the keys (BN 32; 16 for float32);
//   prefill (WM = 4, WN = 1): 64 rows, one key tile of BN 64 (32 for float32).
// Grid: (row tiles, B * Hkv, splits). Split z covers keys [z * split_len, (z + 1) * split_len);
// with more than one split every block writes an unnormalised partial (acc, m, l) in float32 and
// merge_splits_kernel combines them by their log-sum-exp; with one split the block normalises
// and stores itself.
//
// Per step: positions and validity to shared memory; skip the step if no valid key is at or
// before the block's latest query (__syncthreads_or); K (row-major) and V (transposed, so a
// B-fragment is one 32-bit load) to shared memory, in 16-byte loads where D and the strides
// allow, invalid slots as zeros so garbage in empty cache slots never reaches the output; then
// per warp:
//   S = Q K^T  mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate), Q's A-fragments held in
//              registers for the whole kernel; float32: IEEE fmaf dots (the contract: no TF32)
//              written into the same accumulator layout;
//   visibility rule (specdec/attention_math.h), base-2 online softmax on the accumulator
//              fragments (a row's 4 owning lanes reduce by shuffles);
//   O += P V   P re-packed from the S accumulators as A-fragments (the m16n8 C layout of two
//              adjacent key tiles is the m16k16 A layout), O in registers; float32: P through
//              shared memory and fmaf.
// At the end the WN warps that share rows merge their (m, l, O) through shared memory.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "specdec/attention_math.h"
#include "specdec/attention_problem.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kMaxGridZ = 65535;  // CUDA's limit on gridDim.z, where the splits go

struct SplitParams {
  AttentionProblem p;
  int64_t hkv;
  int64_t rows;        // packed rows per (batch, kv head): Nq * group
  int64_t split_len;   // keys per split, a multiple of the keys per step
  int64_t rows_total;  // B * Hq * Nq, rows of out
  float* part_o;       // [splits, rows_total, D] (splits > 1 only)
  float* part_m;       // [splits, rows_total], base-2 running max
  float* part_l;       // [splits, rows_total]
  bool vec16;          // K and V rows load as 16-byte vectors (D, strides and pointers allow it)
};

template <typename T>
struct Dev;
template <>
struct Dev<float> {
  using type = float;
};
template <>
struct Dev<c10::Half> {
  using type = __half;
};
template <>
struct Dev<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename D>
__device__ __forceinline__ D from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Two floats as one 32-bit register of 16-bit values, the lower column in the lower half (the
// order mma.sync fragments use).
template <typename D>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// D[16x8] += A[16x16] B[16x8], fp32 accumulate. A: a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t),
// a2 (row g, k 2t+8), a3 (row g+8, k 2t+8); B: b0 (k 2t..2t+1, col g), b1 (k 2t+8, col g);
// C: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8), with g = lane / 4, t = lane % 4.
template <typename D>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__host__ __device__ constexpr int align16(int x) { return (x + 15) / 16 * 16; }

// Compile-time shape of one instantiation and its shared-memory layout (bytes).
template <typename D, int DP, int WM>
struct Cfg {
  static constexpr bool kMma = !std::is_same<D, float>::value;
  static constexpr int WN = kWarps / WM;
  static constexpr int BN = (WN == 1 ? 64 : 32) / (kMma ? 1 : 2);  // keys per warp per step
  static constexpr int KT = WN * BN;                               // keys per step
  static constexpr int RM = WM * 16;                               // rows per block
  // Row strides padded by 16 bytes so that the 8 rows a fragment load touches fall in different banks.
  static constexpr int LDQ = DP + 16 / static_cast<int>(sizeof(D));
  static constexpr int LDV = KT + 16 / static_cast<int>(sizeof(D));  // V^T: [DP][KT]
  static constexpr int LDP = BN + 1;                                // float32 P, per warp [16][BN]
  static constexpr int LDO = DP + 4;                                // epilogue O, float
  static constexpr int kQ = 0;
  static constexpr int kK = align16(kQ + RM * LDQ * static_cast<int>(sizeof(D)));
  static constexpr int kV = align16(kK + KT * LDQ * static_cast<int>(sizeof(D)));
  static constexpr int kP = align16(kV + DP * LDV * static_cast<int>(sizeof(D)));
  static constexpr int kKpos = align16(kP + (kMma ? 0 : kWarps * 16 * LDP * 4));
  static constexpr int kQpos = kKpos + KT * 8;
  static constexpr int kOk = kQpos + RM * 8;
  static constexpr int kMain = align16(kOk + KT);
  // The epilogue reuses the K, V and P space for every warp's O, m and l.
  static constexpr int kEpi = kK + WN * RM * LDO * 4 + 2 * WN * RM * 4;
  static constexpr int kBytes = kMain > kEpi ? kMain : align16(kEpi);
};

template <typename T, int DP, int WM>
__global__ void __launch_bounds__(kThreads, 1) split_attention_kernel(SplitParams sp) {
  using D = typename Dev<T>::type;
  using C = Cfg<D, DP, WM>;
  constexpr int WN = C::WN, BN = C::BN, KT = C::KT, RM = C::RM, LDQ = C::LDQ, LDV = C::LDV;
  constexpr int NS = BN / 8;  // S accumulator tiles per warp
  constexpr int NO = DP / 8;  // O accumulator tiles
  extern __shared__ __align__(16) unsigned char smem[];
  D* qs = reinterpret_cast<D*>(smem + C::kQ);
  D* ks = reinterpret_cast<D*>(smem + C::kK);
  D* vt = reinterpret_cast<D*>(smem + C::kV);
  int64_t* kpos_s = reinterpret_cast<int64_t*>(smem + C::kKpos);
  int64_t* qpos_s = reinterpret_cast<int64_t*>(smem + C::kQpos);
  bool* ok_s = reinterpret_cast<bool*>(smem + C::kOk);

  const AttentionProblem& p = sp.p;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wm = warp % WM, wn = warp / WM;
  const int64_t b = blockIdx.y / sp.hkv, hk = blockIdx.y % sp.hkv;
  const int64_t r0_tile = static_cast<int64_t>(blockIdx.x) * RM;
  const int d = static_cast<int>(p.d);
  const D* kg = static_cast<const D*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const D* vg = static_cast<const D*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const int64_t* kv_pos = p.kv_pos + b * p.nk;
  const bool* kv_valid = p.kv_valid ? p.kv_valid + b * p.nk : nullptr;
  const int64_t block_start = p.nk - p.nq;

  // Queries (zero padded to DP and RM rows) and their positions; a padding row sees nothing.
  for (int idx = tid; idx < RM * DP; idx += kThreads) {
    const int r = idx / DP, c = idx % DP;
    const int64_t R = r0_tile + r;
    D val = from_f<D>(0.0f);
    if (R < sp.rows && c < d) {
      const int64_t qi = R / p.group, h = hk * p.group + R % p.group;
      val = static_cast<const D*>(p.q)[b * p.q_sb + h * p.q_sh + qi * p.q_sn + c];
    }
    qs[r * LDQ + c] = val;
  }
  for (int r = tid; r < RM; r += kThreads) {
    const int64_t R = r0_tile + r;
    qpos_s[r] = R < sp.rows ? p.q_pos[b * p.nq + R / p.group] : INT64_MIN;
  }
  __syncthreads();
  int64_t q_last = INT64_MIN;
  for (int r = 0; r < RM; ++r) q_last = max(q_last, qpos_s[r]);

  // This thread's two rows (g and g + 8 of its warp's 16).
  const int lr[2] = {wm * 16 + g, wm * 16 + g + 8};
  int64_t qpos[2];
  const int32_t* tree_row[2];
  bool row_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t R = r0_tile + lr[i];
    row_ok[i] = R < sp.rows;
    qpos[i] = qpos_s[lr[i]];
    tree_row[i] = (p.tree != nullptr && row_ok[i]) ? p.tree + (b * p.nq + R / p.group) * p.words : nullptr;
  }

  uint32_t qa[C::kMma ? DP / 16 : 1][4];
  if constexpr (C::kMma) {
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      const D* q0 = qs + lr[0] * LDQ + kc * 16 + 2 * t;
      const D* q1 = qs + lr[1] * LDQ + kc * 16 + 2 * t;
      qa[kc][0] = *reinterpret_cast<const uint32_t*>(q0);
      qa[kc][1] = *reinterpret_cast<const uint32_t*>(q1);
      qa[kc][2] = *reinterpret_cast<const uint32_t*>(q0 + 8);
      qa[kc][3] = *reinterpret_cast<const uint32_t*>(q1 + 8);
    }
  }

  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};  // this lane's share of the row sums; the 4 lanes of a row add up at the end

  const int64_t lo = static_cast<int64_t>(blockIdx.z) * sp.split_len;
  const int64_t hi = min(lo + sp.split_len, p.nk);
  const int jw = wn * BN;  // this warp's first key within a step

  for (int64_t k0 = lo; k0 < hi; k0 += KT) {
    bool any_visible = false;
    for (int j = tid; j < KT; j += kThreads) {
      const int64_t key = k0 + j;
      const bool ok = key < hi && (kv_valid == nullptr || kv_valid[key]);
      const int64_t kp = key < hi ? kv_pos[key] : INT64_MAX;
      ok_s[j] = ok;
      kpos_s[j] = kp;
      any_visible |= ok && kp <= q_last;
    }
    if (!__syncthreads_or(any_visible)) continue;  // uniform across the block

    if (sp.vec16) {
      // 16-byte loads (8 bf16/fp16 or 4 float32 values), coalesced along D across the warp.
      constexpr int VE = 16 / static_cast<int>(sizeof(D));
      for (int idx = tid; idx < KT * (DP / VE); idx += kThreads) {
        const int j = idx / (DP / VE), c = idx % (DP / VE) * VE;
        const int64_t key = k0 + j;
        uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
        if (ok_s[j] && c < d) {  // d % VE == 0: a vector is all in or all out
          kv = *reinterpret_cast<const uint4*>(kg + key * p.k_sn + c);
          vv = *reinterpret_cast<const uint4*>(vg + key * p.v_sn + c);
        }
        *reinterpret_cast<uint4*>(ks + j * LDQ + c) = kv;
        const D* ve = reinterpret_cast<const D*>(&vv);
#pragma unroll
        for (int e = 0; e < VE; ++e) vt[(c + e) * LDV + j] = ve[e];
      }
    } else {
      for (int idx = tid; idx < KT * DP; idx += kThreads) {
        const int j = idx / DP, c = idx % DP;
        const bool load = ok_s[j] && c < d;
        const int64_t key = k0 + j;
        ks[j * LDQ + c] = load ? kg[key * p.k_sn + c] : from_f<D>(0.0f);
        vt[c * LDV + j] = load ? vg[key * p.v_sn + c] : from_f<D>(0.0f);
      }
    }
    __syncthreads();

    float s[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    if constexpr (C::kMma) {
#pragma unroll
      for (int n = 0; n < NS; ++n) {
        const D* krow = ks + (jw + n * 8 + g) * LDQ + 2 * t;
#pragma unroll
        for (int kc = 0; kc < DP / 16; ++kc) {
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(krow + kc * 16);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(krow + kc * 16 + 8);
          mma16816<D>(s[n], qa[kc], b0, b1);
        }
      }
    } else {
      // Register-blocked IEEE dots: per head-dim element, 2 query values x 2 NS key values.
      // (Unrolling a whole dot per accumulator instead spilled 1.2 KB per thread at D = 128.)
      const float* q0 = reinterpret_cast<const float*>(qs) + lr[0] * LDQ;
      const float* q1 = reinterpret_cast<const float*>(qs) + lr[1] * LDQ;
      const float* kw = reinterpret_cast<const float*>(ks) + (jw + 2 * t) * LDQ;
#pragma unroll 1
      for (int c = 0; c < DP; ++c) {
        const float a0 = q0[c], a1 = q1[c];
#pragma unroll
        for (int n = 0; n < NS; ++n) {
          const float k0v = kw[(n * 8) * LDQ + c], k1v = kw[(n * 8 + 1) * LDQ + c];
          s[n][0] = fmaf(a0, k0v, s[n][0]);
          s[n][1] = fmaf(a0, k1v, s[n][1]);
          s[n][2] = fmaf(a1, k0v, s[n][2]);
          s[n][3] = fmaf(a1, k1v, s[n][3]);
        }
      }
    }

    // Visibility, scale, and the online softmax of this lane's two rows.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = jw + n * 8 + 2 * t + (e & 1);
        const int i = e / 2;
        const bool vis = row_ok[i] && key_visible(ok_s[j], kpos_s[j], qpos[i], tree_row[i], k0 + j - block_start);
        s[n][e] = vis ? s[n][e] * p.scale_log2 : -INFINITY;
        mx[i] = fmaxf(mx[i], s[n][e]);
      }
    }
    float alpha[2], msub[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      const float m_new = fmaxf(m[i], mx[i]);
      msub[i] = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: exp2 gives 0, not NaN
      alpha[i] = exp2f(m[i] - msub[i]);
      m[i] = m_new;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - msub[e / 2]);
        rs[e / 2] += s[n][e];
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    if constexpr (C::kMma) {
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        const uint32_t pa[4] = {pack2<D>(s[2 * kc][0], s[2 * kc][1]), pack2<D>(s[2 * kc][2], s[2 * kc][3]),
                                pack2<D>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                pack2<D>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
        for (int n = 0; n < NO; ++n) {
          const D* vrow = vt + (n * 8 + g) * LDV + jw + kc * 16 + 2 * t;
          mma16816<D>(o[n], pa, *reinterpret_cast<const uint32_t*>(vrow),
                      *reinterpret_cast<const uint32_t*>(vrow + 8));
        }
      }
    } else {
      float* ps = reinterpret_cast<float*>(smem + C::kP) + warp * 16 * C::LDP;
#pragma unroll
      for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ps[(g + 8 * (e / 2)) * C::LDP + n * 8 + 2 * t + (e & 1)] = s[n][e];
      }
      __syncwarp();
      const float* p0 = ps + g * C::LDP;
      const float* p1 = ps + (g + 8) * C::LDP;
      const float* vw = reinterpret_cast<const float*>(vt) + 2 * t * LDV + jw;
#pragma unroll 1
      for (int j = 0; j < BN; ++j) {
        const float a0 = p0[j], a1 = p1[j];
#pragma unroll
        for (int n = 0; n < NO; ++n) {
          const float v0 = vw[(n * 8) * LDV + j], v1 = vw[(n * 8 + 1) * LDV + j];
          o[n][0] = fmaf(a0, v0, o[n][0]);
          o[n][1] = fmaf(a0, v1, o[n][1]);
          o[n][2] = fmaf(a1, v0, o[n][2]);
          o[n][3] = fmaf(a1, v1, o[n][3]);
        }
      }
    }
    __syncthreads();  // K, V and P are overwritten by the next step
  }

  // Epilogue: the 4 lanes of a row add their sums; the WN warps sharing rows merge through
  // shared memory (the K/V space is free now); then normalise and store, or store the partial.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  __syncthreads();
  float* os = reinterpret_cast<float*>(smem + C::kK);  // [WN][RM][LDO]
  float* ms = os + WN * RM * C::LDO;                   // [WN][RM]
  float* ls = ms + WN * RM;
#pragma unroll
  for (int n = 0; n < NO; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) os[(wn * RM + lr[e / 2]) * C::LDO + n * 8 + 2 * t + (e & 1)] = o[n][e];
  }
  if (t == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ms[wn * RM + lr[i]] = m[i];
      ls[wn * RM + lr[i]] = l[i];
    }
  }
  __syncthreads();

  const bool single = gridDim.z == 1;
  for (int idx = tid; idx < RM * (d + 1); idx += kThreads) {
    const int r = idx / (d + 1), c = idx % (d + 1);  // c == d: the row's statistics
    const int64_t R = r0_tile + r;
    if (R >= sp.rows) continue;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < WN; ++w) mm = fmaxf(mm, ms[w * RM + r]);
    const float msb = mm == -INFINITY ? 0.0f : mm;
    float ll = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < WN; ++w) {
      const float wgt = exp2f(ms[w * RM + r] - msb);
      ll += wgt * ls[w * RM + r];
      if (c < d) acc += wgt * os[(w * RM + r) * C::LDO + c];
    }
    const int64_t qi = R / p.group, h = hk * p.group + R % p.group;
    const int64_t row = (b * p.hq + h) * p.nq + qi;
    if (single) {
      if (c < d) {
        static_cast<D*>(p.out)[row * p.d + c] = from_f<D>(ll != 0.0f ? acc / ll : 0.0f);
      } else {
        p.lse[row] = ll != 0.0f ? (mm + log2f(ll)) * kLn2 : -INFINITY;
      }
    } else {
      const int64_t part = static_cast<int64_t>(blockIdx.z) * sp.rows_total + row;
      if (c < d) {
        sp.part_o[part * p.d + c] = acc;
      } else {
        sp.part_m[part] = mm;
        sp.part_l[part] = ll;
      }
    }
  }
}

// out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s; one thread per element,
// the thread of column D also writes the row's lse.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(SplitParams sp, int splits) {
  using D = typename Dev<T>::type;
  const int64_t d = sp.p.d;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= sp.rows_total * (d + 1)) return;
  const int64_t row = idx / (d + 1), c = idx % (d + 1);
  float mm = -INFINITY;
  for (int s = 0; s < splits; ++s) mm = fmaxf(mm, sp.part_m[s * sp.rows_total + row]);
  const float msb = mm == -INFINITY ? 0.0f : mm;  // a row no split saw: weights 0, not NaN
  float ll = 0.0f, acc = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const int64_t part = s * sp.rows_total + row;
    const float w = exp2f(sp.part_m[part] - msb);
    ll += w * sp.part_l[part];
    if (c < d) acc += w * sp.part_o[part * d + c];
  }
  if (c < d) {
    static_cast<D*>(sp.p.out)[row * d + c] = from_f<D>(ll != 0.0f ? acc / ll : 0.0f);
  } else {
    sp.p.lse[row] = ll != 0.0f ? (mm + log2f(ll)) * kLn2 : -INFINITY;
  }
}

template <typename T, int DP, int WM>
void launch_split(SplitParams& sp, int64_t b, int64_t splits, const at::TensorOptions& fopts,
                  cudaStream_t stream) {
  using C = Cfg<typename Dev<T>::type, DP, WM>;
  auto kernel = split_attention_kernel<T, DP, WM>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kBytes));
  // Splits are whole key steps; a split past the end of the keys would see nothing.
  const int64_t nk = std::max<int64_t>(sp.p.nk, 1);
  splits = std::min<int64_t>(splits, kMaxGridZ);
  sp.split_len = ((nk + splits - 1) / splits + C::KT - 1) / C::KT * C::KT;
  splits = (nk + sp.split_len - 1) / sp.split_len;
  at::Tensor part_o, part_m, part_l;
  if (splits > 1) {
    part_o = at::empty({splits, sp.rows_total, sp.p.d}, fopts);
    part_m = at::empty({splits, sp.rows_total}, fopts);
    part_l = at::empty({splits, sp.rows_total}, fopts);
    sp.part_o = part_o.data_ptr<float>();
    sp.part_m = part_m.data_ptr<float>();
    sp.part_l = part_l.data_ptr<float>();
  }
  const dim3 grid(static_cast<unsigned>((sp.rows + C::RM - 1) / C::RM), static_cast<unsigned>(b * sp.hkv),
                  static_cast<unsigned>(splits));
  kernel<<<grid, kThreads, C::kBytes, stream>>>(sp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    const int64_t n = sp.rows_total * (sp.p.d + 1);
    merge_splits_kernel<T><<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        sp, static_cast<int>(splits));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // The partial buffers go back to the caching allocator here; stream order keeps them alive
  // for the kernels just queued on `stream`.
}

// Head dims are padded to 16, 32, 64 or 128 (zeros in Q and K add nothing to a dot).
template <typename T, int WM>
void dispatch_dp(SplitParams& sp, int64_t b, int64_t splits, const at::TensorOptions& fopts, cudaStream_t stream) {
  const int64_t d = sp.p.d;
  if (d <= 16) return launch_split<T, 16, WM>(sp, b, splits, fopts, stream);
  if (d <= 32) return launch_split<T, 32, WM>(sp, b, splits, fopts, stream);
  if (d <= 64) return launch_split<T, 64, WM>(sp, b, splits, fopts, stream);
  return launch_split<T, 128, WM>(sp, b, splits, fopts, stream);
}

template <typename T>
void dispatch(SplitParams& sp, int64_t b, int64_t warps_m, int64_t splits, const at::TensorOptions& fopts,
              cudaStream_t stream) {
  if (warps_m == 1) return dispatch_dp<T, 1>(sp, b, splits, fopts, stream);
  return dispatch_dp<T, 4>(sp, b, splits, fopts, stream);
}

template <typename T, int WM>
void add_configs(std::vector<SplitConfig>& out, const char* dtype) {
  using D = typename Dev<T>::type;
  out.emplace_back(dtype, 16, WM, Cfg<D, 16, WM>::kBytes, Cfg<D, 16, WM>::KT);
  out.emplace_back(dtype, 32, WM, Cfg<D, 32, WM>::kBytes, Cfg<D, 32, WM>::KT);
  out.emplace_back(dtype, 64, WM, Cfg<D, 64, WM>::kBytes, Cfg<D, 64, WM>::KT);
  out.emplace_back(dtype, 128, WM, Cfg<D, 128, WM>::kBytes, Cfg<D, 128, WM>::KT);
}

}  // namespace

std::vector<SplitConfig> tree_attention_split_configs() {
  std::vector<SplitConfig> out;
  add_configs<float, 1>(out, "float");
  add_configs<float, 4>(out, "float");
  add_configs<c10::Half, 1>(out, "half");
  add_configs<c10::Half, 4>(out, "half");
  add_configs<c10::BFloat16, 1>(out, "bfloat16");
  add_configs<c10::BFloat16, 4>(out, "bfloat16");
  return out;
}

AttentionOut tree_attention_split_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                       const std::optional<at::Tensor>& kv_valid,
                                       const std::optional<at::Tensor>& tree_mask, std::optional<double> scale,
                                       int64_t warps_m, int64_t splits) {
  check_tree_attention_args(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale);
  TORCH_CHECK_VALUE(warps_m == 1 || warps_m == 4, "warps_m must be 1 (decode) or 4 (prefill), got ", warps_m);
  TORCH_CHECK_VALUE(splits >= 1, "splits must be >= 1, got ", splits);
  TORCH_CHECK_VALUE(q.is_cuda(), "tree_attention_split_cuda needs CUDA tensors, got ", q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionSetup setup = setup_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale);
  if (setup.out.numel() == 0) return {setup.out, setup.lse};
  SplitParams sp{};
  sp.p = setup.problem;
  sp.hkv = k.size(1);
  sp.rows = q.size(2) * sp.p.group;
  sp.rows_total = q.size(0) * q.size(1) * q.size(2);
  const int64_t ve = 16 / static_cast<int64_t>(q.element_size());
  auto vectorisable = [ve](const at::Tensor& x) {
    return reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % ve == 0 &&
           x.stride(1) % ve == 0 && x.stride(2) % ve == 0;
  };
  sp.vec16 = q.size(3) % ve == 0 && vectorisable(k) && vectorisable(v);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::TensorOptions fopts = setup.lse.options();
  switch (q.scalar_type()) {
    case at::kHalf: dispatch<c10::Half>(sp, q.size(0), warps_m, splits, fopts, stream); break;
    case at::kBFloat16: dispatch<c10::BFloat16>(sp, q.size(0), warps_m, splits, fopts, stream); break;
    default: dispatch<float>(sp, q.size(0), warps_m, splits, fopts, stream); break;
  }
  return {setup.out, setup.lse};
}

}  // namespace specdec
