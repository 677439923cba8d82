// Picks the row kernels' instruction set once per process (pool_kernels.h) and keeps each
// thread's scratch buffers between calls.
#include <ATen/Version.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "pool_kernels.h"

namespace specdec {
namespace cpu {
namespace {

bool cpu_has(const char* what) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (std::strcmp(what, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("popcnt");
  }
  if (std::strcmp(what, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("popcnt");
  }
#endif
  (void)what;
  return false;
}

const Kernels* pick() {
  const Kernels* chosen = kernels_default();
#if defined(__x86_64__)
  // ATen's choice (CPU features, lowered by ATEN_CPU_CAPABILITY), the one its DispatchStub makes
  // (at::get_cpu_capability() is its exported name: "DEFAULT", "AVX2", "AVX512").
  const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512" && kernels_avx512() != nullptr && cpu_has("avx512")) {
    chosen = kernels_avx512();
  } else if ((capability == "AVX512" || capability == "AVX2") && kernels_avx2() != nullptr && cpu_has("avx2")) {
    chosen = kernels_avx2();
  }
#endif
  const char* verbose = std::getenv("SPECDEC_CPU_KERNELS_VERBOSE");
  if (verbose != nullptr && verbose[0] == '1') {
    std::fprintf(stderr, "specdec: CPU pooling/sampling kernels: %s (%d float lanes)\n", chosen->name,
                 chosen->lanes);
  }
  return chosen;
}

struct ThreadScratch {
  int64_t capacity = -1;  // scratch_elements of the largest v seen
  std::unique_ptr<char[]> storage;
  RowScratch view{};
};

}  // namespace

const Kernels& kernels() {
  static const Kernels* chosen = pick();
  return *chosen;
}

RowScratch thread_scratch(int64_t v) {
  static thread_local ThreadScratch ts;
  const int64_t need = scratch_elements(v);
  if (need > ts.capacity) {
    const int64_t blocks = need / kResidualBlock + 2;
    // Six arrays of 4-byte elements, the histogram and the block sums, each 64-byte aligned.
    const int64_t bytes = 6 * (need * 4 + 64) + (kHistBins * 8 + 64) + (blocks * 8 + 64) + 64;
    ts.storage.reset(new char[bytes]);
    char* p = ts.storage.get();
    auto take = [&p](int64_t n) {
      char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
      p = aligned + n;
      return aligned;
    };
    ts.view.l = reinterpret_cast<float*>(take(need * 4));
    ts.view.kept_val = reinterpret_cast<float*>(take(need * 4));
    ts.view.kept_idx = reinterpret_cast<int32_t*>(take(need * 4));
    ts.view.cand_key = reinterpret_cast<uint32_t*>(take(need * 4));
    ts.view.cand_aux = reinterpret_cast<int32_t*>(take(need * 4));
    ts.view.weights = reinterpret_cast<int32_t*>(take(need * 4));
    ts.view.hist = reinterpret_cast<int64_t*>(take(kHistBins * 8));
    ts.view.blocks = reinterpret_cast<int64_t*>(take(blocks * 8));
    ts.capacity = need;
  }
  return ts.view;
}

}  // namespace cpu
}  // namespace specdec
