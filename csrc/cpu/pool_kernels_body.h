// The CPU row kernels of pool_probs, sampling_probs (docs/design.md, kernel 1) and sample_residual
// (kernel 2), written once on W-lane vectors. Included only by pool_kernels_{avx512,avx2,default}.cpp,
// which define SPECDEC_CAP (the namespace of this build), SPECDEC_CAP_NAME, SPECDEC_W (float lanes) and
// SPECDEC_X86_AVX512 / SPECDEC_X86_AVX2, after pool_kernels_prelude.h and the target pragma. No
// header is included here and no template of another library is instantiated (see pool_kernels.h).
//
// Exactness (the contract's "how correctness is shown"): the guided logits, the ordered keys, the
// top-k threshold, the top-p fixed-point weights and the residual units are computed with the
// same IEEE float32 operations in the same order as the scalar definitions in
// specdec/pool_math.h and specdec/verify_math.h (no FMA: the build's -ffp-contract=off), so every
// lane equals the scalar value bit for bit and every discrete decision (kept set, token id) is
// the reference's. Only exp() differs from the reference's libm/Sleef exp by an ulp or two
// (probabilities "to float32 rounding"); it uses FMA where the instruction set has it, so its
// last bit may also differ between the builds.
//
// One row of pool_probs or sampling_probs:
//  1. stream: one read of the cond (and uncond) row, guided logits formed in registers, NaN/+inf
//     found, per-lane maxima, and (without top-k/top-p) per-lane online sums of exp(l - max);
//     the logits are kept in a per-thread buffer only when a later pass needs them;
//  2. top-k (0 < k < V): radix select of the k-th largest ordered key, digits of 11, 11 and 10
//     bits: either one vector pass keeps the entries at or above a pivot from a strided sample
//     (long rows, k <= V / 8) and all digits run on those candidates, or the first digit's
//     2048-bin histogram is taken over the row and one compaction pass writes the entries of
//     higher buckets to the kept list and those of the k-th's bucket to the candidates;
//  3. top-p (< 1): the same radix walk over the kept entries with int64 sums of the fixed-point
//     weights in the bins, narrowing to the bucket where the weight strictly above crosses
//     top_p * total (pool_math.h's rule), then a compaction of the entries at or above the cut;
//  4. the softmax sum over the kept list (or from step 1), log_sum = log(sum), row_lse = max + log_sum,
//     and the outputs, with p = exp((l - max) - log_sum): the token's and its neighbours'
//     probabilities (pool_probs) or the probability row (sampling_probs).

namespace specdec {
namespace cpu {
namespace SPECDEC_CAP {
namespace {

constexpr int W = SPECDEC_W;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef int64_t vl __attribute__((vector_size(W * sizeof(int64_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));

#define SD_INLINE inline __attribute__((always_inline))

constexpr float kInf = __builtin_inff();
constexpr float kNegInf = -__builtin_inff();
constexpr float kNaN = __builtin_nanf("");

// ---- vector helpers -----------------------------------------------------------------------------

template <class T, class U>
SD_INLINE T bits_as(U x) {
  static_assert(sizeof(T) == sizeof(U), "bit cast between equal sizes");
  T r;
  __builtin_memcpy(&r, &x, sizeof(r));
  return r;
}
template <class T, class E>
SD_INLINE T load_as(const E* p) {
  T r;
  __builtin_memcpy(&r, p, sizeof(r));
  return r;
}
template <class T, class E>
SD_INLINE void store_as(E* p, T x) {
  __builtin_memcpy(p, &x, sizeof(x));
}
SD_INLINE vf splat(float x) { return vf{} + x; }
SD_INLINE vi iota() {
  vi r;
  for (int j = 0; j < W; ++j) r[j] = j;
  return r;
}
// mask ? a : b per lane (mask lanes all ones or all zeros). GCC keeps vector compares in mask
// registers and blends with them; the bit-operation form is for compilers without ?: on vectors.
#if defined(__GNUC__) && !defined(__clang__)
SD_INLINE vf select_v(vi mask, vf a, vf b) { return mask ? a : b; }
SD_INLINE vi select_i(vi mask, vi a, vi b) { return mask ? a : b; }
#else
SD_INLINE vf select_v(vi mask, vf a, vf b) {
  return bits_as<vf>((bits_as<vi>(a) & mask) | (bits_as<vi>(b) & ~mask));
}
SD_INLINE vi select_i(vi mask, vi a, vi b) { return (a & mask) | (b & ~mask); }
#endif
// The scalar code's a > b ? a : b and a < b ? a : b, lane by lane (b when a lane is NaN): exactly
// x86's maxps/minps. fmadd: one rounding where the instruction set has FMA, two elsewhere (used
// only inside exp, whose last bit the contract leaves free). any_ne: some lane differs.
#if defined(SPECDEC_X86_AVX512)
SD_INLINE vf max_v(vf a, vf b) { return reinterpret_cast<vf>(_mm512_max_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b))); }
SD_INLINE vf min_v(vf a, vf b) { return reinterpret_cast<vf>(_mm512_min_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b))); }
SD_INLINE vf fmadd(vf a, vf b, vf c) {
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
}
SD_INLINE bool any_ne(vf a, vf b) {
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), _CMP_NEQ_UQ) != 0;
}
#elif defined(SPECDEC_X86_AVX2)
SD_INLINE vf max_v(vf a, vf b) { return reinterpret_cast<vf>(_mm256_max_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b))); }
SD_INLINE vf min_v(vf a, vf b) { return reinterpret_cast<vf>(_mm256_min_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b))); }
SD_INLINE vf fmadd(vf a, vf b, vf c) {
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
}
SD_INLINE bool any_ne(vf a, vf b) {
  return _mm256_movemask_ps(_mm256_cmp_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), _CMP_NEQ_UQ)) != 0;
}
#elif defined(__SSE2__)
SD_INLINE vf max_v(vf a, vf b) { return reinterpret_cast<vf>(_mm_max_ps(reinterpret_cast<__m128>(a), reinterpret_cast<__m128>(b))); }
SD_INLINE vf min_v(vf a, vf b) { return reinterpret_cast<vf>(_mm_min_ps(reinterpret_cast<__m128>(a), reinterpret_cast<__m128>(b))); }
SD_INLINE vf fmadd(vf a, vf b, vf c) { return a * b + c; }
SD_INLINE bool any_ne(vf a, vf b) {
  return _mm_movemask_ps(_mm_cmpneq_ps(reinterpret_cast<__m128>(a), reinterpret_cast<__m128>(b))) != 0;
}
#else
SD_INLINE vf max_v(vf a, vf b) { return select_v(a > b, a, b); }
SD_INLINE vf min_v(vf a, vf b) { return select_v(a < b, a, b); }
SD_INLINE vf fmadd(vf a, vf b, vf c) { return a * b + c; }
SD_INLINE bool any_ne(vf a, vf b) {
  for (int j = 0; j < W; ++j)
    if (!(a[j] == b[j])) return true;
  return false;
}
#endif
SD_INLINE int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// Bit j = lane j of a mask vector.
SD_INLINE uint32_t mask_bits(vi m) {
#if defined(SPECDEC_X86_AVX512)
  return _mm512_movepi32_mask(reinterpret_cast<__m512i>(m));
#elif defined(SPECDEC_X86_AVX2)
  return static_cast<uint32_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(m)));
