// Entry points of specdec's C++ ops, one per (op, device). bindings.cpp registers them with
// torch.library; every schema lives there. Light headers only: this is included by .cu files.
#pragma once

#include <ATen/core/Tensor.h>

#include "specdec/verify_math.h"

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace specdec {

using PoolOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Shape/dtype/device/scalar checks of kernel 1, shared by the CPU and CUDA ops (no data read).
void check_pool_args(const at::Tensor& logits, const std::optional<at::Tensor>& tokens,
                     const std::optional<at::Tensor>& neighbors,
                     const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                     double temperature, int64_t top_k, std::optional<double> delta,
                     double top_p);

PoolOut pool_probs_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                       const std::optional<at::Tensor>& neighbors,
                       const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                       double temperature, int64_t top_k, std::optional<double> delta,
                       double top_p);
at::Tensor sampling_probs_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                              double cfg_scale, double temperature, int64_t top_k, double top_p);

// Kernel 2 (verify_grid, sample_residual); scalar math in specdec/verify_math.h.
using VerifyOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using SampleOut = std::tuple<at::Tensor, at::Tensor>;
VerifyConfig check_verify_args(const at::Tensor& p, const std::optional<at::Tensor>& q,
                               const std::optional<at::Tensor>& uniforms,
                               const std::optional<at::Tensor>& valid, std::string_view rule,
                               double tau, std::string_view mode, int64_t radius,
                               const std::optional<at::Tensor>& grid_errors);
void check_sample_args(const at::Tensor& p, const std::optional<at::Tensor>& q,
                       const std::optional<at::Tensor>& uniforms, int64_t offset,
                       const std::optional<at::Tensor>& row_errors);
// grid_errors [B] int32, when given: each grid's value-check code (verify_math.h, kNanP and others).
VerifyOut verify_grid_cpu(const at::Tensor& p, const std::optional<at::Tensor>& q,
                          const std::optional<at::Tensor>& uniforms,
                          const std::optional<at::Tensor>& valid, std::string_view rule,
                          double tau, std::string_view mode, int64_t radius,
                          const std::optional<at::Tensor>& grid_errors);
// uniforms None: row r draws its uniform from Philox (seed, r, offset), see verify_math.h.
// row_errors [M] int32, when given: each row's value-check code (verify_math.h, kBadP and others).
SampleOut sample_residual_cpu(const at::Tensor& p, const std::optional<at::Tensor>& q,
                              const std::optional<at::Tensor>& uniforms, int64_t seed,
                              int64_t offset, const std::optional<at::Tensor>& row_errors);

// The position-keyed exact sampler (race_sample, race_noise); math in specdec/race_math.h.
// Shape/dtype/device checks shared by the CPU and CUDA ops (no data read); `seed` is the bit
// pattern of the 64-bit seed; purposes None: every row's purpose is `purpose`.
void check_race_args(const at::Tensor& images, const at::Tensor& positions,
                     const std::optional<at::Tensor>& purposes, int64_t vocab);
void check_race_sample_args(const at::Tensor& p, const at::Tensor& images, const at::Tensor& positions,
                            const std::optional<at::Tensor>& purposes,
                            const std::optional<at::Tensor>& row_errors);
// row_errors [M] int32, when given: each row's value-check code (race_math.h, race::kBadP).
at::Tensor race_sample_cpu(const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                           const std::optional<at::Tensor>& purposes, int64_t purpose,
                           const std::optional<at::Tensor>& row_errors);
at::Tensor race_noise_cpu(int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                          const std::optional<at::Tensor>& purposes, int64_t purpose, int64_t vocab);

using AttentionOut = std::tuple<at::Tensor, at::Tensor>;

// Shape/dtype/device checks of kernel 3 (tree_attention), shared by the CPU and CUDA ops.
void check_tree_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& q_pos, const at::Tensor& kv_pos,
                               const std::optional<at::Tensor>& kv_valid,
                               const std::optional<at::Tensor>& tree_mask, std::optional<double> scale);

AttentionOut tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                const std::optional<at::Tensor>& kv_valid,
                                const std::optional<at::Tensor>& tree_mask, std::optional<double> scale);

#ifdef SPECDEC_WITH_CUDA
PoolOut pool_probs_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                        const std::optional<at::Tensor>& neighbors,
                        const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                        double temperature, int64_t top_k, std::optional<double> delta,
                        double top_p);
at::Tensor sampling_probs_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                               double cfg_scale, double temperature, int64_t top_k, double top_p);
VerifyOut verify_grid_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                           const std::optional<at::Tensor>& uniforms,
                           const std::optional<at::Tensor>& valid, std::string_view rule,
                           double tau, std::string_view mode, int64_t radius,
                           const std::optional<at::Tensor>& grid_errors);
SampleOut sample_residual_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                               const std::optional<at::Tensor>& uniforms, int64_t seed,
                               int64_t offset, const std::optional<at::Tensor>& row_errors);
// The opt-in pooling kernels, chosen from Python: `variant` 0 runs the default kernels above, 1 ("v2")
// stages each row in shared memory, 2 ("radix") stages it and selects top-k / top-p by radix select
// (csrc/include/specdec/cuda_block.cuh, PoolVariant). 1 and 2 have never run on a GPU.
PoolOut pool_probs_variant_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                                const std::optional<at::Tensor>& neighbors,
                                const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                                double temperature, int64_t top_k, std::optional<double> delta, double top_p,
                                int64_t variant);
at::Tensor sampling_probs_variant_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                                       double cfg_scale, double temperature, int64_t top_k, double top_p,
                                       int64_t variant);
SampleOut sample_residual_variant_cuda(const at::Tensor& p, const std::optional<at::Tensor>& q,
                                       const std::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset,
                                       int64_t variant, const std::optional<at::Tensor>& row_errors);
at::Tensor race_sample_cuda(const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                            const std::optional<at::Tensor>& purposes, int64_t purpose,
                            const std::optional<at::Tensor>& row_errors);
at::Tensor race_noise_cuda(int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                           const std::optional<at::Tensor>& purposes, int64_t purpose, int64_t vocab);
AttentionOut tree_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                 const std::optional<at::Tensor>& kv_valid,
                                 const std::optional<at::Tensor>& tree_mask, std::optional<double> scale);
// The opt-in attention kernel (csrc/cuda/tree_attention_split.cu): GQA heads packed into M,
// keys split `splits` ways; warps_m 1 is the decode block, 4 the prefill block.
AttentionOut tree_attention_split_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                       const std::optional<at::Tensor>& kv_valid,
                                       const std::optional<at::Tensor>& tree_mask, std::optional<double> scale,
                                       int64_t warps_m, int64_t splits);
// (dtype, padded head dim, warps_m, dynamic shared-memory bytes, keys per step) of every
// instantiation of that kernel, for benchmarks/machine/machine_code.py's report.
using SplitConfig = std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>;
std::vector<SplitConfig> tree_attention_split_configs();
#endif

}  // namespace specdec
