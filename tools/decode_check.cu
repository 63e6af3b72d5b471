// Standalone correctness and bandwidth driver for the CUDA decode call (cpp/cuda/decode.h),
// independent of JAX. Needs an sm_80+ GPU (the build below targets sm_90a).
//
// Build (from the repository root):
//   nvcc -std=c++17 -O3 -lineinfo -I cpp -gencode=arch=compute_90a,code=sm_90a \
//       -DJAX_FLASH_BUILT_SM90A=1 tools/decode_check.cu cpp/cuda/decode.cu cpp/cuda/sm90_host.cu \
//       -o build/decode_check
// Run: build/decode_check            every correctness case, then exit 1 if any failed
//      build/decode_check --bench    the bandwidth table (bf16, GQA 32/8, head_dim 128)
//      build/decode_check --bench 32 65536   one cell of it (contiguous cache, one query)
//      JAX_FLASH_DECODE_TILES=compact build/decode_check   the same cases on the compact tiles
//                                    (the configuration GPUs with < 227 KB smem per block get)
//      JAX_FLASH_DECODE_COPY=cp.async build/decode_check   the same cases (or --bench) on the
//                                    cp.async pass where sm_90 would take the TMA pass
//      compute-sanitizer --tool memcheck build/decode_check   (racecheck / synccheck likewise)
//
// Correctness: random problems built on the host, run through decode_fwd, compared with a float64
// host reference written here from the semantics (not through common/mask.h): query i of sequence
// b sees key j iff 0 <= j < seqlen_k(b) and i + off - left <= j <= i + off + right, off =
// (bottom_right ? seqlen_k - seqlen_q : 0) + shift. Paged caches are gathered through the block
// table. Every K/V row the call must not read (rows at or past a sequence's length, pages no
// sequence uses) holds NaN, so a stray read shows up as NaN in the output; the outputs are
// poisoned with NaN before each run (a row left unwritten fails) and each output buffer has a
// guard region behind it that must come back untouched. Each case runs with num_splits 1, 3, 8
// and 64 (more splits than key tiles: empty splits) and compares each against the reference and
// against the num_splits = 1 result. Tolerances: O max abs error relative to max |O_ref|
// (value scale) and lse max abs error (relative to max(1, |lse|) for f32 / f64):
// f16/bf16 2e-2 / 1e-2, f32 1e-5 / 1e-5, f64 1e-12 / 1e-12; a -inf lse must be -inf exactly.
//
// Bench: GB/s = (bytes of K and V actually read (visible keys of each sequence) + q + o) / time;
// time is the mean of 50 back-to-back decode_fwd calls (split and merge passes) after 5 warm-ups,
// rotating over enough copies of the cache that it never sits in L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/decode_params.h"
#include "cuda/decode.h"
#include "cuda_check.h"

namespace {

using jax_flash::DecodeParams;
using jax_flash::DType;
using jax_flash::kUnbounded;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
  }
  return "?";
}
size_t elem_size(DType t) { return t == DType::kF64 ? 8 : (t == DType::kF32 ? 4 : 2); }
size_t stat_size(DType t) { return t == DType::kF64 ? 8 : 4; }

// Host values in the element type: `round` gives the value the device will see, `store` writes it.
double round_to(DType t, double x) {
  switch (t) {
    case DType::kF16:
      return __half2float(__float2half_rn(static_cast<float>(x)));
    case DType::kBF16:
      return __bfloat162float(__float2bfloat16_rn(static_cast<float>(x)));
    case DType::kF32:
      return static_cast<float>(x);
    case DType::kF64:
      return x;
  }
  return x;
}
void store(DType t, void* base, size_t idx, double x) {
  switch (t) {
    case DType::kF16:
      static_cast<__half*>(base)[idx] = __float2half_rn(static_cast<float>(x));
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(static_cast<float>(x));
      break;
    case DType::kF32:
      static_cast<float*>(base)[idx] = static_cast<float>(x);
      break;
    case DType::kF64:
      static_cast<double*>(base)[idx] = x;
      break;
  }
}
double load(DType t, const void* base, size_t idx) {
  switch (t) {
    case DType::kF16:
      return __half2float(static_cast<const __half*>(base)[idx]);
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[idx]);
    case DType::kF32:
      return static_cast<const float*>(base)[idx];
    case DType::kF64:
      return static_cast<const double*>(base)[idx];
  }
  return 0;
}

