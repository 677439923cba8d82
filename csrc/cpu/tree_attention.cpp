// Kernel 3 on the CPU: tree-masked attention over a raster-slot KV cache (docs/design.md, "Kernel 3").
//
// FlashAttention-style blocking: one work item is (batch, query head, tile of kQueryTile
// queries), spread over threads with at::parallel_for. An item walks the keys in tiles of
// kKeyTile with an online softmax (running max and sum per query, in base 2), so the largest
// score buffer is kQueryTile x kKeyTile and memory stays linear in the key length. Key tiles
// that no query of the item can see (all invalid, or all later in raster order) are skipped
// from positions and validity alone; tiles every query fully sees skip the per-pair rule.
//
// Two bodies, by the item's number of queries:
// - at most 4 (the decoders' one-token steps): scores row-major, W keys' dot products reduced
//   together by a transpose-add, float32 K read where it lies;
// - more (verification windows, prefill): scores transposed, S^T[key][query row], one query row
//   per vector lane, so K rows are read where they lie (float32) or converted row by row, and the
//   visibility rule and the online softmax run across rows in vector lanes.
// float32 K and V (D a multiple of W) are read in place, other rows converted into scratch;
// P.V reads only valid keys (an empty cache slot may hold garbage, even NaN, and 0 * NaN is NaN)
// and only the item's real query rows.
//
// Inner loops use GCC/Clang vector extensions in vectors of W floats, W the register width of
// the instruction set (16 under AVX-512, 8 under AVX2, 4 on baseline x86-64): the same source is
// compiled once per instruction set and picked at load time. (A fixed 16-float type was two ymm
// registers per value under AVX2: its accumulators spilled to the stack and the bodies ran
// 10-35x slower than torch's SDPA.) fp16/bf16 are widened W at a time (float32 accumulation
// everywhere).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "specdec/attention_math.h"
#include "specdec/attention_problem.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

// The build compiles with -ffp-contract=off so kernel 1 rounds like its reference; attention is
// checked against tolerances instead, and fused multiply-adds halve its inner-loop instructions.
#pragma GCC optimize("fp-contract=fast")
// Vector types wider than the baseline ISA's registers are passed between always-inlined helpers
// only; no ABI is involved.
#pragma GCC diagnostic ignored "-Wpsabi"

// Helpers are force-inlined so each instruction-set clone (attend_avx512, attend_avx2,
// attend_generic) gets its own vector code.
#define SPECDEC_INLINE inline __attribute__((always_inline))

// Two-source lane shuffle with constant indices: Clang and GCC >= 12 spell it
// __builtin_shufflevector, older GCC __builtin_shuffle with an index vector of type IDX.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SPECDEC_SHUFFLE(IDX, x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SPECDEC_SHUFFLE(IDX, x, y, ...) __builtin_shuffle(x, y, IDX{__VA_ARGS__})
#endif


namespace specdec {
namespace {

constexpr int kVec = 16;                 // the widest vector (AVX-512): D is padded to a multiple
constexpr int kQueryTile = 32;           // queries per work item
constexpr int kKeyTile = 64;             // keys per inner tile
constexpr int kRowBlock = 4;             // at most this many queries: the few-query body
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Positions and validity of one key tile: the smallest and largest position of its valid keys
// (kmin > kmax when none is valid) and whether all its keys are valid.
struct KeyTile {
  int64_t kmin, kmax;
  bool all_valid;
};

// Everything a work item needs, in raw pointers and element strides.
struct Problem : AttentionProblem {
  at::ScalarType dtype;
  int64_t dp;                   // D rounded up to kVec: the row stride of the scratch buffers
  int64_t key_tiles;            // ceil(Nk / kKeyTile)
  const KeyTile* tiles;         // [B, key_tiles]: the same for every head, so scanned once per call
};

// Per-thread buffers, 64-byte aligned, kept between calls (thread_scratch): allocating and
// zeroing ~40 KB per call was a visible part of a decode step over a short cache. Nothing
// relies on their contents: every body writes what it reads (padding columns included).
struct Scratch {
  int64_t dp;
  std::vector<float> storage;
  std::vector<uint32_t> tree_storage;
  float *qs, *kt, *ks, *vs, *s, *o;
  explicit Scratch(int64_t dp_) : dp(dp_) {
    const int64_t sizes[] = {kQueryTile * dp, dp * kKeyTile, kKeyTile * dp, kKeyTile * dp, kQueryTile * kKeyTile,
                             kQueryTile * dp};
    int64_t total = 0;
    for (int64_t s_ : sizes) total += (s_ + kVec - 1) / kVec * kVec;
    storage.assign(total + kVec, 0.0f);
    float* p = storage.data();
    p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    float** slots[] = {&qs, &kt, &ks, &vs, &s, &o};
    for (int i = 0; i < 6; ++i) {
      *slots[i] = p;
      p += (sizes[i] + kVec - 1) / kVec * kVec;
    }
  }
  uint32_t* tree_cols(int64_t n) {
    if (static_cast<int64_t>(tree_storage.size()) < n) tree_storage.resize(n);
    return tree_storage.data();
  }
};

Scratch& thread_scratch(int64_t dp) {
  static thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch || scratch->dp != dp) scratch = std::make_unique<Scratch>(dp);
  return *scratch;
}

// Reads n elements of the input dtype as float, times `mul`.
SPECDEC_INLINE void load_row(const void* base, int64_t offset, at::ScalarType dtype, int64_t n, float mul,
                     float* dst) {
  switch (dtype) {
    case at::kHalf: {
      const c10::Half* p = static_cast<const c10::Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]) * mul;
      break;
    }
    case at::kBFloat16: {
      const c10::BFloat16* p = static_cast<const c10::BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]) * mul;
      break;
    }
    default: {
      const float* p = static_cast<const float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = p[i] * mul;
    }
  }
}

