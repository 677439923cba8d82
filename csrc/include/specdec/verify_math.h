// Scalar math of kernel 2 (verify_grid, sample_residual), shared by the C++ CPU and the CUDA
// kernels; specdec/reference/verification.py is the definition these functions mirror.
//
// Sampling works in exact fixed point: a residual mass x becomes trunc(clamp(x, 0, 1) * 2^30)
// (an int32), row sums are int64, and the inverse-CDF threshold is floor(u * total) computed
// in double (exact while V * 2^30 < 2^53). Integer sums do not depend on the summation order,
// so a sequential CPU loop and a CUDA block scan pick the same token for the same uniform.
//
// Without caller uniforms, sample_residual draws row r's uniform itself from counter-based
// Philox4x32-10 (header-only ATen engine, host and device): key = seed, counter = (offset, r).
// CPU and CUDA share philox_row_uniform below, so they pick the same tokens for the same seed.
#pragma once

#include <c10/util/Exception.h>  // AT_ASSERT, used by a host-only member of the Philox engine
#include <ATen/core/PhiloxRNGEngine.h>

#include <cstdint>

#include "specdec/pool_math.h"  // SPECDEC_HD

namespace specdec {

constexpr int kMassFractionBits = 30;
constexpr float kMassScale = 1073741824.0f;  // 2^30

// The value checks of sample_residual, one code per row (bits below; 0: the row is fine), as
// sample_residual_row_errors in specdec/reference/verification.py defines them. The kernels set
// them in the pass they already make over each row; the Python op reads one flag from the codes.
constexpr int32_t kBadP = 1;        // an entry of p is NaN or outside [0, 1]
constexpr int32_t kPNoMass = 2;     // every entry of p is below 2^-30
constexpr int32_t kBadQ = 4;        // an entry of q is NaN or outside [0, 1]
constexpr int32_t kBadUniform = 8;  // the row's uniform is NaN or outside [0, 1)

// The value checks of verify_grid, one code per grid (bits; verify_grid_errors in
// specdec/reference/verification.py defines them), set in the kernels' first pass over the grid.
constexpr int32_t kNanP = 1;            // a score p is NaN
constexpr int32_t kNanQ = 2;            // a draft probability q is NaN (rule="ratio")
constexpr int32_t kGridBadUniform = 4;  // a uniform is NaN or outside [0, 1) (rule="ratio")

SPECDEC_HD bool outside_unit(float x) { return !(x >= 0.0f && x <= 1.0f); }
SPECDEC_HD bool has_mass(float x) { return x >= 1.0f / kMassScale; }
SPECDEC_HD bool bad_uniform(float u) { return !(u >= 0.0f && u < 1.0f); }

enum class VerifyRule : int { kThreshold = 0, kRatio = 1 };
enum class VerifyMode : int { kRaster = 0, kIndependent = 1, kLocal = 2 };

// rule="threshold": rejected iff not (p >= tau). Written this way round so that a NaN score
// (refused by the Python API) rejects rather than accepts.
SPECDEC_HD bool rejected_by_threshold(float p, float tau) { return !(p >= tau); }

// rule="ratio": accepted iff u < min(1, p / q), evaluated as u * q < p with no division, so
// q = 0 < p accepts and p = 0 rejects.
SPECDEC_HD bool rejected_by_ratio(float p, float q, float u) { return !(u * q < p); }

// Fixed-point mass: trunc(clamp(x, 0, 1) * 2^30); NaN counts as 0. The comparisons are
// written so that compilers map them to vector max/min instructions (NaN > 0 is false).
SPECDEC_HD int32_t mass_units(float x) {
  x = x > 0.0f ? x : 0.0f;
  x = x < 1.0f ? x : 1.0f;
  return static_cast<int32_t>(x * kMassScale);
}

// Residual mass of one entry: max(0, p - q) in fixed point (p - q rounded as float32 first).
SPECDEC_HD int32_t residual_units(float p, float q) { return mass_units(p - q); }

// Inverse-CDF threshold: the token is the smallest v with cumsum(units)[v] > this value.
SPECDEC_HD int64_t cdf_threshold(float u, int64_t total) {
  return static_cast<int64_t>(static_cast<double>(u) * static_cast<double>(total));
}

// Uniform float in [0, 1) from 32 random bits: the top 24 bits times 2^-24 (exact in float32).
SPECDEC_HD float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

// Row r's uniform when sample_residual draws its own: the first 32-bit output of Philox4x32-10
// with key `seed` and counter (offset, row), i.e. at::Philox4_32(seed, subsequence=row, offset).
// (triton_kernels/verification.py computes the same with tl.philox.)
SPECDEC_HD float philox_row_uniform(int64_t seed, int64_t row, int64_t offset) {
  at::Philox4_32 engine(static_cast<uint64_t>(seed), static_cast<uint64_t>(row),
                        static_cast<uint64_t>(offset));
  return uniform_from_bits(engine());
}

}  // namespace specdec

namespace specdec {

// Parsed scalar arguments of verify_grid (see check_verify_args).
struct VerifyConfig {
  VerifyRule rule;
  VerifyMode mode;
  float tau;       // rule="threshold" only
  int32_t radius;  // clamped to max(H, W): a wider window changes nothing
};

}  // namespace specdec
