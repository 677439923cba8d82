// Kernel 1 on the CPU: fused probability pooling and the sampling distribution (docs/design.md,
// "Kernel 1"). This file checks the arguments, allocates the outputs and splits the rows across
// threads with at::parallel_for; the row kernels are pool_kernels_body.h, vectorised and compiled
// once per CPU capability (pool_kernels.h picks one at run time). Each thread reuses its scratch
// buffers across rows and calls (never an [N, V] buffer).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "output_cache.h"
#include "pool_kernels.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

cpu::LogitsType logits_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return cpu::LogitsType::kHalf;
    case at::kBFloat16:
      return cpu::LogitsType::kBFloat16;
    default:
      return cpu::LogitsType::kFloat;
  }
}

cpu::PoolRows rows_of(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                      double cfg_scale, double temperature, int64_t top_k, double top_p) {
  cpu::PoolRows a;
  a.cond = logits.data_ptr();
  a.cond_stride = logits.stride(0);
  if (uncond_logits.has_value()) {
    a.uncond = uncond_logits->data_ptr();
    a.uncond_stride = uncond_logits->stride(0);
  }
  a.dtype = logits_type(logits);
  a.n = logits.size(0);
  a.v = logits.size(1);
  a.cfg_scale = static_cast<float>(cfg_scale);
  a.temperature = static_cast<float>(temperature);
  a.top_k = top_k;
  a.top_p = top_p;
  return a;
}

// Work per row for the parallel grain: about ten element-operations per logit.
int64_t row_work(int64_t v) { return 10 * v; }

}  // namespace

PoolOut pool_probs_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                       const std::optional<at::Tensor>& neighbors,
                       const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                       double temperature, int64_t top_k, std::optional<double> delta,
                       double top_p) {
  check_pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta,
                  top_p);
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits must be a CPU tensor for the cpu backend");
  const int64_t n = logits.size(0), v = logits.size(1);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor pooled = at::empty({n}, opts), p_token = at::empty({n}, opts),
             row_max = at::empty({n}, opts), row_lse = at::empty({n}, opts);
  cpu::PoolRows a = rows_of(logits, uncond_logits, cfg_scale, temperature, top_k, top_p);
  a.tokens = tokens.data_ptr();
  a.tokens64 = tokens.scalar_type() == at::kLong;
  a.token_stride = tokens.stride(0);
  if (neighbors.has_value()) {
    a.neighbors = neighbors->data_ptr();
    a.neighbors16 = neighbors->scalar_type() == at::kShort;
    a.k = neighbors->size(1);
  }
  a.delta = delta.has_value() ? static_cast<float>(*delta) : INFINITY;
  a.pooled = pooled.data_ptr<float>();
  a.p_token = p_token.data_ptr<float>();
  a.row_max = row_max.data_ptr<float>();
  a.row_lse = row_lse.data_ptr<float>();

  const cpu::Kernels& kern = cpu::kernels();
  std::atomic<int64_t> bad_token{-1}, bad_neighbor{-1};
  at::parallel_for(0, n, grain_for(row_work(v)), [&](int64_t begin, int64_t end) {
    const cpu::RowErrors e = kern.pool_rows(a, begin, end, cpu::thread_scratch(v));
    if (e.bad_token >= 0) bad_token.store(e.bad_token);
    if (e.bad_neighbor >= 0) bad_neighbor.store(e.bad_neighbor);
  });
  TORCH_CHECK_VALUE(bad_token.load() < 0, "tokens: id out of range [0, ", v, ") at row ",
                    bad_token.load());
  TORCH_CHECK_VALUE(bad_neighbor.load() < 0, "neighbors: row ", bad_neighbor.load(),
                    " holds an id out of range [0, ", v, ")");
  return {pooled, p_token, row_max, row_lse};
}

at::Tensor sampling_probs_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                              double cfg_scale, double temperature, int64_t top_k, double top_p) {
  check_pool_args(logits, std::nullopt, std::nullopt, uncond_logits, cfg_scale, temperature, top_k,
                  std::nullopt, top_p);
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits must be a CPU tensor for the cpu backend");
  const int64_t n = logits.size(0), v = logits.size(1);
  // Every element of every row is written (NaN rows too), as the reused block requires.
  at::Tensor probs = cpu::empty_reused_output({n, v});
  cpu::PoolRows a = rows_of(logits, uncond_logits, cfg_scale, temperature, top_k, top_p);
  a.probs = probs.data_ptr<float>();
  const cpu::Kernels& kern = cpu::kernels();
  at::parallel_for(0, n, grain_for(row_work(v)), [&](int64_t begin, int64_t end) {
    kern.sampling_rows(a, begin, end, cpu::thread_scratch(v));
  });
  return probs;
}

}  // namespace specdec
