// Runs the CUDA kernels directly (no JAX) over a small grid of awkward cases so that
// compute-sanitizer's memcheck and racecheck see every kernel family, both directions, tails,
// causal masking, windows, softcap, sinks, segment ids, packed batches, GQA, each tensor-core
// head dim and the deterministic backward's dQ order. JAX_FLASH_CUDA_FAMILY=mma runs the mma.sync
// family where wgmma would apply. Usage: compute-sanitizer --tool memcheck
// ./sanitize_cases [--deterministic-only | --no-deterministic] [--shard K N] [--count | --case I].
// Exits non-zero on any CUDA error or non-finite output. --deterministic-only runs the
// deterministic backward's cases alone, --no-deterministic every other case; racecheck may report
// only the backward's dQ hand-off record in either (tools/racecheck_known.py), and since its
// display stops at 100 hazards, which the deterministic cases' record fills together, those are
// checked one case a process (--count, --case) and the others in shards (--shard; both in
// tools/gpu_run.sh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common/params.h"
#include "cuda/dq_convert.cuh"  // kDqCounters
#include "cuda/launch.h"
#include "cuda/segment_summaries.h"
#include "cuda_check.h"

namespace {

using jax_flash::BwdParams;
using jax_flash::DType;
using jax_flash::FwdParams;
using jax_flash::kUnbounded;

// One call. Dense calls have `batch` sequences of seqlen_q / seqlen_k; packed calls (varlen) put
// `batch` sequences of lengths seqlen_q - 3n / seqlen_k - 5n (n = 0, 1, ..; at least 0) back to
// back plus 7 padding tokens, so that tiles straddle sequence ends and the padding span is
// exercised.
struct Case {
  DType dtype;
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
  int64_t left = -1, right = -1;  // window bounds, -1 unbounded
  double softcap = 0.0;
  bool sinks = false;
  bool segments = false;  // documents of 37 positions (so they change mid-tile)
  // With segments: documents of several lengths scheduled one by one (SeqLayout::runs) in row 0,
  // recurring ids in the others, with the summaries from the GPU's summary kernel.
  int64_t runs_per_row = 0;
  bool varlen = false;
  bool deterministic = false;  // dQ added in the fixed key-tile order (dq_semaphores)
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

// Sequence lengths of a packed case, and its cu_seqlens over q and k.
struct Packing {
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t total_q = 0, total_k = 0;
};

Packing packing(const Case& c) {
  Packing p;
  for (int64_t n = 0; n < c.batch; ++n) {
    p.cu_q.push_back(p.cu_q.back() +
                     static_cast<int32_t>(std::max<int64_t>(c.seqlen_q - 3 * n, 0)));
    p.cu_k.push_back(p.cu_k.back() +
                     static_cast<int32_t>(std::max<int64_t>(c.seqlen_k - 5 * n, 0)));
  }
  constexpr int64_t kPadding = 7;
  p.total_q = p.cu_q.back() + kPadding;
  p.total_k = p.cu_k.back() + kPadding;
  return p;
}

// Segment ids [batch, seqlen] (documents of 37 positions) and their per-chunk (min, max).
std::vector<int32_t> segment_ids(int64_t batch, int64_t seqlen) {
  std::vector<int32_t> ids(batch * seqlen);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < seqlen; ++i) ids[b * seqlen + i] = static_cast<int32_t>(i / 37);
  return ids;
}

// Row 0: documents of 37, 1, 300 and 5 positions, then one to the end; other rows: the ids 0, 1, 2
// recurring every 37 positions, which are not documents.
std::vector<int32_t> document_ids(int64_t batch, int64_t seqlen) {
  const int64_t ends[] = {37, 38, 338, 343};
  std::vector<int32_t> ids(batch * seqlen);
  for (int64_t i = 0; i < seqlen; ++i) {
    int32_t doc = 0;
    for (int64_t e : ends) doc += i >= e ? 1 : 0;
    ids[i] = doc;
    for (int64_t b = 1; b < batch; ++b) ids[b * seqlen + i] = static_cast<int32_t>(i / 37 % 3);
  }
  return ids;
}

std::vector<int32_t> segment_ranges(const std::vector<int32_t>& ids, int64_t batch, int64_t seqlen,
                                    bool suffix_reach) {
  std::vector<int32_t> out(batch * jax_flash::segment_chunks(seqlen) * jax_flash::kSegmentRecord);
  jax_flash::build_segment_records(ids.data(), batch, seqlen, suffix_reach, out.data());
  return out;
}

// n zeroed elements, for a kernel to write.
template <typename T>
T* device_zeros(size_t n, std::vector<void*>& owned) {
  void* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, n * sizeof(T)));
  CHECK_CUDA(cudaMemset(ptr, 0, n * sizeof(T)));
  owned.push_back(ptr);
  return static_cast<T*>(ptr);
}

