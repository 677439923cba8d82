// pool_kernels_body.h for AVX-512 (F, BW, VL, DQ) + F16C: 16 float lanes; see pool_kernels.h.
// (FMA is on for the instruction set only: the build's -ffp-contract=off keeps every a * b + c
// two roundings.)
#include "pool_kernels_prelude.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,popcnt"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,popcnt")
#endif
#define SPECDEC_CAP avx512
#define SPECDEC_CAP_NAME "avx512"
#define SPECDEC_W 16
#define SPECDEC_X86_AVX512 1
#include "pool_kernels_body.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace specdec {
namespace cpu {
const Kernels* kernels_avx512() { return avx512::table(); }
}  // namespace cpu
}  // namespace specdec
#else
namespace specdec {
namespace cpu {
const Kernels* kernels_avx512() { return nullptr; }
}  // namespace cpu
}  // namespace specdec
#endif
