// sample_residual on the CPU (docs/design.md, "Kernel 2"): one token per row by inverse-CDF
// sampling of the fixed-point residual (csrc/include/specdec/verify_math.h).
//
// This file checks the arguments, allocates the outputs and splits the rows across threads; the
// row kernel is in pool_kernels_body.h (vectorised, one build per CPU capability): one read of
// the row sums the residual units block by block (int64, exact in any order; falling back to p
// when they are all zero), the block sums locate the block where the cumulative sum passes
// floor(u * total), and only that block is read again. With row_errors, the first read also checks
// the row's values (verify_math.h, kBadP and others) and writes the row's code. Without uniforms, row r's u comes from
// Philox (seed, r, offset) (philox_row_uniform), the same numbers the CUDA kernel draws.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "pool_kernels.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

namespace specdec {

SampleOut sample_residual_cpu(const at::Tensor& p, const std::optional<at::Tensor>& q,
                              const std::optional<at::Tensor>& uniforms, int64_t seed,
                              int64_t offset, const std::optional<at::Tensor>& row_errors) {
  check_sample_args(p, q, uniforms, offset, row_errors);
  TORCH_CHECK_VALUE(p.device().is_cpu(), "p must be a CPU tensor for the cpu backend");
  const int64_t m = p.size(0), v = p.size(1);
  at::Tensor tokens = at::empty({m}, p.options().dtype(at::kInt));
  at::Tensor fallback = at::empty({m}, p.options().dtype(at::kBool));
  cpu::ResidualRows a;
  a.p = p.data_ptr<float>();
  a.q = q.has_value() ? q->data_ptr<float>() : nullptr;
  a.u = uniforms.has_value() ? uniforms->data_ptr<float>() : nullptr;
  a.m = m;
  a.v = v;
  a.seed = seed;
  a.offset = offset;
  a.tokens = tokens.data_ptr<int32_t>();
  a.fallback = fallback.data_ptr<bool>();
  a.errors = row_errors.has_value() ? row_errors->data_ptr<int32_t>() : nullptr;
  const cpu::Kernels& kern = cpu::kernels();
  at::parallel_for(0, m, grain_for(v), [&](int64_t begin, int64_t end) {
    kern.residual_rows(a, begin, end, cpu::thread_scratch(v));
  });
  return {tokens, fallback};
}

}  // namespace specdec
