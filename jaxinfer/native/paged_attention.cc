// Attention over the paged KV cache for XLA:CPU, called through the XLA FFI
// (native/paged_attention.py builds and registers it): decode,
// speculative verification, and prompt steps (chunks mixed with decode rows).
//
// Why it exists: written in jnp, each tile of keys is gathered from the pool
// into a fresh array, transposed for the batched dot, and only then
// multiplied; on the 2-core dev VM those gather/transpose copies took ~70% of
// a decode step's attention. For a prompt the jnp path multiplies every new
// row by every new key, the half the causal mask hides included, and runs the
// softmax over all of them. Here every key and value a row sees is read
// straight from the pool, and nothing is written but the output.
//
// Shapes (the engine's cache layout, models/kv_cache.py):
//   q             f32 [T, H, D]      the step's rows, each sequence's contiguous
//   k_pool/v_pool [L, NB, BS, KV, D] f32, bf16, int8, or fp8 e4m3fn bits (u8)
//   k/v_scales    f32 [L, NB, BS, KV] for int8/fp8 pools (ignored otherwise)
//   layer         s32 []             which layer of the pools
//   block_tables  s32 [S, MAXB], context_lens s32 [S]
//   query_start   s32 [S + 1]        sequence s's rows are query_start[s] ..
//                                    query_start[s + 1] - 1, row i of them at
//                                    position context_len - q_len + i; rows
//                                    after query_start[S] are padding
//   out           f32 [T, H, D]      zeros for padding rows and sequences
//                                    with context_len 0
// sliding_window: 0 = none, else a query sees keys less than that far behind.
// The new rows' K/V are in the pool already (written by the step first).
//
// Work: one task per run of up to kTaskPositions rows of a sequence (and per
// chunk of its keys, then per KV head, when the runs are too few to share
// out): for each chunk of the keys up to its last row, the scores of its rows
// x G query heads (kept in a buffer), a softmax per row, then the weighted
// sum of values; the chunks' results merged per row (MergeChunks). Tasks
// are shared between the calling thread and XLA's intra-op thread pool
// (parallel.h).
#include "jaxinfer/native/vec16.h"  // the vector paths (JAXINFER_VEC16); the rest builds on any CPU

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "jaxinfer/native/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#if JAXINFER_VEC16
namespace vec = jaxinfer::vec16;
#endif

namespace {

constexpr int kMaxHeadDim = 512;  // paged_attention.py's MAX_HEAD_DIM

float Fp8E4m3fnToFloat(uint8_t bits) {
  const int sign = bits >> 7, exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float value;
  if (exponent == 0xF && mantissa == 0x7) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);
  } else {
    value = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return sign ? -value : value;
}

