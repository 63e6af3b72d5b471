// Standalone correctness and timing driver for the Hopper wgmma forward (cpp/cuda/fwd_wgmma.*),
// independent of JAX and of the default dispatch. Needs an sm_90 GPU.
//
// Build (from the repository root):
//   nvcc -std=c++17 -O3 -I cpp -gencode=arch=compute_90a,code=sm_90a -DJAX_FLASH_BUILT_SM90A=1 \
//       tools/wgmma_check.cu \
//       cpp/cuda/fwd_wgmma.cu cpp/cuda/sm90_host.cu -o wgmma_check
// Run: ./wgmma_check [--quick | --correct | --softmax | --time | --grid | --order |
//                     --cell D S causal|full]
//   --quick: a few small cases, no timing; for compute-sanitizer.
//   --softmax: only the softmax-bound timing cells (part 3), no correctness cases; for comparing
//   two builds back to back.
//   --correct: part 1 only (every correctness case, no timing).
//   --time: parts 2 and 3 only (no correctness cases).
//   --grid: the dense cells of part 2 only.
//   --order: the cells a launch order or the segment-id walk moves (timing only).
//   --cell: one dense cell of part 2 (head_dim D, seqlen S, batch 16384 / S); for a profiler.
//
// Part 1 compares O and lse with a naive float32 reference on the GPU (one thread per query row
// and head) over awkward shapes: dense and packed (cu_seqlens) batches, causal and sliding-window
// bands, soft-capping, sinks and segment ids. The reference decides visibility from the
// semantics directly (not through common/mask.h): query i of a sequence sees key j iff
// 0 <= j < len_k, i + off - left <= j <= i + off + right (off = len_k - len_q) and, with segment
// ids, q_id[i] == kv_id[j]. A case fails (exit 1) on relative L2 error of O above 1e-2, any NaN
// or Inf, an lse mismatch, a nonzero O in a row that sees no key, an output element left unwritten
// (the outputs are poisoned with NaN before each run), or two runs that differ in any bit. Cases
// with poisoned inputs fill one packed sequence (or dense batch element) and the rows past the last
// sequence with NaN and check that every other row is still exact.
// Part 2 times the kernel: median over 10 repeats of 20 back-to-back launches after warm-up;
// TFLOP/s = 4 * D * (visible (query, key) pairs) * heads / time, i.e. 4 * B * H * S * S * D for
// full attention, about half that for causal. The feature rows print their ratio to the baseline
// the targets are stated against.
// Part 3 times the cells whose softmax is limited by the special-function unit (head_dim 64, and
// soft-capping at any head_dim): B=4 S=4096 H=16, head_dim 64 and 128, full and causal, bf16 and
// fp16, each without and with softcap 50; the softcap row prints its ratio to the row above it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/params.h"
#include "cuda/fwd_wgmma.h"
#include "cuda_check.h"

namespace {

using jax_flash::build_segment_records;
using jax_flash::DType;
using jax_flash::FwdParams;
using jax_flash::kSegmentRecord;
using jax_flash::kUnbounded;
using jax_flash::segment_chunks;

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

// Where query row r of the [rows, heads_q, head_dim] view of Q lives, for the reference.
struct RowInfo {
  int64_t k_start;  // first key row of its sequence in the [rows, heads_kv, head_dim] view of K
  int len_q;        // its sequence's lengths (0 keys for the padding rows of a packed call)
  int len_k;
  int i;         // sequence-local position
  int batch;     // index into per-batch arrays (segment ids, sinks)
  int64_t stat;  // lse index of head 0; head h adds h * stat_head
};

struct RefArgs {
  const RowInfo* rows;
  int64_t num_rows;
  int heads_q, heads_kv, head_dim;
  int64_t stat_head;
  float scale;
  int64_t left, right;  // kUnbounded: none
  float softcap;        // 0: none
  const float* sinks;   // [batch, heads_q] or nullptr
  int64_t sinks_stride;
  const int32_t* q_ids;  // dense segment ids [batch, seqlen_q] / [batch, seqlen_k], or nullptr
  const int32_t* kv_ids;
  int64_t seqlen_q, seqlen_k;
  float* o;    // [rows, heads_q, head_dim]
  float* lse;  // as the kernel's
  int* seen;   // [rows, heads_q]: number of visible keys
};

// Naive attention in float32 from the same rounded inputs: one thread per (row, head).
template <typename T>
__global__ void reference_fwd(const T* q, const T* k, const T* v, RefArgs a) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= a.num_rows * a.heads_q) return;
  const int64_t r = idx / a.heads_q;
  const int h = static_cast<int>(idx % a.heads_q);
  const RowInfo ri = a.rows[r];
  const int hk = h / (a.heads_q / a.heads_kv);
  const int d_n = a.head_dim;
  const T* qrow = q + (r * a.heads_q + h) * d_n;
  float* orow = a.o + (r * a.heads_q + h) * d_n;
  const int64_t off = ri.len_k - ri.len_q;
  const auto visible = [&](int j) {
    if (j < 0 || j >= ri.len_k) return false;
    if (a.left < kUnbounded && j < ri.i + off - a.left) return false;
    if (a.right < kUnbounded && j > ri.i + off + a.right) return false;
    if (a.q_ids != nullptr &&
        a.q_ids[ri.batch * a.seqlen_q + ri.i] != a.kv_ids[ri.batch * a.seqlen_k + j]) {
      return false;
    }
    return true;
  };
  float qf[256];
  float acc[256];
  for (int d = 0; d < d_n; ++d) {
    qf[d] = to_float(qrow[d]);
    acc[d] = 0.f;
  }
  const auto krow = [&](int j) { return k + ((ri.k_start + j) * a.heads_kv + hk) * d_n; };
  const auto vrow = [&](int j) { return v + ((ri.k_start + j) * a.heads_kv + hk) * d_n; };
  const auto score = [&](int j) {
    const T* kr = krow(j);
    float dot = 0.f;
    for (int d = 0; d < d_n; ++d) dot += qf[d] * to_float(kr[d]);
    float s = dot * a.scale;
    if (a.softcap > 0.f) s = a.softcap * tanhf(s / a.softcap);
    return s;
  };
  const bool has_sink = a.sinks != nullptr;
  const float sink = has_sink ? a.sinks[ri.batch * a.sinks_stride + h] : -INFINITY;
  int seen = 0;
  float mx = sink;
  for (int j = 0; j < ri.len_k; ++j) {
    if (!visible(j)) continue;
    ++seen;
    mx = fmaxf(mx, score(j));
  }
  float* lse_out = a.lse + ri.stat + h * a.stat_head;
  a.seen[idx] = seen;
  if (seen == 0) {
    for (int d = 0; d < d_n; ++d) orow[d] = 0.f;
    *lse_out = sink;
    return;
  }
  float sum = has_sink ? expf(sink - mx) : 0.f;
  for (int j = 0; j < ri.len_k; ++j) {
    if (!visible(j)) continue;
    const float p = expf(score(j) - mx);
    sum += p;
    const T* vr = vrow(j);
    for (int d = 0; d < d_n; ++d) acc[d] += p * to_float(vr[d]);
  }
  for (int d = 0; d < d_n; ++d) orow[d] = acc[d] / sum;
  *lse_out = mx + logf(sum);
}

