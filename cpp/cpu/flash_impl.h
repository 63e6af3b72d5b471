// The CPU FlashAttention kernels, written once and compiled once per instruction set.
//
// This header is deliberately not include-guarded: each kernels_<isa>.cc includes it inside its
// own namespace (jax_flash::cpu::<isa>) after defining there
//   VF, VD          GCC/Clang vector types of float and double, one register wide,
//   Madd(a, b, c)   a * b + c on VF and VD, fused where the instruction set allows,
//   ConvertHalves   n f16 values to float, with conversion instructions where there are some,
//   kMicroRows      rows of the register-blocked micro-kernel, sized to the register file,
// and, on x86, under a target pragma, so every function below (templates included) is generated
// for that instruction set. kernels_common.h has everything it needs from outside.
//
// The algorithm is FlashAttention-2 (Dao, 2023) laid out for a CPU:
//  * A "row" is one (query position, query head) pair of a GQA group: row r of kv head hk is
//    position r / G of query head hk * G + r % G, with G = heads_q / heads_kv. The query heads that
//    share a K/V head share every K/V tile a task loads, and one-token decoding with GQA still
//    fills the vector lanes.
//  * The forward pass and the dQ pass keep their tiles transposed, with rows along the vector
//    lanes: S^T = K Q^T, O^T += V^T P^T, dQ^T += K^T dS^T. The online-softmax state of a row
//    (running max, running sum, rescale factor) then lives in one lane, the softmax is element-wise
//    across vectors, and head_dim is only ever a loop bound, never a vector width.
//  * The dK/dV pass runs untransposed, with keys along the lanes: S = Q K^T, dP = dO V^T,
//    dV += P^T dO, dK += dS^T Q (head_dim zero-padded to whole vectors in the Q and dO rows). Its
//    K^T and V^T are packed once per task, so each row tile only needs plain row copies.
//  * Every product is one register-blocked micro-kernel (kMicroRows x 2 vectors of accumulators,
//    A broadcast from a tile in place, B streamed as vectors).
//  * Every mask is common/mask.h's: the band (a window, causal as right = 0, bottom-right aligned
//    per sequence) bounds each block's inner loop to the keys (or rows) it can see, so that a
//    window costs what its visible pairs cost; of the tiles inside those bounds, the ones whose
//    segment-id ranges are disjoint are skipped, and only the band's boundary tiles and the tiles
//    with mixed segment ids are masked element-wise, in a separate pass over the score tile, so
//    that the softmax loops never test a mask. Soft-capping is one more pass over the scores.
//  * A call is a list of sequences (common/schedule.h SeqLayout): a dense batch, or a packed
//    batch cut by cu_seqlens, which live in host memory here, so each pass counts the blocks of
//    every sequence once and hands the thread pool one task per (sequence, kv head, block).
//  * The backward pass is two passes that each own their outputs (dK/dV per key block, dQ per row
//    block), so it needs no atomics and is deterministic. Both recompute P = exp(S - lse).
//
// Memory: XLA's FFI offers no scratch allocator for CPU custom calls, so each task allocates one
// small heap buffer (a few tiles: O(tile * head_dim)) that it reuses for all its tiles. When there
// are too few blocks to occupy the thread pool (decoding, short key sequences), the inner loop is
// split and the pieces' partial results go to one per-call buffer of O(splits * tile * head_dim)
// per block, combined in a fixed order. Each pass also packs the tensors its tiles read (K and V;
// the dK/dV pass scaled Q and dO) into per-head panels in the compute type, one heap copy of each
// per call (Panel below): O(seqlen * heads * head_dim), the size of the inputs in float32.
// Nothing is O(seqlen^2).

template <class T>
struct VecOf;
template <>
struct VecOf<float> {
  using V = VF;
  using I = int32_t __attribute__((vector_size(sizeof(VF))));
};
template <>
struct VecOf<double> {
  using V = VD;
};

template <class T>
using Vec = typename VecOf<T>::V;
template <class T>
inline constexpr int64_t kLanes = static_cast<int64_t>(sizeof(Vec<T>) / sizeof(T));

template <class T>
inline Vec<T> LoadVec(const T* p) {
  Vec<T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <class T>
inline void StoreVec(T* p, const Vec<T>& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

template <class T, size_t... kI>
inline Vec<T> SplatImpl(T s, std::index_sequence<kI...>) {
  return Vec<T>{((void)kI, s)...};
}

template <class T>
inline Vec<T> Splat(T s) {
  return SplatImpl<T>(s, std::make_index_sequence<kLanes<T>>());
}

inline VF Max(const VF& a, const VF& b) { return a > b ? a : b; }
inline VD Max(const VD& a, const VD& b) { return a > b ? a : b; }

// e^x, vectorised: x = n ln2 + r with n an integer and |r| <= ln2 / 2, e^r from a degree-6
// polynomial (fitted for this kernel; relative error below 4e-9, far under float's half ulp), and
// 2^n built in the exponent bits. Results below float's normal range, and e^-inf, are 0: in the
// softmax such terms are under 2^-126 times the row maximum's term of 1, so dropping them is below
// rounding, and no subnormal is ever produced (they are slow, and flushed under FTZ anyway).
inline VF Exp(const VF& x) {
  const VF lo = Splat(-87.33654f);  // ln(2^-126)
  const VF hi = Splat(88.0f);
  // 1.5 * 2^23: adding it rounds to the nearest integer, which then sits in the low mantissa bits.
  const VF shifter = Splat(12582912.0f);
  VF xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const VF t = Madd(xc, Splat(1.44269504088896341f), shifter);
  const VF n = t - shifter;
  // ln2 split in two so that n * ln2_hi is exact for |n| <= 128.
  VF r = Madd(n, Splat(-0.693359375f), xc);
  r = Madd(n, Splat(2.12194440054690583e-4f), r);
  VF q = Splat(0.0013751408499531048f);
  q = Madd(q, r, Splat(0.008368921813208977f));
  q = Madd(q, r, Splat(0.0416695336804848f));
  q = Madd(q, r, Splat(0.16666518414500084f));
  q = Madd(q, r, Splat(0.4999998859081215f));
  const VF p = Madd(q, r * r, r + Splat(1.0f));
  using VI = VecOf<float>::I;
  VI bits;
  __builtin_memcpy(&bits, &t, sizeof(bits));
  VI shifter_bits;
  __builtin_memcpy(&shifter_bits, &shifter, sizeof(shifter_bits));
  const VI scale_bits = (bits - shifter_bits + 127) << 23;
  VF scale;
  __builtin_memcpy(&scale, &scale_bits, sizeof(scale));
  return x < lo ? Splat(0.0f) : p * scale;
}

// float64 keeps the exact library exponential.
inline VD Exp(const VD& x) {
  VD y;
  for (int64_t i = 0; i < kLanes<double>; ++i) y[i] = std::exp(x[i]);
  return y;
}

// tanh, vectorised, for soft-capping. Near 0, where 1 - 2 / (e^2x + 1) would cancel, the Taylor
// series of tanh(x) / x in x^2 (to x^12: the first omitted term is below 2^-33 of the result at
// the switch point); elsewhere that formula, which saturates to +-1 without overflow since Exp
// clamps its argument. Within a few float ulps throughout.
inline VF Tanh(const VF& x) {
  const VF zero = Splat(0.0f);
  const VF ax = x < zero ? -x : x;
  const VF x2 = ax * ax;
  VF p = Splat(21844.0f / 6081075.0f);
  p = Madd(p, x2, Splat(-1382.0f / 155925.0f));
  p = Madd(p, x2, Splat(62.0f / 2835.0f));
  p = Madd(p, x2, Splat(-17.0f / 315.0f));
  p = Madd(p, x2, Splat(2.0f / 15.0f));
  p = Madd(p, x2, Splat(-1.0f / 3.0f));
  const VF near = Madd(p * x2, ax, ax);
  const VF far = Splat(1.0f) - Splat(2.0f) / (Exp(ax + ax) + Splat(1.0f));
  const VF t = ax < Splat(0.3125f) ? near : far;
  return x < zero ? -t : t;
}

inline VD Tanh(const VD& x) {
  VD y = x;
  for (int64_t i = 0; i < kLanes<double>; ++i) y[i] = std::tanh(x[i]);
  return y;
}

// ---------------------------------------------------------------------------------------------
// Register-blocked GEMM: C[M x N] (op)= sum_k A(m, k) B[k][0:N], with A(m, k) = a[m * a_rs + k *
// a_cs] broadcast from a tile used in place (either orientation), B and C row-major and N a whole
// number of vectors.

enum class Update {
  kOverwrite,   // C = A B
  kAccumulate,  // C += A B
  kRescale,     // C = C * col_scale + A B: the online-softmax rescale of O, fused
};

// Two vectors of columns: kMicroRows x 2 accumulators, two B vectors and one broadcast fill the
// register file without spilling.
inline constexpr int kMicroVecs = 2;

template <class T>
using MicroFn = void (*)(int64_t, const T*, int64_t, int64_t, const T*, int64_t, T*, int64_t,
                         const T*);

template <class T, Update kUpdate, int kRows, int kVecs>
void MicroTile(int64_t kc, const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t ldb, T* c,
               int64_t ldc, const T* col_scale) {
  constexpr int64_t kL = kLanes<T>;
  Vec<T> acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int m = 0; m < kRows; ++m) {
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) acc[m][v] = Splat(T(0));
  }
  for (int64_t k = 0; k < kc; ++k) {
    Vec<T> bv[kVecs];
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) bv[v] = LoadVec(b + v * kL);
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) {
      const Vec<T> av = Splat(a[m * a_rs]);
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) acc[m][v] = Madd(av, bv[v], acc[m][v]);
    }
    a += a_cs;
    b += ldb;
  }