const float* Fp8Table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4m3fnToFloat(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

// One pool row (head_dim values of one token and KV head) as float32.
struct RowReader {
  ffi::DataType dtype;
  const void* pool;
  const float* scales;  // null for a float pool
  int64_t row_bytes;    // bytes of one row (head_dim values)

  // Returns a pointer to the row's float values (the pool itself for f32,
  // otherwise `buffer`, filled).
  const float* Read(int64_t row, int64_t head_dim, float* buffer) const {
    const int64_t offset = row * head_dim;
    switch (dtype) {
      case ffi::DataType::F32:
        return static_cast<const float*>(pool) + offset;
      case ffi::DataType::BF16: {
        const uint16_t* src = static_cast<const uint16_t*>(pool) + offset;
        for (int64_t d = 0; d < head_dim; ++d) {
          const uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
          std::memcpy(&buffer[d], &bits, sizeof(float));
        }
        return buffer;
      }
      case ffi::DataType::S8: {
        const int8_t* src = static_cast<const int8_t*>(pool) + offset;
        const float scale = scales[row];
        for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(src[d]) * scale;
        return buffer;
      }
      default: {  // U8: fp8 e4m3fn bits
        const uint8_t* src = static_cast<const uint8_t*>(pool) + offset;
        const float* table = Fp8Table();
        const float scale = scales[row];
        for (int64_t d = 0; d < head_dim; ++d) buffer[d] = table[src[d]] * scale;
        return buffer;
      }
    }
  }
};

struct Problem {
  const float* q;
  RowReader k, v;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  float* out;
  int64_t layer, num_blocks, block_size, num_kv_heads, head_dim, num_heads, max_blocks, sliding_window;
};

// Keys are attended in chunks of kChunkBlocks pool blocks counted from
// position 0: each chunk of a row gets its own softmax maximum and sum (a
// partial, below) and MergeChunks adds a row's chunks up in order. So the
// chunks of one long context can be tasks of their own, spread over the
// cores, and a row's output is the same arithmetic whichever tasks computed
// its chunks: it never depends on the batch around it. One task per KV
// head instead, each reading its head's rows of every block, strided, took
// 30 layers over 1,024 / 4,096 tokens 3.6 / 14.0 ms (13 GB/s) at one
// sequence, against 1.9 / 7.9 ms in chunks.
constexpr int64_t kChunkBlocks = 16;

// One row's attention over one chunk: the maximum and the sum of
// exp(score - maximum) over the keys it sees there, then the values weighted
// by those exps (head_dim floats); maximum -inf and sum 0 where it sees none.
inline int64_t PartialFloats(int64_t head_dim) { return head_dim + 2; }

// A row's output from its chunks' partials (num_chunks of them, in chunk
// order): sum_c exp(max_c - M) values_c / sum_c exp(max_c - M) sum_c, M the
// largest maximum; zeros where the row sees no key.
void MergeChunks(const float* partials, int64_t num_chunks, int64_t head_dim, float* out) {
  const int64_t stride = PartialFloats(head_dim);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < num_chunks; ++c)
    if (partials[c * stride + 1] > 0.0f) top = std::max(top, partials[c * stride]);
  std::fill_n(out, head_dim, 0.0f);
  float total = 0.0f;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float* part = partials + c * stride;
    if (part[1] <= 0.0f) continue;
    const float weight = std::exp(part[0] - top);
    total += weight * part[1];
    for (int64_t d = 0; d < head_dim; ++d) out[d] += weight * part[2 + d];
  }
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) out[d] *= inverse;
}

// One task's query rows: rows [begin, end) of sequence seq's q_len rows
// (flattened row query_start[seq] + i of q and out is at position
// context_len - q_len + i), for KV heads [head_begin, head_end), over key
// chunks [chunk_begin, chunk_end). A task with every chunk its rows see
// writes their output; one sharing its run of rows with other tasks (split
// over chunks) writes its partials into `partials`, the run's
// [KV heads x rows per head x run_chunks] buffer, merged once all have run.
struct Rows {
  int64_t seq, begin, end, head_begin, head_end, chunk_begin, chunk_end;
  float* partials = nullptr;
  int64_t run_chunks = 0;

  // This task's share of chunk c alone, or of KV head h alone.
  Rows Chunk(int64_t c) const {
    Rows part = *this;
    part.chunk_begin = c, part.chunk_end = c + 1;
    return part;
  }
  Rows Head(int64_t h) const {
    Rows part = *this;
    part.head_begin = h, part.head_end = h + 1;
    return part;
  }
};

// A task's rows are numbered (h * rows + r) * group + g: its query row r
// for query head (head_begin + h) * group + g. Where row `row` of task t
// lies in q and in out.
inline int64_t RowOffset(const Problem& p, const Rows& t, int64_t row) {
  const int64_t group = p.num_heads / p.num_kv_heads, rows_per_head = (t.end - t.begin) * group;
  const int64_t h = row / rows_per_head, r = row % rows_per_head / group, g = row % group;
  return ((p.query_start[t.seq] + t.begin + r) * p.num_heads + (t.head_begin + h) * group + g) * p.head_dim;
}

// Keys [0, KeyEnd) are the ones rows [begin, end) of seq see: up to the last
// row's position.
inline int64_t KeyEnd(const Problem& p, int64_t seq, int64_t end) {
  const int64_t context_len = p.context_lens[seq];
  return std::min<int64_t>(context_len, context_len - (p.query_start[seq + 1] - p.query_start[seq]) + end);
}

// Blocks a pass asks for ahead of the one it reads (see BlockPrefetch).
constexpr int64_t kPrefetchBlocks = 1;

