// Kernel 1 on CUDA: fused probability pooling (docs/design.md, "Kernel 1").
//
// One thread block per logits row, read through a row accessor (global or shared memory). Three
// kernel families; the Python side picks one per call (specdec/ops/dispatch.py, SPECDEC_CUDA_POOL):
// - default (pool_probs / sampling_probs ops; the kernels run on H200s): the row is streamed from
//   global memory: one pass for the softmax statistics (online max/sum, with the NaN/+inf check
//   folded in), plus 32 counting passes of a bisection on the float bit pattern when top-k is on
//   (exact k-th largest value, ties kept, no sort and no V-sized buffer), and, when top_p < 1, a max
//   pass, a weight pass and up to 32 passes of a bisection for the nucleus cut;
// - variant 1, "v2" (the *_variant ops; it has NEVER RUN ON A GPU, only compiled): the row's guided
//   logits are staged once in shared memory with 128-bit loads, so the bisections, the softmax and
//   the K-neighbour gather all read shared memory and DRAM sees each row once. Rows whose float32
//   logits do not fit in the opt-in shared memory of the device fall back to the default kernel;
// - variant 2, "radix" (the *_variant ops; NEVER RUN ON A GPU, only compiled): staged like v2, with
//   both thresholds found by a radix select instead of the bisections: 4 passes of 8-bit digit
//   histograms each (specdec/radix_select.cuh). Rows too large for shared memory run the same
//   selection on the row streamed from global memory (8 passes instead of up to 64).
// The neighbour prefix sums are a block scan over the K gathered probabilities. Nothing of size
// [N, V] is written by pool_probs.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>
#include <cstring>
#include <type_traits>

#include "specdec/cuda_block.cuh"
#include "specdec/pool_math.h"
#include "specdec/radix_select.cuh"
#include "specdec_ops.h"

namespace specdec {
namespace {

using cuda::block_reduce;

constexpr int kThreads = 512;

struct RowArgs {
  int64_t v;
  int64_t stride, ustride;
  float cfg_scale, temperature;
  int64_t top_k;
  double top_p;
};

// v1's view of a row: guided logits recomputed from global memory at each read.
template <typename T>
struct GlobalRow {
  const T* cond;
  const T* uncond;
  float cfg_scale, temperature;
  __device__ __forceinline__ float operator()(int64_t i) const {
    return guided_logit(static_cast<float>(cond[i]), uncond ? static_cast<float>(uncond[i]) : 0.0f,
                        uncond != nullptr, cfg_scale, temperature);
  }
};

// v2's view: the guided logits staged in shared memory.
struct SharedRow {
  const float* l;
  __device__ __forceinline__ float operator()(int64_t i) const { return l[i]; }
};

struct RowSoftmax {
  bool ok;
  int32_t threshold_key;
  float max, log_sum;  // p = exp((l - max) - log_sum) (prob_from_logit); row_lse = max + log_sum
};

// Step 2b: the nucleus cut, the smallest key t >= threshold_key whose weight strictly above is
// below top_p * (total weight) (pool_math.h "top-p"); the max's key always qualifies.
template <typename Row>
__device__ int32_t top_p_cut(const Row& row, int64_t v, int32_t threshold_key, float m, double top_p) {
  int64_t total = 0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    const float l = row(i);
    total += kept_by_top_k(l, threshold_key) ? top_p_weight(l, m) : 0;
  }
  total = block_reduce(total, cuda::Int64SumOp(), int64_t{0});
  const double threshold = nucleus_threshold(top_p, total);
  int64_t lo = threshold_key, hi = ordered_key(m);
  while (lo < hi) {  // uniform across the block: every thread sees the same sums
    const int64_t mid = lo + (hi - lo) / 2;
    int64_t above = 0;
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      const float l = row(i);
      above += ordered_key(l) > mid ? top_p_weight(l, m) : 0;  // key > mid >= threshold_key: kept
    }
    above = block_reduce(above, cuda::Int64SumOp(), int64_t{0});
    if (inside_nucleus(above, threshold)) hi = mid; else lo = mid + 1;
  }
  return static_cast<int32_t>(lo);
}

