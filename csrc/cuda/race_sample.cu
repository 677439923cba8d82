// race_sample and race_noise on CUDA (docs/kernels/exact_sampling.md): one thread block per row.
//
// Each thread walks the row with a stride of blockDim (coalesced loads of p), computes E with
// race_math.h's scalar lanes (the reference's float32 operations; this file, like every .cu of the
// build, is compiled with --fmad=false, and the divisions are __fdiv_rn), and keeps the smallest
// key E / p and the smallest E, each packed with its index into one int64: keys are >= 0 or +inf,
// whose float bits order like the floats, so the smallest packed value is the smallest key at its
// first index, and one block min reduction per row gives the reference's token. A row without a
// finite key takes the smallest E (the uniform fallback of the reference). The value checks
// (race_math.h, kBadP) ride in the same pass.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "specdec/cuda_block.cuh"
#include "specdec/race_math.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kNone = INT64_MAX;        // no entry yet
constexpr int32_t kInfBits = 0x7F800000;  // the bits of +inf

using Lanes = race::ScalarLanes;

__device__ __forceinline__ int64_t pack(float value, int64_t index) {
  return (static_cast<int64_t>(__float_as_int(value)) << 32) | index;
}

__device__ __forceinline__ uint64_t key_of(const int64_t* images, const int64_t* positions, const int64_t* purposes,
                                           int64_t purpose, uint64_t seed, int64_t r) {
  return race::row_key(seed, images[r], positions[r], purposes != nullptr ? purposes[r] : purpose);
}

__global__ void __launch_bounds__(kThreads) race_sample_kernel(
    const float* __restrict__ p_base, const int64_t* __restrict__ images, const int64_t* __restrict__ positions,
    const int64_t* __restrict__ purposes, int64_t purpose, uint64_t seed, int64_t v, int32_t* __restrict__ tokens,
    int32_t* __restrict__ errors) {
  const int64_t r = blockIdx.x;
  const float* p = p_base + r * v;
  const uint64_t key = key_of(images, positions, purposes, purpose, seed, r);
  int64_t best = kNone, least = kNone;
  bool bad = false;
  for (int64_t x = threadIdx.x; x < v; x += blockDim.x) {
    const float px = p[x];
    const float e = race::noise<Lanes>(static_cast<uint32_t>(x), key);
    if (px >= race::kPMin) best = min(best, pack(__fdiv_rn(e, px), x));
    least = min(least, pack(e, x));
    bad |= !(px >= 0.0f && px <= 1.0f);
  }
  best = cuda::block_reduce(best, cuda::Int64MinOp(), kNone);
  least = cuda::block_reduce(least, cuda::Int64MinOp(), kNone);
  if (errors != nullptr) {  // every thread takes part in the vote
    const bool any_bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) errors[r] = any_bad ? race::kBadP : 0;
  }
  if (threadIdx.x == 0) {
    const bool finite = (best >> 32) < kInfBits;  // kNone's high word is above +inf's too
    tokens[r] = static_cast<int32_t>((finite ? best : least) & 0xFFFFFFFF);
  }
}

__global__ void __launch_bounds__(kThreads) race_noise_kernel(
    const int64_t* __restrict__ images, const int64_t* __restrict__ positions, const int64_t* __restrict__ purposes,
    int64_t purpose, uint64_t seed, int64_t v, float* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const uint64_t key = key_of(images, positions, purposes, purpose, seed, r);
  for (int64_t x = threadIdx.x; x < v; x += blockDim.x) {
    out[r * v + x] = race::noise<Lanes>(static_cast<uint32_t>(x), key);
  }
}

const int64_t* purposes_ptr(const std::optional<at::Tensor>& purposes) {
  return purposes.has_value() ? purposes->data_ptr<int64_t>() : nullptr;
}

}  // namespace

at::Tensor race_sample_cuda(const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                            const std::optional<at::Tensor>& purposes, int64_t purpose,
                            const std::optional<at::Tensor>& row_errors) {
  check_race_sample_args(p, images, positions, purposes, row_errors);
  TORCH_CHECK_VALUE(p.is_cuda(), "p must be a CUDA tensor for the cuda backend");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t m = p.size(0), v = p.size(1);
  at::Tensor tokens = at::empty({m}, p.options().dtype(at::kInt));
  if (m == 0) return tokens;
  int32_t* errors = row_errors.has_value() ? row_errors->data_ptr<int32_t>() : nullptr;
  race_sample_kernel<<<m, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p.data_ptr<float>(), images.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), purposes_ptr(purposes), purpose,
      static_cast<uint64_t>(seed), v, tokens.data_ptr<int32_t>(), errors);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return tokens;
}

at::Tensor race_noise_cuda(int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                           const std::optional<at::Tensor>& purposes, int64_t purpose, int64_t vocab) {
  check_race_args(images, positions, purposes, vocab);
  TORCH_CHECK_VALUE(images.is_cuda(), "images must be a CUDA tensor for the cuda backend");
  const c10::cuda::CUDAGuard guard(images.device());
  const int64_t m = images.size(0);
  at::Tensor out = at::empty({m, vocab}, images.options().dtype(at::kFloat));
  if (m == 0) return out;
  race_noise_kernel<<<m, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      images.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), purposes_ptr(purposes), purpose,
      static_cast<uint64_t>(seed), vocab, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace specdec