struct Case {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t batch = 1, seqlen_q = 1, heads_q = 32, heads_kv = 8, head_dim = 128;
  int64_t capacity = 512;        // keys per sequence the cache can hold
  int64_t page_size = 0;         // 0: contiguous
  std::vector<int32_t> seqlens;  // explicit per-sequence lengths (may exceed capacity or be < 0)
  int64_t left = kUnbounded, right = kUnbounded, shift = 0;
  bool bottom_right = true;
  double softcap = 0.0;
  bool sinks = false;  // random sinks per (batch, head), some -inf, one very large
  double scale = 0.0;  // 0: 1 / sqrt(head_dim)
};

// Device buffer with a guard region of kGuard bytes behind the payload, filled with kGuardByte.
constexpr size_t kGuard = 4096;
constexpr unsigned char kGuardByte = 0xA5;
struct DevBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  void alloc(size_t n) {
    bytes = n;
    CHECK_CUDA(cudaMalloc(&ptr, n + kGuard));
    CHECK_CUDA(cudaMemset(static_cast<char*>(ptr) + n, kGuardByte, kGuard));
  }
  bool guard_intact() const {
    std::vector<unsigned char> g(kGuard);
    CHECK_CUDA(
        cudaMemcpy(g.data(), static_cast<char*>(ptr) + bytes, kGuard, cudaMemcpyDeviceToHost));
    return std::all_of(g.begin(), g.end(), [](unsigned char x) { return x == kGuardByte; });
  }
  void free() {
    if (ptr) CHECK_CUDA(cudaFree(ptr));
    ptr = nullptr;
  }
};

struct Problem {
  Case c;
  std::vector<double> q, k, v;  // rounded values, device layouts
  std::vector<int32_t> seqlens;
  std::vector<int32_t> table;
  std::vector<double> sinks;  // [batch, heads_q]
  int64_t num_pages = 0, max_pages = 0, rows_kv = 0;
  double scale = 0;

  int64_t seqlen_k(int64_t b) const { return std::clamp<int64_t>(seqlens[b], 0, c.capacity); }
  int64_t kv_row(int64_t b, int64_t j) const {
    if (c.page_size == 0) return b * c.capacity + j;
    const int64_t page =
        std::clamp<int64_t>(table[b * max_pages + j / c.page_size], 0, num_pages - 1);
    return page * c.page_size + j % c.page_size;
  }
};

Problem build(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Problem p;
  p.c = c;
  p.scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const int64_t hd = c.head_dim;
  p.q.resize(c.batch * c.seqlen_q * c.heads_q * hd);
  for (double& x : p.q) x = round_to(c.dtype, normal(rng));
  p.seqlens = c.seqlens;
  std::uniform_int_distribution<int64_t> len_dist(0, c.capacity);
  while (static_cast<int64_t>(p.seqlens.size()) < c.batch) {
    p.seqlens.push_back(static_cast<int32_t>(len_dist(rng)));
  }
  p.seqlens.resize(c.batch);
  if (c.page_size == 0) {
    p.rows_kv = c.batch * c.capacity;
  } else {
    // Pages of every sequence drawn from one shuffled pool with spare (never used) pages; table
    // entries past a sequence's last page hold garbage (out of range, negative) that the call
    // must not follow, and are clamped if it reads them.
    p.max_pages = (c.capacity + c.page_size - 1) / c.page_size;
    int64_t used = 0;
    for (int64_t b = 0; b < c.batch; ++b) used += (p.seqlen_k(b) + c.page_size - 1) / c.page_size;
    p.num_pages = used + 3;
    std::vector<int32_t> perm(p.num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    p.table.assign(c.batch * p.max_pages, 0);
    int64_t next = 0;
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t pages = (p.seqlen_k(b) + c.page_size - 1) / c.page_size;
      for (int64_t x = 0; x < p.max_pages; ++x) {
        p.table[b * p.max_pages + x] =
            x < pages ? perm[next++] : (x % 2 ? -7 : static_cast<int32_t>(p.num_pages + 1000));
      }
    }
    p.rows_kv = p.num_pages * c.page_size;
  }
  const int64_t kv_elems = p.rows_kv * c.heads_kv * hd;
  p.k.assign(kv_elems, kNaN);
  p.v.assign(kv_elems, kNaN);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < p.seqlen_k(b); ++j) {
      const int64_t row = p.kv_row(b, j);
      for (int64_t x = 0; x < c.heads_kv * hd; ++x) {
        p.k[row * c.heads_kv * hd + x] = round_to(c.dtype, normal(rng));
        p.v[row * c.heads_kv * hd + x] = round_to(c.dtype, normal(rng));
      }
    }
  }
  if (c.sinks) {
    std::uniform_real_distribution<double> u(-2.0, 3.0);
    p.sinks.resize(c.batch * c.heads_q);
    for (size_t x = 0; x < p.sinks.size(); ++x) {
      p.sinks[x] = x % 7 == 3 ? -kInf : (x % 11 == 5 ? 12.0 : u(rng));
      if (c.dtype != DType::kF64) p.sinks[x] = static_cast<float>(p.sinks[x]);
    }
  }
  return p;
}

