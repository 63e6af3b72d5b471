// Host side of the Hopper wgmma backward: checks, TMA tensor maps, dq_accum zeroing, the
// dtype -> head_dim -> mask -> softcap dispatch to the kernel instantiations and the dQ
// conversion.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cuda/bwd_wgmma.cuh"
#include "cuda/bwd_wgmma.h"
#include "cuda/dq_convert.cuh"
#include "cuda/kernel_attributes.h"
#include "cuda/sm90_host.h"

namespace jax_flash::cuda {
namespace {

using sm90::aligned;
using sm90::BwdWgmmaArgs;
using sm90::BwdWgmmaTraits;
using sm90::encode_bshd;
using sm90::sm90a_kernels_usable;

// Keys per CTA (BwdWgmmaTraits::kBlockN): 64 at head_dim 256, 128 below.
constexpr int block_n(int64_t head_dim) { return head_dim == 256 ? 64 : 128; }

// Segment ids are defined for dense batches only; everything else of MaskParams is served.
bool features_supported(const BwdParams& p) {
  return !(p.layout.varlen() && p.mask.segments.enabled());
}

bool params_supported(const BwdParams& p, DType dtype) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const SeqLayout l = with_runs(p.layout, p.mask.segments);
  if (!sm90::common_params_supported(p, dtype)) return false;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  // The kernel multiplies q.k by softmax_scale / softcap in float32.
  if (p.mask.softcap > 0.0 && !(p.softmax_scale / p.mask.softcap <
                                static_cast<double>(std::numeric_limits<float>::max()))) {
    return false;
  }
  // Rows (plus one tile) are int TMA coordinates and positions inside the kernel; head indices
  // and the grid are int.
  const int64_t rows_q = l.rows_q();
  const int64_t rows_k = l.rows_k();
  if (rows_q > kIntMax - 1024 || rows_k > kIntMax - 1024 || p.heads_q > kIntMax) return false;
  if (!l.varlen() && l.batch > kIntMax) return false;
  if (l.varlen() && l.num_seqs > kIntMax - 1024) return false;
  const int64_t tiles = l.tiles(block_n(p.head_dim), true);
  if (tiles * p.heads_kv > kIntMax) return false;
  // Query tiles of one sequence times the GQA group: the producer's loop count.
  const int64_t max_len_q = l.varlen() ? l.total_q : l.seqlen_q;
  // Bounded with the smallest query tile of any kernel (BwdWgmmaTraits::kBlockM >= 64).
  if ((max_len_q / 64 + 2) * (p.heads_q / p.heads_kv) > kIntMax) return false;
  // Pointers and alignment of what the call reads or writes: TMA sources and destinations (Q, K,
  // V, dO, dq_accum, dK, dV) need 16 bytes, dQ 8-byte stores.
  if (rows_q > 0) {
    if (!p.q || !p.dout || !p.lse || !p.delta || !p.dq || !p.dq_accum) return false;
    if (!aligned(p.q, 16) || !aligned(p.dout, 16) || !aligned(p.dq_accum, 16) ||
        !aligned(p.dq, 8)) {
      return false;
    }
  }
  if (rows_k > 0) {
    if (!p.k || !p.v || !p.dk || !p.dv) return false;
    if (!aligned(p.k, 16) || !aligned(p.v, 16) || !aligned(p.dk, 16) || !aligned(p.dv, 16)) {
      return false;
    }
  }
  return true;
}

// Every map of the backward promotes its L2 fills to 256 bytes.
constexpr CUtensorMapL2promotion kL2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;

// Dense calls get 4-D maps over [batch, seqlen, heads, D], whose rows past a sequence read as
// zeros (and are not written); packed calls [rows, heads, D] views (batch 1), whose rows past a
// sequence are the neighbour's and are zeroed by the kernel (read) or never reduced into (dQ).
bool encode(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, const SeqLayout& l,
            bool keys, int64_t heads, int64_t head_dim, int box_rows, int elem_bytes = 2,
            int box_bytes = 128) {
  if (l.varlen()) {
    return encode_bshd(map, type, ptr, 1, keys ? l.total_k : l.total_q, heads, head_dim, box_rows,
                       elem_bytes, kL2, box_bytes);
  }
  return encode_bshd(map, type, ptr, l.batch, keys ? l.seqlen_k : l.seqlen_q, heads, head_dim,
                     box_rows, elem_bytes, kL2, box_bytes);
}

// Zeroes dq_accum, runs the main kernel and converts dQ, all on `stream`.
template <typename T, int kHeadDim, bool kMasked, bool kSoftcap>
cudaError_t launch(const BwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  using Tr = BwdWgmmaTraits<T, kHeadDim, kMasked, kSoftcap>;
  static_assert(Tr::kBlockM >= 64 && Tr::kBlockN == block_n(kHeadDim));
  // Segment ids that form documents schedule a row's key tiles by its documents.
  const SeqLayout l = with_runs(p.layout, p.mask.segments);
  const int64_t dq_elems = l.rows_q() * p.heads_q * Tr::kD;
  if (const cudaError_t err = zero_dq_accum(p.dq_accum, dq_elems, stream); err != cudaSuccess) {
    return err;
  }
  if (const cudaError_t err = zero_dq_semaphores(p.dq_semaphores, l.rows_q() * p.heads_q, stream);
      err != cudaSuccess) {
    return err;
  }

  // kDqPairs: dq_accum in dq_pair_position's order where the tiles' rows pair up in every
  // sequence (dense, even seqlen_q; the tiles start at multiples of 80).
  const bool pairs = Tr::kDqPairs && !l.varlen() && l.seqlen_q % 2 == 0;
  const int64_t tiles = l.tiles(Tr::kBlockN, true);
  const int64_t grid = tiles * p.heads_kv;
  // Without keys there is no dK / dV row to write. Without queries the kernel still runs to
  // write zero dK and dV; its Q / dO maps go unread (and are left blank: their pointers may be
  // null).
  if (grid > 0 && l.rows_k() > 0) {
    CUtensorMap tm_q, tm_k, tm_v, tm_do, tm_dq;
    std::memset(&tm_q, 0, sizeof(tm_q));
    std::memset(&tm_do, 0, sizeof(tm_do));
    std::memset(&tm_dq, 0, sizeof(tm_dq));
    const auto encode_dq = [&] {
      return pairs ? encode_bshd(&tm_dq, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.dq_accum, l.batch,
                                 l.seqlen_q / 2, p.heads_q, 2 * Tr::kD, Tr::kDqPairBoxRows, 4, kL2,
                                 Tr::kDqPairBoxCols * 4)
                   : encode(&tm_dq, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.dq_accum, l, false,
                            p.heads_q, Tr::kD, Tr::kDqBoxRows, 4, Tr::kDqBoxCols * 4);
    };
    if (l.rows_q() > 0 &&
        (!encode(&tm_q, type, p.q, l, false, p.heads_q, Tr::kD, Tr::kBlockM) ||
         !encode(&tm_do, type, p.dout, l, false, p.heads_q, Tr::kD, Tr::kBlockM) || !encode_dq())) {
      return cudaErrorInvalidValue;
    }
    // dK / dV are stored by each consumer warpgroup, 64 key rows at a time.
    CUtensorMap tm_dk, tm_dv;
    if (!encode(&tm_k, type, p.k, l, true, p.heads_kv, Tr::kD, Tr::kBlockN) ||
        !encode(&tm_v, type, p.v, l, true, p.heads_kv, Tr::kD, Tr::kBlockN) ||
        !encode(&tm_dk, type, p.dk, l, true, p.heads_kv, Tr::kD, 64) ||
        !encode(&tm_dv, type, p.dv, l, true, p.heads_kv, Tr::kD, 64)) {
      return cudaErrorInvalidValue;
    }
    BwdWgmmaArgs args;
    args.lse = static_cast<const float*>(p.lse);
    args.delta = static_cast<const float*>(p.delta);
    args.dq_accum = p.dq_accum;
    args.dq_semaphores = p.dq_semaphores;
    args.dk = p.dk;
    args.dv = p.dv;
    args.layout = l;
    args.band = p.mask.band.clamped();
    args.segments = p.mask.segments;
    args.seg_stride_q = l.seqlen_q;
    args.seg_stride_k = l.seqlen_k;
    args.heads_q = static_cast<int>(p.heads_q);
    args.heads_kv = static_cast<int>(p.heads_kv);
    args.group = static_cast<int>(p.heads_q / p.heads_kv);
    // The data a unit's CTAs share at one time is one sequence's Q and dO of its query heads.
    args.order = launch_order(l, p.mask, p.heads_kv, tiles, false,
                              kHeadDim * 2 * int64_t{sizeof(T)} * args.group, 1, 1,
                              p.dq_semaphores != nullptr);
    args.scale = static_cast<float>(p.softmax_scale);
    args.scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);
    const double cap = p.mask.softcap;
    args.softcap_scale = kSoftcap ? static_cast<float>(p.softmax_scale / cap) : 0.f;
    args.softcap_log2 = kSoftcap ? static_cast<float>(cap * 1.4426950408889634) : 0.f;
    args.dq_pairs = pairs;

    const auto kernel = sm90::bwd_wgmma_kernel<Tr>;
    cudaError_t err = configure_kernel_once<sm90::bwd_wgmma_kernel<Tr>>(Tr::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<static_cast<unsigned>(grid), Tr::kThreads, Tr::kSmemBytes, stream>>>(
        args, tm_q, tm_k, tm_v, tm_do, tm_dq, tm_dk, tm_dv);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  if constexpr (Tr::kDqPairs) {
    if (pairs) {
      return convert_dq_pairs<T>(p.dq_accum, p.dq, dq_elems, static_cast<int>(p.heads_q), Tr::kD,
                                 p.softmax_scale, stream);
    }
  }
  // With kDqStsm dq_accum holds each group of 8 columns in dq_accum_position's order.
  return convert_dq<T, Tr::kDqStsm>(p.dq_accum, p.dq, dq_elems, p.softmax_scale, stream);
}

// kMasked unless the band is unbounded and there are no segment ids; kSoftcap when capping.
template <typename T, int kHeadDim>
cudaError_t dispatch_mask(const BwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  const bool masked = !p.mask.band.unbounded() || p.mask.segments.enabled();
  const bool softcap = p.mask.softcap > 0.0;
  if (masked) {
    return softcap ? launch<T, kHeadDim, true, true>(p, type, stream)
                   : launch<T, kHeadDim, true, false>(p, type, stream);
  }
  return softcap ? launch<T, kHeadDim, false, true>(p, type, stream)
                 : launch<T, kHeadDim, false, false>(p, type, stream);
}

template <typename T>
cudaError_t dispatch_head_dim(const BwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  if (p.head_dim == 64) return dispatch_mask<T, 64>(p, type, stream);
  if (p.head_dim == 128) return dispatch_mask<T, 128>(p, type, stream);
  return dispatch_mask<T, 256>(p, type, stream);
}

}  // namespace

bool bwd_wgmma_supported(const BwdParams& params, DType dtype) {
  return features_supported(params) && params_supported(params, dtype) && sm90a_kernels_usable();
}

cudaError_t bwd_wgmma(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (!sm90a_kernels_usable() || !features_supported(params)) return cudaErrorNotSupported;
  if (!params_supported(params, dtype)) return cudaErrorInvalidValue;
  if (params.layout.rows_q() == 0 && params.layout.rows_k() == 0) return cudaSuccess;
  if (dtype == DType::kBF16) {
    return dispatch_head_dim<__nv_bfloat16>(params, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
  }
  return dispatch_head_dim<__half>(params, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
}

}  // namespace jax_flash::cuda
