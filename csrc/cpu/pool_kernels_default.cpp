// pool_kernels_body.h at the baseline instruction set: 4 float lanes (SSE2 on x86-64, NEON on
// AArch64). Every CPU runs it; see pool_kernels.h.
#include "pool_kernels_prelude.h"

#define SPECDEC_CAP generic
#define SPECDEC_CAP_NAME "default"
#define SPECDEC_W 4
#include "pool_kernels_body.h"

namespace specdec {
namespace cpu {
const Kernels* kernels_default() { return generic::table(); }
}  // namespace cpu
}  // namespace specdec
