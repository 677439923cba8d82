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
// - at most 4 (the decoders' one-token steps): scores row-major, one dot product per key with
//   float32 K read where it lies (K staged transposed for 16-bit inputs);
// - more (verification windows, prefill): scores transposed, S^T[key][query row], one query row
//   per vector lane, so K rows are read where they lie (float32) or converted row by row, and the
//   visibility rule and the online softmax run across rows in vector lanes. This replaced a
//   transposed copy of every key tile per item with per-row scalar softmax loops, which was 2-3x
//   slower than torch's SDPA at the decoders' 16-80-query windows.
// V is read in place for float32 tiles whose keys are all valid, else staged with invalid
// slots zeroed (an empty cache slot may hold garbage, even NaN, and 0 * NaN is NaN).
//
// Inner loops use GCC/Clang vector extensions (16 floats) and are compiled for AVX-512, AVX2
// and baseline x86-64 with target_clones, picked once at load time; fp16/bf16 are converted to
// float tile by tile (float32 accumulation everywhere).
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
#include <vector>

#include "specdec/attention_math.h"
#include "specdec/attention_problem.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

// The build compiles with -ffp-contract=off so kernel 1 rounds like its reference; attention is
// checked against tolerances instead, and fused multiply-adds halve its inner-loop instructions.
#pragma GCC optimize("fp-contract=fast")
// The 64-byte vector type is passed between always-inlined helpers only; no ABI is involved.
#pragma GCC diagnostic ignored "-Wpsabi"

// Helpers are force-inlined so each target clone of attend_query_tile gets its own vector code.
#define SPECDEC_INLINE inline __attribute__((always_inline))


