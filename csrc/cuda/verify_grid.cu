// Kernel 2 on CUDA: parallel 2-D acceptance/rejection (docs/design.md, "Kernel 2").
//
// One thread block per grid, one launch for the batch. Phases, separated by __syncthreads:
//   1. rejection flags and the first rejected raster index (block min);
//   2. mode="local": separable Chebyshev dilation (row window, then column window);
//   3. resample/accept, island labels initialised to the pixel's own index;
//   4. union-find over the 8-neighbourhood with atomicMin hooking (Playne & Hawick 2018): each
//      pixel unites with its four earlier neighbours, the larger root always hooked under the
//      smaller, so every root is its component's smallest raster index; a bounded amount of
//      work per pixel, independent of the island shape (no propagation until convergence);
//   5. flattening: every pixel points at its root; roots are counted (block sum).
// Labels live in the `islands` output itself (global memory, read with ld.volatile so that
// hooks done by other threads are seen).
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

struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};
struct SumOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a + b; }
};

__device__ __forceinline__ int32_t load_label(const int32_t* labels, int32_t i) {
  return *reinterpret_cast<const volatile int32_t*>(labels + i);
}

__device__ int32_t find_root(const int32_t* labels, int32_t x) {
  int32_t parent = load_label(labels, x);
  while (parent != x) {
    x = parent;
    parent = load_label(labels, x);
  }
  return x;
}

__device__ void unite(int32_t* labels, int32_t a, int32_t b) {
  while (true) {
    a = find_root(labels, a);
    b = find_root(labels, b);
    if (a == b) return;
    if (a > b) {
      const int32_t t = a;
      a = b;
      b = t;
    }
    // Hook root b under a; if b stopped being a root meanwhile, retry from what it points to.
    const int32_t old = atomicMin(labels + b, a);
    if (old == b) return;
    b = old;
  }
}

struct GridPtrs {
  const float* p;
  const float* q;
  const float* u;
  const bool* valid;
  bool* accept;
  bool* resample;
  int32_t* islands;
  uint8_t* rejected;     // scratch [B, H, W]
  uint8_t* row_window;   // scratch [B, H, W]
  int32_t* first_reject;
  int32_t* num_islands;
  int32_t* errors;       // [B] value-check codes, or nullptr
};

