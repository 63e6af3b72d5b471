// Exact scalar FlashAttention-2 forward pass for float32 and float64 (Dao 2023, Algorithm 1).
// A block owns kM query rows of one (sequence, query head): it keeps Q in shared memory, streams
// the K and V tiles of kN keys that its rows may see through one shared buffer, keeps the
// online-softmax state (running max m, running sum l, both starting from the sink when there is
// one) and the O accumulator in registers, and writes O and lse once. Tiles come from the shared
// scheduler (common/schedule.h) and masks from the shared policy (common/mask.h).
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/simt_common.cuh"

namespace jax_flash::cuda {
namespace simt {
namespace {

// Forward block tile per (dtype, head-dim capacity). kRowLanes lanes (half a warp) share each
// query row, so the softmax row reductions are four shuffles and never leave the warp.
template <typename T, int kCap>
struct FwdTile;
template <>
struct FwdTile<float, 64> {
  static constexpr int kM = 64, kN = 64, kThreads = 128;
};
template <>
struct FwdTile<float, 128> {
  static constexpr int kM = 64, kN = 64, kThreads = 256;
};
template <>
struct FwdTile<float, 256> {
  static constexpr int kM = 32, kN = 32, kThreads = 128;
};
template <>
struct FwdTile<double, 64> {
  static constexpr int kM = 64, kN = 32, kThreads = 256;
};
template <>
struct FwdTile<double, 128> {
  static constexpr int kM = 32, kN = 32, kThreads = 128;
};
template <>
struct FwdTile<double, 256> {
  static constexpr int kM = 16, kN = 16, kThreads = 128;
};

template <typename T, int kCap>
struct FwdConfig {
  static constexpr int kM = FwdTile<T, kCap>::kM;
  static constexpr int kN = FwdTile<T, kCap>::kN;
  static constexpr int kThreads = FwdTile<T, kCap>::kThreads;
  static constexpr int kVecN = kVec<T>;
  static constexpr int kRowLanes = 16;
  static constexpr int kRowGroups = kThreads / kRowLanes;
  static constexpr int kRowsPerThread = kM / kRowGroups;
  static constexpr int kKeysPerThread = kN / kRowLanes;
  // A thread's head-dim columns of O: kDimChunks vectors, kRowLanes vectors apart.
  static constexpr int kChunkSpan = kRowLanes * kVecN;
  static constexpr int kDimChunks = kCap / kChunkSpan;
  static constexpr int kDimsPerThread = kDimChunks * kVecN;
  static constexpr int kStride = kCap + kVecN;  // Q / K / V rows
  static constexpr int kPStride = kN + kVecN;   // P rows
  // Q, K or V, P, then the segment ids of the query rows and of the keys.
  static constexpr size_t kSmemBytes =
      sizeof(T) * (static_cast<size_t>(kM) * kStride + static_cast<size_t>(kN) * kStride +
                   static_cast<size_t>(kM) * kPStride) +
      sizeof(int32_t) * (kM + kN);

