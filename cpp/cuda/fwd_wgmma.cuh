// FlashAttention forward for Hopper (sm_90a), after the FlashAttention-3 paper: warp-specialised
// CTAs in which one producer warpgroup streams K/V tiles with the tensor memory accelerator (TMA)
// into a two-stage shared-memory ring guarded by mbarriers, and two or three consumer warpgroups,
// each owning 64 query rows, run S = Q K^T and O += P V on warpgroup MMA (wgmma) with the online
// softmax kept in registers. setmaxnreg moves registers from the producer to the consumers; the
// consumers take turns issuing GEMMs (ping-pong), and each overlaps the softmax of one key block
// with the P V GEMM of the previous one.
//
// Shared-memory tiles are stored as the TMA writes them with 128-byte swizzling: a tile of R rows
// and D columns is D / 64 "panels" of R rows x 128 bytes, and inside each panel the 16-byte chunk
// c of row r sits at chunk c ^ (r % 8). Every tile starts on a 1024-byte boundary so that the
// swizzle phase equals the address bits the hardware uses (bits 7-9 of the byte address). The same
// bytes are then described to wgmma as K-major operands (Q and K for S = Q K^T) or as an MN-major
// operand (V for O += P V, where the key axis is the reduction axis).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "cuda/tc_primitives.cuh"

// wgmma, setmaxnreg and the TMA tensor instructions used here exist only on the sm_90a target;
// every other device pass (sm_80 in this build) compiles the kernel to an empty body.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_FLASH_SM90A 1
#else
#define JAX_FLASH_SM90A 0
#endif

namespace jax_flash::cuda::sm90 {

// Everything a launch needs besides the four tensor maps, computed on the host.
struct FwdWgmmaArgs {
  float* lse;  // [batch, heads_q, seqlen_q]
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int group;         // heads_q / heads_kv: query heads sharing one K/V head
  int m_blocks;      // ceil(seqlen_q / kBlockM)
  float scale_log2;  // softmax_scale * log2(e): the softmax runs in base 2
};

// Every tile-size choice of the family (after FlashAttention-3's): the number of consumer
// warpgroups (64 query rows each) and the keys per K/V tile.
// - head_dim 64: the softmax costs as much as the two GEMMs, so a third consumer warpgroup
//   (192 query rows) gives the tensor cores more GEMMs to overlap with it and cuts the K/V traffic
//   per FLOP by a third.
// - head_dim 128: 176 keys per tile amortise the per-tile softmax bookkeeping; causal keeps 128
//   for short key sequences, where the partly masked diagonal tiles are a large share of the work.
// - head_dim 256: O alone takes 128 registers a thread, so S gets 80 keys (40 registers).
struct FwdWgmmaTile {
  int consumer_warpgroups;
  int block_n;
};

constexpr FwdWgmmaTile fwd_wgmma_tile(int head_dim, bool causal, bool long_keys) {
  if (head_dim <= 64) return {3, 128};
  if (head_dim <= 128) return {2, causal && !long_keys ? 128 : 176};
  return {2, 80};
}

// Key sequences at least this long count as long_keys.
inline constexpr int64_t kLongKeys = 4096;

template <typename T, int kHeadDim, bool kCausal, bool kLongKeys>
struct FwdWgmmaTraits {
  using Element = T;
  static constexpr int kD = kHeadDim;
  static constexpr bool kIsCausal = kCausal;
  static constexpr FwdWgmmaTile kTile = fwd_wgmma_tile(kHeadDim, kCausal, kLongKeys);
  static constexpr int kConsumerWarpgroups = kTile.consumer_warpgroups;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // One wgmma M extent (64 rows) per consumer warpgroup.
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = kTile.block_n;
  // Consumer warpgroups take turns to issue their GEMMs (FlashAttention-3 ping-pong).
  static constexpr bool kPingPong = true;

  // Registers: the producer needs only addresses and loop counters, the consumers the
  // accumulators (O: kD / 2, S: kBlockN / 2, P: kBlockN / 4 a thread). The split uses the SM's
  // 65536 registers: 24 * 128 + 240 * 256 = 64512, 32 * 128 + 160 * 384 = 65536.
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;