// float64 reference: O [batch, seqlen_q, heads_q, head_dim], lse [batch, heads_q, seqlen_q].
void reference(const Problem& p, std::vector<double>& o, std::vector<double>& lse) {
  const Case& c = p.c;
  const int64_t hd = c.head_dim;
  const int64_t group = c.heads_q / c.heads_kv;
  o.assign(c.batch * c.seqlen_q * c.heads_q * hd, 0.0);
  lse.assign(c.batch * c.heads_q * c.seqlen_q, -kInf);
  std::vector<double> s;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t sk = p.seqlen_k(b);
    const int64_t off = (c.bottom_right ? sk - c.seqlen_q : 0) + c.shift;
    for (int64_t h = 0; h < c.heads_q; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        const double* qr = &p.q[((b * c.seqlen_q + i) * c.heads_q + h) * hd];
        double m = c.sinks ? p.sinks[b * c.heads_q + h] : -kInf;
        s.assign(sk, -kInf);
        for (int64_t j = 0; j < sk; ++j) {
          const bool vis = (c.left >= kUnbounded || j >= i + off - c.left) &&
                           (c.right >= kUnbounded || j <= i + off + c.right);
          if (!vis) continue;
          const double* kr = &p.k[(p.kv_row(b, j) * c.heads_kv + kvh) * hd];
          double dot = 0;
          for (int64_t x = 0; x < hd; ++x) dot += qr[x] * kr[x];
          double sc = p.scale * dot;
          if (c.softcap > 0) sc = c.softcap * std::tanh(sc / c.softcap);
          s[j] = sc;
          m = std::max(m, sc);
        }
        if (m == -kInf) continue;  // no key, no sink: O = 0, lse = -inf
        double sum = c.sinks ? std::exp(p.sinks[b * c.heads_q + h] - m) : 0.0;
        for (int64_t j = 0; j < sk; ++j) sum += std::exp(s[j] - m);
        const double l = m + std::log(sum);
        lse[(b * c.heads_q + h) * c.seqlen_q + i] = l;
        double* orow = &o[((b * c.seqlen_q + i) * c.heads_q + h) * hd];
        for (int64_t j = 0; j < sk; ++j) {
          if (s[j] == -kInf) continue;
          const double w = std::exp(s[j] - l);
          const double* vr = &p.v[(p.kv_row(b, j) * c.heads_kv + kvh) * hd];
          for (int64_t x = 0; x < hd; ++x) orow[x] += w * vr[x];
        }
      }
    }
  }
}

struct Device {
  DevBuf q, k, v, seqlens, table, sinks, o, lse, part_o, part_lse;
  void free_all() {
    for (DevBuf* b : {&q, &k, &v, &seqlens, &table, &sinks, &o, &lse, &part_o, &part_lse})
      b->free();
  }
};

void upload(DType t, const std::vector<double>& x, DevBuf& buf) {
  std::vector<char> host(x.size() * elem_size(t));
  for (size_t i = 0; i < x.size(); ++i) store(t, host.data(), i, x[i]);
  buf.alloc(std::max<size_t>(host.size(), 16));
  CHECK_CUDA(cudaMemcpy(buf.ptr, host.data(), host.size(), cudaMemcpyHostToDevice));
}

DecodeParams make_params(const Problem& p, const Device& d, int64_t splits) {
  const Case& c = p.c;
  DecodeParams dp{};
  dp.q = d.q.ptr;
  dp.k = d.k.ptr;
  dp.v = d.v.ptr;
  dp.cache_seqlens = static_cast<const int32_t*>(d.seqlens.ptr);
  dp.block_table = c.page_size ? static_cast<const int32_t*>(d.table.ptr) : nullptr;
  dp.o = d.o.ptr;
  dp.lse = d.lse.ptr;
  dp.partial_o = d.part_o.ptr;
  dp.partial_lse = d.part_lse.ptr;
  dp.batch = c.batch;
  dp.seqlen_q = c.seqlen_q;
  dp.heads_q = c.heads_q;
  dp.heads_kv = c.heads_kv;
  dp.head_dim = c.head_dim;
  dp.cache_len = c.page_size ? 0 : c.capacity;
  dp.num_pages = p.num_pages;
  dp.page_size = c.page_size;
  dp.max_pages = p.max_pages;
  dp.num_splits = splits;
  dp.softmax_scale = p.scale;
  dp.mask.band.left = c.left;
  dp.mask.band.right = c.right;
  dp.mask.band.shift = c.shift;
  dp.mask.band.bottom_right = c.bottom_right;
  dp.mask.softcap = c.softcap;
  dp.mask.sinks = c.sinks ? d.sinks.ptr : nullptr;
  dp.mask.sinks_batch_stride = c.heads_q;
  return dp;
}

