// sample_residual on CUDA (docs/design.md, "Kernel 2"): one thread block per row.
//
// Pass 1 sums the fixed-point residual units of the row (csrc/include/specdec/verify_math.h),
// and, only where that sum is zero, those of p (the fallback). Pass 2 walks the row in chunks of
// blockDim entries: an int64 block scan gives each entry's cumulative sum, the first entry above
// floor(u * total) is found with a block min, and the walk stops at the chunk holding it. The
// sums are integers, so the token is the one the sequential CPU loop and the reference pick.
// Without uniforms, row r's u comes from Philox (seed, r, offset) (philox_row_uniform in
// verify_math.h), the same numbers the CPU op draws.
//
// v2 (sample_residual_variant with variant 1 "v2" or 2 "radix", chosen from Python: SPECDEC_CUDA_POOL;
// it has NEVER RUN ON A GPU, only compiled): pass 1 reads p and q once with 128-bit loads and stages
// the row's int32 units in shared memory; pass 2 walks tiles of 4 * blockDim staged units (each
// thread owns 4 consecutive ones, read as one 128-bit shared load), so DRAM sees the row once. Only
// a fallback row (residual all zero) reads p a second time. Rows whose units do not fit in the
// device's opt-in shared memory use v1. (There is no threshold to select here: "radix" runs v2.)
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

using SumOp = cuda::Int64SumOp;
using MinOp = cuda::Int64MinOp;

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
    int32_t* __restrict__ tokens, bool* __restrict__ fallback, int32_t* __restrict__ errors) {
  const int64_t r = blockIdx.x;
  const float* p = p_base + r * v;
  const float* q = q_base ? q_base + r * v : nullptr;
  const bool check = errors != nullptr;
  bool bad_p = false, mass = false, bad_q = false;  // the value checks, in the first read of the row
  int64_t total = 0;
  if (q != nullptr) {
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      total += residual_units(p[i], q[i]);
      if (check) {
        bad_p |= outside_unit(p[i]);
        mass |= has_mass(p[i]);
        bad_q |= outside_unit(q[i]);
      }
    }
    total = cuda::block_reduce(total, SumOp(), int64_t{0});
  }
  const bool from_p = q == nullptr || total == 0;
  if (from_p) {
    total = 0;
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      total += mass_units(p[i]);
      if (check && q == nullptr) {
        bad_p |= outside_unit(p[i]);
        mass |= has_mass(p[i]);
      }
    }
    total = cuda::block_reduce(total, SumOp(), int64_t{0});
  }
  float u = uniforms != nullptr ? uniforms[r] : philox_row_uniform(seed, r, offset);
  if (check) {  // every thread takes part in the block votes
    const int32_t code = (__syncthreads_or(bad_p) ? kBadP : 0) | (__syncthreads_or(mass) ? 0 : kPNoMass) |
                         (__syncthreads_or(bad_q) ? kBadQ : 0) | (bad_uniform(u) ? kBadUniform : 0);
    if (threadIdx.x == 0) errors[r] = code;
  }
  if (bad_uniform(u)) u = 0.0f;  // a defined token (the row is refused when checked)
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


// Stages the units of one row in sm[0, V) (residual units of p - q, or p's units when q is null)
// and returns the row total (every thread). `vectorized`: rows start on 16-byte boundaries.
__device__ int64_t stage_units(const float* __restrict__ p, const float* __restrict__ q, int64_t v,
                               bool vectorized, int32_t* sm) {
  int64_t total = 0, done = 0;
  if (vectorized) {
    const float4* p4 = reinterpret_cast<const float4*>(p);
    const float4* q4 = reinterpret_cast<const float4*>(q);
    for (int64_t j = threadIdx.x; j < v / 4; j += blockDim.x) {
      const float4 a = p4[j];
      int4 u;
      if (q != nullptr) {
        const float4 b = q4[j];
        u = make_int4(residual_units(a.x, b.x), residual_units(a.y, b.y), residual_units(a.z, b.z),
                      residual_units(a.w, b.w));
      } else {
        u = make_int4(mass_units(a.x), mass_units(a.y), mass_units(a.z), mass_units(a.w));
      }
      reinterpret_cast<int4*>(sm)[j] = u;
      total += static_cast<int64_t>(u.x) + u.y + u.z + u.w;
    }
    done = v / 4 * 4;
  }
  for (int64_t i = done + threadIdx.x; i < v; i += blockDim.x) {
    const int32_t u = q != nullptr ? residual_units(p[i], q[i]) : mass_units(p[i]);
    sm[i] = u;
    total += u;
  }
  __syncthreads();
  return cuda::block_reduce(total, SumOp(), int64_t{0});
}

