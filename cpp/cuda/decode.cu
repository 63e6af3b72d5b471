// decode_fwd (cuda/decode.h): checks the call, turns (dtype, head_dim, rows, paged, softcap) into
// one kernel instantiation, launches the split pass (fp16/bf16: the TMA pass of decode_tma.cuh on
// sm_90 where it applies, else the cp.async pass of decode_tc.cuh) and, with num_splits > 1, the
// merge pass. Nothing here allocates, synchronises or copies between host and device (the TMA
// pass encodes its two tensor maps on the host, a CPU-only call).
//
// The split count (chosen by the caller) should fill the device in one wave without a ragged
// tail, and leave every split several 64-key tiles. With R = heads_q / heads_kv * seqlen_q:
//   f16/bf16: m_blocks = R <= 16 ? 1 : ceil(R / (head_dim > 128 ? 16 : 32)),
//             slots = sm_count * (head_dim > 128 ? 1 : 2)        (resident blocks on sm_90),
//             splits = clamp(floor(slots / (batch * heads_kv * m_blocks)), 1, ceil(max_keys / 512))
//   f32/f64:  splits = clamp(ceil(32 * sm_count / (batch * heads_q * seqlen_q)), 1,
//                            ceil(max_keys / 128))
// (floor, not ceil, for f16/bf16: 4 splits x 64 sequence-heads fill 264 slots, 5 would run a
// second wave for 56 blocks.) num_splits = 1 needs no partials and no merge pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/decode.h"
#include "cuda/decode_merge.cuh"
#include "cuda/decode_simt.cuh"
#include "cuda/decode_tc.cuh"
#include "cuda/decode_tma.cuh"