// Steps 1-3 for one row; identical result in every thread of the block.
template <typename Row>
__device__ RowSoftmax row_softmax(const Row& row, const RowArgs& a) {
  int32_t threshold_key = INT_MIN;
  const bool use_top_k = a.top_k > 0 && a.top_k < a.v;
  const bool use_top_p = a.top_p < 1.0;
  if (use_top_k || use_top_p) {
    int poison = 0;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
      const float l = row(i);
      poison |= is_poison(l);
      m = fmaxf(m, l);
    }
    if (block_reduce(poison, cuda::OrOp(), 0)) return {false, 0, NAN, NAN};
    m = block_reduce(m, cuda::MaxOp(), -INFINITY);
    if (m == -INFINITY) return {false, 0, NAN, NAN};
    if (use_top_k) {
      // Largest key t with count(key >= t) >= top_k is exactly the key of the k-th largest logit.
      int64_t lo = INT_MIN, hi = INT_MAX;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        int count = 0;
        for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) count += ordered_key(row(i)) >= mid;
        count = block_reduce(count, cuda::CountOp(), 0);
        if (count >= a.top_k) lo = mid; else hi = mid - 1;
      }
      threshold_key = static_cast<int32_t>(lo);
    }
    // Top-k keeps the max, so m is the max of the kept entries too.
    if (use_top_p) threshold_key = top_p_cut(row, a.v, threshold_key, m, a.top_p);
  }
  SoftmaxStats s{-INFINITY, 0.0f};
  int poison = 0;
  for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
    const float l = row(i);
    poison |= is_poison(l);
    if (kept_by_top_k(l, threshold_key)) s = softmax_stats_add(s, l);
  }
  poison = block_reduce(poison, cuda::OrOp(), 0);
  s = cuda::block_merge_stats(s);
  if (poison || s.max == -INFINITY) return {false, 0, NAN, NAN};
  return {true, threshold_key, s.max, softmax_log_sum(s)};
}

struct PoolOutPtrs {
  float* pooled;
  float* p_token;
  float* row_max;
  float* row_lse;
};

// Steps 3-4 for row r, token x (already checked to lie in [0, V)).
template <typename Row, typename Nb>
__device__ void pool_row(const Row& row, const RowArgs& a, int64_t r, int64_t x,
                         const Nb* __restrict__ neighbors, int64_t k, float delta, PoolOutPtrs out) {
  const RowSoftmax st = row_softmax(row, a);
  if (!st.ok) {
    if (threadIdx.x == 0) out.pooled[r] = out.p_token[r] = out.row_max[r] = out.row_lse[r] = NAN;
    return;
  }
  const float px = prob_from_logit(row(x), st.threshold_key, st.max, st.log_sum);
  float moved = 0.0f;
  int bad_neighbor = 0;
  if (neighbors != nullptr) {
    const Nb* row_nb = neighbors + x * k;
    float carry = 0.0f;
    for (int64_t c = 0; c < k; c += blockDim.x) {
      const int64_t j = c + threadIdx.x;
      float p = 0.0f;
      if (j < k) {
        const int64_t y = row_nb[j];
        if (y >= 0 && y < a.v) {
          p = prob_from_logit(row(y), st.threshold_key, st.max, st.log_sum);
        } else {
          bad_neighbor = 1;
        }
      }
      float chunk_total;
      const float inclusive = carry + cuda::block_inclusive_scan(p, &chunk_total);
      const float candidate = j < k ? movable_mass(inclusive, delta) : 0.0f;
      moved = fmaxf(moved, block_reduce(candidate, cuda::MaxOp(), 0.0f));
      carry = carry + chunk_total;
      if (!(carry <= delta)) break;  // prefix sums only grow: no later prefix can be moved
    }
    bad_neighbor = block_reduce(bad_neighbor, cuda::OrOp(), 0);
  }
  if (threadIdx.x == 0) {
    const bool ok = !bad_neighbor;
    out.pooled[r] = ok ? px + moved : NAN;
    out.p_token[r] = ok ? px : NAN;
    out.row_max[r] = ok ? st.max : NAN;
    out.row_lse[r] = ok ? st.max + st.log_sum : NAN;
  }
}

__device__ __forceinline__ int64_t token_of(const void* tokens, bool tokens_int64, int64_t stride, int64_t r) {
  return tokens_int64 ? static_cast<const int64_t*>(tokens)[r * stride]
                      : static_cast<const int32_t*>(tokens)[r * stride];
}

template <typename T>
__device__ __forceinline__ GlobalRow<T> global_row(const T* logits, const T* uncond_logits,
                                                   const RowArgs& a, int64_t r) {
  return {logits + r * a.stride, uncond_logits ? uncond_logits + r * a.ustride : nullptr,
          a.cfg_scale, a.temperature};
}

