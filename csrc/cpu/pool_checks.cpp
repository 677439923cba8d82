// Argument checks of kernel 1 (docs/design.md, "Kernel 1"), shared by the CPU and CUDA ops.
// TORCH_CHECK_VALUE raises a Python ValueError; every message names the argument.
#include <c10/util/Exception.h>

#include <cmath>

#include "specdec_ops.h"

namespace specdec {

namespace {
bool is_float_logits(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}
}  // namespace

void check_pool_args(const at::Tensor& logits, const std::optional<at::Tensor>& tokens,
                     const std::optional<at::Tensor>& neighbors,
                     const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                     double temperature, int64_t top_k, std::optional<double> delta,
                     double top_p) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be 2-D [N, V], got ", logits.dim(), "-D");
  TORCH_CHECK_VALUE(is_float_logits(logits.scalar_type()),
                    "logits must be float32, float16 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(logits.size(1) >= 1, "logits must have V >= 1 columns");
  TORCH_CHECK_VALUE(logits.size(1) <= INT32_MAX, "logits: V must fit in int32");
  TORCH_CHECK_VALUE(logits.stride(1) == 1, "logits must be contiguous along V (stride(1) == 1)");
  const int64_t n = logits.size(0);
  const int64_t v = logits.size(1);
  if (tokens.has_value()) {
    const at::Tensor& t = *tokens;
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, "tokens must have shape [N] = [", n,
                      "], got ", t.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                      "tokens must be int32 or int64, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == logits.device(), "tokens must be on ", logits.device(),
                      " like logits, got ", t.device());
  }
  if (uncond_logits.has_value()) {
    const at::Tensor& u = *uncond_logits;
    TORCH_CHECK_VALUE(u.sizes() == logits.sizes(), "uncond_logits must have the shape of logits ",
                      logits.sizes(), ", got ", u.sizes());
    TORCH_CHECK_VALUE(u.scalar_type() == logits.scalar_type(),
                      "uncond_logits must have the dtype of logits (", logits.scalar_type(),
                      "), got ", u.scalar_type());
    TORCH_CHECK_VALUE(u.device() == logits.device(), "uncond_logits must be on ",
                      logits.device(), ", got ", u.device());
    TORCH_CHECK_VALUE(u.stride(1) == 1, "uncond_logits must be contiguous along V");
  }
  if (neighbors.has_value()) {
    const at::Tensor& nb = *neighbors;
    TORCH_CHECK_VALUE(nb.dim() == 2 && nb.size(0) == v, "neighbors must have shape [V, K] with V = ",
                      v, ", got ", nb.sizes());
    TORCH_CHECK_VALUE(nb.scalar_type() == at::kInt || nb.scalar_type() == at::kShort,
                      "neighbors must be int32 (or int16 when V <= 32767), got ", nb.scalar_type());
    TORCH_CHECK_VALUE(nb.scalar_type() != at::kShort || v <= 32767,
                      "neighbors: int16 tables need V <= 32767, got V = ", v);
    TORCH_CHECK_VALUE(nb.device() == logits.device(), "neighbors must be on ", logits.device(),
                      ", got ", nb.device());
    TORCH_CHECK_VALUE(nb.is_contiguous(), "neighbors must be contiguous");
  }
  TORCH_CHECK_VALUE(std::isfinite(cfg_scale), "cfg_scale must be finite, got ", cfg_scale);
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0,
                    "temperature must be positive and finite, got ", temperature);
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be >= 0 (0 disables it), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "top_p must be a float in (0, 1] (1 disables it), got ",
                    top_p);
  if (delta.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*delta) && *delta >= 0.0,
                      "delta must be None or >= 0, got ", *delta);
  }
}

}  // namespace specdec