namespace specdec {
namespace {

constexpr int kVec = 16;                 // floats per vector register (one zmm, two ymm)
constexpr int kQueryTile = 32;           // queries per work item
constexpr int kKeyTile = 64;             // keys per inner tile
constexpr int kKeyVecs = kKeyTile / kVec;
constexpr int kRowBlock = 4;             // query rows per register block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float vfloat __attribute__((vector_size(kVec * sizeof(float))));

SPECDEC_INLINE vfloat vload(const float* p) {
  vfloat r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
SPECDEC_INLINE void vstore(float* p, vfloat x) { std::memcpy(p, &x, sizeof(x)); }

// Everything a work item needs, in raw pointers and element strides.
struct Problem : AttentionProblem {
  at::ScalarType dtype;
  int64_t dp;                   // D rounded up to kVec
};

// Per-thread buffers, 64-byte aligned.
struct Scratch {
  std::vector<float> storage;
  float *qs, *kt, *ks, *vs, *s, *o, *m, *l;
  explicit Scratch(int64_t dp) {
    const int64_t sizes[] = {kQueryTile * dp, dp * kKeyTile, kKeyTile * dp, kKeyTile * dp, kQueryTile * kKeyTile,
                             kQueryTile * dp, kQueryTile, kQueryTile};
    int64_t total = 0;
    for (int64_t s_ : sizes) total += (s_ + kVec - 1) / kVec * kVec;
    storage.assign(total + kVec, 0.0f);
    float* p = storage.data();
    p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    float** slots[] = {&qs, &kt, &ks, &vs, &s, &o, &m, &l};
    for (int i = 0; i < 8; ++i) {
      *slots[i] = p;
      p += (sizes[i] + kVec - 1) / kVec * kVec;
    }
  }
};

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

// 2^t for t <= 0 on a whole key tile, vectorisable (no libm call): round-to-nearest split
// e^f for |f| <= ln(2) / 2: its degree-6 Taylor polynomial by Horner, on a float or (GCC/Clang
// vector extensions) a vector of floats, so exp2_tile and exp2_vec compute the same digits.
template <class T>
SPECDEC_INLINE T exp_taylor(T f) {
  T p = f * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  return p * f + 1.0f;
}

// t = n + f, |f| <= 1/2, degree-6 Taylor polynomial of 2^f (relative error ~1e-7), 2^n built in
// the exponent bits. Arguments below -126 give 2^-126 (a masked score is zeroed by the caller).
SPECDEC_INLINE void exp2_tile(const float* t, float* out) {
  alignas(64) float frac[kKeyTile];
  alignas(64) int32_t expo[kKeyTile];
  for (int j = 0; j < kKeyTile; ++j) {
    const float x = std::max(t[j], -126.0f);
    const float n = (x + 12582912.0f) - 12582912.0f;  // round to nearest integer (1.5 * 2^23 trick)
    frac[j] = exp_taylor((x - n) * kLn2);
    expo[j] = (static_cast<int32_t>(n) + 127) << 23;
  }
  alignas(64) float scale[kKeyTile];
  std::memcpy(scale, expo, sizeof(scale));
  for (int j = 0; j < kKeyTile; ++j) out[j] = frac[j] * scale[j];
}

// S[rows, kKeyTile] = Qs[rows, D] . Kt[D, kKeyTile]; rows is a multiple of kRowBlock.
SPECDEC_INLINE void scores_tile(const float* qs, const float* kt, float* s, int rows, int64_t d, int64_t dp) {
  for (int i0 = 0; i0 < rows; i0 += kRowBlock) {
    vfloat acc[kRowBlock][kKeyVecs] = {};
    for (int64_t c = 0; c < d; ++c) {
      vfloat kv[kKeyVecs];
#pragma GCC unroll 4
      for (int u = 0; u < kKeyVecs; ++u) kv[u] = vload(kt + c * kKeyTile + u * kVec);
#pragma GCC unroll 4
      for (int r = 0; r < kRowBlock; ++r) {
        const float qv = qs[(i0 + r) * dp + c];
#pragma GCC unroll 4
        for (int u = 0; u < kKeyVecs; ++u) acc[r][u] += kv[u] * qv;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRowBlock; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kKeyVecs; ++u) vstore(s + (i0 + r) * kKeyTile + u * kVec, acc[r][u]);
  }
}

typedef float vhalf __attribute__((vector_size(kVec / 2 * sizeof(float))));

// Sum of the 16 lanes, as a tree of halves (vector adds, not 15 dependent scalar adds).
SPECDEC_INLINE float hsum(vfloat x) {
  vhalf lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  const vhalf h = lo + hi;
  float t[kVec / 2];
  std::memcpy(t, &h, sizeof(t));
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

// S[i, j] = Qs[i] . K[j] for the nrows real queries and the tile's keys, K read in place (float32
// rows, D == Dp). For a few queries this beats transposing the key tile first: the transpose
// touches every key element once per query tile, here each is read once per query.
SPECDEC_INLINE void scores_rows_direct(const float* qs, const float* k, int64_t k_sn, float* s, int nrows, int keys,
                                       int64_t dp) {
  for (int j = 0; j < keys; ++j) {
    const float* kj = k + j * k_sn;
    for (int i = 0; i < nrows; ++i) {
      vfloat acc = {};
      for (int64_t c = 0; c < dp; c += kVec) acc += vload(qs + i * dp + c) * vload(kj + c);
      s[i * kKeyTile + j] = hsum(acc);
    }
  }
}

// O[rows, c0 : c0 + NV*kVec] += P[rows, keys] . V[keys, c0 : ...]  (V rows vstride floats apart;
// P[i, j] at p[i * p_row + j * p_key]: row-major scores, or the many-query path's transposed ones)
template <int NV>
SPECDEC_INLINE void pv_block(const float* p, int64_t p_row, int64_t p_key, const float* vs, int64_t vstride,
                             float* o, int rows, int keys, int64_t dp, int64_t c0) {
  for (int i0 = 0; i0 < rows; i0 += kRowBlock) {
    vfloat acc[kRowBlock][NV];
#pragma GCC unroll 4
    for (int r = 0; r < kRowBlock; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) acc[r][u] = vload(o + (i0 + r) * dp + c0 + u * kVec);
    for (int j = 0; j < keys; ++j) {
      vfloat vv[NV];
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) vv[u] = vload(vs + j * vstride + c0 + u * kVec);
#pragma GCC unroll 4
      for (int r = 0; r < kRowBlock; ++r) {
        const float pr = p[(i0 + r) * p_row + j * p_key];
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) acc[r][u] += vv[u] * pr;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRowBlock; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) vstore(o + (i0 + r) * dp + c0 + u * kVec, acc[r][u]);
  }
}

SPECDEC_INLINE void pv_tile(const float* p, int64_t p_row, int64_t p_key, const float* vs, int64_t vstride, float* o,
                            int rows, int keys, int64_t dp) {
  for (int64_t c0 = 0; c0 < dp; c0 += 4 * kVec) {
    switch (std::min<int64_t>(4, (dp - c0) / kVec)) {
      case 4: pv_block<4>(p, p_row, p_key, vs, vstride, o, rows, keys, dp, c0); break;
      case 3: pv_block<3>(p, p_row, p_key, vs, vstride, o, rows, keys, dp, c0); break;
      case 2: pv_block<2>(p, p_row, p_key, vs, vstride, o, rows, keys, dp, c0); break;
      default: pv_block<1>(p, p_row, p_key, vs, vstride, o, rows, keys, dp, c0); break;
    }
  }
}

// Positions and validity of one key tile: the smallest and largest position of its valid keys
// (kmin > kmax when none is valid) and whether all its keys are valid.
struct KeyTile {
  int64_t kmin, kmax;
  bool all_valid;
};

SPECDEC_INLINE KeyTile scan_key_tile(const bool* kvalid, const int64_t* kpos, int64_t k0, int keys) {
  KeyTile t{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(), true};
  for (int j = 0; j < keys; ++j) {
    const bool ok = kvalid == nullptr || kvalid[k0 + j];
    t.all_valid &= ok;
    if (ok) {
      t.kmin = std::min(t.kmin, kpos[k0 + j]);
      t.kmax = std::max(t.kmax, kpos[k0 + j]);
    }
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
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    store_row(pb.out, (it.out_row0 + i) * d, pb.dtype, d, o);
    pb.lse[it.out_row0 + i] = l[i] > 0.0f ? (m[i] + std::log2(l[i])) * kLn2 : kNegInf;
  }
}

// One work item of at most kRowBlock queries (the decoders' one-token steps): queries
// [q0, q0 + nrows) of head h in batch b against every visible key tile, scores row-major.
SPECDEC_INLINE void attend_query_tile_body(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  const Item it = item_of(pb, b, h, q0, kQueryTile);
  const auto& [nrows, rows, hk, qpos, kpos, kvalid, tree, block_start, out_row0] = it;
  const int64_t d = pb.d, dp = pb.dp;

  // Queries, pre-scaled so exp2(s - m) is the softmax numerator; padding rows/columns are 0.
  std::fill(sc.qs, sc.qs + rows * dp, 0.0f);
  for (int64_t i = 0; i < nrows; ++i) {
    load_row(pb.q, b * pb.q_sb + h * pb.q_sh + (q0 + i) * pb.q_sn, pb.dtype, d, pb.scale_log2, sc.qs + i * dp);
  }
  std::fill(sc.o, sc.o + rows * dp, 0.0f);
  std::fill(sc.m, sc.m + kQueryTile, kNegInf);
  std::fill(sc.l, sc.l + kQueryTile, 0.0f);
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
  for (int64_t i = 0; i < nrows; ++i) {
    qmin = std::min(qmin, qpos[i]);
    qmax = std::max(qmax, qpos[i]);
  }

  // float32 with D a multiple of the vector width: K and V rows can be read where they lie.
  const bool direct = pb.dtype == at::kFloat && d == dp;
  const bool direct_k = direct;  // this body has at most kRowBlock queries: a dot product per key

  alignas(64) float p_row[kKeyTile];
  for (int64_t k0 = 0; k0 < pb.nk; k0 += kKeyTile) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, pb.nk - k0));
    // Tile skipping from positions and validity: nothing visible -> no work at all.
    const KeyTile tile = scan_key_tile(kvalid, kpos, k0, keys);
    if (tile.kmin > qmax) continue;  // also covers a tile with no valid key
    const bool all_valid = tile.all_valid;
    const bool touches_tree = tree != nullptr && k0 + keys > block_start;
    const bool all_visible = all_valid && tile.kmax <= qmin && !touches_tree && keys == kKeyTile;

    // float32 rows with D == Dp are read in place: K always (direct scores), V when every key
    // of the tile is valid (an invalid slot may hold garbage, even NaN, and 0 * NaN is NaN).
    // Otherwise K is staged transposed to [D, kKeyTile] and V as [kKeyTile, Dp],
    // slots past the tile and invalid slots zero, so garbage in empty cache slots cannot reach the
    // output. (Columns d..dp of V stay zero from the scratch allocation; rows d..dp of Kt are
    // never read.)
    const int64_t kv_row0 = k0;
    const float* k_direct = direct_k ? static_cast<const float*>(pb.k) + b * pb.k_sb + hk * pb.k_sh + kv_row0 * pb.k_sn
                                     : nullptr;
    const float* v_direct = direct && all_valid
                                ? static_cast<const float*>(pb.v) + b * pb.v_sb + hk * pb.v_sh + kv_row0 * pb.v_sn
                                : nullptr;
    if (k_direct == nullptr || v_direct == nullptr) {
      alignas(64) float krow[128];
      for (int j = 0; j < kKeyTile; ++j) {
        const bool load = j < keys && (kvalid == nullptr || kvalid[k0 + j]);
        if (k_direct == nullptr) {
          if (load) {
            load_row(pb.k, b * pb.k_sb + hk * pb.k_sh + (k0 + j) * pb.k_sn, pb.dtype, d, 1.0f, krow);
          } else {
            std::fill(krow, krow + d, 0.0f);
          }
          for (int64_t c = 0; c < d; ++c) sc.kt[c * kKeyTile + j] = krow[c];
        }
        if (v_direct == nullptr) {
          if (load) {
            load_row(pb.v, b * pb.v_sb + hk * pb.v_sh + (k0 + j) * pb.v_sn, pb.dtype, d, 1.0f, sc.vs + j * dp);
          } else {
            std::fill(sc.vs + j * dp, sc.vs + j * dp + d, 0.0f);
          }
        }
      }
    }

    if (k_direct != nullptr) {
      // Invalid keys and slots past the tile get garbage scores here; they are masked below
      // (all_visible needs a full, all-valid tile).
      scores_rows_direct(sc.qs, k_direct, pb.k_sn, sc.s, static_cast<int>(nrows), keys, dp);
    } else {
      scores_tile(sc.qs, sc.kt, sc.s, rows, d, dp);
    }

    for (int64_t i = 0; i < nrows; ++i) {
      float* s = sc.s + i * kKeyTile;
      if (!all_visible) {
        const int32_t* tree_row = tree ? tree + i * pb.words : nullptr;
        for (int j = 0; j < keys; ++j) {
          const bool ok = kvalid == nullptr || kvalid[k0 + j];
          if (!key_visible(ok, kpos[k0 + j], qpos[i], tree_row, k0 + j - block_start)) s[j] = kNegInf;
        }
        for (int j = keys; j < kKeyTile; ++j) s[j] = kNegInf;
      }
      float mx = kNegInf;
      for (int j = 0; j < kKeyTile; ++j) mx = std::max(mx, s[j]);
      const float m_old = sc.m[i];
      const float m_new = std::max(m_old, mx);
      if (m_new == kNegInf) {  // nothing visible to this query yet: p = 0 for the tile
        std::fill(s, s + kKeyTile, 0.0f);
        continue;
      }
      for (int j = 0; j < kKeyTile; ++j) p_row[j] = s[j] - m_new;
      exp2_tile(p_row, p_row);
      float sum = 0.0f;
      for (int j = 0; j < kKeyTile; ++j) {
        const float p = s[j] == kNegInf ? 0.0f : p_row[j];
        s[j] = p;  // S now holds P for the P.V product
        sum += p;
      }
      const float alpha = m_old == kNegInf ? 0.0f : std::exp2(m_old - m_new);
      sc.l[i] = sc.l[i] * alpha + sum;
      sc.m[i] = m_new;
      if (alpha != 1.0f) {
        float* o = sc.o + i * dp;
        for (int64_t c = 0; c < dp; ++c) o[c] *= alpha;
      }
    }
    for (int64_t i = nrows; i < rows; ++i) std::fill(sc.s + i * kKeyTile, sc.s + (i + 1) * kKeyTile, 0.0f);
    if (v_direct != nullptr) {
      pv_tile(sc.s, kKeyTile, 1, v_direct, pb.v_sn, sc.o, rows, keys, dp);
    } else {
      pv_tile(sc.s, kKeyTile, 1, sc.vs, dp, sc.o, rows, keys, dp);
    }
  }

