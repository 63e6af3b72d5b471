// Exact scalar FlashAttention-2 backward pass for float32 and float64 (Dao 2023, Algorithm 2),
// split into two deterministic kernels that need no atomics:
//   dK/dV: a block owns a tile of keys of one (batch, kv head) and loops over the query heads of
//          its GQA group and their query tiles, so the group sum stays in registers;
//   dQ:    a block owns a tile of queries of one (batch, query head) and loops over key tiles.
// Both recompute P = exp(scale * Q K^T - lse) and dS = P * (dO V^T - delta) for each tile pair.
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/simt_common.cuh"

namespace jax_flash::cuda {
namespace simt {
namespace {

// Derived constants of a backward tile (see BwdTile). "Resident" rows stay in shared memory for
// the whole block, "streamed" rows are replaced every step.
template <typename T, int kCap>
struct BwdConfig {
  static constexpr int kRows = BwdTile<T, kCap>::kRows;
  static constexpr int kCols = BwdTile<T, kCap>::kCols;
  static constexpr int kThreads = BwdTile<T, kCap>::kThreads;
  static constexpr int kScoreLanes = BwdTile<T, kCap>::kScoreLanes;
  static constexpr int kAccLanes = BwdTile<T, kCap>::kAccLanes;
  static constexpr int kVecN = kVec<T>;
  static constexpr int kScoreRows = kRows / (kThreads / kScoreLanes);
  static constexpr int kScoreCols = kCols / kScoreLanes;
  static constexpr int kAccRows = kRows / (kThreads / kAccLanes);
  static constexpr int kChunkSpan = kAccLanes * kVecN;
  static constexpr int kDimChunks = kCap / kChunkSpan;
  static constexpr int kDimsPerThread = kDimChunks * kVecN;
  static constexpr int kStride = kCap + kVecN;    // rows of Q, dO, K, V
  static constexpr int kPStride = kCols + kVecN;  // rows of P and dS, indexed [resident][streamed]
  static constexpr size_t kOperandElems = 2 * static_cast<size_t>(kRows + kCols) * kStride;
  static constexpr size_t kScoreElems = static_cast<size_t>(kRows) * kPStride;
  // dK/dV kernel: K, V, Q, dO, P^T, dS^T, then lse and delta of the streamed queries.
  static constexpr size_t kSmemDkDv = sizeof(T) * (kOperandElems + 2 * kScoreElems + 2 * kCols);
  // dQ kernel: Q, dO, K, V, dS, then lse and delta of the resident queries.
  static constexpr size_t kSmemDq = sizeof(T) * (kOperandElems + kScoreElems + 2 * kRows);