#elif defined(__SSE2__)
  return static_cast<uint32_t>(_mm_movemask_ps(reinterpret_cast<__m128>(m)));
#else
  uint32_t r = 0;
  for (int j = 0; j < W; ++j) r |= static_cast<uint32_t>(m[j] != 0) << j;
  return r;
#endif
}
SD_INLINE bool any(vi m) { return mask_bits(m) != 0; }

SD_INLINE int popcount(uint32_t bits) { return __builtin_popcount(bits); }

// Writes the lanes selected by `bits` to dst[0, popcount) in lane order and returns the count.
// May write up to W elements: destinations have a vector of slack.
#if !defined(SPECDEC_X86_AVX512)
template <typename T, typename V>
SD_INLINE int compress_lanes(T* dst, V x, uint32_t bits) {
  int n = 0;
  for (int j = 0; j < W; ++j) {
    dst[n] = x[j];
    n += (bits >> j) & 1;
  }
  return n;
}
#endif
SD_INLINE int compress(float* dst, vf x, uint32_t bits) {
#if defined(SPECDEC_X86_AVX512)
  _mm512_storeu_ps(dst, _mm512_maskz_compress_ps(static_cast<__mmask16>(bits), reinterpret_cast<__m512>(x)));
  return popcount(bits);
#else
  return compress_lanes(dst, x, bits);
#endif
}
SD_INLINE int compress(int32_t* dst, vi x, uint32_t bits) {
#if defined(SPECDEC_X86_AVX512)
  _mm512_storeu_si512(dst, _mm512_maskz_compress_epi32(static_cast<__mmask16>(bits), reinterpret_cast<__m512i>(x)));
  return popcount(bits);
#else
  return compress_lanes(dst, x, bits);
#endif
}
SD_INLINE int compress(uint32_t* dst, vu x, uint32_t bits) {
  return compress(reinterpret_cast<int32_t*>(dst), bits_as<vi>(x), bits);
}

SD_INLINE float hmax(vf x) {
  float m = x[0];
  for (int j = 1; j < W; ++j) m = x[j] > m ? x[j] : m;
  return m;
}
SD_INLINE float hsum(vf x) {
  float s = 0.0f;
  for (int j = 0; j < W; ++j) s += x[j];
  return s;
}
SD_INLINE int64_t hsum(vl x) {
  int64_t s = 0;
  for (int j = 0; j < W; ++j) s += x[j];
  return s;
}

// e^x on every lane: x = q ln2 + s with q = round(x log2 e) (the 1.5 * 2^23 trick) and ln2 in two
// parts (Cody-Waite), e^s by SLEEF's expf polynomial (|s| <= ln2 / 2, about 1 ulp); x is clamped
// to [-104, 88] (NaN to -104; every caller's argument is <= 0: l - max, (l - max) - log_sum). Fused multiply-adds where the instruction set has them: exp is not
// one of the contract's exactly rounded steps (probabilities agree "to float32 rounding"), and no
// decision (kept set, token) depends on it. Returns e^s in [0.7, 1.42] and q; the callers put 2^q
// in the exponent bits, so no floating-point operation here makes a subnormal number (which costs
// a microcode assist per instruction on x86).
SD_INLINE vf exp_mantissa(vf x, vi* q_out) {
  x = max_v(x, splat(-104.0f));
  x = min_v(x, splat(88.0f));
  const vf q = fmadd(x, splat(1.44269504088896341f), splat(12582912.0f)) - 12582912.0f;
  vf s = fmadd(q, splat(-0.693145751953125f), x);
  s = fmadd(q, splat(-1.428606765330187045e-06f), s);
  vf u = fmadd(s, splat(0.000198527617612853646278381f), splat(0.00139304355252534151077271f));
  u = fmadd(u, s, splat(0.00833336077630519866943359f));
  u = fmadd(u, s, splat(0.0416664853692054748535156f));
  u = fmadd(u, s, splat(0.166666671633720397949219f));
  u = fmadd(u, s, splat(0.5f));
  u = fmadd(s * s, u, s);
  *q_out = __builtin_convertvector(q, vi);
  return u + 1.0f;
}

// e^x for sums: results below 2^-125 are flushed to 0 (every sum here holds a term 1, the maximum's,
// so a term below 2^-125 never changes it).
SD_INLINE vf exp_sum(vf x) {
  vi q;
  const vf u = exp_mantissa(x, &q);
  return select_v(q > -126, bits_as<vf>(bits_as<vi>(u) + (q << 23)), splat(0.0f));
}

// e^x for probabilities that are written out: u * 2^q rounded once, subnormal results included
// (by integer rounding to nearest even of u's 24-bit significand), as libm's expf and the
// reference give them: a probability of 1e-40 is > 0 here exactly where the reference's is.
SD_INLINE vf exp_v(vf x) {
  vi q;
  const vf u = exp_mantissa(x, &q);
  const vi ub = bits_as<vi>(u);
  vi r = ub + (q << 23);  // normal results: exact
  const vi sub = q <= -126;
  if (any(sub)) {
    // u * 2^q = M * 2^(e - 150 + q) with M the 24-bit significand, e the biased exponent; in units
    // of 2^-149 that is M >> (1 - e - q), rounded to nearest even (a carry into bit 23 gives the
    // smallest normal number, as it should).
    const vi e = (ub >> 23) & 0xff;
    const vi m = (ub & 0x7fffff) | 0x800000;
    vi sh = 1 - e - q;  // >= 0 where q <= -126
    sh = select_i(sh < 31, sh, vi{} + 31);
    sh = select_i(sh > 0, sh, vi{});
    const vi half = ((vi{} + 1) << sh) >> 1;
    const vi bias = select_i(sh > 0, half - 1 + ((m >> sh) & 1), vi{});
    r = select_i(sub, (m + bias) >> sh, r);
  }
  return bits_as<vf>(r);
}

