// Standalone correctness and timing driver for the Hopper wgmma backward
// (cpp/cuda/bwd_wgmma.*), independent of JAX. Needs an sm_90 GPU.
//
// Build (from the repository root):
//   nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a -DJAX_FLASH_BUILT_SM90A=1 \
//       tools/bwd_wgmma_check.cu \
//       cpp/cuda/bwd_wgmma.cu cpp/cuda/sm90_host.cu -o bwd_wgmma_check
// Run: ./bwd_wgmma_check [--quick | --det | --det-check | --time-only | --order | --overheads]
//   --quick: correctness only, no timing; --det: only the deterministic cases and timings;
//   --det-check: the deterministic cases without timings (for compute-sanitizer);
//   --order: timing of the cells a launch order or the segment-id walk moves;
//   --overheads: the --time-only cells, each also split into what the call spends besides the
//   main kernel: zeroing dq_accum and converting it to dQ, each timed alone on the same buffers.
//
// Part 1 builds lse and delta = rowsum(dO * O) with a naive float32 forward on the GPU, then
// compares dQ, dK, dV of bwd_wgmma (bf16) against a naive float32 backward (one thread per query
// row and head, dK / dV by float atomics). The reference implements the mask semantics on its own
// (not through common/mask.h): per sequence, query i sees key j iff 0 <= j < len_k,
// i + off - left <= j <= i + off + right (off = len_k - len_q, a missing bound is unbounded) and,
// with segment ids, q_id == kv_id; scores are scale q.k, soft-capped to c tanh(s / c); sinks
// enter the forward's denominator. Cases: head_dim 128, 64 and 256, causal and not, awkward
// lengths, Sq != Sk both ways, GQA, sliding and two-sided windows, segment ids (rows without a
// matching key included), soft-capping, sinks, packed cu_seqlens (empty sequences, sequences
// without keys or without queries, rows and keys past cu_seqlens[N]) and malformed cu_seqlens.
// Packed and dense cases poison one sequence (batch element) and the padding rows with NaN: the
// other sequences must stay finite and correct, padding dQ rows and padding dK / dV keys exactly 0.
// It fails (exit 1) on a relative L2 error above 2e-2 or any NaN where none belongs.
//
// Deterministic cases (dq_semaphores given: each dQ tile gets its key tiles' additions in a fixed
// order) are checked the same way, and besides run kRepeats times: the fp32 dq_accum and dK, dV of
// every run must be bitwise identical to the first run's. For comparison the same case is run
// again without semaphores and whether its dq_accum repeated is printed (information only: the
// default order may or may not differ between two runs).
//
// Part 2 times the standard grid's 4k cells, B=4, S=4096, H = 2048 / D for D = 128, 64, 256, bf16,
// unmasked and causal, and beside them a causal sliding window, soft-capping, segment ids
// (document masking) and packed sequences: median of 10 repeats of 10 back-to-back calls;
// TFLOP/s = 2.5 * 4 * H * D * (visible (query, key) pairs per head) / time (the causal cells
// count S (S + 1) / 2 pairs where the old driver counted S^2 / 2). lse is log(visible keys) per
// row and delta 0, as a forward of near-zero scores would give. Then the deterministic order
// against the default one, unmasked and causal, at B=4 S=4096 (D = 128, 64) and B=1 S=16384 H=16
// D=128: the backward's extra time in percent of the default backward's (this is the backward
// alone; the forward, which the flag does not change, would make it a smaller part of both).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/params.h"
#include "cuda/bwd_wgmma.h"
#include "cuda/dq_convert.cuh"
#include "cuda_check.h"

namespace {

using jax_flash::BwdParams;
using jax_flash::DType;

constexpr int kMaxD = 256;

// One call: a dense batch (cu_q empty) or packed sequences, and the mask.
struct Case {
  int hq = 2, hkv = 2, d = 128;
  int batch = 1, sq = 0, sk = 0;  // dense
  std::vector<int> cu_q, cu_k;    // packed when cu_q is not empty
  int total_q = 0, total_k = 0;   // packed rows (may exceed cu_q.back() / cu_k.back())
  int left = -1, right = -1;      // window bounds, -1 unbounded; causal is right = 0
  float softcap = 0.f;            // 0: none
  bool sinks = false;
  // dense: 0 none, 1 the same ids for q and kv, 2 different, 3 the same with ids 0, 1, 2
  // cycling over the runs (an id recurs after others: no walk may end at a document's edge)
  int segments = 0;
  std::vector<int> runs = {37, 1, 100, 64, 9};  // segment lengths, cycled
  int poison = -1;         // sequence (packed) or batch element (dense) filled with NaN
  bool malformed = false;  // cu_seqlens out of order: only finiteness is checked
  bool det = false;        // dq_semaphores given: the deterministic order
};

bool varlen(const Case& c) { return !c.cu_q.empty(); }
int num_seqs(const Case& c) { return varlen(c) ? static_cast<int>(c.cu_q.size()) - 1 : 0; }
int64_t rows_q(const Case& c) { return varlen(c) ? c.total_q : int64_t{c.batch} * c.sq; }
int64_t rows_k(const Case& c) { return varlen(c) ? c.total_k : int64_t{c.batch} * c.sk; }

// The reference's view of a case, on the device.
struct RefShape {
  int hq, hkv, d;
  int varlen, batch, sq, sk;
  const int* cu_q;
  const int* cu_k;
  int num_seqs, total_q, total_k;
  int left, right;
  float scale, softcap;
  const float* sinks;  // dense [batch, hq], packed [hq]
  const int* q_ids;    // dense [batch, sq] or nullptr
  const int* kv_ids;   // dense [batch, sk]
};

// Where query row `row` (of the [rows, hq, d] view) lives: sequence n (-1 for the rows past
// cu_q[N]), local index i, the sequence's lengths, its first key row and the lse index.
struct RowInfo {
  int n, i, len_q, len_k;
  int64_t k0, stat;
};

__device__ RowInfo locate(const RefShape& sh, int64_t row, int h) {
  RowInfo r{};
  if (!sh.varlen) {
    r.n = static_cast<int>(row / sh.sq);
    r.i = static_cast<int>(row % sh.sq);
    r.len_q = sh.sq;
    r.len_k = sh.sk;
    r.k0 = int64_t{r.n} * sh.sk;
    r.stat = (int64_t{r.n} * sh.hq + h) * sh.sq + r.i;
    return r;
  }
  r.n = -1;
  r.stat = int64_t{h} * sh.total_q + row;
  for (int n = 0; n < sh.num_seqs; ++n) {
    if (sh.cu_q[n] <= row && row < sh.cu_q[n + 1]) {
      r.n = n;
      r.i = static_cast<int>(row - sh.cu_q[n]);
      r.len_q = sh.cu_q[n + 1] - sh.cu_q[n];
      r.len_k = sh.cu_k[n + 1] - sh.cu_k[n];
      r.k0 = sh.cu_k[n];
    }
  }
  return r;
}

__device__ bool visible(const RefShape& sh, const RowInfo& r, int j) {
  const int off = r.len_k - r.len_q;
  if (j < 0 || j >= r.len_k) return false;
  if (sh.left >= 0 && j < r.i + off - sh.left) return false;
  if (sh.right >= 0 && j > r.i + off + sh.right) return false;
  if (sh.q_ids != nullptr &&
      sh.q_ids[int64_t{r.n} * sh.sq + r.i] != sh.kv_ids[int64_t{r.n} * sh.sk + j]) {
    return false;
  }
  return true;
}

// The raw product q.k and the score it gives.
__device__ float score(const RefShape& sh, float qk) {
  const float s = qk * sh.scale;
  return sh.softcap > 0.f ? sh.softcap * tanhf(s / sh.softcap) : s;
}

__device__ float dot_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, int d) {
  float s = 0.f;
  for (int c = 0; c < d; ++c) s += __bfloat162float(a[c]) * __bfloat162float(b[c]);
  return s;
}

