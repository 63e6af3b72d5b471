// Standalone correctness and timing driver for the Hopper wgmma backward
// (cpp/cuda/bwd_wgmma.*), independent of JAX. Needs an sm_90 GPU.
//
// Build (from the repository root):
//   nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a tools/bwd_wgmma_check.cu \
//       cpp/cuda/bwd_wgmma.cu cpp/cuda/sm90_host.cu -o bwd_wgmma_check
// Run: ./bwd_wgmma_check [--quick]   (--quick: correctness only, no timing)
//
// Part 1 builds lse and delta = rowsum(dO * O) with a naive float32 forward on the GPU, then
// compares dQ, dK, dV of bwd_wgmma (bf16) against a naive float32 backward (one thread per query
// row, dK / dV by float atomics) over head_dim 128 and 64, causal and not, awkward lengths, Sq !=
// Sk both ways and GQA 2:1; it fails (exit 1) on a relative L2 error above 2e-2 or any NaN. Part 2
// times the standard grid's 4k cells, B=4, S=4096, H = 2048 / D for D = 128 and 64, bf16: median
// of 10 repeats of 10 back-to-back calls; TFLOP/s = 2.5 * 4 * B * H * S * S * D / time, halved for
// causal.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/params.h"
#include "cuda/bwd_wgmma.h"
#include "cuda_check.h"

namespace {

using jax_flash::BwdParams;
using jax_flash::DType;

constexpr int kMaxD = 128;

struct Shape {
  int batch, sq, sk, hq, hkv, d;
  bool causal;
};

__device__ __forceinline__ bool visible(int i, int j, int sq, int sk, bool causal) {
  return !causal || j <= i + (sk - sq);
}

// One thread per (batch, query head, query row): lse (natural log, -inf for a row that sees no
// key) and delta = rowsum(dO * O) with O = softmax(S) V in float32.
__global__ void ref_forward(Shape sh, float scale, const __nv_bfloat16* q, const __nv_bfloat16* k,
                            const __nv_bfloat16* v, const __nv_bfloat16* dout, float* lse,
                            float* delta) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(sh.batch) * sh.hq * sh.sq) return;
  const int i = static_cast<int>(idx % sh.sq);
  const int h = static_cast<int>((idx / sh.sq) % sh.hq);
  const int b = static_cast<int>(idx / (static_cast<int64_t>(sh.sq) * sh.hq));
  const int hk = h / (sh.hq / sh.hkv);
  const int d = sh.d;
  const __nv_bfloat16* qi = q + ((static_cast<int64_t>(b) * sh.sq + i) * sh.hq + h) * d;
  const __nv_bfloat16* doi = dout + ((static_cast<int64_t>(b) * sh.sq + i) * sh.hq + h) * d;
  float m = -INFINITY;
  for (int j = 0; j < sh.sk; ++j) {
    if (!visible(i, j, sh.sq, sh.sk, sh.causal)) continue;
    const __nv_bfloat16* kj = k + ((static_cast<int64_t>(b) * sh.sk + j) * sh.hkv + hk) * d;
    float s = 0.f;
    for (int c = 0; c < d; ++c) s += __bfloat162float(qi[c]) * __bfloat162float(kj[c]);
    m = fmaxf(m, s * scale);
  }
  float o[kMaxD];
  for (int c = 0; c < d; ++c) o[c] = 0.f;
  float l = 0.f;
  if (m != -INFINITY) {
    for (int j = 0; j < sh.sk; ++j) {
      if (!visible(i, j, sh.sq, sh.sk, sh.causal)) continue;
      const int64_t kv_off = ((static_cast<int64_t>(b) * sh.sk + j) * sh.hkv + hk) * d;
      float s = 0.f;
      for (int c = 0; c < d; ++c) s += __bfloat162float(qi[c]) * __bfloat162float(k[kv_off + c]);
      const float p = expf(s * scale - m);
      l += p;
      for (int c = 0; c < d; ++c) o[c] += p * __bfloat162float(v[kv_off + c]);
    }
  }
  float dl = 0.f;
  if (l > 0.f) {
    // O is rounded to bf16 as the forward would store it.
    for (int c = 0; c < d; ++c) {
      dl += __bfloat162float(__float2bfloat16(o[c] / l)) * __bfloat162float(doi[c]);
    }
  }
  const int64_t stat = (static_cast<int64_t>(b) * sh.hq + h) * sh.sq + i;
  lse[stat] = l > 0.f ? m + logf(l) : -INFINITY;
  delta[stat] = dl;
}