// ---- logits ---------------------------------------------------------------------------------------

SD_INLINE vf load_logits(const float* p) { return load_as<vf>(p); }
SD_INLINE vf load_logits(const c10::BFloat16* p) {
  const vi x = __builtin_convertvector(load_as<vh>(p), vi);
  return bits_as<vf>(x << 16);  // bf16 is the top half of a float32
}
SD_INLINE vf load_logits(const c10::Half* p) {
#if defined(SPECDEC_X86_AVX512)
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(SPECDEC_X86_AVX2)
  return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  // Exact fp16 -> fp32 with integer operations: exponent and mantissa shifted into place and
  // rebiased by 2^112 (normals and subnormals), Inf/NaN given the all-ones exponent, then the sign.
  const vi x = __builtin_convertvector(load_as<vh>(p), vi);
  const vi em = x & 0x7fff;
  const vi sh = em << 13;
  const vi fin = bits_as<vi>(bits_as<vf>(sh) * 0x1p112f);
  const vi inf_nan = em >= 0x7c00;
  const vi r = (inf_nan & (sh | 0x7f800000)) | (~inf_nan & fin);
  return bits_as<vf>(r | ((x & 0x8000) << 16));
#endif
}
SD_INLINE float logit_s(const float* p) { return *p; }
SD_INLINE float logit_s(const c10::Half* p) { return static_cast<float>(*p); }
SD_INLINE float logit_s(const c10::BFloat16* p) { return static_cast<float>(*p); }

// Step 1 of kernel 1 on W lanes: pool_math.h guided_logit (the same operations in the same order).
SD_INLINE vf guide_v(vf c, vf u, float cfg) {
  const vi masked = (c == kNegInf) | (u == kNegInf);
  return select_v(masked, splat(kNegInf), u + (c - u) * cfg);
}

// Ordered unsigned key: ordered_key(l) (pool_math.h) ^ 0x80000000, so that unsigned order is
// float order (-0.0 merged into +0.0 first).
SD_INLINE vu okey_v(vf x) {
  const vi b = bits_as<vi>(x + 0.0f);
  return bits_as<vu>(b ^ ((b >> 31) | static_cast<int32_t>(0x80000000u)));
}
SD_INLINE uint32_t okey_s(float x) { return static_cast<uint32_t>(ordered_key(x)) ^ 0x80000000u; }
SD_INLINE int32_t signed_key(uint32_t u) { return static_cast<int32_t>(u ^ 0x80000000u); }

// pool_math.h top_p_weight on W lanes, as int32 (every weight is below 2^31): the same float
// operations, then the shift by -n in [0, 32] (by 31 at most: the weight is below 2^31, so both
// shift it to 0).
SD_INLINE vi top_p_weight_v(vf l, float row_max) {
  vf t = (l - row_max) * kTopPLog2e;
  const vi live = t >= -32.0f;
  t = select_v(live, t, splat(0.0f));
  const vi n = __builtin_convertvector(t - 0.5f, vi);  // truncation toward zero
  const vf f = t - __builtin_convertvector(n, vf);
  const vf p = top_p_exp2(f);
  const vi scaled = __builtin_convertvector(p * kTopPScale, vi);
  vi shift = -n;
  shift = select_i(shift < 31, shift, vi{} + 31);
  return select_i(live, scaled >> shift, vi{});
}

// ---- step 1: the streaming pass -------------------------------------------------------------------

struct Stream {
  float max;
  float sum;  // of exp(l - max), when summed
  bool bad;   // a NaN or +inf guided logit
};

struct StreamAcc {
  vf mx, sum;
  vi bad;
};

template <bool kSum>
SD_INLINE void accumulate(StreamAcc& a, vf x) {
  a.bad |= ~(x < kInf);  // NaN and +inf
  if (kSum) {
    // Online softmax per lane; the rescale runs only when a lane's maximum grows.
    const vf m = max_v(a.mx, x);
    if (any_ne(m, a.mx)) {
      a.sum = a.sum * exp_sum(a.mx - m);  // -inf - m: 0; -inf - -inf = NaN: 0 (exp_sum), on sum 0
      a.mx = m;
    }
    a.sum = a.sum + exp_sum(x - a.mx);
  } else {
    a.mx = max_v(a.mx, x);
  }
}

// Guided logits of one row: per-lane statistics, and the logits themselves in l (kStore; padded
// with -inf to a whole vector). kCfg: uncond given; kDiv: temperature != 1 (x / 1 == x for every
// float, so that division is skipped).
template <class T, bool kStore, bool kSum, bool kCfg, bool kDiv>
Stream stream_row(const T* c, const T* u, int64_t v, float cfg, float temperature, float* l) {
  StreamAcc a{splat(kNegInf), splat(0.0f), vi{}};
  int64_t i = 0;
  for (; i + W <= v; i += W) {
    vf x = load_logits(c + i);
    if (kCfg) x = guide_v(x, load_logits(u + i), cfg);
    if (kDiv) x = x / temperature;
    if (kStore) store_as(l + i, x);
    accumulate<kSum>(a, x);
  }
  if (i < v) {  // the last partial vector, padded with -inf (masked in either CFG half)
    alignas(64) float cx[W], ux[W];
    for (int j = 0; j < W; ++j) {
      cx[j] = i + j < v ? logit_s(c + i + j) : kNegInf;
      ux[j] = (kCfg && i + j < v) ? logit_s(u + i + j) : kNegInf;
    }
    vf x = load_as<vf>(cx);
    if (kCfg) x = guide_v(x, load_as<vf>(ux), cfg);
    if (kDiv) x = x / temperature;
    if (kStore) store_as(l + i, x);
    accumulate<kSum>(a, x);
    i += W;
  }
  if (kStore) store_as(l + i, splat(kNegInf));  // one vector of -inf slack after the padding
  Stream st{hmax(a.mx), 0.0f, any(a.bad)};
  if (kSum) st.sum = hsum(a.sum * exp_sum(a.mx - st.max));
  return st;
}

template <class T, bool kStore, bool kSum>
Stream stream_any(const T* c, const T* u, int64_t v, float cfg, float temperature, float* l) {
  if (u != nullptr) {
    return temperature != 1.0f ? stream_row<T, kStore, kSum, true, true>(c, u, v, cfg, temperature, l)
                               : stream_row<T, kStore, kSum, true, false>(c, u, v, cfg, temperature, l);
  }
  return temperature != 1.0f ? stream_row<T, kStore, kSum, false, true>(c, u, v, cfg, temperature, l)
                             : stream_row<T, kStore, kSum, false, false>(c, u, v, cfg, temperature, l);
}

