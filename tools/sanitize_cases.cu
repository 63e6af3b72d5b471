// Runs the CUDA kernels directly (no JAX) over a small grid of awkward cases so that
// compute-sanitizer's memcheck and racecheck see every kernel family, both directions, tails,
// causal masking, GQA and each tensor-core head dim. Usage: compute-sanitizer --tool memcheck
// ./sanitize_cases. Exits non-zero on any CUDA error or non-finite output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/params.h"
#include "cuda/launch.h"
#include "cuda_check.h"

namespace {

using jax_flash::BwdParams;
using jax_flash::DType;
using jax_flash::FwdParams;

struct Case {
  DType dtype;
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
};

size_t elem_bytes(DType t) {
  switch (t) {
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kF64:
      return 8;
  }
  return 0;
}

// Host-side storage in the element type, from float64 values.
std::vector<unsigned char> encode(const std::vector<double>& x, DType t) {
  std::vector<unsigned char> out(x.size() * elem_bytes(t));
  for (size_t i = 0; i < x.size(); ++i) {
    switch (t) {
      case DType::kF16:
        reinterpret_cast<__half*>(out.data())[i] = __double2half(x[i]);
        break;
      case DType::kBF16:
        reinterpret_cast<__nv_bfloat16*>(out.data())[i] = __double2bfloat16(x[i]);
        break;
      case DType::kF32:
        reinterpret_cast<float*>(out.data())[i] = static_cast<float>(x[i]);
        break;
      case DType::kF64:
        reinterpret_cast<double*>(out.data())[i] = x[i];
        break;
    }
  }
  return out;
}

double decode_one(const unsigned char* p, size_t i, DType t) {
  switch (t) {
    case DType::kF16:
      return __half2float(reinterpret_cast<const __half*>(p)[i]);
    case DType::kBF16:
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kF32:
      return reinterpret_cast<const float*>(p)[i];
    case DType::kF64:
      return reinterpret_cast<const double*>(p)[i];
  }
  return 0;
}

void* device_copy(const std::vector<unsigned char>& host) {
  void* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, host.size()));
  CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice));
  return ptr;
}

std::vector<unsigned char> host_copy(const void* ptr, size_t bytes) {
  std::vector<unsigned char> host(bytes);
  CHECK_CUDA(cudaMemcpy(host.data(), ptr, bytes, cudaMemcpyDeviceToHost));
  return host;
}

// Counts NaNs; -inf is legitimate in lse (fully masked rows) and counted separately by callers.
int64_t count_nan(const std::vector<unsigned char>& host, DType t) {
  int64_t n = 0;
  for (size_t i = 0; i < host.size() / elem_bytes(t); ++i)
    n += std::isnan(decode_one(host.data(), i, t));
  return n;
}

bool run_case(const Case& c, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  const DType stats = c.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  const int64_t q_elems = c.batch * c.seqlen_q * c.heads_q * c.head_dim;
  const int64_t kv_elems = c.batch * c.seqlen_k * c.heads_kv * c.head_dim;
  const int64_t rows = c.batch * c.heads_q * c.seqlen_q;
  auto random = [&](int64_t n) {
    std::vector<double> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
  };
  std::vector<double> dout_host = random(q_elems);
  void* q = device_copy(encode(random(q_elems), c.dtype));
  void* k = device_copy(encode(random(kv_elems), c.dtype));
  void* v = device_copy(encode(random(kv_elems), c.dtype));
  void* dout = device_copy(encode(dout_host, c.dtype));
  void *o, *lse, *delta, *dq, *dk, *dv;
  float* dq_accum;
  CHECK_CUDA(cudaMalloc(&o, q_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&lse, rows * elem_bytes(stats)));
  CHECK_CUDA(cudaMalloc(&delta, rows * elem_bytes(stats)));
  CHECK_CUDA(cudaMalloc(&dq, q_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&dk, kv_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&dv, kv_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&dq_accum, q_elems * sizeof(float)));

  FwdParams fp{q,         k,          v,          o,
               lse,       c.batch,    c.seqlen_q, c.seqlen_k,
               c.heads_q, c.heads_kv, c.head_dim, 1.0 / std::sqrt(static_cast<double>(c.head_dim)),
               c.causal};
  CHECK_CUDA(jax_flash::cuda::attention_fwd(fp, c.dtype, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  // delta = rowsum(dO * O), laid out [batch, heads_q, seqlen_q].
  auto o_host = host_copy(o, q_elems * elem_bytes(c.dtype));
  std::vector<double> delta_host(rows, 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t s = 0; s < c.seqlen_q; ++s)
      for (int64_t h = 0; h < c.heads_q; ++h) {
        double acc = 0;
        for (int64_t d = 0; d < c.head_dim; ++d) {
          const int64_t i = ((b * c.seqlen_q + s) * c.heads_q + h) * c.head_dim + d;
          acc += decode_one(o_host.data(), i, c.dtype) * dout_host[i];
        }
        delta_host[(b * c.heads_q + h) * c.seqlen_q + s] = acc;
      }
  auto delta_bytes = encode(delta_host, stats);
  CHECK_CUDA(cudaMemcpy(delta, delta_bytes.data(), delta_bytes.size(), cudaMemcpyHostToDevice));

  BwdParams bp{q,
               k,
               v,
               dout,
               lse,
               delta,
               dq,
               dk,
               dv,
               dq_accum,
               c.batch,
               c.seqlen_q,
               c.seqlen_k,
               c.heads_q,
               c.heads_kv,
               c.head_dim,
               fp.softmax_scale,
               c.causal};
  CHECK_CUDA(jax_flash::cuda::attention_bwd(bp, c.dtype, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  const int64_t nan_count = count_nan(o_host, c.dtype) +
                            count_nan(host_copy(dq, q_elems * elem_bytes(c.dtype)), c.dtype) +
                            count_nan(host_copy(dk, kv_elems * elem_bytes(c.dtype)), c.dtype) +
                            count_nan(host_copy(dv, kv_elems * elem_bytes(c.dtype)), c.dtype);
  for (void* p : {q, k, v, dout, o, lse, delta, dq, dk, dv}) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(dq_accum));
  std::printf("dtype=%d B=%lld Sq=%lld Sk=%lld Hq=%lld Hkv=%lld D=%lld causal=%d: %s\n",
              static_cast<int>(c.dtype), static_cast<long long>(c.batch),
              static_cast<long long>(c.seqlen_q), static_cast<long long>(c.seqlen_k),
              static_cast<long long>(c.heads_q), static_cast<long long>(c.heads_kv),
              static_cast<long long>(c.head_dim), c.causal, nan_count ? "NaN in output" : "ok");
  return nan_count == 0;
}

}  // namespace

int main() {
  std::mt19937_64 rng(1234);
  std::vector<Case> cases;
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (int64_t d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        cases.push_back({t, 1, 113, 257, 4, 2, d, causal});
        cases.push_back({t, 2, 200, 77, 2, 1, d, causal});
      }
    }
  }
  for (DType t : {DType::kF32, DType::kF64}) {
    for (int64_t d : {33, 64, 256}) {
      for (bool causal : {false, true}) cases.push_back({t, 1, 71, 130, 4, 2, d, causal});
    }
  }
  int failures = 0;
  for (const Case& c : cases) failures += !run_case(c, rng);
  std::printf("%zu cases, %d with NaN outputs\n", cases.size(), failures);
  return failures == 0 ? 0 : 1;
}
