// Host side of the Hopper wgmma forward: checks, TMA tensor maps and the dtype -> head_dim ->
// mask -> softcap -> key-length dispatch to the kernel instantiations.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cuda/fwd_wgmma.cuh"
#include "cuda/fwd_wgmma.h"
#include "cuda/kernel_attributes.h"
#include "cuda/sm90_host.h"

namespace jax_flash::cuda {
namespace {

using sm90::aligned;
using sm90::encode_bshd;
using sm90::FwdMask;
using sm90::FwdWgmmaArgs;
using sm90::FwdWgmmaTraits;
using sm90::sm90a_kernels_usable;

constexpr int64_t kIntMax = std::numeric_limits<int>::max();
constexpr double kLog2e = 1.4426950408889634;

// Row counts, lengths and the tiles of a call, all from the layout.
bool layout_supported(const FwdParams& p) {
  const SeqLayout& l = p.layout;
  if (l.heads_q != p.heads_q) return false;
  if (l.varlen()) {
    if (l.cu_seqlens_k == nullptr || !aligned(l.cu_seqlens_q, 4) || !aligned(l.cu_seqlens_k, 4)) {
      return false;
    }
    if (l.num_seqs < 0 || l.num_seqs >= kIntMax || l.total_q < 0 || l.total_q > kIntMax ||
        l.total_k < 0 || l.total_k > kIntMax) {
      return false;
    }
  } else if (l.batch < 0 || l.batch > kIntMax || l.seqlen_q < 0 || l.seqlen_q > kIntMax ||
             l.seqlen_k < 0 || l.seqlen_k > kIntMax) {
    return false;
  }
  // 128 is the smallest query tile of the family, so this bounds every grid (the launcher's
  // layout, with the rows' documents where it schedules by them).
  const int64_t tiles = with_runs(l, p.mask.segments).tiles(128, false);
  return tiles <= kIntMax / std::max<int64_t>(p.heads_q, 1);
}

bool mask_supported(const FwdParams& p) {
  // Everything else of the mask is checked by params_well_formed (common_params_supported).
  const MaskParams& m = p.mask;
  if (m.sinks != nullptr && !aligned(m.sinks, 4)) return false;
  const SegmentIds& s = m.segments;
  return !s.enabled() || (aligned(s.q_ids, 4) && aligned(s.kv_ids, 4) && aligned(s.q_ranges, 4) &&
                          aligned(s.kv_ranges, 4) && aligned(s.runs, 4));
}

bool params_supported(const FwdParams& p, DType dtype) {
  if (!sm90::common_params_supported(p, dtype)) return false;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  if (p.heads_q > kIntMax) return false;
  if (!layout_supported(p) || !mask_supported(p)) return false;
  return aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16) && aligned(p.o, 16);
}

// The most keys one query row can see: the key length, or a window's width when both sides of
// the band are bounded. It chooses the tile only (layout.max_seqlen_k is a bound, not a size).
int64_t visible_keys(const FwdParams& p) {
  const SeqLayout& l = p.layout;
  const int64_t keys = l.varlen() ? std::max(l.max_seqlen_k, int64_t{0}) : l.seqlen_k;
  const Band& b = p.mask.band;
  if (b.left >= kUnbounded || b.right >= kUnbounded) return keys;
  return std::min(keys, b.left + b.right + 1);
}

// The persistent forward (fwd_wgmma_persistent_kernel) runs where a tile's start-up is a large
// share of its life: rows that see at most this many keys (banded calls: _BAND; both can be moved
// for A/B builds).
#ifndef JAX_FLASH_FWD_PERSISTENT_MAX_KEYS
#define JAX_FLASH_FWD_PERSISTENT_MAX_KEYS 2048
#endif
#ifndef JAX_FLASH_FWD_PERSISTENT_MAX_KEYS_BAND
#define JAX_FLASH_FWD_PERSISTENT_MAX_KEYS_BAND JAX_FLASH_FWD_PERSISTENT_MAX_KEYS
#endif
constexpr int64_t kPersistentMaxKeys = JAX_FLASH_FWD_PERSISTENT_MAX_KEYS;
constexpr int64_t kPersistentMaxKeysBand = JAX_FLASH_FWD_PERSISTENT_MAX_KEYS_BAND;

// Whether calls the persistent form serves use it when JAX_FLASH_FWD_PERSISTENT is unset. On: the
// GPU suite passed with it on over one CTA per SM and over 3 CTAs, racecheck and memcheck are
// clean, and on an H100 every cell it serves ran as fast or faster (docs/PERF_LOG.md, "the
// persistent forward on by default").
#ifndef JAX_FLASH_FWD_PERSISTENT_DEFAULT
#define JAX_FLASH_FWD_PERSISTENT_DEFAULT 1
#endif

// CTAs of a persistent grid on the current device: its SM count (read once per device), capped by
// JAX_FLASH_FWD_PERSISTENT_CTAS=N when set (tests use it to give small calls many tiles a CTA); 0
// when the persistent form is off (JAX_FLASH_FWD_PERSISTENT=0; =1 turns it on).
int64_t persistent_ctas() {
  static const int64_t cap = [] {
    const char* env = std::getenv("JAX_FLASH_FWD_PERSISTENT");
    const bool on =
        env != nullptr ? std::string_view(env) != "0" : JAX_FLASH_FWD_PERSISTENT_DEFAULT != 0;
    if (!on) return int64_t{0};
    const char* n = std::getenv("JAX_FLASH_FWD_PERSISTENT_CTAS");
    const long long v = n != nullptr ? std::atoll(n) : 0;
    return v > 0 ? static_cast<int64_t>(v) : std::numeric_limits<int64_t>::max();
  }();
  return cap == 0 ? 0 : std::min<int64_t>(sm90::sm_count(), cap);
}

template <typename T, int kHeadDim, FwdMask kMask, bool kSoftcap, bool kLongKeys>
cudaError_t launch(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  using Tr = FwdWgmmaTraits<T, kHeadDim, kMask, kSoftcap, kLongKeys>;
  constexpr bool kHasPersistent = sm90::fwd_persistent_tile(kHeadDim, kMask, kLongKeys, kSoftcap);
  // Segment ids that form documents schedule a row's tiles by its documents.
  const SeqLayout l = with_runs(p.layout, p.mask.segments);
  FwdWgmmaArgs args{};
  args.o = p.o;
  args.lse = static_cast<float*>(p.lse);
  args.layout = l;
  args.band = p.mask.band.clamped();
  args.segments = p.mask.segments;
  args.sinks = static_cast<const float*>(p.mask.sinks);
  args.sinks_batch_stride = p.mask.sinks_batch_stride;
  args.heads_q = static_cast<int>(p.heads_q);
  args.group = static_cast<int>(p.heads_q / p.heads_kv);
  args.order =
      launch_order(l, p.mask, l.varlen() ? p.heads_q : l.batch * p.heads_q,
                   l.varlen() ? l.tiles(Tr::kBlockM, false) : l.row_tiles(Tr::kBlockM, false), true,
                   kHeadDim * 2 * int64_t{sizeof(T)}, args.group, p.heads_q);
  args.scale_log2 = static_cast<float>(p.softmax_scale * kLog2e);
  if constexpr (kSoftcap) {
    args.softcap_scale = static_cast<float>(p.softmax_scale / p.mask.softcap);
    args.softcap_log2 = static_cast<float>(p.mask.softcap * kLog2e);
  }

  // The persistent grid's CTAs, or 0 for one CTA per tile. Dense calls only (a packed call's
  // tiles are decoded from cu_seqlens by a whole warp).
  int64_t persistent = 0;
  if constexpr (kHasPersistent) {
    constexpr int64_t kMaxKeys =
        kMask == FwdMask::kBand ? kPersistentMaxKeysBand : kPersistentMaxKeys;
    if (p.work_counter != nullptr && !l.varlen() && visible_keys(p) <= kMaxKeys) {
      const int64_t ctas = persistent_ctas();
      if (ctas > 0 && args.order.ctas() > ctas) persistent = ctas;
    }
  }
  // Key blocks of the kernel that runs: the persistent form's may be smaller (head_dim 128
  // without a band).
  constexpr int kPersistentBlockN =
      kHasPersistent ? sm90::fwd_wgmma_tile(kHeadDim, kMask, kLongKeys, true).block_n : Tr::kBlockN;
  const int block_n = persistent > 0 ? kPersistentBlockN : Tr::kBlockN;

  // Dense: [batch, seqlen, heads, D] maps. Packed: the [rows, heads, D] views as one sequence.
  const int64_t map_batch = l.varlen() ? 1 : l.batch;
  const int64_t q_rows = l.varlen() ? l.total_q : l.seqlen_q;
  const int64_t k_rows = l.varlen() ? l.total_k : l.seqlen_k;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  if (!encode_bshd(&tm_q, type, p.q, map_batch, q_rows, p.heads_q, kHeadDim, Tr::kBlockM) ||
      !encode_bshd(&tm_k, type, p.k, map_batch, k_rows, p.heads_kv, kHeadDim, block_n) ||
      !encode_bshd(&tm_v, type, p.v, map_batch, k_rows, p.heads_kv, kHeadDim, block_n) ||
      !encode_bshd(&tm_o, type, p.o, map_batch, q_rows, p.heads_q, kHeadDim,
                   Tr::kBlockM / Tr::kConsumerWarpgroups)) {
    return cudaErrorInvalidValue;
  }
  if (args.order.ctas() == 0) return cudaSuccess;

  if constexpr (kHasPersistent) {
    if (persistent > 0) {
      using TrP = FwdWgmmaTraits<T, kHeadDim, kMask, kSoftcap, kLongKeys, true>;
      static_assert(TrP::kBlockM == Tr::kBlockM && TrP::kBlockN == kPersistentBlockN);
      const cudaError_t err =
          configure_kernel_once<sm90::fwd_wgmma_persistent_kernel<TrP>>(TrP::kSmemBytes);
      if (err != cudaSuccess) return err;
      args.work_counter = p.work_counter;
      if (const cudaError_t e = cudaMemsetAsync(p.work_counter, 0, sizeof(int32_t), stream);
          e != cudaSuccess) {
        return e;
      }
      sm90::fwd_wgmma_persistent_kernel<TrP>
          <<<static_cast<unsigned>(persistent), TrP::kThreads, TrP::kSmemBytes, stream>>>(
              args, tm_q, tm_k, tm_v, tm_o);
      return cudaGetLastError();
    }
  }
  const auto kernel = sm90::fwd_wgmma_kernel<Tr>;
  const cudaError_t err = configure_kernel_once<sm90::fwd_wgmma_kernel<Tr>>(Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  const unsigned grid = static_cast<unsigned>(args.order.ctas());
  if constexpr (Tr::kSegments) {
    // The segment summaries' kernel (segment_summaries.cu) runs just before on the stream, on
    // one SM per batch row, and lets its dependents start at once: this grid's CTAs launch
    // meanwhile and wait for its records (cuda/grid_dependency.cuh).
    return launch_dependent(kernel, grid, Tr::kThreads, Tr::kSmemBytes, stream, args, tm_q, tm_k,
                            tm_v, tm_o);
  }
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(args, tm_q, tm_k, tm_v, tm_o);
  return cudaGetLastError();
}

// Instantiates the long-keys variant only where its tile differs.
template <typename T, int kHeadDim, FwdMask kMask, bool kSoftcap>
cudaError_t dispatch_length(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  constexpr bool kDiffers = sm90::fwd_wgmma_tile(kHeadDim, kMask, true).block_n !=
                            sm90::fwd_wgmma_tile(kHeadDim, kMask, false).block_n;
  if constexpr (kDiffers) {
    if (visible_keys(p) >= sm90::kLongKeys) {
      return launch<T, kHeadDim, kMask, kSoftcap, true>(p, type, stream);
    }
  }
  return launch<T, kHeadDim, kMask, kSoftcap, false>(p, type, stream);
}

template <typename T, int kHeadDim, FwdMask kMask>
cudaError_t dispatch_softcap(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  return p.mask.softcap > 0.0 ? dispatch_length<T, kHeadDim, kMask, true>(p, type, stream)
                              : dispatch_length<T, kHeadDim, kMask, false>(p, type, stream);
}

// Segment ids take the band's code path too (with any band); an unbounded band without them runs
// the unmasked kernel.
template <typename T, int kHeadDim>
cudaError_t dispatch_mask(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  if (p.mask.segments.enabled()) {
    return dispatch_softcap<T, kHeadDim, FwdMask::kSegments>(p, type, stream);
  }
  if (!p.mask.band.unbounded())
    return dispatch_softcap<T, kHeadDim, FwdMask::kBand>(p, type, stream);
  return dispatch_softcap<T, kHeadDim, FwdMask::kNone>(p, type, stream);
}

template <typename T>
cudaError_t dispatch_head_dim(const FwdParams& p, CUtensorMapDataType type, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return dispatch_mask<T, 64>(p, type, stream);
    case 128:
      return dispatch_mask<T, 128>(p, type, stream);
    case 256:
      return dispatch_mask<T, 256>(p, type, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

bool fwd_wgmma_supported(const FwdParams& params, DType dtype) {
  return params_supported(params, dtype) && sm90a_kernels_usable();
}

cudaError_t fwd_wgmma(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (!sm90a_kernels_usable()) return cudaErrorNotSupported;
  if (!params_supported(params, dtype)) return cudaErrorInvalidValue;
  if (params.layout.rows_q() == 0) return cudaSuccess;
  if (dtype == DType::kBF16) {
    return dispatch_head_dim<__nv_bfloat16>(params, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
  }
  return dispatch_head_dim<__half>(params, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
}

}  // namespace jax_flash::cuda