// One thread per (query row, head): lse (natural log; -inf for a row that sees no key and has
// no sink) and delta = rowsum(dO * O) with O = softmax(S) V in float32. Rows past cu_q[N] get
// NaN lse / delta: the kernel must never read them.
__global__ void ref_forward(RefShape sh, const __nv_bfloat16* q, const __nv_bfloat16* k,
                            const __nv_bfloat16* v, const __nv_bfloat16* dout, float* lse,
                            float* delta, int64_t rows) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * sh.hq) return;
  const int64_t row = idx / sh.hq;
  const int h = static_cast<int>(idx % sh.hq);
  const RowInfo r = locate(sh, row, h);
  if (r.n < 0) {
    lse[r.stat] = NAN;
    delta[r.stat] = NAN;
    return;
  }
  const int hk = h / (sh.hq / sh.hkv);
  const int d = sh.d;
  const __nv_bfloat16* qi = q + (row * sh.hq + h) * d;
  const __nv_bfloat16* doi = dout + (row * sh.hq + h) * d;
  const bool has_sink = sh.sinks != nullptr;
  const float sink = has_sink ? sh.sinks[(sh.varlen ? 0 : r.n) * sh.hq + h] : 0.f;
  float m = has_sink ? sink : -INFINITY;
  for (int j = 0; j < r.len_k; ++j) {
    if (!visible(sh, r, j)) continue;
    m = fmaxf(m, score(sh, dot_bf16(qi, k + ((r.k0 + j) * sh.hkv + hk) * d, d)));
  }
  if (m == -INFINITY) {
    lse[r.stat] = -INFINITY;
    delta[r.stat] = 0.f;
    return;
  }
  float o[kMaxD];
  for (int c = 0; c < d; ++c) o[c] = 0.f;
  float l = has_sink ? expf(sink - m) : 0.f;
  for (int j = 0; j < r.len_k; ++j) {
    if (!visible(sh, r, j)) continue;
    const int64_t kv_off = ((r.k0 + j) * sh.hkv + hk) * d;
    const float p = expf(score(sh, dot_bf16(qi, k + kv_off, d)) - m);
    l += p;
    for (int c = 0; c < d; ++c) o[c] += p * __bfloat162float(v[kv_off + c]);
  }
  // O is rounded to bf16 as the forward would store it.
  float dl = 0.f;
  for (int c = 0; c < d; ++c) {
    dl += __bfloat162float(__float2bfloat16(o[c] / l)) * __bfloat162float(doi[c]);
  }
  lse[r.stat] = m + logf(l);
  delta[r.stat] = dl;
}

