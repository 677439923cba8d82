// sample_residual on CUDA (docs/design.md, "Kernel 2"): one thread block per row.
//
// Pass 1 sums the fixed-point residual units of the row (csrc/include/specdec/verify_math.h),
// and, only where that sum is zero, those of p (the fallback). Pass 2 walks the row in chunks of
// blockDim entries: an int64 block scan gives each entry's cumulative sum, the first entry above
// floor(u * total) is found with a block min, and the walk stops at the chunk holding it. The
// sums are integers, so the token is the one the sequential CPU loop and the reference pick.
// Without uniforms, row r's u comes from Philox (seed, r, offset) (philox_row_uniform in
// verify_math.h), the same numbers the CPU op draws.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "specdec/cuda_block.cuh"
#include "specdec/verify_math.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

constexpr int kThreads = 512;

struct SumOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a + b; }
};
struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

// Inclusive int64 prefix sum over the block in thread order; *total gets the block's sum.
__device__ int64_t block_inclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[cuda::kMaxWarps];
  const int lane = threadIdx.x % cuda::kWarp, warp = threadIdx.x / cuda::kWarp;
  const int nwarps = (blockDim.x + cuda::kWarp - 1) / cuda::kWarp;
#pragma unroll
  for (int o = 1; o < cuda::kWarp; o <<= 1) {
    const int64_t up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  __syncthreads();  // warp_sums may still be read by the previous call
  if (lane == cuda::kWarp - 1) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < cuda::kWarp; o <<= 1) {
      const int64_t up = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += up;
    }
    if (lane < nwarps) warp_sums[lane] = s;
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  *total = warp_sums[nwarps - 1];
  return v;
}

__device__ __forceinline__ int32_t units_at(const float* p, const float* q, bool from_p, int64_t i) {
  return from_p ? mass_units(p[i]) : residual_units(p[i], q[i]);
}

__global__ void __launch_bounds__(kThreads) sample_residual_kernel(
    const float* __restrict__ p_base, const float* __restrict__ q_base,
    const float* __restrict__ uniforms, int64_t seed, int64_t offset, int64_t v,
    int32_t* __restrict__ tokens, bool* __restrict__ fallback) {
  const int64_t r = blockIdx.x;
  const float* p = p_base + r * v;
  const float* q = q_base ? q_base + r * v : nullptr;
  int64_t total = 0;
  if (q != nullptr) {
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) total += residual_units(p[i], q[i]);
    total = cuda::block_reduce(total, SumOp(), int64_t{0});
  }
  const bool from_p = q == nullptr || total == 0;
  if (from_p) {
    total = 0;
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) total += mass_units(p[i]);
    total = cuda::block_reduce(total, SumOp(), int64_t{0});
  }
  const float u = uniforms != nullptr ? uniforms[r] : philox_row_uniform(seed, r, offset);
  const int64_t threshold = cdf_threshold(u, total);
  int64_t carry = 0, token = v - 1;  // v - 1 only when the row has no mass at all
  for (int64_t start = 0; start < v; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int64_t x = i < v ? units_at(p, q, from_p, i) : 0;
    int64_t chunk_total;
    const int64_t cum = carry + block_inclusive_scan(x, &chunk_total);
    if (carry + chunk_total > threshold) {  // uniform across the block: the crossing is here
      const int64_t hit = cuda::block_reduce(i < v && cum > threshold ? i : v, MinOp(), v);
      token = hit < v ? hit : v - 1;
      break;
    }
    carry += chunk_total;
  }
  if (threadIdx.x == 0) {
    tokens[r] = static_cast<int32_t>(token);
    fallback[r] = q != nullptr && from_p;
  }
}

}  // namespace

SampleOut sample_residual_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                               const std::optional<at::Tensor>& uniforms, int64_t seed,
                               int64_t offset) {
  check_sample_args(p, q, uniforms, offset);
  TORCH_CHECK_VALUE(p.is_cuda(), "p must be a CUDA tensor for the cuda backend");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t m = p.size(0), v = p.size(1);
  at::Tensor tokens = at::empty({m}, p.options().dtype(at::kInt));
  at::Tensor fallback = at::empty({m}, p.options().dtype(at::kBool));
  if (m == 0) return {tokens, fallback};
  sample_residual_kernel<<<m, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p.data_ptr<float>(), q.has_value() ? q->data_ptr<float>() : nullptr,
      uniforms.has_value() ? uniforms->data_ptr<float>() : nullptr, seed, offset, v,
      tokens.data_ptr<int32_t>(), fallback.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, fallback};
}

}  // namespace specdec