SPECDEC_INLINE void store_row(void* base, int64_t offset, at::ScalarType dtype, int64_t n, const float* src) {
  switch (dtype) {
    case at::kHalf: {
      c10::Half* p = static_cast<c10::Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<c10::Half>(src[i]);
      break;
    }
    case at::kBFloat16: {
      c10::BFloat16* p = static_cast<c10::BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<c10::BFloat16>(src[i]);
      break;
    }
    default: {
      float* p = static_cast<float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = src[i];
    }
  }
}

// e^f for |f| <= ln(2) / 2: its degree-6 Taylor polynomial by Horner, on a float or a vector of
// floats of any width (every instruction-set clone computes the same digits).
template <class T>
SPECDEC_INLINE T exp_taylor(T f) {
  T p = f * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  return p * f + 1.0f;
}

KeyTile scan_key_tile(const bool* kvalid, const int64_t* kpos, int64_t k0, int keys) {
  KeyTile t{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(), true};
  for (int j = 0; j < keys; ++j) {
    const bool ok = kvalid == nullptr || kvalid[k0 + j];
    t.all_valid &= ok;
    const int64_t p = kpos[k0 + j];
    t.kmin = std::min(t.kmin, ok ? p : std::numeric_limits<int64_t>::max());
    t.kmax = std::max(t.kmax, ok ? p : std::numeric_limits<int64_t>::min());
  }
  return t;
}

// What both bodies need of one work item: queries [q0, q0 + nrows) of head h in batch b.
struct Item {
  int64_t nrows;
  int rows;                   // nrows rounded up to kRowBlock (the P.V register blocks)
  int64_t hk;                 // the K/V head (GQA)
  const int64_t* qpos;        // the item's query positions
  const int64_t* kpos;        // the batch row's key positions
  const bool* kvalid;         // nullptr: every key valid
  const int32_t* tree;        // the item's packed tree-mask rows, or nullptr
  int64_t block_start;        // first key slot of the draft block
  int64_t out_row0;           // first output row
};

SPECDEC_INLINE Item item_of(const Problem& pb, int64_t b, int64_t h, int64_t q0, int64_t max_rows) {
  Item it;
  it.nrows = std::min<int64_t>(max_rows, pb.nq - q0);
  it.rows = static_cast<int>((it.nrows + kRowBlock - 1) / kRowBlock * kRowBlock);
  it.hk = h / pb.group;
  it.qpos = pb.q_pos + b * pb.nq + q0;
  it.kpos = pb.kv_pos + b * pb.nk;
  it.kvalid = pb.kv_valid ? pb.kv_valid + b * pb.nk : nullptr;
  it.tree = pb.tree ? pb.tree + (b * pb.nq + q0) * pb.words : nullptr;
  it.block_start = pb.nk - pb.nq;
  it.out_row0 = (b * pb.hq + h) * pb.nq + q0;
  return it;
}

// Normalise the item's output rows o [nrows, dp] by their sums l and store them with their
// log-sum-exp (m in base 2); a query that saw nothing keeps O = 0 and gets lse = -inf.
SPECDEC_INLINE void store_item(const Problem& pb, const Item& it, float* o_rows, const float* l, const float* m) {
  const int64_t d = pb.d, dp = pb.dp;
  for (int64_t i = 0; i < it.nrows; ++i) {
    float* o = o_rows + i * dp;
    const float inv = l[i] != 0.0f ? 1.0f / l[i] : 0.0f;   // (!=, not >: a NaN sum stays NaN)
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    store_row(pb.out, (it.out_row0 + i) * d, pb.dtype, d, o);
    pb.lse[it.out_row0 + i] = l[i] != 0.0f ? (m[i] + std::log2(l[i])) * kLn2 : kNegInf;
  }
}

// ---------------------------------------------------------------------------------------------
// Vectors of W floats and their helpers. The few-query body keeps one query's scores for W keys
// in one vector: W dot products are reduced together by a transpose-add (no horizontal sum
// through memory, whose scalar stores read back by vector loads stalled store forwarding), and
// visibility masks are built before the dot products (so the masks' few scalar stores have
// retired by the time the softmax reads them as vectors).

template <int W>
struct VecT {
  typedef float f __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t i __attribute__((vector_size(W * sizeof(int32_t))));
  typedef int64_t l __attribute__((vector_size(W * sizeof(int64_t))));
  typedef uint16_t h __attribute__((vector_size(W * sizeof(uint16_t))));
  typedef uint8_t b __attribute__((vector_size(W)));
};