__global__ void __launch_bounds__(kThreads) verify_grid_kernel(GridPtrs g, int32_t h, int32_t w,
                                                               VerifyConfig cfg) {
  const int32_t n = h * w;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * n;
  const float* p = g.p + off;
  const bool* valid = g.valid ? g.valid + off : nullptr;
  uint8_t* rejected = g.rejected + off;
  uint8_t* row_window = g.row_window + off;
  bool* resample = g.resample + off;
  bool* accept = g.accept + off;
  int32_t* labels = g.islands + off;

  // 1. rejection flags and the first rejection.
  int64_t first = n;
  const bool ratio = cfg.rule == VerifyRule::kRatio;
  bool nan_p = false, nan_q = false, bad_u = false;  // the value checks, in the same pass
  for (int32_t u = threadIdx.x; u < n; u += blockDim.x) {
    const bool is_valid = valid == nullptr || valid[u];
    const bool rej = ratio ? rejected_by_ratio(p[u], g.q[off + u], g.u[off + u])
                           : rejected_by_threshold(p[u], cfg.tau);
    rejected[u] = is_valid && rej;
    if (is_valid && rej && u < first) first = u;
    if (g.errors != nullptr) {
      nan_p |= p[u] != p[u];
      if (ratio) {
        nan_q |= g.q[off + u] != g.q[off + u];
        bad_u |= bad_uniform(g.u[off + u]);
      }
    }
  }
  if (g.errors != nullptr) {  // uniform across the block: every thread votes
    const int32_t code = (__syncthreads_or(nan_p) ? kNanP : 0) | (__syncthreads_or(nan_q) ? kNanQ : 0) |
                         (__syncthreads_or(bad_u) ? kGridBadUniform : 0);
    if (threadIdx.x == 0) g.errors[blockIdx.x] = code;
  }
  first = cuda::block_reduce(first, MinOp(), static_cast<int64_t>(n));  // synchronises

  // 2. Chebyshev window of mode="local", separably.
  const int32_t r = cfg.radius;
  const bool local = cfg.mode == VerifyMode::kLocal && first < n;
  if (local) {
    for (int32_t u = threadIdx.x; u < n; u += blockDim.x) {
      const int32_t i = u / w, j = u % w;
      const int32_t lo = max(0, j - r), hi = min(w - 1, j + r);
      uint8_t any = 0;
      for (int32_t c = lo; c <= hi; ++c) any |= rejected[i * w + c];
      row_window[u] = any;
    }
    __syncthreads();
  }

  // 3. resample / accept; labels start as the pixel's own index.
  for (int32_t u = threadIdx.x; u < n; u += blockDim.x) {
    const bool is_valid = valid == nullptr || valid[u];
    bool rs;
    if (cfg.mode == VerifyMode::kRaster) {
      rs = is_valid && u >= first;
    } else if (cfg.mode == VerifyMode::kIndependent) {
      rs = rejected[u] != 0;
    } else if (local && is_valid && u >= first) {
      const int32_t i = u / w, j = u % w;
      const int32_t lo = max(0, i - r), hi = min(h - 1, i + r);
      uint8_t any = 0;
      for (int32_t row = lo; row <= hi; ++row) any |= row_window[row * w + j];
      rs = any != 0;
    } else {
      rs = false;
    }
    resample[u] = rs;
    accept[u] = is_valid && !rs;
    labels[u] = rs ? u : -1;
  }
  __syncthreads();

  // 4. union-find over the four earlier 8-neighbours (the later four unite with u themselves).
  for (int32_t u = threadIdx.x; u < n; u += blockDim.x) {
    if (!resample[u]) continue;
    const int32_t i = u / w, j = u % w;
    if (j > 0 && resample[u - 1]) unite(labels, u, u - 1);
    if (i > 0) {
      const int32_t up = u - w;
      if (j > 0 && resample[up - 1]) unite(labels, u, up - 1);
      if (resample[up]) unite(labels, u, up);
      if (j + 1 < w && resample[up + 1]) unite(labels, u, up + 1);
    }
  }
  __syncthreads();

  // 5. flatten and count roots. Concurrent writes only replace a pointer by its root, so every
  // find still ends at the right root.
  int64_t roots = 0;
  for (int32_t u = threadIdx.x; u < n; u += blockDim.x) {
    if (!resample[u]) continue;
    const int32_t root = find_root(labels, u);
    labels[u] = root;
    roots += root == u;
  }
  roots = cuda::block_reduce(roots, SumOp(), int64_t{0});
  if (threadIdx.x == 0) {
    g.first_reject[blockIdx.x] = static_cast<int32_t>(first);
    g.num_islands[blockIdx.x] = static_cast<int32_t>(roots);
  }
}

}  // namespace

VerifyOut verify_grid_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                           const std::optional<at::Tensor>& uniforms,
                           const std::optional<at::Tensor>& valid, std::string_view rule,
                           double tau, std::string_view mode, int64_t radius,
                           const std::optional<at::Tensor>& grid_errors) {
  const VerifyConfig cfg = check_verify_args(p, q, uniforms, valid, rule, tau, mode, radius, grid_errors);
  TORCH_CHECK_VALUE(p.is_cuda(), "p must be a CUDA tensor for the cuda backend");
  const c10::cuda::CUDAGuard guard(p.device());
  const int64_t b = p.size(0), h = p.size(1), w = p.size(2);
  at::Tensor accept = at::empty(p.sizes(), p.options().dtype(at::kBool));
  at::Tensor resample = at::empty(p.sizes(), p.options().dtype(at::kBool));
  at::Tensor islands = at::empty(p.sizes(), p.options().dtype(at::kInt));
  at::Tensor first_reject = at::empty({b}, p.options().dtype(at::kInt));
  at::Tensor num_islands = at::empty({b}, p.options().dtype(at::kInt));
  if (b == 0) return {accept, resample, first_reject, islands, num_islands};
  at::Tensor scratch = at::empty({2, b, h, w}, p.options().dtype(at::kByte));
  const bool ratio = cfg.rule == VerifyRule::kRatio;
  GridPtrs g{p.data_ptr<float>(),
             ratio ? q->data_ptr<float>() : nullptr,
             ratio ? uniforms->data_ptr<float>() : nullptr,
             valid.has_value() ? valid->data_ptr<bool>() : nullptr,
             accept.data_ptr<bool>(),
             resample.data_ptr<bool>(),
             islands.data_ptr<int32_t>(),
             scratch.data_ptr<uint8_t>(),
             scratch.data_ptr<uint8_t>() + b * h * w,
             first_reject.data_ptr<int32_t>(),
             num_islands.data_ptr<int32_t>(),
             grid_errors.has_value() ? grid_errors->data_ptr<int32_t>() : nullptr};
  verify_grid_kernel<<<b, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      g, static_cast<int32_t>(h), static_cast<int32_t>(w), cfg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept, resample, first_reject, islands, num_islands};
}

}  // namespace specdec