// W float32 values table[ids] (ids valid).
SD_INLINE vf gather(const float* table, vi ids) {
#if defined(SPECDEC_X86_AVX512)
  return reinterpret_cast<vf>(_mm512_i32gather_ps(reinterpret_cast<__m512i>(ids), table, 4));
#elif defined(SPECDEC_X86_AVX2)
  return reinterpret_cast<vf>(_mm256_i32gather_ps(table, reinterpret_cast<__m256i>(ids), 4));
#else
  vf r;
  for (int j = 0; j < W; ++j) r[j] = table[ids[j]];
  return r;
#endif
}

// ---- step 2: top-k by radix select -----------------------------------------------------------------

// Digits of the ordered key, most significant first: 11, 11 and 10 bits.
constexpr int kDigitShift[3] = {21, 10, 0};
constexpr uint32_t kDigitMask[3] = {0x7ff, 0x7ff, 0x3ff};

// Radix select on a candidate list: ck / ci hold the ordered keys and ids of the nc entries that
// may still be the k-th largest (the need-th largest among them), all of whose keys agree with
// the candidates' bucket in the digits before `level`. Entries of higher buckets go to the kept
// list (kv, ki, *nk; their logits from l), the rest narrow down digit by digit. Returns the
// threshold key; every candidate left is kept (ties at the threshold).
uint32_t radix_on_list(int level, uint32_t* ck, int32_t* ci, int64_t nc, int64_t need, const float* l, float* kv,
                       int32_t* ki, int64_t* nk_io, int64_t* hist) {
  int64_t nk = *nk_io;
  for (; level < 3 && nc > need; ++level) {
    const int shift = kDigitShift[level];
    const uint32_t mask = kDigitMask[level];
    __builtin_memset(hist, 0, sizeof(int64_t) * (mask + 1));
    uint32_t dmax = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const uint32_t d = (ck[c] >> shift) & mask;
      ++hist[d];
      dmax = d > dmax ? d : dmax;
    }
    uint32_t bb = dmax;
    while (hist[bb] < need) need -= hist[bb--];
    // Vector filter (no branch per candidate): higher digits to the kept list, the bucket's own
    // stay, in place (writes land at or before what was read).
    int64_t m = 0;
    const vu bv = vu{} + bb;
    const vi lanes = iota();
    for (int64_t c = 0; c < nc; c += W) {
      const vu key = load_as<vu>(ck + c);
      const vi id = load_as<vi>(ci + c);
      const vi valid = (lanes + static_cast<int32_t>(c)) < static_cast<int32_t>(nc);
      const vi safe = select_i(valid, id, vi{});
      const vu d = (key >> shift) & mask;
      const uint32_t gt = mask_bits((d > bv) & valid);
      const uint32_t eq = mask_bits((d == bv) & valid);
      if (gt != 0) {
        compress(kv + nk, gather(l, safe), gt);
        nk += compress(ki + nk, safe, gt);
      }
      compress(ck + m, key, eq);
      m += compress(ci + m, id, eq);
    }
    nc = m;
  }
  // Either every candidate is kept (nc == need) or all share one key (all 32 bits decided): the
  // threshold is their smallest key, and they are all kept (ties at the threshold).
  uint32_t thr = 0xffffffffu;
  for (int64_t c = 0; c < nc; ++c) {
    thr = ck[c] < thr ? ck[c] : thr;
    kv[nk] = l[ci[c]];
    ki[nk++] = ci[c];
  }
  *nk_io = nk;
  return thr;
}

// The r-th largest (1 <= r <= n) of n keys, by the same radix walk with 8-bit digits; keys is
// overwritten. For the pivot sample only (a few hundred keys).
uint32_t kth_largest_key(uint32_t* keys, int64_t n, int64_t r, int64_t* hist) {
  uint32_t prefix = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    __builtin_memset(hist, 0, sizeof(int64_t) * 256);
    for (int64_t c = 0; c < n; ++c) ++hist[(keys[c] >> shift) & 0xff];
    uint32_t b = 255;
    while (hist[b] < r) r -= hist[b--];
    int64_t m = 0;
    for (int64_t c = 0; c < n; ++c)
      if (((keys[c] >> shift) & 0xff) == b) keys[m++] = keys[c];
    n = m;
    prefix |= b << shift;
  }
  return prefix;
}

// Pivot for long rows with a small k: kPivotSample keys at a fixed stride, and the key of rank
// about 1.25 * k * kPivotSample / v + 8 among them, so that (unless the row's order is adversarial
// to the stride) clearly more than k entries of the row are at or above it, and few beyond.
constexpr int64_t kPivotSample = 512;
constexpr int64_t kPivotMinRow = 4096;

