// Radix select of kernel 1's two thresholds for the CUDA kernels of the "radix" pool variant (opt-in;
// NEVER RUN ON A GPU, only compiled and checked in SASS), with a sequential host version that runs
// the same steps for the tests (tests/kernels/test_pool_gpu_radix_host.py compiles this header with g++).
//
// Both thresholds are ordered keys (pool_math.h: ordered_key), read here as unsigned numbers
// u = key ^ 0x80000000 with the same order, 8 bits at a time from the top: 4 passes over the row,
// each a 256-bin histogram in shared memory of the digit of the keys that share the digits chosen so
// far, then one warp walks the bins from the top and picks the bin that holds the answer.
// - top-k: the k-th largest key (ties kept: the answer is that key, everything >= it survives).
//   Counts per bin; the answer's bin is the one where the count above it is < rank <= count above it
//   plus its own count; the rank left for the next pass drops by the count above the bin.
// - top-p: the smallest key t (>= the top-k key) whose weight strictly above is < top_p * total
//   (pool_math.h, "top-p"): fixed-point int64 weights per bin; the answer's bin is the lowest one of
//   positive weight whose largest key is inside, i.e. acc + weight(bins above it) < limit, where acc
//   is the weight of the keys above the bins of this pass. The weights go into the histogram as two
//   32-bit halves (native shared atomics) where V <= 65536.
// Integer sums do not depend on the order of the atomics, so the keys are the ones the 32-step
// bisections of the default kernels find (and the reference's sort), bit for bit.
#pragma once

#include <cstdint>

#include "specdec/pool_math.h"
#if defined(__CUDACC__)
#include "specdec/cuda_block.cuh"
#endif