  static_assert(kThreads % 32 == 0 && kRowLanes <= 32 && 32 % kRowLanes == 0);
  static_assert(kM % kRowGroups == 0 && kN % kRowLanes == 0 && kN % kVecN == 0);
  static_assert(kCap % kChunkSpan == 0 && kDimChunks >= 1);
  static_assert(kSmemBytes <= 99 * 1024, "must fit the opt-in shared memory of every sm_8x");
};

// Sum or max over the kRowLanes lanes that share a row; xor offsets below kRowLanes stay inside
// the aligned lane group.
template <int kLanes, typename T>
__device__ __forceinline__ T row_max(T v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
template <int kLanes, typename T>
__device__ __forceinline__ T row_sum(T v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <typename T, int kCap, bool kSoftcap>
__global__ void __launch_bounds__(FwdConfig<T, kCap>::kThreads) fwd_kernel(const FwdParams p) {
  using C = FwdConfig<T, kCap>;
  constexpr int kTM = C::kRowsPerThread;
  constexpr int kTN = C::kKeysPerThread;
  constexpr int kV = C::kVecN;
  constexpr int kL = C::kRowLanes;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* kv_s = q_s + C::kM * C::kStride;
  T* p_s = kv_s + C::kN * C::kStride;
  int32_t* q_id_s = reinterpret_cast<int32_t*>(p_s + C::kM * C::kPStride);
  int32_t* k_id_s = q_id_s + C::kM;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kL;
  const int row0 = (tid / kL) * kTM;

  // Query tiles run last-first: under a causal or windowed mask the last tiles of a sequence see
  // the most keys, and starting the heaviest blocks first keeps the tail of the grid short. Heads
  // vary fastest, so the query heads of a GQA group read their K and V at about the same time.
  const int64_t block = blockIdx.x;
  const int64_t h = block % p.heads_q;
  const SeqTile tile = p.layout.tile(p.layout.tiles(C::kM, false) - 1 - block / p.heads_q, C::kM,
                                     /*keys=*/false);
  if (tile.empty(C::kM, false)) return;
  const SeqSpan& span = tile.span;
  const int64_t h_kv = h / (p.heads_q / p.heads_kv);
  const int64_t m0 = tile.block * C::kM;
  const int m_rows = tile_rows(span.len_q - m0, C::kM);
  const int d = static_cast<int>(p.head_dim);
  const Score<T, kSoftcap> score = Score<T, kSoftcap>::of(p.softmax_scale, p.mask.softcap);

  const int64_t q_row_stride = p.heads_q * p.head_dim;
  const int64_t kv_row_stride = p.heads_kv * p.head_dim;
  const T* q = static_cast<const T*>(p.q) + ((span.q_start + m0) * p.heads_q + h) * p.head_dim;
  const int64_t kv_offset = (span.k_start * p.heads_kv + h_kv) * p.head_dim;
  const T* k = static_cast<const T*>(p.k) + kv_offset;
  const T* v = static_cast<const T*>(p.v) + kv_offset;

  load_tile_async<T, C::kThreads, C::kM, kCap, C::kStride>(q_s, q, q_row_stride, m_rows, d);

  // A sink is one more logit of every row with no value: the online softmax starts from it
  // (m = sink, l = 1, counted once per row, by its lane 0) instead of from an empty row.
  const bool has_sink = p.mask.sinks != nullptr;
  const T m_init =
      has_sink ? static_cast<const T*>(p.mask.sinks)[span.batch * p.mask.sinks_batch_stride + h]
               : neg_inf<T>();
  const T l_init = has_sink && lane == 0 ? T(1) : T(0);
  T o[kTM][C::kDimsPerThread];
  T m_run[kTM];
  T l_run[kTM];  // this lane's share of the row sum; the lanes of a row are added at the end
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    m_run[i] = m_init;
    l_run[i] = l_init;
#pragma unroll
    for (int x = 0; x < C::kDimsPerThread; ++x) o[i][x] = T(0);
  }

  const SeqMask band = p.mask.band.for_seq(span.len_q, span.len_k);
  const SeqSegments seg = seq_segments(p.mask.segments, span);
  if (seg.enabled()) load_ids<C::kThreads, C::kM>(q_id_s, seg.q_ids + m0, m_rows);
  const int k_vecs = (d + kV - 1) / kV;
  const int64_t n_end = band.key_end(m0 + m_rows);
  for (int64_t n0 = band.key_begin(m0); n0 < n_end; n0 += C::kN) {
    const int n_rows = tile_rows(n_end - n0, C::kN);
    const PairMask pm = pair_mask(band, seg, m0, m0 + m_rows, n0, n0 + n_rows);
    if (pm.skip) continue;
    load_tile_async<T, C::kThreads, C::kN, kCap, C::kStride>(kv_s, k + n0 * kv_row_stride,
                                                             kv_row_stride, n_rows, d);
    if (pm.ids) load_ids<C::kThreads, C::kN>(k_id_s, seg.kv_ids + n0, n_rows);
    cp_async_wait_all();
    __syncthreads();

    // S = Q K^T for this thread's kTM rows and kTN keys (lane, lane + kL, ...).
    T s[kTM][kTN];
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int j = 0; j < kTN; ++j) s[i][j] = T(0);
    }
#pragma unroll 1
    for (int kv = 0; kv < k_vecs; ++kv) {
      Vec<T> qa[kTM];
      Vec<T> kb[kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i) qa[i] = load_vec(q_s + (row0 + i) * C::kStride + kv * kV);
#pragma unroll
      for (int j = 0; j < kTN; ++j) kb[j] = load_vec(kv_s + (lane + j * kL) * C::kStride + kv * kV);
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
#pragma unroll
          for (int e = 0; e < kV; ++e) s[i][j] = fma(qa[i].v[e], kb[j].v[e], s[i][j]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        T t;
        s[i][j] = score(s[i][j], t);
      }
    }

    // Boundary pairs (and partial key tiles, whose zero-filled keys must not count) get -inf for
    // the entries their row may not see; interior pairs need no element test. Padded query rows
    // compute harmless values that are never stored.
    if (!(pm.full && n_rows == C::kN)) {
      const TileMask tm = loaded_tile_mask(band, m0, n0, n_rows);
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          const int r = row0 + i;
          const int c = lane + j * kL;
          if (!tm.visible(r, c) || (pm.ids && q_id_s[r] != k_id_s[c])) s[i][j] = neg_inf<T>();
        }
      }
    }