struct Errors {
  double o = 0, lse = 0;
  bool bad = false;  // NaN, -inf mismatch, unwritten output, guard overwritten
  std::string why;
};

Errors compare(DType t, const std::vector<double>& o, const std::vector<double>& lse,
               const std::vector<double>& o_ref, const std::vector<double>& lse_ref) {
  Errors e;
  double scale = 0;
  for (double x : o_ref) scale = std::max(scale, std::fabs(x));
  scale = std::max(scale, 1e-30);
  for (size_t i = 0; i < o.size(); ++i) {
    if (!std::isfinite(o[i])) {
      e.bad = true;
      e.why = "non-finite O at " + std::to_string(i);
      return e;
    }
    e.o = std::max(e.o, std::fabs(o[i] - o_ref[i]) / scale);
  }
  const bool rel = t == DType::kF32 || t == DType::kF64;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isnan(lse[i]) || (lse[i] == -kInf) != (lse_ref[i] == -kInf)) {
      e.bad = true;
      e.why = "lse " + std::to_string(lse[i]) + " vs " + std::to_string(lse_ref[i]) + " at " +
              std::to_string(i);
      return e;
    }
    if (lse_ref[i] == -kInf) continue;
    const double d = std::fabs(lse[i] - lse_ref[i]);
    e.lse = std::max(e.lse, rel ? d / std::max(1.0, std::fabs(lse_ref[i])) : d);
  }
  return e;
}

int g_pass = 0, g_fail = 0;