// The pool blocks (all their tokens and KV heads) a pass asks to be brought
// into L2 while it reads one block: the reader's block kPrefetchBlocks
// ahead, and a companion's block at the same position (the values', while
// the keys are scored, so that the values pass finds them in L2). Blocks may
// lie anywhere in the pool, and the hardware prefetcher only follows
// sequential streams. The first version asked for the next block into L1;
// into L2, two ahead, with the values' block while the keys are scored took
// the default model's attention at batch 32 (one thread, 30 layers, 140
// tokens of context in scattered blocks, /tmp harness) from 33.7 to 19.7 ms
// (BENCHMARKS.md, "CPU: the native paged-attention kernel"). The blocks are asked for in parts,
// one per KV head of the block's work (Part): all 384 lines of both blocks at
// once held the core until the memory system had taken them. Spread between
// the heads' computations, one block ahead instead of two, decode attention
// of 64 sequences of ~156 tokens (30 layers, two cores, /tmp harness) went
// from 23.6 to 20.5 ms, of 32 and 8 sequences 12.0 -> 10.4 and 3.2 -> 2.7 ms
// (two blocks ahead: 21.4 ms at 64; asking for the next task's first block
// too: no change).
struct BlockPrefetch {
  const char* ahead;      // the reader's block kPrefetchBlocks ahead, or null past the end
  const char* companion;  // or null
  int64_t bytes;          // of one block

  // Slice k of n of both blocks. Always inlined: g++ 12 judged an outlined
  // Part free of side effects (a prefetch counts as none) and dropped every
  // call to it.
  __attribute__((always_inline)) void Part(int64_t k, int64_t n) const {
    const int64_t lines = bytes / 64, begin = 64 * (lines * k / n), end = 64 * (lines * (k + 1) / n);
    // One block's lines, then the other's (alternating between the two
    // blocks line by line measured 4% slower).
    if (ahead != nullptr)
      for (int64_t b = begin; b < end; b += 64) __builtin_prefetch(ahead + b, 0, 2);
    if (companion != nullptr)
      for (int64_t b = begin; b < end; b += 64) __builtin_prefetch(companion + b, 0, 2);
  }
  void All() const { Part(0, 1); }
};

// Calls visit(start, count, first_row, prefetch) for each block of positions
// [begin, end) of sequence `seq` (begin a multiple of the block size):
// positions [start, start + count), whose rows for KV head `kv_head` are
// first_row + t * num_kv_heads (the heads of a token side by side); the visit
// asks for `prefetch` (BlockPrefetch) while it works, whole or in parts. The
// reader's first blocks are asked for here.
template <typename Visit>
inline void ForEachBlock(const Problem& p, const RowReader& reader, int64_t seq, int64_t kv_head, int64_t begin,
                         int64_t end, Visit visit, const RowReader* companion = nullptr) {
  const int32_t* table = p.block_tables + seq * p.max_blocks + begin / p.block_size;
  const int64_t block_rows = p.block_size * p.num_kv_heads;
  const int64_t layer_row = p.layer * p.num_blocks * block_rows;
  const int64_t num_blocks = (end - begin + p.block_size - 1) / p.block_size;
  auto block_bytes = [&](const RowReader& r, int64_t block) {
    return static_cast<const char*>(r.pool) + (layer_row + block * block_rows) * r.row_bytes;
  };
  const int64_t bytes = block_rows * reader.row_bytes;
  for (int64_t j = 1; j < std::min(kPrefetchBlocks, num_blocks); ++j)
    BlockPrefetch{block_bytes(reader, table[j]), nullptr, bytes}.All();
  for (int64_t j = 0; j < num_blocks; ++j) {
    const BlockPrefetch prefetch{j + kPrefetchBlocks < num_blocks ? block_bytes(reader, table[j + kPrefetchBlocks])
                                                                  : nullptr,
                                 companion != nullptr ? block_bytes(*companion, table[j]) : nullptr, bytes};
    const int64_t start = begin + j * p.block_size;
    visit(start, std::min(p.block_size, end - start), layer_row + table[j] * block_rows + kv_head, prefetch);
  }
}

// Calls visit(position, pool_row) for positions [begin, end), a block at a
// time (no division per token).
template <typename Visit>
inline void ForEachKey(const Problem& p, const RowReader& reader, int64_t seq, int64_t kv_head, int64_t begin,
                       int64_t end, Visit visit, const RowReader* companion = nullptr) {
  ForEachBlock(p, reader, seq, kv_head, begin, end, [&](int64_t start, int64_t count, int64_t first_row,
                                                        const BlockPrefetch& prefetch) {
    prefetch.All();
    for (int64_t t = 0; t < count; ++t) visit(start + t, first_row + t * p.num_kv_heads);
  }, companion);
}