template <class T>
SPECDEC_INLINE T load_v(const void* p) {
  T r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
template <class T>
SPECDEC_INLINE void store_v(void* p, T x) {
  std::memcpy(p, &x, sizeof(x));
}
template <class T, class U>
SPECDEC_INLINE T bitcast_v(U x) {
  static_assert(sizeof(T) == sizeof(U), "bitcast between vectors of one size");
  T r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
}
template <class F>
SPECDEC_INLINE F splat_v(float x) {
  return F{} + x;
}
// mask ? a : b per lane with bit operations (mask lanes all ones or all zeros).
template <class F, class I>
SPECDEC_INLINE F select_v(I mask, F a, F b) {
  return bitcast_v<F>((bitcast_v<I>(a) & mask) | (bitcast_v<I>(b) & ~mask));
}
template <class F>
SPECDEC_INLINE F vmax_v(F a, F b) {
  return select_v(a > b, a, b);
}
// 2^t for t <= 0 without libm: t = n + f, |f| <= 1/2 (round to nearest by the 1.5 * 2^23 trick),
// 2^f by exp_taylor (relative error ~1e-7), 2^n built in the exponent bits. Arguments below -126
// give 2^-126 (a masked score is zeroed by the caller).
template <class F>
SPECDEC_INLINE F exp2_v(F t) {
  using I = decltype(t < t);
  const F lo = splat_v<F>(-126.0f);
  const F x = select_v(t < lo, lo, t);
  const F n = (x + 12582912.0f) - 12582912.0f;
  const F p = exp_taylor((x - n) * kLn2);
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  return p * bitcast_v<F>(e);
}
template <int W>
SPECDEC_INLINE float hsum_v(typename VecT<W>::f x) {
  alignas(64) float t[W];
  store_v(t, x);  // one wide store, narrow loads inside it: forwarded, no stall
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += t[i];
  return s;
}
template <int W>
SPECDEC_INLINE float hmax_v(typename VecT<W>::f x) {
  alignas(64) float t[W];
  store_v(t, x);
  float m = t[0];
  for (int i = 1; i < W; ++i) m = std::max(m, t[i]);
  return m;
}

// Transpose-add: lane u of the result is the sum of the W lanes of a[u]. Each step adds the
// even and odd lanes of two vectors; after log2(W) steps the sums are in order.
SPECDEC_INLINE VecT<4>::f pair_add(VecT<4>::f x, VecT<4>::f y) {
  return SPECDEC_SHUFFLE(VecT<4>::i, x, y, 0, 2, 4, 6) + SPECDEC_SHUFFLE(VecT<4>::i, x, y, 1, 3, 5, 7);
}
SPECDEC_INLINE VecT<16>::f pair_add(VecT<16>::f x, VecT<16>::f y) {
  return SPECDEC_SHUFFLE(VecT<16>::i, x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SPECDEC_SHUFFLE(VecT<16>::i, x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
template <int W>
SPECDEC_INLINE typename VecT<W>::f reduce_lanes(typename VecT<W>::f* a) {
  for (int n = W; n > 1; n /= 2)
    for (int u = 0; u < n / 2; ++u) a[u] = pair_add(a[2 * u], a[2 * u + 1]);
  return a[0];
}
// AVX2: the same within each 128-bit half (vshufps, no lane crossing) for two steps, then one
// cross-half add (vperm2f128): 21 instructions for 8 dot products.
SPECDEC_INLINE VecT<8>::f hadd8(VecT<8>::f x, VecT<8>::f y) {
  return SPECDEC_SHUFFLE(VecT<8>::i, x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
         SPECDEC_SHUFFLE(VecT<8>::i, x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}
template <>
SPECDEC_INLINE VecT<8>::f reduce_lanes<8>(VecT<8>::f* a) {
  const VecT<8>::f u0 = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));
  const VecT<8>::f u1 = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
  return SPECDEC_SHUFFLE(VecT<8>::i, u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         SPECDEC_SHUFFLE(VecT<8>::i, u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// dst[0, d) = row * mul as float, dst[d, dw) = 0 (padding that dot products may read).
// 16-bit inputs are widened W at a time with integer bit operations (c10's scalar conversions
// cost more than the attention arithmetic itself).
template <int W>
SPECDEC_INLINE void convert_row(const void* base, int64_t offset, at::ScalarType dtype, int64_t d, int64_t dw,
                                float mul, float* dst) {
  using F = typename VecT<W>::f;
  using I = typename VecT<W>::i;
  using H = typename VecT<W>::h;
  const int64_t full = d / W * W;
  if (dtype == at::kFloat) {
    const float* p = static_cast<const float*>(base) + offset;
    for (int64_t c = 0; c < full; c += W) store_v(dst + c, load_v<F>(p + c) * mul);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int64_t c = 0; c < full; c += W) {
      const I x = __builtin_convertvector(load_v<H>(p + c), I);  // zero-extended bits
      F f;
      if (dtype == at::kBFloat16) {
        f = bitcast_v<F>(x << 16);  // bf16 is the top half of a float32
      } else {
        // fp16: shift exponent+mantissa into float position and rebias by 2^112 (exact for
        // normals and subnormals); Inf/NaN get the all-ones exponent; then the sign.
        const I em = x & 0x7fff;
        const I sh = em << 13;
        const I fin = bitcast_v<I>(bitcast_v<F>(sh) * 0x1p112f);
        const I inf_nan = em >= 0x7c00;
        const I r = (inf_nan & (sh | 0x7f800000)) | (~inf_nan & fin);
        f = bitcast_v<F>(r | ((x & 0x8000) << 16));
      }
      store_v(dst + c, f * mul);
    }
  }
  if (full < d) load_row(base, offset + full, dtype, d - full, mul, dst + full);
  for (int64_t c = d; c < dw; ++c) dst[c] = 0.0f;
}

// mask[i * kKeyTile + j] = all ones iff key k0 + j is visible to query i (attention_math.h
// key_visible, by vectors of W keys; the tree bits and the ragged tail by scalars).
template <int W>
SPECDEC_INLINE void few_masks(const Item& it, int64_t words, int64_t k0, int keys, int32_t* mask) {
  using I = typename VecT<W>::i;
  using L = typename VecT<W>::l;
  using B = typename VecT<W>::b;
  const int nrows = static_cast<int>(it.nrows);
  const int full = keys / W * W;
  for (int j0 = 0; j0 < full; j0 += W) {
    const L kp = load_v<L>(it.kpos + k0 + j0);
    I valid = I{} - 1;
    if (it.kvalid != nullptr) valid = __builtin_convertvector(load_v<B>(it.kvalid + k0 + j0), I) != 0;
    for (int i = 0; i < nrows; ++i) {
      const L le = kp <= (L{} + it.qpos[i]);
      store_v(mask + i * kKeyTile + j0, __builtin_convertvector(le, I) & valid);
    }
  }
  for (int i = 0; i < nrows; ++i) {
    for (int j = full; j < kKeyTile; ++j) {
      const bool ok = j < keys && (it.kvalid == nullptr || it.kvalid[k0 + j]) && it.kpos[k0 + j] <= it.qpos[i];
      mask[i * kKeyTile + j] = ok ? -1 : 0;
    }
    if (it.tree != nullptr) {
      const int32_t* row = it.tree + i * words;
      for (int j = static_cast<int>(std::max<int64_t>(0, it.block_start - k0)); j < keys; ++j)
        if (!tree_bit(row, k0 + j - it.block_start)) mask[i * kKeyTile + j] = 0;
    }
  }
}

// S[i, j] = Qs[i] . K[j] for the nrows queries and keys [0, keys) of the tile, W keys at a time
// (a short last group repeats its last key so no row past the tensor is read).
template <int W>
SPECDEC_INLINE void few_scores(const float* qs, int64_t dp, const float* krows, int64_t kstride, float* s, int nrows,
                               int keys, int64_t dw) {
  using F = typename VecT<W>::f;
  for (int j0 = 0; j0 < keys; j0 += W) {
    const float* kr[W];
    for (int u = 0; u < W; ++u) kr[u] = krows + std::min(j0 + u, keys - 1) * kstride;
    for (int i = 0; i < nrows; ++i) {
      const float* qi = qs + i * dp;
      F acc[W] = {};
      for (int64_t c = 0; c < dw; c += W) {
        const F qv = load_v<F>(qi + c);
#pragma GCC unroll 16
        for (int u = 0; u < W; ++u) acc[u] += qv * load_v<F>(kr[u] + c);
      }
      store_v(s + i * kKeyTile + j0, reduce_lanes<W>(acc));
    }
  }
}

// O[0 .. NR, c0 : c0 + NV * W] += P[rows, keys] . V[keys, ...] over the n keys listed in idx
// (Indexed: the tile's valid keys, so garbage in invalid V slots is never read) or 0..n-1.
// P[r, j] is p[r * p_row + j * p_key]: row-major scores (few-query body) or transposed ones
// (many-query body). KS sets of accumulators over alternating keys keep enough independent FMA
// chains in flight when NR * NV is small.
template <int W, int NR, int NV, int KS, bool Indexed>
SPECDEC_INLINE void pv_block(const float* p, int64_t p_row, int64_t p_key, const float* vrows, int64_t vstride,
                             const int* idx, int n, float* o, int64_t dp, int64_t c0) {
  using F = typename VecT<W>::f;
  F acc[KS][NR][NV];
  for (int s_ = 0; s_ < KS; ++s_)
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < NV; ++u) acc[s_][r][u] = s_ == 0 ? load_v<F>(o + r * dp + c0 + u * W) : F{};
  int t = 0;
  for (; t + KS <= n; t += KS) {
#pragma GCC unroll 2
    for (int s_ = 0; s_ < KS; ++s_) {
      const int j = Indexed ? idx[t + s_] : t + s_;
      F vv[NV];
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) vv[u] = load_v<F>(vrows + j * vstride + c0 + u * W);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const float pr = p[r * p_row + j * p_key];
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) acc[s_][r][u] += vv[u] * pr;
      }
    }
  }
  for (; t < n; ++t) {
    const int j = Indexed ? idx[t] : t;
    for (int r = 0; r < NR; ++r) {
      const float pr = p[r * p_row + j * p_key];
      for (int u = 0; u < NV; ++u) acc[0][r][u] += load_v<F>(vrows + j * vstride + c0 + u * W) * pr;
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NV; ++u) {
      F sum = acc[0][r][u];
      for (int s_ = 1; s_ < KS; ++s_) sum += acc[s_][r][u];
      store_v(o + r * dp + c0 + u * W, sum);
    }
}

// NR rows: the columns in passes of at most MaxNV vectors (the accumulators fit the registers).
template <int W, int NR, bool Indexed>
SPECDEC_INLINE void pv_rows(const float* p, int64_t p_row, int64_t p_key, const float* vrows, int64_t vstride,
                            const int* idx, int n, float* o, int64_t dp, int64_t dw) {
  constexpr int MaxNV = NR >= 4 ? 2 : 4;
  constexpr int KS = NR == 1 ? 2 : 1;
  for (int64_t c0 = 0; c0 < dw; c0 += MaxNV * W) {
    switch (std::min<int64_t>(MaxNV, (dw - c0) / W)) {
      case 4: pv_block<W, NR, (MaxNV >= 4 ? 4 : 1), KS, Indexed>(p, p_row, p_key, vrows, vstride, idx, n, o, dp, c0); break;
      case 3: pv_block<W, NR, (MaxNV >= 3 ? 3 : 1), KS, Indexed>(p, p_row, p_key, vrows, vstride, idx, n, o, dp, c0); break;
      case 2: pv_block<W, NR, 2, KS, Indexed>(p, p_row, p_key, vrows, vstride, idx, n, o, dp, c0); break;
      default: pv_block<W, NR, 1, KS, Indexed>(p, p_row, p_key, vrows, vstride, idx, n, o, dp, c0); break;
    }
  }
}

// O[0 .. nrows, 0 : dw] += P . V, in blocks of 4, 2 and 1 rows: padding rows cost nothing.
template <int W, bool Indexed>
SPECDEC_INLINE void pv_tile(const float* p, int64_t p_row, int64_t p_key, const float* vrows, int64_t vstride,
                            const int* idx, int n, float* o, int nrows, int64_t dp, int64_t dw) {
  int r = 0;
  for (; nrows - r >= 4; r += 4)
    pv_rows<W, 4, Indexed>(p + r * p_row, p_row, p_key, vrows, vstride, idx, n, o + r * dp, dp, dw);
  if (nrows - r >= 2) {
    pv_rows<W, 2, Indexed>(p + r * p_row, p_row, p_key, vrows, vstride, idx, n, o + r * dp, dp, dw);
    r += 2;
  }
  if (nrows - r >= 1) pv_rows<W, 1, Indexed>(p + r * p_row, p_row, p_key, vrows, vstride, idx, n, o + r * dp, dp, dw);
}

template <int W>
SPECDEC_INLINE void pv_any(const float* p, int64_t p_row, int64_t p_key, const float* vrows, int64_t vstride,
                           const int* idx, int n, bool indexed, float* o, int nrows, int64_t dp, int64_t dw) {
  if (indexed) {
    pv_tile<W, true>(p, p_row, p_key, vrows, vstride, idx, n, o, nrows, dp, dw);
  } else {
    pv_tile<W, false>(p, p_row, p_key, vrows, vstride, idx, n, o, nrows, dp, dw);
  }
}

// Where a key tile's K and V rows are read from. float32 rows whose length is a multiple of W
// are read where they lie; others are staged in scratch (converted, zero-padded to dw) row by
// row. Only valid keys are staged and listed for P.V (idx, n): an empty cache slot may hold
// garbage, even NaN, and 0 * NaN is NaN. Invalid K rows get garbage scores that the visibility
// masks replace by -inf (staged ones are zeroed, so no NaN is even computed).
struct TileRows {
  const float *k, *v;
  int64_t k_stride, v_stride;
  int n;  // keys for P.V: all of them, or the n valid ones listed in idx
};

template <int W>
SPECDEC_INLINE TileRows tile_rows(const Problem& pb, const Item& it, int64_t b, int64_t k0, int keys,
                                  bool all_valid, Scratch& sc, int* idx) {
  const int64_t d = pb.d, dp = pb.dp, dw = (d + W - 1) / W * W;
  TileRows t;
  t.n = keys;
  if (!all_valid) {
    t.n = 0;
    for (int j = 0; j < keys; ++j) {
      idx[t.n] = j;
      t.n += it.kvalid[k0 + j] ? 1 : 0;
    }
  }
  const int64_t k_off = b * pb.k_sb + it.hk * pb.k_sh + k0 * pb.k_sn;
  const int64_t v_off = b * pb.v_sb + it.hk * pb.v_sh + k0 * pb.v_sn;
  if (pb.dtype == at::kFloat && d % W == 0) {
    t.k = static_cast<const float*>(pb.k) + k_off;
    t.v = static_cast<const float*>(pb.v) + v_off;
    t.k_stride = pb.k_sn;
    t.v_stride = pb.v_sn;
    return t;
  }
  for (int u = 0; u < t.n; ++u) {
    const int j = all_valid ? u : idx[u];
    convert_row<W>(pb.k, k_off + j * pb.k_sn, pb.dtype, d, dw, 1.0f, sc.ks + j * dp);
    convert_row<W>(pb.v, v_off + j * pb.v_sn, pb.dtype, d, dw, 1.0f, sc.vs + j * dp);
  }
  if (!all_valid) {
    for (int j = 0; j < keys; ++j)
      if (!it.kvalid[k0 + j]) std::fill(sc.ks + j * dp, sc.ks + j * dp + dw, 0.0f);
  }
  t.k = sc.ks;
  t.v = sc.vs;
  t.k_stride = t.v_stride = dp;
  return t;
}

// One work item of at most kRowBlock queries: queries [q0, q0 + nrows) of head h in batch b
// against every visible key tile, scores row-major.
template <int W>
SPECDEC_INLINE void attend_few_body(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  using F = typename VecT<W>::f;
  using I = typename VecT<W>::i;
  const Item it = item_of(pb, b, h, q0, kRowBlock);
  const int nrows = static_cast<int>(it.nrows);
  const int64_t d = pb.d, dp = pb.dp, dw = (d + W - 1) / W * W;

  // Queries, pre-scaled so exp2(s - m) is the softmax numerator; columns d..dw are 0.
  for (int i = 0; i < nrows; ++i)
    convert_row<W>(pb.q, b * pb.q_sb + h * pb.q_sh + (q0 + i) * pb.q_sn, pb.dtype, d, dw, pb.scale_log2,
                   sc.qs + i * dp);
  std::fill(sc.o, sc.o + nrows * dp, 0.0f);
  float m[kRowBlock], l[kRowBlock];
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
  for (int i = 0; i < nrows; ++i) {
    m[i] = kNegInf;
    l[i] = 0.0f;
    qmin = std::min(qmin, it.qpos[i]);
    qmax = std::max(qmax, it.qpos[i]);
  }

  alignas(64) int32_t mask[kRowBlock * kKeyTile];
  alignas(64) int idx[kKeyTile];

  for (int64_t k0 = 0; k0 < pb.nk; k0 += kKeyTile) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, pb.nk - k0));
    // Tile skipping from positions and validity: nothing visible -> no work at all.
    const KeyTile& tile = pb.tiles[b * pb.key_tiles + k0 / kKeyTile];
    if (tile.kmin > qmax) continue;  // also covers a tile with no valid key
    const bool touches_tree = it.tree != nullptr && k0 + keys > it.block_start;
    const bool all_visible = tile.all_valid && tile.kmax <= qmin && !touches_tree && keys == kKeyTile;
    if (!all_visible) few_masks<W>(it, pb.words, k0, keys, mask);

    const TileRows tr = tile_rows<W>(pb, it, b, k0, keys, tile.all_valid, sc, idx);
    few_scores<W>(sc.qs, dp, tr.k, tr.k_stride, sc.s, nrows, keys, dw);

    // Online softmax per query over the tile's vectors of scores; S becomes P in place.
    const int nv = (keys + W - 1) / W;
    for (int i = 0; i < nrows; ++i) {
      float* s = sc.s + i * kKeyTile;
      F mx = splat_v<F>(kNegInf);
      for (int v = 0; v < nv; ++v) {
        F x = load_v<F>(s + v * W);
        if (!all_visible) {
          x = select_v(load_v<I>(mask + i * kKeyTile + v * W), x, splat_v<F>(kNegInf));
          store_v(s + v * W, x);
        }
        mx = vmax_v(mx, x);
      }
      const float m_old = m[i];
      const float m_new = std::max(m_old, hmax_v<W>(mx));
      if (m_new == kNegInf) {  // nothing visible to this query yet: p = 0 for the tile
        // (or only NaN scores, which the vector max drops: the row is NaN, as the reference's)
        bool nan = false;
        for (int j = 0; j < keys; ++j) nan |= s[j] != s[j];
        if (nan) m[i] = l[i] = std::numeric_limits<float>::quiet_NaN();
        for (int v = 0; v < nv; ++v) store_v(s + v * W, F{});
        continue;
      }
      F sum = F{};
      for (int v = 0; v < nv; ++v) {
        const F x = load_v<F>(s + v * W);
        const F p = select_v(x == kNegInf, F{}, exp2_v(x - m_new));
        store_v(s + v * W, p);
        sum += p;
      }
      const float alpha = m_old == kNegInf ? 0.0f : std::exp2(m_old - m_new);
      l[i] = l[i] * alpha + hsum_v<W>(sum);
      m[i] = m_new;
      if (alpha != 1.0f) {
        float* o = sc.o + i * dp;
        for (int64_t c = 0; c < dw; ++c) o[c] *= alpha;
      }
    }
    pv_any<W>(sc.s, kKeyTile, 1, tr.v, tr.v_stride, idx, tr.n, !tile.all_valid, sc.o, nrows, dp, dw);
  }

  store_item(pb, it, sc.o, l, m);
}

