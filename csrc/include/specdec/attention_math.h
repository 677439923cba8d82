// The visibility rule of kernel 3 (docs/design.md, "Kernel 3"), shared by the C++ CPU and CUDA kernels.
//
// Key j is visible to query i iff kv_valid[j] and kv_pos[j] <= q_pos[i] and, when a tree mask
// is given and j is one of the last Nq key slots (the draft block), bit j - (Nk - Nq) of row i
// of the packed tree mask is set (little-endian within each int32 word). Keeping the rule in one
// function is what keeps the CPU and CUDA backends from drifting apart.
#pragma once

#include <cstdint>

#ifndef SPECDEC_HD
#if defined(__CUDACC__)
#define SPECDEC_HD __host__ __device__ __forceinline__
#else
#define SPECDEC_HD inline
#endif
#endif

namespace specdec {

constexpr int kTreeWordBits = 32;

// Bit `col` of a packed tree-mask row (col >= 0 is a column of the draft block).
SPECDEC_HD bool tree_bit(const int32_t* row_words, int64_t col) {
  const uint32_t word = static_cast<uint32_t>(row_words[col / kTreeWordBits]);
  return ((word >> (col % kTreeWordBits)) & 1u) != 0u;
}

// The whole rule for one (query, key) pair. `tree_row` is the query's packed row or nullptr
// when there is no tree mask; `block_col` = j - (Nk - Nq), negative outside the draft block.
SPECDEC_HD bool key_visible(bool valid, int64_t kv_pos, int64_t q_pos, const int32_t* tree_row,
                            int64_t block_col) {
  if (!valid || kv_pos > q_pos) return false;
  if (tree_row != nullptr && block_col >= 0) return tree_bit(tree_row, block_col);
  return true;
}

}  // namespace specdec
