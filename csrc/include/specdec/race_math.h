// The position-keyed exact sampler (race_sample, race_noise): the hash and the float32 -ln(u),
// shared by the C++ CPU kernels (on SIMD vectors, csrc/cpu/race_kernels_body.h) and the CUDA
// kernels (on scalars). specdec/reference/exact_sampling.py is the definition these functions
// mirror bit for bit; docs/kernels/exact_sampling.md explains the choices.
//
// Every float step is one IEEE float32 operation in the reference's order. Nothing may be
// contracted into a fused multiply-add: the CPU build has -ffp-contract=off and the CUDA build
// --fmad=false (setup.py); divisions are correctly rounded (Lanes::div, __fdiv_rn on a GPU).
#pragma once

#include <cstdint>
#include <cstring>

#include "specdec/pool_math.h"  // SPECDEC_HD, SPECDEC_HD_ALWAYS_INLINE

namespace specdec {
namespace race {

constexpr uint64_t kGolden64 = 0x9E3779B97F4A7C15ull;  // splitmix64's increment
constexpr uint64_t kMix64M1 = 0xBF58476D1CE4E5B9ull;   // splitmix64's finalizer multipliers
constexpr uint64_t kMix64M2 = 0x94D049BB133111EBull;
constexpr uint32_t kGolden32 = 0x9E3779B9u;
constexpr uint32_t kFmix32M1 = 0x85EBCA6Bu;  // murmur3's fmix32 multipliers
constexpr uint32_t kFmix32M2 = 0xC2B2AE35u;

// float32 constants by their exact values (hex floats, so no decimal rounding is involved).
constexpr float kSqrt2 = 0x1.6a09e6p+0f;   // float32(sqrt 2), just below sqrt 2
constexpr float kLn2Hi = 0x1.62e4p-1f;     // ln 2 to 15 bits: e * kLn2Hi is exact for |e| <= 24
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;  // float32(ln 2 - kLn2Hi)
constexpr float kInv3 = 0x1.555556p-2f;    // float32(1/3), (1/5), (1/7), (1/9)
constexpr float kInv5 = 0x1.99999ap-3f;
constexpr float kInv7 = 0x1.24924ap-3f;
constexpr float kInv9 = 0x1.c71c72p-4f;
constexpr float kTwoM24 = 0x1p-24f;
// Entries of p below the smallest normal float32 never win, so no flush of subnormals to zero
// (a GPU's, a CPU's DAZ mode) can change a token.
constexpr float kPMin = 0x1p-126f;

constexpr int32_t kBadP = 1;  // the row's value-check code: an entry of p is NaN or outside [0, 1]

SPECDEC_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix64M1;
  z = (z ^ (z >> 27)) * kMix64M2;
  return z ^ (z >> 31);
}

SPECDEC_HD uint64_t absorb(uint64_t h, uint64_t word) { return mix64((h ^ word) + kGolden64); }

// The row's 64-bit key: the words seed, image, position, purpose absorbed in that order.
SPECDEC_HD uint64_t row_key(uint64_t seed, int64_t image, int64_t position, int64_t purpose) {
  uint64_t h = absorb(0, seed);
  h = absorb(h, static_cast<uint64_t>(image));
  h = absorb(h, static_cast<uint64_t>(position));
  return absorb(h, static_cast<uint64_t>(purpose));
}

// U: uint32_t, or a vector of uint32_t (GCC vector extensions: the same operators per lane).
template <class U>
SPECDEC_HD_ALWAYS_INLINE U fmix32(U a) {
  a = a ^ (a >> 16);
  a = a * kFmix32M1;
  a = a ^ (a >> 13);
  a = a * kFmix32M2;
  return a ^ (a >> 16);
}

// The 32 random bits of entry x of the row whose key is `key`.
template <class U>
SPECDEC_HD_ALWAYS_INLINE U entry_bits(U x, uint64_t key) {
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  const U a = fmix32(x * kGolden32 + lo);
  return fmix32(a ^ hi);
}

// The scalar lanes (CUDA, and anything scalar on the host); the CPU kernels define vector lanes
// with the same members.
struct ScalarLanes {
  using F = float;
  using I = int32_t;
  using U = uint32_t;
  using M = bool;
  static SPECDEC_HD I as_int(F x) {
#if defined(__CUDA_ARCH__)
    return __float_as_int(x);
#else
    I r;
    std::memcpy(&r, &x, sizeof r);
    return r;
#endif
  }
  static SPECDEC_HD F as_float(I x) {
#if defined(__CUDA_ARCH__)
    return __int_as_float(x);
#else
    F r;
    std::memcpy(&r, &x, sizeof r);
    return r;
#endif
  }
  static SPECDEC_HD I from_unsigned(U x) { return static_cast<I>(x); }
  static SPECDEC_HD F to_float(I x) { return static_cast<F>(x); }  // exact: |x| < 2^24
  static SPECDEC_HD F select(M m, F a, F b) { return m ? a : b; }
  static SPECDEC_HD I one_if(M m) { return m ? 1 : 0; }
  static SPECDEC_HD F div(F a, F b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
  }
};

// (2 * (bits >> 9) + 1) * 2^-24: exact, in [2^-24, 1 - 2^-24].
template <class L>
SPECDEC_HD_ALWAYS_INLINE typename L::F uniform_from_bits(typename L::U bits) {
  return L::to_float(L::from_unsigned((bits >> 9) * 2u + 1u)) * kTwoM24;
}

// -ln(u) for u in [2^-24, 1): u = m * 2^e from its bits; m > sqrt 2 is halved (e + 1); with
// s = (m - 1) / (m + 1), ln m = 2 atanh(s) = t + t * (z/3 + z^2/5 + z^3/7 + z^4/9), t = 2s, z = s^2;
// ln u = e * ln2_hi + (e * ln2_lo + ln m). Within 2 ulp of -ln(u) (tested exhaustively).
template <class L>
SPECDEC_HD_ALWAYS_INLINE typename L::F neg_log(typename L::F u) {
  using F = typename L::F;
  using I = typename L::I;
  const I bits = L::as_int(u);
  I e = (bits >> 23) - 127;
  F m = L::as_float((bits & 0x007FFFFF) | 0x3F800000);
  const auto big = m > kSqrt2;
  m = m * L::select(big, F{} + 0.5f, F{} + 1.0f);  // exact
  e = e + L::one_if(big);
  const F f = m - 1.0f;  // exact
  const F s = L::div(f, m + 1.0f);
  const F z = s * s;
  const F r = z * (kInv3 + z * (kInv5 + z * (kInv7 + z * kInv9)));
  const F t = s + s;
  const F ln_m = t + t * r;
  const F ef = L::to_float(e);
  const F ln_u = ef * kLn2Hi + (ef * kLn2Lo + ln_m);
  return -ln_u;
}

// E of entry x of the row whose key is `key`.
template <class L>
SPECDEC_HD_ALWAYS_INLINE typename L::F noise(typename L::U x, uint64_t key) {
  return neg_log<L>(uniform_from_bits<L>(entry_bits(x, key)));
}

}  // namespace race
}  // namespace specdec