// One thread per (query row, head): dQ row directly, dK / dV by float atomics. With
// soft-capping dS = P (dP - delta) (1 - t^2), t = tanh(scale q.k / c).
__global__ void ref_backward(RefShape sh, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse,
                             const float* delta, float* dq, float* dk, float* dv, int64_t rows) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * sh.hq) return;
  const int64_t row = idx / sh.hq;
  const int h = static_cast<int>(idx % sh.hq);
  const RowInfo r = locate(sh, row, h);
  const int hk = h / (sh.hq / sh.hkv);
  const int d = sh.d;
  const int64_t q_off = (row * sh.hq + h) * d;
  float acc[kMaxD];
  for (int c = 0; c < d; ++c) acc[c] = 0.f;
  const float l = r.n >= 0 ? lse[r.stat] : -INFINITY;
  if (l != -INFINITY) {
    const float dl = delta[r.stat];
    for (int j = 0; j < r.len_k; ++j) {
      if (!visible(sh, r, j)) continue;
      const int64_t kv_off = ((r.k0 + j) * sh.hkv + hk) * d;
      const float qk = dot_bf16(q + q_off, k + kv_off, d);
      const float dp = dot_bf16(dout + q_off, v + kv_off, d);
      const float p = expf(score(sh, qk) - l);
      float ds = p * (dp - dl);
      if (sh.softcap > 0.f) {
        const float t = tanhf(qk * sh.scale / sh.softcap);
        ds *= 1.f - t * t;
      }
      for (int c = 0; c < d; ++c) {
        acc[c] += sh.scale * ds * __bfloat162float(k[kv_off + c]);
        atomicAdd(dk + kv_off + c, sh.scale * ds * __bfloat162float(q[q_off + c]));
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

// Segment ids of one batch row: runs of the lengths in `runs`, cycled, with ids 0, 1, 2, ...
// (`id_step` apart, so that q and kv patterns can share some ids and not others).
std::vector<int> segment_ids(int len, const std::vector<int>& runs, int id_step) {
  std::vector<int> ids(len);
  int id = 0, left = runs[0], run = 0;
  for (int i = 0; i < len; ++i) {
    if (left == 0) {
      run = (run + 1) % static_cast<int>(runs.size());
      left = runs[run];
      id += id_step;
    }
    ids[i] = id;
    --left;
  }
  return ids;
}

// The chunk records of each batch row, as the FFI's caller passes them (common/mask.h).
std::vector<int> segment_ranges(const std::vector<int>& ids, int batch, int len,
                                bool suffix_reach) {
  std::vector<int> out(static_cast<size_t>(batch) * jax_flash::segment_chunks(len) *
                       jax_flash::kSegmentRecord);
  jax_flash::build_segment_records(ids.data(), batch, len, suffix_reach, out.data());
  return out;
}

// --overheads: time_case also times the call's zeroing and conversion passes.
bool g_overheads = false;

// Median over 10 rounds of the time of one call of `f` (10 calls a round, after one more
// untimed), in ms.
template <class F>
double median_ms(cudaEvent_t start, cudaEvent_t stop, const F& f) {
  constexpr int kCalls = 10;
  f();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int rep = 0; rep < 10; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < kCalls; ++i) f();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t / kCalls);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Everything one case needs on the device, and which rows the comparison includes.
struct Run {
  Case c;
  __nv_bfloat16 *q, *k, *v, *dout, *dq, *dk, *dv;
  float *lse, *delta, *dq_accum, *sinks;
  int *cu_q, *cu_k, *q_ids, *kv_ids, *q_ranges, *kv_ranges;
  int* sems;                         // [rows_q, hq, 2] (deterministic cases), else nullptr
  std::vector<char> q_skip, k_skip;  // rows of the poisoned sequence: not compared
  std::vector<char> q_zero, k_zero;  // rows past cu_seqlens[N]: must be exactly 0
  float scale;
};

// Sequence of each row of one side (-1 past cu[N]); dense: the batch element.
std::vector<int> row_sequences(const Case& c, bool keys) {
  const int64_t rows = keys ? rows_k(c) : rows_q(c);
  std::vector<int> seq(rows, -1);
  if (!varlen(c)) {
    const int len = keys ? c.sk : c.sq;
    for (int64_t r = 0; r < rows; ++r) seq[r] = static_cast<int>(r / len);
    return seq;
  }
  const std::vector<int>& cu = keys ? c.cu_k : c.cu_q;
  for (int n = 0; n + 1 < static_cast<int>(cu.size()); ++n) {
    for (int r = std::max(cu[n], 0); r < std::min<int64_t>(cu[n + 1], rows); ++r) seq[r] = n;
  }
  return seq;
}

Run make_run(const Case& c, uint64_t seed) {
  Run run{};
  run.c = c;
  run.scale = 1.f / std::sqrt(static_cast<float>(c.d));
  const int64_t nq = rows_q(c) * c.hq * c.d;
  const int64_t nk = rows_k(c) * c.hkv * c.d;
  std::vector<__nv_bfloat16> q = random_bf16(nq, seed + 1), k = random_bf16(nk, seed + 2),
                             v = random_bf16(nk, seed + 3), dout = random_bf16(nq, seed + 4);
  const std::vector<int> seq_q = row_sequences(c, false), seq_k = row_sequences(c, true);
  run.q_skip.assign(seq_q.size(), 0);
  run.k_skip.assign(seq_k.size(), 0);
  run.q_zero.assign(seq_q.size(), 0);
  run.k_zero.assign(seq_k.size(), 0);
  const __nv_bfloat16 nan = __float2bfloat16(NAN);
  // Poison one sequence, and (packed) the rows past cu_seqlens[N], with NaN.
  for (int64_t r = 0; r < static_cast<int64_t>(seq_q.size()); ++r) {
    const bool poisoned = c.poison >= 0 && seq_q[r] == c.poison;
    const bool padding = varlen(c) && seq_q[r] < 0 && !c.malformed;
    if (poisoned || padding) {
      std::fill(q.begin() + r * c.hq * c.d, q.begin() + (r + 1) * c.hq * c.d, nan);
      std::fill(dout.begin() + r * c.hq * c.d, dout.begin() + (r + 1) * c.hq * c.d, nan);
    }
    run.q_skip[r] = poisoned;
    run.q_zero[r] = padding;
  }
  for (int64_t r = 0; r < static_cast<int64_t>(seq_k.size()); ++r) {
    const bool poisoned = c.poison >= 0 && seq_k[r] == c.poison;
    const bool padding = varlen(c) && seq_k[r] < 0 && !c.malformed;
    if (poisoned || padding) {
      std::fill(k.begin() + r * c.hkv * c.d, k.begin() + (r + 1) * c.hkv * c.d, nan);
      std::fill(v.begin() + r * c.hkv * c.d, v.begin() + (r + 1) * c.hkv * c.d, nan);
    }
    run.k_skip[r] = poisoned;
    run.k_zero[r] = padding;
  }
  run.q = to_device(q);
  run.k = to_device(k);
  run.v = to_device(v);
  run.dout = to_device(dout);
  CHECK_CUDA(cudaMalloc(&run.dq, std::max<int64_t>(nq, 1) * 2));
  CHECK_CUDA(cudaMalloc(&run.dk, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMalloc(&run.dv, std::max<int64_t>(nk, 1) * 2));
  const int64_t ns = rows_q(c) * c.hq;
  CHECK_CUDA(cudaMalloc(&run.lse, std::max<int64_t>(ns, 1) * 4));
  CHECK_CUDA(cudaMalloc(&run.delta, std::max<int64_t>(ns, 1) * 4));
  CHECK_CUDA(cudaMalloc(&run.dq_accum, std::max<int64_t>(nq, 1) * 4));
  // Two counters per dQ row and head (BwdParams::dq_semaphores); the launcher zeroes them.
  run.sems = nullptr;
  if (c.det) CHECK_CUDA(cudaMalloc(&run.sems, std::max<int64_t>(ns, 1) * 2 * sizeof(int)));
  run.cu_q = varlen(c) ? to_device(c.cu_q) : nullptr;
  run.cu_k = varlen(c) ? to_device(c.cu_k) : nullptr;
  run.sinks = nullptr;
  if (c.sinks) {
    std::vector<float> s((varlen(c) ? 1 : c.batch) * c.hq);
    for (size_t i = 0; i < s.size(); ++i) s[i] = 1.5f * std::sin(1.7f * i + 0.3f);
    run.sinks = to_device(s);
  }
  run.q_ids = run.kv_ids = run.q_ranges = run.kv_ranges = nullptr;
  if (c.segments != 0) {
    std::vector<int> qi, ki;
    for (int b = 0; b < c.batch; ++b) {
      std::vector<int> a = segment_ids(c.sq, c.runs, 1);
      std::vector<int> bb =
          c.segments == 2 ? segment_ids(c.sk, {50, 20, 130}, 2) : segment_ids(c.sk, c.runs, 1);
      if (c.segments == 3) {
        for (int& x : a) x %= 3;
        for (int& x : bb) x %= 3;
      }
      qi.insert(qi.end(), a.begin(), a.end());
      ki.insert(ki.end(), bb.begin(), bb.end());
    }
    run.q_ids = to_device(qi);
    run.kv_ids = to_device(ki);
    run.q_ranges = to_device(segment_ranges(qi, c.batch, c.sq, true));
    run.kv_ranges = to_device(segment_ranges(ki, c.batch, c.sk, false));
  }
  return run;
}

void free_run(Run& r) {
  for (void* p :
       {static_cast<void*>(r.q), static_cast<void*>(r.k), static_cast<void*>(r.v),
        static_cast<void*>(r.dout), static_cast<void*>(r.dq), static_cast<void*>(r.dk),
        static_cast<void*>(r.dv), static_cast<void*>(r.lse), static_cast<void*>(r.delta),
        static_cast<void*>(r.dq_accum), static_cast<void*>(r.sinks), static_cast<void*>(r.cu_q),
        static_cast<void*>(r.cu_k), static_cast<void*>(r.q_ids), static_cast<void*>(r.kv_ids),
        static_cast<void*>(r.q_ranges), static_cast<void*>(r.kv_ranges),
        static_cast<void*>(r.sems)}) {
    if (p != nullptr) CHECK_CUDA(cudaFree(p));
  }
}

RefShape ref_shape(const Run& r) {
  const Case& c = r.c;
  RefShape sh{};
  sh.hq = c.hq;
  sh.hkv = c.hkv;
  sh.d = c.d;
  sh.varlen = varlen(c);
  sh.batch = c.batch;
  sh.sq = c.sq;
  sh.sk = c.sk;
  sh.cu_q = r.cu_q;
  sh.cu_k = r.cu_k;
  sh.num_seqs = num_seqs(c);
  sh.total_q = c.total_q;
  sh.total_k = c.total_k;
  sh.left = c.left;
  sh.right = c.right;
  sh.scale = r.scale;
  sh.softcap = c.softcap;
  sh.sinks = r.sinks;
  sh.q_ids = r.q_ids;
  sh.kv_ids = r.kv_ids;
  return sh;
}

BwdParams make_params(const Run& r) {
  const Case& c = r.c;
  BwdParams p{};
  p.q = r.q;
  p.k = r.k;
  p.v = r.v;
  p.dout = r.dout;
  p.lse = r.lse;
  p.delta = r.delta;
  p.dq = r.dq;
  p.dk = r.dk;
  p.dv = r.dv;
  p.dq_accum = r.dq_accum;
  p.dq_semaphores = r.sems;
  p.heads_q = c.hq;
  p.heads_kv = c.hkv;
  p.head_dim = c.d;
  p.softmax_scale = r.scale;
  jax_flash::SeqLayout& l = p.layout;
  l.heads_q = c.hq;
  if (varlen(c)) {
    l.cu_seqlens_q = r.cu_q;
    l.cu_seqlens_k = r.cu_k;
    l.num_seqs = num_seqs(c);
    l.total_q = c.total_q;
    l.total_k = c.total_k;
    l.batch = 1;
    l.seqlen_q = c.total_q;
    l.seqlen_k = c.total_k;
  } else {
    l.batch = c.batch;
    l.seqlen_q = c.sq;
    l.seqlen_k = c.sk;
  }
  l.max_seqlen_q = l.seqlen_q;
  l.max_seqlen_k = l.seqlen_k;
  jax_flash::MaskParams& m = p.mask;
  m.band.left = c.left < 0 ? jax_flash::kUnbounded : c.left;
  m.band.right = c.right < 0 ? jax_flash::kUnbounded : c.right;
  m.softcap = c.softcap;
  m.sinks = r.sinks;
  m.sinks_batch_stride = varlen(c) ? 0 : c.hq;
  m.segments.q_ids = r.q_ids;
  m.segments.kv_ids = r.kv_ids;
  m.segments.q_ranges = r.q_ranges;
  m.segments.kv_ranges = r.kv_ranges;
  return p;
}

std::string describe(const Case& c) {
  char buf[512];
  std::string s;
  if (varlen(c)) {
    s = "packed cu_q=[";
    for (size_t i = 0; i < c.cu_q.size(); ++i) s += (i ? "," : "") + std::to_string(c.cu_q[i]);
    s += "] cu_k=[";
    for (size_t i = 0; i < c.cu_k.size(); ++i) s += (i ? "," : "") + std::to_string(c.cu_k[i]);
    std::snprintf(buf, sizeof(buf), "] rows %d/%d", c.total_q, c.total_k);
    s += buf;
  } else {
    std::snprintf(buf, sizeof(buf), "B=%d Sq=%d Sk=%d", c.batch, c.sq, c.sk);
    s = buf;
  }
  std::snprintf(buf, sizeof(buf), " Hq=%d Hkv=%d D=%d window=(%d,%d)", c.hq, c.hkv, c.d, c.left,
                c.right);
  s += buf;
  if (c.softcap > 0.f) s += " softcap=" + std::to_string(c.softcap).substr(0, 4);
  if (c.sinks) s += " sinks";
  if (c.segments) s += " segments=" + std::to_string(c.segments);
  if (c.poison >= 0) s += " nan-seq=" + std::to_string(c.poison);
  if (c.malformed) s += " malformed";
  if (c.det) s += " deterministic";
  return s;
}

// ||got - ref|| / max(||ref||, kGradFloor * sqrt(n)) over the rows not skipped, of rows of
// `row_elems` elements; NaN on any non-finite output there, or a nonzero one in a row that must
// be zero. The floor (as in tests/conftest.py) keeps gradients that are exactly 0 in exact
// arithmetic, such as dQ and dK of a row that sees a single key, from turning rounding noise
// into an infinite relative error.
constexpr double kGradFloor = 0.1;

double rel_l2(const std::vector<__nv_bfloat16>& got, const std::vector<float>& ref,
              const std::vector<char>& skip, const std::vector<char>& zero, int64_t row_elems) {
  double num = 0.0, den = 0.0;
  int64_t n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t row = i / row_elems;
    if (skip[row]) continue;
    const double g = __bfloat162float(got[i]);
    if (!std::isfinite(g) || (zero[row] && g != 0.0)) return NAN;
    num += (g - ref[i]) * (g - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
    ++n;
  }
  den = std::max(den, kGradFloor * kGradFloor * static_cast<double>(n));
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

bool all_finite(const std::vector<__nv_bfloat16>& x) {
  for (const __nv_bfloat16& e : x) {
    if (!std::isfinite(__bfloat162float(e))) return false;
  }
  return true;
}

// What one backward call left behind, as bits: the fp32 dq_accum (finer than the rounded dQ, so
// that an addition in another order shows even where dQ's rounding would hide it), dK and dV.
struct Outputs {
  std::vector<float> dq_accum;
  std::vector<__nv_bfloat16> dk, dv;
};

Outputs read_outputs(const Run& r) {
  const int64_t nq = rows_q(r.c) * r.c.hq * r.c.d;
  const int64_t nk = rows_k(r.c) * r.c.hkv * r.c.d;
  return Outputs{to_host(r.dq_accum, nq), to_host(r.dk, nk), to_host(r.dv, nk)};
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

bool same_bits(const Outputs& a, const Outputs& b) {
  return same_bits(a.dq_accum, b.dq_accum) && same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv);
}

// Deterministic calls of one case, after the first.
constexpr int kRepeats = 3;

// One backward call, waited for.
void run_backward(const BwdParams& p) {
  CHECK_CUDA(jax_flash::cuda::bwd_wgmma(p, DType::kBF16, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
}

void reference(const Run& r, float* rdq, float* rdk, float* rdv) {
  const int64_t threads = rows_q(r.c) * r.c.hq;
  if (threads == 0) return;
  const unsigned grid = static_cast<unsigned>((threads + 127) / 128);
  const RefShape sh = ref_shape(r);
  ref_forward<<<grid, 128>>>(sh, r.q, r.k, r.v, r.dout, r.lse, r.delta, rows_q(r.c));
  CHECK_CUDA(cudaGetLastError());
  ref_backward<<<grid, 128>>>(sh, r.q, r.k, r.v, r.dout, r.lse, r.delta, rdq, rdk, rdv,
                              rows_q(r.c));
  CHECK_CUDA(cudaGetLastError());
}

bool check_case(const Case& c, uint64_t seed) {
  const int64_t nq = rows_q(c) * c.hq * c.d;
  const int64_t nk = rows_k(c) * c.hkv * c.d;
  Run r = make_run(c, seed);
  float *rdq = nullptr, *rdk = nullptr, *rdv = nullptr;
  CHECK_CUDA(cudaMalloc(&rdq, std::max<int64_t>(nq, 1) * 4));
  CHECK_CUDA(cudaMalloc(&rdk, std::max<int64_t>(nk, 1) * 4));
  CHECK_CUDA(cudaMalloc(&rdv, std::max<int64_t>(nk, 1) * 4));
  CHECK_CUDA(cudaMemset(rdk, 0, std::max<int64_t>(nk, 1) * 4));
  CHECK_CUDA(cudaMemset(rdv, 0, std::max<int64_t>(nk, 1) * 4));
  // Poison the outputs so that unwritten elements show up.
  CHECK_CUDA(cudaMemset(r.dq, 0xFF, std::max<int64_t>(nq, 1) * 2));
  CHECK_CUDA(cudaMemset(r.dk, 0xFF, std::max<int64_t>(nk, 1) * 2));
  CHECK_CUDA(cudaMemset(r.dv, 0xFF, std::max<int64_t>(nk, 1) * 2));
  if (c.malformed) {
    // No reference: the spans are clamped, not defined. Any finite lse / delta will do.
    const int64_t ns = rows_q(c) * c.hq;
    CHECK_CUDA(cudaMemset(r.lse, 0, std::max<int64_t>(ns, 1) * 4));
    CHECK_CUDA(cudaMemset(r.delta, 0, std::max<int64_t>(ns, 1) * 4));
  } else {
    reference(r, rdq, rdk, rdv);
  }
  const BwdParams p = make_params(r);
  bool ok = false;
  if (!jax_flash::cuda::bwd_wgmma_supported(p, DType::kBF16)) {
    std::printf("FAIL unsupported %s\n", describe(c).c_str());
  } else {
    run_backward(p);
    const std::vector<__nv_bfloat16> gdq = to_host(r.dq, nq), gdk = to_host(r.dk, nk),
                                     gdv = to_host(r.dv, nk);
    if (c.malformed) {
      ok = all_finite(gdq) && all_finite(gdk) && all_finite(gdv);
      std::printf("%s %s  (finite outputs only)\n", ok ? "ok  " : "FAIL", describe(c).c_str());
    } else {
      const double edq = rel_l2(gdq, to_host(rdq, nq), r.q_skip, r.q_zero, int64_t{c.hq} * c.d);
      const double edk = rel_l2(gdk, to_host(rdk, nk), r.k_skip, r.k_zero, int64_t{c.hkv} * c.d);
      const double edv = rel_l2(gdv, to_host(rdv, nk), r.k_skip, r.k_zero, int64_t{c.hkv} * c.d);
      const double worst = std::max({edq, edk, edv});
      ok = std::isfinite(edq) && std::isfinite(edk) && std::isfinite(edv) && worst <= 2e-2;
      std::printf("%s %s  dq %.2e dk %.2e dv %.2e\n", ok ? "ok  " : "FAIL", describe(c).c_str(),
                  edq, edk, edv);
    }
    if (c.det) {
      // Bitwise repeatability: every further run against the first; then the default order twice,
      // for comparison.
      const Outputs first = read_outputs(r);
      int differ = 0;
      for (int i = 0; i < kRepeats; ++i) {
        run_backward(p);
        differ += same_bits(first, read_outputs(r)) ? 0 : 1;
      }
      BwdParams unordered = p;
      unordered.dq_semaphores = nullptr;
      run_backward(unordered);
      const Outputs d0 = read_outputs(r);
      run_backward(unordered);
      const bool default_repeats = same_bits(d0.dq_accum, read_outputs(r).dq_accum);
      ok = ok && differ == 0;
      std::printf(
          "%s     repeats: %d of %d deterministic runs differ from the first (default "
          "order: dq_accum %s)\n",
          differ == 0 ? "ok  " : "FAIL", differ, kRepeats,
          default_repeats ? "repeated" : "differed");
    }
  }
  CHECK_CUDA(cudaFree(rdq));
  CHECK_CUDA(cudaFree(rdk));
  CHECK_CUDA(cudaFree(rdv));
  free_run(r);
  return ok;
}

Case dense(int batch, int sq, int sk, int hq, int hkv, int d, int left = -1, int right = -1) {
  Case c;
  c.batch = batch;
  c.sq = sq;
  c.sk = sk;
  c.hq = hq;
  c.hkv = hkv;
  c.d = d;
  c.left = left;
  c.right = right;
  return c;
}

Case packed(std::vector<int> cu_q, std::vector<int> cu_k, int total_q, int total_k, int hq, int hkv,
            int d, int left = -1, int right = -1) {
  Case c;
  c.cu_q = std::move(cu_q);
  c.cu_k = std::move(cu_k);
  c.total_q = total_q;
  c.total_k = total_k;
  c.batch = 1;
  c.hq = hq;
  c.hkv = hkv;
  c.d = d;
  c.left = left;
  c.right = right;
  return c;
}

// Keys each query row of a case sees (per head), counted on the host from the same rule; dense
// rows are numbered b * sq + i, packed rows by their position (rows past cu_q[N] see none).
std::vector<int> visible_keys(const Case& c, const std::vector<int>& q_ids,
                              const std::vector<int>& k_ids) {
  std::vector<int> count(rows_q(c), 0);
  const int seqs = varlen(c) ? num_seqs(c) : c.batch;
  for (int n = 0; n < seqs; ++n) {
    const int q0 = varlen(c) ? c.cu_q[n] : n * c.sq;
    const int len_q = varlen(c) ? c.cu_q[n + 1] - c.cu_q[n] : c.sq;
    const int len_k = varlen(c) ? c.cu_k[n + 1] - c.cu_k[n] : c.sk;
    const int off = len_k - len_q;
    for (int i = 0; i < len_q; ++i) {
      const int lo = std::max(0, c.left < 0 ? 0 : i + off - c.left);
      const int hi = std::min(len_k - 1, c.right < 0 ? len_k - 1 : i + off + c.right);
      int seen = std::max(0, hi - lo + 1);
      if (!q_ids.empty()) {
        seen = 0;
        for (int j = lo; j <= hi; ++j) {
          seen +=
              q_ids[static_cast<size_t>(n) * c.sq + i] == k_ids[static_cast<size_t>(n) * c.sk + j];
        }
      }
      count[q0 + i] = seen;
    }
  }
  return count;
}

// Times the backward of `c` and returns the median seconds per call.
double time_case(const char* label, const Case& c) {
  Run r = make_run(c, 7);
  std::vector<int> qi, ki;
  if (c.segments != 0) {
    qi.resize(int64_t{c.batch} * c.sq);
    ki.resize(int64_t{c.batch} * c.sk);
    CHECK_CUDA(cudaMemcpy(qi.data(), r.q_ids, qi.size() * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(ki.data(), r.kv_ids, ki.size() * 4, cudaMemcpyDeviceToHost));
  }
  const std::vector<int> keys = visible_keys(c, qi, ki);
  double pairs = 0.0;
  for (int n : keys) pairs += n;
  // lse = log(keys seen), delta = 0: what the forward gives for scores near 0 (the inputs'
  // scores are within about +-1), without a reference forward over 16k tokens. The kernel's
  // work does not depend on the values.
  std::vector<float> lse(rows_q(c) * c.hq), delta(lse.size(), 0.f);
  for (int64_t row = 0; row < rows_q(c); ++row) {
    for (int h = 0; h < c.hq; ++h) {
      const int64_t stat =
          varlen(c) ? int64_t{h} * c.total_q + row : (row / c.sq * c.hq + h) * c.sq + row % c.sq;
      lse[stat] = keys[row] > 0 ? std::log(static_cast<float>(keys[row])) : -INFINITY;
    }
  }
  CHECK_CUDA(cudaMemcpy(r.lse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(r.delta, delta.data(), delta.size() * 4, cudaMemcpyHostToDevice));
  const BwdParams p = make_params(r);
  for (int i = 0; i < 2; ++i) CHECK_CUDA(jax_flash::cuda::bwd_wgmma(p, DType::kBF16, nullptr));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const double t = 1e-3 * median_ms(start, stop, [&] {
                     CHECK_CUDA(jax_flash::cuda::bwd_wgmma(p, DType::kBF16, nullptr));
                   });
  const double flops = 2.5 * 4.0 * c.hq * c.d * pairs;
  std::printf("time %-24s H=%d D=%d bf16: %.3f ms, %.1f TFLOP/s on %.3g visible pairs\n", label,
              c.hq, c.d, t * 1e3, flops / t * 1e-12, pairs);
  if (g_overheads) {
    // The call's two passes besides the main kernel, each alone, as bwd_wgmma issues them
    // (dq_convert.cuh). The convert timed is the natural order's; the permuted column order and
    // the 80-query kernels' query-pair order (convert_dq_pairs) read and write the same bytes
    // in other patterns, not timed here.
    const int64_t elems = rows_q(c) * c.hq * c.d;
    const double zero_ms = median_ms(start, stop, [&] {
      CHECK_CUDA(jax_flash::cuda::zero_dq_accum(r.dq_accum, elems, nullptr));
    });
    const double convert_ms = median_ms(start, stop, [&] {
      CHECK_CUDA(
          jax_flash::cuda::convert_dq<__nv_bfloat16>(r.dq_accum, r.dq, elems, r.scale, nullptr));
    });
    const double gb = elems * 4.0 * 1e-9;
    std::printf(
        "     %-24s zero dq_accum %.3f ms (%.0f GB/s), convert %.3f ms (%.0f GB/s), together "
        "%.1f%% of the call\n",
        "", zero_ms, gb / (zero_ms * 1e-3), convert_ms, 1.5 * gb / (convert_ms * 1e-3),
        100.0 * (zero_ms + convert_ms) / (t * 1e3));
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  free_run(r);
  return t;
}

// The deterministic order's cost: `c` timed without and with dq_semaphores.
void time_deterministic(const char* label, Case c) {
  c.det = false;
  const double t0 = time_case(label, c);
  c.det = true;
  const std::string det_label = std::string(label) + " det";
  const double t1 = time_case(det_label.c_str(), c);
  std::printf("cost %-24s H=%d D=%d: deterministic backward %+.1f%% of the default backward\n",
              label, c.hq, c.d, 100.0 * (t1 - t0) / t0);
}

void time_deterministic_all() {
  for (int d : {128, 64, 256}) {
    const int h = 2048 / d;
    time_deterministic("B=4 S=4096 unmasked", dense(4, 4096, 4096, h, h, d));
    time_deterministic("B=4 S=4096 causal", dense(4, 4096, 4096, h, h, d, -1, 0));
  }
  time_deterministic("B=1 S=16384 unmasked", dense(1, 16384, 16384, 16, 16, 128));
  time_deterministic("B=1 S=16384 causal", dense(1, 16384, 16384, 16, 16, 128, -1, 0));
}

// The deterministic order's correctness cases: dense and packed, every head dim, causal and not,
// GQA, windows, segment ids (pairs whose ids are disjoint are then visited, fully masked), soft-
// capping, Sq != Sk, and packed sequences whose last query tile is short (those tiles add from
// registers, in the same order, beside the staged tiles of the CTA's writer warps).
std::vector<Case> deterministic_cases() {
  std::vector<Case> cases;
  for (int d : {128, 64, 256}) {
    for (int right : {-1, 0}) {
      cases.push_back(dense(2, 1000, 1000, 2, 2, d, -1, right));
      cases.push_back(dense(2, 257, 200, 4, 2, d, -1, right));
    }
    cases.push_back(dense(1, 300, 777, 2, 2, d, -1, 0));
    cases.push_back(dense(1, 777, 300, 2, 2, d, -1, 0));
    cases.push_back(dense(2, 1000, 1000, 2, 2, d, 100, 0));
    cases.push_back(dense(1, 700, 700, 4, 2, d, 37, 19));
  }
  // Long key-tile chains: 16 key tiles add to every query tile (the reference's dK / dV atomics
  // keep this short of the timed lengths).
  cases.push_back(dense(1, 2048, 2048, 1, 1, 128));
  cases.push_back(dense(1, 2048, 2048, 2, 1, 64, -1, 0));
  {
    Case a = dense(2, 300, 300, 2, 2, 128, -1, 0);
    a.segments = 1;
    cases.push_back(a);
    Case b = dense(2, 200, 333, 4, 2, 128);
    b.segments = 2;
    cases.push_back(b);
    Case c = dense(1, 400, 400, 2, 2, 64, 60, 0);
    c.segments = 2;
    c.softcap = 0.5f;
    cases.push_back(c);
    Case s = dense(2, 257, 257, 2, 2, 128);
    s.softcap = 0.4f;
    cases.push_back(s);
  }
  {
    Case a = packed({0, 100, 177, 477, 480}, {0, 100, 177, 477, 480}, 500, 520, 2, 2, 128);
    a.poison = 1;
    cases.push_back(a);
    a.right = 0;
    cases.push_back(a);
    a.d = 64;
    cases.push_back(a);
    Case b = packed({0, 50, 50, 350, 351, 600}, {0, 130, 140, 400, 400, 777}, 600, 800, 4, 2, 128,
                    -1, 0);
    b.poison = 2;
    cases.push_back(b);
    Case w = packed({0, 1000, 1001, 3050}, {0, 1000, 1300, 3050}, 3100, 3100, 4, 2, 64, 200, 0);
    cases.push_back(w);
    Case u = packed({0, 700, 1457}, {0, 700, 1457}, 1457, 1500, 2, 2, 128);
    cases.push_back(u);
  }
  for (Case& c : cases) c.det = true;
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  // --time-only [D]: only the timed cases (for a profiler, which then sees no correctness
  // launches), of head_dim D if given.
  g_overheads = argc > 1 && std::strcmp(argv[1], "--overheads") == 0;
  const bool time_only = g_overheads || (argc > 1 && std::strcmp(argv[1], "--time-only") == 0);
  // --det: only the deterministic order's correctness cases and timings.
  const bool det_only = argc > 1 && std::strcmp(argv[1], "--det") == 0;
  // --det-check: the same correctness cases without the timings (small enough for racecheck).
  const bool det_check = argc > 1 && std::strcmp(argv[1], "--det-check") == 0;
  if (det_only || det_check) {
    bool ok = true;
    uint64_t seed = 1000;
    for (const Case& c : deterministic_cases()) ok &= check_case(c, seed++);
    std::printf(ok ? "all deterministic cases passed\n" : "FAILED\n");
    if (det_only) time_deterministic_all();
    return ok ? 0 : 1;
  }
  if (argc > 1 && std::strcmp(argv[1], "--order") == 0) {
    // The cells a launch order or the segment-id walk moves (bench_masks.py's 11 documents).
    const std::vector<int> docs = {3494, 2632, 2125, 1152, 1305, 229, 367, 130, 770, 3343, 837};
    for (int d : {128, 64, 256}) {
      const int h = 2048 / d;
      for (int s : {1024, 4096}) {
        const std::string causal = "causal S=" + std::to_string(s);
        time_case(causal.c_str(), dense(16384 / s, s, s, h, h, d, -1, 0));
        if (d == 128) {
          const std::string full = "unmasked S=" + std::to_string(s);
          time_case(full.c_str(), dense(16384 / s, s, s, h, h, d));
        }
      }
      if (d == 128) time_case("causal S=16384", dense(1, 16384, 16384, h, h, d, -1, 0));
      // Soft-capped kernels at head_dim 64 and 128: the per-head_dim switches reach them with
      // their own exceptions (BwdWgmmaTraits::kDqWriter, kDqStsm).
      if (d != 256) {
        for (int right : {-1, 0}) {
          Case cap = dense(4, 4096, 4096, h, h, d, -1, right);
          cap.softcap = 50.f;
          time_case(right < 0 ? "softcap 50 S=4096" : "softcap 50 causal S=4096", cap);
        }
      }
      if (d != 128) continue;
      time_case("window 1k over 16k", dense(1, 16384, 16384, h, h, d, 1023, 0));
      std::vector<int> cu = {0};
      for (int n : docs) cu.push_back(cu.back() + n);
      time_case("11 documents packed", packed(cu, cu, 16384, 16384, h, h, d, -1, 0));
      Case seg = dense(1, 16384, 16384, h, h, d, -1, 0);
      seg.segments = 1;
      seg.runs = docs;
      time_case("11 documents segment ids", seg);
    }
    return 0;
  }
  if (time_only) {
    // An optional head_dim after --time-only times only that one.
    const int only_d = argc > 2 ? std::atoi(argv[2]) : 0;
    for (int d : {128, 64, 256}) {
      if (only_d != 0 && d != only_d) continue;
      const int h = 2048 / d;
      time_case("unmasked", dense(4, 4096, 4096, h, h, d));
      time_case("causal", dense(4, 4096, 4096, h, h, d, -1, 0));
    }
    return 0;
  }
  bool ok = true;
  uint64_t seed = 1;
  const auto check = [&](const Case& c) { ok &= check_case(c, seed++); };
  const int lengths[] = {1, 17, 128, 257, 1000};
  // Unmasked and causal (right = 0), as before the masks existed.
  for (int right : {-1, 0}) {
    for (int len : lengths) check(dense(2, len, len, 2, 2, 128, -1, right));
    // Sq != Sk both ways (causal: Sq > Sk has rows that see nothing), GQA 2:1.
    check(dense(1, 300, 77, 2, 2, 128, -1, right));
    check(dense(1, 77, 300, 2, 2, 128, -1, right));
    check(dense(1, 1, 1000, 2, 2, 128, -1, right));
    check(dense(2, 257, 200, 4, 2, 128, -1, right));
    check(dense(1, 130, 513, 4, 2, 128, -1, right));
    for (int len : lengths) check(dense(2, len, len, 2, 2, 64, -1, right));
    check(dense(1, 300, 77, 2, 2, 64, -1, right));
    check(dense(1, 77, 300, 4, 2, 64, -1, right));
  }
  // Windows: causal sliding, two-sided, one-sided of either side, diagonal only, wider than the
  // sequence, with Sq != Sk both ways (rows before the band see nothing).
  check(dense(2, 1000, 1000, 2, 2, 128, 100, 0));
  check(dense(2, 1000, 1000, 2, 2, 64, 100, 0));
  check(dense(1, 700, 700, 4, 2, 128, 37, 19));
  check(dense(1, 700, 700, 4, 2, 64, 37, 19));
  check(dense(1, 300, 777, 2, 2, 128, 64, 0));
  check(dense(1, 777, 300, 2, 2, 64, 0, 0));
  check(dense(1, 513, 513, 2, 2, 128, -1, 5));
  check(dense(1, 400, 400, 2, 2, 128, 200, -1));
  check(dense(1, 333, 333, 2, 2, 128, 5000, 0));
  check(dense(1, 257, 1000, 2, 1, 128, 0, 130));
  // Soft-capping (strong enough that tanh is far from linear), alone and with masks.
  {
    Case c = dense(2, 257, 257, 2, 2, 128);
    c.softcap = 0.4f;
    check(c);
    c.right = 0;
    check(c);
    Case w = dense(1, 600, 600, 4, 2, 64, 70, 0);
    w.softcap = 0.3f;
    check(w);
    Case g = dense(1, 300, 500, 4, 1, 128, 90, 40);
    g.softcap = 1.f;
    check(g);
  }
  // Sinks: lse includes them, nothing else changes; with a window some rows see nothing.
  {
    Case c = dense(2, 300, 300, 4, 2, 128, -1, 0);
    c.sinks = true;
    check(c);
    Case w = dense(1, 500, 300, 2, 2, 64, 10, 0);
    w.sinks = true;
    check(w);
  }
  // Segment ids: the same runs for q and kv, different ones (rows without a matching key),
  // with causal, a window and soft-capping, and one batch element poisoned.
  {
    Case c = dense(2, 300, 300, 2, 2, 128);
    c.segments = 1;
    check(c);
    c.right = 0;
    check(c);
    Case d = dense(2, 300, 300, 2, 2, 64, -1, 0);
    d.segments = 1;
    check(d);
    Case e = dense(2, 200, 333, 4, 2, 128);
    e.segments = 2;
    check(e);
    Case f = dense(1, 400, 400, 2, 2, 128, 60, 0);
    f.segments = 1;
    f.softcap = 0.5f;
    check(f);
    Case g = dense(3, 256, 256, 2, 2, 128, -1, 0);
    g.segments = 2;
    g.poison = 1;
    check(g);
    // Rows longer than 32 query tiles: a key tile's walk ends at its document's last query tile
    // (growing ids), or must not (ids that recur), also under GQA and a window.
    Case h = dense(1, 5000, 5000, 4, 2, 128, -1, 0);
    h.segments = 1;
    h.runs = {1500, 700, 2100, 300};
    check(h);
    h.segments = 3;
    check(h);
    h.right = -1;
    check(h);
    Case k = dense(1, 4500, 4500, 2, 2, 64, 2500, 0);
    k.segments = 1;
    k.runs = {2300, 90, 1200};
    check(k);
  }
  // Dense isolation: a NaN batch element must not reach the others.
  {
    Case c = dense(3, 200, 200, 2, 2, 128, -1, 0);
    c.poison = 1;
    check(c);
  }
  // Packed sequences. Rows past cu_seqlens[N] and the poisoned sequence hold NaN.
  {
    Case a = packed({0, 100, 177, 477, 480}, {0, 100, 177, 477, 480}, 500, 520, 2, 2, 128);
    a.poison = 1;
    check(a);
    a.right = 0;
    check(a);
    Case a64 = a;
    a64.d = 64;
    check(a64);
    // Empty query sequence with keys (dK = dV = 0), a row without keys, lengths off the tiles,
    // keys past cu_k[N].
    Case b = packed({0, 50, 50, 350, 351, 600}, {0, 130, 140, 400, 400, 777}, 600, 800, 4, 2, 128,
                    -1, 0);
    b.poison = 2;
    check(b);
    Case b64 = b;
    b64.d = 64;
    b64.hq = 2;
    check(b64);
    Case w = packed({0, 1000, 1001, 3050}, {0, 1000, 1300, 3050}, 3100, 3100, 4, 2, 64, 200, 0);
    w.poison = 1;
    check(w);
    Case w128 = packed({0, 700, 1457}, {0, 700, 1457}, 1457, 1500, 2, 2, 128, 33, 70);
    check(w128);
    Case s = packed({0, 129, 300, 555}, {0, 200, 300, 613}, 600, 700, 2, 2, 128, -1, 0);
    s.softcap = 0.5f;
    s.poison = 0;
    check(s);
    Case k = packed({0, 300, 310}, {0, 5, 400}, 330, 420, 2, 1, 128);
    k.sinks = true;
    check(k);
    // No sequences at all: everything is padding.
    check(packed({0}, {0}, 64, 100, 2, 2, 128));
    // Malformed cu_seqlens (decreasing, negative, past the totals): clamped, never out of
    // bounds.
    Case m = packed({0, 300, 100, 9999}, {-5, 50, 40, 60}, 400, 200, 2, 2, 128, -1, 0);
    m.malformed = true;
    check(m);
  }
  // Head_dim 64's 128-query tiles, whose warpgroups split dQ_i's rows 64 and 64 and mask the
  // packed P^T: sequences ending at, before and after the 64th row of a tile (dense, and packed,
  // where the short last tile adds from registers), ids that differ between q and kv, soft-capping
  // with a window, in both orders.
  {
    check(dense(1, 192, 192, 2, 2, 64, -1, 0));
    check(dense(2, 191, 193, 4, 2, 64));
    Case e = dense(2, 200, 333, 4, 2, 64);
    e.segments = 2;
    check(e);
    Case p = packed({0, 64, 129, 256, 385}, {0, 64, 129, 256, 385}, 400, 400, 2, 2, 64, -1, 0);
    p.poison = 2;
    check(p);
    p.softcap = 0.5f;
    p.left = 50;
    check(p);
    p.det = true;
    check(p);
    e.det = true;
    check(e);
  }
  // Head_dim 128 without a mask, whose pairs have 80 queries with JAX_FLASH_BWD_M80 (dQ computed
  // transposed): lengths around multiples of 80, packed sequences ending inside a tile (the short
  // last tile adds from registers), GQA, in both orders.
  {
    check(dense(1, 160, 160, 2, 2, 128));
    check(dense(2, 161, 239, 4, 2, 128));
    Case p = packed({0, 80, 159, 240, 401}, {0, 80, 159, 240, 401}, 420, 420, 4, 2, 128);
    p.poison = 2;
    check(p);
    p.det = true;
    check(p);
    Case e = dense(2, 241, 317, 4, 2, 128);
    e.det = true;
    check(e);
  }
  // Head_dim 256 (64-key tiles, the warpgroups splitting the queries of S^T): the same kinds of
  // cases, fewer of each.
  for (int right : {-1, 0}) {
    for (int len : lengths) check(dense(2, len, len, 2, 2, 256, -1, right));
    check(dense(1, 300, 77, 2, 2, 256, -1, right));
    check(dense(1, 77, 300, 4, 2, 256, -1, right));
  }
  check(dense(2, 1000, 1000, 2, 2, 256, 100, 0));
  check(dense(1, 700, 700, 4, 2, 256, 37, 19));
  check(dense(1, 257, 1000, 2, 1, 256, 0, 130));
  {
    Case c = dense(2, 257, 257, 2, 2, 256, -1, 0);
    c.softcap = 0.4f;
    check(c);
    Case k = dense(2, 300, 300, 4, 2, 256, -1, 0);
    k.sinks = true;
    check(k);
    Case e = dense(2, 200, 333, 4, 2, 256);
    e.segments = 2;
    check(e);
    Case f = dense(3, 256, 256, 2, 2, 256, 60, 0);
    f.segments = 1;
    f.poison = 1;
    check(f);
    Case a = packed({0, 100, 177, 477, 480}, {0, 100, 177, 477, 480}, 500, 520, 2, 2, 256);
    a.poison = 1;
    check(a);
    a.right = 0;
    check(a);
    Case b = packed({0, 50, 50, 350, 351, 600}, {0, 130, 140, 400, 400, 777}, 600, 800, 4, 2, 256,
                    -1, 0);
    b.poison = 2;
    check(b);
  }
  for (const Case& c : deterministic_cases()) check(c);
  std::printf(ok ? "all correctness cases passed\n" : "FAILED\n");
  // Timed even after a failure: the speed of a wrong kernel still says whether it is worth fixing.
  if (!quick) {
    for (int d : {128, 64, 256}) {
      const int h = 2048 / d;
      time_case("unmasked", dense(4, 4096, 4096, h, h, d));
      time_case("causal", dense(4, 4096, 4096, h, h, d, -1, 0));
      time_case("window (1023, 0)", dense(4, 4096, 4096, h, h, d, 1023, 0));
      Case sc = dense(4, 4096, 4096, h, h, d, -1, 0);
      sc.softcap = 30.f;
      time_case("causal softcap", sc);
    }
    // Document masking: four documents of 1024 tokens per row.
    Case seg = dense(4, 4096, 4096, 16, 16, 128, -1, 0);
    seg.segments = 1;
    seg.runs = {1024};
    time_case("causal 4 documents", seg);
    time_case("packed 4 x 4096 causal",
              packed({0, 4096, 8192, 12288, 16384}, {0, 4096, 8192, 12288, 16384}, 16384, 16384, 16,
                     16, 128, -1, 0));
    time_case("packed mixed causal",
              packed({0, 512, 2048, 5120, 11264, 16384}, {0, 512, 2048, 5120, 11264, 16384}, 16384,
                     16384, 16, 16, 128, -1, 0));
    time_deterministic_all();
  }
  return ok ? 0 : 1;
}
