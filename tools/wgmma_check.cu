// Standalone correctness and timing driver for the Hopper wgmma forward (cpp/cuda/fwd_wgmma.*),
// independent of JAX and of the default dispatch. Needs an sm_90 GPU.
//
// Build (from the repository root):
//   nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a tools/wgmma_check.cu \
//       cpp/cuda/fwd_wgmma.cu cpp/cuda/sm90_host.cu -o wgmma_check
// Run: ./wgmma_check [--quick]   (--quick: a few small cases, no timing; for compute-sanitizer)
//
// Part 1 compares O and lse with a naive float32 reference on the GPU (one thread per query row)
// over awkward shapes and fails (exit 1) on relative L2 error of O above 1e-2, any NaN, an lse
// mismatch, a nonzero O in a row that sees no key, or two runs that differ in any bit.
// Part 2 times the kernel: median over 10 repeats of 20 back-to-back launches after warm-up;
// TFLOP/s = 4 * B * H * S * S * D / time, halved for causal.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/params.h"
#include "cuda/fwd_wgmma.h"
#include "cuda_check.h"

namespace {

using jax_flash::DType;
using jax_flash::FwdParams;

__host__ __device__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Standard normal samples (Box-Muller on two hashed uniforms) times `amp`, rounded to T.
template <typename T>
__global__ void fill_normal(T* x, int64_t n, uint64_t seed, float amp) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(h >> 40) + 1.f) * (1.f / 16777217.f);
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) * (1.f / 16777216.f);
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    x[i] = static_cast<T>(amp * z);
  }
}

template <typename T>
__device__ float to_float(T x) {
  return static_cast<float>(x);
}

// Naive attention in float32 from the same rounded inputs: one thread per (batch, head, query).
template <typename T>
__global__ void reference_fwd(const T* q, const T* k, const T* v, float* o, float* lse, int batch,
                              int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
                              float scale, bool causal) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(batch) * heads_q * seqlen_q) return;
  const int i = static_cast<int>(idx % seqlen_q);
  const int h = static_cast<int>((idx / seqlen_q) % heads_q);
  const int b = static_cast<int>(idx / (static_cast<int64_t>(seqlen_q) * heads_q));
  const int hk = h / (heads_q / heads_kv);
  const int last = causal ? min(seqlen_k - 1, i + seqlen_k - seqlen_q) : seqlen_k - 1;
  const T* qrow = q + ((static_cast<int64_t>(b) * seqlen_q + i) * heads_q + h) * head_dim;
  float* orow = o + ((static_cast<int64_t>(b) * seqlen_q + i) * heads_q + h) * head_dim;
  float* lse_out = lse + (static_cast<int64_t>(b) * heads_q + h) * seqlen_q + i;
  if (last < 0) {
    for (int d = 0; d < head_dim; ++d) orow[d] = 0.f;
    *lse_out = -INFINITY;
    return;
  }
  float qf[256];
  float acc[256];
  for (int d = 0; d < head_dim; ++d) {
    qf[d] = to_float(qrow[d]);
    acc[d] = 0.f;
  }
  const auto score = [&](int j) {
    const T* krow = k + ((static_cast<int64_t>(b) * seqlen_k + j) * heads_kv + hk) * head_dim;
    float dot = 0.f;
    for (int d = 0; d < head_dim; ++d) dot += qf[d] * to_float(krow[d]);
    return dot * scale;
  };
  float mx = -INFINITY;
  for (int j = 0; j <= last; ++j) mx = fmaxf(mx, score(j));
  float sum = 0.f;
  for (int j = 0; j <= last; ++j) {
    const float p = expf(score(j) - mx);
    sum += p;
    const T* vrow = v + ((static_cast<int64_t>(b) * seqlen_k + j) * heads_kv + hk) * head_dim;
    for (int d = 0; d < head_dim; ++d) acc[d] += p * to_float(vrow[d]);
  }
  for (int d = 0; d < head_dim; ++d) orow[d] = acc[d] / sum;
  *lse_out = mx + logf(sum);
}

template <typename T>
__global__ void widen(const T* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = static_cast<float>(x[i]);
  }
}

