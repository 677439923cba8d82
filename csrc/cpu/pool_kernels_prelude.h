// Every header that pool_kernels_body.h needs. The per-capability files include this first, at
// the baseline instruction set, and only then switch the wider instruction set on for the body
// (which includes nothing itself): inline functions of these headers are then compiled for the
// baseline wherever the linker's deduplication takes them from (see pool_kernels.h).
#pragma once

// Vectors wider than the baseline registers only pass between always-inlined helpers of one
// file (top_p_exp2 in pool_math.h among them); no function boundary (ABI) sees them.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's _mm512_cvtph_ps initialises its unused pass-through operand from itself.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "pool_kernels.h"
#include "specdec/pool_math.h"
#include "specdec/verify_math.h"
