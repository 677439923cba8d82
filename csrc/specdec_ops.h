// Entry points of specdec's C++ ops, one per (op, device). bindings.cpp registers them with
// torch.library; every schema lives there. Light headers only: this is included by .cu files.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace specdec {

using PoolOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Shape/dtype/device/scalar checks of kernel 1, shared by the CPU and CUDA ops (no data read).
void check_pool_args(const at::Tensor& logits, const std::optional<at::Tensor>& tokens,
                     const std::optional<at::Tensor>& neighbors,
                     const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                     double temperature, int64_t top_k, std::optional<double> delta);

PoolOut pool_probs_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                       const std::optional<at::Tensor>& neighbors,
                       const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                       double temperature, int64_t top_k, std::optional<double> delta);
at::Tensor sampling_probs_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                              double cfg_scale, double temperature, int64_t top_k);

#ifdef SPECDEC_WITH_CUDA
PoolOut pool_probs_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                        const std::optional<at::Tensor>& neighbors,
                        const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                        double temperature, int64_t top_k, std::optional<double> delta);
at::Tensor sampling_probs_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                               double cfg_scale, double temperature, int64_t top_k);
#endif

}  // namespace specdec