// One work item of more than kRowBlock queries (verification windows, prefill): R = NR * W query
// rows, one row per vector lane. Scores are kept transposed, S^T[key][row], so K is read row by
// row (a broadcast per element) instead of being transposed for every item, and the visibility
// rule, the online softmax and its rescaling run across the item's rows in vector lanes. The
// tree mask is regrouped once per item into one bit per row for each draft-block column, so the
// rule is a vector test per key, not a scalar store per (row, key) that vector loads read back.
template <int W, int NR>
SPECDEC_INLINE void attend_rows_body(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  using F = typename VecT<W>::f;
  using I = typename VecT<W>::i;
  using L = typename VecT<W>::l;
  constexpr int R = NR * W;  // query rows of the item (padding lanes see no key)
  static_assert(R <= kQueryTile, "scratch holds kQueryTile query rows");
  constexpr int KU = NR >= 8 ? 1 : NR >= 4 ? 2 : 4;  // keys per score block (KU * NR accumulators)
  const Item it = item_of(pb, b, h, q0, R);
  const int nrows = static_cast<int>(it.nrows);
  const int64_t d = pb.d, dp = pb.dp, dw = (d + W - 1) / W * W;

  // Q^T [d, R], pre-scaled so exp2(s - m) is the softmax numerator.
  float* qt = sc.kt;  // dp * kKeyTile >= d * R floats
  std::fill(qt, qt + d * R, 0.0f);
  alignas(64) float qrow[128 + 16];
  for (int i = 0; i < nrows; ++i) {
    convert_row<W>(pb.q, b * pb.q_sb + h * pb.q_sh + (q0 + i) * pb.q_sn, pb.dtype, d, dw, pb.scale_log2, qrow);
    for (int64_t c = 0; c < d; ++c) qt[c * R + i] = qrow[c];
  }
  // Padding lanes get the lowest position: no key is ever visible to them.
  alignas(64) int64_t qp[R];
  alignas(64) int32_t lane_bit[R];
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
  for (int i = 0; i < R; ++i) {
    qp[i] = i < nrows ? it.qpos[i] : std::numeric_limits<int64_t>::min();
    lane_bit[i] = static_cast<int32_t>(1u << i);
    if (i < nrows) {
      qmin = std::min(qmin, it.qpos[i]);
      qmax = std::max(qmax, it.qpos[i]);
    }
  }
  // tree_cols[col]: bit i set iff row i may see draft-block column col.
  uint32_t* tree_cols = nullptr;
  if (it.tree != nullptr) {
    tree_cols = sc.tree_cols(pb.nq);
    for (int64_t col = 0; col < pb.nq; ++col) {
      uint32_t bits = 0;
      for (int i = 0; i < nrows; ++i) bits |= tree_bit(it.tree + i * pb.words, col) ? 1u << i : 0u;
      tree_cols[col] = bits;
    }
  }
  for (int i = 0; i < nrows; ++i) std::fill(sc.o + i * dp, sc.o + i * dp + dw, 0.0f);
  F m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    m[r] = splat_v<F>(kNegInf);
    l[r] = F{};
  }

  alignas(64) int idx[kKeyTile];
  float* st = sc.s;  // S^T [kKeyTile, R]
  for (int64_t k0 = 0; k0 < pb.nk; k0 += kKeyTile) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, pb.nk - k0));
    const KeyTile& tile = pb.tiles[b * pb.key_tiles + k0 / kKeyTile];
    if (tile.kmin > qmax) continue;  // nothing visible (also a tile with no valid key)
    const bool touches_tree = it.tree != nullptr && k0 + keys > it.block_start;
    const bool all_visible = tile.all_valid && tile.kmax <= qmin && !touches_tree;
    const TileRows tr = tile_rows<W>(pb, it, b, k0, keys, tile.all_valid, sc, idx);

    // S^T = K . Q^T, KU keys at a time (a short last group repeats its last key).
    for (int j0 = 0; j0 < keys; j0 += KU) {
      const float* kr[KU];
      for (int u = 0; u < KU; ++u) kr[u] = tr.k + std::min(j0 + u, keys - 1) * tr.k_stride;
      F acc[KU][NR] = {};
      for (int64_t c = 0; c < d; ++c) {
        F qv[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) qv[r] = load_v<F>(qt + c * R + r * W);
#pragma GCC unroll 4
        for (int u = 0; u < KU; ++u) {
          const float kc = kr[u][c];
#pragma GCC unroll 8
          for (int r = 0; r < NR; ++r) acc[u][r] += qv[r] * kc;
        }
      }
      for (int u = 0; u < KU && j0 + u < keys; ++u)
        for (int r = 0; r < NR; ++r) store_v(st + (j0 + u) * R + r * W, acc[u][r]);
    }

    // The visibility rule (attention_math.h key_visible) one key across R rows at a time, then
    // the online softmax across the rows' lanes.
    F alpha[NR];
    for (int r = 0; r < NR; ++r) {
      F mx = splat_v<F>(kNegInf);
      if (all_visible) {
        for (int j = 0; j < keys; ++j) mx = vmax_v(mx, load_v<F>(st + j * R + r * W));
      } else {
        const L qpr = load_v<L>(qp + r * W);
        const I bit = load_v<I>(lane_bit + r * W);
        for (int j = 0; j < keys; ++j) {
          const int64_t kj = k0 + j;
          I vis = __builtin_convertvector(qpr >= (L{} + it.kpos[kj]), I);
          if (it.kvalid != nullptr) vis &= I{} - static_cast<int32_t>(it.kvalid[kj]);
          const int64_t col = kj - it.block_start;
          if (tree_cols != nullptr && col >= 0) vis &= (bit & static_cast<int32_t>(tree_cols[col])) != 0;
          const F x = select_v(vis, load_v<F>(st + j * R + r * W), splat_v<F>(kNegInf));
          store_v(st + j * R + r * W, x);
          mx = vmax_v(mx, x);
        }
      }
      const F m_new = vmax_v(mx, m[r]);
      // A lane that has seen nothing yet keeps m = -inf: shift by 0 (its scores are all -inf).
      const F shift = select_v(m_new == kNegInf, F{}, m_new);
      alpha[r] = select_v(m[r] == kNegInf, F{}, exp2_v(m[r] - m_new));
      m[r] = m_new;
      F sum = F{};
      for (int j = 0; j < keys; ++j) {
        const F x = load_v<F>(st + j * R + r * W);
        const F p = select_v(x == kNegInf, F{}, exp2_v(x - shift));
        store_v(st + j * R + r * W, p);  // S^T now holds P^T for the P.V product
        sum += p;
      }
      l[r] = l[r] * alpha[r] + sum;
    }
    alignas(64) float scale_rows[R];
    for (int r = 0; r < NR; ++r) store_v(scale_rows + r * W, alpha[r]);
    for (int i = 0; i < nrows; ++i) {
      if (scale_rows[i] == 1.0f) continue;
      float* o = sc.o + i * dp;
      for (int64_t c = 0; c < dw; ++c) o[c] *= scale_rows[i];
    }
    pv_any<W>(st, 1, R, tr.v, tr.v_stride, idx, tr.n, !tile.all_valid, sc.o, nrows, dp, dw);
  }

  alignas(64) float lv[R], mv[R];
  for (int r = 0; r < NR; ++r) {
    store_v(lv + r * W, l[r]);
    store_v(mv + r * W, m[r]);
  }
  store_item(pb, it, sc.o, lv, mv);
}