// ---- v2: the row staged in shared memory --------------------------------------------------------

// Writes the row's guided logits (float32) to sm[0, V). With `vectorized` (the host checked that
// both rows start on 16-byte boundaries) each thread moves 16 bytes per load: LDG.E.128.
template <typename T>
__device__ void stage_row(const T* __restrict__ cond, const T* __restrict__ uncond, const RowArgs& a,
                          bool vectorized, float* sm) {
  constexpr int kVec = 16 / sizeof(T);
  const bool has_uncond = uncond != nullptr;
  int64_t done = 0;
  if (vectorized) {
    const int64_t nvec = a.v / kVec;
    const uint4* c4 = reinterpret_cast<const uint4*>(cond);
    const uint4* u4 = reinterpret_cast<const uint4*>(uncond);
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      const uint4 craw = c4[j];
      const uint4 uraw = has_uncond ? u4[j] : craw;
      T c[kVec], u[kVec];
      memcpy(c, &craw, 16);
      memcpy(u, &uraw, 16);
      float l[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        l[e] = guided_logit(static_cast<float>(c[e]), static_cast<float>(u[e]), has_uncond,
                            a.cfg_scale, a.temperature);
      }
      if constexpr (kVec % 4 == 0) {  // float32 and 16-bit logits: 128-bit shared stores
        float4* dst = reinterpret_cast<float4*>(sm + j * kVec);
#pragma unroll
        for (int e = 0; e < kVec; e += 4) dst[e / 4] = make_float4(l[e], l[e + 1], l[e + 2], l[e + 3]);
      } else {  // float64 (instantiated by the dispatch, refused by check_pool_args)
#pragma unroll
        for (int e = 0; e < kVec; ++e) sm[j * kVec + e] = l[e];
      }
    }
    done = nvec * kVec;
  }
  const GlobalRow<T> row{cond, uncond, a.cfg_scale, a.temperature};
  for (int64_t i = done + threadIdx.x; i < a.v; i += blockDim.x) sm[i] = row(i);
  __syncthreads();
}

template <typename T, typename Nb>
__global__ void __launch_bounds__(kThreads) pool_probs_smem_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a, bool vectorized,
    const void* __restrict__ tokens, bool tokens_int64, int64_t tokens_stride,
    const Nb* __restrict__ neighbors, int64_t k, float delta, PoolOutPtrs out) {
  extern __shared__ float4 staged[];  // float4: 16-byte alignment for the vector stores
  float* sm = reinterpret_cast<float*>(staged);
  const int64_t r = blockIdx.x;
  const int64_t x = token_of(tokens, tokens_int64, tokens_stride, r);
  // Out-of-range ids are rejected by the Python API; here they only must not read out of bounds.
  if (!(x >= 0 && x < a.v)) {
    if (threadIdx.x == 0) out.pooled[r] = out.p_token[r] = out.row_max[r] = out.row_lse[r] = NAN;
    return;
  }
  const GlobalRow<T> g = global_row(logits, uncond_logits, a, r);
  stage_row(g.cond, g.uncond, a, vectorized, sm);
  pool_row(SharedRow{sm}, a, r, x, neighbors, k, delta, out);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sampling_probs_smem_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a, bool vectorized,
    float* __restrict__ probs) {
  extern __shared__ float4 staged[];
  float* sm = reinterpret_cast<float*>(staged);
  const int64_t r = blockIdx.x;
  const GlobalRow<T> g = global_row(logits, uncond_logits, a, r);
  stage_row(g.cond, g.uncond, a, vectorized, sm);
  const RowSoftmax st = row_softmax(SharedRow{sm}, a);
  float* out = probs + r * a.v;
  int64_t done = 0;
  if (vectorized && a.v % 4 == 0) {  // then probs rows start on 16-byte boundaries too
    float4* out4 = reinterpret_cast<float4*>(out);
    const float4* sm4 = reinterpret_cast<const float4*>(sm);
    for (int64_t j = threadIdx.x; j < a.v / 4; j += blockDim.x) {
      const float4 l = sm4[j];
      out4[j] = st.ok ? make_float4(prob_from_logit(l.x, st.threshold_key, st.max, st.log_sum),
                                    prob_from_logit(l.y, st.threshold_key, st.max, st.log_sum),
                                    prob_from_logit(l.z, st.threshold_key, st.max, st.log_sum),
                                    prob_from_logit(l.w, st.threshold_key, st.max, st.log_sum))
                      : make_float4(NAN, NAN, NAN, NAN);
    }
    done = a.v;
  }
  for (int64_t i = done + threadIdx.x; i < a.v; i += blockDim.x) {
    out[i] = st.ok ? prob_from_logit(sm[i], st.threshold_key, st.max, st.log_sum) : NAN;
  }
}