  store_item(pb, it, sc.o, sc.l, sc.m);
}

typedef int32_t vint __attribute__((vector_size(kVec * sizeof(int32_t))));

SPECDEC_INLINE vfloat splat(float x) {
  vfloat r;
  for (int i = 0; i < kVec; ++i) r[i] = x;
  return r;
}

// mask ? a : b per lane (mask lanes all ones or all zeros, as vector comparisons give), written
// with bit operations: GCC and Clang agree on those, not on ?: over vector types.
SPECDEC_INLINE vfloat select(vint mask, vfloat a, vfloat b) {
  vint ai, bi;
  std::memcpy(&ai, &a, sizeof(ai));
  std::memcpy(&bi, &b, sizeof(bi));
  const vint r = (ai & mask) | (bi & ~mask);
  vfloat out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

SPECDEC_INLINE vfloat vmax(vfloat a, vfloat b) { return select(a > b, a, b); }

// exp2_tile's arithmetic on one vector (same clamp, split and polynomial, lane by lane).
SPECDEC_INLINE vfloat exp2_vec(vfloat t) {
  const vfloat x = select(t < splat(-126.0f), splat(-126.0f), t);
  const vfloat n = (x + 12582912.0f) - 12582912.0f;
  const vfloat p = exp_taylor((x - n) * kLn2);
  const vint e = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// One work item of more than kRowBlock queries (verification windows, prefill): NR vectors of
// query rows, one row per lane. Scores are kept transposed, S^T[key][row], so K is read row by row
// where it lies (float32) instead of being transposed for every item, and the visibility rule,
// the online softmax and its rescaling run across the item's rows in vector lanes.
template <int NR>
SPECDEC_INLINE void attend_rows_body(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  constexpr int R = NR * kVec;  // query rows of the item (padding lanes see no key)
  static_assert(R <= kQueryTile, "scratch holds kQueryTile query rows");
  const Item it = item_of(pb, b, h, q0, R);
  const auto& [nrows, rows, hk, qpos, kpos, kvalid, tree, block_start, out_row0] = it;
  const int64_t d = pb.d, dp = pb.dp;

  // Q^T [d, R], pre-scaled so exp2(s - m) is the softmax numerator.
  float* qt = sc.kt;  // dp * kKeyTile >= d * R floats
  std::fill(qt, qt + d * R, 0.0f);
  alignas(64) float qrow[128];
  for (int64_t i = 0; i < nrows; ++i) {
    load_row(pb.q, b * pb.q_sb + h * pb.q_sh + (q0 + i) * pb.q_sn, pb.dtype, d, pb.scale_log2, qrow);
    for (int64_t c = 0; c < d; ++c) qt[c * R + i] = qrow[c];
  }
  // Padding lanes get the lowest position: no key is ever visible to them.
  alignas(64) int64_t qp[R];
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
  for (int i = 0; i < R; ++i) {
    qp[i] = i < nrows ? qpos[i] : std::numeric_limits<int64_t>::min();
    if (i < nrows) {
      qmin = std::min(qmin, qpos[i]);
      qmax = std::max(qmax, qpos[i]);
    }
  }
  std::fill(sc.o, sc.o + R * dp, 0.0f);
  vfloat m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    m[r] = splat(kNegInf);
    l[r] = splat(0.0f);
  }

  const bool f32 = pb.dtype == at::kFloat;
  float* st = sc.s;  // S^T [kKeyTile, R]
  for (int64_t k0 = 0; k0 < pb.nk; k0 += kKeyTile) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyTile, pb.nk - k0));
    const KeyTile tile = scan_key_tile(kvalid, kpos, k0, keys);
    if (tile.kmin > qmax) continue;  // nothing visible (also a tile with no valid key)
    const bool touches_tree = tree != nullptr && k0 + keys > block_start;
    const bool all_visible = tile.all_valid && tile.kmax <= qmin && !touches_tree;

