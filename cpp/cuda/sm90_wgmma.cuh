// Warpgroup MMA (wgmma) on sm_90a, shared by the forward (fwd_wgmma.cuh) and the backward
// (bwd_wgmma.cuh): the fence / commit / wait wrappers, shared-memory matrix descriptors of the
// 128-byte swizzle, the m64nNk16 GEMMs with both operands in shared memory or A in registers, the
// multi-step GEMMs over swizzled panels built from them, and the warp-uniform values the kernels
// branch on.
//
// Consumer pieces. Accumulator layout of m64nNk16 (float32): warp w of the warpgroup owns rows
// 16w..16w+15; lane = 4g + t holds, for i < N/8, acc[4i + e] = (row g, col 8i + 2t + e) and
// acc[4i + 2 + e] = (row g + 8, col 8i + 2t + e), e in {0, 1}. Row r below means g + 8r.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/schedule.h"
#include "cuda/sm90_async.cuh"  // JAX_FLASH_SM90A
#include "cuda/tc_primitives.cuh"

namespace jax_flash::cuda::sm90 {

// The 128-byte swizzle's panel, the unit in which both wgmma families store their tiles and the
// TMA boxes them: 64 columns of 16-bit elements, one 128-byte swizzle span per row, so a row of
// kD columns is kD / 64 panels. The families' traits derive from it.
template <int kD>
struct Sw128Panels {
  static constexpr int kPanelCols = 64;
  static constexpr int kPanels = kD / kPanelCols;
  static constexpr int kRowBytes = 128;
  static_assert(kD % kPanelCols == 0, "head_dim must be a multiple of one 128-byte panel");
};

#if JAX_FLASH_SM90A

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
#define JF_DP2 JF_DC0 ", " JF_DC1
#define JF_DP4 JF_DP2 ", " JF_DC2 ", " JF_DC3
#define JF_DP5 JF_DP4 ", " JF_DC4
#define JF_DP8 JF_DP4 ", " JF_DC4 ", " JF_DC5 ", " JF_DC6 ", " JF_DC7
#define JF_DP11 JF_DP8 ", " JF_DC8 ", " JF_DC9 ", " JF_DC10
#define JF_DP16 JF_DP11 ", " JF_DC11 ", " JF_DC12 ", " JF_DC13 ", " JF_DC14 ", " JF_DC15

#define JF_F1_AT(d, i)                                                                      \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define JF_F2(d) JF_F1_AT(d, 0), JF_F1_AT(d, 8)
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
// TR is the pair imm-trans-a, imm-trans-b: "0, 0" here, other pairs for wgmma_ss_mn.
#define JF_WGMMA_SS(N, TY, DP, FOPS, IA, IB, IS, TR)                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS                                       \
               ", 0;\n"                                                                       \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" DP "}, %" #IA \
               ", %" #IB ", p, 1, 1, " TR ";\n}\n"                                            \
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

#define JF_SS_CASE(N, DP, FOPS, IA, IB, IS, TR)       \
  if constexpr (kBf16) {                              \
    JF_WGMMA_SS(N, "bf16", DP, FOPS, IA, IB, IS, TR); \
  } else {                                            \
    JF_WGMMA_SS(N, "f16", DP, FOPS, IA, IB, IS, TR);  \
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
  static_assert(kN == 32 || kN == 64 || kN == 80 || kN == 128 || kN == 176,
                "no wgmma_ss wrapper for this N");
  if constexpr (kN == 32) {
    JF_SS_CASE(32, JF_DP2, JF_F2, 16, 17, 18, "0, 0")
  } else if constexpr (kN == 64) {
    JF_SS_CASE(64, JF_DP4, JF_F4, 32, 33, 34, "0, 0")
  } else if constexpr (kN == 80) {
    JF_SS_CASE(80, JF_DP5, JF_F5, 40, 41, 42, "0, 0")
  } else if constexpr (kN == 128) {
    JF_SS_CASE(128, JF_DP8, JF_F8, 64, 65, 66, "0, 0")
  } else {
    JF_SS_CASE(176, JF_DP11, JF_F11, 88, 89, 90, "0, 0")
  }
}

// The same with A MN-major (imm-trans-a = 1) and B MN-major too where kMnB (imm-trans-b), for
// the two uses in the backward:
// - kMnB (N 32 / 64): dQ = dS K, A = dS^T read as dS and B = K. An n32 B operand starts 64 bytes
//   into a 128-byte swizzled row for the upper half of a 64-column panel, as a K-major operand's
//   k-steps start 32 bytes in: the hardware applies the swizzle to the address it forms;
// - !kMnB (N 80): dQ^T = K^T dS^T in the 80-query pair, A = K read as K^T and B = dS^T stored as
//   dS.
template <int kN, bool kMnB, typename T>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                            uint32_t scale_d) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kMnB) {
    static_assert(kN == 32 || kN == 64, "no wgmma_ss_mn wrapper for this N");
    if constexpr (kN == 32) {
      JF_SS_CASE(32, JF_DP2, JF_F2, 16, 17, 18, "1, 1")
    } else {
      JF_SS_CASE(64, JF_DP4, JF_F4, 32, 33, 34, "1, 1")
    }
  } else {
    static_assert(kN == 80, "no wgmma_ss_mn wrapper for this N");
    JF_SS_CASE(80, JF_DP5, JF_F5, 40, 41, 42, "1, 0")
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
#undef JF_F2
#undef JF_F1_AT
#undef JF_DP16
#undef JF_DP11
#undef JF_DP8
#undef JF_DP5
#undef JF_DP4
#undef JF_DP2
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

// x, which is the same in every lane, as the compiler sees a warp-uniform value (a warp reduction
// leaves its result in a uniform register). The whole warp must call it.
__device__ __forceinline__ int warp_uniform(int x) { return __reduce_min_sync(0xffffffffu, x); }

__device__ __forceinline__ int64_t warp_uniform(int64_t x) {
  const uint32_t lo = __reduce_min_sync(0xffffffffu, static_cast<uint32_t>(x));
  const uint32_t hi = __reduce_min_sync(0xffffffffu, static_cast<uint32_t>(x >> 32));
  return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

__device__ __forceinline__ SeqTile warp_uniform(const SeqTile& x) {
  const SeqSpan& s = x.span;
  return {{warp_uniform(s.seq), warp_uniform(s.batch), warp_uniform(s.q_start),
           warp_uniform(s.k_start), warp_uniform(s.len_q), warp_uniform(s.len_k),
           warp_uniform(s.stat_start), warp_uniform(s.stat_head)},
          warp_uniform(x.block),
          warp_uniform(static_cast<int>(x.packed)) != 0};
}

#endif  // JAX_FLASH_SM90A

}  // namespace jax_flash::cuda::sm90