// ---- v1: the row streamed from global memory (the default) ---------------------------------------

template <typename T, typename Nb>
__global__ void __launch_bounds__(kThreads) pool_probs_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a,
    const void* __restrict__ tokens, bool tokens_int64, int64_t tokens_stride,
    const Nb* __restrict__ neighbors, int64_t k, float delta, PoolOutPtrs out) {
  const int64_t r = blockIdx.x;
  const int64_t x = token_of(tokens, tokens_int64, tokens_stride, r);
  if (!(x >= 0 && x < a.v)) {
    if (threadIdx.x == 0) out.pooled[r] = out.p_token[r] = out.row_max[r] = out.row_lse[r] = NAN;
    return;
  }
  pool_row(global_row(logits, uncond_logits, a, r), a, r, x, neighbors, k, delta, out);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sampling_probs_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a,
    float* __restrict__ probs) {
  const int64_t r = blockIdx.x;
  const GlobalRow<T> row = global_row(logits, uncond_logits, a, r);
  const RowSoftmax st = row_softmax(row, a);
  float* out = probs + r * a.v;
  for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
    out[i] = st.ok ? prob_from_logit(row(i), st.threshold_key, st.max, st.log_sum) : NAN;
  }
}

// ---- radix (variant 2): the v2 staging (or the v1 streaming) with radix-select thresholds ---------
//
// Kept apart from row_softmax / pool_row / the v2 kernels above, which stay as they were when they ran
// on the H200: sharing them through a selection template changed their machine code (nvcc inlined
// differently, and the default kernel spilled on sm_80).

// Steps 1-3 for one row, thresholds by radix select (specdec/radix_select.cuh): the same keys as
// the bisections of row_softmax, in 4 histogram passes each.
template <typename Row>
__device__ RowSoftmax row_softmax_radix(const Row& row, const RowArgs& a) {
  int32_t threshold_key = INT_MIN;
  const bool use_top_k = a.top_k > 0 && a.top_k < a.v;
  const bool use_top_p = a.top_p < 1.0;
  if (use_top_k || use_top_p) {
    int poison = 0;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
      const float l = row(i);
      poison |= is_poison(l);
      m = fmaxf(m, l);
    }
    if (block_reduce(poison, cuda::OrOp(), 0)) return {false, 0, NAN, NAN};
    m = block_reduce(m, cuda::MaxOp(), -INFINITY);
    if (m == -INFINITY) return {false, 0, NAN, NAN};
    if (use_top_k) threshold_key = radix::top_k_key(row, a.v, a.top_k);
    // Top-k keeps the max, so m is the max of the kept entries too.
    if (use_top_p) threshold_key = radix::top_p_key(row, a.v, threshold_key, m, a.top_p);
  }
  SoftmaxStats s{-INFINITY, 0.0f};
  int poison = 0;
  for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
    const float l = row(i);
    poison |= is_poison(l);
    if (kept_by_top_k(l, threshold_key)) s = softmax_stats_add(s, l);
  }
  poison = block_reduce(poison, cuda::OrOp(), 0);
  s = cuda::block_merge_stats(s);
  if (poison || s.max == -INFINITY) return {false, 0, NAN, NAN};
  return {true, threshold_key, s.max, softmax_log_sum(s)};
}