template <typename T>
__global__ void widen(const T* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = static_cast<float>(x[i]);
  }
}

// Device buffers of one case, freed on scope exit.
struct DeviceBuffers {
  std::vector<void*> ptrs;
  template <typename P>
  P* alloc(int64_t bytes) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, std::max<int64_t>(bytes, 4)));
    ptrs.push_back(p);
    return static_cast<P*>(p);
  }
  template <typename P>
  P* upload(const std::vector<P>& host) {
    P* p = alloc<P>(static_cast<int64_t>(host.size() * sizeof(P)));
    if (!host.empty()) {
      CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(P), cudaMemcpyHostToDevice));
    }
    return p;
  }
  ~DeviceBuffers() {
    for (void* p : ptrs) cudaFree(p);
  }
};

const char* dtype_name(DType t) { return t == DType::kBF16 ? "bf16" : "fp16"; }

void fill_dtype(DType t, void* x, int64_t n, uint64_t seed, float amp) {
  if (n == 0) return;
  if (t == DType::kBF16) {
    fill_normal<__nv_bfloat16><<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), n, seed, amp);
  } else {
    fill_normal<__half><<<1024, 256>>>(static_cast<__half*>(x), n, seed, amp);
  }
  CHECK_CUDA(cudaGetLastError());
}

// Segment-id patterns (dense calls).
enum class Segments {
  kNone,
  kRuns,       // runs of 1..max_run positions, the same pattern for queries and keys
  kRunsApart,  // independent run patterns for queries and keys (ids grow with the position)
  kStripes,    // ids 0, 1, 2 repeating every 3 positions: nothing can be skipped
  kRecurring,  // kRuns with ids 0, 1, 2 cycling over the runs: an id recurs after others
};

struct Case {
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int heads_q = 4;
  int heads_kv = 2;
  float amp = 1.f;
  // Dense when `seqs` is empty: `batch` sequences of seqlen_q queries and seqlen_k keys.
  int batch = 2;
  int seqlen_q = 0;
  int seqlen_k = 0;
  // Packed: (len_q, len_k) per sequence, then pad_q query rows and pad_k key rows past the last.
  std::vector<std::pair<int, int>> seqs;
  int pad_q = 0;
  int pad_k = 0;
  int64_t left = kUnbounded;
  int64_t right = kUnbounded;
  float softcap = 0.f;
  bool sinks = false;
  Segments segments = Segments::kNone;
  int max_run = 300;
  // Segments::kRuns with these run lengths (document_ids; the keys follow the queries) instead of
  // random ones, when given.
  std::vector<int> doc_lens;
  // Poison (NaN) the Q, K and V rows of this sequence / dense batch element, and the rows past
  // the last packed sequence; -1: none. Its rows are then left out of the comparison.
  int poison = -1;

  bool packed() const { return !seqs.empty(); }
};

std::string bound_text(int64_t b) { return b >= kUnbounded ? "inf" : std::to_string(b); }

std::string describe(const Case& c) {
  char buf[256];
  std::string s;
  if (c.packed()) {
    int64_t tq = 0, tk = 0;
    for (const auto& sq : c.seqs) {
      tq += sq.first;
      tk += sq.second;
    }
    std::snprintf(buf, sizeof(buf), "packed n=%zu rows_q=%lld rows_k=%lld", c.seqs.size(),
                  static_cast<long long>(tq + c.pad_q), static_cast<long long>(tk + c.pad_k));
  } else {
    std::snprintf(buf, sizeof(buf), "B=%d Sq=%4d Sk=%4d", c.batch, c.seqlen_q, c.seqlen_k);
  }
  s = buf;
  std::snprintf(buf, sizeof(buf), " D=%3d %s Hq=%d Hkv=%d amp=%g band=[%s,%s]", c.head_dim,
                dtype_name(c.dtype), c.heads_q, c.heads_kv, c.amp, bound_text(c.left).c_str(),
                bound_text(c.right).c_str());
  s += buf;
  if (c.softcap > 0.f) s += " softcap=" + std::to_string(static_cast<int>(c.softcap));
  if (c.sinks) s += " sinks";
  if (c.segments != Segments::kNone) {
    static const char* const names[] = {"", "runs", "runs-apart", "stripes", "recurring"};
    s += std::string(" seg=") + names[static_cast<int>(c.segments)];
  }
  if (c.poison >= 0) s += " poison=" + std::to_string(c.poison);
  return s;
}

// Ids of `n` positions: runs of random length 1..max_run with increasing ids, or stripes.
std::vector<int32_t> segment_ids(int n, Segments kind, int max_run, uint64_t seed) {
  std::vector<int32_t> ids(n);
  if (kind == Segments::kStripes) {
    for (int i = 0; i < n; ++i) ids[i] = i % 3;
    return ids;
  }
  int id = 0;
  for (int i = 0; i < n;) {
    seed = splitmix64(seed);
    const int run = 1 + static_cast<int>(seed % static_cast<uint64_t>(max_run));
    for (int j = 0; j < run && i < n; ++j, ++i) ids[i] = kind == Segments::kRecurring ? id % 3 : id;
    ++id;
  }
  return ids;
}

// Ids of `n` positions in runs of the given lengths (document d has id d); positions past the
// last run belong to one more document.
std::vector<int32_t> document_ids(int n, const std::vector<int>& lens) {
  std::vector<int32_t> ids(n, static_cast<int32_t>(lens.size()));
  int pos = 0;
  for (size_t d = 0; d < lens.size(); ++d) {
    for (int j = 0; j < lens[d] && pos < n; ++j) ids[pos++] = static_cast<int32_t>(d);
  }
  return ids;
}