template <typename T>
const T* device_array(const std::vector<T>& host, std::vector<void*>& owned) {
  void* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  owned.push_back(ptr);
  return static_cast<const T*>(ptr);
}

// Sizes, layout and mask of both directions' params for one case.
template <class P>
void describe(P& p, const Case& c, const Packing& pk, const jax_flash::MaskParams& mask) {
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  p.mask = mask;
  jax_flash::SeqLayout& l = p.layout;
  l.heads_q = c.heads_q;
  l.batch = c.varlen ? 1 : c.batch;
  l.seqlen_q = c.varlen ? pk.total_q : c.seqlen_q;
  l.seqlen_k = c.varlen ? pk.total_k : c.seqlen_k;
  l.max_seqlen_q = l.seqlen_q;
  l.max_seqlen_k = l.seqlen_k;
}

bool run_case(const Case& c, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  const DType stats = c.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  const Packing pk = packing(c);
  const int64_t rows_q = c.varlen ? pk.total_q : c.batch * c.seqlen_q;
  const int64_t rows_k = c.varlen ? pk.total_k : c.batch * c.seqlen_k;
  const int64_t q_elems = rows_q * c.heads_q * c.head_dim;
  const int64_t kv_elems = rows_k * c.heads_kv * c.head_dim;
  const int64_t rows = rows_q * c.heads_q;
  auto random = [&](int64_t n) {
    std::vector<double> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
  };
  std::vector<void*> owned;
  jax_flash::MaskParams mask;
  mask.band.left = c.left < 0 ? kUnbounded : c.left;
  mask.band.right = c.causal ? 0 : (c.right < 0 ? kUnbounded : c.right);
  mask.softcap = c.softcap;
  if (c.sinks) {
    const int64_t sink_rows = c.varlen ? 1 : c.batch;
    const std::vector<unsigned char> sinks = encode(random(sink_rows * c.heads_q), stats);
    mask.sinks = device_array(sinks, owned);
    mask.sinks_batch_stride = c.varlen ? 0 : c.heads_q;
  }
  if (c.segments && c.runs_per_row > 0) {
    const auto ids = document_ids(c.batch, c.seqlen_q);
    const size_t records =
        c.batch * jax_flash::segment_chunks(c.seqlen_q) * jax_flash::kSegmentRecord;
    jax_flash::cuda::SegmentSummaryParams sp{};
    sp.q_ids = sp.kv_ids = device_array(ids, owned);
    sp.q_ranges = device_zeros<int32_t>(records, owned);
    sp.kv_ranges = device_zeros<int32_t>(records, owned);
    sp.runs = device_zeros<int32_t>(c.batch * c.runs_per_row, owned);
    sp.batch = c.batch;
    sp.seqlen_q = sp.seqlen_k = c.seqlen_q;
    sp.runs_per_row = c.runs_per_row;
    CHECK_CUDA(jax_flash::cuda::segment_summaries(sp, nullptr));
    mask.segments.q_ids = mask.segments.kv_ids = sp.q_ids;
    mask.segments.q_ranges = sp.q_ranges;
    mask.segments.kv_ranges = sp.kv_ranges;
    mask.segments.runs = sp.runs;
    mask.segments.runs_per_row = c.runs_per_row;
  } else if (c.segments) {
    const auto q_ids = segment_ids(c.batch, c.seqlen_q);
    const auto kv_ids = segment_ids(c.batch, c.seqlen_k);
    mask.segments.q_ids = device_array(q_ids, owned);
    mask.segments.kv_ids = device_array(kv_ids, owned);
    mask.segments.q_ranges = device_array(segment_ranges(q_ids, c.batch, c.seqlen_q, true), owned);
    mask.segments.kv_ranges =
        device_array(segment_ranges(kv_ids, c.batch, c.seqlen_k, false), owned);
  }

  std::vector<double> dout_host = random(q_elems);
  void* q = device_copy(encode(random(q_elems), c.dtype));
  void* k = device_copy(encode(random(kv_elems), c.dtype));
  void* v = device_copy(encode(random(kv_elems), c.dtype));
  void* dout = device_copy(encode(dout_host, c.dtype));
  void *o, *lse, *delta, *dq, *dk, *dv;
  float* dq_accum;
  int32_t* dq_semaphores = nullptr;
  CHECK_CUDA(cudaMalloc(&o, q_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&lse, rows * elem_bytes(stats)));
  CHECK_CUDA(cudaMalloc(&delta, rows * elem_bytes(stats)));
  CHECK_CUDA(cudaMalloc(&dq, q_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&dk, kv_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&dv, kv_elems * elem_bytes(c.dtype)));
  CHECK_CUDA(cudaMalloc(&dq_accum, q_elems * sizeof(float)));
  // The deterministic order's counters, kDqCounters per dQ row and head; the launcher zeroes them.
  if (c.deterministic) {
    CHECK_CUDA(cudaMalloc(&dq_semaphores, rows * jax_flash::cuda::kDqCounters * sizeof(int32_t)));
  }

  FwdParams fp{};
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.o = o;
  fp.lse = lse;
  describe(fp, c, pk, mask);
  // The persistent forward's tile counter, as the FFI handler gives it
  // (JAX_FLASH_FWD_PERSISTENT_CTAS makes the small cases here run persistent, several tiles a CTA).
  int32_t* work_counter = nullptr;
  CHECK_CUDA(cudaMalloc(&work_counter, sizeof(int32_t)));
  owned.push_back(work_counter);
  fp.work_counter = work_counter;
  if (c.varlen) {
    fp.layout.cu_seqlens_q = device_array(pk.cu_q, owned);
    fp.layout.cu_seqlens_k = device_array(pk.cu_k, owned);
    fp.layout.num_seqs = c.batch;
    fp.layout.total_q = pk.total_q;
    fp.layout.total_k = pk.total_k;
  }
  CHECK_CUDA(jax_flash::cuda::attention_fwd(fp, c.dtype, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  // delta = rowsum(dO * O), laid out like lse: [batch, heads_q, seqlen_q] or [heads_q, total_q].
  auto o_host = host_copy(o, q_elems * elem_bytes(c.dtype));
  std::vector<double> delta_host(rows, 0.0);
  const int64_t per_batch = c.varlen ? rows_q : c.seqlen_q;
  for (int64_t r = 0; r < rows_q; ++r) {
    const int64_t b = r / per_batch, s = r % per_batch;
    for (int64_t h = 0; h < c.heads_q; ++h) {
      double acc = 0;
      for (int64_t d = 0; d < c.head_dim; ++d) {
        const int64_t i = (r * c.heads_q + h) * c.head_dim + d;
        acc += decode_one(o_host.data(), i, c.dtype) * dout_host[i];
      }
      delta_host[(b * c.heads_q + h) * per_batch + s] = acc;
    }
  }
  auto delta_bytes = encode(delta_host, stats);
  CHECK_CUDA(cudaMemcpy(delta, delta_bytes.data(), delta_bytes.size(), cudaMemcpyHostToDevice));

  BwdParams bp{};
  bp.q = q;
  bp.k = k;
  bp.v = v;
  bp.dout = dout;
  bp.lse = lse;
  bp.delta = delta;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  bp.dq_accum = dq_accum;
  bp.dq_semaphores = dq_semaphores;
  describe(bp, c, pk, mask);
  bp.layout = fp.layout;
  CHECK_CUDA(jax_flash::cuda::attention_bwd(bp, c.dtype, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  const int64_t nan_count = count_nan(o_host, c.dtype) +
                            count_nan(host_copy(dq, q_elems * elem_bytes(c.dtype)), c.dtype) +
                            count_nan(host_copy(dk, kv_elems * elem_bytes(c.dtype)), c.dtype) +
                            count_nan(host_copy(dv, kv_elems * elem_bytes(c.dtype)), c.dtype);
  for (void* p : {q, k, v, dout, o, lse, delta, dq, dk, dv}) CHECK_CUDA(cudaFree(p));
  for (void* p : owned) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(dq_accum));
  CHECK_CUDA(cudaFree(dq_semaphores));
  std::printf(
      "dtype=%d B=%lld Sq=%lld Sk=%lld Hq=%lld Hkv=%lld D=%lld causal=%d window=(%lld,%lld) "
      "softcap=%g sinks=%d segments=%d runs=%lld varlen=%d deterministic=%d: %s\n",
      static_cast<int>(c.dtype), static_cast<long long>(c.batch),
      static_cast<long long>(c.seqlen_q), static_cast<long long>(c.seqlen_k),
      static_cast<long long>(c.heads_q), static_cast<long long>(c.heads_kv),
      static_cast<long long>(c.head_dim), c.causal, static_cast<long long>(c.left),
      static_cast<long long>(c.right), c.softcap, c.sinks, c.segments,
      static_cast<long long>(c.runs_per_row), c.varlen, c.deterministic,
      nan_count ? "NaN in output" : "ok");
  return nan_count == 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool deterministic_only = false, no_deterministic = false, count_only = false;
  long only_case = -1;
  long shard = 0, shards = 1;
  bool usage_error = false;
  for (int a = 1; a < argc; ++a) {
    if (std::strcmp(argv[a], "--deterministic-only") == 0) {
      deterministic_only = true;
    } else if (std::strcmp(argv[a], "--no-deterministic") == 0) {
      no_deterministic = true;
    } else if (std::strcmp(argv[a], "--count") == 0) {
      count_only = true;
    } else if (std::strcmp(argv[a], "--case") == 0 && a + 1 < argc) {
      char* end = nullptr;
      only_case = std::strtol(argv[++a], &end, 10);
      usage_error = usage_error || *end != '\0' || only_case < 0;
    } else if (std::strcmp(argv[a], "--shard") == 0 && a + 2 < argc) {
      char* end_k = nullptr;
      char* end_n = nullptr;
      shard = std::strtol(argv[++a], &end_k, 10);
      shards = std::strtol(argv[++a], &end_n, 10);
      usage_error = usage_error || *end_k != '\0' || *end_n != '\0' || shards < 1 || shard < 0 ||
                    shard >= shards;
    } else {
      usage_error = true;
    }
  }
  if (usage_error || (deterministic_only && no_deterministic)) {
    std::fprintf(stderr,
                 "usage: %s [--deterministic-only | --no-deterministic] [--shard K N] "
                 "[--count | --case I]\n",
                 argv[0]);
    return 2;
  }
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
  // Pushes c and, in the tensor-core families, the same call with the deterministic backward.
  const auto and_deterministic = [&cases](Case c) {
    cases.push_back(c);
    if (c.dtype == DType::kBF16 || c.dtype == DType::kF16) {
      c.deterministic = true;
      cases.push_back(c);
    }
  };
  // The mask features, each with tails that straddle tiles, in every family; a band, documents
  // and packed tails (added from registers) also in the deterministic order.
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kF64}) {
    const bool half = t == DType::kBF16 || t == DType::kF16;
    for (int64_t d : half ? std::vector<int64_t>{64, 128, 256} : std::vector<int64_t>{40}) {
      Case window{t, 1, 301, 333, 4, 2, d, true};
      window.left = 70;
      and_deterministic(window);
      Case band{t, 2, 290, 190, 2, 1, d, false};
      band.left = 5;
      band.right = 40;
      band.softcap = 20.0;
      band.sinks = true;
      cases.push_back(band);
      Case segments{t, 2, 260, 260, 4, 2, d, true};
      segments.segments = true;
      segments.sinks = true;
      cases.push_back(segments);
      Case documents{t, 2, 700, 700, 4, 2, d, true};
      documents.segments = true;
      documents.runs_per_row = 8;
      and_deterministic(documents);
      Case packed{t, 4, 150, 170, 4, 2, d, true};
      packed.varlen = true;
      packed.left = 60;
      packed.softcap = 10.0;
      and_deterministic(packed);
      Case packed_full{t, 3, 97, 6, 2, 2, d, false};  // the last sequence has no keys
      packed_full.varlen = true;
      packed_full.sinks = true;
      cases.push_back(packed_full);
    }
  }
  // The deterministic order's writer warps on a query tile of one row (Sq = 65), GQA.
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (int64_t d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        Case one_row{t, 2, 65, 300, 4, 2, d, causal};
        one_row.deterministic = true;
        cases.push_back(one_row);
      }
    }
  }
  if (deterministic_only || no_deterministic) {
    cases.erase(std::remove_if(cases.begin(), cases.end(),
                               [deterministic_only](const Case& c) {
                                 return c.deterministic != deterministic_only;
                               }),
                cases.end());
  }
  // --shard K N keeps the selection's cases i with i % N == K. --count prints the selection's
  // size; --case I runs its case I alone. racecheck displays at most 100 hazards a process, which
  // the deterministic cases' hand-off record fills together, so tools/gpu_run.sh checks those one
  // process a case, and the others in shards.
  if (shards > 1) {
    std::vector<Case> kept;
    for (size_t i = 0; i < cases.size(); ++i) {
      if (static_cast<long>(i % static_cast<size_t>(shards)) == shard) kept.push_back(cases[i]);
    }
    cases = kept;
  }
  if (count_only) {
    std::printf("%zu\n", cases.size());
    return 0;
  }
  if (only_case >= 0) {
    if (only_case >= static_cast<long>(cases.size())) {
      std::fprintf(stderr, "--case %ld: the selection has %zu cases\n", only_case, cases.size());
      return 2;
    }
    cases = {cases[static_cast<size_t>(only_case)]};
  }
  int failures = 0;
  for (const Case& c : cases) failures += !run_case(c, rng);
  std::printf("%zu cases, %d with NaN outputs\n", cases.size(), failures);
  return failures == 0 ? 0 : 1;
}