  // A panel is 64 columns of 16-bit elements: one 128-byte swizzle span per row.
  static constexpr int kPanelCols = 64;
  static constexpr int kPanels = kD / kPanelCols;
  static constexpr int kRowBytes = 128;
  static constexpr int kQPanelBytes = kBlockM * kRowBytes;
  static constexpr int kKVPanelBytes = kBlockN * kRowBytes;
  static constexpr int kQBytes = kQPanelBytes * kPanels;
  static constexpr int kKVStageBytes = kKVPanelBytes * kPanels;
  // K/V ring depth (a third stage measured no faster on the H200).
  static constexpr int kStages = 2;

  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKVStageBytes;
  static constexpr int kBarOffset = kVOffset + kStages * kKVStageBytes;
  // mbarriers: Q full, then K full, V full, K empty, V empty per stage.
  static constexpr int kNumBarriers = 1 + 4 * kStages;
  // The extra 1024 bytes let the kernel round the dynamic shared-memory base up to the 1024-byte
  // swizzle period.
  static constexpr int kSmemBytes = kBarOffset + 8 * kNumBarriers + 1024;

  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3);
  static_assert(kD % kPanelCols == 0, "head_dim must be a multiple of one 128-byte panel");
  static_assert(kBlockN % 16 == 0 && kD % 16 == 0, "wgmma K extent is 16");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "TMA boxes hold at most 256 rows");
  static_assert(kQPanelBytes % 1024 == 0 && kKVPanelBytes % 1024 == 0,
                "every tile must stay on the 1024-byte swizzle period");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the 227 KB of shared memory a block may use");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 65536);
};

#if JAX_FLASH_SM90A

// ---------------------------------------------------------------------------------------------
// mbarrier, TMA and proxy-fence wrappers (PTX ISA 8.0+, sm_90).

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) and to the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The producer's arrival: announces how many bytes the TMA copies will deliver to `bar`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of `bar` with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// One box of a 4-D tensor map (coordinates innermost first) into shared memory; completion is
// counted in bytes on `bar`. Out-of-range rows arrive as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// One box from shared memory to global; rows outside the tensor are not written.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], "
      "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Shared memory must stay valid until the bulk stores have read it.
__device__ __forceinline__ void tma_store_commit_and_wait_read() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---------------------------------------------------------------------------------------------
// wgmma wrappers.

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The compiler sees a wgmma as an ordinary instruction that reads and writes its registers when
// issued; this empty asm pins those registers at a point (after a wait) so that no access to them
// is moved across the wait.
template <int kN>
__device__ __forceinline__ void fence_operand(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int kRows>
__device__ __forceinline__ void fence_operand(uint32_t (&r)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand: start address >> 4 in bits 0-13,
// leading-dimension byte offset >> 4 in bits 16-29, stride-dimension byte offset >> 4 in bits
// 32-45, base offset 0 (tiles start on the 1024-byte swizzle period) and layout type 1 (128-byte
// swizzle) in bits 62-63. The stride offset is the distance between groups of 8 rows (8 x 128 B).
// The leading offset is ignored for K-major swizzled operands; for the MN-major operand it is the
// distance between 64-column panels along N.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes) {
  constexpr uint64_t kSbo = 1024;
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) | ((kSbo >> 4) << 32) |
         (uint64_t{1} << 62);
}

// Moving a descriptor by a byte offset adds to its start-address field (bits 0-13). Shared
// addresses stay below 2^18, so the sum never carries out of the field.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Operand lists of the accumulator of m64nNk16 with float32 accumulation (N / 2 registers a
// thread), built from chunks of 8 asm operands: JF_DPk names operands %0 .. %(8k - 1), JF_Fk binds
// the first 8k floats of d to them.
#define JF_DC0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define JF_DC1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define JF_DC2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define JF_DC3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define JF_DC4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define JF_DC5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define JF_DC6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define JF_DC7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define JF_DC8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define JF_DC9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define JF_DC10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define JF_DC11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define JF_DC12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define JF_DC13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define JF_DC14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define JF_DC15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define JF_DP4 JF_DC0 ", " JF_DC1 ", " JF_DC2 ", " JF_DC3
#define JF_DP5 JF_DP4 ", " JF_DC4
#define JF_DP8 JF_DP4 ", " JF_DC4 ", " JF_DC5 ", " JF_DC6 ", " JF_DC7
#define JF_DP11 JF_DP8 ", " JF_DC8 ", " JF_DC9 ", " JF_DC10
#define JF_DP16 JF_DP11 ", " JF_DC11 ", " JF_DC12 ", " JF_DC13 ", " JF_DC14 ", " JF_DC15