// Picks the body for an item by its number of queries: the fewest vectors of rows that hold them.
template <int W>
SPECDEC_INLINE void attend_item_body(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  const int64_t nrows = std::min<int64_t>(kQueryTile, pb.nq - q0);
  if (nrows <= kRowBlock) {
    attend_few_body<W>(pb, b, h, q0, sc);
  } else if (nrows <= W) {
    attend_rows_body<W, 1>(pb, b, h, q0, sc);
  } else if (nrows <= 2 * W || 4 * W > kQueryTile) {
    attend_rows_body<W, 2>(pb, b, h, q0, sc);
  } else if (nrows <= 4 * W || 8 * W > kQueryTile) {
    attend_rows_body<W, (4 * W <= kQueryTile ? 4 : 2)>(pb, b, h, q0, sc);
  } else {
    attend_rows_body<W, (8 * W <= kQueryTile ? 8 : 2)>(pb, b, h, q0, sc);
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, int64_t, Scratch&);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Same code compiled three times; the widest instruction set the CPU has is picked at run time
// (features, not CPU models, so new CPUs get the AVX-512 path).
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi2")))
void attend_avx512(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  attend_item_body<16>(pb, b, h, q0, sc);
}
__attribute__((target("avx2,fma,bmi2")))
void attend_avx2(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  attend_item_body<8>(pb, b, h, q0, sc);
}
#endif
void attend_generic(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  attend_item_body<4>(pb, b, h, q0, sc);
}

AttendFn pick_attend() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw")) {
    return attend_avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return attend_avx2;
#endif
  return attend_generic;
}

}  // namespace

