// Argument checks of kernel 2 (docs/design.md, "Kernel 2"), shared by the CPU and CUDA ops.
// TORCH_CHECK_VALUE raises a Python ValueError; every message names the argument. No data is
// read here: the kernels check the values in their own pass (sample_residual's row_errors).
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "specdec_ops.h"

namespace specdec {

namespace {

void check_like(const std::optional<at::Tensor>& t, const at::Tensor& p, const char* name,
                at::ScalarType dtype) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->sizes() == p.sizes(), name, " must have the shape of p ", p.sizes(),
                    ", got ", t->sizes());
  TORCH_CHECK_VALUE(t->scalar_type() == dtype, name, " must be ", dtype, ", got ",
                    t->scalar_type());
  TORCH_CHECK_VALUE(t->device() == p.device(), name, " must be on ", p.device(), " like p, got ",
                    t->device());
  TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous");
}

// The optional [rows] int32 output of the value-check codes.
void check_codes(const std::optional<at::Tensor>& codes, const char* name, int64_t rows,
                 const at::Tensor& p) {
  if (!codes.has_value()) return;
  TORCH_CHECK_VALUE(codes->dim() == 1 && codes->size(0) == rows, name, " must have shape [", rows,
                    "], got ", codes->sizes());
  TORCH_CHECK_VALUE(codes->scalar_type() == at::kInt, name, " must be int32, got ", codes->scalar_type());
  TORCH_CHECK_VALUE(codes->device() == p.device(), name, " must be on ", p.device(), ", got ",
                    codes->device());
  TORCH_CHECK_VALUE(codes->is_contiguous(), name, " must be contiguous");
}

}  // namespace

VerifyConfig check_verify_args(const at::Tensor& p, const std::optional<at::Tensor>& q,
                               const std::optional<at::Tensor>& uniforms,
                               const std::optional<at::Tensor>& valid, std::string_view rule,
                               double tau, std::string_view mode, int64_t radius,
                               const std::optional<at::Tensor>& grid_errors) {
  TORCH_CHECK_VALUE(p.dim() == 3, "p must be 3-D [B, H, W], got ", p.dim(), "-D");
  TORCH_CHECK_VALUE(p.scalar_type() == at::kFloat, "p must be float32, got ", p.scalar_type());
  TORCH_CHECK_VALUE(p.size(1) >= 1 && p.size(2) >= 1, "p: grids must be at least 1x1, got ",
                    p.sizes());
  TORCH_CHECK_VALUE(p.size(1) * p.size(2) < (int64_t{1} << 31), "p: H * W must fit in int32");
  TORCH_CHECK_VALUE(p.is_contiguous(), "p must be contiguous");
  check_like(q, p, "q", at::kFloat);
  check_like(uniforms, p, "uniforms", at::kFloat);
  check_like(valid, p, "valid", at::kBool);
  VerifyConfig cfg{};
  if (rule == "threshold") {
    cfg.rule = VerifyRule::kThreshold;
    TORCH_CHECK_VALUE(std::isfinite(tau), "tau must be finite for rule='threshold', got ", tau);
  } else if (rule == "ratio") {
    cfg.rule = VerifyRule::kRatio;
    TORCH_CHECK_VALUE(q.has_value(), "q (the draft probabilities) is required for rule='ratio'");
    TORCH_CHECK_VALUE(uniforms.has_value(), "uniforms are required for rule='ratio'");
  } else {
    TORCH_CHECK_VALUE(false, "rule must be 'threshold' or 'ratio', got '", std::string(rule), "'");
  }
  if (mode == "raster") {
    cfg.mode = VerifyMode::kRaster;
  } else if (mode == "independent") {
    cfg.mode = VerifyMode::kIndependent;
  } else if (mode == "local") {
    cfg.mode = VerifyMode::kLocal;
  } else {
    TORCH_CHECK_VALUE(false, "mode must be 'raster', 'independent' or 'local', got '",
                      std::string(mode), "'");
  }
  TORCH_CHECK_VALUE(radius >= 0, "radius must be >= 0, got ", radius);
  check_codes(grid_errors, "grid_errors", p.size(0), p);
  cfg.tau = static_cast<float>(tau);
  // A window wider than the grid covers it all; clamping keeps index arithmetic in range.
  cfg.radius = static_cast<int32_t>(std::min<int64_t>(radius, std::max(p.size(1), p.size(2))));
  return cfg;
}

void check_sample_args(const at::Tensor& p, const std::optional<at::Tensor>& q,
                       const std::optional<at::Tensor>& uniforms, int64_t offset,
                       const std::optional<at::Tensor>& row_errors) {
  TORCH_CHECK_VALUE(p.dim() == 2, "p must be 2-D [M, V], got ", p.dim(), "-D");
  TORCH_CHECK_VALUE(p.scalar_type() == at::kFloat, "p must be float32, got ", p.scalar_type());
  TORCH_CHECK_VALUE(p.size(1) >= 1 && p.size(1) < (int64_t{1} << 23),
                    "p must have 1 <= V < 2^23 columns, got ", p.size(1));
  TORCH_CHECK_VALUE(p.is_contiguous(), "p must be contiguous");
  if (q.has_value()) {
    TORCH_CHECK_VALUE(q->sizes() == p.sizes(), "q must have the shape of p ", p.sizes(), ", got ",
                      q->sizes());
    TORCH_CHECK_VALUE(q->scalar_type() == at::kFloat, "q must be float32, got ", q->scalar_type());
    TORCH_CHECK_VALUE(q->device() == p.device(), "q must be on ", p.device(), ", got ", q->device());
    TORCH_CHECK_VALUE(q->is_contiguous(), "q must be contiguous");
  }
  TORCH_CHECK_VALUE(offset >= 0, "offset (of the Philox counter) must be >= 0, got ", offset);
  check_codes(row_errors, "row_errors", p.size(0), p);
  if (!uniforms.has_value()) return;  // drawn in the kernel from Philox (seed, row, offset)
  TORCH_CHECK_VALUE(uniforms->dim() == 1 && uniforms->size(0) == p.size(0),
                    "uniforms must have shape [M] = [", p.size(0), "], got ", uniforms->sizes());
  TORCH_CHECK_VALUE(uniforms->scalar_type() == at::kFloat, "uniforms must be float32, got ",
                    uniforms->scalar_type());
  TORCH_CHECK_VALUE(uniforms->device() == p.device(), "uniforms must be on ", p.device(), ", got ",
                    uniforms->device());
  TORCH_CHECK_VALUE(uniforms->is_contiguous(), "uniforms must be contiguous");
}

}  // namespace specdec