#define JF_F1_AT(d, i)                                                                      \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define JF_F4_AT(d, i) \
  JF_F1_AT(d, (i) + 0), JF_F1_AT(d, (i) + 8), JF_F1_AT(d, (i) + 16), JF_F1_AT(d, (i) + 24)
#define JF_F4(d) JF_F4_AT(d, 0)
#define JF_F5(d) JF_F4_AT(d, 0), JF_F1_AT(d, 32)
#define JF_F8(d) JF_F4_AT(d, 0), JF_F4_AT(d, 32)
#define JF_F11(d) JF_F8(d), JF_F1_AT(d, 64), JF_F1_AT(d, 72), JF_F1_AT(d, 80)
#define JF_F16(d) JF_F8(d), JF_F4_AT(d, 64), JF_F4_AT(d, 96)

// S = Q K^T: A and B both K-major in shared memory (imm-trans-a = imm-trans-b = 0). Operands
// after the accumulators: %IA = A descriptor, %IB = B descriptor, %IS = scale_d (0 overwrites the
// accumulator, 1 accumulates).
#define JF_WGMMA_SS(N, TY, DP, FOPS, IA, IB, IS)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS                                       \
               ", 0;\n"                                                                       \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" DP "}, %" #IA \
               ", %" #IB ", p, 1, 1, 0, 0;\n}\n"                                              \
               : FOPS(d)                                                                      \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))

// O += P V: A from registers (%A0..%A3: the m16n8k16-style fragment of each warp's 16 rows), B = V
// with N (head_dim) contiguous in shared memory, i.e. MN-major (imm-trans-b = 1).
#define JF_WGMMA_RS(N, TY, DP, FOPS, A0, A1, A2, A3, IB, IS)                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS                                        \
               ", 0;\n"                                                                        \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" DP "}, {%" #A0 \
               ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #IB ", p, 1, 1, 1;\n}\n"                   \
               : FOPS(d)                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

#define JF_SS_CASE(N, DP, FOPS, IA, IB, IS)       \
  if constexpr (kBf16) {                          \
    JF_WGMMA_SS(N, "bf16", DP, FOPS, IA, IB, IS); \
  } else {                                        \
    JF_WGMMA_SS(N, "f16", DP, FOPS, IA, IB, IS);  \
  }
#define JF_RS_CASE(N, DP, FOPS, A0, A1, A2, A3, IB, IS)       \
  if constexpr (kBf16) {                                      \
    JF_WGMMA_RS(N, "bf16", DP, FOPS, A0, A1, A2, A3, IB, IS); \
  } else {                                                    \
    JF_WGMMA_RS(N, "f16", DP, FOPS, A0, A1, A2, A3, IB, IS);  \
  }

template <int kN, typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                         uint32_t scale_d) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kN == 64 || kN == 80 || kN == 128 || kN == 176, "no wgmma_ss wrapper for this N");
  if constexpr (kN == 64) {
    JF_SS_CASE(64, JF_DP4, JF_F4, 32, 33, 34)
  } else if constexpr (kN == 80) {
    JF_SS_CASE(80, JF_DP5, JF_F5, 40, 41, 42)
  } else if constexpr (kN == 128) {
    JF_SS_CASE(128, JF_DP8, JF_F8, 64, 65, 66)
  } else {
    JF_SS_CASE(176, JF_DP11, JF_F11, 88, 89, 90)
  }
}

template <int kN, typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b, uint32_t scale_d) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kN == 64 || kN == 128 || kN == 256, "no wgmma_rs wrapper for this N");
  if constexpr (kN == 64) {
    JF_RS_CASE(64, JF_DP4, JF_F4, 32, 33, 34, 35, 36, 37)
  } else if constexpr (kN == 128) {
    JF_RS_CASE(128, JF_DP8, JF_F8, 64, 65, 66, 67, 68, 69)
  } else {
    JF_RS_CASE(256, JF_DP16, JF_F16, 128, 129, 130, 131, 132, 133)
  }
}