namespace specdec {
namespace radix {

constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;        // 256
constexpr int kPasses = 32 / kDigitBits;      // 4
constexpr int kLanes = 32;                    // one warp picks the bin
constexpr int kBinsPerLane = kBins / kLanes;  // 8, walked by each lane from the top

// ordered_key as an unsigned number of the same order, and back.
SPECDEC_HD uint32_t ukey(int32_t key) { return static_cast<uint32_t>(key) ^ 0x80000000u; }
SPECDEC_HD int32_t key_of(uint32_t u) { return static_cast<int32_t>(u ^ 0x80000000u); }

// Lowest bit of the digit read in pass p (pass 0 reads the most significant byte).
SPECDEC_HD int shift_of(int pass) { return 32 - kDigitBits * (pass + 1); }
SPECDEC_HD uint32_t digit(uint32_t u, int pass) { return (u >> shift_of(pass)) & (kBins - 1); }
// Whether u has the digits already chosen (held in the bits of `prefix` above pass p's digit).
SPECDEC_HD bool in_prefix(uint32_t u, uint32_t prefix, int pass) {
  return pass == 0 || (u >> (shift_of(pass) + kDigitBits)) == (prefix >> (shift_of(pass) + kDigitBits));
}

// top-k, one lane's bins [first, first + n), walked from the top. `above`: the count of the keys in
// bins above them. Returns the bin that holds the rank-th largest key (1-based) and stores the count
// above that bin in *above_bin, or -1 when the lane does not own it.
SPECDEC_HD int pick_count_bin(const uint32_t* hist, int first, int n, int64_t above, int64_t rank,
                              int64_t* above_bin) {
  for (int b = first + n - 1; b >= first; --b) {
    if (above < rank && rank <= above + static_cast<int64_t>(hist[b])) {
      *above_bin = above;
      return b;
    }
    above += hist[b];
  }
  return -1;
}

// top-p, one lane's bins first .. first + n - 1, their weights in weight[0, n). `above`: the weight
// of every key above these bins (acc included). Returns the lowest of them of positive weight whose
// weight above is inside the nucleus, storing that weight in *above_bin, or -1. Zero-weight bins are
// skipped: the cut is a key of positive weight (a zero-weight key only follows keys that hold the
// whole weight).
SPECDEC_HD int pick_weight_bin(const int64_t* weight, int first, int n, int64_t above, double limit,
                               int64_t* above_bin) {
  int found = -1;
  for (int e = n - 1; e >= 0; --e) {
    if (!inside_nucleus(above, limit)) break;  // the weight above only grows downwards
    if (weight[e] > 0) {
      found = first + e;
      *above_bin = above;
    }
    above += weight[e];
  }
  return found;
}

// Rows of at most this many entries accumulate the weights of a bin in two 32-bit halves, low 16
// bits and the rest (w <= 2^30): 65536 * (2^16 - 1) < 2^32, and 32-bit shared atomics are native
// (a 64-bit shared atomic add is a compare-and-swap loop on sm_80 and sm_90). Longer rows, which
// only the streamed kernels see, use the 64-bit atomics.
constexpr int64_t kMaxSplitWeightV = 65536;
SPECDEC_HD uint32_t weight_lo(int64_t w) { return static_cast<uint32_t>(w & 0xFFFF); }
SPECDEC_HD uint32_t weight_hi(int64_t w) { return static_cast<uint32_t>(w >> 16); }
SPECDEC_HD int64_t weight_of(uint32_t lo_sum, uint32_t hi_sum) {
  return (static_cast<int64_t>(hi_sum) << 16) + static_cast<int64_t>(lo_sum);
}

// ---- host: the same passes, one "thread", 32 "lanes" walked in turn (tests) -----------------------

#if !defined(__CUDA_ARCH__)
// Key of the k-th largest of l[0, v) (1 <= k <= v), as top_k_key below does on the device.
inline int32_t top_k_key_host(const float* l, int64_t v, int64_t k) {
  uint32_t prefix = 0;
  int64_t rank = k;
  for (int pass = 0; pass < kPasses; ++pass) {
    uint32_t hist[kBins] = {};
    for (int64_t i = 0; i < v; ++i) {
      const uint32_t u = ukey(ordered_key(l[i]));
      if (in_prefix(u, prefix, pass)) ++hist[digit(u, pass)];
    }
    int64_t above = 0, above_bin = 0;
    int bin = -1;
    for (int lane = kLanes - 1; lane >= 0 && bin < 0; --lane) {  // lanes from the top
      bin = pick_count_bin(hist, lane * kBinsPerLane, kBinsPerLane, above, rank, &above_bin);
      for (int e = 0; e < kBinsPerLane; ++e) above += hist[lane * kBinsPerLane + e];
    }
    prefix |= static_cast<uint32_t>(bin) << shift_of(pass);
    rank -= above_bin;
  }
  return key_of(prefix);
}

// Nucleus cut of l[0, v) given the top-k key and the row max m, as top_p_key below does on the device.
inline int32_t top_p_key_host(const float* l, int64_t v, int32_t threshold_key, float m, double top_p) {
  int64_t total = 0;
  for (int64_t i = 0; i < v; ++i) total += kept_by_top_k(l[i], threshold_key) ? top_p_weight(l[i], m) : 0;
  const double limit = nucleus_threshold(top_p, total);
  uint32_t prefix = 0;
  int64_t acc = 0;
  const bool split = v <= kMaxSplitWeightV;
  for (int pass = 0; pass < kPasses; ++pass) {
    uint32_t lo[kBins] = {}, hi[kBins] = {};
    int64_t wide[kBins] = {};
    for (int64_t i = 0; i < v; ++i) {
      const int32_t key = ordered_key(l[i]);
      const uint32_t u = ukey(key);
      if (key >= threshold_key && in_prefix(u, prefix, pass)) {
        const int64_t w = top_p_weight(l[i], m);
        if (split) {
          lo[digit(u, pass)] += weight_lo(w);
          hi[digit(u, pass)] += weight_hi(w);
        } else {
          wide[digit(u, pass)] += w;
        }
      }
    }
    // Every lane walks its bins; the lowest bin found over all lanes wins (the warp min).
    int64_t above = acc, best_above = 0;
    int best = kBins;
    for (int lane = kLanes - 1; lane >= 0; --lane) {
      const int first = lane * kBinsPerLane;
      int64_t weight[kBinsPerLane];
      for (int e = 0; e < kBinsPerLane; ++e) weight[e] = split ? weight_of(lo[first + e], hi[first + e]) : wide[first + e];
      int64_t above_bin = 0;
      const int bin = pick_weight_bin(weight, first, kBinsPerLane, above, limit, &above_bin);
      if (bin >= 0 && bin < best) {
        best = bin;
        best_above = above_bin;
      }
      for (int e = 0; e < kBinsPerLane; ++e) above += weight[e];
    }
    prefix |= static_cast<uint32_t>(best) << shift_of(pass);
    acc = best_above;
  }
  return key_of(prefix);
}
#endif  // !__CUDA_ARCH__

// ---- device: one thread block per row -----------------------------------------------------------------

#if defined(__CUDACC__)
constexpr unsigned kFullMask = 0xffffffffu;

// Minimum over the warp (shuffles: __reduce_min_sync would need sm_80).
__device__ __forceinline__ unsigned warp_min(unsigned v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) {
    const unsigned other = __shfl_xor_sync(kFullMask, v, o);
    v = other < v ? other : v;
  }
  return v;
}

// Sum of the lanes above this one (lane + 1 .. 31) of warp 0.
__device__ __forceinline__ int64_t lanes_above(int64_t own) {
  const int lane = threadIdx.x % kLanes;
  int64_t suffix = own;
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) {
    const int64_t up = __shfl_down_sync(kFullMask, suffix, o);
    if (lane + o < kLanes) suffix += up;
  }
  return suffix - own;
}

