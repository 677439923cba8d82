// Row kernels of pool_probs, sampling_probs and sample_residual on the CPU, compiled once per CPU
// capability and picked at run time the way ATen's DispatchStub picks its kernels.
//
// pool_kernels_body.h holds the kernels, written once on W-lane vectors (GCC/Clang vector
// extensions). The thin files pool_kernels_avx512.cpp, pool_kernels_avx2.cpp and
// pool_kernels_default.cpp each compile it for one instruction set (16, 8 and 4 float lanes;
// the default build is SSE2 on x86-64 and NEON on AArch64) into a namespace of its own, and
// kernels() below returns the table of the widest one that both ATen's CPU capability
// (at::native::get_cpu_capability(), which honours ATEN_CPU_CAPABILITY=default|avx2|avx512) and
// the CPU itself allow. SPECDEC_CPU_KERNELS_VERBOSE=1 prints the choice once to stderr.
//
// This header is the boundary between the torch-facing wrappers (pool_probs.cpp,
// sample_residual.cpp: checks, allocation, at::parallel_for) and the kernels: plain structs of raw
// pointers, no torch types, so that nothing from a torch header is compiled for a wider
// instruction set than the CPU running it may have.
#pragma once

#include <cstdint>

namespace specdec {
namespace cpu {

enum class LogitsType : int32_t { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

// Kernel 1 (docs/design.md): one call's arguments. Rows are contiguous along V (checked by
// check_pool_args); row r starts at cond + r * cond_stride elements.
struct PoolRows {
  const void* cond = nullptr;
  const void* uncond = nullptr;  // nullptr: no CFG
  int64_t cond_stride = 0, uncond_stride = 0;
  LogitsType dtype = LogitsType::kFloat;
  int64_t n = 0, v = 0;
  float cfg_scale = 1.0f, temperature = 1.0f;
  int64_t top_k = 0;
  double top_p = 1.0;
  // pool_probs
  const void* tokens = nullptr;
  bool tokens64 = false;
  int64_t token_stride = 1;
  const void* neighbors = nullptr;  // [V, K] int32 or int16, or nullptr
  bool neighbors16 = false;
  int64_t k = 0;
  float delta = 0.0f;  // +inf: delta=None
  float *pooled = nullptr, *p_token = nullptr, *row_max = nullptr, *row_lse = nullptr;
  // sampling_probs: [N, V] contiguous
  float* probs = nullptr;
};

// sample_residual: p, q [M, V] contiguous float32; u [M] or nullptr (Philox (seed, r, offset)).
struct ResidualRows {
  const float* p = nullptr;
  const float* q = nullptr;
  const float* u = nullptr;
  int64_t m = 0, v = 0;
  int64_t seed = 0, offset = 0;
  int32_t* tokens = nullptr;
  bool* fallback = nullptr;
  int32_t* errors = nullptr;  // [M] value-check codes (verify_math.h), or nullptr: no checks
};

// Per-thread buffers, allocated once per thread and kept between calls (thread_scratch). Every
// array holds at least scratch_elements(v) elements; hist holds kHistBins.
constexpr int kHistBins = 2048;
constexpr int64_t kResidualBlock = 256;  // sample_residual: entries per block sum
struct RowScratch {
  float* l;            // the row's guided logits (padded with -inf to a whole vector)
  float* kept_val;     // the kept entries' logits ...
  int32_t* kept_idx;   // ... and their ids
  uint32_t* cand_key;  // selection candidates: ordered keys ...
  int32_t* cand_aux;   // ... and ids (top-k) or fixed-point weights (top-p)
  int32_t* weights;    // top-p weights of the row
  int64_t* hist;       // kHistBins digit counts or weight sums
  int64_t* blocks;     // sample_residual: the row's block sums (v / kResidualBlock + 1)
};

inline int64_t scratch_elements(int64_t v) {
  return (v + 15) / 16 * 16 + 64;  // whole vectors of up to 16 lanes, and a vector of slack
}

// The first row with an out-of-range token id or neighbour (-1: none), as the scalar code did.
struct RowErrors {
  int64_t bad_token = -1;
  int64_t bad_neighbor = -1;
};

struct Kernels {
  const char* name;  // "avx512", "avx2" or "default"
  int lanes;
  RowErrors (*pool_rows)(const PoolRows&, int64_t begin, int64_t end, const RowScratch&);
  void (*sampling_rows)(const PoolRows&, int64_t begin, int64_t end, const RowScratch&);
  void (*residual_rows)(const ResidualRows&, int64_t begin, int64_t end, const RowScratch&);
};

// The per-capability tables (nullptr where that build is not compiled for this architecture).
const Kernels* kernels_avx512();
const Kernels* kernels_avx2();
const Kernels* kernels_default();

// The table this process uses (picked once).
const Kernels& kernels();

// This thread's scratch for rows of length v (grown as needed, kept between calls).
RowScratch thread_scratch(int64_t v);

}  // namespace cpu
}  // namespace specdec
