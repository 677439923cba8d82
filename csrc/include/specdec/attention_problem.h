// The problem setup shared by the CPU and CUDA tree_attention kernels: the outputs, the inputs
// in the form the kernels read (positions widened to int64, masks contiguous), and one struct of
// pointers, strides and sizes. Host code only (ATen); the kernels take AttentionProblem by value.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace specdec {

struct AttentionProblem {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_sn;      // strides over (B, H, N); the stride over D is 1
  int64_t k_sb, k_sh, k_sn;
  int64_t v_sb, v_sh, v_sn;
  int64_t hq, group, nq, nk, d;
  int64_t words;                 // int32 words of one query's tree-mask row
  const int64_t* q_pos;          // [B, Nq]
  const int64_t* kv_pos;         // [B, Nk]
  const bool* kv_valid;          // [B, Nk], nullptr: all valid
  const int32_t* tree;           // [B, Nq, words], nullptr: no tree mask
  float scale_log2;              // scale * log2(e): scores are kept in base 2
  void* out;                     // [B, Hq, Nq, D] contiguous, dtype of q
  float* lse;                    // [B, Hq, Nq]
};

// The problem plus the tensors it points into, which must outlive the launch.
struct AttentionSetup {
  at::Tensor out, lse;
  at::Tensor q_pos, kv_pos, kv_valid, tree;
  AttentionProblem problem;
};

// Call after check_tree_attention_args. When out.numel() == 0 there is nothing to launch.
inline AttentionSetup setup_tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                           const std::optional<at::Tensor>& kv_valid,
                                           const std::optional<at::Tensor>& tree_mask,
                                           std::optional<double> scale) {
  const int64_t b = q.size(0), hq = q.size(1), nq = q.size(2), d = q.size(3);
  AttentionSetup s;
  s.out = at::empty({b, hq, nq, d}, q.options());
  s.lse = at::empty({b, hq, nq}, q.options().dtype(at::kFloat));
  if (s.out.numel() == 0) return s;
  // Positions are widened to int64 (lossless) so the kernels have one index type.
  s.q_pos = q_pos.to(at::kLong).contiguous();
  s.kv_pos = kv_pos.to(at::kLong).contiguous();
  if (kv_valid.has_value()) s.kv_valid = kv_valid->contiguous();
  if (tree_mask.has_value()) s.tree = tree_mask->contiguous();

  AttentionProblem& p = s.problem;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sn = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_sn = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_sn = v.stride(2);
  p.hq = hq;
  p.group = hq / k.size(1);
  p.nq = nq;
  p.nk = k.size(2);
  p.d = d;
  p.words = (nq + 31) / 32;
  p.q_pos = s.q_pos.data_ptr<int64_t>();
  p.kv_pos = s.kv_pos.data_ptr<int64_t>();
  p.kv_valid = s.kv_valid.defined() ? s.kv_valid.data_ptr<bool>() : nullptr;
  p.tree = s.tree.defined() ? s.tree.data_ptr<int32_t>() : nullptr;
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
  p.scale_log2 = static_cast<float>(sc * 1.4426950408889634);
  p.out = s.out.data_ptr();
  p.lse = s.lse.data_ptr<float>();
  return s;
}

}  // namespace specdec
