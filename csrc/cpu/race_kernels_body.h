// The CPU row kernels of race_sample and race_noise, written once on W-lane vectors (GCC/Clang
// vector extensions). Included only by race_kernels.cpp, once per instruction set, which defines
// SPECDEC_RACE_CAP (the namespace of this build) and SPECDEC_RACE_W (float lanes) and switches the
// instruction set on around this file. Nothing is included here (see pool_kernels.h for why).
//
// Exactness: every lane runs race_math.h's templates, the same IEEE float32 operations in the same
// order as the reference and the CUDA kernels (no FMA: the build's -ffp-contract=off; vector
// division is correctly rounded), so each E and each key E / p is the reference's bit for bit,
// and the argmin (first index of the smallest key) is exact.
//
// One row of race_sample: one read of p, W entries at a time: E from the hash, key = E / p
// (+inf where p < 2^-126), and per lane the smallest key and its first index (each lane sees
// increasing indices, so a strict < keeps the first of equal keys); the lanes are then reduced to
// (smallest key, smallest index holding it). A row without a finite key (rare: p all zero)
// makes a second pass over E alone. The value checks (race_math.h, kBadP) ride in the first pass.

namespace specdec {
namespace cpu {
namespace SPECDEC_RACE_CAP {
namespace {

constexpr int W = SPECDEC_RACE_W;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));

#define RACE_INLINE inline __attribute__((always_inline))

constexpr float kInf = __builtin_inff();
constexpr int32_t kNoIndex = 0x7FFFFFFF;

using Lanes = VectorLanes<W>;  // race_kernels.cpp: defined at the baseline, see there
static_assert(sizeof(Lanes::F) == sizeof(vf), "the lanes are this build's vectors");

RACE_INLINE vi select_i(vi m, vi a, vi b) { return (m & a) | (~m & b); }

RACE_INLINE vi lane_iota() {
  vi r;
  for (int j = 0; j < W; ++j) r[j] = j;
  return r;
}

// The first `n` (<= W) floats at p, zeros after them.
RACE_INLINE vf load_part(const float* p, int64_t n) {
  vf r = vf{};
  __builtin_memcpy(&r, p, static_cast<size_t>(n) * sizeof(float));
  return r;
}

uint64_t key_of(const RaceRows& a, int64_t r) {
  const int64_t purpose = a.purposes != nullptr ? a.purposes[r] : a.purpose;
  return race::row_key(a.seed, a.images[r], a.positions[r], purpose);
}

// Per-lane running minimum of `value` and the first index holding it.
struct LaneMin {
  vf value = vf{} + kInf;
  vi at = vi{} + kNoIndex;
  RACE_INLINE void update(vf x, vi index) {
    const vi better = x < value;
    value = Lanes::select(better, x, value);
    at = select_i(better, index, at);
  }
  // (smallest value, smallest index holding it) over the lanes.
  RACE_INLINE void reduce(float* best, int32_t* best_at) const {
    *best = value[0];
    *best_at = at[0];
    for (int j = 1; j < W; ++j) {
      if (value[j] < *best || (value[j] == *best && at[j] < *best_at)) {
        *best = value[j];
        *best_at = at[j];
      }
    }
  }
};

RACE_INLINE vf race_key(vf p, vf e) {
  const vi takes_part = p >= race::kPMin;
  const vf safe = Lanes::select(takes_part, p, vf{} + 1.0f);
  return Lanes::select(takes_part, e / safe, vf{} + kInf);
}

// The token of a row without a finite key: the first index of the smallest E.
int32_t uniform_token(uint64_t key, int64_t v) {
  LaneMin least;
  const vi iota = lane_iota();
  for (int64_t x = 0; x < v; x += W) {
    const vi index = iota + static_cast<int32_t>(x);
    const vf e = race::noise<Lanes>((vu)index, key);
    least.update(Lanes::select(index < static_cast<int32_t>(v), e, vf{} + kInf), index);
  }
  float smallest;
  int32_t token;
  least.reduce(&smallest, &token);
  return token;
}

template <bool kCheck>
void sample_rows_impl(const RaceRows& a, int64_t begin, int64_t end) {
  const int64_t v = a.v;
  const vi iota = lane_iota();
  for (int64_t r = begin; r < end; ++r) {
    const float* p = a.p + r * v;
    const uint64_t key = key_of(a, r);
    LaneMin best;
    vi bad = vi{};
    for (int64_t x = 0; x < v; x += W) {
      // The last step reads only the row's own entries; its padding lanes have p = 0 (never win).
      const vf pv = x + W <= v ? load_part(p + x, W) : load_part(p + x, v - x);
      const vi index = iota + static_cast<int32_t>(x);
      best.update(race_key(pv, race::noise<Lanes>((vu)index, key)), index);
      if (kCheck) bad |= ~((pv >= 0.0f) & (pv <= 1.0f));
    }
    float smallest;
    int32_t token;
    best.reduce(&smallest, &token);
    a.tokens[r] = smallest < kInf ? token : uniform_token(key, v);
    if (kCheck) {
      int32_t any = 0;
      for (int j = 0; j < W; ++j) any |= bad[j];
      a.errors[r] = any != 0 ? race::kBadP : 0;
    }
  }
}

void sample_rows(const RaceRows& a, int64_t begin, int64_t end) {
  if (a.errors != nullptr) {
    sample_rows_impl<true>(a, begin, end);
  } else {
    sample_rows_impl<false>(a, begin, end);
  }
}

void noise_rows(const RaceRows& a, int64_t begin, int64_t end) {
  const int64_t v = a.v;
  const vi iota = lane_iota();
  for (int64_t r = begin; r < end; ++r) {
    float* out = a.noise + r * v;
    const uint64_t key = key_of(a, r);
    for (int64_t x = 0; x < v; x += W) {
      const vf e = race::noise<Lanes>((vu)(iota + static_cast<int32_t>(x)), key);
      const int64_t n = x + W <= v ? W : v - x;
      __builtin_memcpy(out + x, &e, static_cast<size_t>(n) * sizeof(float));
    }
  }
}

#undef RACE_INLINE

}  // namespace

const RaceKernels* race_table() {
  static const RaceKernels table{SPECDEC_RACE_NAME, &sample_rows, &noise_rows};
  return &table;
}

}  // namespace SPECDEC_RACE_CAP
}  // namespace cpu
}  // namespace specdec