#if JAXINFER_VEC16
// The float32 pool's inner loops with a head dimension known at compile time,
// for a block of tokens and kRows query rows of one KV head: the rows' queries
// (ScoreRows) or output sums (AccumulateRows) stay in registers across the
// block's tokens, and each key or value row is loaded once for all of them.
// The loops over single keys (AttendRows' general path) reloaded the
// query for every dot and loaded and stored the sums for every value: the
// default model's shapes (3 KV heads of 3 query heads, head dim 64) over 140
// tokens x 30 layers, 32 / 8 / 1 sequences, took 15.8 / 4.3 / 0.44 ms there
// and take 12.4 / 3.0 / 0.29 ms here (the softmax's exp is 1.8 ms of the 12.4).
// 16 vectors of queries or sums on AVX-512; AVX2's 16 registers hold one row of 4 vectors (head dim 64).
template <int64_t kHeadDim>
constexpr int kRowsInRegisters = vec::kVecRegisters < 32 ? 1 : kHeadDim <= 64 ? 4 : 2;

template <int64_t kHeadDim, int kRows>
void ScoreRows(const float* keys, int64_t key_stride, int64_t count, const float* queries, float* scores,
               int64_t score_stride) {
  constexpr int kVectors = kHeadDim / 16;
  vec::F q[kRows][kVectors];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v) q[r][v] = vec::LoadUnaligned(queries + r * kHeadDim + 16 * v);
  for (int64_t t = 0; t < count; ++t) {
    vec::F key[kVectors];
    for (int v = 0; v < kVectors; ++v) key[v] = vec::LoadUnaligned(keys + t * key_stride + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      vec::F dot = vec::Mul(q[r][0], key[0]);
      for (int v = 1; v < kVectors; ++v) dot = vec::MulAdd(q[r][v], key[v], dot);
      scores[r * score_stride + t] = vec::Sum(dot);
    }
  }
}

