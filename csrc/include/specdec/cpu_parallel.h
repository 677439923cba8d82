// Grain sizes for at::parallel_for in the CPU kernels.
//
// A grain of 1 splits even a one-row call across every thread; on a busy machine the OpenMP
// barrier then waits for a core, which made tiny decoding-loop calls (a few rows of V = 256)
// 10x+ slower than running inline. at::parallel_for runs inline when the range is within one
// grain, so asking for at least kMinWorkPerTask element-operations per task keeps small calls on
// the calling thread and still spreads large ones over every core.
#pragma once

#include <algorithm>
#include <cstdint>

namespace specdec {

constexpr int64_t kMinWorkPerTask = 32768;

// Items per task when one item costs about `work_per_item` element-operations.
inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerTask / std::max<int64_t>(1, work_per_item));
}

}  // namespace specdec