void run_case(const Case& c, uint64_t seed) {
  const Problem p = build(c, seed);
  std::vector<double> o_ref, lse_ref;
  reference(p, o_ref, lse_ref);
  const DType t = c.dtype;
  Device d;
  upload(t, p.q, d.q);
  upload(t, p.k, d.k);
  upload(t, p.v, d.v);
  d.seqlens.alloc(p.seqlens.size() * 4);
  CHECK_CUDA(
      cudaMemcpy(d.seqlens.ptr, p.seqlens.data(), p.seqlens.size() * 4, cudaMemcpyHostToDevice));
  if (c.page_size) {
    d.table.alloc(std::max<size_t>(p.table.size() * 4, 16));
    CHECK_CUDA(cudaMemcpy(d.table.ptr, p.table.data(), p.table.size() * 4, cudaMemcpyHostToDevice));
  }
  if (c.sinks) {
    std::vector<double> sk(p.sinks);
    const DType st = t == DType::kF64 ? DType::kF64 : DType::kF32;
    upload(st, sk, d.sinks);
  }
  const size_t o_elems = o_ref.size();
  const size_t lse_elems = lse_ref.size();
  const size_t ss = stat_size(t);
  d.o.alloc(o_elems * elem_size(t));
  d.lse.alloc(lse_elems * ss);
  constexpr int64_t kMaxSplits = 64;
  d.part_o.alloc(o_elems * kMaxSplits * ss);
  d.part_lse.alloc(lse_elems * kMaxSplits * ss);
  const bool half = t == DType::kF16 || t == DType::kBF16;
  const double tol_o = half ? 2e-2 : (t == DType::kF32 ? 1e-5 : 1e-12);
  const double tol_lse = half ? 1e-2 : (t == DType::kF32 ? 1e-5 : 1e-12);
  const DType st = t == DType::kF64 ? DType::kF64 : DType::kF32;

  std::vector<double> o1, lse1;  // the num_splits = 1 result
  for (int64_t splits : {1, 3, 8, 64}) {
    // Poison: all-ones bytes are NaN in every float type.
    CHECK_CUDA(cudaMemset(d.o.ptr, 0xFF, d.o.bytes));
    CHECK_CUDA(cudaMemset(d.lse.ptr, 0xFF, d.lse.bytes));
    CHECK_CUDA(cudaMemset(d.part_o.ptr, 0xFF, d.part_o.bytes));
    CHECK_CUDA(cudaMemset(d.part_lse.ptr, 0xFF, d.part_lse.bytes));
    const DecodeParams dp = make_params(p, d, splits);
    const cudaError_t status = jax_flash::cuda::decode_fwd(dp, t, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    Errors e;
    std::vector<double> o(o_elems), lse(lse_elems);
    if (status != cudaSuccess) {
      e.bad = true;
      e.why = std::string("decode_fwd: ") + cudaGetErrorString(status);
    } else {
      std::vector<char> ho(d.o.bytes), hl(d.lse.bytes);
      CHECK_CUDA(cudaMemcpy(ho.data(), d.o.ptr, ho.size(), cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(hl.data(), d.lse.ptr, hl.size(), cudaMemcpyDeviceToHost));
      for (size_t x = 0; x < o_elems; ++x) o[x] = load(t, ho.data(), x);
      for (size_t x = 0; x < lse_elems; ++x) lse[x] = load(st, hl.data(), x);
      e = compare(t, o, lse, o_ref, lse_ref);
      for (const DevBuf* b : {&d.o, &d.lse, &d.part_o, &d.part_lse}) {
        if (!b->guard_intact()) {
          e.bad = true;
          e.why = "write past an output buffer";
        }
      }
    }
    // The split result against the one-split result, with the same tolerances.
    double vs1_o = 0, vs1_lse = 0;
    if (!e.bad && splits == 1) {
      o1 = o;
      lse1 = lse;
    } else if (!e.bad && !o1.empty()) {
      const Errors e1 = compare(t, o, lse, o1, lse1);
      vs1_o = e1.o;
      vs1_lse = e1.lse;
      if (e1.bad) {
        e.bad = true;
        e.why = "vs num_splits=1: " + e1.why;
      }
    }
    const bool ok =
        !e.bad && e.o <= tol_o && e.lse <= tol_lse && vs1_o <= tol_o && vs1_lse <= tol_lse;
    std::printf("%s %-44s splits=%-3lld o_err=%.2e lse_err=%.2e vs_split1=%.2e/%.2e %s\n",
                ok ? "PASS" : "FAIL", c.name.c_str(), static_cast<long long>(splits), e.o, e.lse,
                vs1_o, vs1_lse, e.bad ? e.why.c_str() : "");
    (ok ? g_pass : g_fail)++;
  }
  d.free_all();
}

// A params call that must be refused with `want`.
void expect_status(const char* name, DecodeParams dp, DType t, cudaError_t want) {
  const cudaError_t got = jax_flash::cuda::decode_fwd(dp, t, nullptr);
  cudaGetLastError();
  const bool ok = got == want;
  std::printf("%s refuse %-37s got %s\n", ok ? "PASS" : "FAIL", name, cudaGetErrorName(got));
  (ok ? g_pass : g_fail)++;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(c); };
  const int64_t kInfB = kUnbounded;
  for (DType t : {DType::kBF16, DType::kF16}) {
    const std::string n = dtype_name(t);
    // GQA 32/8 d128 Sq 1: the common decode; lengths 0, 1 and random.
    add({n + " gqa32/8 d128 sq1 full", t, 4, 1, 32, 8, 128, 700, 0, {700, 0, 1}});
    add({n + " gqa32/8 d128 sq1 causal paged16",
         t,
         4,
         1,
         32,
         8,
         128,
         900,
         16,
         {900, 1, 0, 333},
         kInfB,
         0});
    // Sq 4 against lengths below Sq (rows with no key), paged page size 1.
    add({n + " gqa32/8 d128 sq4 causal paged1",
         t,
         3,
         4,
         32,
         8,
         128,
         300,
         1,
         {2, 0, 300},
         kInfB,
         0});
    // MQA 8/1 Sq 4: 32 packed rows (two m16 tiles), sinks incl. -inf, softcap.
    add({n + " mqa8/1 d64 sq4 causal sink cap",
         t,
         3,
         4,
         8,
         1,
         64,
         1200,
         0,
         {1200, 3, 517},
         kInfB,
         0,
         0,
         true,
         2.0,
         true});
    // MHA d256 Sq 16, window, paged 256.
    add({n + " mha4/4 d256 sq16 window paged256",
         t,
         2,
         16,
         4,
         4,
         256,
         1100,
         256,
         {1100, 260},
         37,
         5});
    // Odd head dims (padded template): 96 and 40, 8 and 72.
    add({n + " gqa16/4 d96 sq4 cap sink paged16",
         t,
         3,
         4,
         16,
         4,
         96,
         640,
         16,
         {640, 17, 5},
         kInfB,
         kInfB,
         0,
         true,
         2.0,
         true});
    add({n + " gqa8/2 d40 sq16 topleft causal shift3",
         t,
         2,
         16,
         8,
         2,
         40,
         500,
         0,
         {500, 9},
         kInfB,
         0,
         3,
         false});
    add({n + " mha2/2 d8 sq1 full", t, 2, 1, 2, 2, 8, 400, 0, {400, 129}});
    add({n + " mha3/3 d72 sq4 window shift-2 paged16",
         t,
         2,
         4,
         3,
         3,
         72,
         350,
         16,
         {350, 64},
         20,
         3,
         -2});
    // Rows whose window misses every key (top-left, negative shift), with and without sinks.
    add({n + " gqa8/2 d64 sq16 empty rows",
         t,
         2,
         16,
         8,
         2,
         64,
         200,
         0,
         {200, 10},
         4,
         0,
         -10,
         false});
    add({n + " gqa8/2 d64 sq16 empty rows sink",
         t,
         2,
         16,
         8,
         2,
         64,
         200,
         0,
         {200, 10},
         4,
         0,
         -10,
         false,
         0.0,
         true});
    // Pages that a 64-key tile spans several of, or that do not divide it (TMA boxes of 32 and
    // of 16 keys).
    add({n + " gqa8/2 d128 sq1 paged32", t, 2, 1, 8, 2, 128, 500, 32, {500, 130}});
    add({n + " gqa8/2 d128 sq2 causal paged48",
         t,
         3,
         2,
         8,
         2,
         128,
         700,
         48,
         {700, 97, 48},
         kUnbounded,
         0});
    // Lengths out of range are clamped into [0, capacity].
    add({n + " gqa4/2 d128 clamp lengths paged16", t, 3, 2, 4, 2, 128, 160, 16, {100000, -5, 77}});
  }
  // Several row blocks per KV head (64 packed rows: two blocks of 32 at d128, four of 16 at d256).
  add({"bf16 gqa32/8 d128 sq16 causal paged16 sink",
       DType::kBF16,
       2,
       16,
       32,
       8,
       128,
       700,
       16,
       {700, 12},
       kUnbounded,
       0,
       0,
       true,
       0.0,
       true});
  add({"f16 gqa16/2 d256 sq8 window cap",
       DType::kF16,
       2,
       8,
       16,
       2,
       256,
       600,
       0,
       {600, 100},
       200,
       0,
       0,
       true,
       2.0});
  // Long sequence: many tiles per split (split boundaries inside the range).
  add({"bf16 gqa32/8 d128 sq1 long", DType::kBF16, 1, 1, 32, 8, 128, 20000, 0, {20000}});
  add({"bf16 gqa32/8 d128 sq4 long window paged256",
       DType::kBF16,
       1,
       4,
       32,
       8,
       128,
       9000,
       256,
       {8999},
       3000,
       0});
  // Exact paths.
  add({"f32 gqa32/8 d128 sq1 causal paged16 sink",
       DType::kF32,
       3,
       1,
       32,
       8,
       128,
       600,
       16,
       {600, 0, 1},
       kInfB,
       0,
       0,
       true,
       0.0,
       true});
  add({"f32 gqa4/2 d13 sq4 window cap",
       DType::kF32,
       2,
       4,
       4,
       2,
       13,
       300,
       0,
       {300, 2},
       50,
       2,
       0,
       true,
       5.0});
  add({"f32 mha2/2 d256 sq16 topleft shift",
       DType::kF32,
       2,
       16,
       2,
       2,
       256,
       200,
       256,
       {200, 7},
       kInfB,
       0,
       5,
       false});
  add({"f64 mqa8/1 d64 sq16 causal shift-2 paged16 sink",
       DType::kF64,
       2,
       16,
       8,
       1,
       64,
       400,
       16,
       {400, 5},
       kInfB,
       0,
       -2,
       true,
       0.0,
       true});
  add({"f64 mha2/2 d256 sq1 full", DType::kF64, 2, 1, 2, 2, 256, 500, 0, {500, 0}});
  add({"f64 gqa6/3 d33 sq4 window cap paged1",
       DType::kF64,
       2,
       4,
       6,
       3,
       33,
       250,
       1,
       {250, 31},
       16,
       16,
       0,
       true,
       3.0});
  return v;
}

// ---- bench ----

__global__ void fill_bf16(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    x[i] = __float2bfloat16_rn(static_cast<float>(h & 0xFFFF) / 32768.f - 1.f);
  }
}