#undef JF_RS_CASE
#undef JF_SS_CASE
#undef JF_WGMMA_RS
#undef JF_WGMMA_SS
#undef JF_F16
#undef JF_F11
#undef JF_F8
#undef JF_F5
#undef JF_F4
#undef JF_F4_AT
#undef JF_F1_AT
#undef JF_DP16
#undef JF_DP11
#undef JF_DP8
#undef JF_DP5
#undef JF_DP4
#undef JF_DC0
#undef JF_DC1
#undef JF_DC2
#undef JF_DC3
#undef JF_DC4
#undef JF_DC5
#undef JF_DC6
#undef JF_DC7
#undef JF_DC8
#undef JF_DC9
#undef JF_DC10
#undef JF_DC11
#undef JF_DC12
#undef JF_DC13
#undef JF_DC14
#undef JF_DC15

// ---------------------------------------------------------------------------------------------
// Consumer pieces. Accumulator layout of m64nNk16 (float32): warp w of the warpgroup owns rows
// 16w..16w+15; lane = 4g + t holds, for i < N/8, acc[4i + e] = (row g, col 8i + 2t + e) and
// acc[4i + 2 + e] = (row g + 8, col 8i + 2t + e), e in {0, 1}. Row r below means g + 8r.

// Named-barrier ids; 0 is __syncthreads.
inline constexpr int kBarSchedBase = 1;     // + consumer warpgroup: its turn to issue wgmma
inline constexpr int kBarEpilogueBase = 4;  // + consumer warpgroup: its own 128 threads

// Number of K/V blocks a query tile starting at m0 must visit. Causal (bottom-right aligned): the
// last row m_last sees keys up to m_last + seqlen_k - seqlen_q, so later blocks are skipped.
template <int kBlockM, int kBlockN, bool kCausal>
__device__ __forceinline__ int visible_key_blocks(int m0, int seqlen_q, int seqlen_k) {
  const int all = (seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (!kCausal) {
    return all;
  } else {
    const int m_last = min(m0 + kBlockM, seqlen_q) - 1;
    const int last_key = m_last + (seqlen_k - seqlen_q);
    if (last_key < 0) return 0;
    return min(all, last_key / kBlockN + 1);
  }
}

// Whether some key of block n0..n0+kBlockN-1 is invisible to some row of the query tile at m0:
// past seqlen_k, or (causal) past the diagonal of the tile's first row.
template <int kBlockN, bool kCausal>
__device__ __forceinline__ bool block_needs_mask(int n0, int m0, int seqlen_q, int seqlen_k) {
  const int n_end = n0 + kBlockN;
  if (n_end > seqlen_k) return true;
  if constexpr (kCausal) return n_end - 1 > m0 + (seqlen_k - seqlen_q);
  return false;
}

// Online softmax of one S tile in base 2 (FlashAttention-2, Algorithm 1, lines 8-10): masks
// invisible keys to -inf, updates the running row max m and partial row sum l, replaces S by
// P = 2^(S * scale_log2 - m) and returns the factor alpha by which O must be rescaled. A row that
// has seen no key keeps m = -inf; its subtraction point is clamped to 0 so that P = 0 and alpha = 0
// come out instead of NaN.
template <int kBlockN, bool kCausal, bool kMask>
__device__ __forceinline__ void online_softmax(float (&s)[kBlockN / 2], float (&m)[2],
                                               float (&l)[2], float (&alpha)[2], int n0, int row,
                                               int t, const FwdWgmmaArgs& args) {
  if constexpr (kMask) {
    const int diag = args.seqlen_k - args.seqlen_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int limit = kCausal ? min(args.seqlen_k, row + 8 * r + diag + 1) : args.seqlen_k;
#pragma unroll
      for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (n0 + 8 * i + 2 * t + e >= limit) s[4 * i + 2 * r + e] = -CUDART_INF_F;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
      mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], mx * args.scale_log2);
    const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
    alpha[r] = tc::fast_exp2(m[r] - m_use);
    m[r] = m_new;
    // Two partial sums halve the dependent-add chain.
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
      const float p0 = tc::fast_exp2(fmaf(s[4 * i + 2 * r], args.scale_log2, -m_use));
      const float p1 = tc::fast_exp2(fmaf(s[4 * i + 2 * r + 1], args.scale_log2, -m_use));
      s[4 * i + 2 * r] = p0;
      s[4 * i + 2 * r + 1] = p1;
      sum0 += p0;
      sum1 += p1;
    }
    l[r] = l[r] * alpha[r] + (sum0 + sum1);
  }
}

