// A CPU allocator for large kernel outputs that keeps a few freed blocks for the next call.
//
// Why: glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
// mmap, and the kernel then faults in and zeroes each 4 KiB page on its first write. For
// sampling_probs' [1024, 16384] float32 output (64 MiB) that was a third of the op's time on the
// 2-core development machine (11 of 35 us per row, measured 2026-12-02). A decoding loop frees
// that output before its next call, so keeping the freed block and handing it out again skips
// the faults, as the CUDA caching allocator does on the GPU.
//
// The tensors it makes are ordinary CPU tensors: the caller owns them, and freeing one gives its
// block back to the cache (or to the system once kMaxKept blocks are kept). Outputs below
// kMinBytes go to the default CPU allocator, whose malloc reuses small blocks by itself.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace specdec {
namespace cpu {

// An uninitialised float32 CPU tensor of `sizes` whose memory may be a block an earlier output
// freed: every kernel using it must write every element.
at::Tensor empty_reused_output(c10::IntArrayRef sizes);

}  // namespace cpu
}  // namespace specdec