__global__ void __launch_bounds__(kThreads) sample_residual_smem_kernel(
    const float* __restrict__ p_base, const float* __restrict__ q_base,
    const float* __restrict__ uniforms, int64_t seed, int64_t offset, int64_t v, bool vectorized,
    int32_t* __restrict__ tokens, bool* __restrict__ fallback) {
  extern __shared__ int4 staged[];  // int4: 16-byte alignment for the vector accesses
  int32_t* sm = reinterpret_cast<int32_t*>(staged);
  const int64_t r = blockIdx.x;
  const float* p = p_base + r * v;
  const float* q = q_base ? q_base + r * v : nullptr;
  int64_t total = stage_units(p, q, v, vectorized, sm);
  const bool from_p = q == nullptr || total == 0;
  if (q != nullptr && from_p) total = stage_units(p, nullptr, v, vectorized, sm);  // rare: re-read p
  const float u = uniforms != nullptr ? uniforms[r] : philox_row_uniform(seed, r, offset);
  const int64_t threshold = cdf_threshold(u, total);
  int64_t carry = 0, token = v - 1;  // v - 1 only when the row has no mass at all
  for (int64_t start = 0; start < v; start += 4 * static_cast<int64_t>(blockDim.x)) {
    const int64_t i0 = start + 4 * static_cast<int64_t>(threadIdx.x);
    int4 x = make_int4(0, 0, 0, 0);
    if (i0 + 3 < v) {
      x = reinterpret_cast<const int4*>(sm)[i0 / 4];
    } else {
      if (i0 < v) x.x = sm[i0];
      if (i0 + 1 < v) x.y = sm[i0 + 1];
      if (i0 + 2 < v) x.z = sm[i0 + 2];
    }
    const int64_t own = static_cast<int64_t>(x.x) + x.y + x.z + x.w;
    int64_t tile_total;
    const int64_t cum = carry + block_inclusive_scan(own, &tile_total);
    if (carry + tile_total > threshold) {  // uniform across the block: the crossing is here
      // Entries past V hold 0 units, so they never cross first.
      int64_t c = cum - own, hit = v;
      const int32_t xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c += xs[e];
        if (hit == v && c > threshold) hit = i0 + e;
      }
      hit = cuda::block_reduce(hit, MinOp(), v);
      token = hit < v ? hit : v - 1;
      break;
    }
    carry += tile_total;
  }
  if (threadIdx.x == 0) {
    tokens[r] = static_cast<int32_t>(token);
    fallback[r] = q != nullptr && from_p;
  }
}

// Dynamic shared memory for v2 (V int32 units), or 0 when the row does not fit.
size_t v2_shared_bytes(int64_t v) {
  const size_t bytes = static_cast<size_t>(v) * sizeof(int32_t);
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, sample_residual_smem_kernel));
  if (bytes + attr.sharedSizeBytes > static_cast<size_t>(optin)) return 0;
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(sample_residual_smem_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  return bytes;
}

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// With row_errors the default kernel runs whatever the variant: the value checks ride in its first
// read of each row.
SampleOut sample_residual_launch(const at::Tensor& p, const std::optional<at::Tensor>& q,
                                 const std::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset,
                                 PoolVariant variant, const std::optional<at::Tensor>& row_errors) {
  check_sample_args(p, q, uniforms, offset, row_errors);
  TORCH_CHECK_VALUE(p.is_cuda(), "p must be a CUDA tensor for the cuda backend");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t m = p.size(0), v = p.size(1);
  at::Tensor tokens = at::empty({m}, p.options().dtype(at::kInt));
  at::Tensor fallback = at::empty({m}, p.options().dtype(at::kBool));
  if (m == 0) return {tokens, fallback};
  const float* q_ptr = q.has_value() ? q->data_ptr<float>() : nullptr;
  const float* u_ptr = uniforms.has_value() ? uniforms->data_ptr<float>() : nullptr;
  auto stream = c10::cuda::getCurrentCUDAStream();
  int32_t* errors = row_errors.has_value() ? row_errors->data_ptr<int32_t>() : nullptr;
  const size_t smem = variant == PoolVariant::kStreamed || errors != nullptr ? 0 : v2_shared_bytes(v);
  if (smem > 0) {
    const bool vectorized = v % 4 == 0 && aligned_16(p.data_ptr()) && (q_ptr == nullptr || aligned_16(q_ptr));
    sample_residual_smem_kernel<<<m, kThreads, smem, stream>>>(
        p.data_ptr<float>(), q_ptr, u_ptr, seed, offset, v, vectorized, tokens.data_ptr<int32_t>(),
        fallback.data_ptr<bool>());
  } else {
    sample_residual_kernel<<<m, kThreads, 0, stream>>>(p.data_ptr<float>(), q_ptr, u_ptr, seed, offset, v,
                                                       tokens.data_ptr<int32_t>(), fallback.data_ptr<bool>(), errors);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, fallback};
}

}  // namespace

SampleOut sample_residual_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                               const std::optional<at::Tensor>& uniforms, int64_t seed,
                               int64_t offset, const std::optional<at::Tensor>& row_errors) {
  return sample_residual_launch(p, q, uniforms, seed, offset, PoolVariant::kStreamed, row_errors);
}

SampleOut sample_residual_variant_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                                       const std::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset,
                                       int64_t variant, const std::optional<at::Tensor>& row_errors) {
  TORCH_CHECK_VALUE(is_pool_variant(variant), "variant must be " SPECDEC_POOL_VARIANTS ", got ", variant);
  return sample_residual_launch(p, q, uniforms, seed, offset, static_cast<PoolVariant>(variant), row_errors);
}

}  // namespace specdec