    // Online softmax. A row that has seen no finite logit (and has no sink) keeps m = -inf; it is
    // rescaled against 0 instead, so exp(-inf - -inf) never produces NaN and its P stays 0. Max
    // and exponent use the same rounded logit as the backward pass (Score).
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const int r = row0 + i;
      T tile_max = neg_inf<T>();
#pragma unroll
      for (int j = 0; j < kTN; ++j) tile_max = fmax(tile_max, s[i][j]);
      const T m_new = fmax(m_run[i], row_max<kL>(tile_max));
      const T m_ref = m_new == neg_inf<T>() ? T(0) : m_new;
      const T correction = exp_full(m_run[i] - m_ref);
      m_run[i] = m_new;
      l_run[i] *= correction;
#pragma unroll
      for (int x = 0; x < C::kDimsPerThread; ++x) o[i][x] *= correction;
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const T pij = exp_full(s[i][j] - m_ref);
        l_run[i] += pij;
        p_s[r * C::kPStride + lane + j * kL] = pij;
      }
    }
    // K is no longer read and every P is written: V may replace K in the shared buffer.
    __syncthreads();
    load_tile_async<T, C::kThreads, C::kN, kCap, C::kStride>(kv_s, v + n0 * kv_row_stride,
                                                             kv_row_stride, n_rows, d);
    cp_async_wait_all();
    __syncthreads();

    // O += P V. Keys past n_rows have P = 0 and zero-filled V rows, so rounding the trip count
    // up to a whole vector adds exact zeros.
    accumulate_rows<T, kTM, C::kDimChunks, C::kChunkSpan, C::kPStride, C::kStride>(
        o, p_s, kv_s, row0, lane, (n_rows + kV - 1) / kV * kV, d);
    // The next iteration overwrites the shared V and P.
    __syncthreads();
  }

  // Without any key tile the Q copy is still in flight; it must land before the block exits.
  cp_async_wait_all();
  T* o_out = static_cast<T*>(p.o);
  T* lse_out = static_cast<T*>(p.lse) + span.stat_start + h * span.stat_head + m0;
#pragma unroll
  for (int i = 0; i < kTM; ++i) l_run[i] = row_sum<kL>(l_run[i]);
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const int r = row0 + i;
    if (r >= m_rows) continue;
    // A row without keys and sink has l == 0 (O = 0, lse = -inf); any other l is > 0 or NaN
    // and propagates NaN inputs unchanged. With a sink and no key, l = 1 and lse = sink.
    const T l = l_run[i];
    const bool masked = l == T(0);
    const T inv_l = masked ? T(0) : T(1) / l;
    T* o_row = o_out + ((span.q_start + m0 + r) * p.heads_q + h) * p.head_dim;
#pragma unroll
    for (int ch = 0; ch < C::kDimChunks; ++ch) {
#pragma unroll
      for (int f = 0; f < kV; ++f) {
        const int col = ch * C::kChunkSpan + lane * kV + f;
        if (col < d) o_row[col] = o[i][ch * kV + f] * inv_l;
      }
    }
    if (lane == 0) lse_out[r] = masked ? neg_inf<T>() : m_run[i] + log_full(l);
  }
}

template <typename T, int kCap, bool kSoftcap>
cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream) {
  using C = FwdConfig<T, kCap>;
  const int64_t blocks = params.layout.tiles(C::kM, /*keys=*/false) * params.heads_q;
  return launch(fwd_kernel<T, kCap, kSoftcap>, blocks, C::kThreads, C::kSmemBytes, stream, params);
}

}  // namespace
}  // namespace simt

cudaError_t fwd_simt(const FwdParams& params, DType dtype, cudaStream_t stream) {
  return simt::dispatch(params, dtype, [&](const FwdParams& p, auto zero, auto cap, auto softcap) {
    return simt::launch_fwd<decltype(zero), decltype(cap)::value, decltype(softcap)::value>(p,
                                                                                            stream);
  });
}

}  // namespace jax_flash::cuda