// The split count the kernels are tuned for (cpp/cuda/decode.cu): one wave of resident blocks.
int64_t recommended_splits(int64_t batch, int64_t heads_kv, int64_t rows, int64_t keys,
                           int64_t head_dim, int sms) {
  const int64_t rows_per_block = rows <= 16 ? 16 : (head_dim > 128 ? 16 : 32);
  const int64_t m_blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t slots = static_cast<int64_t>(sms) * (head_dim > 128 ? 1 : 2);
  const int64_t want = slots / (batch * heads_kv * m_blocks);
  const int64_t cap = std::max<int64_t>(1, (keys + 511) / 512);
  return std::clamp<int64_t>(want, 1, cap);
}

// `only_batch` / `only_keys` > 0: only that shape, contiguous cache, one query token (a single
// cell for a profiler).
void bench(int64_t only_batch, int64_t only_keys) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf(
      "bench: %s, %d SMs, L2 %d MB; bf16 GQA 32/8 d128; GB/s counts K+V of visible keys "
      "+ q + o\n",
      prop.name, sms, prop.l2CacheSize >> 20);
  const int64_t hq = 32, hkv = 8, hd = 128;
  struct Shape {
    int64_t batch, keys;
  };
  const Shape shapes[] = {{1, 65536}, {8, 65536}, {32, 65536}, {1, 8192}};
  const bool one = only_batch > 0;
  for (int64_t sq : {1, 4}) {
    for (const Shape& sh : shapes) {
      if (one && (sq != 1 || sh.batch != only_batch || sh.keys != only_keys)) continue;
      for (int64_t ps : {0, 16, 256}) {
        if (one && ps != 0) continue;
        const int64_t rows_per_copy = sh.batch * sh.keys;
        const int64_t cache_bytes = rows_per_copy * hkv * hd * 2 * 2;
        // Rotate over copies so that the working set is at least 4x L2 (one copy of a 256 MB
        // cache).
        const int64_t copies = std::max<int64_t>(
            1, (4 * static_cast<int64_t>(prop.l2CacheSize) + cache_bytes - 1) / cache_bytes);
        const int64_t elems = copies * rows_per_copy * hkv * hd;
        __nv_bfloat16 *k, *v, *q, *o;
        CHECK_CUDA(cudaMalloc(&k, elems * 2));
        CHECK_CUDA(cudaMalloc(&v, elems * 2));
        const int64_t q_elems = sh.batch * sq * hq * hd;
        CHECK_CUDA(cudaMalloc(&q, q_elems * 2));
        CHECK_CUDA(cudaMalloc(&o, q_elems * 2));
        fill_bf16<<<1024, 256>>>(k, elems, 1);
        fill_bf16<<<1024, 256>>>(v, elems, 2);
        fill_bf16<<<1024, 256>>>(q, q_elems, 3);
        CHECK_CUDA(cudaGetLastError());
        std::vector<int32_t> lens(sh.batch, static_cast<int32_t>(sh.keys));
        int32_t* d_lens;
        CHECK_CUDA(cudaMalloc(&d_lens, lens.size() * 4));
        CHECK_CUDA(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
        int32_t* d_table = nullptr;
        int64_t max_pages = 0, num_pages = 0;
        if (ps) {
          max_pages = sh.keys / ps;
          num_pages = sh.batch * max_pages;  // per copy
          std::vector<int32_t> perm(num_pages);
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), std::mt19937_64(7));
          CHECK_CUDA(cudaMalloc(&d_table, perm.size() * 4));
          CHECK_CUDA(cudaMemcpy(d_table, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
        }
        const int64_t rec = recommended_splits(sh.batch, hkv, (hq / hkv) * sq, sh.keys, hd, sms);
        std::vector<int64_t> sweep = {1, std::max<int64_t>(1, rec / 2), rec, rec * 3 / 2, rec * 2};
        std::sort(sweep.begin(), sweep.end());
        sweep.erase(std::unique(sweep.begin(), sweep.end()), sweep.end());
        const int64_t max_splits = sweep.back();
        float *part_o, *part_lse, *lse;
        CHECK_CUDA(cudaMalloc(&part_o, q_elems * max_splits * 4));
        CHECK_CUDA(cudaMalloc(&part_lse, sh.batch * hq * sq * max_splits * 4));
        CHECK_CUDA(cudaMalloc(&lse, sh.batch * hq * sq * 4));
        for (int64_t splits : sweep) {
          DecodeParams dp{};
          dp.q = q;
          dp.o = o;
          dp.lse = lse;
          dp.partial_o = part_o;
          dp.partial_lse = part_lse;
          dp.cache_seqlens = d_lens;
          dp.block_table = d_table;
          dp.batch = sh.batch;
          dp.seqlen_q = sq;
          dp.heads_q = hq;
          dp.heads_kv = hkv;
          dp.head_dim = hd;
          dp.cache_len = ps ? 0 : sh.keys;
          dp.num_pages = num_pages;
          dp.page_size = ps;
          dp.max_pages = max_pages;
          dp.num_splits = splits;
          dp.softmax_scale = 1.0 / std::sqrt(static_cast<double>(hd));
          dp.mask.band.right =
              sq > 1 ? 0 : kUnbounded;  // causal for Sq 4 (all keys visible anyway)
          auto call = [&](int64_t it) {
            const int64_t copy = it % copies;
            dp.k = k + copy * rows_per_copy * hkv * hd;
            dp.v = v + copy * rows_per_copy * hkv * hd;
            CHECK_CUDA(jax_flash::cuda::decode_fwd(dp, DType::kBF16, nullptr));
          };
          for (int it = 0; it < 5; ++it) call(it);
          cudaEvent_t e0, e1;
          CHECK_CUDA(cudaEventCreate(&e0));
          CHECK_CUDA(cudaEventCreate(&e1));
          constexpr int kIters = 50;
          CHECK_CUDA(cudaEventRecord(e0));
          for (int it = 0; it < kIters; ++it) call(it);
          CHECK_CUDA(cudaEventRecord(e1));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          const double t = ms / 1e3 / kIters;
          const double bytes = static_cast<double>(cache_bytes) + 2.0 * q_elems * 2;
          std::printf(
              "  sq=%lld batch=%-2lld keys=%-6lld %-9s splits=%-3lld%s %8.1f us %7.1f GB/s "
              "%5.2f TB/s\n",
              static_cast<long long>(sq), static_cast<long long>(sh.batch),
              static_cast<long long>(sh.keys), ps ? (ps == 16 ? "paged16" : "paged256") : "contig",
              static_cast<long long>(splits), splits == rec ? "*" : " ", t * 1e6, bytes / t / 1e9,
              bytes / t / 1e12);
          CHECK_CUDA(cudaEventDestroy(e0));
          CHECK_CUDA(cudaEventDestroy(e1));
        }
        CHECK_CUDA(cudaFree(k));
        CHECK_CUDA(cudaFree(v));
        CHECK_CUDA(cudaFree(q));
        CHECK_CUDA(cudaFree(o));
        CHECK_CUDA(cudaFree(d_lens));
        if (d_table) CHECK_CUDA(cudaFree(d_table));
        CHECK_CUDA(cudaFree(part_o));
        CHECK_CUDA(cudaFree(part_lse));
        CHECK_CUDA(cudaFree(lse));
      }
    }
  }
  std::printf("(* = recommended_splits; the merge pass is included in every time)\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) {
    // --bench [BATCH KEYS]: the whole table, or one of its cells.
    bench(argc > 3 ? std::atoll(argv[2]) : 0, argc > 3 ? std::atoll(argv[3]) : 0);
    return 0;
  }
  uint64_t seed = 1234;
  for (const Case& c : cases()) run_case(c, seed++);

  // Calls that must be refused before any launch.
  DecodeParams base{};
  int32_t* lens;
  CHECK_CUDA(cudaMalloc(&lens, 16));
  base.cache_seqlens = lens;
  base.batch = 1;
  base.seqlen_q = 1;
  base.heads_q = 4;
  base.heads_kv = 2;
  base.head_dim = 64;
  base.cache_len = 16;
  base.num_splits = 1;
  base.softmax_scale = 0.125;
  DecodeParams x = base;
  x.head_dim = 60;
  expect_status("bf16 head_dim % 8 != 0", x, DType::kBF16, cudaErrorNotSupported);
  x = base;
  x.head_dim = 264;
  expect_status("f32 head_dim > 256", x, DType::kF32, cudaErrorNotSupported);
  x = base;
  x.heads_kv = 3;
  expect_status("heads_q % heads_kv != 0", x, DType::kBF16, cudaErrorInvalidValue);
  x = base;
  x.num_splits = 4;
  expect_status("splits > 1 without partials", x, DType::kF16, cudaErrorInvalidValue);
  x = base;
  x.softmax_scale = 0.0;
  expect_status("softmax_scale 0", x, DType::kF64, cudaErrorInvalidValue);
  CHECK_CUDA(cudaFree(lens));

  std::printf("decode_check: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}
