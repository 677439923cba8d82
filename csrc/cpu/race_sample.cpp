// race_sample and race_noise on the CPU (docs/kernels/exact_sampling.md): the argument checks
// shared with the CUDA ops, and the CPU entry points. The row kernels are in race_kernels_body.h
// (vectorised, one build per instruction set); rows are split across threads.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "race_kernels.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

namespace specdec {

namespace {

constexpr int64_t kMaxVocab = int64_t{1} << 23;  // as sample_residual: ids and counters fit easily
// Element-operations of one entry (hash, logarithm, two divisions): the grain of parallel_for.
constexpr int64_t kEntryCost = 16;

void check_index(const std::optional<at::Tensor>& t, const char* name, int64_t rows, const at::Tensor& like) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows, name, " must have shape [", rows, "], got ",
                    t->sizes());
  TORCH_CHECK_VALUE(t->scalar_type() == at::kLong, name, " must be int64, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->device() == like.device(), name, " must be on ", like.device(), ", got ", t->device());
  TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous");
}

cpu::RaceRows rows_of(uint64_t seed, const at::Tensor& images, const at::Tensor& positions,
                      const std::optional<at::Tensor>& purposes, int64_t purpose, int64_t v) {
  cpu::RaceRows a;
  a.images = images.data_ptr<int64_t>();
  a.positions = positions.data_ptr<int64_t>();
  a.purposes = purposes.has_value() ? purposes->data_ptr<int64_t>() : nullptr;
  a.purpose = purpose;
  a.seed = seed;
  a.m = images.size(0);
  a.v = v;
  return a;
}

}  // namespace

void check_race_args(const at::Tensor& images, const at::Tensor& positions,
                     const std::optional<at::Tensor>& purposes, int64_t vocab) {
  TORCH_CHECK_VALUE(images.dim() == 1, "images must be 1-D [M], got ", images.dim(), "-D");
  const int64_t m = images.size(0);
  check_index(images, "images", m, images);
  check_index(positions, "positions", m, images);
  check_index(purposes, "purposes", m, images);
  TORCH_CHECK_VALUE(vocab >= 1 && vocab < kMaxVocab, "the vocabulary must have 1 <= V < 2^23 entries, got ",
                    vocab);
}

void check_race_sample_args(const at::Tensor& p, const at::Tensor& images, const at::Tensor& positions,
                            const std::optional<at::Tensor>& purposes,
                            const std::optional<at::Tensor>& row_errors) {
  TORCH_CHECK_VALUE(p.dim() == 2, "p must be 2-D [M, V], got ", p.dim(), "-D");
  TORCH_CHECK_VALUE(p.scalar_type() == at::kFloat, "p must be float32, got ", p.scalar_type());
  TORCH_CHECK_VALUE(p.is_contiguous(), "p must be contiguous");
  TORCH_CHECK_VALUE(images.dim() == 1 && images.size(0) == p.size(0), "images must have shape [M] = [",
                    p.size(0), "], got ", images.sizes());
  TORCH_CHECK_VALUE(images.device() == p.device(), "images must be on ", p.device(), " like p, got ",
                    images.device());
  check_race_args(images, positions, purposes, p.size(1));
  if (row_errors.has_value()) {
    TORCH_CHECK_VALUE(row_errors->dim() == 1 && row_errors->size(0) == p.size(0), "row_errors must have shape [",
                      p.size(0), "], got ", row_errors->sizes());
    TORCH_CHECK_VALUE(row_errors->scalar_type() == at::kInt, "row_errors must be int32, got ",
                      row_errors->scalar_type());
    TORCH_CHECK_VALUE(row_errors->device() == p.device(), "row_errors must be on ", p.device(), ", got ",
                      row_errors->device());
    TORCH_CHECK_VALUE(row_errors->is_contiguous(), "row_errors must be contiguous");
  }
}

at::Tensor race_sample_cpu(const at::Tensor& p, int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                           const std::optional<at::Tensor>& purposes, int64_t purpose,
                           const std::optional<at::Tensor>& row_errors) {
  check_race_sample_args(p, images, positions, purposes, row_errors);
  TORCH_CHECK_VALUE(p.device().is_cpu(), "p must be a CPU tensor for the cpu backend");
  const int64_t m = p.size(0), v = p.size(1);
  at::Tensor tokens = at::empty({m}, p.options().dtype(at::kInt));
  cpu::RaceRows a = rows_of(static_cast<uint64_t>(seed), images, positions, purposes, purpose, v);
  a.p = p.data_ptr<float>();
  a.tokens = tokens.data_ptr<int32_t>();
  a.errors = row_errors.has_value() ? row_errors->data_ptr<int32_t>() : nullptr;
  const cpu::RaceKernels& kern = cpu::race_kernels();
  at::parallel_for(0, m, grain_for(v * kEntryCost),
                   [&](int64_t begin, int64_t end) { kern.sample_rows(a, begin, end); });
  return tokens;
}

at::Tensor race_noise_cpu(int64_t seed, const at::Tensor& images, const at::Tensor& positions,
                          const std::optional<at::Tensor>& purposes, int64_t purpose, int64_t vocab) {
  check_race_args(images, positions, purposes, vocab);
  TORCH_CHECK_VALUE(images.device().is_cpu(), "images must be a CPU tensor for the cpu backend");
  at::Tensor out = at::empty({images.size(0), vocab}, images.options().dtype(at::kFloat));
  cpu::RaceRows a = rows_of(static_cast<uint64_t>(seed), images, positions, purposes, purpose, vocab);
  a.noise = out.data_ptr<float>();
  const cpu::RaceKernels& kern = cpu::race_kernels();
  at::parallel_for(0, a.m, grain_for(vocab * kEntryCost),
                   [&](int64_t begin, int64_t end) { kern.noise_rows(a, begin, end); });
  return out;
}

}  // namespace specdec
