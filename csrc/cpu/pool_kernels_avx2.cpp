// pool_kernels_body.h for AVX2 + FMA + F16C: 8 float lanes; see pool_kernels.h. (FMA is on for
// the instruction set only: the build's -ffp-contract=off keeps every a * b + c two roundings.)
#include "pool_kernels_prelude.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,popcnt")
#endif
#define SPECDEC_CAP avx2
#define SPECDEC_CAP_NAME "avx2"
#define SPECDEC_W 8
#define SPECDEC_X86_AVX2 1
#include "pool_kernels_body.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace specdec {
namespace cpu {
const Kernels* kernels_avx2() { return avx2::table(); }
}  // namespace cpu
}  // namespace specdec
#else
namespace specdec {
namespace cpu {
const Kernels* kernels_avx2() { return nullptr; }
}  // namespace cpu
}  // namespace specdec
#endif