// pool_row with radix thresholds: steps 3-4 for row r, token x (already checked to lie in [0, V)).
template <typename Row, typename Nb>
__device__ void pool_row_radix(const Row& row, const RowArgs& a, int64_t r, int64_t x,
                               const Nb* __restrict__ neighbors, int64_t k, float delta, PoolOutPtrs out) {
  const RowSoftmax st = row_softmax_radix(row, a);
  if (!st.ok) {
    if (threadIdx.x == 0) out.pooled[r] = out.p_token[r] = out.row_max[r] = out.row_lse[r] = NAN;
    return;
  }
  const float px = prob_from_logit(row(x), st.threshold_key, st.max, st.log_sum);
  float moved = 0.0f;
  int bad_neighbor = 0;
  if (neighbors != nullptr) {
    const Nb* row_nb = neighbors + x * k;
    float carry = 0.0f;
    for (int64_t c = 0; c < k; c += blockDim.x) {
      const int64_t j = c + threadIdx.x;
      float p = 0.0f;
      if (j < k) {
        const int64_t y = row_nb[j];
        if (y >= 0 && y < a.v) {
          p = prob_from_logit(row(y), st.threshold_key, st.max, st.log_sum);
        } else {
          bad_neighbor = 1;
        }
      }
      float chunk_total;
      const float inclusive = carry + cuda::block_inclusive_scan(p, &chunk_total);
      const float candidate = j < k ? movable_mass(inclusive, delta) : 0.0f;
      moved = fmaxf(moved, block_reduce(candidate, cuda::MaxOp(), 0.0f));
      carry = carry + chunk_total;
      if (!(carry <= delta)) break;  // prefix sums only grow: no later prefix can be moved
    }
    bad_neighbor = block_reduce(bad_neighbor, cuda::OrOp(), 0);
  }
  if (threadIdx.x == 0) {
    const bool ok = !bad_neighbor;
    out.pooled[r] = ok ? px + moved : NAN;
    out.p_token[r] = ok ? px : NAN;
    out.row_max[r] = ok ? st.max : NAN;
    out.row_lse[r] = ok ? st.max + st.log_sum : NAN;
  }
}

// With __launch_bounds__(kThreads) alone ptxas aims at 4 blocks per SM (32 registers) and spills
// around the IEEE division's slow-path call in these kernels; 2 blocks per SM leaves it 64
// registers (a staged float32 row of V = 16384, 64 KiB, fits 3 blocks per SM in shared memory).
constexpr int kRadixMinBlocks = 2;

// kStaged: the row staged in shared memory as in v2 (the host checked it fits); else streamed as in v1.
template <typename T, typename Nb, bool kStaged>
__global__ void __launch_bounds__(kThreads, kRadixMinBlocks) pool_probs_radix_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a, bool vectorized,
    const void* __restrict__ tokens, bool tokens_int64, int64_t tokens_stride,
    const Nb* __restrict__ neighbors, int64_t k, float delta, PoolOutPtrs out) {
  const int64_t r = blockIdx.x;
  const int64_t x = token_of(tokens, tokens_int64, tokens_stride, r);
  // Out-of-range ids are rejected by the Python API; here they only must not read out of bounds.
  if (!(x >= 0 && x < a.v)) {
    if (threadIdx.x == 0) out.pooled[r] = out.p_token[r] = out.row_max[r] = out.row_lse[r] = NAN;
    return;
  }
  const GlobalRow<T> g = global_row(logits, uncond_logits, a, r);
  if constexpr (kStaged) {
    extern __shared__ float4 staged[];  // float4: 16-byte alignment for the vector stores
    float* sm = reinterpret_cast<float*>(staged);
    stage_row(g.cond, g.uncond, a, vectorized, sm);
    pool_row_radix(SharedRow{sm}, a, r, x, neighbors, k, delta, out);
  } else {
    pool_row_radix(g, a, r, x, neighbors, k, delta, out);
  }
}

template <typename T, bool kStaged>
__global__ void __launch_bounds__(kThreads, kRadixMinBlocks) sampling_probs_radix_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a, bool vectorized,
    float* __restrict__ probs) {
  const int64_t r = blockIdx.x;
  const GlobalRow<T> g = global_row(logits, uncond_logits, a, r);
  float* out = probs + r * a.v;
  if constexpr (kStaged) {
    extern __shared__ float4 staged[];
    float* sm = reinterpret_cast<float*>(staged);
    stage_row(g.cond, g.uncond, a, vectorized, sm);
    const RowSoftmax st = row_softmax_radix(SharedRow{sm}, a);
    int64_t done = 0;
    if (vectorized && a.v % 4 == 0) {  // then probs rows start on 16-byte boundaries too
      float4* out4 = reinterpret_cast<float4*>(out);
      const float4* sm4 = reinterpret_cast<const float4*>(sm);
      for (int64_t j = threadIdx.x; j < a.v / 4; j += blockDim.x) {
        const float4 l = sm4[j];
        out4[j] = st.ok ? make_float4(prob_from_logit(l.x, st.threshold_key, st.max, st.log_sum),
                                      prob_from_logit(l.y, st.threshold_key, st.max, st.log_sum),
                                      prob_from_logit(l.z, st.threshold_key, st.max, st.log_sum),
                                      prob_from_logit(l.w, st.threshold_key, st.max, st.log_sum))
                        : make_float4(NAN, NAN, NAN, NAN);
      }
      done = a.v;
    }
    for (int64_t i = done + threadIdx.x; i < a.v; i += blockDim.x) {
      out[i] = st.ok ? prob_from_logit(sm[i], st.threshold_key, st.max, st.log_sum) : NAN;
    }
  } else {
    const RowSoftmax st = row_softmax_radix(g, a);
    for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
      out[i] = st.ok ? prob_from_logit(g(i), st.threshold_key, st.max, st.log_sum) : NAN;
    }
  }
}