template <int64_t kHeadDim, int kRows>
void AccumulateRows(const float* values, int64_t value_stride, int64_t count, const float* weights,
                    int64_t weight_stride, float* sums) {
  constexpr int kVectors = kHeadDim / 16;
  vec::F acc[kRows][kVectors];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = vec::LoadUnaligned(sums + r * kHeadDim + 16 * v);
  for (int64_t t = 0; t < count; ++t) {
    vec::F value[kVectors];
    for (int v = 0; v < kVectors; ++v) value[v] = vec::LoadUnaligned(values + t * value_stride + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      const vec::F weight = vec::Set(weights[r * weight_stride + t]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = vec::MulAdd(weight, value[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v) vec::StoreUnaligned(sums + r * kHeadDim + 16 * v, acc[r][v]);
}

// Calls body(std::integral_constant<int, n>, row) for rows [begin, end) in
// runs of n = kRowsInRegisters rows (the last run shorter).
template <int64_t kHeadDim, typename Body>
void ForEachRowRun(int64_t begin, int64_t end, Body body) {
  constexpr int kRun = kRowsInRegisters<kHeadDim>;
  int64_t row = begin;
  for (; row + kRun <= end; row += kRun) body(std::integral_constant<int, kRun>{}, row);
  switch (end - row) {
    case 1: body(std::integral_constant<int, 1>{}, row); break;
    case 2: if constexpr (kRun > 2) body(std::integral_constant<int, 2>{}, row); break;
    case 3: if constexpr (kRun > 3) body(std::integral_constant<int, 3>{}, row); break;
    default: break;
  }
}
#endif  // JAXINFER_VEC16

// The scores pass (kScores: scores[row, pos - key_begin] = queries[row] .
// key[pos]) or the values pass (sums[row] += scores[row, pos - key_begin] *
// value[pos]) over keys [key_begin, key_end) of a float32 pool with the
// register loops above; false, doing nothing, where they do not apply
// (another pool type, a head dimension not compiled in, no vec16.h build):
// the caller's general loop runs instead.
template <int64_t kHeadDim, bool kScores>
bool FloatPoolPass(const Problem& p, int64_t seq, int64_t head_begin, int64_t num_heads, int64_t rows_per_head,
                   int64_t key_begin, int64_t key_end, float* rows, float* scores) {
#if JAXINFER_VEC16
  if constexpr (kHeadDim > 0) {
    const RowReader& reader = kScores ? p.k : p.v;
    if (reader.dtype != ffi::DataType::F32) return false;
    const float* pool = static_cast<const float*>(reader.pool);
    const int64_t stride = p.num_kv_heads * kHeadDim;  // one token to the next, same head
    const int64_t num_keys = key_end - key_begin;
    ForEachBlock(p, reader, seq, head_begin, key_begin, key_end, [&](int64_t start, int64_t count,
                                                                     int64_t first_row, const BlockPrefetch& prefetch) {
      for (int64_t h = 0; h < num_heads; ++h) {
        prefetch.Part(h, num_heads);
        const float* pool_rows = pool + (first_row + h) * kHeadDim;
        ForEachRowRun<kHeadDim>(h * rows_per_head, (h + 1) * rows_per_head, [&](auto run, int64_t row) {
          constexpr int kRows = decltype(run)::value;
          float* row_scores = scores + row * num_keys + (start - key_begin);
          if constexpr (kScores) {
            ScoreRows<kHeadDim, kRows>(pool_rows, stride, count, rows + row * kHeadDim, row_scores, num_keys);
          } else {
            AccumulateRows<kHeadDim, kRows>(pool_rows, stride, count, row_scores, num_keys, rows + row * kHeadDim);
          }
        });
      }
    }, kScores ? &p.v : nullptr);
    return true;
  }
#endif
  return false;
}

#if JAXINFER_VEC16
// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, so
// r is exact), exp(r) by its Taylor series to r^7 (truncation below 1e-8
// relative), then times 2^n (vec16's ScaleByPowerOf2), which gives 0 for n
// below the float range. Inputs under -104 (exp is below the smallest float
// there) are clamped first; NaN stays NaN. Within 0.91 float ulps of exp
// over [-87, 0], the softmax's range (every 7th float, against double exp,
// /tmp program, AVX-512). A libm expf call per visible key was 45% of the
// kernel's time in the harness above with the blocks in cache (12.96 -> 7.23 ms).
inline vec::F Exp16(vec::F x) {
  x = vec::Max(vec::Set(-104.0f), x);  // NaN in x: Max returns x
  const vec::F n = vec::RoundNearest(vec::Mul(x, vec::Set(1.44269504088896341f)));
  vec::F r = vec::NegMulAdd(n, vec::Set(0.693145751953125f), x);
  r = vec::NegMulAdd(n, vec::Set(1.428606765330187e-06f), r);
  vec::F poly = vec::Set(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    poly = vec::MulAdd(poly, r, vec::Set(c));
  return vec::ScaleByPowerOf2(poly, n);
}
#endif

// The softmax weights of one row's scores s[0, num_keys), in place: keys
// [first, last) are visible, the others get weight 0. The weights are
// exp(score - maximum), unnormalized; returns {maximum, sum of the weights}
// ({-inf, 0} for a row that sees nothing).
struct Softmax {
  float max, sum;
};
Softmax SoftmaxWeights(float* s, int64_t num_keys, int64_t first, int64_t last) {
#if JAXINFER_VEC16
  vec::F max16 = vec::Set(-std::numeric_limits<float>::infinity());
  for (int64_t pos = first - first % 16; pos < last; pos += 16) {
    const vec::M visible = vec::LanesIn(pos, first, last);
    max16 = vec::MaxMasked(max16, visible, vec::LoadMasked(visible, s + pos));
  }
  const float max_score = vec::MaxOf(max16);
  const vec::F max_scores = vec::Set(max_score);
  vec::F sum16 = vec::Zero();
  for (int64_t pos = 0; pos < num_keys; pos += 16) {
    const vec::M in_row = vec::LanesIn(pos, 0, num_keys);
    const vec::F weights = vec::Masked(vec::LanesIn(pos, first, last),
                                       Exp16(vec::Sub(vec::LoadMasked(in_row, s + pos), max_scores)));
    vec::StoreMasked(s + pos, in_row, weights);
    sum16 = vec::Add(sum16, weights);
  }
  const float sum = vec::Sum(sum16);
#else
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t pos = first; pos < last; ++pos) max_score = std::max(max_score, s[pos]);
  float sum = 0.0f;
  for (int64_t pos = 0; pos < num_keys; ++pos) {
    s[pos] = pos >= first && pos < last ? std::exp(s[pos] - max_score) : 0.0f;
    sum += s[pos];
  }
#endif
  return {max_score, sum};
}

// Attention of one task's query rows (Rows), chunk by chunk. Keys are
// visited token by token with the heads of a token side by side, so the pool
// is read as the contiguous run it is (a block's tokens are consecutive):
// reading one head's rows alone, strided, ran at ~5 GB/s. Only the keys up
// to the last row's position are read, so a prompt's early rows skip the
// keys after them. kHeadDim > 0 fixes head_dim at compile time (the common
// 64 and 128: the inner loops then unroll completely); 0 reads it from the
// problem.
template <int64_t kHeadDim>
void AttendRows(const Problem& p, const Rows& task, std::vector<float>& scratch) {
  const int64_t group = p.num_heads / p.num_kv_heads, head_dim = kHeadDim > 0 ? kHeadDim : p.head_dim;
  const int64_t seq = task.seq, head_begin = task.head_begin, num_heads = task.head_end - task.head_begin;
  const int64_t q_len = p.query_start[seq + 1] - p.query_start[seq];
  const int64_t rows_per_head = (task.end - task.begin) * group;
  const int64_t num_rows = num_heads * rows_per_head;
  const int64_t first_pos = p.context_lens[seq] - q_len + task.begin;  // the position of the task's first row
  const int64_t key_end = KeyEnd(p, seq, task.end);
  if (key_end <= 0) {
    for (int64_t row = 0; row < num_rows; ++row) std::fill_n(p.out + RowOffset(p, task, row), head_dim, 0.0f);
    return;
  }
  const int64_t chunk_keys = kChunkBlocks * p.block_size, num_chunks = task.chunk_end - task.chunk_begin;
  const int64_t stride = PartialFloats(head_dim);
  // scratch: the queries (pre-scaled), the values' sums, one chunk's scores,
  // then each row's partials [num_chunks] (unless the run's buffer takes them).
  const int64_t chunk_scores = std::min(chunk_keys, key_end);
  scratch.resize(num_rows * (2 * head_dim + chunk_scores + (task.partials ? 0 : num_chunks * stride)));
  float* queries = scratch.data();
  float* sums = queries + num_rows * head_dim;
  float* scores = sums + num_rows * head_dim;
  float* own_partials = scores + num_rows * chunk_scores;
  auto partial = [&](int64_t row, int64_t chunk) {  // chunk counts from 0 at the task's first
    if (task.partials == nullptr) return own_partials + (row * num_chunks + chunk) * stride;
    const int64_t run_row = head_begin * rows_per_head + row;  // the run's rows, all its KV heads
    return task.partials + (run_row * task.run_chunks + task.chunk_begin + chunk) * stride;
  };
  const float softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<int64_t> first(num_rows), last(num_rows);  // a row sees keys [first, last)
  for (int64_t row = 0; row < num_rows; ++row) {
    const float* q = p.q + RowOffset(p, task, row);
    for (int64_t d = 0; d < head_dim; ++d) queries[row * head_dim + d] = q[d] * softmax_scale;
    const int64_t query_pos = first_pos + row % rows_per_head / group;
    first[row] = p.sliding_window > 0 ? std::max<int64_t>(0, query_pos - p.sliding_window + 1) : 0;
    last[row] = std::max(first[row], std::min<int64_t>(key_end, query_pos + 1));
  }
  float buffer[kMaxHeadDim];
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t key_begin = (task.chunk_begin + chunk) * chunk_keys;
    const int64_t chunk_end = std::min(key_end, key_begin + chunk_keys), count = chunk_end - key_begin;
    if (!FloatPoolPass<kHeadDim, true>(p, seq, head_begin, num_heads, rows_per_head, key_begin, chunk_end, queries,
                                       scores)) {
      ForEachKey(p, p.k, seq, head_begin, key_begin, chunk_end, [&](int64_t pos, int64_t pool_row) {
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* key = p.k.Read(pool_row + h, head_dim, buffer);
          for (int64_t row = h * rows_per_head; row < (h + 1) * rows_per_head; ++row) {
            const float* q = queries + row * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * key[d];
            scores[row * count + pos - key_begin] = dot;
          }
        }
      }, &p.v);
    }
    for (int64_t row = 0; row < num_rows; ++row) {
      const int64_t seen_first = std::clamp(first[row] - key_begin, int64_t{0}, count);
      const int64_t seen_last = std::clamp(last[row] - key_begin, seen_first, count);
      const Softmax softmax = SoftmaxWeights(scores + row * count, count, seen_first, seen_last);
      partial(row, chunk)[0] = softmax.max;
      partial(row, chunk)[1] = softmax.sum;
    }
    std::fill_n(sums, num_rows * head_dim, 0.0f);
    if (!FloatPoolPass<kHeadDim, false>(p, seq, head_begin, num_heads, rows_per_head, key_begin, chunk_end, sums,
                                        scores)) {
      ForEachKey(p, p.v, seq, head_begin, key_begin, chunk_end, [&](int64_t pos, int64_t pool_row) {
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* value = p.v.Read(pool_row + h, head_dim, buffer);
          for (int64_t row = h * rows_per_head; row < (h + 1) * rows_per_head; ++row) {
            const float weight = scores[row * count + pos - key_begin];
            float* o = sums + row * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * value[d];
          }
        }
      });
    }
    for (int64_t row = 0; row < num_rows; ++row) std::copy_n(sums + row * head_dim, head_dim, partial(row, chunk) + 2);
  }
  if (task.partials == nullptr) {
    for (int64_t row = 0; row < num_rows; ++row)
      MergeChunks(partial(row, 0), num_chunks, head_dim, p.out + RowOffset(p, task, row));
  }
}

// A task's rows, with a scratch buffer kept per thread.
void AttendTask(const Problem& p, const Rows& task) {
  thread_local std::vector<float> scratch;
  if (p.head_dim == 64) {
    AttendRows<64>(p, task, scratch);
  } else if (p.head_dim == 128) {
    AttendRows<128>(p, task, scratch);
  } else {
    AttendRows<0>(p, task, scratch);
  }
}

// Query positions per task: a prompt's rows are cut into runs of up to this
// many, each its own task (the keys come from L2 for every run after the
// first), and fewer where a run's rows x query heads x keys would pass
// kScoreFloats: its partials (a row's chunks x head_dim + 2) live in a buffer
// kept per thread, and a long context of a large model (32 query heads,
// 8,192 keys) would otherwise hold tens of MB per thread.
constexpr int64_t kTaskPositions = 32;
constexpr int64_t kScoreFloats = int64_t{1} << 20;

ffi::Error PagedAttentionImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                              ffi::AnyBuffer v_pool, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> query_start,
                              ffi::ResultBuffer<ffi::F32> out, int64_t sliding_window) {
  const auto q_dims = q.dimensions();
  const auto pool_dims = k_pool.dimensions();
  if (q_dims.size() != 3 || pool_dims.size() != 5 || block_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be 3-D, pools 5-D, block tables 2-D");
  }
  const int64_t num_seqs = context_lens.element_count(), num_tokens = q_dims[0];
  if (query_start.element_count() != num_seqs + 1 || block_tables.dimensions()[0] != num_seqs) {
    return ffi::Error::InvalidArgument("paged attention: query_start must have one entry per sequence, plus one");
  }
  const ffi::DataType dtype = k_pool.element_type();
  if (v_pool.element_type() != dtype ||
      (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16 && dtype != ffi::DataType::S8 &&
       dtype != ffi::DataType::U8)) {
    return ffi::Error::InvalidArgument("paged attention: pools must both be f32, bf16, int8 or fp8 bits");
  }
  const bool quantized = dtype == ffi::DataType::S8 || dtype == ffi::DataType::U8;
  Problem p;
  p.q = q.typed_data();
  const int64_t row_bytes = pool_dims[4] * static_cast<int64_t>(ffi::ByteWidth(dtype));
  p.k = {dtype, k_pool.untyped_data(), quantized ? k_scales.typed_data() : nullptr, row_bytes};
  p.v = {dtype, v_pool.untyped_data(), quantized ? v_scales.typed_data() : nullptr, row_bytes};
  p.block_tables = block_tables.typed_data();
  p.context_lens = context_lens.typed_data();
  p.query_start = query_start.typed_data();
  p.out = out->typed_data();
  p.layer = layer.typed_data()[0];
  p.num_blocks = pool_dims[1];
  p.block_size = pool_dims[2];
  p.num_kv_heads = pool_dims[3];
  p.head_dim = pool_dims[4];
  p.num_heads = q_dims[1];
  p.max_blocks = block_tables.dimensions()[1];
  p.sliding_window = sliding_window;
  if (q_dims[2] != p.head_dim || p.head_dim > kMaxHeadDim || p.num_heads % p.num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged attention: q's heads / head_dim do not match the pools");
  }
  // Sequences' rows must be contiguous, in order, inside q; rows after the
  // last sequence's are padding and get zeros.
  for (int64_t s = 0; s <= num_seqs; ++s) {
    if (p.query_start[s] < 0 || p.query_start[s] > num_tokens || (s > 0 && p.query_start[s] < p.query_start[s - 1])) {
      return ffi::Error::InvalidArgument("paged attention: query_start must not fall and must stay within q's rows");
    }
  }
  const int64_t padding_row = num_seqs > 0 ? p.query_start[num_seqs] : 0;
  std::fill(p.out + padding_row * p.num_heads * p.head_dim, p.out + num_tokens * p.num_heads * p.head_dim, 0.0f);
  const int64_t chunk_keys = kChunkBlocks * p.block_size, workers = jaxinfer::NumWorkers(thread_pool);
  std::vector<Rows> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = p.query_start[s + 1] - p.query_start[s];
    const int64_t positions = std::clamp<int64_t>(
        kScoreFloats / (p.num_heads * std::max<int64_t>(1, p.context_lens[s])), 1, kTaskPositions);
    for (int64_t begin = 0; begin < q_len; begin += positions) {
      const int64_t end = std::min(q_len, begin + positions);
      tasks.push_back({s, begin, end, 0, p.num_kv_heads, 0, (KeyEnd(p, s, end) + chunk_keys - 1) / chunk_keys});
    }
  }
  // Too few runs of rows to keep the cores busy (decode at a few sequences):
  // each run's chunks become tasks of their own, their partials merged below.
  auto run_floats = [&p](const Rows& t) {  // a run's partials: its rows of every query head x its chunks
    return (t.end - t.begin) * p.num_heads * t.chunk_end * PartialFloats(p.head_dim);
  };
  std::vector<float> run_partials;
  std::vector<Rows> split_runs;
  if (static_cast<int64_t>(tasks.size()) < 4 * workers) {
    int64_t floats = 0;
    for (const Rows& t : tasks)
      if (t.chunk_end > 1) floats += run_floats(t);
    run_partials.resize(floats);
    std::vector<Rows> chunked;
    float* next = run_partials.data();
    for (Rows t : tasks) {
      if (t.chunk_end <= 1) {
        chunked.push_back(t);
        continue;
      }
      t.partials = next;
      t.run_chunks = t.chunk_end;
      next += run_floats(t);
      split_runs.push_back(t);
      for (int64_t c = 0; c < t.run_chunks; ++c) chunked.push_back(t.Chunk(c));
    }
    tasks.swap(chunked);
  }
  // Fewer tasks than two per core still (a short context at one or two
  // sequences): one per KV head too, each reading its head's rows of the
  // blocks, strided. Where there are more, a task keeps its heads together
  // and reads its blocks once: with the old rule (< 4 per core) decode of 4
  // and 6 sequences of 160 tokens took 2.12 and 2.85 ms over 30 layers
  // (/tmp harness), with this one 1.48 and 2.04.
  if (static_cast<int64_t>(tasks.size()) < 2 * workers) {
    std::vector<Rows> per_head;
    for (const Rows& t : tasks)
      for (int64_t h = 0; h < p.num_kv_heads; ++h) per_head.push_back(t.Head(h));
    tasks.swap(per_head);
  }
  // The tasks that read the most keys first, so that the last ones to finish
  // are short: each core's share longest first (LongestFirstOrder).
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Rows& a, const Rows& b) {
    auto keys = [&](const Rows& t) {
      return std::min(KeyEnd(p, t.seq, t.end), t.chunk_end * chunk_keys) - t.chunk_begin * chunk_keys;
    };
    return keys(a) > keys(b);
  });
  std::vector<Rows> sorted;
  sorted.swap(tasks);
  tasks.resize(sorted.size());
  const std::vector<int64_t> order = jaxinfer::LongestFirstOrder(sorted.size(), workers);
  for (size_t k = 0; k < sorted.size(); ++k) tasks[order[k]] = sorted[k];
  jaxinfer::ParallelFor(thread_pool, static_cast<int64_t>(tasks.size()),
                        [&p, &tasks](int64_t i) { AttendTask(p, tasks[i]); });
  // The split runs' rows (every KV head's, numbered as RowOffset), from their
  // chunks' partials.
  for (const Rows& run : split_runs) {
    for (int64_t row = 0; row < (run.end - run.begin) * p.num_heads; ++row) {
      MergeChunks(run.partials + row * run.run_chunks * PartialFloats(p.head_dim), run.run_chunks, p.head_dim,
                  p.out + RowOffset(p, run, row));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pool
                                  .Arg<ffi::AnyBuffer>()         // v_pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("sliding_window"));
