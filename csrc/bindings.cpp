// The one translation unit that includes torch/extension.h: op schemas, their CPU/CUDA
// registrations, and a tiny pybind11 module for build information.
//
// Every op lives in the `specdec` namespace of torch.library (torch.ops.specdec.*). Fake
// (meta) implementations are registered from Python, each by its op module in specdec/ops/.
// Scalars follow one order in every schema and in Python: cfg_scale, temperature, top_k, delta,
// top_p; top_p comes last so that it can default to 1.0 for callers that pass the others by position.
#include <torch/extension.h>
#include <torch/library.h>

#include "specdec_ops.h"

#ifndef SPECDEC_CUDA_ARCHS
#define SPECDEC_CUDA_ARCHS ""
#endif

TORCH_LIBRARY(specdec, m) {
  m.def(
      "pool_probs(Tensor logits, Tensor tokens, Tensor? neighbors, Tensor? uncond_logits, "
      "float cfg_scale, float temperature, int top_k, float? delta, float top_p=1.0) "
      "-> (Tensor pooled, Tensor p_token, Tensor row_max, Tensor row_lse)");
  m.def(
      "sampling_probs(Tensor logits, Tensor? uncond_logits, float cfg_scale, float temperature, "
      "int top_k, float top_p=1.0) -> Tensor");
  m.def(
      "verify_grid(Tensor p, Tensor? q, Tensor? uniforms, Tensor? valid, str rule, float tau, "
      "str resample_mode, int radius, Tensor(a!)? grid_errors=None) -> (Tensor accept, "
      "Tensor resample, Tensor first_reject, Tensor islands, Tensor num_islands)");
  // (verify_grid's mode is `resample_mode` in the schema: torch.compile's functionalization of the
  // mutable grid_errors passes every argument by name beside a `mode` of its own.)
  m.def(
      "sample_residual(Tensor p, Tensor? q, Tensor? uniforms, int seed, int offset, "
      "Tensor(a!)? row_errors=None) -> (Tensor tokens, Tensor fallback)");
  // The position-keyed exact sampler (docs/kernels/exact_sampling.md): `seed` is the 64-bit seed's
  // bit pattern; `purposes` None gives every row the purpose `purpose`.
  // Two schemas, because inductor cannot lower an op with one returned tensor and an optional
  // mutated argument (torch 2.14): `race_sample` (compiled graphs, the decoders) has none, and
  // `race_sample_checked` (the public op's value checks) writes each row's check code.
  m.def("race_sample(Tensor p, int seed, Tensor images, Tensor positions, Tensor? purposes, int purpose) -> Tensor");
  m.def(
      "race_sample_checked(Tensor p, int seed, Tensor images, Tensor positions, Tensor? purposes, int purpose, "
      "Tensor(a!) row_errors) -> Tensor");
  m.def("race_noise(int seed, Tensor images, Tensor positions, Tensor? purposes, int purpose, int vocab) -> Tensor");
  m.def(
      "tree_attention(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor kv_pos, Tensor? kv_valid, "
      "Tensor? tree_mask, float? scale) -> (Tensor out, Tensor lse)");
  // CUDA only: the pooling kernels chosen by `variant` (0 default, 1 "v2", 2 "radix"; 1 and 2 opt-in,
  // never run on a GPU). Python picks it (specdec/ops/dispatch.py, SPECDEC_CUDA_POOL); the ops above always
  // run the default kernels.
  m.def(
      "pool_probs_variant(Tensor logits, Tensor tokens, Tensor? neighbors, Tensor? uncond_logits, "
      "float cfg_scale, float temperature, int top_k, float? delta, float top_p, int variant) "
      "-> (Tensor pooled, Tensor p_token, Tensor row_max, Tensor row_lse)");
  m.def(
      "sampling_probs_variant(Tensor logits, Tensor? uncond_logits, float cfg_scale, float temperature, "
      "int top_k, float top_p, int variant) -> Tensor");
  m.def(
      "sample_residual_variant(Tensor p, Tensor? q, Tensor? uniforms, int seed, int offset, int variant) "
      "-> (Tensor tokens, Tensor fallback)");
  // CUDA only, opt-in (specdec/ops/attention.py, SPECDEC_ATTN_PATH): split-KV decode / tensor-core prefill.
  m.def(
      "tree_attention_split(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor kv_pos, Tensor? kv_valid, "
      "Tensor? tree_mask, float? scale, int warps_m, int splits) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("pool_probs", &specdec::pool_probs_cpu);
  m.impl("sampling_probs", &specdec::sampling_probs_cpu);
  m.impl("verify_grid", &specdec::verify_grid_cpu);
  m.impl("sample_residual", &specdec::sample_residual_cpu);
  m.impl("tree_attention", &specdec::tree_attention_cpu);
  m.impl("race_sample",
         [](const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
            const std::optional<at::Tensor>& purposes, int64_t purpose) {
           return specdec::race_sample_cpu(p, seed, images, positions, purposes, purpose, std::nullopt);
         });
  m.impl("race_sample_checked",
         [](const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
            const std::optional<at::Tensor>& purposes, int64_t purpose, at::Tensor& row_errors) {
           return specdec::race_sample_cpu(p, seed, images, positions, purposes, purpose, row_errors);
         });
  m.impl("race_noise", &specdec::race_noise_cpu);
}

#ifdef SPECDEC_WITH_CUDA
TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("pool_probs", &specdec::pool_probs_cuda);
  m.impl("tree_attention", &specdec::tree_attention_cuda);
  m.impl("tree_attention_split", &specdec::tree_attention_split_cuda);
  m.impl("sampling_probs", &specdec::sampling_probs_cuda);
  m.impl("verify_grid", &specdec::verify_grid_cuda);
  m.impl("sample_residual", &specdec::sample_residual_cuda);
  m.impl("race_sample",
         [](const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
            const std::optional<at::Tensor>& purposes, int64_t purpose) {
           return specdec::race_sample_cuda(p, seed, images, positions, purposes, purpose, std::nullopt);
         });
  m.impl("race_sample_checked",
         [](const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
            const std::optional<at::Tensor>& purposes, int64_t purpose, at::Tensor& row_errors) {
           return specdec::race_sample_cuda(p, seed, images, positions, purposes, purpose, row_errors);
         });
  m.impl("race_noise", &specdec::race_noise_cuda);
  m.impl("pool_probs_variant", &specdec::pool_probs_variant_cuda);
  m.impl("sampling_probs_variant", &specdec::sampling_probs_variant_cuda);
  // The variants never check values: a checked call runs the default kernel (sample_residual).
  m.impl("sample_residual_variant",
         [](const at::Tensor& p, const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& uniforms,
            int64_t seed, int64_t offset, int64_t variant) {
           return specdec::sample_residual_variant_cuda(p, q, uniforms, seed, offset, variant, std::nullopt);
         });
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
#ifdef SPECDEC_WITH_CUDA
  mod.attr("with_cuda") = true;
  mod.def("split_attention_configs", &specdec::tree_attention_split_configs,
          "(dtype, padded D, warps_m, dynamic shared bytes, keys per step) of the split attention kernel");
#else
  mod.attr("with_cuda") = false;
#endif
  mod.attr("cuda_archs") = std::string(SPECDEC_CUDA_ARCHS);
}
