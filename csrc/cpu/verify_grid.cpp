// Kernel 2 on the CPU: parallel 2-D acceptance/rejection (docs/design.md, "Kernel 2").
//
// Grids are split across threads with at::parallel_for; each grid is handled in O(H * W)
// whatever the radius: the Chebyshev dilation of mode="local" is separable (a row pass, then a
// column pass, each a window count over prefix sums), and the islands come from one raster
// scan of union-find (each pixel is united with its four already-visited 8-neighbours, the
// larger root always hooked under the smaller, so every root is the smallest raster index of
// its component) followed by one flattening pass. With grid_errors, the first pass also checks
// the values (NaN scores, uniforms outside [0, 1)) and writes the grid's code.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "specdec/verify_math.h"
#include "specdec/cpu_parallel.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

struct GridIn {
  const float* p;
  const float* q;
  const float* u;
  const bool* valid;
};

struct GridOut {
  bool* accept;
  bool* resample;
  int32_t* islands;
};

int32_t find_root(int32_t* parent, int32_t x) {
  while (parent[x] != x) {
    parent[x] = parent[parent[x]];  // path halving
    x = parent[x];
  }
  return x;
}

void unite(int32_t* parent, int32_t a, int32_t b) {
  a = find_root(parent, a);
  b = find_root(parent, b);
  if (a < b) {
    parent[b] = a;
  } else if (b < a) {
    parent[a] = b;
  }
}

// Chebyshev dilation of `marks` by `r`, written to `out` (values 0/1); `scratch` has size
// (H + 1) * W + W + 1.
void dilate(const uint8_t* marks, int64_t h, int64_t w, int64_t r, uint8_t* row_dilated,
            int32_t* scratch, uint8_t* out) {
  int32_t* row_prefix = scratch;  // W + 1 entries
  for (int64_t i = 0; i < h; ++i) {
    const uint8_t* row = marks + i * w;
    row_prefix[0] = 0;
    for (int64_t j = 0; j < w; ++j) row_prefix[j + 1] = row_prefix[j] + row[j];
    for (int64_t j = 0; j < w; ++j) {
      const int64_t lo = std::max<int64_t>(0, j - r), hi = std::min<int64_t>(w, j + r + 1);
      row_dilated[i * w + j] = (row_prefix[hi] - row_prefix[lo]) > 0;
    }
  }
  int32_t* col_prefix = scratch + (w + 1);  // (H + 1) * W entries
  for (int64_t j = 0; j < w; ++j) col_prefix[j] = 0;
  for (int64_t i = 0; i < h; ++i) {
    for (int64_t j = 0; j < w; ++j) {
      col_prefix[(i + 1) * w + j] = col_prefix[i * w + j] + row_dilated[i * w + j];
    }
  }
  for (int64_t i = 0; i < h; ++i) {
    const int64_t lo = std::max<int64_t>(0, i - r), hi = std::min<int64_t>(h, i + r + 1);
    for (int64_t j = 0; j < w; ++j) {
      out[i * w + j] = (col_prefix[hi * w + j] - col_prefix[lo * w + j]) > 0;
    }
  }
}

// Labels the 8-connected components of `resample` in place in `labels`; returns their number.
int32_t label_islands(const bool* resample, int64_t h, int64_t w, int32_t* labels) {
  for (int64_t i = 0; i < h; ++i) {
    for (int64_t j = 0; j < w; ++j) {
      const int32_t u = static_cast<int32_t>(i * w + j);
      if (!resample[u]) {
        labels[u] = -1;
        continue;
      }
      labels[u] = u;
      // The four neighbours already visited in raster order; the other four unite with u later.
      if (j > 0 && resample[u - 1]) unite(labels, u, u - 1);
      if (i > 0) {
        const int32_t up = static_cast<int32_t>(u - w);
        if (j > 0 && resample[up - 1]) unite(labels, u, up - 1);
        if (resample[up]) unite(labels, u, up);
        if (j + 1 < w && resample[up + 1]) unite(labels, u, up + 1);
      }
    }
  }
  int32_t count = 0;
  for (int32_t u = 0; u < static_cast<int32_t>(h * w); ++u) {
    if (labels[u] < 0) continue;
    labels[u] = find_root(labels, u);  // roots precede their members: one pass flattens
    count += labels[u] == u;
  }
  return count;
}