// The ordered key of the k-th largest of l[0, v) (0 < k < v; l padded with -inf) whose maximum has
// key umax. Writes every entry with a key >= it (ties at the threshold included) to
// kept_val / kept_idx and returns the key; *kept_n is their count.
//
// Digits of 11, 11 and 10 bits. The first is histogrammed over the row, unless a pivot key g from
// a strided sample leaves at least k entries at or above it: then one vector pass copies those
// entries (a few times k) to the candidate list and only they are histogrammed. Either way the
// threshold is the exact k-th largest key: the pivot only chooses which entries are counted, and
// a pivot with fewer than k entries above it is dropped.
uint32_t select_top_k(const float* l, int64_t v, int64_t k, uint32_t umax, const RowScratch& s, int64_t* kept_n) {
  int64_t* hist = s.hist;
  float* kv = s.kept_val;
  int32_t* ki = s.kept_idx;
  uint32_t* ck = s.cand_key;
  int32_t* ci = s.cand_aux;
  const vi lanes = iota();
  int64_t nk = 0, nc = 0;
  if (v >= kPivotMinRow && k * 8 <= v) {
    uint32_t* sample = reinterpret_cast<uint32_t*>(s.weights);
    const int64_t stride = v / kPivotSample;
    for (int64_t j = 0; j < kPivotSample; ++j) sample[j] = okey_s(l[j * stride]);
    const int64_t rank = imin(kPivotSample, (k * kPivotSample * 5) / (4 * v) + 8);
    const vu g = vu{} + kth_largest_key(sample, kPivotSample, rank, hist);
    for (int64_t i = 0; i < v; i += W) {
      const vu key = okey_v(load_as<vf>(l + i));
      const vi idx = lanes + static_cast<int32_t>(i);
      const uint32_t sel = mask_bits((key >= g) & (idx < static_cast<int32_t>(v)));
      if (sel != 0) {
        compress(ck + nc, key, sel);
        nc += compress(ci + nc, idx, sel);
      }
    }
    if (nc >= k) {
      const uint32_t thr = radix_on_list(0, ck, ci, nc, k, l, kv, ki, &nk, hist);
      *kept_n = nk;
      return thr;
    }
    nc = 0;
  }
  __builtin_memset(hist, 0, sizeof(int64_t) * kHistBins);
  int64_t i = 0;
  for (; i + W <= v; i += W) {
    alignas(64) uint32_t d[W];
    store_as(d, okey_v(load_as<vf>(l + i)) >> 21);
    for (int j = 0; j < W; ++j) ++hist[d[j]];
  }
  for (; i < v; ++i) ++hist[okey_s(l[i]) >> 21];
  // The bucket holding the k-th largest key: from the maximum's bucket down.
  int64_t need = k;
  uint32_t b = umax >> 21;
  while (hist[b] < need) need -= hist[b--];
  // One pass: higher buckets are kept, the k-th's bucket becomes the candidate list.
  const vu bv = vu{} + b;
  for (i = 0; i < v; i += W) {
    const vf x = load_as<vf>(l + i);
    const vu key = okey_v(x);
    const vu d = key >> 21;
    const vi idx = lanes + static_cast<int32_t>(i);
    const vi valid = idx < static_cast<int32_t>(v);
    const uint32_t gt = mask_bits((d > bv) & valid);
    const uint32_t eq = mask_bits((d == bv) & valid);
    compress(kv + nk, x, gt);
    nk += compress(ki + nk, idx, gt);
    compress(ck + nc, key, eq);
    nc += compress(ci + nc, idx, eq);
  }
  const uint32_t thr = radix_on_list(1, ck, ci, nc, need, l, kv, ki, &nk, hist);
  *kept_n = nk;
  return thr;
}

// ---- step 3: top-p by radix select over weight sums ----------------------------------------------

// The nucleus cut (pool_math.h, "top-p") of the n logits vals[0, n) (padded with -inf to whole
// vectors) whose maximum is m: the ordered key c such that exactly the entries with key >= c are
// kept. Bins hold int64 sums of the fixed-point weights; the walk goes down from the maximum's
// bin while the weight strictly above stays below top_p * total, digit by digit.
uint32_t select_top_p(const float* vals, int64_t n, float m, double top_p, const RowScratch& s) {
  int64_t* hist = s.hist;
  int32_t* w = s.weights;
  __builtin_memset(hist, 0, sizeof(int64_t) * kHistBins);
  vl total_v = vl{};
  for (int64_t i = 0; i < n; i += W) {
    const vf x = load_as<vf>(vals + i);
    const vi wx = top_p_weight_v(x, m);  // 0 on the -inf padding
    store_as(w + i, wx);
    total_v += __builtin_convertvector(wx, vl);
    if (any(wx != 0)) {  // weightless lanes add 0: no branch per lane
      alignas(64) uint32_t d[W];
      alignas(64) int32_t ww[W];
      store_as(d, okey_v(x) >> 21);
      store_as(ww, wx);
      for (int j = 0; j < W; ++j) hist[d[j]] += ww[j];
    }
  }
  const int64_t total = hsum(total_v);
  const double threshold = nucleus_threshold(top_p, total);
  // Invariant of the walk: double(above) < threshold, above = the weight of every key above the
  // current bucket. The bucket where adding its own weight reaches the threshold holds the cut.
  int64_t above = 0;
  uint32_t b = okey_s(m) >> 21;
  while (b > 0 && inside_nucleus(above + hist[b], threshold)) above += hist[b--];
  // Candidates: the entries of that bucket with a weight (weightless ones never move a sum; the
  // cut is the key of a weighted entry, as the weight at it must reach the threshold).
  uint32_t* ck = s.cand_key;
  int32_t* cw = s.cand_aux;
  int64_t nc = 0;
  const vu bv = vu{} + b;
  for (int64_t i = 0; i < n; i += W) {
    const vu key = okey_v(load_as<vf>(vals + i));
    const vi wx = load_as<vi>(w + i);
    const uint32_t sel = mask_bits(((key >> 21) == bv) & (wx != 0));
    if (sel != 0) {
      compress(ck + nc, key, sel);
      nc += compress(cw + nc, wx, sel);
    }
  }
  for (int level = 1; level < 3 && nc > 1; ++level) {
    const int shift = kDigitShift[level];
    const uint32_t mask = kDigitMask[level];
    __builtin_memset(hist, 0, sizeof(int64_t) * (mask + 1));
    uint32_t dmax = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const uint32_t d = (ck[c] >> shift) & mask;
      hist[d] += cw[c];
      dmax = d > dmax ? d : dmax;
    }
    uint32_t bb = dmax;
    while (bb > 0 && inside_nucleus(above + hist[bb], threshold)) above += hist[bb--];
    int64_t k = 0;  // the bucket's candidates stay, in place (vector filter, no branch per entry)
    const vu bv = vu{} + bb;
    const vi lanes = iota();
    for (int64_t c = 0; c < nc; c += W) {
      const vu key = load_as<vu>(ck + c);
      const vi wc = load_as<vi>(cw + c);
      const vi valid = (lanes + static_cast<int32_t>(c)) < static_cast<int32_t>(nc);
      const uint32_t eq = mask_bits((((key >> shift) & mask) == bv) & valid);
      compress(ck + k, key, eq);
      k += compress(cw + k, wc, eq);
    }
    nc = k;
  }
  return ck[0];  // one candidate left, or all share the key (all 32 bits decided)
}

// Keeps, in place, the entries of (val, idx)[0, n) with key >= thr; returns their count.
int64_t filter_kept(float* val, int32_t* idx, int64_t n, uint32_t thr) {
  int64_t m = 0;
  const vu tv = vu{} + thr;
  for (int64_t i = 0; i < n; i += W) {
    const vf x = load_as<vf>(val + i);
    const vi id = load_as<vi>(idx + i);
    const vi lanes = iota() + static_cast<int32_t>(i);
    const uint32_t keep = mask_bits((okey_v(x) >= tv) & (lanes < static_cast<int32_t>(n)));
    compress(val + m, x, keep);  // m <= i: writes land at or before what was read
    m += compress(idx + m, id, keep);
  }
  return m;
}

