// Kernel 1 on the CPU: fused probability pooling (docs/design.md, "Kernel 1").
//
// Rows are split across threads with at::parallel_for. Each row is read once into a per-thread
// float buffer of V logits (never an [N, V] tensor); softmax statistics, the top-k threshold, the
// top-p cut (a bisection over keys on a compacted (key, weight) buffer) and the neighbour prefix
// sums are computed from that buffer.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <vector>

#include "specdec/pool_math.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct RowSoftmax {
  bool ok;          // false: the row holds NaN/+inf or no finite logit -> NaN outputs
  int32_t threshold_key;
  float max;
  float lse;
};

// Steps 1-3 of kernel 1 for one row: fills `l` with the guided logits and returns the
// statistics of softmax(top_k(l)).
// Buffers one thread reuses across its rows (never [N, V]).
struct RowScratch {
  std::vector<float> values;     // top-k selection
  std::vector<int32_t> keys;     // top-p: ordered keys of the entries with weight > 0 ...
  std::vector<int32_t> weights;  // ... and their fixed-point weights (< 2^31)
};

// Smallest key t >= lo with sum(weights of keys > t) < threshold (pool_math.h "top-p"); `hi`
// satisfies it. Entries of zero weight never change the sums, so only the others are searched.
int32_t nucleus_cut(const std::vector<int32_t>& keys, const std::vector<int32_t>& weights,
                    int64_t lo, int64_t hi, double threshold) {
  const int64_t c = static_cast<int64_t>(keys.size());
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    int64_t above = 0;
    for (int64_t i = 0; i < c; ++i) above += keys[i] > mid ? weights[i] : 0;
    if (inside_nucleus(above, threshold)) hi = mid; else lo = mid + 1;
  }
  return static_cast<int32_t>(lo);
}

// Step 2b: raise the top-k threshold key to the nucleus cut of top_p (< 1) for a row whose
// kept logits (key >= threshold_key) have maximum m.
int32_t top_p_threshold(const float* l, int64_t v, int32_t threshold_key, float m, double top_p,
                        RowScratch& scratch) {
  scratch.keys.clear();
  scratch.weights.clear();
  int64_t total = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (!kept_by_top_k(l[i], threshold_key)) continue;
    const int64_t w = top_p_weight(l[i], m);
    if (w == 0) continue;
    scratch.keys.push_back(ordered_key(l[i]));
    scratch.weights.push_back(static_cast<int32_t>(w));
    total += w;
  }
  // The cut lies between the top-k threshold (everything below it is gone already) and the
  // max's key (nothing weighs more than the max: weight above it is 0).
  return nucleus_cut(scratch.keys, scratch.weights, threshold_key, ordered_key(m),
                     nucleus_threshold(top_p, total));
}

template <typename T>
RowSoftmax row_softmax(const T* cond, const T* uncond, int64_t v, float cfg_scale,
                       float temperature, int64_t top_k, double top_p, std::vector<float>& l,
                       RowScratch& scratch) {
  bool poison = false;
  for (int64_t i = 0; i < v; ++i) {
    float x = guided_logit(static_cast<float>(cond[i]),
                           uncond ? static_cast<float>(uncond[i]) : 0.0f, uncond != nullptr,
                           cfg_scale, temperature);
    poison |= is_poison(x);
    l[i] = x;
  }
  if (poison) return {false, 0, kNaN, kNaN};

  int32_t threshold_key = std::numeric_limits<int32_t>::min();
  if (top_k > 0 && top_k < v) {
    std::vector<float>& values = scratch.values;
    values.assign(l.begin(), l.begin() + v);
    std::nth_element(values.begin(), values.begin() + (top_k - 1), values.end(),
                     std::greater<float>());
    threshold_key = ordered_key(values[top_k - 1]);
  }

  float m = -INFINITY;
  for (int64_t i = 0; i < v; ++i) {
    if (kept_by_top_k(l[i], threshold_key)) m = std::max(m, l[i]);
  }
  if (m == -INFINITY) return {false, 0, kNaN, kNaN};
  // top-p keeps the max, so m stays the row max of the final softmax.
  if (top_p < 1.0) threshold_key = top_p_threshold(l.data(), v, threshold_key, m, top_p, scratch);
  float s = 0.0f;
  for (int64_t i = 0; i < v; ++i) {
    s += kept_by_top_k(l[i], threshold_key) ? expf(l[i] - m) : 0.0f;
  }
  return {true, threshold_key, m, m + logf(s)};
}

