// race_kernels_body.h compiled once per instruction set (AVX-512: 16 float lanes, AVX2: 8, the
// baseline: 4, SSE2 on x86-64 or NEON on AArch64), and the choice among them: the one the pooling
// kernels use (pool_kernels.h), so ATEN_CPU_CAPABILITY steers both. The headers are included here,
// at the baseline, before any target switch; the body includes nothing.
#include <cstring>

#include "pool_kernels.h"
#include "race_kernels.h"
#include "specdec/race_math.h"

namespace specdec {
namespace cpu {
namespace {

// The lanes race_math.h's templates run on in the CPU kernels: W-lane vectors with the members of
// race::ScalarLanes (vector casts between types of one size reinterpret the bits; masks are all
// ones or all zeros). Defined here, at the baseline instruction set like race_math.h's templates:
// GCC inlines a baseline function into a function of a wider instruction set, never the reverse,
// and always inlined, every function of the chain becomes the calling build's vector code.
template <int W>
struct VectorLanes;

// (One explicit specialisation per width: GCC's __builtin_convertvector rejects dependent types.)
#define SPECDEC_RACE_VECTOR_LANES(WIDTH)                                                                     \
  template <>                                                                                              \
  struct VectorLanes<WIDTH> {                                                                              \
    typedef float F __attribute__((vector_size(WIDTH * sizeof(float))));                                   \
    typedef int32_t I __attribute__((vector_size(WIDTH * sizeof(int32_t))));                               \
    typedef uint32_t U __attribute__((vector_size(WIDTH * sizeof(uint32_t))));                             \
    using M = I;                                                                                           \
    static SPECDEC_HD_ALWAYS_INLINE I as_int(F x) { return (I)x; }                                         \
    static SPECDEC_HD_ALWAYS_INLINE F as_float(I x) { return (F)x; }                                       \
    static SPECDEC_HD_ALWAYS_INLINE I from_unsigned(U x) { return (I)x; }                                  \
    static SPECDEC_HD_ALWAYS_INLINE F to_float(I x) { return __builtin_convertvector(x, F); }              \
    static SPECDEC_HD_ALWAYS_INLINE F select(M m, F a, F b) { return (F)((m & (I)a) | (~m & (I)b)); }      \
    static SPECDEC_HD_ALWAYS_INLINE I one_if(M m) { return m & 1; }                                        \
    static SPECDEC_HD_ALWAYS_INLINE F div(F a, F b) { return a / b; }                                      \
  };
SPECDEC_RACE_VECTOR_LANES(4)
SPECDEC_RACE_VECTOR_LANES(8)
SPECDEC_RACE_VECTOR_LANES(16)
#undef SPECDEC_RACE_VECTOR_LANES

}  // namespace
}  // namespace cpu
}  // namespace specdec

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECDEC_RACE_X86 1
#endif

#if defined(SPECDEC_RACE_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif
#define SPECDEC_RACE_CAP avx512
#define SPECDEC_RACE_NAME "avx512"
#define SPECDEC_RACE_W 16
#include "race_kernels_body.h"
#undef SPECDEC_RACE_CAP
#undef SPECDEC_RACE_NAME
#undef SPECDEC_RACE_W
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define SPECDEC_RACE_CAP avx2
#define SPECDEC_RACE_NAME "avx2"
#define SPECDEC_RACE_W 8
#include "race_kernels_body.h"
#undef SPECDEC_RACE_CAP
#undef SPECDEC_RACE_NAME
#undef SPECDEC_RACE_W
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // SPECDEC_RACE_X86

#define SPECDEC_RACE_CAP generic
#define SPECDEC_RACE_NAME "default"
#define SPECDEC_RACE_W 4
#include "race_kernels_body.h"

namespace specdec {
namespace cpu {

const RaceKernels& race_kernels() {
  static const RaceKernels* chosen = [] {
#if defined(SPECDEC_RACE_X86)
    // kernels() has checked ATen's capability and the CPU's features for this instruction set.
    const char* isa = kernels().name;
    if (std::strcmp(isa, "avx512") == 0) return avx512::race_table();
    if (std::strcmp(isa, "avx2") == 0) return avx2::race_table();
#endif
    return generic::race_table();
  }();
  return *chosen;
}

}  // namespace cpu
}  // namespace specdec
