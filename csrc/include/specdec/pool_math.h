// Scalar math of kernel 1 (probability pooling), shared by the C++ CPU and the CUDA kernels.
//
// Every function here is the single definition of one step of docs/design.md, "Kernel 1", so the
// CPU and CUDA backends cannot drift apart. Arithmetic is written operation by operation and
// the CUDA build uses --fmad=false: a fused multiply-add would round differently from the
// reference, and the top-k threshold compares logits exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPECDEC_HD __host__ __device__ __forceinline__
#define SPECDEC_HD_ALWAYS_INLINE __host__ __device__ __forceinline__
#else
#define SPECDEC_HD inline
#if defined(__GNUC__) || defined(__clang__)
// Templates the CPU kernels instantiate on SIMD vectors (csrc/cpu/pool_kernels_body.h): always
// inlined, so each instruction-set build of the kernels gets its own vector code.
#define SPECDEC_HD_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SPECDEC_HD_ALWAYS_INLINE inline
#endif
#endif

namespace specdec {

// Step 1: classifier-free guidance and temperature.
// An entry that is -inf in either the conditional or the unconditional logits stays -inf:
// -inf is how callers mask tokens, and `u + s * (c - u)` would otherwise give NaN or +inf.
SPECDEC_HD float guided_logit(float cond, float uncond, bool has_uncond, float cfg_scale,
                              float temperature) {
  float l = cond;
  if (has_uncond) {
    if (cond == -INFINITY || uncond == -INFINITY) {
      l = -INFINITY;
    } else {
      l = uncond + cfg_scale * (cond - uncond);
    }
  }
  return l / temperature;
}

// A logit that poisons its row: NaN or +inf (docs/design.md: that row's outputs are NaN).
SPECDEC_HD bool is_poison(float l) { return l != l || l == INFINITY; }

// Monotone map float -> int32 (for non-NaN inputs) used by the top-k threshold search.
// -0.0 and +0.0 compare equal as floats, so they are merged before taking the bits.
SPECDEC_HD int32_t ordered_key(float f) {
  f = f + 0.0f;
  int32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_int(f);
#else
  std::memcpy(&bits, &f, sizeof(bits));
#endif
  return bits >= 0 ? bits : (bits ^ 0x7fffffff);
}

// Step 2: an entry survives top-k iff its key is >= the key of the k-th largest logit (ties
// at the threshold are kept). `threshold_key` is INT32_MIN when top-k is off.
SPECDEC_HD bool kept_by_top_k(float l, int32_t threshold_key) {
  return ordered_key(l) >= threshold_key;
}

// Step 2b, top-p (nucleus). The keep rule "the mass of the tokens strictly more probable than v
// is < top_p" is a discrete decision, so it is evaluated on fixed-point weights that every
// backend computes bit for bit: only exactly rounded float32 + - * (no library exp, whose last
// bit differs between CPU, CUDA and Triton) relative to the row max (exact on every backend),
// summed in int64 (order-free). specdec/reference/pooling.py (top_p_weights, top_p_mask) is
// the definition and triton_kernels/pooling.py repeats it; all three use the same operations
// in the same order, and the builds disable FMA contraction.
//   w(v) = trunc(2^30 * 2^f) >> -n  with t = (l - max) * log2(e), n = trunc(t - 0.5),
//          f = t - n in (-0.5, 0.5], 2^f by a degree-7 Taylor polynomial; w = 0 for t < -32;
//   keep v  iff  double(sum of w over keys > key(v)) < top_p * double(sum of all w).
// The max has w = 2^30 exactly, so the argmax and its ties are always kept.
//
// top_p_exp2 is the polynomial alone, on a float or on a vector of floats (the CPU kernels' SIMD
// lanes compute the weights with it, csrc/cpu/pool_kernels_body.h), so there is one definition of
// its operations and their order. f * c7 is c7 * f exactly (IEEE multiplication commutes).
template <class F>
SPECDEC_HD_ALWAYS_INLINE F top_p_exp2(F f) {
  F p = f * 1.5252733646775596e-05f + 0.0001540352968731895f;
  p = p * f + 0.0013333557872101665f;
  p = p * f + 0.009618128649890423f;
  p = p * f + 0.05550410971045494f;
  p = p * f + 0.24022650718688965f;
  p = p * f + 0.6931471824645996f;
  p = p * f + 1.0f;
  return p;
}

constexpr float kTopPLog2e = 1.4426950216293335f;  // float32(log2(e))
constexpr float kTopPScale = 1073741824.0f;        // 2^30

SPECDEC_HD int64_t top_p_weight(float l, float row_max) {
  const float t = (l - row_max) * kTopPLog2e;
  if (!(t >= -32.0f)) return 0;  // -inf (masked) tokens and negligible ones weigh nothing
  const int32_t n = static_cast<int32_t>(t - 0.5f);  // truncation toward zero
  const float f = t - static_cast<float>(n);
  const float p = top_p_exp2(f);
  return static_cast<int64_t>(p * kTopPScale) >> (-n);
}

// The nucleus threshold of a row whose weights sum to `total`: one IEEE double product.
SPECDEC_HD double nucleus_threshold(double top_p, int64_t total) {
  return top_p * static_cast<double>(total);
}

// A key t is at or above the nucleus cut iff the weight strictly above it is below the threshold.
SPECDEC_HD bool inside_nucleus(int64_t weight_above, double threshold) {
  return static_cast<double>(weight_above) < threshold;
}

// Step 3: probability of one entry given the softmax statistics of its row: the row's max and
// log_sum = log(sum of exp(l - max)). Computed as exp((l - max) - log_sum), never as
// exp(l - row_lse): row_lse = max + log_sum is rounded to float32 at the size of l (1e5 and
// more at a temperature of 1e-4), which can move p by far more than an ulp (two tied tokens
// each got p = 1 at l ~ 2e7), while l - max is exact near the max (Sterbenz) and log_sum lies
// in [0, log V].
SPECDEC_HD float prob_from_logit(float l, int32_t threshold_key, float row_max, float log_sum) {
  if (!kept_by_top_k(l, threshold_key)) return 0.0f;
  return expf((l - row_max) - log_sum);
}

// Online softmax: merge (max, sum of exp(x - max)) pairs. -inf maxima carry no mass.
struct SoftmaxStats {
  float max;
  float sum;
};

SPECDEC_HD SoftmaxStats softmax_stats_add(SoftmaxStats s, float l) {
  if (l == -INFINITY) return s;
  if (l > s.max) {
    float scaled = (s.max == -INFINITY) ? 0.0f : s.sum * expf(s.max - l);
    return {l, scaled + 1.0f};
  }
  return {s.max, s.sum + expf(l - s.max)};
}

SPECDEC_HD SoftmaxStats softmax_stats_merge(SoftmaxStats a, SoftmaxStats b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  if (a.max >= b.max) return {a.max, a.sum + b.sum * expf(b.max - a.max)};
  return {b.max, b.sum + a.sum * expf(a.max - b.max)};
}

// log(sum of exp(l - max)); probabilities use it with the max (prob_from_logit).
// The row_lse output is max + log_sum; probabilities are never computed from it.
SPECDEC_HD float softmax_log_sum(SoftmaxStats s) { return logf(s.sum); }

// Step 4: LANTERN's delta rule. `inclusive` is sum_{j <= m} p(neighbors[x][j]); a prefix may be
// moved onto x while it stays <= delta (delta = +inf encodes delta=None: move everything).
SPECDEC_HD float movable_mass(float inclusive, float delta) {
  return inclusive <= delta ? inclusive : 0.0f;
}

}  // namespace specdec