// One thread per (batch, query head, query row): dQ row directly, dK / dV by float atomics.
__global__ void ref_backward(Shape sh, float scale, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse,
                             const float* delta, float* dq, float* dk, float* dv) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(sh.batch) * sh.hq * sh.sq) return;
  const int i = static_cast<int>(idx % sh.sq);
  const int h = static_cast<int>((idx / sh.sq) % sh.hq);
  const int b = static_cast<int>(idx / (static_cast<int64_t>(sh.sq) * sh.hq));
  const int hk = h / (sh.hq / sh.hkv);
  const int d = sh.d;
  const int64_t q_off = ((static_cast<int64_t>(b) * sh.sq + i) * sh.hq + h) * d;
  const int64_t stat = (static_cast<int64_t>(b) * sh.hq + h) * sh.sq + i;
  const float l = lse[stat];
  const float dl = delta[stat];
  float acc[kMaxD];
  for (int c = 0; c < d; ++c) acc[c] = 0.f;
  if (l != -INFINITY) {
    for (int j = 0; j < sh.sk; ++j) {
      if (!visible(i, j, sh.sq, sh.sk, sh.causal)) continue;
      const int64_t kv_off = ((static_cast<int64_t>(b) * sh.sk + j) * sh.hkv + hk) * d;
      float s = 0.f;
      float dp = 0.f;
      for (int c = 0; c < d; ++c) {
        s += __bfloat162float(q[q_off + c]) * __bfloat162float(k[kv_off + c]);
        dp += __bfloat162float(dout[q_off + c]) * __bfloat162float(v[kv_off + c]);
      }
      const float p = expf(s * scale - l);
      const float ds = p * (dp - dl);
      for (int c = 0; c < d; ++c) {
        acc[c] += scale * ds * __bfloat162float(k[kv_off + c]);
        atomicAdd(dk + kv_off + c, scale * ds * __bfloat162float(q[q_off + c]));
        atomicAdd(dv + kv_off + c, p * __bfloat162float(dout[q_off + c]));
      }
    }
  }
  for (int c = 0; c < d; ++c) dq[q_off + c] = acc[c];
}