AttentionOut tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                const std::optional<at::Tensor>& kv_valid,
                                const std::optional<at::Tensor>& tree_mask, std::optional<double> scale) {
  check_tree_attention_args(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale);
  TORCH_CHECK_VALUE(q.device().is_cpu(), "tree_attention_cpu needs CPU tensors, got ", q.device());
  const int64_t b = q.size(0), hq = q.size(1), nq = q.size(2), d = q.size(3);
  const int64_t nk = k.size(2);
  AttentionSetup setup = setup_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale);
  if (setup.out.numel() == 0) return {setup.out, setup.lse};
  Problem pb;
  static_cast<AttentionProblem&>(pb) = setup.problem;
  pb.dtype = q.scalar_type();
  pb.dp = (d + kVec - 1) / kVec * kVec;

  // Key tile summaries for tile skipping, once per batch row (scanning them per item cost about
  // as much as a decode step's dot products).
  pb.key_tiles = (nk + kKeyTile - 1) / kKeyTile;
  std::vector<KeyTile> tiles(b * pb.key_tiles);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t t = 0; t < pb.key_tiles; ++t)
      tiles[r * pb.key_tiles + t] =
          scan_key_tile(pb.kv_valid ? pb.kv_valid + r * nk : nullptr, pb.kv_pos + r * nk, t * kKeyTile,
                        static_cast<int>(std::min<int64_t>(kKeyTile, nk - t * kKeyTile)));
  pb.tiles = tiles.data();

  const int64_t q_tiles = (nq + kQueryTile - 1) / kQueryTile;
  const int64_t items = b * hq * q_tiles;
  static const AttendFn attend_query_tile = pick_attend();
  // An item's work is its real queries times the keys, not kQueryTile times: one-query steps
  // over a short cache stay on the calling thread (cpu_parallel.h).
  const int64_t item_work = std::min<int64_t>(nq, kQueryTile) * nk * d;
  at::parallel_for(0, items, grain_for(item_work), [&](int64_t begin, int64_t end) {
    Scratch& scratch = thread_scratch(pb.dp);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t t = it % q_tiles;
      const int64_t bh = it / q_tiles;
      attend_query_tile(pb, bh / hq, bh % hq, t * kQueryTile, scratch);
    }
  });
  return {setup.out, setup.lse};
}

}  // namespace specdec