struct Tensors {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  ~Tensors() {
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(lse);
  }
};

const char* dtype_name(DType t) { return t == DType::kBF16 ? "bf16" : "fp16"; }

template <typename T>
void fill(void* x, int64_t n, uint64_t seed, float amp) {
  fill_normal<T><<<1024, 256>>>(static_cast<T*>(x), n, seed, amp);
  CHECK_CUDA(cudaGetLastError());
}

void fill_dtype(DType t, void* x, int64_t n, uint64_t seed, float amp) {
  if (t == DType::kBF16) {
    fill<__nv_bfloat16>(x, n, seed, amp);
  } else {
    fill<__half>(x, n, seed, amp);
  }
}

// Allocates and fills Q, K, V with N(0, amp^2); O and lse are allocated but left to the caller.
void make_inputs(Tensors& t, const FwdParams& p, DType dtype, uint64_t seed, float amp) {
  const int64_t nq = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const int64_t nk = p.batch * p.seqlen_k * p.heads_kv * p.head_dim;
  CHECK_CUDA(cudaMalloc(&t.q, std::max<int64_t>(nq, 1) * 2));
  CHECK_CUDA(cudaMalloc(&t.k, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMalloc(&t.v, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMalloc(&t.o, std::max<int64_t>(nq, 1) * 2));
  CHECK_CUDA(cudaMalloc(&t.lse, std::max<int64_t>(p.batch * p.heads_q * p.seqlen_q, 1) * 4));
  fill_dtype(dtype, t.q, nq, seed * 3 + 0, amp);
  fill_dtype(dtype, t.k, nk, seed * 3 + 1, amp);
  fill_dtype(dtype, t.v, nk, seed * 3 + 2, 1.f);
}

struct Case {
  DType dtype;
  int head_dim;
  bool causal;
  int seqlen_q, seqlen_k;
  int heads_q, heads_kv;
  float amp;
};

bool run_case(const Case& c, int index) {
  FwdParams p{};
  p.batch = 2;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  p.causal = c.causal;
  Tensors t;
  make_inputs(t, p, c.dtype, 1000 + index, c.amp);
  p.q = t.q;
  p.k = t.k;
  p.v = t.v;
  p.o = t.o;
  p.lse = t.lse;

  std::printf("D=%3d %s %-6s Sq=%4d Sk=%4d Hq=%d Hkv=%d amp=%g: ", c.head_dim, dtype_name(c.dtype),
              c.causal ? "causal" : "full", c.seqlen_q, c.seqlen_k, c.heads_q, c.heads_kv, c.amp);
  if (!jax_flash::cuda::fwd_wgmma_supported(p, c.dtype)) {
    std::printf("NOT SUPPORTED -> FAIL\n");
    return false;
  }

  const int64_t nq = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const int64_t nl = p.batch * p.heads_q * p.seqlen_q;
  float *o_ref = nullptr, *lse_ref = nullptr, *o_wide = nullptr;
  CHECK_CUDA(cudaMalloc(&o_ref, nq * 4));
  CHECK_CUDA(cudaMalloc(&lse_ref, nl * 4));
  CHECK_CUDA(cudaMalloc(&o_wide, nq * 4));
  const unsigned ref_blocks = static_cast<unsigned>((nl + 127) / 128);
  const float scale = static_cast<float>(p.softmax_scale);
  if (c.dtype == DType::kBF16) {
    reference_fwd<__nv_bfloat16><<<ref_blocks, 128>>>(
        static_cast<const __nv_bfloat16*>(t.q), static_cast<const __nv_bfloat16*>(t.k),
        static_cast<const __nv_bfloat16*>(t.v), o_ref, lse_ref, 2, c.seqlen_q, c.seqlen_k,
        c.heads_q, c.heads_kv, c.head_dim, scale, c.causal);
  } else {
    reference_fwd<__half>
        <<<ref_blocks, 128>>>(static_cast<const __half*>(t.q), static_cast<const __half*>(t.k),
                              static_cast<const __half*>(t.v), o_ref, lse_ref, 2, c.seqlen_q,
                              c.seqlen_k, c.heads_q, c.heads_kv, c.head_dim, scale, c.causal);
  }
  CHECK_CUDA(cudaGetLastError());

  // Poison the outputs (all-ones bits are NaN in every format) so unwritten elements show up.
  std::vector<uint16_t> o_first(nq);
  std::vector<float> lse_first(nl);
  bool deterministic = true;
  for (int run = 0; run < 2; ++run) {
    CHECK_CUDA(cudaMemset(t.o, 0xFF, nq * 2));
    CHECK_CUDA(cudaMemset(t.lse, 0xFF, nl * 4));
    CHECK_CUDA(jax_flash::cuda::fwd_wgmma(p, c.dtype, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    if (run == 0) {
      CHECK_CUDA(cudaMemcpy(o_first.data(), t.o, nq * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(lse_first.data(), t.lse, nl * 4, cudaMemcpyDeviceToHost));
    } else {
      std::vector<uint16_t> o_second(nq);
      std::vector<float> lse_second(nl);
      CHECK_CUDA(cudaMemcpy(o_second.data(), t.o, nq * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(lse_second.data(), t.lse, nl * 4, cudaMemcpyDeviceToHost));
      deterministic = std::memcmp(o_first.data(), o_second.data(), nq * 2) == 0 &&
                      std::memcmp(lse_first.data(), lse_second.data(), nl * 4) == 0;
    }
  }
  if (c.dtype == DType::kBF16) {
    widen<__nv_bfloat16><<<1024, 256>>>(static_cast<const __nv_bfloat16*>(t.o), o_wide, nq);
  } else {
    widen<__half><<<1024, 256>>>(static_cast<const __half*>(t.o), o_wide, nq);
  }
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> o_h(nq), o_r(nq), l_h(nl), l_r(nl);
  CHECK_CUDA(cudaMemcpy(o_h.data(), o_wide, nq * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o_r.data(), o_ref, nq * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(l_h.data(), t.lse, nl * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(l_r.data(), lse_ref, nl * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(o_ref));
  CHECK_CUDA(cudaFree(lse_ref));
  CHECK_CUDA(cudaFree(o_wide));

  int64_t nan_count = 0;
  double err2 = 0.0, ref2 = 0.0, max_abs = 0.0;
  for (int64_t i = 0; i < nq; ++i) {
    if (std::isnan(o_h[i]) || std::isinf(o_h[i])) {
      ++nan_count;
      continue;
    }
    const double d = static_cast<double>(o_h[i]) - o_r[i];
    err2 += d * d;
    ref2 += static_cast<double>(o_r[i]) * o_r[i];
    max_abs = std::max(max_abs, std::fabs(d));
  }
  // lse: -inf exactly where the row sees no key (and O must then be exactly 0 there).
  int64_t lse_bad = 0, masked_rows = 0, masked_nonzero = 0;
  double lse_max_err = 0.0;
  const int64_t sq = p.seqlen_q;
  for (int64_t r = 0; r < nl; ++r) {
    if (std::isnan(l_h[r])) {
      ++nan_count;
      continue;
    }
    if (std::isinf(l_r[r])) {
      ++masked_rows;
      if (!(std::isinf(l_h[r]) && l_h[r] < 0)) ++lse_bad;
      const int64_t i = r % sq, h = (r / sq) % p.heads_q, b = r / (sq * p.heads_q);
      const float* orow = o_h.data() + ((b * sq + i) * p.heads_q + h) * p.head_dim;
      for (int d = 0; d < c.head_dim; ++d) masked_nonzero += orow[d] != 0.f;
      continue;
    }
    const double e = std::fabs(static_cast<double>(l_h[r]) - l_r[r]);
    lse_max_err = std::max(lse_max_err, std::isfinite(e) ? e : 1e30);
    if (!(e <= 1e-3 * std::max(1.0, std::fabs(static_cast<double>(l_r[r]))))) ++lse_bad;
  }
  const double rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  const bool ok =
      nan_count == 0 && rel_l2 <= 1e-2 && lse_bad == 0 && masked_nonzero == 0 && deterministic;
  std::printf(
      "max_abs=%.3e rel_l2=%.3e lse_max_err=%.2e masked_rows=%lld nan=%lld lse_bad=%lld "
      "masked_nonzero=%lld det=%d %s\n",
      max_abs, rel_l2, lse_max_err, static_cast<long long>(masked_rows),
      static_cast<long long>(nan_count), static_cast<long long>(lse_bad),
      static_cast<long long>(masked_nonzero), deterministic ? 1 : 0, ok ? "ok" : "FAIL");
  return ok;
}

void time_case(int head_dim, int batch, int heads, int seqlen, bool causal) {
  FwdParams p{};
  p.batch = batch;
  p.seqlen_q = seqlen;
  p.seqlen_k = seqlen;
  p.heads_q = heads;
  p.heads_kv = heads;
  p.head_dim = head_dim;
  p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  p.causal = causal;
  Tensors t;
  make_inputs(t, p, DType::kBF16, 7, 1.f);
  p.q = t.q;
  p.k = t.k;
  p.v = t.v;
  p.o = t.o;
  p.lse = t.lse;
  std::printf("bf16 D=%3d B=%2d H=%2d S=%5d %-6s: ", head_dim, batch, heads, seqlen,
              causal ? "causal" : "full");
  if (!jax_flash::cuda::fwd_wgmma_supported(p, DType::kBF16)) {
    std::printf("not supported\n");
    return;
  }
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) CHECK_CUDA(jax_flash::cuda::fwd_wgmma(p, DType::kBF16, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  constexpr int kRepeats = 10;
  constexpr int kLaunches = 20;
  std::vector<float> ms(kRepeats);
  for (int r = 0; r < kRepeats; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < kLaunches; ++i) {
      CHECK_CUDA(jax_flash::cuda::fwd_wgmma(p, DType::kBF16, nullptr));
    }
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    CHECK_CUDA(cudaEventElapsedTime(&ms[r], start, stop));
    ms[r] /= kLaunches;
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  const double median_ms = 0.5 * (ms[kRepeats / 2 - 1] + ms[kRepeats / 2]);
  const double flops =
      4.0 * batch * heads * static_cast<double>(seqlen) * seqlen * head_dim * (causal ? 0.5 : 1.0);
  std::printf("%8.3f ms  %6.1f TFLOP/s\n", median_ms, flops / (median_ms * 1e-3) / 1e12);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);

  // 4400 and 4500 keys reach the long-key tiles (seqlen_k >= kLongKeys = 4096).
  const int seq_pairs[][2] = {{1, 1},      {17, 17},     {128, 128},  {257, 257},   {1000, 1000},
                              {1, 1000},   {1000, 1},    {17, 257},   {257, 17},    {300, 1000},
                              {1000, 300}, {2125, 2125}, {300, 4400}, {4500, 4500}, {4500, 300}};
  const int quick_pairs[][2] = {{17, 17}, {257, 129}, {129, 257}, {1, 300}};
  std::vector<Case> cases;
  for (int head_dim : {128, 64, 256}) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      for (bool causal : {false, true}) {
        if (quick) {
          for (const auto& sp : quick_pairs) {
            cases.push_back({dtype, head_dim, causal, sp[0], sp[1], 4, 2, 1.f});
          }
          continue;
        }
        for (const auto& sp : seq_pairs) {
          for (int heads_kv : {4, 2}) {
            cases.push_back({dtype, head_dim, causal, sp[0], sp[1], 4, heads_kv, 1.f});
          }
        }
        // Large logits: the running max must keep exp2 from overflowing.
        cases.push_back({dtype, head_dim, causal, 333, 517, 4, 1, 6.f});
      }
    }
  }
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i)
    failures += run_case(cases[i], static_cast<int>(i)) ? 0 : 1;
  std::printf("%d of %zu cases failed\n", failures, cases.size());

  if (!quick) {
    const int seqlens[] = {1024, 2048, 4096, 16384};
    for (int head_dim : {128, 64, 256}) {
      const int heads = 2048 / head_dim;
      for (bool causal : {false, true}) {
        for (int s : seqlens) time_case(head_dim, 16384 / s, heads, s, causal);
      }
    }
  }
  return failures == 0 ? 0 : 1;
}