#pragma GCC unroll 8
  for (int m = 0; m < kRows; ++m) {
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) {
      T* cp = c + m * ldc + v * kL;
      if constexpr (kUpdate == Update::kOverwrite) {
        StoreVec(cp, acc[m][v]);
      } else if constexpr (kUpdate == Update::kAccumulate) {
        StoreVec(cp, LoadVec(cp) + acc[m][v]);
      } else {
        StoreVec(cp, Madd(LoadVec(cp), LoadVec(col_scale + v * kL), acc[m][v]));
      }
    }
  }
}

template <class T, Update kUpdate, int kVecs, size_t... kR>
constexpr std::array<MicroFn<T>, sizeof...(kR)> MicroRowTable(std::index_sequence<kR...>) {
  return {&MicroTile<T, kUpdate, static_cast<int>(kR) + 1, kVecs>...};
}

template <class T, Update kUpdate>
void Gemm(int64_t m_total, int64_t n_total, int64_t kc, const T* a, int64_t a_rs, int64_t a_cs,
          const T* b, int64_t ldb, T* c, int64_t ldc, const T* col_scale = nullptr) {
  constexpr int64_t kL = kLanes<T>;
  static_assert(kMicroVecs == 2, "the table below lists one row per vector count");
  // [vectors - 1][rows - 1]: edge tiles still run fully unrolled kernels.
  static constexpr std::array<MicroFn<T>, kMicroRows> kTable[kMicroVecs] = {
      MicroRowTable<T, kUpdate, 1>(std::make_index_sequence<kMicroRows>()),
      MicroRowTable<T, kUpdate, 2>(std::make_index_sequence<kMicroRows>()),
  };
  // Columns outer: one column block's B panel stays in L1 while the A strips stream past.
  for (int64_t n0 = 0; n0 < n_total; n0 += kMicroVecs * kL) {
    const int64_t vecs = std::min<int64_t>(kMicroVecs, (n_total - n0) / kL);
    const T* scale = kUpdate == Update::kRescale ? col_scale + n0 : nullptr;
    for (int64_t m0 = 0; m0 < m_total; m0 += kMicroRows) {
      const int64_t rows = std::min<int64_t>(kMicroRows, m_total - m0);
      kTable[vecs - 1][rows - 1](kc, a + m0 * a_rs, a_rs, a_cs, b + n0, ldb, c + m0 * ldc + n0, ldc,
                                 scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Shapes, tiles, schedules and workspaces.

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Tile sizes. 64 x 64 keeps a task's tiles (16 KiB each in float32 at head_dim 64) in L2 and the
// micro-kernel's B panels in L1; larger tiles measured no faster and leave fewer tasks.
inline constexpr int64_t kRowTile = 64;  // rows per tile: the vector dimension of fwd / dQ
inline constexpr int64_t kKeyTile = 64;  // keys per tile: the vector dimension of dK / dV
template <class T>
inline constexpr bool kTilesFit =
    kRowTile % (kMicroVecs * kLanes<T>) == 0 && kKeyTile % (kMicroVecs * kLanes<T>) == 0;
static_assert(kTilesFit<float> && kTilesFit<double>, "tiles must be whole micro-tiles");

// Sizes that every sequence of a call shares.
struct Shape {
  int64_t heads_q, heads_kv, head_dim;

  int64_t Group() const { return heads_q / heads_kv; }
};

// P is FwdParams or BwdParams, which name their sizes alike.
template <class P>
inline Shape MakeShape(const P& p) {
  return {p.heads_q, p.heads_kv, p.head_dim};
}

// What one (row tile, key tile) pair needs beyond its products.
struct TileMasks {
  bool skip;      // no row of the tile shares a segment with any key: nothing to compute
  bool band;      // some score lies outside the band (or past the sequence's keys)
  bool segments;  // some row and key of the tile hold different segment ids

  bool Any() const { return band || segments; }
};

// Tiles of at most `size` over [begin, end): tile t covers [Start(t), Start(t) + Length(t)).
struct Tiling {
  int64_t begin, end, size;

  int64_t Count() const { return end > begin ? CeilDiv(end - begin, size) : 0; }
  int64_t Start(int64_t t) const { return begin + t * size; }
  int64_t Length(int64_t t) const { return std::min(size, end - Start(t)); }
};

// One GQA group of one sequence: rows [0, Rows()) are the (position, query head) pairs of query
// heads hk * G .. hk * G + G - 1, row r being position r / G of head hk * G + r % G (see the top),
// and keys [0, len_k) those of kv head hk. Positions and keys are sequence-local, and so is the
// band, which is in positions: a tile of rows [r0, r1) covers positions [r0 / G, (r1 - 1) / G].
struct SpanGroup {
  int64_t group;  // G = heads_q / heads_kv
  int64_t heads_q, head_dim;
  int64_t len_q, len_k;
  int64_t stat_head;
  int64_t row_base;   // element offset of (q_start, head hk * G, 0) in Q / O / dO / dQ
  int64_t stat_base;  // of (head hk * G, position 0) in lse / delta
  int64_t key_base;   // of (k_start, hk, 0) in K / V / dK / dV
  int64_t sink_base;  // of (batch, head hk * G) in the sinks
  int64_t key_row;    // row of key 0 in the K / V panels (Panels below)
  int64_t group_row;  // row of row 0 in the Q / dO panels
  SeqMask band;
  // The sequence's segment ids and their chunk ranges; null without segment ids.
  const int32_t* q_ids = nullptr;
  const int32_t* kv_ids = nullptr;
  const int32_t* q_ranges = nullptr;
  const int32_t* kv_ranges = nullptr;

  SpanGroup(const Shape& shape, const MaskParams& mask, const SeqLayout& layout,
            const SeqSpan& span, int64_t hk)
      : group(shape.Group()),
        heads_q(shape.heads_q),
        head_dim(shape.head_dim),
        len_q(span.len_q),
        len_k(span.len_k),
        stat_head(span.stat_head),
        row_base((span.q_start * shape.heads_q + hk * group) * shape.head_dim),
        stat_base(span.stat_start + hk * group * span.stat_head),
        key_base((span.k_start * shape.heads_kv + hk) * shape.head_dim),
        sink_base(span.batch * mask.sinks_batch_stride + hk * group),
        key_row(hk * layout.rows_k() + span.k_start),
        group_row((hk * layout.rows_q() + span.q_start) * group),
        band(mask.band.for_seq(span.len_q, span.len_k)) {
    if (mask.segments.enabled()) {
      // Segment ids come with dense batches only: sequence `batch` is row `batch` of each array.
      const SegmentIds& s = mask.segments;
      q_ids = s.q_ids + span.batch * layout.seqlen_q;
      kv_ids = s.kv_ids + span.batch * layout.seqlen_k;
      q_ranges = segment_row(s.q_ranges, span.batch, layout.seqlen_q);
      kv_ranges = segment_row(s.kv_ranges, span.batch, layout.seqlen_k);
    }
  }

  int64_t Rows() const { return len_q * group; }
  // Offsets of row r: into Q / O / dO / dQ from row_base, into lse / delta from stat_base.
  int64_t RowOffset(int64_t r) const {
    const int64_t i = r / group;
    return (i * heads_q + (r - i * group)) * head_dim;
  }
  int64_t StatOffset(int64_t r) const {
    const int64_t i = r / group;
    return (r - i * group) * stat_head + i;
  }
  // The keys that some row of [r0, r1) may see, in tiles; r0 < r1.
  Tiling KeysSeen(int64_t r0, int64_t r1) const {
    return {band.key_begin(r0 / group), band.key_end((r1 - 1) / group + 1), kKeyTile};
  }
  // The rows that may see some key of [c0, c1), in tiles; c0 < c1.
  Tiling RowsSeeing(int64_t c0, int64_t c1) const {
    return {band.row_begin(c0) * group, band.row_end(c1) * group, kRowTile};
  }
  // Within the bounds above every tile pair holds a visible score as far as the band goes (it is
  // convex), so only segment ids can make one empty.
  TileMasks Classify(int64_t r0, int64_t rows, int64_t key0, int64_t keys) const {
    const int64_t p0 = r0 / group;
    const int64_t p1 = (r0 + rows - 1) / group + 1;
    TileMasks m{false, !band.tile_full(p0, p1, key0, key0 + keys), false};
    if (q_ids != nullptr) {
      const IdRange qr = id_range(q_ranges, p0, p1);
      const IdRange kr = id_range(kv_ranges, key0, key0 + keys);
      m.skip = qr.disjoint(kr);
      m.segments = !qr.same_single(kr);
    }
    return m;
  }
};

// The outer blocks of one pass: every (sequence, kv head) cut into blocks of `tile` rows (the
// forward and dQ passes) or keys (the dK/dV pass), each of which owns its outputs.
class Blocks {
 public:
  struct Block {
    SeqSpan span;
    int64_t hk;
    int64_t index;  // of the block within its sequence
    int64_t id;     // a number in [0, Count()) of its own
  };

  Blocks(const SeqLayout& layout, int64_t group, int64_t heads_kv, bool keys, int64_t tile)
      : layout_(layout), group_(group), heads_kv_(heads_kv), keys_(keys) {
    if (!layout.varlen()) {
      per_seq_ = CeilDiv(keys ? layout.seqlen_k : layout.seqlen_q * group, tile);
      per_head_ = layout.batch * per_seq_;
      return;
    }
    // The CPU sees cu_seqlens in host memory, so the blocks of every sequence are counted once
    // and a block is found by binary search: each sequence gets only the blocks it needs, and a
    // batch of many short sequences still gives one task per (sequence, kv head, block).
    first_.resize(static_cast<size_t>(layout.spans() + 1));
    for (int64_t n = 0; n < layout.spans(); ++n) {
      first_[n + 1] = first_[n] + CeilDiv(Extent(Span(n)), tile);
    }
    per_head_ = first_.back();
  }

  int64_t Count() const { return heads_kv_ * per_head_; }

  // Sequence n as this pass sees it. The key pass gives the padding span the keys past
  // cu_seqlens_k[num_seqs] and no queries, so that their dK and dV are written (as zeros).
  SeqSpan Span(int64_t n) const {
    SeqSpan s = layout_.span(n);
    if (keys_ && layout_.varlen() && n >= layout_.num_seqs) {
      s.len_k = layout_.total_k - s.k_start;
      s.len_q = 0;
    }
    return s;
  }

  // Block o of [0, Count()). Within a sequence the order alternates its first and last blocks:
  // under a band a block's cost grows or shrinks with its index, and any contiguous share of the
  // tasks that the pool hands one thread then carries about the same work.
  Block Get(int64_t o) const {
    const int64_t hk = o / per_head_;
    const int64_t g = o - hk * per_head_;
    int64_t n, first, count;
    if (!layout_.varlen()) {
      n = g / per_seq_;
      first = n * per_seq_;
      count = per_seq_;
    } else {
      // The last sequence whose first block is at most g: empty sequences share their first
      // block with the next one and are passed over.
      n = std::upper_bound(first_.begin(), first_.end(), g) - first_.begin() - 1;
      first = first_[n];
      count = first_[n + 1] - first;
    }
    const int64_t i = g - first;
    const int64_t index = i % 2 == 0 ? i / 2 : count - 1 - i / 2;
    return {Span(n), hk, index, hk * per_head_ + first + index};
  }

 private:
  int64_t Extent(const SeqSpan& s) const { return keys_ ? s.len_k : s.len_q * group_; }

  SeqLayout layout_;
  int64_t group_, heads_kv_;
  bool keys_;
  int64_t per_seq_ = 0;               // dense: blocks per sequence
  int64_t per_head_ = 0;              // blocks per kv head, over all sequences
  std::vector<int64_t> first_ = {0};  // packed: first block of each sequence, and the total
};

// The tasks of one pass: every outer block, cut into `splits` contiguous pieces of its inner loop.
struct Schedule {
  const Blocks& blocks;
  int64_t splits = 1;

  // inner(block) is the number of inner tiles the block visits; only consulted when the blocks
  // alone cannot occupy the thread pool.
  template <class Inner>
  Schedule(const Blocks& blocks_, Inner inner) : blocks(blocks_) {
    // 16 tasks keep a small pool busy with slack for uneven tasks; a piece keeps at least 4 tiles
    // so that combining the partial results stays cheap next to computing them.
    constexpr int64_t kMinTasks = 16;
    constexpr int64_t kMinTilesPerSplit = 4;
    const int64_t outer = blocks.Count();
    if (outer == 0 || outer >= kMinTasks) return;
    int64_t most = 0;
    for (int64_t o = 0; o < outer; ++o) most = std::max(most, inner(blocks.Get(o)));
    splits = std::max<int64_t>(1, std::min(CeilDiv(kMinTasks, outer), most / kMinTilesPerSplit));
  }
  int64_t Outer() const { return blocks.Count(); }
  int64_t Tasks() const { return Outer() * splits; }

  struct Task {
    Blocks::Block block;
    int64_t split;
  };
  Task Decode(int64_t t) const { return {blocks.Get(t / splits), t % splits}; }
  // The inner tiles [first, second) of [0, count) that piece `split` covers.
  std::pair<int64_t, int64_t> Piece(int64_t split, int64_t count) const {
    const int64_t per = CeilDiv(count, splits);
    return {std::min(split * per, count), std::min((split + 1) * per, count)};
  }
  // Index of a task's partial result: the pieces of one block are adjacent, in piece order.
  int64_t Slot(const Task& task) const { return task.block.id * splits + task.split; }
};

// A block of the forward or dQ pass: rows [r0, r0 + rows) of one group and the keys they see.
struct RowBlock {
  SpanGroup g;
  int64_t r0, rows;
  Tiling keys;

  template <class P>
  RowBlock(const P& p, const Shape& shape, const Blocks::Block& b)
      : g(shape, p.mask, p.layout, b.span, b.hk),
        r0(b.index * kRowTile),
        rows(std::min(kRowTile, g.Rows() - r0)),
        keys(g.KeysSeen(r0, r0 + rows)) {}
};

// A block of the dK/dV pass: keys [key0, key0 + keys) of one group and the rows that see them.
struct KeyBlock {
  SpanGroup g;
  int64_t key0, keys;
  Tiling rows;

  KeyBlock(const BwdParams& p, const Shape& shape, const Blocks::Block& b)
      : g(shape, p.mask, p.layout, b.span, b.hk),
        key0(b.index * kKeyTile),
        keys(std::min(kKeyTile, g.len_k - key0)),
        rows(g.RowsSeeing(key0, key0 + keys)) {}
};

// One heap buffer per task, carved into 64-byte aligned arrays of the given sizes, handed out in
// order by Next().
template <class T>
class Workspace {
 public:
  explicit Workspace(std::initializer_list<int64_t> sizes) {
    int64_t total = 0;
    for (int64_t size : sizes)
      offsets_.push_back(std::exchange(total, total + RoundUp(size, kAlign)));
    buffer_.resize(static_cast<size_t>(total + kAlign));
    const auto address = reinterpret_cast<uintptr_t>(buffer_.data());
    const uintptr_t aligned = (address + kAlign * sizeof(T) - 1) & ~(kAlign * sizeof(T) - 1);
    base_ = buffer_.data() + (aligned - address) / sizeof(T);
  }
  T* Next() { return base_ + offsets_.at(next_++); }

 private:
  static constexpr int64_t kAlign = 64 / static_cast<int64_t>(sizeof(T));  // in elements
  std::vector<T> buffer_;
  std::vector<int64_t> offsets_;
  T* base_ = nullptr;
  size_t next_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Packing: tensors to tiles in the compute type.

// n contiguous elements to the compute type.
template <class T, class S>
void LoadRow(const S* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, S>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
  } else if constexpr (std::is_same_v<S, Half>) {
    ConvertHalves(src, n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Load<T>(src + i);
  }
}

// Rows [r0, r0 + rows) of a group (base points at its row_base), transposed into dst[d][r] and
// multiplied by `scale`; lanes [rows, padded) are zeroed so that they stay finite.
template <class T, class S>
void PackRowsTransposed(const S* base, const SpanGroup& g, int64_t r0, int64_t rows, int64_t padded,
                        T scale, T* dst, int64_t ld) {
  const int64_t d_dim = g.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const S* src = base + g.RowOffset(r0 + r);
    for (int64_t d = 0; d < d_dim; ++d) dst[d * ld + r] = Load<T>(src + d) * scale;
  }
  for (int64_t d = 0; d < d_dim; ++d) std::fill(dst + d * ld + rows, dst + d * ld + padded, T(0));
}

// Tensors repacked once per call, in the compute type, into panels that hold each kv head's rows
// contiguously: K and V as [heads_kv][rows_k][head_dim] for the forward and dQ passes, Q (times
// the softmax scale) and dO as [heads_kv][rows_q * G][d_pad] in group-row order (head_dim
// zero-padded to whole vectors) for the dK/dV pass. A tile is then a dense array the
// micro-kernels read in place. Copying tiles out of the tensors instead, once per block that
// visits them (64 times per head at seqlen 4k), took ~11% of the forward at head_dim 64 (the
// softmax ~16%). In the tensors consecutive keys are heads * head_dim elements apart, often a
// multiple of 4 KiB, which would put the micro-kernel's broadcast streams in the same few L1 sets.
// O(N) memory: one more copy of each packed tensor.
template <class T>
class Panel {
 public:
  Panel(int64_t rows, int64_t width) : width_(width), data_(new T[rows * width]) {}
  T* Row(int64_t r) { return data_.get() + r * width_; }
  const T* Row(int64_t r) const { return data_.get() + r * width_; }

 private:
  int64_t width_;
  // Uninitialised: the packing writes every element.
  std::unique_ptr<T[]> data_;
};

// Packing runs over chunks of this many rows per kv head, in parallel.
inline constexpr int64_t kPackChunk = 256;

// K or V [rows_k, heads_kv, head_dim] as panel rows hk * rows_k + j.
template <class T, class S>
Panel<T> PackKeyPanel(const void* tensor, const SeqLayout& layout, const Shape& shape,
                      const ParallelFor& parallel_for) {
  const int64_t rows = layout.rows_k();
  const int64_t d_dim = shape.head_dim;
  const int64_t heads = shape.heads_kv;
  Panel<T> panel(heads * rows, d_dim);
  const int64_t chunks = CeilDiv(rows, kPackChunk);
  const S* src = static_cast<const S*>(tensor);
  parallel_for(heads * chunks, [&](int64_t t) {
    const int64_t hk = t / chunks;
    const int64_t j0 = (t - hk * chunks) * kPackChunk;
    const int64_t j1 = std::min(rows, j0 + kPackChunk);
    for (int64_t j = j0; j < j1; ++j) {
      LoadRow(src + (j * heads + hk) * d_dim, d_dim, panel.Row(hk * rows + j));
    }
  });
  return panel;
}

// Q or dO [rows_q, heads_q, head_dim] as panel rows (hk * rows_q + i) * G + h for position i of
// query head hk * G + h, times `scale`, zero-padded to d_pad.
template <class T, class S>
Panel<T> PackRowPanel(const void* tensor, T scale, const SeqLayout& layout, const Shape& shape,
                      const ParallelFor& parallel_for) {
  const int64_t positions = layout.rows_q();
  const int64_t d_dim = shape.head_dim;
  const int64_t d_pad = RoundUp(d_dim, kLanes<T>);
  const int64_t group = shape.Group();
  Panel<T> panel(shape.heads_q * positions, d_pad);
  const int64_t chunks = CeilDiv(positions, kPackChunk);
  const S* src = static_cast<const S*>(tensor);
  parallel_for(shape.heads_kv * chunks, [&](int64_t t) {
    const int64_t hk = t / chunks;
    const int64_t i0 = (t - hk * chunks) * kPackChunk;
    const int64_t i1 = std::min(positions, i0 + kPackChunk);
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t h = 0; h < group; ++h) {
        T* out = panel.Row((hk * positions + i) * group + h);
        LoadRow(src + (i * shape.heads_q + hk * group + h) * d_dim, d_dim, out);
        if (scale != T(1)) {
          for (int64_t d = 0; d < d_dim; ++d) out[d] *= scale;
        }
        std::fill(out + d_dim, out + d_pad, T(0));
      }
    }
  });
  return panel;
}

// A K or V tile [keys, head_dim] transposed into dst[d][j]; keys [keys, padded) are zeroed.
template <class T, class S>
void PackKeysTransposed(const S* src, int64_t src_ld, int64_t keys, int64_t padded, int64_t d_dim,
                        T* dst, int64_t ld) {
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t d = 0; d < d_dim; ++d) dst[d * ld + j] = Load<T>(src + j * src_ld + d);
  }
  for (int64_t d = 0; d < d_dim; ++d) std::fill(dst + d * ld + keys, dst + d * ld + padded, T(0));
}

