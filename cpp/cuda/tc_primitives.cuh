// Thin wrappers over the sm_80+ warp-level instructions the tensor-core kernels are built from:
// asynchronous global->shared copies, ldmatrix and the m16n8k16 MMA with float32 accumulation.
// Each wrapper is one PTX instruction, so the kernels read like the papers' pseudo-code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_flash::cuda::tc {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global->shared copy that bypasses L1. When `valid` is false the source is not read and
// the destination is zero-filled, which is how out-of-range rows (sequence tails) become zeros.
// The uint32_t overloads take a 32-bit shared-window address (the form the mma.sync kernels keep
// in their loops, one register per address instead of a 64-bit generic pointer).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  cp_async_16(smem_addr(smem_dst), gmem_src, valid);
}
// The same for a stream read once in whole rows of 256 bytes or more (the decode pass's K and V):
// each L2 miss fetches the 256-byte span around it, so a row comes from DRAM in one piece.
__device__ __forceinline__ void cp_async_16_stream(void* smem_dst, const void* gmem_src,
                                                   bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile(
      "cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)),
      "l"(gmem_src), "r"(src_bytes));
}
// 4-byte copy for rows whose base is only 4-byte aligned (lse / delta rows, segment ids).
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) {
  cp_async_4(smem_addr(smem_dst), gmem_src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory; lane l supplies the row address of matrix l / 8.
// The uint32_t overloads take a shared-window address (the tensor-core backward keeps those).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  ldmatrix_x4(r, smem_addr(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  ldmatrix_x4_trans(r, smem_addr(smem_row));
}
// Four 8x8 matrices of 16-bit elements to shared memory (sm_90): lanes 8m..8m+7 address the rows
// of matrix m, and each lane's register m holds 4 bytes of that matrix's row lane / 4, at byte
// 4 (lane % 4). Any 32-bit values travel this way, not only 16-bit pairs.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_row, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  __trap();
#endif
}

// The same, each matrix transposed on its way: lane 4g + t's register m (the row g, columns 2t
// and 2t + 1 of matrix m) lands in column g of rows 2t and 2t + 1 of the rows lanes 8m..8m+7
// address. 16-bit elements only.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_row, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

// D = A * B + D for one 16x8x16 tile: A row-major (4 regs), B column-major (2 regs), D float32.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Packs two float32 values into one register of two 16-bit values (lo in the low half), the
// operand layout the MMA expects; used to feed P back into the next MMA without shared memory.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Fire-and-forget fp32 reduction of one float into global memory.
__device__ __forceinline__ void red_add_f32(float* gmem, float a) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem), "f"(a) : "memory");
}

// Fire-and-forget fp32 reduction of two adjacent floats into global memory: Hopper has a
// 2-wide vector form, which halves the number of reduction messages for dQ.
__device__ __forceinline__ void red_add_f32x2(float* gmem, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(gmem), "f"(a), "f"(b) : "memory");
#else
  red_add_f32(gmem, a);
  red_add_f32(gmem + 1, b);
#endif
}

// 2^x on the special-function unit. Softmax works in base 2 with log2(e) folded into the scale,
// so each score costs one FMA and one ex2 instead of a multiply and a full-precision expf. (Part of
// a row's exponentials as a polynomial on the FMA pipe instead measured slower in the forward at
// head_dim 64 and with softcap, where the unit was thought the limit: docs/PERF_LOG.md.)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh on the special-function unit (maximum relative error about 2^-11, bf16-level): logit
// soft-capping's s = c * tanh(x / c). Every tensor-core kernel (mma.sync and wgmma, forward and
// backward) and the decode kernel use this one function, so the backward's recomputed
// P = exp(s - lse) matches the forward's lse whichever kernel ran the forward. (tanh.approx.f16x2
// is no faster: on sm_90a it compiles to two MUFU.TANH.F16, one per half.)
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The mask variants both mma.sync directions are instantiated for, as X(T, D, kBand, kSegments,
// kSoftcap): (kBand, kSegments) in {(0, 0), (1, 0), (1, 1)}, each with and without kSoftcap.
#define JAX_FLASH_TC_FLAGS(X, T, D) \
  X(T, D, false, false, false)      \
  X(T, D, false, false, true)       \
  X(T, D, true, false, false)       \
  X(T, D, true, false, true)        \
  X(T, D, true, true, false)        \
  X(T, D, true, true, true)

// Shared-memory loads and stores at a shared-window address, as opaque asm: the compiler neither
// caches nor reorders them across other asm, which the kernels rely on where they re-read a value
// instead of keeping it in a register.
__device__ __forceinline__ int ld_shared_s32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ int64_t ld_shared_s64(uint32_t addr) {
  int64_t v;
  asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ int2 ld_shared_v2s32(uint32_t addr) {
  int2 v;
  asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_b128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}
__device__ __forceinline__ void st_shared_s64(uint32_t addr, int64_t value) {
  asm volatile("st.shared.s64 [%0], %1;\n" ::"r"(addr), "l"(value));
}

}  // namespace jax_flash::cuda::tc