    // K rows: float32 where they lie; 16-bit ones converted. An invalid slot may hold garbage
    // (even NaN): its scores are replaced by -inf below, never multiplied.
    const float* krows;
    int64_t kstride;
    if (f32) {
      krows = static_cast<const float*>(pb.k) + b * pb.k_sb + hk * pb.k_sh + k0 * pb.k_sn;
      kstride = pb.k_sn;
    } else {
      for (int j = 0; j < keys; ++j) load_row(pb.k, b * pb.k_sb + hk * pb.k_sh + (k0 + j) * pb.k_sn, pb.dtype, d, 1.0f,
                                              sc.ks + j * dp);
      krows = sc.ks;
      kstride = dp;
    }
    // V rows: in place when float32, all valid and D == Dp (a full vector per row); otherwise
    // staged with invalid slots zeroed (0 * NaN would be NaN). Columns d..dp stay 0 from the
    // scratch allocation.
    const float* vrows;
    int64_t vstride;
    if (f32 && tile.all_valid && d == dp) {
      vrows = static_cast<const float*>(pb.v) + b * pb.v_sb + hk * pb.v_sh + k0 * pb.v_sn;
      vstride = pb.v_sn;
    } else {
      for (int j = 0; j < keys; ++j) {
        if (kvalid == nullptr || kvalid[k0 + j]) {
          load_row(pb.v, b * pb.v_sb + hk * pb.v_sh + (k0 + j) * pb.v_sn, pb.dtype, d, 1.0f, sc.vs + j * dp);
        } else {
          std::fill(sc.vs + j * dp, sc.vs + j * dp + d, 0.0f);
        }
      }
      vrows = sc.vs;
      vstride = dp;
    }

