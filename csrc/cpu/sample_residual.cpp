// sample_residual on the CPU (docs/design.md, "Kernel 2"): one token per row by inverse-CDF sampling
// of the fixed-point residual (csrc/include/specdec/verify_math.h).
//
// Rows are split across threads with at::parallel_for. Each row is read twice at most: one
// pass sums the residual units (falling back to p when they are all zero), a second pass
// accumulates until the sum exceeds floor(u * total) and stops there. No [M, V] buffer.
// Without uniforms, row r's u comes from Philox (seed, r, offset) (philox_row_uniform), the
// same numbers the CUDA kernel draws.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "specdec/verify_math.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

// Sum of the fixed-point units of n entries: of max(0, p - q), or of p when q is null.
int64_t sum_units_scalar(const float* p, const float* q, int64_t n) {
  int64_t total = 0;
  if (q != nullptr) {
    for (int64_t i = 0; i < n; ++i) total += residual_units(p[i], q[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) total += mass_units(p[i]);
  }
  return total;
}

#if defined(__GNUC__) && defined(__x86_64__)
// The row sums are the hot loops, and compilers leave them scalar (the NaN-safe clamp is a
// branch to them; baseline x86-64 cannot widen int32 to int64 in vector registers). This AVX2
// version does exactly mass_units() on 8 lanes: max(x, 0) returns 0 for NaN like the scalar
// code, the truncating conversion and the int64 adds are exact, so the sum is the same.
__attribute__((target("avx2"))) int64_t sum_units_avx2(const float* p, const float* q, int64_t n) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 scale = _mm256_set1_ps(kMassScale);
  __m256i acc = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(p + i);
    if (q != nullptr) x = _mm256_sub_ps(x, _mm256_loadu_ps(q + i));
    x = _mm256_min_ps(_mm256_max_ps(x, zero), one);  // maxps(NaN, 0) = 0
    const __m256i units = _mm256_cvttps_epi32(_mm256_mul_ps(x, scale));
    acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(units)));
    acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(units, 1)));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] +
         sum_units_scalar(p + i, q ? q + i : nullptr, n - i);
}

int64_t sum_units(const float* p, const float* q, int64_t n) {
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  return has_avx2 ? sum_units_avx2(p, q, n) : sum_units_scalar(p, q, n);
}
#else
int64_t sum_units(const float* p, const float* q, int64_t n) { return sum_units_scalar(p, q, n); }
#endif

// Smallest i with cumsum(units)[i] > threshold (v - 1 when there is none: a row without mass).
// Whole chunks are skipped with the vectorised sum; only the chunk holding the crossing is
// walked entry by entry.
int32_t first_above(const float* p, const float* q, int64_t v, int64_t threshold) {
  constexpr int64_t kChunk = 512;
  int64_t cum = 0;
  for (int64_t start = 0; start < v; start += kChunk) {
    const int64_t len = std::min(kChunk, v - start);
    const int64_t chunk = sum_units(p + start, q ? q + start : nullptr, len);
    if (cum + chunk > threshold) {
      for (int64_t i = start; i < start + len; ++i) {
        cum += q ? residual_units(p[i], q[i]) : mass_units(p[i]);
        if (cum > threshold) return static_cast<int32_t>(i);
      }
    }
    cum += chunk;
  }
  return static_cast<int32_t>(v - 1);
}

}  // namespace

SampleOut sample_residual_cpu(const at::Tensor& p, const std::optional<at::Tensor>& q,
                              const std::optional<at::Tensor>& uniforms, int64_t seed,
                              int64_t offset) {
  check_sample_args(p, q, uniforms, offset);
  TORCH_CHECK_VALUE(p.device().is_cpu(), "p must be a CPU tensor for the cpu backend");
  const int64_t m = p.size(0), v = p.size(1);
  at::Tensor tokens = at::empty({m}, p.options().dtype(at::kInt));
  at::Tensor fallback = at::empty({m}, p.options().dtype(at::kBool));
  const float* p_base = p.data_ptr<float>();
  const float* q_base = q.has_value() ? q->data_ptr<float>() : nullptr;
  const float* u = uniforms.has_value() ? uniforms->data_ptr<float>() : nullptr;
  int32_t* tok = tokens.data_ptr<int32_t>();
  bool* fb = fallback.data_ptr<bool>();

  at::parallel_for(0, m, grain_for(v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* pr = p_base + r * v;
      const float* qr = q_base ? q_base + r * v : nullptr;
      const int64_t residual_total = qr ? sum_units(pr, qr, v) : 0;
      const bool from_p = qr == nullptr || residual_total == 0;
      fb[r] = qr != nullptr && residual_total == 0;
      const float* q_used = from_p ? nullptr : qr;
      const int64_t total = from_p ? sum_units(pr, nullptr, v) : residual_total;
      const float ur = u ? u[r] : philox_row_uniform(seed, r, offset);
      tok[r] = first_above(pr, q_used, v, cdf_threshold(ur, total));
    }
  });
  return {tokens, fallback};
}

}  // namespace specdec
