// Kernel 3 on CUDA: tree-masked attention over a raster-slot KV cache (docs/design.md, "Kernel 3").
//
// FlashAttention-2 style forward. A block of 4 warps owns kBlockM = 64 queries of one
// (batch, query head); warp w owns query rows 16w..16w+15. Keys are walked in tiles of
// kBlockN = 64 with an online softmax in base 2 (running max m, sum l per row, float32):
//   1. the tile's K, V, positions and validity go to shared memory (invalid slots as zeros, so
//      garbage in empty cache slots never reaches the output);
//   2. tile skipping: if no valid key of the tile is at or before the block's latest query
//      (__syncthreads_or), the tile costs nothing more;
//   3. S = Q K^T: tensor cores (nvcuda::wmma 16x16x16, fp16/bf16 in, fp32 accumulate) for
//      fp16/bf16, plain FMA for fp32;
//   4. per warp, two lanes per query row apply the visibility rule (specdec/attention_math.h),
//      update m and l and write P;
//   5. O = O * alpha + P V: tensor cores again (O kept in shared memory as float, which is where
//      the per-row rescaling happens, since wmma fragment layouts are opaque), FMA for fp32.
// Memory is linear in the key length; nothing of size [Nq, Nk] is written.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "specdec/attention_math.h"
#include "specdec/attention_problem.h"
#include "specdec_ops.h"