std::vector<__nv_bfloat16> random_bf16(int64_t n, uint64_t seed) {
  std::vector<__nv_bfloat16> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float u = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24);
    out[i] = __float2bfloat16(2.f * u - 1.f);
  }
  return out;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) {
    CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, int64_t n) {
  std::vector<T> h(n);
  if (n > 0) CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// ||got - ref|| / max(||ref||, kGradFloor * sqrt(n)) of a bf16 result against a float32
// reference; NaN on any non-finite output. The floor (as in tests/conftest.py) keeps gradients
// that are exactly 0 in exact arithmetic, such as dQ and dK of a row that sees a single key, from
// turning rounding noise into an infinite relative error.
constexpr double kGradFloor = 0.1;

double rel_l2(const std::vector<__nv_bfloat16>& got, const std::vector<float>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = __bfloat162float(got[i]);
    if (!std::isfinite(g)) return NAN;
    num += (g - ref[i]) * (g - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  den = std::max(den, kGradFloor * kGradFloor * static_cast<double>(ref.size()));
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

struct Buffers {
  __nv_bfloat16 *q, *k, *v, *dout, *dq, *dk, *dv;
  float *lse, *delta, *dq_accum;
};

Buffers make_buffers(const Shape& sh, uint64_t seed) {
  const int64_t nq = static_cast<int64_t>(sh.batch) * sh.sq * sh.hq * sh.d;
  const int64_t nk = static_cast<int64_t>(sh.batch) * sh.sk * sh.hkv * sh.d;
  const int64_t ns = static_cast<int64_t>(sh.batch) * sh.hq * sh.sq;
  Buffers b;
  b.q = to_device(random_bf16(nq, seed + 1));
  b.k = to_device(random_bf16(nk, seed + 2));
  b.v = to_device(random_bf16(nk, seed + 3));
  b.dout = to_device(random_bf16(nq, seed + 4));
  CHECK_CUDA(cudaMalloc(&b.dq, std::max<int64_t>(nq, 1) * 2));
  CHECK_CUDA(cudaMalloc(&b.dk, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMalloc(&b.dv, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMalloc(&b.lse, std::max<int64_t>(ns, 1) * 4));
  CHECK_CUDA(cudaMalloc(&b.delta, std::max<int64_t>(ns, 1) * 4));
  CHECK_CUDA(cudaMalloc(&b.dq_accum, std::max<int64_t>(nq, 1) * 4));
  return b;
}

void free_buffers(Buffers& b) {
  CHECK_CUDA(cudaFree(b.q));
  CHECK_CUDA(cudaFree(b.k));
  CHECK_CUDA(cudaFree(b.v));
  CHECK_CUDA(cudaFree(b.dout));
  CHECK_CUDA(cudaFree(b.dq));
  CHECK_CUDA(cudaFree(b.dk));
  CHECK_CUDA(cudaFree(b.dv));
  CHECK_CUDA(cudaFree(b.lse));
  CHECK_CUDA(cudaFree(b.delta));
  CHECK_CUDA(cudaFree(b.dq_accum));
}

BwdParams make_params(const Shape& sh, const Buffers& b, float scale) {
  BwdParams p;
  p.q = b.q;
  p.k = b.k;
  p.v = b.v;
  p.dout = b.dout;
  p.lse = b.lse;
  p.delta = b.delta;
  p.dq = b.dq;
  p.dk = b.dk;
  p.dv = b.dv;
  p.dq_accum = b.dq_accum;
  p.batch = sh.batch;
  p.seqlen_q = sh.sq;
  p.seqlen_k = sh.sk;
  p.heads_q = sh.hq;
  p.heads_kv = sh.hkv;
  p.head_dim = sh.d;
  p.softmax_scale = scale;
  p.causal = sh.causal;
  return p;
}

bool check_case(const Shape& sh, uint64_t seed) {
  const float scale = 1.f / std::sqrt(static_cast<float>(sh.d));
  const int64_t nq = static_cast<int64_t>(sh.batch) * sh.sq * sh.hq * sh.d;
  const int64_t nk = static_cast<int64_t>(sh.batch) * sh.sk * sh.hkv * sh.d;
  const int64_t rows = static_cast<int64_t>(sh.batch) * sh.hq * sh.sq;
  Buffers b = make_buffers(sh, seed);
  float *rdq = nullptr, *rdk = nullptr, *rdv = nullptr;
  CHECK_CUDA(cudaMalloc(&rdq, std::max<int64_t>(nq, 1) * 4));
  CHECK_CUDA(cudaMalloc(&rdk, std::max<int64_t>(nk, 1) * 4));
  CHECK_CUDA(cudaMalloc(&rdv, std::max<int64_t>(nk, 1) * 4));
  CHECK_CUDA(cudaMemset(rdk, 0, std::max<int64_t>(nk, 1) * 4));
  CHECK_CUDA(cudaMemset(rdv, 0, std::max<int64_t>(nk, 1) * 4));
  // Poison the outputs so that unwritten elements show up.
  CHECK_CUDA(cudaMemset(b.dq, 0xFF, std::max<int64_t>(nq, 1) * 2));
  CHECK_CUDA(cudaMemset(b.dk, 0xFF, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMemset(b.dv, 0xFF, std::max<int64_t>(nk, 1) * 2));
  const unsigned grid = static_cast<unsigned>((rows + 127) / 128);
  if (rows > 0) {
    ref_forward<<<grid, 128>>>(sh, scale, b.q, b.k, b.v, b.dout, b.lse, b.delta);
    CHECK_CUDA(cudaGetLastError());
    ref_backward<<<grid, 128>>>(sh, scale, b.q, b.k, b.v, b.dout, b.lse, b.delta, rdq, rdk, rdv);
    CHECK_CUDA(cudaGetLastError());
  }
  const BwdParams p = make_params(sh, b, scale);
  if (!jax_flash::cuda::bwd_wgmma_supported(p, DType::kBF16)) {
    std::printf("FAIL unsupported B=%d Sq=%d Sk=%d Hq=%d Hkv=%d D=%d causal=%d\n", sh.batch, sh.sq,
                sh.sk, sh.hq, sh.hkv, sh.d, sh.causal);
    return false;
  }
  CHECK_CUDA(jax_flash::cuda::bwd_wgmma(p, DType::kBF16, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const double edq = rel_l2(to_host(b.dq, nq), to_host(rdq, nq));
  const double edk = rel_l2(to_host(b.dk, nk), to_host(rdk, nk));
  const double edv = rel_l2(to_host(b.dv, nk), to_host(rdv, nk));
  const double worst = std::max({edq, edk, edv});
  const bool ok = std::isfinite(edq) && std::isfinite(edk) && std::isfinite(edv) && worst <= 2e-2;
  std::printf("%s B=%d Sq=%d Sk=%d Hq=%d Hkv=%d D=%d causal=%d  dq %.2e dk %.2e dv %.2e\n",
              ok ? "ok  " : "FAIL", sh.batch, sh.sq, sh.sk, sh.hq, sh.hkv, sh.d, sh.causal, edq,
              edk, edv);
  CHECK_CUDA(cudaFree(rdq));
  CHECK_CUDA(cudaFree(rdk));
  CHECK_CUDA(cudaFree(rdv));
  free_buffers(b);
  return ok;
}

// The standard grid's 4k cell: 16k tokens (B = 4) and hidden 2048 (H = 2048 / D).
void time_case(int d, bool causal) {
  const int heads = 2048 / d;
  const Shape sh{4, 4096, 4096, heads, heads, d, causal};
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  Buffers b = make_buffers(sh, 7);
  const int64_t rows = static_cast<int64_t>(sh.batch) * sh.hq * sh.sq;
  // Realistic lse / delta: the reference forward (slow but run once).
  ref_forward<<<static_cast<unsigned>((rows + 127) / 128), 128>>>(sh, scale, b.q, b.k, b.v, b.dout,
                                                                  b.lse, b.delta);
  CHECK_CUDA(cudaGetLastError());
  const BwdParams p = make_params(sh, b, scale);
  for (int i = 0; i < 3; ++i) CHECK_CUDA(jax_flash::cuda::bwd_wgmma(p, DType::kBF16, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  constexpr int kCalls = 10;
  std::vector<float> ms;
  for (int rep = 0; rep < 10; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < kCalls; ++i) {
      CHECK_CUDA(jax_flash::cuda::bwd_wgmma(p, DType::kBF16, nullptr));
    }
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t / kCalls);
  }
  std::sort(ms.begin(), ms.end());
  const double t = ms[ms.size() / 2] * 1e-3;
  double flops = 2.5 * 4.0 * sh.batch * sh.hq * static_cast<double>(sh.sq) * sh.sk * sh.d;
  if (causal) flops *= 0.5;
  std::printf("time B=4 H=%d S=4096 D=%d bf16 causal=%d: %.3f ms, %.1f TFLOP/s\n", heads, d, causal,
              t * 1e3, flops / t * 1e-12);
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  free_buffers(b);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  bool ok = true;
  uint64_t seed = 1;
  const int lengths[] = {1, 17, 128, 257, 1000};
  for (int causal = 0; causal < 2; ++causal) {
    for (int len : lengths) ok &= check_case({2, len, len, 2, 2, 128, causal != 0}, seed++);
    // Sq != Sk both ways (causal: Sq > Sk has rows that see nothing), GQA 2:1.
    ok &= check_case({1, 300, 77, 2, 2, 128, causal != 0}, seed++);
    ok &= check_case({1, 77, 300, 2, 2, 128, causal != 0}, seed++);
    ok &= check_case({1, 1, 1000, 2, 2, 128, causal != 0}, seed++);
    ok &= check_case({2, 257, 200, 4, 2, 128, causal != 0}, seed++);
    ok &= check_case({1, 130, 513, 4, 2, 128, causal != 0}, seed++);
    for (int len : lengths) ok &= check_case({2, len, len, 2, 2, 64, causal != 0}, seed++);
    ok &= check_case({1, 300, 77, 2, 2, 64, causal != 0}, seed++);
    ok &= check_case({1, 77, 300, 4, 2, 64, causal != 0}, seed++);
  }
  std::printf(ok ? "all correctness cases passed\n" : "FAILED\n");
  // Timed even after a failure: the speed of a wrong kernel still says whether it is worth fixing.
  if (!quick) {
    for (int d : {128, 64}) {
      time_case(d, false);
      time_case(d, true);
    }
  }
  return ok ? 0 : 1;
}