// The chunk records of each batch row, as the FFI's caller passes them (common/mask.h).
std::vector<int32_t> chunk_ranges(const std::vector<int32_t>& ids, int batch, int n,
                                  bool suffix_reach) {
  std::vector<int32_t> r(static_cast<size_t>(batch) * segment_chunks(n) * kSegmentRecord);
  build_segment_records(ids.data(), batch, n, suffix_reach, r.data());
  return r;
}

// Everything one call needs: FwdParams over freshly filled inputs, plus the reference's row map.
struct Problem {
  DeviceBuffers buf;
  FwdParams p{};
  int64_t rows_q = 0, rows_k = 0;
  std::vector<RowInfo> rows;
  std::vector<int> row_seq;  // sequence (dense: batch element) of each query row; -1: padding
  int64_t stat_head = 0;
  int64_t lse_count = 0;
  std::vector<int32_t> q_ids, kv_ids;  // dense segment ids, [batch, seqlen]
};

void build(Problem& pb, const Case& c, uint64_t seed) {
  FwdParams& p = pb.p;
  jax_flash::SeqLayout& l = p.layout;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  // The persistent forward's tile counter, as the FFI handler passes it (JAX_FLASH_FWD_PERSISTENT
  // and JAX_FLASH_FWD_PERSISTENT_CTAS choose whether and how a call runs persistent).
  p.work_counter = pb.buf.alloc<int32_t>(4);
  l.heads_q = c.heads_q;
  std::vector<std::pair<int64_t, int64_t>> q_spans, k_spans;  // (start, len) per sequence
  if (c.packed()) {
    std::vector<int32_t> cu_q{0}, cu_k{0};
    int max_q = 0, max_k = 0;
    for (const auto& s : c.seqs) {
      q_spans.push_back({cu_q.back(), s.first});
      k_spans.push_back({cu_k.back(), s.second});
      cu_q.push_back(cu_q.back() + s.first);
      cu_k.push_back(cu_k.back() + s.second);
      max_q = std::max(max_q, s.first);
      max_k = std::max(max_k, s.second);
    }
    pb.rows_q = cu_q.back() + c.pad_q;
    pb.rows_k = cu_k.back() + c.pad_k;
    l.cu_seqlens_q = pb.buf.upload(cu_q);
    l.cu_seqlens_k = pb.buf.upload(cu_k);
    l.num_seqs = static_cast<int64_t>(c.seqs.size());
    l.total_q = pb.rows_q;
    l.total_k = pb.rows_k;
    l.batch = 1;
    l.seqlen_q = pb.rows_q;
    l.seqlen_k = pb.rows_k;
    l.max_seqlen_q = max_q;
    l.max_seqlen_k = max_k;
    pb.stat_head = pb.rows_q;
    pb.lse_count = c.heads_q * pb.rows_q;
  } else {
    for (int b = 0; b < c.batch; ++b) {
      q_spans.push_back({static_cast<int64_t>(b) * c.seqlen_q, c.seqlen_q});
      k_spans.push_back({static_cast<int64_t>(b) * c.seqlen_k, c.seqlen_k});
    }
    pb.rows_q = static_cast<int64_t>(c.batch) * c.seqlen_q;
    pb.rows_k = static_cast<int64_t>(c.batch) * c.seqlen_k;
    l.batch = c.batch;
    l.seqlen_q = c.seqlen_q;
    l.seqlen_k = c.seqlen_k;
    l.max_seqlen_q = c.seqlen_q;
    l.max_seqlen_k = c.seqlen_k;
    pb.stat_head = c.seqlen_q;
    pb.lse_count = static_cast<int64_t>(c.batch) * c.heads_q * c.seqlen_q;
  }
  // The reference's row map, from the spans above (not from the scheduler).
  pb.rows.assign(pb.rows_q, RowInfo{0, 0, 0, 0, 0, 0});
  pb.row_seq.assign(pb.rows_q, -1);
  for (size_t n = 0; n < q_spans.size(); ++n) {
    for (int64_t i = 0; i < q_spans[n].second; ++i) {
      const int64_t r = q_spans[n].first + i;
      RowInfo& ri = pb.rows[r];
      ri.k_start = k_spans[n].first;
      ri.len_q = static_cast<int>(q_spans[n].second);
      ri.len_k = static_cast<int>(k_spans[n].second);
      ri.i = static_cast<int>(i);
      ri.batch = c.packed() ? 0 : static_cast<int>(n);
      ri.stat = c.packed() ? r : static_cast<int64_t>(n) * c.heads_q * c.seqlen_q + i;
      pb.row_seq[r] = static_cast<int>(n);
    }
  }
  // Padding rows of a packed call: no keys; lse at h * total_q + r.
  for (int64_t r = q_spans.empty() ? 0 : q_spans.back().first + q_spans.back().second;
       c.packed() && r < pb.rows_q; ++r) {
    pb.rows[r].stat = r;
    pb.rows[r].len_q = static_cast<int>(pb.rows_q - r);
  }

  const int64_t nq = pb.rows_q * c.heads_q * c.head_dim;
  const int64_t nk = pb.rows_k * c.heads_kv * c.head_dim;
  p.q = pb.buf.alloc<uint16_t>(nq * 2);
  p.k = pb.buf.alloc<uint16_t>(nk * 2);
  p.v = pb.buf.alloc<uint16_t>(nk * 2);
  p.o = pb.buf.alloc<uint16_t>(nq * 2);
  p.lse = pb.buf.alloc<float>(pb.lse_count * 4);
  fill_dtype(c.dtype, const_cast<void*>(p.q), nq, seed * 3 + 0, c.amp);
  fill_dtype(c.dtype, const_cast<void*>(p.k), nk, seed * 3 + 1, c.amp);
  fill_dtype(c.dtype, const_cast<void*>(p.v), nk, seed * 3 + 2, 1.f);
  if (c.poison >= 0) {
    // All-ones bits are NaN in f16 and bf16.
    const int64_t q_row_bytes = static_cast<int64_t>(c.heads_q) * c.head_dim * 2;
    const int64_t k_row_bytes = static_cast<int64_t>(c.heads_kv) * c.head_dim * 2;
    const auto poison_rows = [](const void* base, int64_t row_bytes, int64_t r0, int64_t r1) {
      if (r1 > r0) {
        CHECK_CUDA(cudaMemset(static_cast<char*>(const_cast<void*>(base)) + r0 * row_bytes, 0xFF,
                              (r1 - r0) * row_bytes));
      }
    };
    const auto& qs = q_spans[c.poison];
    const auto& ks = k_spans[c.poison];
    poison_rows(p.q, q_row_bytes, qs.first, qs.first + qs.second);
    poison_rows(p.k, k_row_bytes, ks.first, ks.first + ks.second);
    poison_rows(p.v, k_row_bytes, ks.first, ks.first + ks.second);
    if (c.packed()) {
      poison_rows(p.q, q_row_bytes, q_spans.back().first + q_spans.back().second, pb.rows_q);
      poison_rows(p.k, k_row_bytes, k_spans.back().first + k_spans.back().second, pb.rows_k);
      poison_rows(p.v, k_row_bytes, k_spans.back().first + k_spans.back().second, pb.rows_k);
    }
  }

  jax_flash::MaskParams& m = p.mask;
  m.band.left = c.left;
  m.band.right = c.right;
  m.softcap = c.softcap;
  if (c.sinks) {
    const int64_t n = (c.packed() ? 1 : c.batch) * static_cast<int64_t>(c.heads_q);
    std::vector<float> sinks(n);
    uint64_t s = seed * 7 + 5;
    for (auto& x : sinks) {
      s = splitmix64(s);
      x = static_cast<float>(static_cast<double>(s >> 11) / 9007199254740992.0 * 6.0 - 3.0);
    }
    m.sinks = pb.buf.upload(sinks);
    m.sinks_batch_stride = c.packed() ? 0 : c.heads_q;
  }
  if (c.segments != Segments::kNone) {
    std::vector<int32_t> q_ids, kv_ids;
    for (int b = 0; b < c.batch; ++b) {
      const uint64_t s = seed * 11 + b;
      const auto qi = c.doc_lens.empty() ? segment_ids(c.seqlen_q, c.segments, c.max_run, s)
                                         : document_ids(c.seqlen_q, c.doc_lens);
      // kRuns: the keys follow the queries' pattern (stretched when the lengths differ).
      std::vector<int32_t> ki;
      if (c.segments == Segments::kRunsApart) {
        ki = segment_ids(c.seqlen_k, c.segments, c.max_run / 2 + 1, s + 1000);
      } else if (c.segments == Segments::kRuns || c.segments == Segments::kRecurring) {
        ki.resize(c.seqlen_k);
        for (int j = 0; j < c.seqlen_k; ++j) {
          ki[j] = c.seqlen_q > 0 ? qi[static_cast<int64_t>(j) * c.seqlen_q / c.seqlen_k] : 0;
        }
      } else {
        ki = segment_ids(c.seqlen_k, c.segments, c.max_run, s);
      }
      q_ids.insert(q_ids.end(), qi.begin(), qi.end());
      kv_ids.insert(kv_ids.end(), ki.begin(), ki.end());
    }
    m.segments.q_ids = pb.buf.upload(q_ids);
    m.segments.kv_ids = pb.buf.upload(kv_ids);
    m.segments.q_ranges = pb.buf.upload(chunk_ranges(q_ids, c.batch, c.seqlen_q, true));
    m.segments.kv_ranges = pb.buf.upload(chunk_ranges(kv_ids, c.batch, c.seqlen_k, false));
    pb.q_ids = std::move(q_ids);
    pb.kv_ids = std::move(kv_ids);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
}

bool run_case(const Case& c, int index) {
  Problem pb;
  build(pb, c, 1000 + index);
  const FwdParams& p = pb.p;
  std::printf("%s: ", describe(c).c_str());
  if (!jax_flash::cuda::fwd_wgmma_supported(p, c.dtype)) {
    std::printf("NOT SUPPORTED -> FAIL\n");
    return false;
  }

  const int64_t nq = pb.rows_q * c.heads_q * c.head_dim;
  const int64_t nl = pb.lse_count;
  const int64_t nrh = pb.rows_q * c.heads_q;
  float* o_ref = pb.buf.alloc<float>(nq * 4);
  float* lse_ref = pb.buf.alloc<float>(nl * 4);
  int* seen = pb.buf.alloc<int>(nrh * 4);
  float* o_wide = pb.buf.alloc<float>(nq * 4);
  CHECK_CUDA(cudaMemset(lse_ref, 0, nl * 4));
  RefArgs ra{};
  ra.rows = pb.buf.upload(pb.rows);
  ra.num_rows = pb.rows_q;
  ra.heads_q = c.heads_q;
  ra.heads_kv = c.heads_kv;
  ra.head_dim = c.head_dim;
  ra.stat_head = pb.stat_head;
  ra.scale = static_cast<float>(p.softmax_scale);
  ra.left = c.left;
  ra.right = c.right;
  ra.softcap = c.softcap;
  ra.sinks = static_cast<const float*>(p.mask.sinks);
  ra.sinks_stride = p.mask.sinks_batch_stride;
  ra.q_ids = p.mask.segments.q_ids;
  ra.kv_ids = p.mask.segments.kv_ids;
  ra.seqlen_q = c.seqlen_q;
  ra.seqlen_k = c.seqlen_k;
  ra.o = o_ref;
  ra.lse = lse_ref;
  ra.seen = seen;
  if (nrh > 0) {
    const unsigned ref_blocks = static_cast<unsigned>((nrh + 127) / 128);
    if (c.dtype == DType::kBF16) {
      reference_fwd<__nv_bfloat16><<<ref_blocks, 128>>>(static_cast<const __nv_bfloat16*>(p.q),
                                                        static_cast<const __nv_bfloat16*>(p.k),
                                                        static_cast<const __nv_bfloat16*>(p.v), ra);
    } else {
      reference_fwd<__half><<<ref_blocks, 128>>>(static_cast<const __half*>(p.q),
                                                 static_cast<const __half*>(p.k),
                                                 static_cast<const __half*>(p.v), ra);
    }
    CHECK_CUDA(cudaGetLastError());
  }

  // Poison the outputs (all-ones bits are NaN in every format) so unwritten elements show up.
  std::vector<uint16_t> o_first(nq);
  std::vector<float> lse_first(nl);
  bool deterministic = true;
  for (int run = 0; run < 2; ++run) {
    CHECK_CUDA(cudaMemset(p.o, 0xFF, nq * 2));
    CHECK_CUDA(cudaMemset(p.lse, 0xFF, nl * 4));
    CHECK_CUDA(jax_flash::cuda::fwd_wgmma(p, c.dtype, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    if (run == 0) {
      CHECK_CUDA(cudaMemcpy(o_first.data(), p.o, nq * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(lse_first.data(), p.lse, nl * 4, cudaMemcpyDeviceToHost));
    } else {
      std::vector<uint16_t> o_second(nq);
      std::vector<float> lse_second(nl);
      CHECK_CUDA(cudaMemcpy(o_second.data(), p.o, nq * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(lse_second.data(), p.lse, nl * 4, cudaMemcpyDeviceToHost));
      deterministic = std::memcmp(o_first.data(), o_second.data(), nq * 2) == 0 &&
                      std::memcmp(lse_first.data(), lse_second.data(), nl * 4) == 0;
    }
  }
  if (nq > 0) {
    if (c.dtype == DType::kBF16) {
      widen<__nv_bfloat16><<<1024, 256>>>(static_cast<const __nv_bfloat16*>(p.o), o_wide, nq);
    } else {
      widen<__half><<<1024, 256>>>(static_cast<const __half*>(p.o), o_wide, nq);
    }
    CHECK_CUDA(cudaGetLastError());
  }
  std::vector<float> o_h(nq), o_r(nq), l_h(nl), l_r(nl);
  std::vector<int> seen_h(nrh);
  CHECK_CUDA(cudaMemcpy(o_h.data(), o_wide, nq * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o_r.data(), o_ref, nq * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(l_h.data(), p.lse, nl * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(l_r.data(), lse_ref, nl * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(seen_h.data(), seen, nrh * 4, cudaMemcpyDeviceToHost));

  int64_t nan_count = 0, lse_bad = 0, masked_rows = 0, masked_nonzero = 0, skipped_rows = 0;
  double err2 = 0.0, ref2 = 0.0, max_abs = 0.0, lse_max_err = 0.0;
  for (int64_t r = 0; r < pb.rows_q; ++r) {
    // A poisoned sequence's own rows are NaN by construction.
    if (c.poison >= 0 && pb.row_seq[r] == c.poison) {
      skipped_rows += c.heads_q;
      continue;
    }
    for (int h = 0; h < c.heads_q; ++h) {
      const int64_t base = (r * c.heads_q + h) * c.head_dim;
      bool row_nan = false;
      for (int d = 0; d < c.head_dim; ++d) {
        const float x = o_h[base + d];
        if (std::isnan(x) || std::isinf(x)) {
          row_nan = true;
          continue;
        }
        const double e = static_cast<double>(x) - o_r[base + d];
        err2 += e * e;
        ref2 += static_cast<double>(o_r[base + d]) * o_r[base + d];
        max_abs = std::max(max_abs, std::fabs(e));
      }
      nan_count += row_nan;
      const int64_t li = pb.rows[r].stat + h * pb.stat_head;
      const double lh = l_h[li], lr = l_r[li];
      if (std::isnan(lh)) {
        ++nan_count;
        continue;
      }
      if (seen_h[r * c.heads_q + h] == 0) {
        // No visible key: O exactly 0, lse = the sink (or -inf).
        ++masked_rows;
        for (int d = 0; d < c.head_dim; ++d) masked_nonzero += o_h[base + d] != 0.f;
        if (std::isinf(lr)) {
          if (!(std::isinf(lh) && lh < 0)) ++lse_bad;
          continue;
        }
      }
      const double e = std::fabs(lh - lr);
      lse_max_err = std::max(lse_max_err, std::isfinite(e) ? e : 1e30);
      if (!(e <= 1e-3 * std::max(1.0, std::fabs(lr)))) ++lse_bad;
    }
  }
  const double rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  const bool ok =
      nan_count == 0 && rel_l2 <= 1e-2 && lse_bad == 0 && masked_nonzero == 0 && deterministic;
  std::printf(
      "max_abs=%.3e rel_l2=%.3e lse_max_err=%.2e masked_rows=%lld skipped=%lld nan=%lld "
      "lse_bad=%lld masked_nonzero=%lld det=%d %s\n",
      max_abs, rel_l2, lse_max_err, static_cast<long long>(masked_rows),
      static_cast<long long>(skipped_rows), static_cast<long long>(nan_count),
      static_cast<long long>(lse_bad), static_cast<long long>(masked_nonzero),
      deterministic ? 1 : 0, ok ? "ok" : "FAIL");
  return ok;
}

// Visible (query, key) pairs of one head of a case, from the semantics.
double visible_pairs(const Case& c, const Problem& pb) {
  std::vector<std::pair<int, int>> seqs = c.seqs;
  if (!c.packed()) seqs.assign(c.batch, {c.seqlen_q, c.seqlen_k});
  double pairs = 0.0;
  for (size_t n = 0; n < seqs.size(); ++n) {
    const int64_t len_q = seqs[n].first, len_k = seqs[n].second;
    const int64_t off = len_k - len_q;
    for (int64_t i = 0; i < len_q; ++i) {
      const int64_t lo = c.left >= kUnbounded ? 0 : std::max<int64_t>(0, i + off - c.left);
      const int64_t hi =
          c.right >= kUnbounded ? len_k - 1 : std::min<int64_t>(len_k - 1, i + off + c.right);
      if (pb.q_ids.empty()) {
        if (hi >= lo) pairs += static_cast<double>(hi - lo + 1);
        continue;
      }
      const int32_t id = pb.q_ids[n * len_q + i];
      for (int64_t j = lo; j <= hi; ++j) pairs += pb.kv_ids[n * len_k + j] == id ? 1.0 : 0.0;
    }
  }
  return pairs;
}

// Median milliseconds of one call and its rate on visible pairs; 0 if not supported.
double time_case(const Case& c, const char* label, double baseline_tflops) {
  Problem pb;
  build(pb, c, 7);
  const FwdParams& p = pb.p;
  std::printf("%-34s %s D=%3d H=%2d: ", label, dtype_name(c.dtype), c.head_dim, c.heads_q);
  if (!jax_flash::cuda::fwd_wgmma_supported(p, c.dtype)) {
    std::printf("not supported\n");
    return 0.0;
  }
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) CHECK_CUDA(jax_flash::cuda::fwd_wgmma(p, c.dtype, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  constexpr int kRepeats = 10;
  constexpr int kLaunches = 20;
  std::vector<float> ms(kRepeats);
  for (int r = 0; r < kRepeats; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < kLaunches; ++i) CHECK_CUDA(jax_flash::cuda::fwd_wgmma(p, c.dtype, nullptr));
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    CHECK_CUDA(cudaEventElapsedTime(&ms[r], start, stop));
    ms[r] /= kLaunches;
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  const double median_ms = 0.5 * (ms[kRepeats / 2 - 1] + ms[kRepeats / 2]);
  const double flops = 4.0 * c.head_dim * c.heads_q * visible_pairs(c, pb);
  const double tflops = flops / (median_ms * 1e-3) / 1e12;
  std::printf("%8.3f ms  %6.1f TFLOP/s", median_ms, tflops);
  if (baseline_tflops > 0.0) std::printf("  x%.3f of baseline", tflops / baseline_tflops);
  std::printf("\n");
  return tflops;
}

Case dense(DType dtype, int head_dim, int sq, int sk, int hkv, int64_t left, int64_t right) {
  Case c;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_kv = hkv;
  c.left = left;
  c.right = right;
  return c;
}

Case packed(DType dtype, int head_dim, std::vector<std::pair<int, int>> seqs, int pad_q, int pad_k,
            int64_t left, int64_t right) {
  Case c;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.seqs = std::move(seqs);
  c.pad_q = pad_q;
  c.pad_k = pad_k;
  c.left = left;
  c.right = right;
  return c;
}

// Random (len, len) documents of min_len..max_len tokens filling `total` tokens.
std::vector<std::pair<int, int>> documents(int total, int min_len, int max_len, uint64_t seed) {
  std::vector<std::pair<int, int>> seqs;
  int used = 0;
  while (used < total) {
    seed = splitmix64(seed);
    int len = min_len + static_cast<int>(seed % static_cast<uint64_t>(max_len - min_len + 1));
    len = std::min(len, total - used);
    seqs.push_back({len, len});
    used += len;
  }
  return seqs;
}

// The cases of the new features for one (dtype, head_dim). `quick` keeps a few small ones (for
// compute-sanitizer) that still reach every code path: masked and skipped blocks, sequences
// straddling tiles, padding rows, segment walks, softcap and sinks.
void feature_cases(std::vector<Case>& out, DType dt, int hd, bool quick) {
  const int64_t inf = kUnbounded;
  const auto add = [&](Case c) { out.push_back(std::move(c)); };
  const auto with = [](Case c, auto&& edit) {
    edit(c);
    return c;
  };
  // Packed (cu_seqlens) batches: empty and one-row sequences, tiles straddling sequence ends,
  // padding rows past the last sequence; the first list has len_q = len_k, the second not.
  const std::vector<std::pair<int, int>> same = {{1, 1},     {17, 17},     {128, 128},
                                                 {129, 129}, {0, 0},       {300, 300},
                                                 {64, 64},   {1000, 1000}, {257, 257}};
  const std::vector<std::pair<int, int>> apart = {{17, 40},    {300, 300}, {5, 0},  {0, 7},
                                                  {129, 1000}, {200, 3},   {1, 333}};
  const std::vector<std::pair<int, int>> small = {{1, 1}, {17, 17}, {129, 129}, {0, 0}, {200, 200}};
  if (quick) {
    add(dense(dt, hd, 300, 300, 2, 0, 0));
    add(dense(dt, hd, 257, 300, 2, 64, 0));
    add(dense(dt, hd, 300, 129, 1, 20, 5));
    add(with(dense(dt, hd, 129, 200, 1, inf, inf), [](Case& c) {
      c.softcap = 5.f;
      c.amp = 6.f;
    }));
    add(with(dense(dt, hd, 300, 129, 2, inf, 0), [](Case& c) { c.sinks = true; }));
    add(with(dense(dt, hd, 300, 300, 2, inf, 0), [](Case& c) {
      c.segments = Segments::kRuns;
      c.max_run = 100;
    }));
    add(with(dense(dt, hd, 129, 300, 2, inf, inf),
             [](Case& c) { c.segments = Segments::kRunsApart; }));
    add(packed(dt, hd, small, 37, 50, inf, inf));
    add(packed(dt, hd, apart, 0, 19, 30, 0));
    add(with(packed(dt, hd, small, 37, 50, inf, 0), [](Case& c) { c.poison = 2; }));
    return;
  }
  // Sliding windows and other bands (bottom-right aligned).
  add(dense(dt, hd, 1000, 1000, 2, 0, 0));      // the diagonal only
  add(dense(dt, hd, 1000, 1000, 2, 127, 0));    // causal window
  add(dense(dt, hd, 257, 1000, 2, 64, 0));      // fewer queries than keys
  add(dense(dt, hd, 1000, 300, 1, 50, 10));     // many rows see no key
  add(dense(dt, hd, 300, 300, 2, inf, 17));     // right bound only
  add(dense(dt, hd, 129, 129, 4, 5, inf));      // left bound only
  add(dense(dt, hd, 1000, 1000, 2, 300, 300));  // two-sided
  add(dense(dt, hd, 4500, 4500, 2, 1023, 0));   // window over long keys: blocks skipped
  add(dense(dt, hd, 2125, 2125, 4, 4000, 0));   // window wider than the sequence
  // Soft-capping (large logits reach tanh's saturation).
  add(with(dense(dt, hd, 333, 517, 1, inf, inf), [](Case& c) {
    c.amp = 6.f;
    c.softcap = 5.f;
  }));
  add(with(dense(dt, hd, 1000, 1000, 2, inf, 0), [](Case& c) {
    c.amp = 3.f;
    c.softcap = 20.f;
  }));
  add(with(dense(dt, hd, 1000, 1000, 2, 200, 0), [](Case& c) {
    c.amp = 3.f;
    c.softcap = 2.f;
  }));
  // A cap far above the logits: scores keep their spread, so most of P lies well below 1.
  for (int64_t right : {inf, int64_t{0}}) {
    add(with(dense(dt, hd, 1000, 1000, 2, inf, right), [](Case& c) {
      c.amp = 3.f;
      c.softcap = 50.f;
    }));
  }
  // Sinks; with a causal Sq > Sk some rows see no key and get lse = sink.
  add(with(dense(dt, hd, 300, 300, 2, inf, inf), [](Case& c) { c.sinks = true; }));
  add(with(dense(dt, hd, 1000, 300, 2, inf, 0), [](Case& c) { c.sinks = true; }));
  add(with(dense(dt, hd, 1000, 1000, 2, 10, 0), [](Case& c) {
    c.sinks = true;
    c.softcap = 30.f;
    c.amp = 3.f;
  }));
  // Segment ids (dense).
  add(with(dense(dt, hd, 1000, 1000, 2, inf, inf), [](Case& c) { c.segments = Segments::kRuns; }));
  add(with(dense(dt, hd, 1000, 1000, 2, inf, 0), [](Case& c) { c.segments = Segments::kRuns; }));
  add(with(dense(dt, hd, 300, 1000, 2, inf, inf),
           [](Case& c) { c.segments = Segments::kRunsApart; }));
  add(with(dense(dt, hd, 257, 257, 2, inf, inf), [](Case& c) { c.segments = Segments::kStripes; }));
  add(with(dense(dt, hd, 1000, 1000, 2, 400, 0), [](Case& c) {
    c.segments = Segments::kRuns;
    c.softcap = 10.f;
    c.amp = 2.f;
    c.sinks = true;
  }));
  // 9000-token rows: many short documents (whole 32-block windows of the key-block walk are
  // skipped), long documents (walks that end at a document's start, more than 32 blocks below
  // the diagonal) and ids that recur after others (walks that must go on past such a start).
  struct LongRow {
    int64_t right;
    Segments kind;
    int max_run;
  };
  for (const LongRow& r :
       {LongRow{0, Segments::kRuns, 250}, LongRow{0, Segments::kRuns, 5000},
        LongRow{inf, Segments::kRecurring, 3000}, LongRow{0, Segments::kRecurring, 3000}}) {
    add(with(dense(dt, hd, 9000, 9000, 1, inf, r.right), [&](Case& c) {
      c.segments = r.kind;
      c.max_run = r.max_run;
      c.heads_q = 2;
    }));
  }
  // Packed batches.
  add(packed(dt, hd, same, 37, 50, inf, inf));
  add(packed(dt, hd, same, 37, 50, inf, 0));
  add(packed(dt, hd, apart, 0, 19, inf, 0));
  add(packed(dt, hd, documents(6000, 1, 400, 99), 16, 16, inf, 0));
  // About 120 documents: more spans than a warp's lanes, so the span search takes two rounds.
  add(packed(dt, hd, documents(6000, 1, 100, 98), 16, 16, inf, 0));
  add(with(packed(dt, hd, same, 5, 0, 100, 0), [](Case& c) {
    c.softcap = 8.f;
    c.amp = 2.f;
    c.sinks = true;
  }));
  // NaN in one sequence (or batch element) and in the rows past the last sequence: nothing may
  // leak into the others. Sequence 3 (129 rows) and 5 (300) have neighbours straddling into them.
  add(with(packed(dt, hd, same, 37, 50, inf, inf), [](Case& c) { c.poison = 3; }));
  add(with(packed(dt, hd, same, 37, 50, inf, 0), [](Case& c) { c.poison = 5; }));
  add(with(packed(dt, hd, apart, 3, 3, 30, 30), [](Case& c) { c.poison = 4; }));
  add(with(dense(dt, hd, 300, 300, 2, inf, inf), [](Case& c) { c.poison = 1; }));
}

// Part 3: the softmax-bound cells, each plain and then soft-capped.
void time_softmax_cells() {
  std::printf(
      "softmax-bound cells (B=4 S=4096 H=16; softcap rows: ratio to the plain row above; "
      "target >= 0.90)\n");
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int head_dim : {64, 128}) {
      for (bool causal : {false, true}) {
        Case c = dense(dtype, head_dim, 4096, 4096, 16, kUnbounded, causal ? 0 : kUnbounded);
        c.batch = 4;
        c.heads_q = 16;
        char label[64];
        std::snprintf(label, sizeof(label), "B=4 S=4096 %s", causal ? "causal" : "full");
        const double plain = time_case(c, label, 0.0);
        c.softcap = 50.f;
        std::snprintf(label, sizeof(label), "B=4 S=4096 %s softcap 50", causal ? "causal" : "full");
        time_case(c, label, plain);
      }
    }
  }
}

// The launch-order and segment-id study: the cells a tile order or the segment walk can move.
// The documents are bench_masks.py's (seed 0): 11 documents filling 16k tokens.
void time_order_cells() {
  const int64_t inf = kUnbounded;
  const std::vector<int> docs = {3494, 2632, 2125, 1152, 1305, 229, 367, 130, 770, 3343, 837};
  // The same documents rounded to multiples of 128 tokens: no tile holds two documents, so the
  // segment-id kernel masks only the diagonal tiles, as the packed one does, and the difference
  // between the two is what every tile pays.
  const std::vector<int> aligned = {3456, 2688, 2176, 1152, 1280, 256, 384, 128, 768, 3328, 768};
  for (int head_dim : {128, 64, 256}) {
    const int heads = 2048 / head_dim;
    for (int s : {1024, 4096}) {
      for (bool causal : {true, false}) {
        if (!causal && head_dim != 128) continue;
        Case c = dense(DType::kBF16, head_dim, s, s, heads, inf, causal ? 0 : inf);
        c.batch = 16384 / s;
        c.heads_q = heads;
        char label[64];
        std::snprintf(label, sizeof(label), "B=%2d S=%5d %s", c.batch, s,
                      causal ? "causal" : "full");
        time_case(c, label, 0.0);
      }
    }
    if (head_dim != 128) continue;
    Case c16 = dense(DType::kBF16, head_dim, 16384, 16384, heads, inf, 0);
    c16.batch = 1;
    c16.heads_q = heads;
    time_case(c16, "B= 1 S=16384 causal", 0.0);
    Case window = c16;
    window.left = 1023;
    time_case(window, "window 1k over 16k", 0.0);
    // One row of documents of these lengths, packed (varlen) and as segment ids of a dense row.
    const auto document_cases = [&](const std::vector<int>& lengths) {
      std::vector<std::pair<int, int>> seqs;
      for (int d : lengths) seqs.push_back({d, d});
      Case as_packed = packed(DType::kBF16, head_dim, seqs, 0, 0, inf, 0);
      as_packed.heads_q = heads;
      as_packed.heads_kv = heads;
      Case as_segments = c16;
      as_segments.segments = Segments::kRuns;
      as_segments.doc_lens = lengths;
      return std::make_pair(as_packed, as_segments);
    };
    const auto [packed_docs, seg] = document_cases(docs);
    const auto [aligned_packed, aligned_seg] = document_cases(aligned);
    time_case(packed_docs, "11 documents packed (varlen)", 0.0);
    time_case(seg, "11 documents as segment ids", 0.0);
    time_case(aligned_packed, "11 aligned documents packed", 0.0);
    time_case(aligned_seg, "11 aligned documents segment ids", 0.0);
    // The first packed cell of a process reads slow (docs/PERF_LOG.md): the four cells again.
    time_case(packed_docs, "11 documents packed (varlen)", 0.0);
    time_case(seg, "11 documents as segment ids", 0.0);
    time_case(aligned_packed, "11 aligned documents packed", 0.0);
    time_case(aligned_seg, "11 aligned documents segment ids", 0.0);
  }
}

// One dense cell of the timing grid: bf16, 16k tokens (batch 16384 / s), hidden 2048.
void time_grid_cell(int head_dim, int s, bool causal) {
  const int heads = 2048 / head_dim;
  Case c = dense(DType::kBF16, head_dim, s, s, heads, kUnbounded, causal ? 0 : kUnbounded);
  c.batch = 16384 / s;
  c.heads_q = heads;
  char label[64];
  std::snprintf(label, sizeof(label), "B=%2d S=%5d %s", c.batch, s, causal ? "causal" : "full");
  time_case(c, label, 0.0);
}

// Part 2's dense cells: every head_dim, unmasked and causal, 1k to 16k.
void time_grid() {
  for (int head_dim : {128, 64, 256}) {
    for (bool causal : {false, true}) {
      for (int s : {1024, 2048, 4096, 16384}) time_grid_cell(head_dim, s, causal);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool softmax_only = argc > 1 && std::strcmp(argv[1], "--softmax") == 0;
  const bool time_only = argc > 1 && std::strcmp(argv[1], "--time") == 0;
  const bool correct_only = argc > 1 && std::strcmp(argv[1], "--correct") == 0;
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);

  if (softmax_only) {
    time_softmax_cells();
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--order") == 0) {
    time_order_cells();
    return 0;
  }
  // --grid: the timing grid of part 2 alone (no correctness cases, no feature cells).
  if (argc > 1 && std::strcmp(argv[1], "--grid") == 0) {
    time_grid();
    return 0;
  }
  // --cell D S causal|full: one cell of the timing grid below (bf16, 16k tokens, hidden 2048),
  // with no correctness launches before it, for a profiler (its 6th launch is a timed one).
  if (argc > 4 && std::strcmp(argv[1], "--cell") == 0) {
    const int head_dim = std::atoi(argv[2]);
    const int s = std::atoi(argv[3]);
    const bool causal = std::strcmp(argv[4], "causal") == 0;
    if ((head_dim != 64 && head_dim != 128 && head_dim != 256) || s <= 0 || 16384 % s != 0) {
      std::printf("--cell: head_dim 64, 128 or 256 and a seqlen dividing 16384\n");
      return 2;
    }
    time_grid_cell(head_dim, s, causal);
    return 0;
  }

  const int64_t inf = kUnbounded;
  // 4400 and 4500 keys reach the long-key tiles (seqlen_k >= kLongKeys = 4096).
  const int seq_pairs[][2] = {{1, 1},      {17, 17},     {128, 128},  {257, 257},   {1000, 1000},
                              {1, 1000},   {1000, 1},    {17, 257},   {257, 17},    {300, 1000},
                              {1000, 300}, {2125, 2125}, {300, 4400}, {4500, 4500}, {4500, 300}};
  const int quick_pairs[][2] = {{17, 17}, {257, 129}, {129, 257}, {1, 300}};
  std::vector<Case> cases;
  for (int head_dim : {128, 64, 256}) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      for (bool causal : {false, true}) {
        const int64_t right = causal ? 0 : inf;
        if (quick) {
          for (const auto& sp : quick_pairs) {
            cases.push_back(dense(dtype, head_dim, sp[0], sp[1], 2, inf, right));
          }
          continue;
        }
        for (const auto& sp : seq_pairs) {
          for (int heads_kv : {4, 2}) {
            cases.push_back(dense(dtype, head_dim, sp[0], sp[1], heads_kv, inf, right));
          }
        }
        // Large logits: the running max must keep exp2 from overflowing.
        Case c = dense(dtype, head_dim, 333, 517, 1, inf, right);
        c.amp = 6.f;
        cases.push_back(c);
      }
      // The feature paths do not depend on the element type beyond what the dense grid above
      // covers: fp16 runs them at head_dim 128 only, to keep the whole run short.
      if (dtype == DType::kBF16 || (!quick && head_dim == 128)) {
        feature_cases(cases, dtype, head_dim, quick);
      }
    }
  }
  int failures = 0;
  if (time_only) cases.clear();
  for (size_t i = 0; i < cases.size(); ++i) {
    failures += run_case(cases[i], static_cast<int>(i)) ? 0 : 1;
  }
  std::printf("%d of %zu cases failed\n", failures, cases.size());

  if (!quick && !correct_only) {
    time_grid();
    // Feature rates against the baselines of their targets (bf16, 16k tokens per call).
    std::printf(
        "features (rates on visible pairs; targets: window >= 0.9 x causal 16k, packed\n"
        "documents >= 0.85 x causal 4k, softcap >= 0.9 x and sinks >= 0.97 x causal 4k)\n");
    for (int head_dim : {128, 64, 256}) {
      const int heads = 2048 / head_dim;
      Case base16 = dense(DType::kBF16, head_dim, 16384, 16384, heads, inf, 0);
      base16.batch = 1;
      base16.heads_q = heads;
      const double causal16 = time_case(base16, "causal 16k (baseline)", 0.0);
      Case window = base16;
      window.left = 1023;
      time_case(window, "window 1k over 16k", causal16);
      Case base4 = dense(DType::kBF16, head_dim, 4096, 4096, heads, inf, 0);
      base4.batch = 4;
      base4.heads_q = heads;
      const double causal4 = time_case(base4, "causal 4k (baseline)", 0.0);
      Case docs = packed(DType::kBF16, head_dim, documents(16384, 64, 4096, 1234), 0, 0, inf, 0);
      docs.heads_q = heads;
      docs.heads_kv = heads;
      time_case(docs, "packed causal documents 64-4096", causal4);
      // Documents of at most 2048 tokens: a packed call the persistent forward serves.
      Case short_docs =
          packed(DType::kBF16, head_dim, documents(16384, 64, 2048, 1234), 0, 0, inf, 0);
      short_docs.heads_q = heads;
      short_docs.heads_kv = heads;
      time_case(short_docs, "packed causal documents 64-2048", causal4);
      Case cap = base4;
      cap.softcap = 30.f;
      time_case(cap, "causal 4k softcap", causal4);
      Case sink = base4;
      sink.sinks = true;
      time_case(sink, "causal 4k sinks", causal4);
      Case seg = base4;
      seg.segments = Segments::kRuns;
      seg.max_run = 2048;
      time_case(seg, "causal 4k segment ids (docs <= 2k)", causal4);
    }
    time_softmax_cells();
  }
  return failures == 0 ? 0 : 1;
}