void verify_one_grid(const GridIn& in, const GridOut& out, int64_t h, int64_t w,
                     const VerifyConfig& cfg, std::vector<uint8_t>& rejected,
                     std::vector<uint8_t>& row_dilated, std::vector<uint8_t>& window,
                     std::vector<int32_t>& scratch, int32_t* first_reject, int32_t* num_islands,
                     int32_t* errors) {
  const int64_t n = h * w;
  const bool ratio = cfg.rule == VerifyRule::kRatio;
  int64_t first = n;
  bool nan_p = false, nan_q = false, bad_u = false;  // the value checks, in the same pass
  for (int64_t u = 0; u < n; ++u) {
    const bool is_valid = in.valid == nullptr || in.valid[u];
    const bool rej = ratio ? rejected_by_ratio(in.p[u], in.q[u], in.u[u])
                           : rejected_by_threshold(in.p[u], cfg.tau);
    rejected[u] = is_valid && rej;
    if (rejected[u] && first == n) first = u;
    if (errors != nullptr) {
      nan_p |= in.p[u] != in.p[u];
      if (ratio) {
        nan_q |= in.q[u] != in.q[u];
        bad_u |= bad_uniform(in.u[u]);
      }
    }
  }
  if (errors != nullptr) *errors = (nan_p ? kNanP : 0) | (nan_q ? kNanQ : 0) | (bad_u ? kGridBadUniform : 0);
  if (cfg.mode == VerifyMode::kLocal && first < n) {
    dilate(rejected.data(), h, w, cfg.radius, row_dilated.data(), scratch.data(), window.data());
  }
  for (int64_t u = 0; u < n; ++u) {
    const bool is_valid = in.valid == nullptr || in.valid[u];
    bool rs;
    switch (cfg.mode) {
      case VerifyMode::kRaster: rs = is_valid && u >= first; break;
      case VerifyMode::kIndependent: rs = rejected[u] != 0; break;
      default: rs = is_valid && u >= first && window[u] != 0; break;
    }
    out.resample[u] = rs;
    out.accept[u] = is_valid && !rs;
  }
  *first_reject = static_cast<int32_t>(first);
  *num_islands = label_islands(out.resample, h, w, out.islands);
}

}  // namespace

VerifyOut verify_grid_cpu(const at::Tensor& p, const std::optional<at::Tensor>& q,
                          const std::optional<at::Tensor>& uniforms,
                          const std::optional<at::Tensor>& valid, std::string_view rule,
                          double tau, std::string_view mode, int64_t radius,
                          const std::optional<at::Tensor>& grid_errors) {
  const VerifyConfig cfg = check_verify_args(p, q, uniforms, valid, rule, tau, mode, radius, grid_errors);
  TORCH_CHECK_VALUE(p.device().is_cpu(), "p must be a CPU tensor for the cpu backend");
  const int64_t b = p.size(0), h = p.size(1), w = p.size(2), n = h * w;
  at::Tensor accept = at::empty(p.sizes(), p.options().dtype(at::kBool));
  at::Tensor resample = at::empty(p.sizes(), p.options().dtype(at::kBool));
  at::Tensor islands = at::empty(p.sizes(), p.options().dtype(at::kInt));
  at::Tensor first_reject = at::empty({b}, p.options().dtype(at::kInt));
  at::Tensor num_islands = at::empty({b}, p.options().dtype(at::kInt));
  const float* p_ptr = p.data_ptr<float>();
  const float* q_ptr = cfg.rule == VerifyRule::kRatio ? q->data_ptr<float>() : nullptr;
  const float* u_ptr = cfg.rule == VerifyRule::kRatio ? uniforms->data_ptr<float>() : nullptr;
  const bool* valid_ptr = valid.has_value() ? valid->data_ptr<bool>() : nullptr;
  bool* accept_ptr = accept.data_ptr<bool>();
  bool* resample_ptr = resample.data_ptr<bool>();
  int32_t* islands_ptr = islands.data_ptr<int32_t>();
  int32_t* first_ptr = first_reject.data_ptr<int32_t>();
  int32_t* count_ptr = num_islands.data_ptr<int32_t>();
  int32_t* errors_ptr = grid_errors.has_value() ? grid_errors->data_ptr<int32_t>() : nullptr;

  at::parallel_for(0, b, grain_for(h * w), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> rejected(n), row_dilated(n), window(n);
    std::vector<int32_t> scratch((h + 1) * w + w + 1);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * n;
      GridIn in{p_ptr + off, q_ptr ? q_ptr + off : nullptr, u_ptr ? u_ptr + off : nullptr,
                valid_ptr ? valid_ptr + off : nullptr};
      GridOut out{accept_ptr + off, resample_ptr + off, islands_ptr + off};
      verify_one_grid(in, out, h, w, cfg, rejected, row_dilated, window, scratch, first_ptr + g,
                      count_ptr + g, errors_ptr ? errors_ptr + g : nullptr);
    }
  });
  return {accept, resample, first_reject, islands, num_islands};
}

}  // namespace specdec
