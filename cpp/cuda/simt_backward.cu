// Exact scalar FlashAttention-2 backward pass for float32 and float64 (Dao 2023, Algorithm 2),
// split into two deterministic kernels that need no atomics:
//   dK/dV: a block owns a tile of keys of one (sequence, kv head) and loops over the query heads
//          of its GQA group and the query tiles that may see its keys, so the group sum stays in
//          registers;
//   dQ:    a block owns a tile of queries of one (sequence, query head) and loops over the key
//          tiles it may see.
// Both recompute P = exp(S - lse) and dS = P * (dO V^T - delta) for each tile pair, with S the
// forward's scores (Score: scaled, optionally soft-capped). Tiles come from the shared scheduler
// (common/schedule.h) and masks from the shared policy (common/mask.h); interior tile pairs skip
// the element test, pairs of disjoint segments are skipped.
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
  static constexpr size_t kIdBytes = sizeof(int32_t) * (kRows + kCols);
  // dK/dV kernel: the block's SeqSpan, then K, V, Q, dO, P^T, dS^T, lse and delta of the
  // streamed queries, then the segment ids of the resident keys and of the streamed queries.
  static constexpr size_t kSpanBytes = sizeof(SeqSpan);
  static constexpr size_t kSmemDkDv =
      kSpanBytes + sizeof(T) * (kOperandElems + 2 * kScoreElems + 2 * kCols) + kIdBytes;
  // dQ kernel: Q, dO, K, V, dS, lse and delta of the resident queries, then the segment ids of
  // the resident queries and of the streamed keys.
  static constexpr size_t kSmemDq =
      sizeof(T) * (kOperandElems + kScoreElems + 2 * kRows) + kIdBytes;
  static constexpr int kMinBlocksDkDv = blocks_per_sm(kSmemDkDv);
  static constexpr int kMinBlocksDq = blocks_per_sm(kSmemDq);

  static_assert(kThreads % kScoreLanes == 0 && kThreads % kAccLanes == 0);
  static_assert(kRows % (kThreads / kScoreLanes) == 0 && kCols % kScoreLanes == 0);
  static_assert(kRows % (kThreads / kAccLanes) == 0 && kCols % kVecN == 0);
  static_assert(kCap % kChunkSpan == 0 && kDimChunks >= 1);
  static_assert(kSpanBytes % 16 == 0, "keeps the tiles after the span 16-byte aligned");
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
// masked entries, padded rows and queries whose lse is -inf (rows without keys): those give exact
// zeros, by select, and never evaluate exp(-inf + inf). The logit is the forward's bit for bit
// (Score). dS is with respect to the capped score's argument scale * q.k: with soft-capping the
// chain factor d(cap * tanh(u / cap)) / du = 1 - t^2.
template <typename T, bool kSoftcap>
__device__ __forceinline__ void softmax_grad(T x, T y, const Score<T, kSoftcap>& score, T lse,
                                             T delta, bool ok, T& p, T& ds) {
  T t;
  const T s = score(x, t);
  p = ok ? exp_full(s - lse) : T(0);
  T g = p * (y - delta);
  if constexpr (kSoftcap) g *= fma(-t, t, T(1));
  ds = ok ? g : T(0);
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

template <typename T, int kCap, bool kSoftcap>
__global__ void __launch_bounds__(BwdConfig<T, kCap>::kThreads, BwdConfig<T, kCap>::kMinBlocksDkDv)
    dkdv_kernel(const BwdParams p) {
  using C = BwdConfig<T, kCap>;
  constexpr int kV = C::kVecN;
  constexpr int kAR = C::kAccRows;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  SeqSpan* span_s = reinterpret_cast<SeqSpan*>(smem_raw);
  T* k_s = reinterpret_cast<T*>(smem_raw + C::kSpanBytes);
  T* v_s = k_s + C::kRows * C::kStride;
  T* q_s = v_s + C::kRows * C::kStride;
  T* do_s = q_s + C::kCols * C::kStride;
  T* p_s = do_s + C::kCols * C::kStride;   // P^T: [key][query]
  T* ds_s = p_s + C::kRows * C::kPStride;  // dS^T: [key][query]
  T* lse_s = ds_s + C::kRows * C::kPStride;
  T* delta_s = lse_s + C::kCols;
  int32_t* k_id_s = reinterpret_cast<int32_t*>(delta_s + C::kCols);
  int32_t* q_id_s = k_id_s + C::kRows;

  const int tid = static_cast<int>(threadIdx.x);
  const int score_row0 = (tid / C::kScoreLanes) * C::kScoreRows;
  const int score_col0 = tid % C::kScoreLanes;
  const int acc_row0 = (tid / C::kAccLanes) * kAR;
  const int acc_lane = tid % C::kAccLanes;

  // Key tiles run in order: under a causal mask the first key tiles of a sequence are seen by the
  // most query tiles, so the heaviest blocks start first. Heads vary fastest, as in the forward.
  const int64_t block = blockIdx.x;
  const int64_t h_kv = block % p.heads_kv;
  const SeqTile tile = p.layout.tile(block / p.heads_kv, C::kRows, /*keys=*/true);
  if (tile.empty(C::kRows, true)) return;
  // The span is read from shared memory: each barrier forces its reload where it is used, once
  // per query tile, instead of keeping its 64-bit fields of a packed call (which, unlike a dense
  // call's, cannot be recomputed from the params) live in registers across the loops.
  if (tid == 0) *span_s = tile.span;
  __syncthreads();
  const SeqSpan& span = *span_s;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n0 = tile.block * C::kRows;
  const int n_rows = tile_rows(span.len_k - n0, C::kRows);
  const int d = static_cast<int>(p.head_dim);
  const int k_vecs = (d + kV - 1) / kV;
  const T scale = static_cast<T>(p.softmax_scale);
  const Score<T, kSoftcap> score = Score<T, kSoftcap>::of(p.softmax_scale, p.mask.softcap);

  const int64_t q_row_stride = p.heads_q * p.head_dim;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const int64_t kv_offset = ((span.k_start + n0) * p.heads_kv + h_kv) * p.head_dim;
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      k_s, static_cast<const T*>(p.k) + kv_offset, kv_row_stride, n_rows, d);
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      v_s, static_cast<const T*>(p.v) + kv_offset, kv_row_stride, n_rows, d);
  const SeqSegments seg = seq_segments(p.mask.segments, span);
  if (seg.enabled()) load_ids<C::kThreads, C::kRows>(k_id_s, seg.kv_ids + n0, n_rows);

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

  // Only the query rows [row_begin, row_end) may see a key of this tile (none for the keys of
  // the padding span, which get dK = dV = 0).
  const SeqMask band = p.mask.band.for_seq(span.len_q, span.len_k);
  const int64_t m_begin = band.row_begin(n0);
  const int64_t m_end = band.row_end(n0 + n_rows);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = h_kv * group + g;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += C::kCols) {
      const int m_rows = tile_rows(m_end - m0, C::kCols);
      const PairMask pm = pair_mask(band, seg, m0, m0 + m_rows, n0, n0 + n_rows);
      if (pm.skip) continue;
      const int64_t q_offset = ((span.q_start + m0) * p.heads_q + h) * p.head_dim;
      const int64_t stat_offset = span.stat_start + h * span.stat_head + m0;
      load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(
          q_s, static_cast<const T*>(p.q) + q_offset, q_row_stride, m_rows, d);
      load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(
          do_s, static_cast<const T*>(p.dout) + q_offset, q_row_stride, m_rows, d);
      load_row_stat<T, C::kThreads, C::kCols>(lse_s, static_cast<const T*>(p.lse) + stat_offset,
                                              m_rows, neg_inf<T>());
      load_row_stat<T, C::kThreads, C::kCols>(delta_s, static_cast<const T*>(p.delta) + stat_offset,
                                              m_rows, T(0));
      if (pm.ids) load_ids<C::kThreads, C::kCols>(q_id_s, seg.q_ids + m0, m_rows);
      cp_async_wait_all();
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T for key rows r and query columns c. Padded query columns
      // have lse = -inf, so even interior pairs exclude them; padded key rows only feed dK and
      // dV rows that are never stored.
      T x[C::kScoreRows][C::kScoreCols];
      T y[C::kScoreRows][C::kScoreCols];
      score_tiles<T, kCap>(x, y, k_s, v_s, q_s, do_s, score_row0, score_col0, k_vecs);
      const TileMask tm = loaded_tile_mask(band, m0, n0, n_rows);
#pragma unroll
      for (int j = 0; j < C::kScoreCols; ++j) {
        const int c = score_col0 + j * C::kScoreLanes;
        const T lse = lse_s[c];
        const T delta = delta_s[c];
#pragma unroll
        for (int i = 0; i < C::kScoreRows; ++i) {
          const int r = score_row0 + i;
          const bool visible = pm.full || (tm.visible(c, r) && (!pm.ids || q_id_s[c] == k_id_s[r]));
          T pij, dsij;
          softmax_grad(x[i][j], y[i][j], score, lse, delta, visible && lse != neg_inf<T>(), pij,
                       dsij);
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
      // The next step overwrites Q, dO, P^T, dS^T, the statistics and the query ids.
      __syncthreads();
    }
  }

  // Without any query tile the K and V copies are still in flight; they must land first.
  cp_async_wait_all();
  store_rows<T, kCap>(static_cast<T*>(p.dk) + kv_offset, kv_row_stride, dk, scale, acc_row0, n_rows,
                      acc_lane, d);
  store_rows<T, kCap>(static_cast<T*>(p.dv) + kv_offset, kv_row_stride, dv, T(1), acc_row0, n_rows,
                      acc_lane, d);
}