template <int kD>
__device__ __forceinline__ void rescale_o(float (&o)[kD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    o[4 * i + 0] *= alpha[0];
    o[4 * i + 1] *= alpha[0];
    o[4 * i + 2] *= alpha[1];
    o[4 * i + 3] *= alpha[1];
  }
}

// The S accumulator columns 16k..16k+15 are exactly the register-A fragment of the k-th wgmma of
// P V: {(g, 2t), (g+8, 2t), (g, 2t+8), (g+8, 2t+8)} pairs = acc[8k + 0..7] in order.
template <int kBlockN, typename T>
__device__ __forceinline__ void convert_p(const float (&s)[kBlockN / 2],
                                          uint32_t (&p)[kBlockN / 16][4]) {
#pragma unroll
  for (int k = 0; k < kBlockN / 16; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[k][j] = tc::pack2<T>(s[8 * k + 2 * j], s[8 * k + 2 * j + 1]);
  }
}

// acc = A B^T over kD columns, A and B K-major in 128-byte-swizzled panels of kAPanel / kBPanel
// bytes: 16 columns per wgmma, the descriptors advance 32 bytes inside a 128-byte row, then jump a
// panel. S = Q K^T here; S^T = K Q^T and dP^T = V dO^T in the backward.
template <int kN, int kD, int kAPanel, int kBPanel, typename T>
__device__ __forceinline__ void wgmma_ss_kmajor(float (&acc)[kN / 2], uint64_t a_desc,
                                                uint64_t b_desc) {
#pragma unroll
  for (int k = 0; k < kD / 16; ++k) {
    const uint32_t within = (k % 4) * 32;
    wgmma_ss<kN, T>(acc, desc_advance(a_desc, (k / 4) * kAPanel + within),
                    desc_advance(b_desc, (k / 4) * kBPanel + within), k > 0 ? 1u : 0u);
  }
}

// acc += A B over kSteps * 16 reduction rows: A from registers (one fragment per k16 step), B
// MN-major, advancing 16 rows of 128 bytes per wgmma. O += P V here; dV += P^T dO and
// dK += dS^T Q in the backward.
template <int kN, int kSteps, typename T>
__device__ __forceinline__ void wgmma_rs_mn(float (&acc)[kN / 2], const uint32_t (&a)[kSteps][4],
                                            uint64_t b_desc) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    wgmma_rs<kN, T>(acc, a[k], desc_advance(b_desc, k * 16 * 128), 1u);
  }
}

// S = Q K^T for this warpgroup's 64 Q rows and the K tile; O += P V over the keys of the tile.
template <class Tr>
__device__ __forceinline__ void issue_qk(float (&s)[Tr::kBlockN / 2], uint64_t q_desc,
                                         uint64_t k_desc) {
  wgmma_ss_kmajor<Tr::kBlockN, Tr::kD, Tr::kQPanelBytes, Tr::kKVPanelBytes, typename Tr::Element>(
      s, q_desc, k_desc);
}
template <class Tr>
__device__ __forceinline__ void issue_pv(float (&o)[Tr::kD / 2],
                                         const uint32_t (&p)[Tr::kBlockN / 16][4],
                                         uint64_t v_desc) {
  wgmma_rs_mn<Tr::kD, Tr::kBlockN / 16, typename Tr::Element>(o, p, v_desc);
}

#endif  // JAX_FLASH_SM90A