    // S^T = K . Q^T, four keys at a time (a short last group repeats its last key).
    for (int j0 = 0; j0 < keys; j0 += 4) {
      const float* kr[4];
      for (int u = 0; u < 4; ++u) kr[u] = krows + std::min(j0 + u, keys - 1) * kstride;
      vfloat acc[4][NR] = {};
      for (int64_t c = 0; c < d; ++c) {
        vfloat qv[NR];
#pragma GCC unroll 2
        for (int r = 0; r < NR; ++r) qv[r] = vload(qt + c * R + r * kVec);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const float kc = kr[u][c];
#pragma GCC unroll 2
          for (int r = 0; r < NR; ++r) acc[u][r] += qv[r] * kc;
        }
      }
      for (int u = 0; u < 4 && j0 + u < keys; ++u)
        for (int r = 0; r < NR; ++r) vstore(st + (j0 + u) * R + r * kVec, acc[u][r]);
    }

    // The visibility rule (attention_math.h key_visible), one key across all rows at a time.
    if (!all_visible) {
      for (int j = 0; j < keys; ++j) {
        float* sj = st + j * R;
        if (kvalid != nullptr && !kvalid[k0 + j]) {
          std::fill(sj, sj + R, kNegInf);
          continue;
        }
        const int64_t kp = kpos[k0 + j];
        for (int i = 0; i < R; ++i) sj[i] = kp <= qp[i] ? sj[i] : kNegInf;
        const int64_t col = k0 + j - block_start;
        if (tree != nullptr && col >= 0) {
          for (int64_t i = 0; i < nrows; ++i)
            if (!tree_bit(tree + i * pb.words, col)) sj[i] = kNegInf;
        }
      }
    }

    // Online softmax across the rows' lanes.
    vfloat alpha[NR], shift[NR], sum[NR];
    for (int r = 0; r < NR; ++r) {
      vfloat mx = splat(kNegInf);
      for (int j = 0; j < keys; ++j) {
        const vfloat x = vload(st + j * R + r * kVec);
        mx = vmax(x, mx);
      }
      const vfloat m_new = vmax(mx, m[r]);
      // A lane that has seen nothing yet keeps m = -inf: shift by 0 (its scores are all -inf).
      shift[r] = select(m_new == splat(kNegInf), splat(0.0f), m_new);
      alpha[r] = select(m[r] == splat(kNegInf), splat(0.0f), exp2_vec(m[r] - m_new));
      m[r] = m_new;
      sum[r] = splat(0.0f);
    }
    for (int j = 0; j < keys; ++j) {
#pragma GCC unroll 2
      for (int r = 0; r < NR; ++r) {
        const vfloat x = vload(st + j * R + r * kVec);
        const vfloat p = select(x == splat(kNegInf), splat(0.0f), exp2_vec(x - shift[r]));
        vstore(st + j * R + r * kVec, p);  // S^T now holds P^T for the P.V product
        sum[r] += p;
      }
    }
    alignas(64) float scale_rows[R];
    for (int r = 0; r < NR; ++r) {
      l[r] = l[r] * alpha[r] + sum[r];
      vstore(scale_rows + r * kVec, alpha[r]);
    }
    for (int i = 0; i < rows; ++i) {
      if (scale_rows[i] == 1.0f) continue;
      float* o = sc.o + i * dp;
      for (int64_t c = 0; c < dp; ++c) o[c] *= scale_rows[i];
    }
    pv_tile(st, 1, R, vrows, vstride, sc.o, rows, keys, dp);
  }

  alignas(64) float lv[R], mv[R];
  for (int r = 0; r < NR; ++r) {
    vstore(lv + r * kVec, l[r]);
    vstore(mv + r * kVec, m[r]);
  }
  store_item(pb, it, sc.o, lv, mv);
}