// ---------------------------------------------------------------------------------------------
// Score tiles after their product: soft-capping, then the masks a tile pair needs (TileMasks).
// Both are passes of their own over a tile, run only for the tiles that need them, so the
// softmax loops stay the same for every mask. A masked score is set to -inf, never multiplied by
// 0, so a non-finite score there cannot leak.

// S = c tanh(S / c) over `count` lines of `width` (whole vectors) at stride ld.
template <class T>
void Softcap(T cap, int64_t count, int64_t width, T* s, int64_t ld) {
  constexpr int64_t kL = kLanes<T>;
  const Vec<T> c = Splat(cap);
  const Vec<T> inv = Splat(T(1) / cap);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t w = 0; w < width; w += kL) {
      T* at = s + i * ld + w;
      StoreVec(at, c * Tanh(LoadVec(at) * inv));
    }
  }
}

// Segment ids of rows [r0, r0 + rows) of a group.
inline void RowIds(const SpanGroup& g, int64_t r0, int64_t rows, int32_t* ids) {
  for (int64_t r = 0; r < rows; ++r) ids[r] = g.q_ids[(r0 + r) / g.group];
}

// Rows along the lanes: S^T[j][r] = -inf where row r0 + r does not see key key0 + j. Lanes
// [rows, padded) hold no row and are left as they are, or -inf.
template <class T>
void MaskTransposed(const SpanGroup& g, const TileMasks& m, int64_t r0, int64_t rows, int64_t key0,
                    int64_t keys, int64_t padded, const int32_t* row_ids, T* st, int64_t ld) {
  constexpr T kHidden = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < keys; ++j) {
    T* line = st + j * ld;
    if (m.band) {
      const Tiling seen = g.RowsSeeing(key0 + j, key0 + j + 1);
      const int64_t lo = std::clamp<int64_t>(seen.begin - r0, 0, padded);
      const int64_t hi = std::clamp<int64_t>(seen.end - r0, lo, padded);
      std::fill(line, line + lo, kHidden);
      std::fill(line + hi, line + padded, kHidden);
    }
    if (m.segments) {
      const int32_t id = g.kv_ids[key0 + j];
      for (int64_t r = 0; r < rows; ++r) line[r] = row_ids[r] == id ? line[r] : kHidden;
    }
  }
}