// ---- host side -------------------------------------------------------------------------------------

RowArgs make_row_args(const at::Tensor& logits, const std::optional<at::Tensor>& uncond,
                      double cfg_scale, double temperature, int64_t top_k, double top_p) {
  return RowArgs{logits.size(1), logits.stride(0), uncond.has_value() ? uncond->stride(0) : 0,
                 static_cast<float>(cfg_scale), static_cast<float>(temperature), top_k, top_p};
}

void check_cuda(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.is_cuda(), "logits must be a CUDA tensor for the cuda backend");
}

bool rows_16b_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * t.element_size()) % 16 == 0;
}

// Dynamic shared memory for one staged row (V float32 logits) of `kernel`, or 0 when the row does not
// fit in the device's opt-in shared memory beside the kernel's static shared memory.
template <typename Kernel>
size_t staged_row_bytes(Kernel kernel, int64_t v) {
  const size_t bytes = static_cast<size_t>(v) * sizeof(float);
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (bytes + attr.sharedSizeBytes > static_cast<size_t>(optin)) return 0;
  if (bytes > 48 * 1024) {  // above the default limit the kernel must opt in
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
  return bytes;
}

PoolVariant pool_variant(int64_t variant) {
  TORCH_CHECK_VALUE(is_pool_variant(variant), "variant must be " SPECDEC_POOL_VARIANTS ", got ", variant);
  return static_cast<PoolVariant>(variant);
}

PoolOut pool_probs_launch(const at::Tensor& logits, const at::Tensor& tokens,
                          const std::optional<at::Tensor>& neighbors,
                          const std::optional<at::Tensor>& uncond_logits, double cfg_scale, double temperature,
                          int64_t top_k, std::optional<double> delta, double top_p, PoolVariant variant) {
  check_pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta,
                  top_p);
  check_cuda(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor pooled = at::empty({n}, opts), p_token = at::empty({n}, opts),
             row_max = at::empty({n}, opts), row_lse = at::empty({n}, opts);
  if (n == 0) return {pooled, p_token, row_max, row_lse};
  const RowArgs a = make_row_args(logits, uncond_logits, cfg_scale, temperature, top_k, top_p);
  const float d = delta.has_value() ? static_cast<float>(*delta) : INFINITY;
  const int64_t k = neighbors.has_value() ? neighbors->size(1) : 0;
  const PoolOutPtrs out{pooled.data_ptr<float>(), p_token.data_ptr<float>(), row_max.data_ptr<float>(),
                        row_lse.data_ptr<float>()};
  const bool vectorized = rows_16b_aligned(logits) && (!uncond_logits || rows_16b_aligned(*uncond_logits));
  const bool t64 = tokens.scalar_type() == at::kLong;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pool_probs_cuda", [&] {
    const scalar_t* lg = logits.data_ptr<scalar_t>();
    const scalar_t* u = uncond_logits.has_value() ? uncond_logits->data_ptr<scalar_t>() : nullptr;
    auto launch = [&](auto* nb) {
      using Nb = std::remove_const_t<std::remove_pointer_t<decltype(nb)>>;
      if (variant == PoolVariant::kRadix) {
        const size_t smem = staged_row_bytes(pool_probs_radix_kernel<scalar_t, Nb, true>, a.v);
        if (smem > 0) {
          pool_probs_radix_kernel<scalar_t, Nb, true><<<n, kThreads, smem, stream>>>(
              lg, u, a, vectorized, tokens.data_ptr(), t64, tokens.stride(0), nb, k, d, out);
        } else {
          pool_probs_radix_kernel<scalar_t, Nb, false><<<n, kThreads, 0, stream>>>(
              lg, u, a, vectorized, tokens.data_ptr(), t64, tokens.stride(0), nb, k, d, out);
        }
        return;
      }
      const size_t smem =
          variant == PoolVariant::kStaged ? staged_row_bytes(pool_probs_smem_kernel<scalar_t, Nb>, a.v) : 0;
      if (smem > 0) {
        pool_probs_smem_kernel<scalar_t, Nb><<<n, kThreads, smem, stream>>>(
            lg, u, a, vectorized, tokens.data_ptr(), t64, tokens.stride(0), nb, k, d, out);
      } else {
        pool_probs_kernel<scalar_t, Nb><<<n, kThreads, 0, stream>>>(
            lg, u, a, tokens.data_ptr(), t64, tokens.stride(0), nb, k, d, out);
      }
    };
    if (!neighbors.has_value()) {
      launch(static_cast<const int32_t*>(nullptr));
    } else if (neighbors->scalar_type() == at::kShort) {
      launch(static_cast<const int16_t*>(neighbors->data_ptr<int16_t>()));
    } else {
      launch(static_cast<const int32_t*>(neighbors->data_ptr<int32_t>()));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {pooled, p_token, row_max, row_lse};
}

at::Tensor sampling_probs_launch(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                                 double cfg_scale, double temperature, int64_t top_k, double top_p,
                                 PoolVariant variant) {
  check_pool_args(logits, std::nullopt, std::nullopt, uncond_logits, cfg_scale, temperature, top_k,
                  std::nullopt, top_p);
  check_cuda(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0);
  at::Tensor probs = at::empty({n, logits.size(1)}, logits.options().dtype(at::kFloat));
  if (n == 0) return probs;
  const RowArgs a = make_row_args(logits, uncond_logits, cfg_scale, temperature, top_k, top_p);
  const bool vectorized = rows_16b_aligned(logits) && (!uncond_logits || rows_16b_aligned(*uncond_logits));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sampling_probs_cuda", [&] {
    const scalar_t* lg = logits.data_ptr<scalar_t>();
    const scalar_t* u = uncond_logits.has_value() ? uncond_logits->data_ptr<scalar_t>() : nullptr;
    float* p = probs.data_ptr<float>();
    if (variant == PoolVariant::kRadix) {
      const size_t smem = staged_row_bytes(sampling_probs_radix_kernel<scalar_t, true>, a.v);
      if (smem > 0) {
        sampling_probs_radix_kernel<scalar_t, true><<<n, kThreads, smem, stream>>>(lg, u, a, vectorized, p);
      } else {
        sampling_probs_radix_kernel<scalar_t, false><<<n, kThreads, 0, stream>>>(lg, u, a, vectorized, p);
      }
      return;
    }
    const size_t smem =
        variant == PoolVariant::kStaged ? staged_row_bytes(sampling_probs_smem_kernel<scalar_t>, a.v) : 0;
    if (smem > 0) {
      sampling_probs_smem_kernel<scalar_t><<<n, kThreads, smem, stream>>>(lg, u, a, vectorized, p);
    } else {
      sampling_probs_kernel<scalar_t><<<n, kThreads, 0, stream>>>(lg, u, a, p);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return probs;
}

}  // namespace

PoolOut pool_probs_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                        const std::optional<at::Tensor>& neighbors,
                        const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                        double temperature, int64_t top_k, std::optional<double> delta,
                        double top_p) {
  return pool_probs_launch(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p,
                           PoolVariant::kStreamed);
}

PoolOut pool_probs_variant_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                                const std::optional<at::Tensor>& neighbors,
                                const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                                double temperature, int64_t top_k, std::optional<double> delta, double top_p,
                                int64_t variant) {
  return pool_probs_launch(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta, top_p,
                           pool_variant(variant));
}

at::Tensor sampling_probs_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                               double cfg_scale, double temperature, int64_t top_k, double top_p) {
  return sampling_probs_launch(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, PoolVariant::kStreamed);
}

at::Tensor sampling_probs_variant_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                                       double cfg_scale, double temperature, int64_t top_k, double top_p,
                                       int64_t variant) {
  return sampling_probs_launch(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, pool_variant(variant));
}

}  // namespace specdec
