// Argument checks of kernel 3 (docs/design.md, "Kernel 3"), shared by the CPU and CUDA ops.
// TORCH_CHECK_VALUE raises a Python ValueError; every message names the argument. No data is read.
#include <c10/util/Exception.h>

#include <cmath>

#include "specdec_ops.h"

namespace specdec {

namespace {
bool is_attention_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_positions(const at::Tensor& pos, const char* name, int64_t b, int64_t n,
                     const at::Tensor& q) {
  TORCH_CHECK_VALUE(pos.dim() == 2 && pos.size(0) == b && pos.size(1) == n, name,
                    " must have shape [B, N] = [", b, ", ", n, "], got ", pos.sizes());
  TORCH_CHECK_VALUE(pos.scalar_type() == at::kInt || pos.scalar_type() == at::kLong, name,
                    " must be int32 or int64, got ", pos.scalar_type());
  TORCH_CHECK_VALUE(pos.device() == q.device(), name, " must be on ", q.device(), " like q, got ",
                    pos.device());
}
}  // namespace

void check_tree_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& q_pos, const at::Tensor& kv_pos,
                               const std::optional<at::Tensor>& kv_valid,
                               const std::optional<at::Tensor>& tree_mask, std::optional<double> scale) {
  TORCH_CHECK_VALUE(q.dim() == 4, "q must be 4-D [B, Hq, Nq, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, "k must be 4-D [B, Hkv, Nk, D], got ", k.sizes());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got k ", k.sizes(),
                    " and v ", v.sizes());
  TORCH_CHECK_VALUE(is_attention_dtype(q.scalar_type()), "q must be float32, float16 or bfloat16, got ",
                    q.scalar_type());
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(),
                    "), got ", k.scalar_type());
  TORCH_CHECK_VALUE(v.scalar_type() == q.scalar_type(), "v must have the dtype of q (", q.scalar_type(),
                    "), got ", v.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device(), "k must be on ", q.device(), " like q, got ", k.device());
  TORCH_CHECK_VALUE(v.device() == q.device(), "v must be on ", q.device(), " like q, got ", v.device());
  const int64_t b = q.size(0), hq = q.size(1), nq = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), nk = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == b && k.size(3) == d, "k must have shape [B, Hkv, Nk, D] with B=", b,
                    " and D=", d, " like q, got ", k.sizes());
  TORCH_CHECK_VALUE(hkv >= 1 && hq % hkv == 0, "q heads Hq=", hq,
                    " must be a multiple of k/v heads Hkv=", hkv, " (GQA needs Hq % Hkv == 0)");
  TORCH_CHECK_VALUE(d >= 1 && d <= 128, "q: head dim D must be in [1, 128], got ", d);
  TORCH_CHECK_VALUE(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
                    "q, k and v must be contiguous along D (stride(-1) == 1)");
  check_positions(q_pos, "q_pos", b, nq, q);
  check_positions(kv_pos, "kv_pos", b, nk, q);
  if (kv_valid.has_value()) {
    const at::Tensor& m = *kv_valid;
    TORCH_CHECK_VALUE(m.dim() == 2 && m.size(0) == b && m.size(1) == nk,
                      "kv_valid must have shape [B, Nk] = [", b, ", ", nk, "], got ", m.sizes());
    TORCH_CHECK_VALUE(m.scalar_type() == at::kBool, "kv_valid must be bool, got ", m.scalar_type());
    TORCH_CHECK_VALUE(m.device() == q.device(), "kv_valid must be on ", q.device(), ", got ", m.device());
  }
  if (tree_mask.has_value()) {
    const at::Tensor& t = *tree_mask;
    const int64_t words = (nq + 31) / 32;
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == b && t.size(1) == nq && t.size(2) == words,
                      "tree_mask must have shape [B, Nq, ceil(Nq/32)] = [", b, ", ", nq, ", ", words,
                      "], got ", t.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, "tree_mask must be int32 (packed bits), got ",
                      t.scalar_type());
    TORCH_CHECK_VALUE(nk >= nq, "tree_mask needs Nk >= Nq (the draft block is the last Nq key slots), got Nk=",
                      nk, ", Nq=", nq);
    TORCH_CHECK_VALUE(t.device() == q.device(), "tree_mask must be on ", q.device(), ", got ", t.device());
  }
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*scale), "scale must be finite, got ", *scale);
  }
}

}  // namespace specdec