// One CTA per (kBlockM-row query tile, query head, batch element); blockIdx.x enumerates the
// query tiles of one head fastest so that the CTAs running together share that head's K/V in L2.
// Warpgroup 0 is the TMA producer, the others the consumers.
template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_wgmma_kernel(const FwdWgmmaArgs args, const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v,
                     const __grid_constant__ CUtensorMap tm_o) {
#if JAX_FLASH_SM90A
  using T = typename Tr::Element;
  constexpr bool kCausal = Tr::kIsCausal;
  constexpr int kD = Tr::kD;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - raw_addr);
  const uint32_t q_smem = base + Tr::kQOffset;
  const uint32_t k_smem = base + Tr::kKOffset;
  const uint32_t v_smem = base + Tr::kVOffset;
  const uint32_t bar_q = base + Tr::kBarOffset;
  const auto bar_k_full = [&](int stage) { return bar_q + 8u * (1 + stage); };
  const auto bar_v_full = [&](int stage) { return bar_q + 8u * (1 + kStages + stage); };
  const auto bar_k_empty = [&](int stage) { return bar_q + 8u * (1 + 2 * kStages + stage); };
  const auto bar_v_empty = [&](int stage) { return bar_q + 8u * (1 + 3 * kStages + stage); };

  const int tile = static_cast<int>(blockIdx.x) % args.m_blocks;
  const int bh = static_cast<int>(blockIdx.x) / args.m_blocks;
  const int head = bh % args.heads_q;
  const int batch = bh / args.heads_q;
  // Causal tiles near the bottom visit the most key blocks: launch them first.
  const int m_block = kCausal ? args.m_blocks - 1 - tile : tile;
  const int m0 = m_block * kBlockM;
  const int n_blocks =
      visible_key_blocks<kBlockM, kBlockN, kCausal>(m0, args.seqlen_q, args.seqlen_k);

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_k_full(s), 1);
      mbar_init(bar_v_full(s), 1);
      // Released by every consumer warp once its wgmmas have read the stage.
      mbar_init(bar_k_empty(s), 4 * Tr::kConsumerWarpgroups);
      mbar_init(bar_v_empty(s), 4 * Tr::kConsumerWarpgroups);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<Tr::kProducerRegs>();
    // A tile whose rows see no key is all zeros / -inf: nothing to load.
    if (threadIdx.x == 0 && n_blocks > 0) {
      prefetch_tensormap(&tm_q);
      prefetch_tensormap(&tm_k);
      prefetch_tensormap(&tm_v);
      const int kv_head = head / args.group;
      mbar_arrive_expect_tx(bar_q, Tr::kQBytes);
#pragma unroll
      for (int p = 0; p < Tr::kPanels; ++p) {
        tma_load_4d(q_smem + p * Tr::kQPanelBytes, &tm_q, bar_q, p * Tr::kPanelCols, head, m0,
                    batch);
      }
      // Key blocks are visited last to first so that the masked ones (diagonal, tail) come first.
      for (int it = 0; it < n_blocks; ++it) {
        const int stage = it % kStages;
        const int n0 = (n_blocks - 1 - it) * kBlockN;
        // Use u = it / kStages of a stage needs the consumers' release of use u - 1.
        const uint32_t empty_parity = ((it / kStages) + 1) & 1;
        if (it >= kStages) mbar_wait(bar_k_empty(stage), empty_parity);
        mbar_arrive_expect_tx(bar_k_full(stage), Tr::kKVStageBytes);
#pragma unroll
        for (int p = 0; p < Tr::kPanels; ++p) {
          tma_load_4d(k_smem + stage * Tr::kKVStageBytes + p * Tr::kKVPanelBytes, &tm_k,
                      bar_k_full(stage), p * Tr::kPanelCols, kv_head, n0, batch);
        }
        if (it >= kStages) mbar_wait(bar_v_empty(stage), empty_parity);
        mbar_arrive_expect_tx(bar_v_full(stage), Tr::kKVStageBytes);
#pragma unroll
        for (int p = 0; p < Tr::kPanels; ++p) {
          tma_load_4d(v_smem + stage * Tr::kKVStageBytes + p * Tr::kKVPanelBytes, &tm_v,
                      bar_v_full(stage), p * Tr::kPanelCols, kv_head, n0, batch);
        }
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - 1;
    const int tid = static_cast<int>(threadIdx.x) % 128;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int t = lane % 4;
    // Query row of acc rows r = 0 (and r = 1 at +8) of this thread.
    const int row = m0 + cw * 64 + warp * 16 + lane / 4;
    // A warpgroup whose 64 rows all lie past seqlen_q (the tail of the last query tile) keeps the
    // barrier protocol (waits, releases, turns) so the others are not blocked, but issues no
    // GEMMs and computes nothing.
    const bool active = m0 + cw * 64 < args.seqlen_q;

    float o[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l[2] = {0.f, 0.f};

    if (n_blocks > 0) {
      float s[kBlockN / 2];
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) s[i] = 0.f;
      uint32_t p[kBlockN / 16][4];
      float alpha[2];

      // Ping-pong (FlashAttention-3, section 3.1): the consumer warpgroups take turns, in a ring,
      // to issue their GEMMs, so that one's softmax runs while another's GEMMs occupy the tensor
      // cores. Turns are numbered 0..n_blocks (QK^T of the first block; QK^T of block it with P V
      // of block it-1; P V of the last block). Warpgroup 0 takes turn 0 freely and the end of
      // each turn opens the next warpgroup's; the arrivals exactly match the waits, so no barrier
      // is left pending when the CTA exits.
      constexpr int kGroups = Tr::kConsumerWarpgroups;
      const int last_turn = n_blocks;
      const auto turn_begin = [&](int turn) {
        if (Tr::kPingPong && (cw > 0 || turn > 0)) named_barrier_sync(kBarSchedBase + cw, 256);
      };
      const auto turn_end = [&](int turn) {
        if (Tr::kPingPong && (cw < kGroups - 1 || turn < last_turn)) {
          named_barrier_arrive(kBarSchedBase + (cw + 1) % kGroups, 256);
        }
      };
      const auto release = [&](uint32_t bar) {
        if (lane == 0) mbar_arrive(bar);
      };

      const uint64_t q_desc = smem_desc_sw128(q_smem + cw * 64 * Tr::kRowBytes, 16);
      const auto k_desc = [&](int stage) {
        return smem_desc_sw128(k_smem + stage * Tr::kKVStageBytes, 16);
      };
      const auto v_desc = [&](int stage) {
        return smem_desc_sw128(v_smem + stage * Tr::kKVStageBytes, Tr::kKVPanelBytes);
      };

      if (!active) {
        // Same waits, releases and turns as below, without the math.
        mbar_wait(bar_k_full(0), 0);
        turn_begin(0);
        turn_end(0);
        release(bar_k_empty(0));
        for (int it = 1; it < n_blocks; ++it) {
          mbar_wait(bar_k_full(it % kStages), (it / kStages) & 1);
          turn_begin(it);
          mbar_wait(bar_v_full((it - 1) % kStages), ((it - 1) / kStages) & 1);
          turn_end(it);
          release(bar_k_empty(it % kStages));
          release(bar_v_empty((it - 1) % kStages));
        }
        mbar_wait(bar_v_full((n_blocks - 1) % kStages), ((n_blocks - 1) / kStages) & 1);
        turn_begin(last_turn);
        turn_end(last_turn);
        release(bar_v_empty((n_blocks - 1) % kStages));
        return;
      }

      mbar_wait(bar_q, 0);

      // Block n_blocks - 1 first: its S is computed and softmaxed before the loop, so that inside
      // the loop the P V of block it-1 runs under the softmax of block it (FlashAttention-3,
      // Algorithm 2).
      {
        mbar_wait(bar_k_full(0), 0);
        turn_begin(0);
        wgmma_fence();
        issue_qk<Tr>(s, q_desc, k_desc(0));
        wgmma_commit();
        turn_end(0);
        wgmma_wait<0>();
        fence_operand(s);
        release(bar_k_empty(0));
        const int n0 = (n_blocks - 1) * kBlockN;
        online_softmax<kBlockN, kCausal, true>(s, m, l, alpha, n0, row, t, args);
        convert_p<kBlockN, T>(s, p);
      }

      for (int it = 1; it < n_blocks; ++it) {
        const int stage = it % kStages;
        const int prev = (it - 1) % kStages;
        const int n0 = (n_blocks - 1 - it) * kBlockN;
        mbar_wait(bar_k_full(stage), (it / kStages) & 1);
        turn_begin(it);
        wgmma_fence();
        issue_qk<Tr>(s, q_desc, k_desc(stage));
        wgmma_commit();
        // O's rescale for block it-1 is done here, hidden under the QK^T just issued.
        rescale_o<kD>(o, alpha);
        mbar_wait(bar_v_full(prev), ((it - 1) / kStages) & 1);
        wgmma_fence();
        issue_pv<Tr>(o, p, v_desc(prev));
        wgmma_commit();
        turn_end(it);

        wgmma_wait<1>();  // S of block it is complete; P V of block it-1 may still run
        fence_operand(s);
        release(bar_k_empty(stage));
        if (block_needs_mask<kBlockN, kCausal>(n0, m0, args.seqlen_q, args.seqlen_k)) {
          online_softmax<kBlockN, kCausal, true>(s, m, l, alpha, n0, row, t, args);
        } else {
          online_softmax<kBlockN, kCausal, false>(s, m, l, alpha, n0, row, t, args);
        }
        wgmma_wait<0>();
        fence_operand(o);
        fence_operand(p);
        release(bar_v_empty(prev));
        convert_p<kBlockN, T>(s, p);
      }

      {
        const int last = (n_blocks - 1) % kStages;
        rescale_o<kD>(o, alpha);
        mbar_wait(bar_v_full(last), ((n_blocks - 1) / kStages) & 1);
        turn_begin(last_turn);
        wgmma_fence();
        issue_pv<Tr>(o, p, v_desc(last));
        wgmma_commit();
        turn_end(last_turn);
        wgmma_wait<0>();
        fence_operand(o);
        fence_operand(p);
        release(bar_v_empty(last));
      }
    }

    if (!active) return;

    // Epilogue: O = acc / l, lse = ln(2) * (m + log2(l)); a row that saw no key gets O = 0 and
    // lse = -inf.
    float inv_l[2];
    float lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv_l[r] = sum > 0.f ? 1.f / sum : 0.f;
      lse[r] = sum > 0.f ? (m[r] + log2f(sum)) * 0.69314718055994531f : -CUDART_INF_F;
    }

    const int g = lane / 4;
    // O goes through this warpgroup's own 64 rows of the Q tile (no longer read by any wgmma)
    // in the same swizzled panel layout, then out with one TMA store per panel, which clips
    // rows past seqlen_q. Row index inside the warpgroup is 16 * warp + g (+8); both have
    // (row % 8) == g, so chunk c of either row sits at c ^ g.
    uint8_t* const o_stage = smem + Tr::kQOffset + cw * 64 * Tr::kRowBytes;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      const int panel = i / 8;
      const int chunk = (i % 8) ^ g;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row_in_wg = warp * 16 + g + 8 * r;
        const uint32_t packed =
            tc::pack2<T>(o[4 * i + 2 * r] * inv_l[r], o[4 * i + 2 * r + 1] * inv_l[r]);
        *reinterpret_cast<uint32_t*>(o_stage + panel * Tr::kQPanelBytes +
                                     row_in_wg * Tr::kRowBytes + chunk * 16 + t * 4) = packed;
      }
    }
    fence_proxy_async_smem();
    named_barrier_sync(kBarEpilogueBase + cw, 128);
    if (tid == 0) {
#pragma unroll
      for (int pnl = 0; pnl < Tr::kPanels; ++pnl) {
        tma_store_4d(&tm_o, q_smem + pnl * Tr::kQPanelBytes + cw * 64 * Tr::kRowBytes,
                     pnl * Tr::kPanelCols, head, m0 + cw * 64, batch);
      }
      tma_store_commit_and_wait_read();
    }
    if (t == 0) {
      float* lse_row = args.lse + (static_cast<int64_t>(batch) * args.heads_q + head) *
                                      static_cast<int64_t>(args.seqlen_q);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (row + 8 * r < args.seqlen_q) lse_row[row + 8 * r] = lse[r];
      }
    }
  }
#endif  // JAX_FLASH_SM90A
}

}  // namespace jax_flash::cuda::sm90