// The entries of l[0, v) with key >= thr, as a kept list.
int64_t collect_kept(const float* l, int64_t v, uint32_t thr, float* val, int32_t* idx) {
  int64_t m = 0;
  const vu tv = vu{} + thr;
  const vi lanes = iota();
  for (int64_t i = 0; i < v; i += W) {
    const vf x = load_as<vf>(l + i);
    const vi id = lanes + static_cast<int32_t>(i);
    const uint32_t keep = mask_bits((okey_v(x) >= tv) & (id < static_cast<int32_t>(v)));
    if (keep != 0) {
      compress(val + m, x, keep);
      m += compress(idx + m, id, keep);
    }
  }
  return m;
}

SD_INLINE void pad_neg_inf(float* val, int64_t n) { store_as(val + n, splat(kNegInf)); }

// ---- steps 1-3 for one row ------------------------------------------------------------------------

struct RowStats {
  bool ok;         // false: NaN outputs (NaN/+inf logit, or no finite one)
  bool select;     // top-k or top-p decided a threshold; the kept list holds the kept entries
  bool stored;     // s.l holds the row's guided logits
  uint32_t thr;    // kept iff okey >= thr (select only)
  float max;
  float log_sum;   // log(sum of exp(l - max)); p = exp((l - max) - log_sum), see probs_of
  int64_t kept_n;  // select only
};

template <class T>
RowStats row_stats(const T* c, const T* u, const PoolRows& a, bool need_logits, const RowScratch& s) {
  const int64_t v = a.v;
  const bool top_k = a.top_k > 0 && a.top_k < v;
  const bool top_p = a.top_p < 1.0;
  RowStats st{false, top_k || top_p, false, 0u, kNaN, kNaN, 0};
  if (!st.select) {
    const Stream r = need_logits ? stream_any<T, true, true>(c, u, v, a.cfg_scale, a.temperature, s.l)
                                 : stream_any<T, false, true>(c, u, v, a.cfg_scale, a.temperature, s.l);
    st.stored = need_logits;
    if (r.bad || r.max == kNegInf) return st;
    st.ok = true;
    st.max = r.max;
    st.log_sum = logf(r.sum);
    return st;
  }
  const Stream r = stream_any<T, true, false>(c, u, v, a.cfg_scale, a.temperature, s.l);
  st.stored = true;
  if (r.bad || r.max == kNegInf) return st;
  const float m = r.max;  // top-k and top-p keep the maximum: it stays the softmax's max
  int64_t kept = 0;
  if (top_k) {
    st.thr = select_top_k(s.l, v, a.top_k, okey_s(m), s, &kept);
    if (top_p) {
      pad_neg_inf(s.kept_val, kept);
      st.thr = select_top_p(s.kept_val, kept, m, a.top_p, s);
      kept = filter_kept(s.kept_val, s.kept_idx, kept, st.thr);
    }
  } else {
    st.thr = select_top_p(s.l, v, m, a.top_p, s);
    kept = collect_kept(s.l, v, st.thr, s.kept_val, s.kept_idx);
  }
  pad_neg_inf(s.kept_val, kept);
  vf acc = splat(0.0f);
  for (int64_t i = 0; i < kept; i += W) acc = acc + exp_sum(load_as<vf>(s.kept_val + i) - m);
  st.ok = true;
  st.max = m;
  st.log_sum = logf(hsum(acc));
  st.kept_n = kept;
  return st;
}

// ---- pool_probs ------------------------------------------------------------------------------------

// A logit by id: from the row buffer, or recomputed from the inputs (still in cache) with
// pool_math.h's scalar guided_logit, which every lane of the vector pass equals.
template <class T>
SD_INLINE float logit_at(const RowStats& st, const RowScratch& s, const T* c, const T* u, const PoolRows& a,
                         int64_t y) {
  if (st.stored) return s.l[y];
  return guided_logit(logit_s(c + y), u != nullptr ? logit_s(u + y) : 0.0f, u != nullptr, a.cfg_scale,
                      a.temperature);
}

// Probability of logits x under a row's softmax: exp((x - max) - log_sum), as pool_math.h's
// prob_from_logit. Not exp(x - lse): lse is rounded to float32 at the size of the logits (1e5 and
// more at a temperature of 1e-4), x - max is exact near the max (Sterbenz).
SD_INLINE vf prob_v(vf x, vf max, vf log_sum) { return exp_v((x - max) - log_sum); }

// Probabilities of W logits under the row's softmax (0 outside the kept set).
SD_INLINE vf probs_of(const RowStats& st, vf lv) {
  const vf p = prob_v(lv, splat(st.max), splat(st.log_sum));
  return st.select ? select_v(okey_v(lv) >= (vu{} + st.thr), p, splat(0.0f)) : p;
}

// The guided logits of W valid ids: gathered from the row buffer, or recomputed from the inputs
// (still in cache) with the operations of the streaming pass.
template <class T>
SD_INLINE vf logits_at(const RowStats& st, const RowScratch& s, const T* c, const T* u, const PoolRows& a, vi ids) {
  if (st.stored) return gather(s.l, ids);
  vf x;
  if constexpr (sizeof(T) == 4) {
    x = gather(reinterpret_cast<const float*>(c), ids);
    if (u != nullptr) x = guide_v(x, gather(reinterpret_cast<const float*>(u), ids), a.cfg_scale);
    if (a.temperature != 1.0f) x = x / a.temperature;
  } else {
    for (int j = 0; j < W; ++j) x[j] = logit_at<T>(st, s, c, u, a, ids[j]);
  }
  return x;
}

template <class Nb>
SD_INLINE vi load_ids(const Nb* p) {
  if constexpr (sizeof(Nb) == 2) {
    typedef int16_t vs __attribute__((vector_size(W * sizeof(int16_t))));
    return __builtin_convertvector(load_as<vs>(p), vi);
  } else {
    return load_as<vi>(p);
  }
}