namespace specdec {
namespace {

constexpr int kBlockM = 64;
constexpr int kBlockN = 64;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kBlockM / kWarps;  // 16: one wmma row of fragments
constexpr int kFrag = 16;

// Element traits: the device type behind the ATen type, conversions, and whether wmma applies.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using dev = float;
  static constexpr bool kMma = false;
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
};
template <>
struct Elem<c10::Half> {
  using dev = __half;
  static constexpr bool kMma = true;
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Elem<c10::BFloat16> {
  using dev = __nv_bfloat16;
  static constexpr bool kMma = true;
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

using Params = AttentionProblem;   // passed to the kernel by value

// Shared-memory layout (element counts), padded so that wmma pointers stay 32-byte aligned
// and rows of consecutive fragments fall in different banks.
struct Layout {
  int dp;       // D rounded up to 16
  int ld_in;    // row stride of Q, K, V tiles (elements of the input type)
  int ld_s;     // row stride of S (floats)
  int ld_p;     // row stride of P (input type)
  int ld_o;     // row stride of O (floats)
  size_t off_q, off_k, off_v, off_s, off_p, off_o, off_stats, off_pos, bytes;
};

__host__ __device__ inline size_t align128(size_t x) { return (x + 127) / 128 * 128; }

// `mma`: P gets its own buffer in the input type for wmma; the FMA path keeps P in S.
template <typename T, bool mma>
__host__ __device__ inline Layout make_layout(int d) {
  Layout L;
  L.dp = (d + kFrag - 1) / kFrag * kFrag;
  L.ld_in = L.dp + 8;
  L.ld_s = kBlockN + 4;
  L.ld_p = kBlockN + 8;
  L.ld_o = L.dp + 4;
  const size_t in = sizeof(T);
  size_t off = 0;
  L.off_q = off; off = align128(off + kBlockM * L.ld_in * in);
  L.off_k = off; off = align128(off + kBlockN * L.ld_in * in);
  L.off_v = off; off = align128(off + kBlockN * L.ld_in * in);
  L.off_s = off; off = align128(off + kBlockM * L.ld_s * sizeof(float));
  L.off_p = off; off = align128(off + (mma ? kBlockM * L.ld_p * in : 0));
  L.off_o = off; off = align128(off + kBlockM * L.ld_o * sizeof(float));
  L.off_stats = off; off = align128(off + 3 * kBlockM * sizeof(float));            // m, l, alpha
  L.off_pos = off; off = align128(off + (kBlockM + kBlockN) * sizeof(int64_t) + kBlockN);  // q_pos, kv_pos, ok
  L.bytes = off;
  return L;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_attention_kernel(Params p) {
  using E = Elem<T>;
  using D = typename E::dev;
  extern __shared__ __align__(128) unsigned char smem[];
  const Layout L = make_layout<D, Elem<T>::kMma>(static_cast<int>(p.d));
  D* qs = reinterpret_cast<D*>(smem + L.off_q);
  D* ks = reinterpret_cast<D*>(smem + L.off_k);
  D* vs = reinterpret_cast<D*>(smem + L.off_v);
  float* ss = reinterpret_cast<float*>(smem + L.off_s);
  D* ps = reinterpret_cast<D*>(smem + L.off_p);
  float* os = reinterpret_cast<float*>(smem + L.off_o);
  float* m_s = reinterpret_cast<float*>(smem + L.off_stats);
  float* l_s = m_s + kBlockM;
  float* alpha_s = l_s + kBlockM;
  int64_t* qpos_s = reinterpret_cast<int64_t*>(smem + L.off_pos);
  int64_t* kpos_s = qpos_s + kBlockM;
  bool* ok_s = reinterpret_cast<bool*>(kpos_s + kBlockN);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t bh = blockIdx.y;
  const int64_t b = bh / p.hq, h = bh % p.hq, hk = h / p.group;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  const int dp = L.dp, d = static_cast<int>(p.d);
  const D* qg = static_cast<const D*>(p.q) + b * p.q_sb + h * p.q_sh;
  const D* kg = static_cast<const D*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const D* vg = static_cast<const D*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const int64_t* kv_pos = p.kv_pos + b * p.nk;
  const bool* kv_valid = p.kv_valid ? p.kv_valid + b * p.nk : nullptr;
  const int64_t block_start = p.nk - p.nq;

  // Queries (zero padded), their positions, and the running statistics.
  for (int i = tid; i < kBlockM * dp; i += kThreads) {
    const int r = i / dp, c = i % dp;
    const int64_t qi = q0 + r;
    qs[r * L.ld_in + c] = (qi < p.nq && c < d) ? qg[qi * p.q_sn + c] : E::from_float(0.0f);
  }
  for (int i = tid; i < kBlockM * dp; i += kThreads) os[(i / dp) * L.ld_o + i % dp] = 0.0f;
  for (int r = tid; r < kBlockM; r += kThreads) {
    const int64_t qi = q0 + r;
    qpos_s[r] = qi < p.nq ? p.q_pos[b * p.nq + qi] : INT64_MIN;  // a padding row sees nothing
    m_s[r] = -INFINITY;
    l_s[r] = 0.0f;
  }
  __syncthreads();
  int64_t q_last = INT64_MIN;
  for (int r = 0; r < kBlockM; ++r) q_last = max(q_last, qpos_s[r]);

  for (int64_t k0 = 0; k0 < p.nk; k0 += kBlockN) {
    // Positions and validity first: they decide whether the tile is needed at all.
    bool any_visible = false;
    if (tid < kBlockN) {
      const int64_t j = k0 + tid;
      const bool ok = j < p.nk && (kv_valid == nullptr || kv_valid[j]);
      ok_s[tid] = ok;
      kpos_s[tid] = j < p.nk ? kv_pos[j] : INT64_MAX;
      any_visible = ok && kpos_s[tid] <= q_last;
    }
    if (!__syncthreads_or(any_visible)) continue;  // uniform across the block

    for (int i = tid; i < kBlockN * dp; i += kThreads) {
      const int r = i / dp, c = i % dp;
      const bool load = ok_s[r] && c < d;
      const int64_t j = k0 + r;
      ks[r * L.ld_in + c] = load ? kg[j * p.k_sn + c] : E::from_float(0.0f);
      vs[r * L.ld_in + c] = load ? vg[j * p.v_sn + c] : E::from_float(0.0f);
    }
    __syncthreads();

    float* s_w = ss + warp * kRowsPerWarp * L.ld_s;
    // S_w[16, 64] = Q_w K^T
    if constexpr (E::kMma) {
      using namespace nvcuda;
      for (int n = 0; n < kBlockN / kFrag; ++n) {
        wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < dp; kk += kFrag) {
          wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, D, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, D, wmma::col_major> bf;
          wmma::load_matrix_sync(a, qs + warp * kRowsPerWarp * L.ld_in + kk, L.ld_in);
          wmma::load_matrix_sync(bf, ks + n * kFrag * L.ld_in + kk, L.ld_in);  // K^T as column-major
          wmma::mma_sync(acc, a, bf, acc);
        }
        wmma::store_matrix_sync(s_w + n * kFrag, acc, L.ld_s, wmma::mem_row_major);
      }
    } else {
      for (int e = lane; e < kRowsPerWarp * kBlockN; e += 32) {
        const int r = e / kBlockN, j = e % kBlockN;
        const D* qrow = qs + (warp * kRowsPerWarp + r) * L.ld_in;
        const D* krow = ks + j * L.ld_in;
        float acc = 0.0f;
        for (int c = 0; c < d; ++c) acc = fmaf(E::to_float(qrow[c]), E::to_float(krow[c]), acc);
        s_w[r * L.ld_s + j] = acc;
      }
    }
    __syncwarp();

    // Online softmax: lanes 2r and 2r+1 share row r, 32 columns each.
    {
      const int r = lane / 2, half = lane % 2;
      const int row = warp * kRowsPerWarp + r;
      const int64_t qi = q0 + row;
      const int64_t qpos = qpos_s[row];
      const int32_t* tree_row = (p.tree != nullptr && qi < p.nq) ? p.tree + (b * p.nq + qi) * p.words : nullptr;
      float* srow = s_w + r * L.ld_s;
      float mx = -INFINITY;
      for (int jj = 0; jj < kBlockN / 2; ++jj) {
        const int j = half * (kBlockN / 2) + jj;
        const int64_t key = k0 + j;
        bool vis = qi < p.nq && key_visible(ok_s[j], kpos_s[j], qpos, p.tree ? tree_row : nullptr, key - block_start);
        if (p.tree != nullptr && tree_row == nullptr) vis = false;
        const float s = vis ? srow[j] * p.scale_log2 : -INFINITY;
        srow[j] = s;
        mx = fmaxf(mx, s);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = m_s[row];
      const float m_new = fmaxf(m_old, mx);
      const float m_sub = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: exp2 gives 0, not NaN
      float sum = 0.0f;
      for (int jj = 0; jj < kBlockN / 2; ++jj) {
        const int j = half * (kBlockN / 2) + jj;
        const float pj = exp2f(srow[j] - m_sub);
        sum += pj;
        if constexpr (E::kMma) {
          ps[row * L.ld_p + j] = E::from_float(pj);
        } else {
          srow[j] = pj;
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      const float alpha = exp2f(m_old - m_sub);
      __syncwarp();
      if (half == 0) {
        l_s[row] = l_s[row] * alpha + sum;
        m_s[row] = m_new;
        alpha_s[row] = alpha;
      }
    }
    __syncwarp();

    // O_w = O_w * alpha + P_w V
    float* o_w = os + warp * kRowsPerWarp * L.ld_o;
    for (int e = lane; e < kRowsPerWarp * dp; e += 32) {
      const int r = e / dp, c = e % dp;
      o_w[r * L.ld_o + c] *= alpha_s[warp * kRowsPerWarp + r];
    }
    __syncwarp();
    if constexpr (E::kMma) {
      using namespace nvcuda;
      for (int n = 0; n < dp; n += kFrag) {
        wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
        wmma::load_matrix_sync(acc, o_w + n, L.ld_o, wmma::mem_row_major);
        for (int kk = 0; kk < kBlockN; kk += kFrag) {
          wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, D, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, D, wmma::row_major> bf;
          wmma::load_matrix_sync(a, ps + warp * kRowsPerWarp * L.ld_p + kk, L.ld_p);
          wmma::load_matrix_sync(bf, vs + kk * L.ld_in + n, L.ld_in);
          wmma::mma_sync(acc, a, bf, acc);
        }
        wmma::store_matrix_sync(o_w + n, acc, L.ld_o, wmma::mem_row_major);
      }
    } else {
      for (int e = lane; e < kRowsPerWarp * d; e += 32) {
        const int r = e / d, c = e % d;
        const float* prow = s_w + r * L.ld_s;
        float acc = o_w[r * L.ld_o + c];
        for (int j = 0; j < kBlockN; ++j) acc = fmaf(prow[j], E::to_float(vs[j * L.ld_in + c]), acc);
        o_w[r * L.ld_o + c] = acc;
      }
    }
    __syncthreads();  // K, V, S and P are overwritten by the next tile
  }

  // Normalise and write; a query that saw nothing gets zeros and lse = -inf.
  D* out = static_cast<D*>(p.out);
  for (int i = tid; i < kBlockM * d; i += kThreads) {
    const int r = i / d, c = i % d;
    const int64_t qi = q0 + r;
    if (qi >= p.nq) continue;
    const float l = l_s[r];
    const float val = l != 0.0f ? os[r * L.ld_o + c] / l : 0.0f;
    out[(bh * p.nq + qi) * p.d + c] = E::from_float(val);
  }
  for (int r = tid; r < kBlockM; r += kThreads) {
    const int64_t qi = q0 + r;
    if (qi >= p.nq) continue;
    const float l = l_s[r];
    p.lse[bh * p.nq + qi] = l != 0.0f ? (m_s[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
}

template <typename T>
void launch(const Params& p, int64_t b, cudaStream_t stream) {
  using D = typename Elem<T>::dev;
  const Layout L = make_layout<D, Elem<T>::kMma>(static_cast<int>(p.d));
  auto kernel = tree_attention_kernel<T>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(L.bytes)));
  const dim3 grid(static_cast<unsigned>((p.nq + kBlockM - 1) / kBlockM), static_cast<unsigned>(b * p.hq));
  kernel<<<grid, kThreads, L.bytes, stream>>>(p);
}

}  // namespace

AttentionOut tree_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_pos, const at::Tensor& kv_pos,
                                 const std::optional<at::Tensor>& kv_valid,
                                 const std::optional<at::Tensor>& tree_mask, std::optional<double> scale) {
  check_tree_attention_args(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale);
  TORCH_CHECK_VALUE(q.is_cuda(), "tree_attention_cuda needs CUDA tensors, got ", q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t b = q.size(0);
  AttentionSetup setup = setup_tree_attention(q, k, v, q_pos, kv_pos, kv_valid, tree_mask, scale);
  if (setup.out.numel() == 0) return {setup.out, setup.lse};
  const Params& p = setup.problem;

  auto stream = c10::cuda::getCurrentCUDAStream();
  switch (q.scalar_type()) {
    case at::kHalf: launch<c10::Half>(p, b, stream); break;
    case at::kBFloat16: launch<c10::BFloat16>(p, b, stream); break;
    default: launch<float>(p, b, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {setup.out, setup.lse};
}

}  // namespace specdec
