// Block-wide reductions and scans for specdec's CUDA kernels (warp shuffles + one shared array).
// Kept here instead of pulling CUB so the .cu files compile with light headers and the same
// code builds against CUDA 12 and 13 (whose CCCL include layout differs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "specdec/pool_math.h"

namespace specdec {

// Which kernels pool_probs, sampling_probs and sample_residual run on CUDA: the `variant` argument of
// the pool_probs_variant / sampling_probs_variant / sample_residual_variant ops, chosen in Python
// (specdec/ops/dispatch.py reads SPECDEC_CUDA_POOL; the plain ops always run kStreamed).
//   0 kStreamed: rows streamed from global memory, bisections: the default, run on H200s;
//   1 kStaged ("v2"): rows staged once in shared memory with 128-bit loads, bisections;
//   2 kRadix ("radix"): staged rows, radix-select thresholds (specdec/radix_select.cuh); rows too
//     large for shared memory stream with the same selection. sample_residual has no selection:
//     kRadix runs its kStaged kernel.
// kStaged and kRadix have been compiled (sm_80, sm_90a) and checked in SASS, never run on a GPU.
enum class PoolVariant : int64_t { kStreamed = 0, kStaged = 1, kRadix = 2 };
constexpr bool is_pool_variant(int64_t v) { return v >= 0 && v <= 2; }
#define SPECDEC_POOL_VARIANTS "0 (default: rows streamed), 1 (v2: rows staged in shared memory) or 2 (radix)"

namespace cuda {

constexpr int kWarp = 32;
constexpr int kMaxWarps = 32;

struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct CountOp {
  __device__ int operator()(int a, int b) const { return a + b; }
};
struct OrOp {
  __device__ int operator()(int a, int b) const { return a | b; }
};
struct Int64SumOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a + b; }
};
struct Int64MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduce over the whole block; every thread gets the result. `identity` fills missing warps.
// Must be called by all threads of the block (it synchronises).
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V identity) {
  __shared__ V partial[kMaxWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = (blockDim.x + kWarp - 1) / kWarp;
  v = warp_reduce(v, op);
  __syncthreads();  // `partial` may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < nwarps ? partial[lane] : identity;
  return warp_reduce(v, op);
}

__device__ __forceinline__ SoftmaxStats warp_merge_stats(SoftmaxStats s) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    SoftmaxStats other{__shfl_xor_sync(0xffffffffu, s.max, o),
                       __shfl_xor_sync(0xffffffffu, s.sum, o)};
    s = softmax_stats_merge(s, other);
  }
  return s;
}

__device__ inline SoftmaxStats block_merge_stats(SoftmaxStats s) {
  __shared__ float pmax[kMaxWarps], psum[kMaxWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = (blockDim.x + kWarp - 1) / kWarp;
  s = warp_merge_stats(s);
  __syncthreads();
  if (lane == 0) {
    pmax[warp] = s.max;
    psum[warp] = s.sum;
  }
  __syncthreads();
  s = lane < nwarps ? SoftmaxStats{pmax[lane], psum[lane]} : SoftmaxStats{-INFINITY, 0.0f};
  return warp_merge_stats(s);
}

// Inclusive prefix sum over the block in thread order; returns this thread's prefix and
// writes the block total to *total (for every thread).
__device__ inline float block_inclusive_scan(float v, float* total) {
  __shared__ float warp_sums[kMaxWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = (blockDim.x + kWarp - 1) / kWarp;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    float up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  __syncthreads();
  if (lane == kWarp - 1) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      float up = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += up;
    }
    if (lane < nwarps) warp_sums[lane] = w;  // inclusive scan of warp totals
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  *total = warp_sums[nwarps - 1];
  return v;
}

}  // namespace cuda
}  // namespace specdec