template <typename T, typename Nb>
void pool_rows(const at::Tensor& logits, const at::Tensor& tokens, const Nb* nb, int64_t k,
               const at::Tensor* uncond, float cfg_scale, float temperature, int64_t top_k,
               double top_p, float delta, float* pooled, float* p_token, float* row_max, float* row_lse) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const T* cond_base = logits.data_ptr<T>();
  const T* uncond_base = uncond ? uncond->data_ptr<T>() : nullptr;
  const int64_t stride = logits.stride(0);
  const int64_t ustride = uncond ? uncond->stride(0) : 0;
  const bool tok64 = tokens.scalar_type() == at::kLong;
  const void* tok = tokens.data_ptr();
  const int64_t tok_stride = tokens.stride(0);
  std::atomic<int64_t> bad_token{-1}, bad_neighbor{-1};

  at::parallel_for(0, n, grain_for(v), [&](int64_t begin, int64_t end) {
    std::vector<float> l(v);
    RowScratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t x = tok64 ? static_cast<const int64_t*>(tok)[r * tok_stride]
                              : static_cast<const int32_t*>(tok)[r * tok_stride];
      if (x < 0 || x >= v) {
        bad_token.store(r);
        pooled[r] = p_token[r] = row_max[r] = row_lse[r] = kNaN;
        continue;
      }
      RowSoftmax st = row_softmax(cond_base + r * stride,
                                  uncond_base ? uncond_base + r * ustride : nullptr, v, cfg_scale,
                                  temperature, top_k, top_p, l, scratch);
      if (!st.ok) {
        pooled[r] = p_token[r] = row_max[r] = row_lse[r] = kNaN;
        continue;
      }
      const float px = prob_from_logit(l[x], st.threshold_key, st.lse);
      float moved = 0.0f;
      if (nb != nullptr) {
        const Nb* row_nb = nb + x * k;
        float inclusive = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t y = row_nb[j];
          if (y < 0 || y >= v) {
            bad_neighbor.store(x);
            break;
          }
          inclusive += prob_from_logit(l[y], st.threshold_key, st.lse);
          // Prefix sums of non-negative terms never decrease: the first one above delta ends it.
          if (!(inclusive <= delta)) break;
          moved = inclusive;
        }
      }
      pooled[r] = px + moved;
      p_token[r] = px;
      row_max[r] = st.max;
      row_lse[r] = st.lse;
    }
  });
  TORCH_CHECK_VALUE(bad_token.load() < 0, "tokens: id out of range [0, ", v, ") at row ",
                    bad_token.load());
  TORCH_CHECK_VALUE(bad_neighbor.load() < 0, "neighbors: row ", bad_neighbor.load(),
                    " holds an id out of range [0, ", v, ")");
}

}  // namespace

PoolOut pool_probs_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                       const std::optional<at::Tensor>& neighbors,
                       const std::optional<at::Tensor>& uncond_logits, double cfg_scale,
                       double temperature, int64_t top_k, std::optional<double> delta,
                       double top_p) {
  check_pool_args(logits, tokens, neighbors, uncond_logits, cfg_scale, temperature, top_k, delta,
                  top_p);
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits must be a CPU tensor for the cpu backend");
  const int64_t n = logits.size(0);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor pooled = at::empty({n}, opts), p_token = at::empty({n}, opts),
             row_max = at::empty({n}, opts), row_lse = at::empty({n}, opts);
  const at::Tensor* uncond = uncond_logits.has_value() ? &*uncond_logits : nullptr;
  const float d = delta.has_value() ? static_cast<float>(*delta) : INFINITY;
  const int64_t k = neighbors.has_value() ? neighbors->size(1) : 0;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "pool_probs_cpu", [&] {
    auto run = [&](auto* nb_ptr) {
      pool_rows<scalar_t>(logits, tokens, nb_ptr, k, uncond, static_cast<float>(cfg_scale),
                          static_cast<float>(temperature), top_k, top_p, d, pooled.data_ptr<float>(),
                          p_token.data_ptr<float>(), row_max.data_ptr<float>(),
                          row_lse.data_ptr<float>());
    };
    if (!neighbors.has_value()) {
      run(static_cast<const int32_t*>(nullptr));
    } else if (neighbors->scalar_type() == at::kShort) {
      run(neighbors->data_ptr<int16_t>());
    } else {
      run(neighbors->data_ptr<int32_t>());
    }
  });
  return {pooled, p_token, row_max, row_lse};
}

at::Tensor sampling_probs_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                              double cfg_scale, double temperature, int64_t top_k, double top_p) {
  check_pool_args(logits, std::nullopt, std::nullopt, uncond_logits, cfg_scale, temperature, top_k,
                  std::nullopt, top_p);
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits must be a CPU tensor for the cpu backend");
  const int64_t n = logits.size(0), v = logits.size(1);
  at::Tensor probs = at::empty({n, v}, logits.options().dtype(at::kFloat));
  float* out = probs.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sampling_probs_cpu", [&] {
    const scalar_t* cond = logits.data_ptr<scalar_t>();
    const scalar_t* uncond = uncond_logits.has_value() ? uncond_logits->data_ptr<scalar_t>() : nullptr;
    const int64_t stride = logits.stride(0);
    const int64_t ustride = uncond_logits.has_value() ? uncond_logits->stride(0) : 0;
    at::parallel_for(0, n, grain_for(v), [&](int64_t begin, int64_t end) {
      std::vector<float> l(v);
      RowScratch scratch;
      for (int64_t r = begin; r < end; ++r) {
        RowSoftmax st = row_softmax(cond + r * stride, uncond ? uncond + r * ustride : nullptr, v,
                                    static_cast<float>(cfg_scale), static_cast<float>(temperature),
                                    top_k, top_p, l, scratch);
        float* row = out + r * v;
        for (int64_t i = 0; i < v; ++i) {
          row[i] = st.ok ? prob_from_logit(l[i], st.threshold_key, st.lse) : kNaN;
        }
      }
    });
  });
  return probs;
}

}  // namespace specdec