// Keys along the lanes: S[r][c] = -inf where row r0 + r does not see key key0 + c. Lanes
// [keys, padded) hold no key and are left as they are, or -inf.
template <class T>
void MaskRows(const SpanGroup& g, const TileMasks& m, int64_t r0, int64_t rows, int64_t key0,
              int64_t keys, int64_t padded, const int32_t* row_ids, T* s, int64_t ld) {
  constexpr T kHidden = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    T* line = s + r * ld;
    if (m.band) {
      const int64_t i = (r0 + r) / g.group;
      const int64_t lo = std::clamp<int64_t>(g.band.key_begin(i) - key0, 0, padded);
      const int64_t hi = std::clamp<int64_t>(g.band.key_end(i + 1) - key0, lo, padded);
      std::fill(line, line + lo, kHidden);
      std::fill(line + hi, line + padded, kHidden);
    }
    if (m.segments) {
      const int32_t id = row_ids[r];
      const int32_t* key_ids = g.kv_ids + key0;
      for (int64_t c = 0; c < keys; ++c) line[c] = key_ids[c] == id ? line[c] : kHidden;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

// The online-softmax state of a row tile over the keys seen so far: O^T[d][r] unnormalised, and
// per row the running max and sum. One per task, or one per piece of a split block.
template <class T>
struct SoftmaxState {
  T* ot;
  T* max;
  T* sum;

  static int64_t Size(int64_t d_dim) { return (d_dim + 2) * kRowTile; }
  SoftmaxState(T* buffer, int64_t d_dim)
      : ot(buffer), max(buffer + d_dim * kRowTile), sum(max + kRowTile) {}
};

// Runs key tiles [t0, t1) of the block's keys through the online softmax of its rows, starting
// from an empty state.
template <class T, class S>
void ForwardRows(const FwdParams& p, const RowBlock& blk, int64_t t0, int64_t t1,
                 const Panel<T>& k_panel, const Panel<T>& v_panel, SoftmaxState<T> state) {
  constexpr int64_t kL = kLanes<T>;
  constexpr int64_t ld = kRowTile;
  constexpr T kInf = std::numeric_limits<T>::infinity();
  const SpanGroup& g = blk.g;
  const int64_t d_dim = g.head_dim;
  const int64_t rows = blk.rows;
  const int64_t padded = RoundUp(rows, kL);
  std::fill(state.ot, state.ot + d_dim * ld, T(0));
  std::fill(state.max, state.max + ld, -kInf);
  std::fill(state.sum, state.sum + ld, T(0));
  if (t0 >= t1) return;

  Workspace<T> ws({d_dim * ld, kKeyTile * ld, ld});
  T* qt = ws.Next();
  T* st = ws.Next();
  T* rescale = ws.Next();
  PackRowsTransposed(static_cast<const S*>(p.q) + g.row_base, g, blk.r0, rows, padded,
                     static_cast<T>(p.softmax_scale), qt, ld);
  int32_t row_ids[kRowTile];
  if (g.q_ids != nullptr) RowIds(g, blk.r0, rows, row_ids);
  const T cap = static_cast<T>(p.mask.softcap);

  for (int64_t t = t0; t < t1; ++t) {
    const int64_t key0 = blk.keys.Start(t);
    const int64_t keys = blk.keys.Length(t);
    const TileMasks masks = g.Classify(blk.r0, rows, key0, keys);
    if (masks.skip) continue;
    const T* kt = k_panel.Row(g.key_row + key0);
    const T* vt = v_panel.Row(g.key_row + key0);

    Gemm<T, Update::kOverwrite>(keys, padded, d_dim, kt, d_dim, 1, qt, ld, st, ld);
    if (cap > 0) Softcap(cap, keys, padded, st, ld);
    if (masks.Any()) MaskTransposed(g, masks, blk.r0, rows, key0, keys, padded, row_ids, st, ld);

    // A row that has seen only masked keys keeps max = -inf. Its subtraction point is clamped to
    // 0 so that exp gives 0 rather than NaN, and its rescale exp(-inf - finite) is 0.
    for (int64_t c = 0; c < padded; c += kL) {
      const Vec<T> old_max = LoadVec(state.max + c);
      Vec<T> new_max = old_max;
      for (int64_t j = 0; j < keys; ++j) new_max = Max(new_max, LoadVec(st + j * ld + c));
      const Vec<T> pivot = new_max == Splat(-kInf) ? Splat(T(0)) : new_max;
      const Vec<T> alpha = Exp(old_max - pivot);
      Vec<T> sum = Splat(T(0));
      for (int64_t j = 0; j < keys; ++j) {
        const Vec<T> e = Exp(LoadVec(st + j * ld + c) - pivot);
        StoreVec(st + j * ld + c, e);
        sum += e;
      }
      StoreVec(state.sum + c, Madd(LoadVec(state.sum + c), alpha, sum));
      StoreVec(state.max + c, new_max);
      StoreVec(rescale + c, alpha);
    }
    Gemm<T, Update::kRescale>(d_dim, padded, keys, vt, 1, d_dim, st, ld, state.ot, ld, rescale);
  }
}

// Writes O = O^T / sum and lse = max + log(sum) for the block's rows; a row with sum = 0 saw no
// key and gets O = 0, lse = -inf. lse is evaluated in double so that the stored value carries a
// single rounding; when one key dominates a row, log(sum) vanishes and lse is exactly the row
// max, consistent with the scores the backward pass recomputes.
//
// A sink is one more term e^sink of every row's denominator, with no value. Starting the online
// softmax at max = sink, sum = 1 gives the same sum as adding the term here, once per row and in
// double, which leaves the key loops (and the merge of split pieces) as they are. A row that saw
// no key then gets O = 0 and lse = sink.
template <class T, class S>
void WriteForward(const FwdParams& p, const RowBlock& blk, const T* ot, const double* max,
                  const double* sum) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const SpanGroup& g = blk.g;
  S* o_base = static_cast<S*>(p.o) + g.row_base;
  T* lse_base = static_cast<T*>(p.lse) + g.stat_base;
  const T* sinks =
      p.mask.sinks != nullptr ? static_cast<const T*>(p.mask.sinks) + g.sink_base : nullptr;
  for (int64_t r = 0; r < blk.rows; ++r) {
    const int64_t row = blk.r0 + r;
    double top = max[r];
    double total = sum[r];
    double o_scale = 1.0;  // O^T is relative to e^max
    if (sinks != nullptr) {
      const double sink = sinks[row % g.group];
      if (sink > -kInf) {
        const double m = total > 0 ? std::max(top, sink) : sink;
        o_scale = total > 0 ? std::exp(top - m) : 0.0;
        total = total * o_scale + std::exp(sink - m);
        top = m;
      }
    }
    S* out = o_base + g.RowOffset(row);
    const T inv = total > 0 ? static_cast<T>(o_scale / total) : T(0);
    for (int64_t d = 0; d < g.head_dim; ++d) Store(out + d, ot[d * kRowTile + r] * inv);
    lse_base[g.StatOffset(row)] =
        total > 0 ? static_cast<T>(top + std::log(total)) : -std::numeric_limits<T>::infinity();
  }
}

template <class T, class S>
void Forward(const FwdParams& p, const ParallelFor& parallel_for) {
  const Shape shape = MakeShape(p);
  const int64_t d_dim = shape.head_dim;
  const Blocks blocks(p.layout, shape.Group(), shape.heads_kv, /*keys=*/false, kRowTile);
  const Schedule sched(blocks,
                       [&](const Blocks::Block& b) { return RowBlock(p, shape, b).keys.Count(); });
  const Panel<T> k_panel = PackKeyPanel<T, S>(p.k, p.layout, shape, parallel_for);
  const Panel<T> v_panel = PackKeyPanel<T, S>(p.v, p.layout, shape, parallel_for);
  const int64_t state_size = SoftmaxState<T>::Size(d_dim);
  // Partial states of split blocks, [outer block][piece]; see the note at the top.
  std::vector<T> partials(sched.splits > 1 ? sched.Tasks() * state_size : 0);

  parallel_for(sched.Tasks(), [&](int64_t t) {
    const Schedule::Task task = sched.Decode(t);
    const RowBlock blk(p, shape, task.block);
    const auto [t0, t1] = sched.Piece(task.split, blk.keys.Count());
    if (sched.splits > 1) {
      T* state = partials.data() + sched.Slot(task) * state_size;
      ForwardRows<T, S>(p, blk, t0, t1, k_panel, v_panel, {state, d_dim});
      return;
    }
    std::vector<T> state(static_cast<size_t>(state_size));
    const SoftmaxState<T> st(state.data(), d_dim);
    ForwardRows<T, S>(p, blk, t0, t1, k_panel, v_panel, st);
    double max[kRowTile], sum[kRowTile];
    for (int64_t r = 0; r < blk.rows; ++r) {
      max[r] = st.max[r];
      sum[r] = st.sum[r];
    }
    WriteForward<T, S>(p, blk, st.ot, max, sum);
  });
  if (sched.splits == 1) return;

  // Merge the pieces of each block in piece order: rescale every piece to the overall max.
  parallel_for(sched.Outer(), [&](int64_t outer) {
    const Schedule::Task task = sched.Decode(outer * sched.splits);
    const RowBlock blk(p, shape, task.block);
    const int64_t rows = blk.rows;
    T* first = partials.data() + sched.Slot(task) * state_size;
    std::vector<T> ot(static_cast<size_t>(d_dim * kRowTile), T(0));
    double max[kRowTile], sum[kRowTile], weight[kRowTile];
    for (int64_t r = 0; r < rows; ++r) {
      max[r] = -std::numeric_limits<double>::infinity();
      sum[r] = 0;
    }
    for (int64_t s = 0; s < sched.splits; ++s) {
      const SoftmaxState<T> piece(first + s * state_size, d_dim);
      for (int64_t r = 0; r < rows; ++r) max[r] = std::max<double>(max[r], piece.max[r]);
    }
    for (int64_t s = 0; s < sched.splits; ++s) {
      const SoftmaxState<T> piece(first + s * state_size, d_dim);
      for (int64_t r = 0; r < rows; ++r) {
        // A piece that saw nothing (max -inf) weighs 0; so does every piece of a masked row.
        weight[r] = piece.max[r] == -std::numeric_limits<T>::infinity()
                        ? 0.0
                        : std::exp(static_cast<double>(piece.max[r]) - max[r]);
        sum[r] += weight[r] * piece.sum[r];
      }
      for (int64_t d = 0; d < d_dim; ++d) {
        for (int64_t r = 0; r < rows; ++r) {
          ot[d * kRowTile + r] += static_cast<T>(weight[r]) * piece.ot[d * kRowTile + r];
        }
      }
    }
    WriteForward<T, S>(p, blk, ot.data(), max, sum);
  });
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Per-row statistics of rows [r0, r0 + rows): lse, with -inf replaced by +inf so that
// P = exp(S - lse) is 0 on fully masked rows, and delta. Lanes [rows, padded) get the same as a
// fully masked row, and delta = 0.
template <class T>
void LoadStats(const BwdParams& p, const SpanGroup& g, int64_t r0, int64_t rows, int64_t padded,
               T* lse, T* delta) {
  constexpr T kInf = std::numeric_limits<T>::infinity();
  const T* lse_src = static_cast<const T*>(p.lse) + g.stat_base;
  const T* delta_src = static_cast<const T*>(p.delta) + g.stat_base;
  for (int64_t r = 0; r < rows; ++r) {
    const T l = lse_src[g.StatOffset(r0 + r)];
    lse[r] = l == -kInf ? kInf : l;
    delta[r] = delta_src[g.StatOffset(r0 + r)];
  }
  std::fill(lse + rows, lse + padded, kInf);
  std::fill(delta + rows, delta + padded, T(0));
}

// dS = P (dP - delta), times dtanh = 1 - t^2 with soft-capping, where t = S / c is the tanh the
// capped score S came from. A masked score (-inf) gets a factor of 0, not -inf, so that its
// dS is 0 and never NaN.
template <class T, bool kSoftcap>
inline Vec<T> ScoreGrad(const Vec<T>& s, const Vec<T>& pv, const Vec<T>& dp, const Vec<T>& dl,
                        const Vec<T>& inv_cap) {
  const Vec<T> ds = pv * (dp - dl);
  if constexpr (!kSoftcap) {
    return ds;
  } else {
    const Vec<T> t = s * inv_cap;
    return ds * Max(Splat(T(1)) - t * t, Splat(T(0)));
  }
}

// Rows along the lanes: st = S^T becomes P^T = exp(S^T - lse) and dpt = dP^T becomes dS^T.
template <class T, bool kSoftcap>
void SoftmaxGradTransposed(int64_t keys, int64_t padded, const T* lse, const T* delta, T inv_cap,
                           T* st, T* dpt, int64_t ld) {
  constexpr int64_t kL = kLanes<T>;
  const Vec<T> ic = Splat(inv_cap);
  for (int64_t c = 0; c < padded; c += kL) {
    const Vec<T> l = LoadVec(lse + c);
    const Vec<T> dl = LoadVec(delta + c);
    for (int64_t j = 0; j < keys; ++j) {
      const Vec<T> sv = LoadVec(st + j * ld + c);
      const Vec<T> pv = Exp(sv - l);
      StoreVec(st + j * ld + c, pv);
      StoreVec(dpt + j * ld + c, ScoreGrad<T, kSoftcap>(sv, pv, LoadVec(dpt + j * ld + c), dl, ic));
    }
  }
}

// Keys along the lanes: s = S becomes P and dp = dP becomes dS.
template <class T, bool kSoftcap>
void SoftmaxGradRows(int64_t rows, int64_t padded, const T* lse, const T* delta, T inv_cap, T* s,
                     T* dp, int64_t ld) {
  constexpr int64_t kL = kLanes<T>;
  const Vec<T> ic = Splat(inv_cap);
  for (int64_t r = 0; r < rows; ++r) {
    const Vec<T> l = Splat(lse[r]);
    const Vec<T> dl = Splat(delta[r]);
    for (int64_t c = 0; c < padded; c += kL) {
      const Vec<T> sv = LoadVec(s + r * ld + c);
      const Vec<T> pv = Exp(sv - l);
      StoreVec(s + r * ld + c, pv);
      StoreVec(dp + r * ld + c, ScoreGrad<T, kSoftcap>(sv, pv, LoadVec(dp + r * ld + c), dl, ic));
    }
  }
}

// Pass 1: dK, dV [keys, d_pad] of the block's keys from row tiles [t0, t1) of the rows that see
// them, starting from zero.
template <class T, class S>
void BackwardKeys(const BwdParams& p, const KeyBlock& blk, int64_t t0, int64_t t1,
                  const Panel<T>& q_panel, const Panel<T>& do_panel, T* dk, T* dv) {
  constexpr int64_t kL = kLanes<T>;
  constexpr int64_t ldk = kKeyTile;
  const SpanGroup& g = blk.g;
  const int64_t d_dim = g.head_dim;
  const int64_t d_pad = RoundUp(d_dim, kL);
  const int64_t key0 = blk.key0;
  const int64_t keys = blk.keys;
  const int64_t keys_pad = RoundUp(keys, kL);
  std::fill(dk, dk + keys * d_pad, T(0));
  std::fill(dv, dv + keys * d_pad, T(0));
  if (t0 >= t1) return;

  const int64_t kv_ld = p.heads_kv * d_dim;
  Workspace<T> ws({d_dim * ldk, d_dim * ldk, kRowTile * ldk, kRowTile * ldk, kRowTile, kRowTile});
  T* kt = ws.Next();
  T* vt = ws.Next();
  T* s = ws.Next();
  T* dp = ws.Next();
  T* lse = ws.Next();
  T* delta = ws.Next();
  const S* k_src = static_cast<const S*>(p.k) + g.key_base + key0 * kv_ld;
  const S* v_src = static_cast<const S*>(p.v) + g.key_base + key0 * kv_ld;
  PackKeysTransposed(k_src, kv_ld, keys, keys_pad, d_dim, kt, ldk);
  PackKeysTransposed(v_src, kv_ld, keys, keys_pad, d_dim, vt, ldk);
  // The Q rows carry the softmax scale: S = (scale Q) K^T and dK = dS^T (scale Q).
  const T cap = static_cast<T>(p.mask.softcap);
  int32_t row_ids[kRowTile];

  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r0 = blk.rows.Start(t);
    const int64_t rows = blk.rows.Length(t);
    const TileMasks masks = g.Classify(r0, rows, key0, keys);
    if (masks.skip) continue;
    const T* q_rows = q_panel.Row(g.group_row + r0);
    const T* do_rows = do_panel.Row(g.group_row + r0);
    LoadStats(p, g, r0, rows, rows, lse, delta);

    // Padding keys (zero K and V columns) get values in s and dp that no product reads.
    Gemm<T, Update::kOverwrite>(rows, keys_pad, d_dim, q_rows, d_pad, 1, kt, ldk, s, ldk);
    if (cap > 0) Softcap(cap, rows, keys_pad, s, ldk);
    if (masks.Any()) {
      if (masks.segments) RowIds(g, r0, rows, row_ids);
      MaskRows(g, masks, r0, rows, key0, keys, keys_pad, row_ids, s, ldk);
    }
    Gemm<T, Update::kOverwrite>(rows, keys_pad, d_dim, do_rows, d_pad, 1, vt, ldk, dp, ldk);
    if (cap > 0) {
      SoftmaxGradRows<T, true>(rows, keys_pad, lse, delta, T(1) / cap, s, dp, ldk);
    } else {
      SoftmaxGradRows<T, false>(rows, keys_pad, lse, delta, T(0), s, dp, ldk);
    }
    Gemm<T, Update::kAccumulate>(keys, d_pad, rows, s, 1, ldk, do_rows, d_pad, dv, d_pad);
    Gemm<T, Update::kAccumulate>(keys, d_pad, rows, dp, 1, ldk, q_rows, d_pad, dk, d_pad);
  }
}

// Pass 2: dQ^T [d][r] (without the softmax scale) of the block's rows from key tiles [t0, t1) of
// the keys they see, starting from zero.
template <class T, class S>
void BackwardRows(const BwdParams& p, const RowBlock& blk, int64_t t0, int64_t t1,
                  const Panel<T>& k_panel, const Panel<T>& v_panel, T* dqt) {
  constexpr int64_t kL = kLanes<T>;
  constexpr int64_t ld = kRowTile;
  const SpanGroup& g = blk.g;
  const int64_t d_dim = g.head_dim;
  const int64_t r0 = blk.r0;
  const int64_t rows = blk.rows;
  const int64_t padded = RoundUp(rows, kL);
  std::fill(dqt, dqt + d_dim * ld, T(0));
  if (t0 >= t1) return;

  Workspace<T> ws({d_dim * ld, d_dim * ld, kKeyTile * ld, kKeyTile * ld, ld, ld});
  T* qt = ws.Next();
  T* dot = ws.Next();
  T* st = ws.Next();
  T* dpt = ws.Next();
  T* lse = ws.Next();
  T* delta = ws.Next();
  PackRowsTransposed(static_cast<const S*>(p.q) + g.row_base, g, r0, rows, padded,
                     static_cast<T>(p.softmax_scale), qt, ld);
  PackRowsTransposed(static_cast<const S*>(p.dout) + g.row_base, g, r0, rows, padded, T(1), dot,
                     ld);
  LoadStats(p, g, r0, rows, padded, lse, delta);
  int32_t row_ids[kRowTile];
  if (g.q_ids != nullptr) RowIds(g, r0, rows, row_ids);
  const T cap = static_cast<T>(p.mask.softcap);

  for (int64_t t = t0; t < t1; ++t) {
    const int64_t key0 = blk.keys.Start(t);
    const int64_t keys = blk.keys.Length(t);
    const TileMasks masks = g.Classify(r0, rows, key0, keys);
    if (masks.skip) continue;
    const T* kt = k_panel.Row(g.key_row + key0);
    const T* vt = v_panel.Row(g.key_row + key0);
    Gemm<T, Update::kOverwrite>(keys, padded, d_dim, kt, d_dim, 1, qt, ld, st, ld);
    if (cap > 0) Softcap(cap, keys, padded, st, ld);
    if (masks.Any()) MaskTransposed(g, masks, r0, rows, key0, keys, padded, row_ids, st, ld);
    Gemm<T, Update::kOverwrite>(keys, padded, d_dim, vt, d_dim, 1, dot, ld, dpt, ld);
    if (cap > 0) {
      SoftmaxGradTransposed<T, true>(keys, padded, lse, delta, T(1) / cap, st, dpt, ld);
    } else {
      SoftmaxGradTransposed<T, false>(keys, padded, lse, delta, T(0), st, dpt, ld);
    }
    // dQ^T[d][r] += sum_j K[j][d] dS^T[j][r].
    Gemm<T, Update::kAccumulate>(d_dim, padded, keys, kt, 1, d_dim, dpt, ld, dqt, ld);
  }
}

// Runs a pass whose split blocks combine by plain summation (both backward passes; the forward
// merge rescales instead). compute(task, out) fills out[0, size) with the task's result, the whole
// block's when unsplit and its piece's otherwise; write(task, total) stores a block's result.
template <class T, class Compute, class Write>
void RunSummed(const Schedule& sched, int64_t size, const ParallelFor& parallel_for,
               Compute compute, Write write) {
  // Partial results of split blocks, [outer block][piece]; see the note at the top.
  std::vector<T> partials(sched.splits > 1 ? sched.Tasks() * size : 0);
  parallel_for(sched.Tasks(), [&](int64_t t) {
    const Schedule::Task task = sched.Decode(t);
    std::vector<T> own(sched.splits > 1 ? 0 : static_cast<size_t>(size));
    T* out = sched.splits > 1 ? partials.data() + sched.Slot(task) * size : own.data();
    compute(task, out);
    if (sched.splits == 1) write(task, out);
  });
  if (sched.splits == 1) return;

  parallel_for(sched.Outer(), [&](int64_t outer) {
    const Schedule::Task task = sched.Decode(outer * sched.splits);
    T* first = partials.data() + sched.Slot(task) * size;
    // Fixed piece order: float addition is not associative, and gradients must be deterministic.
    for (int64_t s = 1; s < sched.splits; ++s) {
      const T* piece = first + s * size;
      for (int64_t i = 0; i < size; ++i) first[i] += piece[i];
    }
    write(task, first);
  });
}

template <class T, class S>
void Backward(const BwdParams& p, const ParallelFor& parallel_for) {
  const Shape shape = MakeShape(p);
  const int64_t d_dim = shape.head_dim;
  const int64_t d_pad = RoundUp(d_dim, kLanes<T>);
  const int64_t kv_ld = shape.heads_kv * d_dim;

  // Pass 1: dK and dV, one task per key block (and piece of the row tiles that see it). Every
  // key row of the call is in some block, the keys of the packed padding span included, so every
  // row of dK and dV is written.
  {
    const Panel<T> q_panel =
        PackRowPanel<T, S>(p.q, static_cast<T>(p.softmax_scale), p.layout, shape, parallel_for);
    const Panel<T> do_panel = PackRowPanel<T, S>(p.dout, T(1), p.layout, shape, parallel_for);
    const Blocks blocks(p.layout, shape.Group(), shape.heads_kv, /*keys=*/true, kKeyTile);
    const Schedule sched(
        blocks, [&](const Blocks::Block& b) { return KeyBlock(p, shape, b).rows.Count(); });
    const int64_t grad_size = 2 * kKeyTile * d_pad;  // dK, then dV
    const auto compute = [&](const Schedule::Task& task, T* grads) {
      const KeyBlock blk(p, shape, task.block);
      const auto [t0, t1] = sched.Piece(task.split, blk.rows.Count());
      BackwardKeys<T, S>(p, blk, t0, t1, q_panel, do_panel, grads, grads + kKeyTile * d_pad);
    };
    const auto write = [&](const Schedule::Task& task, const T* grads) {
      const KeyBlock blk(p, shape, task.block);
      const T* dk = grads;
      const T* dv = grads + kKeyTile * d_pad;
      const int64_t offset = blk.g.key_base + blk.key0 * kv_ld;
      S* dk_out = static_cast<S*>(p.dk) + offset;
      S* dv_out = static_cast<S*>(p.dv) + offset;
      for (int64_t j = 0; j < blk.keys; ++j) {
        for (int64_t d = 0; d < d_dim; ++d) {
          Store(dk_out + j * kv_ld + d, dk[j * d_pad + d]);
          Store(dv_out + j * kv_ld + d, dv[j * d_pad + d]);
        }
      }
    };
    RunSummed<T>(sched, grad_size, parallel_for, compute, write);
  }

  // Pass 2: dQ, one task per row block (and piece of the key tiles it sees).
  {
    const Panel<T> k_panel = PackKeyPanel<T, S>(p.k, p.layout, shape, parallel_for);
    const Panel<T> v_panel = PackKeyPanel<T, S>(p.v, p.layout, shape, parallel_for);
    const Blocks blocks(p.layout, shape.Group(), shape.heads_kv, /*keys=*/false, kRowTile);
    const Schedule sched(
        blocks, [&](const Blocks::Block& b) { return RowBlock(p, shape, b).keys.Count(); });
    const int64_t grad_size = d_dim * kRowTile;
    const T scale = static_cast<T>(p.softmax_scale);
    const auto compute = [&](const Schedule::Task& task, T* dqt) {
      const RowBlock blk(p, shape, task.block);
      const auto [t0, t1] = sched.Piece(task.split, blk.keys.Count());
      BackwardRows<T, S>(p, blk, t0, t1, k_panel, v_panel, dqt);
    };
    const auto write = [&](const Schedule::Task& task, const T* dqt) {
      const RowBlock blk(p, shape, task.block);
      S* dq = static_cast<S*>(p.dq) + blk.g.row_base;
      for (int64_t r = 0; r < blk.rows; ++r) {
        S* out = dq + blk.g.RowOffset(blk.r0 + r);
        for (int64_t d = 0; d < d_dim; ++d) Store(out + d, dqt[d * kRowTile + r] * scale);
      }
    };
    RunSummed<T>(sched, grad_size, parallel_for, compute, write);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points of this instruction set (declared in kernels.h). dtype is the element type of Q,
// K, V and the outputs; f16/bf16 compute in float32.

void AttentionForward(const FwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF16:
      return Forward<float, Half>(params, parallel_for);
    case DType::kBF16:
      return Forward<float, BFloat16>(params, parallel_for);
    case DType::kF32:
      return Forward<float, float>(params, parallel_for);
    case DType::kF64:
      return Forward<double, double>(params, parallel_for);
  }
}

void AttentionBackward(const BwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF16:
      return Backward<float, Half>(params, parallel_for);
    case DType::kBF16:
      return Backward<float, BFloat16>(params, parallel_for);
    case DType::kF32:
      return Backward<float, float>(params, parallel_for);
    case DType::kF64:
      return Backward<double, double>(params, parallel_for);
  }
}