  static_assert(kThreads % kScoreLanes == 0 && kThreads % kAccLanes == 0);
  static_assert(kRows % (kThreads / kScoreLanes) == 0 && kCols % kScoreLanes == 0);
  static_assert(kRows % (kThreads / kAccLanes) == 0 && kCols % kVecN == 0);
  static_assert(kCap % kChunkSpan == 0 && kDimChunks >= 1);
  static_assert(kSmemDkDv <= 99 * 1024 && kSmemDq <= 99 * 1024,
                "must fit the opt-in shared memory of every sm_8x");
};

// X = A B^T and Y = A2 B2^T for a thread's kScoreRows resident rows (consecutive, from row0)
// against its kScoreCols streamed rows (col0, col0 + kScoreLanes, ...), over the first k_vecs
// vectors of the head dim.
template <typename T, int kCap>
__device__ __forceinline__ void score_tiles(
    T (&x)[BwdConfig<T, kCap>::kScoreRows][BwdConfig<T, kCap>::kScoreCols],
    T (&y)[BwdConfig<T, kCap>::kScoreRows][BwdConfig<T, kCap>::kScoreCols], const T* a, const T* a2,
    const T* b, const T* b2, int row0, int col0, int k_vecs) {
  using C = BwdConfig<T, kCap>;
  constexpr int kR = C::kScoreRows;
  constexpr int kC = C::kScoreCols;
  constexpr int kV = C::kVecN;
#pragma unroll
  for (int i = 0; i < kR; ++i) {
#pragma unroll
    for (int j = 0; j < kC; ++j) {
      x[i][j] = T(0);
      y[i][j] = T(0);
    }
  }
#pragma unroll 1
  for (int kv = 0; kv < k_vecs; ++kv) {
    Vec<T> ra[kR], ra2[kR], cb[kC], cb2[kC];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      ra[i] = load_vec(a + (row0 + i) * C::kStride + kv * kV);
      ra2[i] = load_vec(a2 + (row0 + i) * C::kStride + kv * kV);
    }
#pragma unroll
    for (int j = 0; j < kC; ++j) {
      cb[j] = load_vec(b + (col0 + j * C::kScoreLanes) * C::kStride + kv * kV);
      cb2[j] = load_vec(b2 + (col0 + j * C::kScoreLanes) * C::kStride + kv * kV);
    }
#pragma unroll
    for (int i = 0; i < kR; ++i) {
#pragma unroll
      for (int j = 0; j < kC; ++j) {
#pragma unroll
        for (int e = 0; e < kV; ++e) {
          x[i][j] = fma(ra[i].v[e], cb[j].v[e], x[i][j]);
          y[i][j] = fma(ra2[i].v[e], cb2[j].v[e], y[i][j]);
        }
      }
    }
  }
}

// P and dS of one score entry from the raw dot products x = q.k and y = dO.v. `ok` is false for
// masked entries, padded rows and queries whose lse is -inf (fully masked rows): those give exact
// zeros and never evaluate exp(-inf + inf). The logit is rounded exactly as in the forward pass
// (scaled_logit).
template <typename T>
__device__ __forceinline__ void softmax_grad(T x, T y, T scale, T lse, T delta, bool ok, T& p,
                                             T& ds) {
  p = ok ? exp_full(scaled_logit(x, scale) - lse) : T(0);
  ds = ok ? p * (y - delta) : T(0);
}

// Writes scale * acc for the thread's kAccRows rows (from row0) and head-dim columns.
template <typename T, int kCap>
__device__ __forceinline__ void store_rows(
    T* out, int64_t row_stride,
    const T (&acc)[BwdConfig<T, kCap>::kAccRows][BwdConfig<T, kCap>::kDimsPerThread], T scale,
    int row0, int rows_valid, int lane, int d) {
  using C = BwdConfig<T, kCap>;
#pragma unroll
  for (int i = 0; i < C::kAccRows; ++i) {
    if (row0 + i >= rows_valid) continue;
    T* row = out + (row0 + i) * row_stride;
#pragma unroll
    for (int ch = 0; ch < C::kDimChunks; ++ch) {
#pragma unroll
      for (int f = 0; f < C::kVecN; ++f) {
        const int col = ch * C::kChunkSpan + lane * C::kVecN + f;
        if (col < d) row[col] = acc[i][ch * C::kVecN + f] * scale;
      }
    }
  }
}

template <typename T, int kCap>
__global__ void __launch_bounds__(BwdConfig<T, kCap>::kThreads)
    dkdv_kernel(const BwdParams p, int64_t num_n_tiles) {
  using C = BwdConfig<T, kCap>;
  constexpr int kV = C::kVecN;
  constexpr int kAR = C::kAccRows;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + C::kRows * C::kStride;
  T* q_s = v_s + C::kRows * C::kStride;
  T* do_s = q_s + C::kCols * C::kStride;
  T* p_s = do_s + C::kCols * C::kStride;   // P^T: [key][query]
  T* ds_s = p_s + C::kRows * C::kPStride;  // dS^T: [key][query]
  T* lse_s = ds_s + C::kRows * C::kPStride;
  T* delta_s = lse_s + C::kCols;

  const int tid = static_cast<int>(threadIdx.x);
  const int score_row0 = (tid / C::kScoreLanes) * C::kScoreRows;
  const int score_col0 = tid % C::kScoreLanes;
  const int acc_row0 = (tid / C::kAccLanes) * kAR;
  const int acc_lane = tid % C::kAccLanes;

  // Under causal masking the first key tiles are seen by the most query tiles: schedule them first.
  const int64_t tile = blockIdx.x;
  const int64_t n_tile = tile % num_n_tiles;
  const int64_t h_kv = (tile / num_n_tiles) % p.heads_kv;
  const int64_t b = (tile / num_n_tiles) / p.heads_kv;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n0 = n_tile * C::kRows;
  const int n_rows = static_cast<int>(p.seqlen_k - n0 < C::kRows ? p.seqlen_k - n0 : C::kRows);
  const int d = static_cast<int>(p.head_dim);
  const int k_vecs = (d + kV - 1) / kV;
  const T scale = static_cast<T>(p.softmax_scale);

  const int64_t q_row_stride = p.heads_q * p.head_dim;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const int64_t kv_offset = ((b * p.seqlen_k + n0) * p.heads_kv + h_kv) * p.head_dim;
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      k_s, static_cast<const T*>(p.k) + kv_offset, kv_row_stride, n_rows, d);
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      v_s, static_cast<const T*>(p.v) + kv_offset, kv_row_stride, n_rows, d);