template <class T, class Nb>
RowErrors pool_rows_impl(const PoolRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  RowErrors err;
  const int64_t v = a.v;
  const T* cond = static_cast<const T*>(a.cond);
  const T* uncond = static_cast<const T*>(a.uncond);
  const Nb* nb = static_cast<const Nb*>(a.neighbors);
  const bool all_neighbors = a.delta == kInf;  // delta=None: the sum of all K
  for (int64_t r = begin; r < end; ++r) {
    const int64_t x = a.tokens64 ? static_cast<const int64_t*>(a.tokens)[r * a.token_stride]
                                 : static_cast<const int32_t*>(a.tokens)[r * a.token_stride];
    if (x < 0 || x >= v) {
      err.bad_token = r;
      a.pooled[r] = a.p_token[r] = a.row_max[r] = a.row_lse[r] = kNaN;
      continue;
    }
    const T* c = cond + r * a.cond_stride;
    const T* u = uncond != nullptr ? uncond + r * a.uncond_stride : nullptr;
    const RowStats st = row_stats<T>(c, u, a, false, s);
    if (!st.ok) {
      a.pooled[r] = a.p_token[r] = a.row_max[r] = a.row_lse[r] = kNaN;
      continue;
    }
    const float px = probs_of(st, splat(logit_at<T>(st, s, c, u, a, x)))[0];
    float moved = 0.0f;
    if (nb != nullptr) {
      // W neighbours at a time: ids checked, logits gathered, probabilities computed together.
      // S_m: the prefix sums in neighbour order. A batch whose end stays <= delta is taken whole;
      // the batch where the sum passes delta is walked one neighbour at a time, as the scalar
      // definition (an out-of-range id is an error only when reached, the first sum above delta
      // ends the walk). Sums are float32; the order within a batch may differ from the scalar
      // one by rounding.
      const Nb* row_nb = nb + x * a.k;
      const vi lanes = iota();
      vf all = splat(0.0f);  // delta=None: per-lane sums of every batch
      float inclusive = 0.0f;
      bool stopped = false;
      for (int64_t j0 = 0; j0 < a.k && !stopped; j0 += W) {
        const int cnt = static_cast<int>(imin(W, a.k - j0));
        vi ids;
        if (cnt == W) {
          ids = load_ids<Nb>(row_nb + j0);
        } else {
          for (int t = 0; t < W; ++t) ids[t] = t < cnt ? static_cast<int32_t>(row_nb[j0 + t]) : 0;
        }
        const vi present = lanes < cnt;
        const vi valid = (ids >= 0) & (ids < static_cast<int32_t>(v));
        const bool bad = any(present & ~valid);
        const vi safe = select_i(valid, ids, vi{});
        const vf lg = select_v(present & valid, logits_at<T>(st, s, c, u, a, safe), splat(kNegInf));
        const vf p = probs_of(st, lg);
        if (all_neighbors && !bad) {
          all = all + p;
          continue;
        }
        if (all_neighbors) inclusive = hsum(all);  // a bad id in this batch: walk up to it
        const float batch = hsum(p);
        if (!bad && inclusive + batch <= a.delta) {
          inclusive += batch;
          moved = inclusive;
          continue;
        }
        alignas(64) float pv[W];
        alignas(64) int32_t ok[W];
        store_as(pv, p);
        store_as(ok, valid);
        for (int t = 0; t < cnt && !stopped; ++t) {
          if (!ok[t]) {
            err.bad_neighbor = x;
            stopped = true;
          } else {
            inclusive += pv[t];
            stopped = !(inclusive <= a.delta);
            if (!stopped) moved = inclusive;
          }
        }
      }
      if (all_neighbors && !stopped) moved = hsum(all);
    }
    a.pooled[r] = px + moved;
    a.p_token[r] = px;
    a.row_max[r] = st.max;
    a.row_lse[r] = st.max + st.log_sum;
  }
  return err;
}

// ---- sampling_probs --------------------------------------------------------------------------------

SD_INLINE void store_tail(float* dst, vf x, int64_t n) {
  alignas(64) float t[W];
  store_as(t, x);
  for (int64_t j = 0; j < n; ++j) dst[j] = t[j];
}

template <class T>
void sampling_rows_impl(const PoolRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  const int64_t v = a.v;
  const T* cond = static_cast<const T*>(a.cond);
  const T* uncond = static_cast<const T*>(a.uncond);
  const int64_t full = v - v % W;
  for (int64_t r = begin; r < end; ++r) {
    float* out = a.probs + r * v;
    const RowStats st = row_stats<T>(cond + r * a.cond_stride,
                                     uncond != nullptr ? uncond + r * a.uncond_stride : nullptr, a, true, s);
    if (!st.ok) {
      for (int64_t i = 0; i < full; i += W) store_as(out + i, splat(kNaN));
      store_tail(out + full, splat(kNaN), v - full);
      continue;
    }
    const vf mx = splat(st.max), log_sum = splat(st.log_sum);
    if (st.select && st.kept_n * 8 <= v) {
      // Few kept: zeros, then the kept entries' probabilities by id.
      for (int64_t i = 0; i < full; i += W) store_as(out + i, splat(0.0f));
      store_tail(out + full, splat(0.0f), v - full);
      for (int64_t i = 0; i < st.kept_n; i += W) {
        alignas(64) float p[W];
        store_as(p, prob_v(load_as<vf>(s.kept_val + i), mx, log_sum));
        const int cnt = static_cast<int>(imin(W, st.kept_n - i));
        for (int j = 0; j < cnt; ++j) out[s.kept_idx[i + j]] = p[j];
      }
      continue;
    }
    if (!st.select) {
      for (int64_t i = 0; i < full; i += W) store_as(out + i, prob_v(load_as<vf>(s.l + i), mx, log_sum));
      if (full < v) store_tail(out + full, prob_v(load_as<vf>(s.l + full), mx, log_sum), v - full);
      continue;
    }
    const vu thr = vu{} + st.thr;
    for (int64_t i = 0; i < v; i += W) {
      const vf x = load_as<vf>(s.l + i);
      const vi keep = okey_v(x) >= thr;
      const vf p = any(keep) ? select_v(keep, prob_v(x, mx, log_sum), splat(0.0f)) : splat(0.0f);
      if (i + W <= v) {
        store_as(out + i, p);
      } else {
        store_tail(out + i, p, v - i);
      }
    }
  }
}

// ---- sample_residual -------------------------------------------------------------------------------

// verify_math.h mass_units on W lanes: clamp to [0, 1] (NaN -> 0), times 2^30, truncated.
SD_INLINE vi units_v(vf x) {
  x = max_v(x, splat(0.0f));
  x = min_v(x, splat(1.0f));
  return __builtin_convertvector(x * kMassScale, vi);
}

template <bool kQ>
SD_INLINE vi units_at(const float* p, const float* q, int64_t i) {
  vf x = load_as<vf>(p + i);
  if (kQ) x = x - load_as<vf>(q + i);
  return units_v(x);
}

template <bool kQ>
SD_INLINE int64_t units_s(const float* p, const float* q, int64_t i) {
  return kQ ? residual_units(p[i], q[i]) : mass_units(p[i]);
}