// Key of the k-th largest entry of the row (1 <= k <= v; ties kept). Called by every thread of the
// block; every thread gets the key. Row: i -> float guided logit (shared or global memory).
template <typename Row>
__device__ int32_t top_k_key(const Row& row, int64_t v, int64_t k) {
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t picked_bin;
  __shared__ int64_t picked_above;
  uint32_t prefix = 0;
  int64_t rank = k;
  for (int pass = 0; pass < kPasses; ++pass) {
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
    __syncthreads();  // also: every thread has read the previous pass's pick
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      const uint32_t u = ukey(ordered_key(row(i)));
      if (in_prefix(u, prefix, pass)) atomicAdd(&hist[digit(u, pass)], 1u);
    }
    __syncthreads();
    if (threadIdx.x < kLanes) {
      const int first = threadIdx.x * kBinsPerLane;
      int64_t own = 0;
#pragma unroll
      for (int e = 0; e < kBinsPerLane; ++e) own += hist[first + e];
      int64_t above_bin = 0;
      const int bin = pick_count_bin(hist, first, kBinsPerLane, lanes_above(own), rank, &above_bin);
      if (bin >= 0) {  // exactly one lane: the counts above grow strictly past `rank` once
        picked_bin = static_cast<uint32_t>(bin);
        picked_above = above_bin;
      }
    }
    __syncthreads();
    prefix |= picked_bin << shift_of(pass);
    rank -= picked_above;
  }
  return key_of(prefix);
}

// Nucleus cut (pool_math.h, "top-p") of a row whose top-k key is threshold_key and whose max is m
// (kept by top-k, weight 2^30): the smallest key >= threshold_key with weight above < top_p * total.
template <typename Row>
__device__ int32_t top_p_key(const Row& row, int64_t v, int32_t threshold_key, float m, double top_p) {
  __shared__ uint32_t lo[kBins], hi[kBins];  // the two halves of each bin's weight (split)
  __shared__ unsigned long long wide[kBins];  // each bin's weight (rows longer than kMaxSplitWeightV)
  __shared__ uint32_t picked_bin;
  __shared__ int64_t picked_above;
  const bool split = v <= kMaxSplitWeightV;
  int64_t total = 0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    const float l = row(i);
    total += kept_by_top_k(l, threshold_key) ? top_p_weight(l, m) : 0;
  }
  const double limit = nucleus_threshold(top_p, cuda::block_reduce(total, cuda::Int64SumOp(), int64_t{0}));
  uint32_t prefix = 0;
  int64_t acc = 0;
  for (int pass = 0; pass < kPasses; ++pass) {
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
      lo[b] = hi[b] = 0;
      wide[b] = 0;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      const float l = row(i);
      const int32_t key = ordered_key(l);
      const uint32_t u = ukey(key);
      if (key >= threshold_key && in_prefix(u, prefix, pass)) {
        const int64_t w = top_p_weight(l, m);  // only for the keys still in the running
        if (w > 0 && split) {
          atomicAdd(&lo[digit(u, pass)], weight_lo(w));
          atomicAdd(&hi[digit(u, pass)], weight_hi(w));
        } else if (w > 0) {
          atomicAdd(&wide[digit(u, pass)], static_cast<unsigned long long>(w));
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < kLanes) {
      const int first = threadIdx.x * kBinsPerLane;
      int64_t weight[kBinsPerLane], own = 0;
#pragma unroll
      for (int e = 0; e < kBinsPerLane; ++e) {
        weight[e] = split ? weight_of(lo[first + e], hi[first + e]) : static_cast<int64_t>(wide[first + e]);
        own += weight[e];
      }
      int64_t above_bin = 0;
      const int bin = pick_weight_bin(weight, first, kBinsPerLane, acc + lanes_above(own), limit, &above_bin);
      // The lowest bin found by any lane (the row max keeps at least one bin inside).
      const unsigned lowest = warp_min(bin >= 0 ? static_cast<unsigned>(bin) : kBins);
      if (bin >= 0 && static_cast<unsigned>(bin) == lowest) {
        picked_bin = lowest;
        picked_above = above_bin;
      }
    }
    __syncthreads();
    prefix |= picked_bin << shift_of(pass);
    acc = picked_above;
  }
  return key_of(prefix);
}
#endif  // __CUDACC__

}  // namespace radix
}  // namespace specdec