  T dk[kAR][C::kDimsPerThread];
  T dv[kAR][C::kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kAR; ++i) {
#pragma unroll
    for (int x = 0; x < C::kDimsPerThread; ++x) {
      dk[i][x] = T(0);
      dv[i][x] = T(0);
    }
  }

  // Query tiles that end before the first query seeing key n0 see none of this tile's keys.
  const int64_t m_first =
      first_visible_query(n0, p.seqlen_q, p.seqlen_k, p.causal) / C::kCols * C::kCols;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = h_kv * group + g;
    for (int64_t m0 = m_first; m0 < p.seqlen_q; m0 += C::kCols) {
      const int m_rows = static_cast<int>(p.seqlen_q - m0 < C::kCols ? p.seqlen_q - m0 : C::kCols);
      const int64_t q_offset = ((b * p.seqlen_q + m0) * p.heads_q + h) * p.head_dim;
      const int64_t stat_offset = (b * p.heads_q + h) * p.seqlen_q + m0;
      load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(
          q_s, static_cast<const T*>(p.q) + q_offset, q_row_stride, m_rows, d);
      load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(
          do_s, static_cast<const T*>(p.dout) + q_offset, q_row_stride, m_rows, d);
      load_row_stat<T, C::kThreads, C::kCols>(lse_s, static_cast<const T*>(p.lse) + stat_offset,
                                              m_rows, neg_inf<T>());
      load_row_stat<T, C::kThreads, C::kCols>(delta_s, static_cast<const T*>(p.delta) + stat_offset,
                                              m_rows, T(0));
      cp_async_wait_all();
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T; key row r sees query column c iff r <= c + diag.
      T x[C::kScoreRows][C::kScoreCols];
      T y[C::kScoreRows][C::kScoreCols];
      score_tiles<T, kCap>(x, y, k_s, v_s, q_s, do_s, score_row0, score_col0, k_vecs);
      const int diag = causal_diag(m0, n0, p.seqlen_q, p.seqlen_k, p.causal);
#pragma unroll
      for (int j = 0; j < C::kScoreCols; ++j) {
        const int c = score_col0 + j * C::kScoreLanes;
        const T lse = lse_s[c];
        const T delta = delta_s[c];
#pragma unroll
        for (int i = 0; i < C::kScoreRows; ++i) {
          const int r = score_row0 + i;
          const bool ok = r < n_rows && c < m_rows && r <= c + diag && lse != neg_inf<T>();
          T pij, dsij;
          softmax_grad(x[i][j], y[i][j], scale, lse, delta, ok, pij, dsij);
          p_s[r * C::kPStride + c] = pij;
          ds_s[r * C::kPStride + c] = dsij;
        }
      }
      __syncthreads();

      // dV += P^T dO and dK += dS^T Q. Padded queries have P = dS = 0 and zero-filled rows, so
      // rounding the trip count up to a whole vector adds exact zeros.
      const int m_lim = (m_rows + kV - 1) / kV * kV;
#pragma unroll 1
      for (int m = 0; m < m_lim; m += kV) {
        Vec<T> pa[kAR], da[kAR];
#pragma unroll
        for (int i = 0; i < kAR; ++i) {
          pa[i] = load_vec(p_s + (acc_row0 + i) * C::kPStride + m);
          da[i] = load_vec(ds_s + (acc_row0 + i) * C::kPStride + m);
        }
#pragma unroll
        for (int e = 0; e < kV; ++e) {
          const T* do_row = do_s + (m + e) * C::kStride + acc_lane * kV;
          const T* q_row = q_s + (m + e) * C::kStride + acc_lane * kV;
#pragma unroll
          for (int ch = 0; ch < C::kDimChunks; ++ch) {
            if (ch * C::kChunkSpan < d) {
              const Vec<T> vo = load_vec(do_row + ch * C::kChunkSpan);
              const Vec<T> vq = load_vec(q_row + ch * C::kChunkSpan);
#pragma unroll
              for (int i = 0; i < kAR; ++i) {
#pragma unroll
                for (int f = 0; f < kV; ++f) {
                  dv[i][ch * kV + f] = fma(pa[i].v[e], vo.v[f], dv[i][ch * kV + f]);
                  dk[i][ch * kV + f] = fma(da[i].v[e], vq.v[f], dk[i][ch * kV + f]);
                }
              }
            }
          }
        }
      }
      // The next step overwrites Q, dO, P^T, dS^T and the statistics.
      __syncthreads();
    }
  }

  // Without any query tile the K and V copies are still in flight; they must land first.
  cp_async_wait_all();
  const int64_t out_offset = ((b * p.seqlen_k + n0) * p.heads_kv + h_kv) * p.head_dim;
  store_rows<T, kCap>(static_cast<T*>(p.dk) + out_offset, kv_row_stride, dk, scale, acc_row0,
                      n_rows, acc_lane, d);
  store_rows<T, kCap>(static_cast<T*>(p.dv) + out_offset, kv_row_stride, dv, T(1), acc_row0, n_rows,
                      acc_lane, d);
}