template <typename T, int kCap, bool kSoftcap>
__global__ void __launch_bounds__(BwdConfig<T, kCap>::kThreads, BwdConfig<T, kCap>::kMinBlocksDq)
    dq_kernel(const BwdParams p) {
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
  int32_t* q_id_s = reinterpret_cast<int32_t*>(delta_s + C::kRows);
  int32_t* k_id_s = q_id_s + C::kRows;

  const int tid = static_cast<int>(threadIdx.x);
  const int score_row0 = (tid / C::kScoreLanes) * C::kScoreRows;
  const int score_col0 = tid % C::kScoreLanes;
  const int acc_row0 = (tid / C::kAccLanes) * kAR;
  const int acc_lane = tid % C::kAccLanes;

  // Query tiles run last-first and heads vary fastest, as in the forward.
  const int64_t block = blockIdx.x;
  const int64_t h = block % p.heads_q;
  const SeqTile tile = p.layout.tile(p.layout.tiles(C::kRows, false) - 1 - block / p.heads_q,
                                     C::kRows, /*keys=*/false);
  if (tile.empty(C::kRows, false)) return;
  const SeqSpan& span = tile.span;
  const int64_t h_kv = h / (p.heads_q / p.heads_kv);
  const int64_t m0 = tile.block * C::kRows;
  const int m_rows = tile_rows(span.len_q - m0, C::kRows);
  const int d = static_cast<int>(p.head_dim);
  const int k_vecs = (d + kV - 1) / kV;
  const T scale = static_cast<T>(p.softmax_scale);
  const Score<T, kSoftcap> score = Score<T, kSoftcap>::of(p.softmax_scale, p.mask.softcap);

  const int64_t q_row_stride = p.heads_q * p.head_dim;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const int64_t q_offset = ((span.q_start + m0) * p.heads_q + h) * p.head_dim;
  const int64_t stat_offset = span.stat_start + h * span.stat_head + m0;
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      q_s, static_cast<const T*>(p.q) + q_offset, q_row_stride, m_rows, d);
  load_tile_async<T, C::kThreads, C::kRows, kCap, C::kStride>(
      do_s, static_cast<const T*>(p.dout) + q_offset, q_row_stride, m_rows, d);
  load_row_stat<T, C::kThreads, C::kRows>(lse_s, static_cast<const T*>(p.lse) + stat_offset, m_rows,
                                          neg_inf<T>());
  load_row_stat<T, C::kThreads, C::kRows>(delta_s, static_cast<const T*>(p.delta) + stat_offset,
                                          m_rows, T(0));
  const SeqSegments seg = seq_segments(p.mask.segments, span);
  if (seg.enabled()) load_ids<C::kThreads, C::kRows>(q_id_s, seg.q_ids + m0, m_rows);

  T dq[kAR][C::kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kAR; ++i) {
#pragma unroll
    for (int x = 0; x < C::kDimsPerThread; ++x) dq[i][x] = T(0);
  }

  const int64_t kv_offset = (span.k_start * p.heads_kv + h_kv) * p.head_dim;
  const T* k = static_cast<const T*>(p.k) + kv_offset;
  const T* v = static_cast<const T*>(p.v) + kv_offset;
  const SeqMask band = p.mask.band.for_seq(span.len_q, span.len_k);
  const int64_t n_end = band.key_end(m0 + m_rows);
  for (int64_t n0 = band.key_begin(m0); n0 < n_end; n0 += C::kCols) {
    const int n_rows = tile_rows(n_end - n0, C::kCols);
    const PairMask pm = pair_mask(band, seg, m0, m0 + m_rows, n0, n0 + n_rows);
    if (pm.skip) continue;
    load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(k_s, k + n0 * kv_row_stride,
                                                                kv_row_stride, n_rows, d);
    load_tile_async<T, C::kThreads, C::kCols, kCap, C::kStride>(v_s, v + n0 * kv_row_stride,
                                                                kv_row_stride, n_rows, d);
    if (pm.ids) load_ids<C::kThreads, C::kCols>(k_id_s, seg.kv_ids + n0, n_rows);
    cp_async_wait_all();
    __syncthreads();

    // S = Q K^T and dP = dO V^T. Padded query rows have lse = -inf; zero-filled keys past n_rows
    // must be masked (their dS would multiply zero K rows, but need not be finite), so only
    // a whole key tile takes the interior path.
    T x[C::kScoreRows][C::kScoreCols];
    T y[C::kScoreRows][C::kScoreCols];
    score_tiles<T, kCap>(x, y, q_s, do_s, k_s, v_s, score_row0, score_col0, k_vecs);
    const bool full = pm.full && n_rows == C::kCols;
    const TileMask tm = loaded_tile_mask(band, m0, n0, n_rows);
#pragma unroll
    for (int i = 0; i < C::kScoreRows; ++i) {
      const int r = score_row0 + i;
      const T lse = lse_s[r];
      const T delta = delta_s[r];
#pragma unroll
      for (int j = 0; j < C::kScoreCols; ++j) {
        const int c = score_col0 + j * C::kScoreLanes;
        const bool visible = full || (tm.visible(r, c) && (!pm.ids || q_id_s[r] == k_id_s[c]));
        T pij, dsij;
        softmax_grad(x[i][j], y[i][j], score, lse, delta, visible && lse != neg_inf<T>(), pij,
                     dsij);
        ds_s[r * C::kPStride + c] = dsij;
      }
    }
    __syncthreads();

    // dQ += dS K; padded keys have dS = 0 and zero-filled K rows.
    accumulate_rows<T, kAR, C::kDimChunks, C::kChunkSpan, C::kPStride, C::kStride>(
        dq, ds_s, k_s, acc_row0, acc_lane, (n_rows + kV - 1) / kV * kV, d);
    // The next step overwrites K, V, dS and the key ids.
    __syncthreads();
  }

  // Without any key tile the Q and dO copies are still in flight; they must land first.
  cp_async_wait_all();
  store_rows<T, kCap>(static_cast<T*>(p.dq) + q_offset, q_row_stride, dq, scale, acc_row0, m_rows,
                      acc_lane, d);
}

template <typename T, int kCap, bool kSoftcap>
cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream) {
  using C = BwdConfig<T, kCap>;
  const SeqLayout& l = params.layout;
  cudaError_t err =
      launch(dkdv_kernel<T, kCap, kSoftcap>, l.tiles(C::kRows, /*keys=*/true) * params.heads_kv,
             C::kThreads, C::kSmemDkDv, stream, params);
  if (err != cudaSuccess) return err;
  return launch(dq_kernel<T, kCap, kSoftcap>, l.tiles(C::kRows, /*keys=*/false) * params.heads_q,
                C::kThreads, C::kSmemDq, stream, params);
}

}  // namespace
}  // namespace simt

cudaError_t bwd_simt(const BwdParams& params, DType dtype, cudaStream_t stream) {
  return simt::dispatch(params, dtype, [&](const BwdParams& p, auto zero, auto cap, auto softcap) {
    return simt::launch_bwd<decltype(zero), decltype(cap)::value, decltype(softcap)::value>(p,
                                                                                            stream);
  });
}

}  // namespace jax_flash::cuda