namespace jax_flash::cuda {
namespace {

using decode::TcArgs;
using decode::TcTraits;

// Positions and block indices are int inside the kernels; tiles may run one tile past the last
// key, so the cache keeps that far below INT_MAX.
constexpr int64_t kMaxPositions = INT_MAX - 1024;

// Whether environment variable `name` is set to `value`; each caller reads it once per process.
bool env_is(const char* name, const char* value) {
  const char* set = std::getenv(name);
  return set != nullptr && std::strcmp(set, value) == 0;
}

// JAX_FLASH_DECODE_TILES=compact forces the compact tiles on any device, and
// JAX_FLASH_DECODE_COPY=cp.async the cp.async ring on sm_90, so that one GPU tests every
// configuration (tools/decode_check.cu).
bool compact_tiles_forced() {
  static const bool forced = env_is("JAX_FLASH_DECODE_TILES", "compact");
  return forced;
}

bool cp_async_forced() {
  static const bool forced = env_is("JAX_FLASH_DECODE_COPY", "cp.async");
  return forced;
}

// The configurations the TMA pass serves (TcTraits::kTma) go to it where it can serve the call
// (decode_tma.cuh), everything else to the cp.async pass.
template <typename Tr>
cudaError_t launch_rows(const DecodeParams& p, TcArgs args, cudaStream_t stream) {
  args.m_blocks = (args.rows + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t blocks = p.batch * p.heads_kv * p.num_splits * args.m_blocks;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  if constexpr (Tr::kTma) {
    if (!cp_async_forced() && decode::tma_usable(p)) {
      return p.paged() ? decode::launch_tma<Tr, true>(p, args, blocks, stream)
                       : decode::launch_tma<Tr, false>(p, args, blocks, stream);
    }
  }
  return p.paged() ? decode::launch_tc<Tr, true>(p, args, blocks, stream)
                   : decode::launch_tc<Tr, false>(p, args, blocks, stream);
}

// The full-depth tiles where the device's per-block shared memory holds them (sm_90, and at
// head_dim 64 every sm_80+ part), the compact ones elsewhere. Two attribute reads, no
// synchronisation.
template <typename T, int kHeadDim, int kMTiles>
cudaError_t run_tc_rows(const DecodeParams& p, const TcArgs& args, cudaStream_t stream) {
  using Full = TcTraits<T, kHeadDim, kMTiles, false>;
  using Compact = TcTraits<T, kHeadDim, kMTiles, true>;
  int device = 0;
  int smem_optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err != cudaSuccess) return err;
  if (Full::kSmemBytes <= smem_optin && !compact_tiles_forced()) {
    return launch_rows<Full>(p, args, stream);
  }
  if (Compact::kSmemBytes <= smem_optin) return launch_rows<Compact>(p, args, stream);
  return cudaErrorNotSupported;
}

// Rows per block: one m16 tile when the packed rows fit it (Sq = 1 at GQA ratio <= 16, the
// common decode), else two, which halves the K/V re-reads of the extra row blocks; at padded
// head_dim 256 two tiles of O would not fit the registers.
template <typename T, int kHeadDim>
cudaError_t run_tc_dim(const DecodeParams& p, const TcArgs& args, cudaStream_t stream) {
  if constexpr (kHeadDim == 256) {
    return run_tc_rows<T, kHeadDim, 1>(p, args, stream);
  } else {
    if (args.rows <= 16) return run_tc_rows<T, kHeadDim, 1>(p, args, stream);
    return run_tc_rows<T, kHeadDim, 2>(p, args, stream);
  }
}

template <typename T>
cudaError_t run_tc(const DecodeParams& p, cudaStream_t stream) {
  if (p.head_dim % 8 != 0) return cudaErrorNotSupported;  // 16-byte rows; the caller pads
  constexpr double kLog2e = 1.4426950408889634;
  TcArgs args{};
  args.softcap = p.mask.softcap > 0.0;
  args.scale_log2 = static_cast<float>((args.softcap ? p.mask.softcap : p.softmax_scale) * kLog2e);
  args.cap_scale = args.softcap ? static_cast<float>(p.softmax_scale / p.mask.softcap) : 0.f;
  // The fp32 factors must be normal: an overflowed one turns a zero score into NaN, an
  // underflowed one every score into 0.
  if (!std::isnormal(args.scale_log2) || (args.softcap && !std::isnormal(args.cap_scale))) {
    return cudaErrorInvalidValue;
  }
  const int64_t group = p.heads_q / p.heads_kv;
  if (group * p.seqlen_q > INT_MAX - 64) return cudaErrorInvalidValue;
  args.group = static_cast<int>(group);
  args.rows = static_cast<int>(group * p.seqlen_q);
  if (p.head_dim <= 64) return run_tc_dim<T, 64>(p, args, stream);
  if (p.head_dim <= 128) return run_tc_dim<T, 128>(p, args, stream);
  return run_tc_dim<T, 256>(p, args, stream);
}

template <typename T>
cudaError_t run_simt(const DecodeParams& p, cudaStream_t stream) {
  if (p.mask.softcap > 0.0 && (!std::isnormal(static_cast<T>(p.softmax_scale / p.mask.softcap)) ||
                               !std::isnormal(static_cast<T>(p.mask.softcap)))) {
    return cudaErrorInvalidValue;
  }
  const int64_t warps = p.batch * p.num_splits * p.heads_q * p.seqlen_q;
  const int64_t blocks = (warps + decode::kSimtWarps - 1) / decode::kSimtWarps;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  const auto kernel = p.mask.softcap > 0.0 ? decode::decode_simt_kernel<T, true>
                                           : decode::decode_simt_kernel<T, false>;
  kernel<<<static_cast<unsigned>(blocks), decode::kSimtWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename S>
cudaError_t run_merge(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;  // one block each
  if (rows > INT_MAX) return cudaErrorInvalidValue;
  // The split pass before it on the stream lets it launch early (cuda/grid_dependency.cuh).
  return launch_dependent(decode::decode_merge_kernel<T, S>, static_cast<unsigned>(rows),
                          decode::kMergeWarps * 32, 0, stream, p);
}

template <typename T, typename S>
cudaError_t run_split_and_merge(const DecodeParams& p, cudaStream_t stream) {
  cudaError_t err;
  if constexpr (sizeof(T) == 2) {
    err = run_tc<T>(p, stream);
  } else {
    err = run_simt<T>(p, stream);
  }
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return run_merge<T, S>(p, stream);
}

}  // namespace

cudaError_t decode_fwd(const DecodeParams& params, DType dtype, cudaStream_t stream) {
  if (!decode_params_well_formed(params) || params.cache_seqlens == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (params.head_dim > decode::kSimtMaxHeadDim) return cudaErrorNotSupported;
  if (params.cache_capacity() > kMaxPositions || params.seqlen_q > kMaxPositions ||
      params.heads_q > INT_MAX || params.num_splits > INT_MAX ||
      (params.paged() && params.page_size > kMaxPositions)) {
    return cudaErrorInvalidValue;
  }
  if (params.batch == 0 || params.seqlen_q == 0) return cudaSuccess;
  DecodeParams p = params;
  // Bounds beyond kUnbounded mean none; clamping keeps the band arithmetic far from overflow.
  p.mask.band = params.mask.band.clamped();
  switch (dtype) {
    case DType::kF16:
      return run_split_and_merge<__half, float>(p, stream);
    case DType::kBF16:
      return run_split_and_merge<__nv_bfloat16, float>(p, stream);
    case DType::kF32:
      return run_split_and_merge<float, float>(p, stream);
    case DType::kF64:
      return run_split_and_merge<double, double>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flash::cuda