// Picks the body for an item by its number of queries.
SPECDEC_INLINE void attend_item_body(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  const int64_t nrows = std::min<int64_t>(kQueryTile, pb.nq - q0);
  if (nrows <= kRowBlock) {
    attend_query_tile_body(pb, b, h, q0, sc);
  } else if (nrows <= kVec) {
    attend_rows_body<1>(pb, b, h, q0, sc);
  } else {
    attend_rows_body<2>(pb, b, h, q0, sc);
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, int64_t, Scratch&);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Same code compiled three times; the widest instruction set the CPU has is picked at run time
// (features, not CPU models, so new CPUs get the AVX-512 path).
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi2")))
void attend_avx512(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  attend_item_body(pb, b, h, q0, sc);
}
__attribute__((target("avx2,fma,bmi2")))
void attend_avx2(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  attend_item_body(pb, b, h, q0, sc);
}
#endif
void attend_generic(const Problem& pb, int64_t b, int64_t h, int64_t q0, Scratch& sc) {
  attend_item_body(pb, b, h, q0, sc);
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

  const int64_t q_tiles = (nq + kQueryTile - 1) / kQueryTile;
  const int64_t items = b * hq * q_tiles;
  static const AttendFn attend_query_tile = pick_attend();
  at::parallel_for(0, items, grain_for(int64_t{kQueryTile} * nk * d), [&](int64_t begin, int64_t end) {
    Scratch scratch(pb.dp);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t t = it % q_tiles;
      const int64_t bh = it / q_tiles;
      attend_query_tile(pb, bh / hq, bh % hq, t * kQueryTile, scratch);
    }
  });
  return {setup.out, setup.lse};
}

}  // namespace specdec