// The value checks of one row (verify_math.h, kBadP and others), accumulated lane by lane.
struct RowChecks {
  vi bad_p = vi{}, bad_q = vi{}, mass = vi{};
  bool bad_p_s = false, bad_q_s = false, mass_s = false;

  SD_INLINE static vi outside_unit_v(vf x) { return ~((x >= splat(0.0f)) & (x <= splat(1.0f))); }

  template <bool kQ>
  SD_INLINE void vector(const float* p, const float* q, int64_t i) {
    const vf x = load_as<vf>(p + i);
    bad_p |= outside_unit_v(x);
    mass |= x >= splat(1.0f / kMassScale);
    if (kQ) bad_q |= outside_unit_v(load_as<vf>(q + i));
  }

  template <bool kQ>
  SD_INLINE void scalar(const float* p, const float* q, int64_t i) {
    bad_p_s |= outside_unit(p[i]);
    mass_s |= has_mass(p[i]);
    if (kQ) bad_q_s |= outside_unit(q[i]);
  }

  SD_INLINE int32_t code() const {
    return ((bad_p_s || any(bad_p)) ? kBadP : 0) | ((mass_s || any(mass)) ? 0 : kPNoMass) |
           ((bad_q_s || any(bad_q)) ? kBadQ : 0);
  }
};

// Sums of the units of each block of kResidualBlock entries into blocks[]; returns the total.
// With `checks`, the same read also checks the values of p (and q).
template <bool kQ, bool kCheck = false>
int64_t block_sums(const float* p, const float* q, int64_t v, int64_t* blocks, RowChecks* checks = nullptr) {
  int64_t total = 0;
  for (int64_t b0 = 0, bi = 0; b0 < v; b0 += kResidualBlock, ++bi) {
    const int64_t e = imin(b0 + kResidualBlock, v);
    vl acc = vl{};
    int64_t i = b0;
    for (; i + W <= e; i += W) {
      if (kCheck) checks->template vector<kQ>(p, q, i);
      acc += __builtin_convertvector(units_at<kQ>(p, q, i), vl);
    }
    int64_t sum = hsum(acc);
    for (; i < e; ++i) {
      if (kCheck) checks->template scalar<kQ>(p, q, i);
      sum += units_s<kQ>(p, q, i);
    }
    blocks[bi] = sum;
    total += sum;
  }
  return total;
}

// Smallest i with cumsum(units)[i] > threshold, v - 1 when there is none (verify_math.h).
template <bool kQ>
int32_t first_above(const float* p, const float* q, int64_t v, const int64_t* blocks, int64_t threshold) {
  int64_t cum = 0;
  for (int64_t b0 = 0, bi = 0; b0 < v; b0 += kResidualBlock, ++bi) {
    if (cum + blocks[bi] <= threshold) {
      cum += blocks[bi];
      continue;
    }
    const int64_t e = imin(b0 + kResidualBlock, v);
    int64_t i = b0;
    for (; i + W <= e; i += W) {
      const vi un = units_at<kQ>(p, q, i);
      const int64_t sum = hsum(__builtin_convertvector(un, vl));
      if (cum + sum > threshold) {
        alignas(64) int32_t t[W];
        store_as(t, un);
        for (int j = 0; j < W; ++j) {
          cum += t[j];
          if (cum > threshold) return static_cast<int32_t>(i + j);
        }
      }
      cum += sum;
    }
    for (; i < e; ++i) {
      cum += units_s<kQ>(p, q, i);
      if (cum > threshold) return static_cast<int32_t>(i);
    }
  }
  return static_cast<int32_t>(v - 1);
}

void residual_rows_impl(const ResidualRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  const int64_t v = a.v;
  const bool check = a.errors != nullptr;
  for (int64_t r = begin; r < end; ++r) {
    const float* p = a.p + r * v;
    const float* q = a.q != nullptr ? a.q + r * v : nullptr;
    RowChecks checks;
    int64_t total = 0;
    if (q != nullptr) {
      total = check ? block_sums<true, true>(p, q, v, s.blocks, &checks) : block_sums<true>(p, q, v, s.blocks);
    }
    const bool from_p = q == nullptr || total == 0;
    a.fallback[r] = q != nullptr && total == 0;
    if (from_p) {
      total = check && q == nullptr ? block_sums<false, true>(p, nullptr, v, s.blocks, &checks)
                                    : block_sums<false>(p, nullptr, v, s.blocks);
    }
    float ur = a.u != nullptr ? a.u[r] : philox_row_uniform(a.seed, r, a.offset);
    if (check) a.errors[r] = checks.code() | (bad_uniform(ur) ? kBadUniform : 0);
    if (bad_uniform(ur)) ur = 0.0f;  // a defined token (the row is refused when checked)
    const int64_t threshold = cdf_threshold(ur, total);
    a.tokens[r] = from_p ? first_above<false>(p, nullptr, v, s.blocks, threshold)
                         : first_above<true>(p, q, v, s.blocks, threshold);
  }
}

// ---- entry points ----------------------------------------------------------------------------------

template <class T>
RowErrors pool_rows_nb(const PoolRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  return a.neighbors16 ? pool_rows_impl<T, int16_t>(a, begin, end, s) : pool_rows_impl<T, int32_t>(a, begin, end, s);
}

RowErrors pool_rows(const PoolRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  switch (a.dtype) {
    case LogitsType::kHalf:
      return pool_rows_nb<c10::Half>(a, begin, end, s);
    case LogitsType::kBFloat16:
      return pool_rows_nb<c10::BFloat16>(a, begin, end, s);
    default:
      return pool_rows_nb<float>(a, begin, end, s);
  }
}

void sampling_rows(const PoolRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  switch (a.dtype) {
    case LogitsType::kHalf:
      return sampling_rows_impl<c10::Half>(a, begin, end, s);
    case LogitsType::kBFloat16:
      return sampling_rows_impl<c10::BFloat16>(a, begin, end, s);
    default:
      return sampling_rows_impl<float>(a, begin, end, s);
  }
}

void residual_rows(const ResidualRows& a, int64_t begin, int64_t end, const RowScratch& s) {
  residual_rows_impl(a, begin, end, s);
}

const Kernels kTable{SPECDEC_CAP_NAME, W, &pool_rows, &sampling_rows, &residual_rows};
#undef SD_INLINE

}  // namespace

const Kernels* table() { return &kTable; }

}  // namespace SPECDEC_CAP
}  // namespace cpu
}  // namespace specdec