template <typename T, int kCap>
__global__ void __launch_bounds__(BwdConfig<T, kCap>::kThreads)
    dq_kernel(const BwdParams p, int64_t num_m_tiles) {
  using C = BwdConfig<T, kCap>;
  constexpr int kV = C::kVecN;
  constexpr int kAR = C::kAccRows;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* do_s = q_s + C::kRows * C::kStride;
  T* k_s = do_s + C::kRows * C::kStride;
  T* v_s = k_s + C::kCols * C::kStride;
  T* ds_s = v_s + C::kCols * C::kStride;  // dS: [query][key]
  T* lse_s = ds_s + C::kRows * C::kPStride;
  T* delta_s = lse_s + C::kRows;

  const int tid = static_cast<int>(threadIdx.x);
  const int score_row0 = (tid / C::kScoreLanes) * C::kScoreRows;
  const int score_col0 = tid % C::kScoreLanes;
  const int acc_row0 = (tid / C::kAccLanes) * kAR;
  const int acc_lane = tid % C::kAccLanes;

  // Heaviest causal tiles (the last query rows) are scheduled first.
  const int64_t tile = blockIdx.x;
  const int64_t m_tile = num_m_tiles - 1 - tile % num_m_tiles;
  const int64_t h = (tile / num_m_tiles) % p.heads_q;
  const int64_t b = (tile / num_m_tiles) / p.heads_q;
  const int64_t h_kv = h / (p.heads_q / p.heads_kv);
  const int64_t m0 = m_tile * C::kRows;
  const int m_rows = static_cast<int>(p.seqlen_q - m0 < C::kRows ? p.seqlen_q - m0 : C::kRows);
  const int d = static_cast<int>(p.head_dim);
  const int k_vecs = (d + kV - 1) / kV;
  const T scale = static_cast<T>(p.softmax_scale);

  const int64_t q_row_stride = p.heads_q * p.head_dim;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const int64_t q_offset = ((b * p.seqlen_q + m0) * p.heads_q + h) * p.head_dim;
  const int64_t stat_offset = (b * p.heads_q + h) * p.seqlen_q + m0;
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      q_s, static_cast<const T*>(p.q) + q_offset, q_row_stride, m_rows, d);
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      do_s, static_cast<const T*>(p.dout) + q_offset, q_row_stride, m_rows, d);
  load_row_stat<T, C::kThreads, C::kRows>(lse_s, static_cast<const T*>(p.lse) + stat_offset, m_rows,
                                          neg_inf<T>());
  load_row_stat<T, C::kThreads, C::kRows>(delta_s, static_cast<const T*>(p.delta) + stat_offset,
                                          m_rows, T(0));

  T dq[kAR][C::kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kAR; ++i) {
#pragma unroll
    for (int x = 0; x < C::kDimsPerThread; ++x) dq[i][x] = T(0);
  }

  const T* k = static_cast<const T*>(p.k) + (b * p.seqlen_k * p.heads_kv + h_kv) * p.head_dim;
  const T* v = static_cast<const T*>(p.v) + (b * p.seqlen_k * p.heads_kv + h_kv) * p.head_dim;
  const int64_t n_end = visible_key_end(m0 + m_rows, p.seqlen_q, p.seqlen_k, p.causal);
  for (int64_t n0 = 0; n0 < n_end; n0 += C::kCols) {
    const int n_rows = static_cast<int>(n_end - n0 < C::kCols ? n_end - n0 : C::kCols);
    load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(k_s, k + n0 * kv_row_stride,
                                                                kv_row_stride, n_rows, d);
    load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(v_s, v + n0 * kv_row_stride,
                                                                kv_row_stride, n_rows, d);
    cp_async_wait_all();
    __syncthreads();

    // S = Q K^T and dP = dO V^T; query row r sees key column c iff c <= r + diag.
    T x[C::kScoreRows][C::kScoreCols];
    T y[C::kScoreRows][C::kScoreCols];
    score_tiles<T, kCap>(x, y, q_s, do_s, k_s, v_s, score_row0, score_col0, k_vecs);
    const int diag = causal_diag(m0, n0, p.seqlen_q, p.seqlen_k, p.causal);
#pragma unroll
    for (int i = 0; i < C::kScoreRows; ++i) {
      const int r = score_row0 + i;
      const T lse = lse_s[r];
      const T delta = delta_s[r];
#pragma unroll
      for (int j = 0; j < C::kScoreCols; ++j) {
        const int c = score_col0 + j * C::kScoreLanes;
        const bool ok = r < m_rows && c < n_rows && c <= r + diag && lse != neg_inf<T>();
        T pij, dsij;
        softmax_grad(x[i][j], y[i][j], scale, lse, delta, ok, pij, dsij);
        ds_s[r * C::kPStride + c] = dsij;
      }
    }
    __syncthreads();

    // dQ += dS K; padded keys have dS = 0 and zero-filled K rows.
    accumulate_rows<T, kAR, C::kDimChunks, C::kChunkSpan, C::kPStride, C::kStride>(
        dq, ds_s, k_s, acc_row0, acc_lane, (n_rows + kV - 1) / kV * kV, d);
    // The next step overwrites K, V and dS.
    __syncthreads();
  }

  // Without any key tile the Q and dO copies are still in flight; they must land first.
  cp_async_wait_all();
  store_rows<T, kCap>(static_cast<T*>(p.dq) + q_offset, q_row_stride, dq, scale, acc_row0, m_rows,
                      acc_lane, d);
}

template <typename T, int kCap>
cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream) {
  using C = BwdConfig<T, kCap>;
  const int64_t num_n_tiles = (params.seqlen_k + C::kRows - 1) / C::kRows;
  cudaError_t err = launch(dkdv_kernel<T, kCap>, num_n_tiles * params.heads_kv * params.batch,
                           C::kThreads, C::kSmemDkDv, stream, params, num_n_tiles);
  if (err != cudaSuccess) return err;
  const int64_t num_m_tiles = (params.seqlen_q + C::kRows - 1) / C::kRows;
  return launch(dq_kernel<T, kCap>, num_m_tiles * params.heads_q * params.batch, C::kThreads,
                C::kSmemDq, stream, params, num_m_tiles);
}

}  // namespace
}  // namespace simt

cudaError_t bwd_simt(const BwdParams& params, DType dtype, cudaStream_t stream) {
  return simt::dispatch(params, dtype, [&](auto zero, auto cap) {
    return simt::launch_bwd<decltype(zero), decltype(cap)::value>(params, stream);
  });
}

}  // namespace jax_flash::cuda
