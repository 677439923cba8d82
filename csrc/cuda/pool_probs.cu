// Kernel 1 on CUDA: fused probability pooling (docs/design.md, "Kernel 1").
//
// One thread block per logits row. The row is streamed from global memory: one pass for the
// softmax statistics (online max/sum, with the NaN/+inf check folded in), plus 32 counting
// passes of a bisection on the float bit pattern when top-k is on (exact k-th largest value,
// ties kept, no sort and no V-sized buffer). The neighbour prefix sums are a block scan over
// the K gathered probabilities. Nothing of size [N, V] is written by pool_probs.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "specdec/cuda_block.cuh"
#include "specdec/pool_math.h"
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
};

template <typename T>
__device__ __forceinline__ float logit_at(const T* cond, const T* uncond, const RowArgs& a,
                                          int64_t i) {
  return guided_logit(static_cast<float>(cond[i]), uncond ? static_cast<float>(uncond[i]) : 0.0f,
                      uncond != nullptr, a.cfg_scale, a.temperature);
}

struct RowSoftmax {
  bool ok;
  int32_t threshold_key;
  float max, lse;
};

// Steps 1-3 for the row at cond/uncond; identical result in every thread of the block.
template <typename T>
__device__ RowSoftmax row_softmax(const T* cond, const T* uncond, const RowArgs& a) {
  int32_t threshold_key = INT_MIN;
  const bool use_top_k = a.top_k > 0 && a.top_k < a.v;
  if (use_top_k) {
    int poison = 0;
    for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) poison |= is_poison(logit_at(cond, uncond, a, i));
    if (block_reduce(poison, cuda::OrOp(), 0)) return {false, 0, NAN, NAN};
    // Largest key t with count(key >= t) >= top_k is exactly the key of the k-th largest logit.
    int64_t lo = INT_MIN, hi = INT_MAX;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      int count = 0;
      for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
        count += ordered_key(logit_at(cond, uncond, a, i)) >= mid;
      }
      count = block_reduce(count, cuda::CountOp(), 0);
      if (count >= a.top_k) lo = mid; else hi = mid - 1;
    }
    threshold_key = static_cast<int32_t>(lo);
  }
  SoftmaxStats s{-INFINITY, 0.0f};
  int poison = 0;
  for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
    const float l = logit_at(cond, uncond, a, i);
    poison |= is_poison(l);
    if (kept_by_top_k(l, threshold_key)) s = softmax_stats_add(s, l);
  }
  poison = block_reduce(poison, cuda::OrOp(), 0);
  s = cuda::block_merge_stats(s);
  if (poison || s.max == -INFINITY) return {false, 0, NAN, NAN};
  return {true, threshold_key, s.max, softmax_lse(s)};
}

template <typename T, typename Nb>
__global__ void __launch_bounds__(kThreads) pool_probs_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a,
    const void* __restrict__ tokens, bool tokens_int64, int64_t tokens_stride,
    const Nb* __restrict__ neighbors, int64_t k, float delta, float* __restrict__ pooled,
    float* __restrict__ p_token, float* __restrict__ row_max, float* __restrict__ row_lse) {
  const int64_t r = blockIdx.x;
  const T* cond = logits + r * a.stride;
  const T* uncond = uncond_logits ? uncond_logits + r * a.ustride : nullptr;
  const int64_t x = tokens_int64 ? static_cast<const int64_t*>(tokens)[r * tokens_stride]
                                 : static_cast<const int32_t*>(tokens)[r * tokens_stride];
  // Out-of-range ids are rejected by the Python API; here they only must not read out of bounds.
  RowSoftmax st = (x >= 0 && x < a.v) ? row_softmax(cond, uncond, a) : RowSoftmax{false, 0, NAN, NAN};
  if (!st.ok) {
    if (threadIdx.x == 0) pooled[r] = p_token[r] = row_max[r] = row_lse[r] = NAN;
    return;
  }
  const float px = prob_from_logit(logit_at(cond, uncond, a, x), st.threshold_key, st.lse);
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
          p = prob_from_logit(logit_at(cond, uncond, a, y), st.threshold_key, st.lse);
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
    pooled[r] = ok ? px + moved : NAN;
    p_token[r] = ok ? px : NAN;
    row_max[r] = ok ? st.max : NAN;
    row_lse[r] = ok ? st.lse : NAN;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sampling_probs_kernel(
    const T* __restrict__ logits, const T* __restrict__ uncond_logits, RowArgs a,
    float* __restrict__ probs) {
  const int64_t r = blockIdx.x;
  const T* cond = logits + r * a.stride;
  const T* uncond = uncond_logits ? uncond_logits + r * a.ustride : nullptr;
  const RowSoftmax st = row_softmax(cond, uncond, a);
  float* out = probs + r * a.v;
  for (int64_t i = threadIdx.x; i < a.v; i += blockDim.x) {
    out[i] = st.ok ? prob_from_logit(logit_at(cond, uncond, a, i), st.threshold_key, st.lse) : NAN;
  }
}

RowArgs make_row_args(const at::Tensor& logits, const std::optional<at::Tensor>& uncond,
                      double cfg_scale, double temperature, int64_t top_k) {
  return RowArgs{logits.size(1), logits.stride(0), uncond.has_value() ? uncond->stride(0) : 0,
                 static_cast<float>(cfg_scale), static_cast<float>(temperature), top_k};
}

void check_cuda(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.is_cuda(), "logits must be a CUDA tensor for the cuda backend");
}

}  // namespace

PoolOut pool_probs_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                        const std::optional<at::Tensor>& neighbors,
                        const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                        double temperature, int64_t top_k, std::optional<double> delta) {
  check_pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta);
  check_cuda(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor pooled = at::empty({n}, opts), p_token = at::empty({n}, opts),
             row_max = at::empty({n}, opts), row_lse = at::empty({n}, opts);
  if (n == 0) return {pooled, p_token, row_max, row_lse};
  const RowArgs a = make_row_args(logits, uncond_logits, cfg_scale, temperature, top_k);
  const float d = delta.has_value() ? static_cast<float>(*delta) : INFINITY;
  const int64_t k = neighbors.has_value() ? neighbors->size(1) : 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pool_probs_cuda", [&] {
    const scalar_t* u = uncond_logits.has_value() ? uncond_logits->data_ptr<scalar_t>() : nullptr;
    auto launch = [&](auto* nb) {
      pool_probs_kernel<<<n, kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), u, a, tokens.data_ptr(), tokens.scalar_type() == at::kLong,
          tokens.stride(0), nb, k, d, pooled.data_ptr<float>(), p_token.data_ptr<float>(),
          row_max.data_ptr<float>(), row_lse.data_ptr<float>());
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

at::Tensor sampling_probs_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                               double cfg_scale, double temperature, int64_t top_k) {
  check_pool_args(logits, std::nullopt, std::nullopt, uncond_logits, cfg_scale, temperature, top_k,
                  std::nullopt);
  check_cuda(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0);
  at::Tensor probs = at::empty({n, logits.size(1)}, logits.options().dtype(at::kFloat));
  if (n == 0) return probs;
  const RowArgs a = make_row_args(logits, uncond_logits, cfg_scale, temperature, top_k);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sampling_probs_cuda", [&] {
    const scalar_t* u = uncond_logits.has_value() ? uncond_logits->data_ptr<scalar_t>() : nullptr;
    sampling_probs_kernel<<<n, kThreads, 0, stream>>>(logits.data_ptr<scalar_t>(), u, a,
                                                      probs.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return probs;
}

}  // namespace specdec
