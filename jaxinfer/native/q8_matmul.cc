// Matmul of float32 activations by grouped int8 / int4 weights, with the
// activations quantized to int8 on the fly in blocks of 32 inputs (the way
// llama.cpp multiplies its Q4/Q8 blocks by Q8 activations), for XLA:CPU
// through the XLA FFI (native/matmul.py builds and registers it).
//
// Why: past a few rows a float32 matmul is compute-bound on the dev VM's two
// cores (16 multiply-adds per AVX-512 FMA). An int8 x uint8 dot (AVX512-VNNI
// vpdpbusd) does 64 per instruction and needs no float copy of the weight,
// so the whole step runs on the codes as stored. Needs AVX512-VNNI at build
// time; elsewhere the build fails on purpose and quant/linear.py runs the
// same numbers in XLA.
//
// Arguments as matmul.cc (data [L, in(/2), out] int8 or packed uint8
// int4, scales / offsets [L, in / group, out], layer), plus out % 64 == 0,
// and scales and offsets may be float16 (quant/params.py stores a GGUF's own
// float16 d and m so: half the bytes, the same values).
// With `block` (16 or 32, quant/schemes.py activation_block) inputs per
// activation block a:
//
//   d[r, a]  = max |x[r, a's inputs]| / 127 (1 where all are 0)
//   xq[r, i] = round(x[r, i] / d[r, a]) in [-127, 127]      (quant/schemes.py, absmax_int8)
//   y[r, o]  = sum_a  scale[g, o] * d[r, a] * (sum_{i in a} q[i, o] * xq[r, i])
//                   + offset[g, o] * d[r, a] * (sum_{i in a} xq[r, i]),        g = a's weight group
//
// i.e. exactly x' @ dequantized(w) for x' = xq * d, up to float rounding
// order: the integer sums are exact. quant/linear.py's XLA path computes
// that x' and multiplies it in float, the reference the tests hold this to.
//
// Layout trick: vpdpbusd multiplies 4 adjacent bytes of each 32-bit lane
// and adds them into the lane. Four weight rows of 64 columns, transposed
// byte-wise in registers (unpack 8 then 16 bit), give 4 vectors whose lanes
// each hold 4 consecutive input rows of one column, so one instruction
// advances 16 columns by 4 inputs against an activation dword broadcast to
// every lane, and the sums never need a horizontal add. The transposition
// leaves column 16 * l + 4 * k + i in lane 4 * l + i of vector k (l the
// 128-bit lane); scales and results go through the matching 4 x 4 shuffle
// of 128-bit lanes (Transpose4x4Lanes), which is its own inverse.
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#error "the Q8-activation matmul needs AVX512-VNNI (-march=native on a CPU without it); XLA runs it instead"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "jaxinfer/native/kquant_layer.h"
#include "jaxinfer/native/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColumns = 64;     // output columns of a tile: 4 vectors of 16
constexpr int64_t kRowBlock = 16;    // rows per column task, sharing the weights' transposition
// Few rows of a weight whose byte rows span a page or more (the head: 49,152
// bytes): tasks walk the input blocks' rows front to back (BlockRangeTask),
// kBlockRanges ranges of blocks, whose partial sums add up at the end, times
// kColumnParts parts of the columns. Measured on the default model's head
// (Q8_0, float16 scales): column tiles alone 1.85 ms at one row; 4 block
// ranges 1.28 ms at one row, 4.4 ms at eight (a partial of 8 rows spans
// 1.5 MB, past the L2); 2 ranges x 8 parts 1.07-1.11 ms and 2.4 ms (16 tasks
// also share better with a helper thread that starts late). The model's
// 1,536-byte-wide layer weights ran 2x slower split by blocks than by tiles.
constexpr int64_t kFewRows = 8;
constexpr int64_t kPageBytes = 4096;
constexpr int64_t kBlockRanges = 2;
constexpr int64_t kColumnParts = 8;
// ColumnTask prefetches the weights of the block this far ahead (Prefetch):
// the default model's seven projections x 30 layers (100 MB with scales and
// offsets, more than the L3), 4 rows 6.8-8.0 -> 4.8 ms with the codes
// prefetched; one row 6.0 -> 4.5 ms with the scales and offsets too.
constexpr int64_t kPrefetchBlocks = 4;

struct Problem {
  const uint8_t* data;  // this layer's codes
  const void* scales;   // this layer's [groups, out], float32 or (half) float16
  const void* offsets;  // the same, or null: none
  bool half;
  float* out;
  bool int4;
  int64_t rows, in, out_features, group, block;
  // The quantized activations: codes [rows, in] (int4: each 8 inputs stored
  // as the 4 even ones then the 4 odd ones, the order of the weight's low and
  // high nibbles), and per row and block d, d * sum(xq) and sum(xq).
  std::vector<int8_t> codes;
  std::vector<float> x_scales, x_sums;
  std::vector<int32_t> code_sums;
};

// The few-row path's partial sums, kept per calling thread across calls: a
// fresh allocation each call would be mapped and zeroed by the kernel.
std::vector<float>& PartialsBuffer() {
  static thread_local std::vector<float> buffer;
  return buffer;
}

void QuantizeActivations(const float* x, Problem& p) {
  const int64_t blocks = p.in / p.block;
  p.codes.resize(p.rows * p.in);
  p.x_scales.resize(p.rows * blocks);
  p.x_sums.resize(p.rows * blocks);
  p.code_sums.resize(p.rows * blocks);
  // int4: within each 8 inputs, the even ones first (the weight's low nibbles).
  const __m128i nibble_order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m512 lowest = _mm512_set1_ps(-127.0f), highest = _mm512_set1_ps(127.0f);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t a = 0; a < blocks; ++a) {
      const float* xs = x + r * p.in + a * p.block;
      const int64_t vectors = p.block / 16;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t v = 0; v < vectors; ++v) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xs + 16 * v)));
      float d = _mm512_reduce_max_ps(amax) / 127.0f;
      if (!(d > 0.0f)) d = 1.0f;
      int8_t* codes = p.codes.data() + r * p.in + a * p.block;
      __m512i sum = _mm512_setzero_si512();
      for (int64_t v = 0; v < vectors; ++v) {
        // x / d rounded half to even, as jnp.round(x / scale) does.
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xs + 16 * v), _mm512_set1_ps(d)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lowest), highest));
        sum = _mm512_add_epi32(sum, qi);
        __m128i bytes = _mm512_cvtepi32_epi8(qi);
        if (p.int4) bytes = _mm_shuffle_epi8(bytes, nibble_order);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * v), bytes);
      }
      const int32_t code_sum = _mm512_reduce_add_epi32(sum);
      p.x_scales[r * blocks + a] = d;
      p.x_sums[r * blocks + a] = d * static_cast<float>(code_sum);
      p.code_sums[r * blocks + a] = code_sum;
    }
  }
}

// Vectors v[0..3] as a 4 x 4 matrix of 128-bit lanes, transposed.
template <typename V, typename Shuffle>
void Transpose4x4Lanes(V v[4], Shuffle shuffle) {
  const V u0 = shuffle(v[0], v[1], 0x44), u1 = shuffle(v[0], v[1], 0xEE);
  const V u2 = shuffle(v[2], v[3], 0x44), u3 = shuffle(v[2], v[3], 0xEE);
  v[0] = shuffle(u0, u2, 0x88);
  v[1] = shuffle(u0, u2, 0xDD);
  v[2] = shuffle(u1, u3, 0x88);
  v[3] = shuffle(u1, u3, 0xDD);
}

void TransposeLanes(__m512 v[4]) {
  Transpose4x4Lanes(v, [](__m512 a, __m512 b, int imm) {
    switch (imm) {  // the immediate must be a constant
      case 0x44: return _mm512_shuffle_f32x4(a, b, 0x44);
      case 0xEE: return _mm512_shuffle_f32x4(a, b, 0xEE);
      case 0x88: return _mm512_shuffle_f32x4(a, b, 0x88);
      default: return _mm512_shuffle_f32x4(a, b, 0xDD);
    }
  });
}

// Four weight rows of 64 byte columns -> t[k]: lane 4 * l + i holds the
// rows' 4 bytes of column 16 * l + 4 * k + i.
void TransposeRows(const uint8_t* row, int64_t stride, __m512i t[4]) {
  const __m512i r0 = _mm512_loadu_si512(row), r1 = _mm512_loadu_si512(row + stride);
  const __m512i r2 = _mm512_loadu_si512(row + 2 * stride), r3 = _mm512_loadu_si512(row + 3 * stride);
  const __m512i a0 = _mm512_unpacklo_epi8(r0, r1), a1 = _mm512_unpackhi_epi8(r0, r1);
  const __m512i b0 = _mm512_unpacklo_epi8(r2, r3), b1 = _mm512_unpackhi_epi8(r2, r3);
  t[0] = _mm512_unpacklo_epi16(a0, b0);
  t[1] = _mm512_unpackhi_epi16(a0, b0);
  t[2] = _mm512_unpacklo_epi16(a1, b1);
  t[3] = _mm512_unpackhi_epi16(a1, b1);
}

// The weights of one activation block and 64 columns, transposed for
// vpdpbusd. int4: per 8 inputs (4 byte rows), vector 8 * quad + 2 * k (+1)
// holds the low (high) nibbles; int8: per 4 inputs, vector 4 * quad + k
// holds the codes + 128 (vpdpbusd takes them unsigned).
template <bool kInt4>
void PrepareWeights(const uint8_t* first, int64_t stride, int64_t quads, __m512i* w) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t quad = 0; quad < quads; ++quad) {
    __m512i t[4];
    TransposeRows(first + 4 * quad * stride, stride, t);
    for (int k = 0; k < 4; ++k) {
      if constexpr (kInt4) {
        w[8 * quad + 2 * k] = _mm512_and_si512(t[k], nibble);
        w[8 * quad + 2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(t[k], 4), nibble);
      } else {
        w[4 * quad + k] = _mm512_xor_si512(t[k], sign);
      }
    }
  }
}

// Integer dots of kRows rows' block codes (x[r], as dwords) with prepared
// weights: sum[r][k] for the 64 columns. Several rows at once give the
// core independent vpdpbusd chains (its latency is several cycles).
template <bool kInt4, int kRows>
void BlockDots(const int32_t* const* x, const __m512i* w, int64_t quads, __m512i sum[][4]) {
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < 4; ++k) sum[r][k] = _mm512_setzero_si512();
  for (int64_t quad = 0; quad < quads; ++quad) {
    if constexpr (kInt4) {
      for (int r = 0; r < kRows; ++r) {
        const __m512i even = _mm512_set1_epi32(x[r][2 * quad]), odd = _mm512_set1_epi32(x[r][2 * quad + 1]);
        for (int k = 0; k < 4; ++k) {
          sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], w[8 * quad + 2 * k], even);
          sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], w[8 * quad + 2 * k + 1], odd);
        }
      }
    } else {
      for (int r = 0; r < kRows; ++r) {
        const __m512i four = _mm512_set1_epi32(x[r][quad]);
        for (int k = 0; k < 4; ++k) sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], w[4 * quad + k], four);
      }
    }
  }
}

// 16 scales (or offsets) from `base` at element `at`, as float32.
__m512 LoadScales(const Problem& p, const void* base, int64_t at) {
  if (p.half) {
    const uint16_t* half = static_cast<const uint16_t*>(base) + at;
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(base) + at);
}

// Adds activation block a's products for rows [row0, row0 + rows) into
// acc + r * stride (64 floats per row, in the tile's lane order: see the
// top), for the 64 columns whose weights are prepared in w.
template <bool kInt4>
void AccumulateBlock(const Problem& p, int64_t a, int64_t col, const __m512i* w, int64_t row0, int64_t rows,
                     float* acc, int64_t stride) {
  const int64_t blocks = p.in / p.block;
  const int64_t quads = (kInt4 ? p.block / 2 : p.block) / 4;
  const int64_t g = a * p.block / p.group;
  __m512 scale[4], offset[4];
  for (int k = 0; k < 4; ++k) {
    scale[k] = LoadScales(p, p.scales, g * p.out_features + col + 16 * k);
    offset[k] = p.offsets ? LoadScales(p, p.offsets, g * p.out_features + col + 16 * k) : _mm512_setzero_ps();
  }
  TransposeLanes(scale);
  TransposeLanes(offset);
  for (int64_t r = 0; r < rows; r += 2) {
    const int pair = r + 1 < rows ? 2 : 1;
    const int32_t* x[2];
    for (int i = 0; i < pair; ++i)
      x[i] = reinterpret_cast<const int32_t*>(p.codes.data() + (row0 + r + i) * p.in + a * p.block);
    __m512i sum[2][4];
    if (pair == 2) {
      BlockDots<kInt4, 2>(x, w, quads, sum);
    } else {
      BlockDots<kInt4, 1>(x, w, quads, sum);
    }
    for (int i = 0; i < pair; ++i) {
      const int64_t at = (row0 + r + i) * blocks + a;
      const __m512 d = _mm512_set1_ps(p.x_scales[at]), x_sum = _mm512_set1_ps(p.x_sums[at]);
      // int8 codes went in as q + 128: take 128 * sum(xq) back off.
      const __m512i bias = _mm512_set1_epi32(kInt4 ? 0 : 128 * p.code_sums[at]);
      float* out = acc + (r + i) * stride;
      for (int k = 0; k < 4; ++k) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[i][k], bias));
        __m512 v = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale[k], d), _mm512_loadu_ps(out + 16 * k));
        if (p.offsets) v = _mm512_fmadd_ps(offset[k], x_sum, v);
        _mm512_storeu_ps(out + 16 * k, v);
      }
    }
  }
}

// Asks for the cache lines ColumnTask reads for block a of the 64 columns at
// col: its codes and its group's scales and offsets (as many bytes again as
// the int4 codes, and as scattered). Always inlined: outlined, g++ 12
// judged it free of side effects (a prefetch counts as none) and dropped
// every call, unnoticed since a later change of this file; restored (stop
// 31, the default model's projections x 30 layers and head, medians of 40
// alternated calls): 8 rows 16.5 -> 14.9 ms, 32 rows 40.6 -> 38.2, one row
// unchanged.
__attribute__((always_inline)) inline void Prefetch(const Problem& p, int64_t a, int64_t col) {
  const int64_t byte_rows = p.int4 ? p.block / 2 : p.block;
  const uint8_t* codes = p.data + a * byte_rows * p.out_features + col;
  for (int64_t j = 0; j < byte_rows; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + j * p.out_features), _MM_HINT_T0);
  }
  const int64_t at = (a * p.block / p.group) * p.out_features + col;
  const int64_t size = p.half ? 2 : 4;
  for (int64_t byte = 0; byte < kColumns * size; byte += 64) {
    _mm_prefetch(static_cast<const char*>(p.scales) + at * size + byte, _MM_HINT_T0);
    if (p.offsets) _mm_prefetch(static_cast<const char*>(p.offsets) + at * size + byte, _MM_HINT_T0);
  }
}

// The column split (every weight but a few rows of a wide one): one task is
// rows [row0, row0 + rows) x columns [col, col + 64) over every input block.
template <bool kInt4>
void ColumnTask(const Problem& p, int64_t row0, int64_t rows, int64_t col) {
  const int64_t byte_rows = kInt4 ? p.block / 2 : p.block;
  alignas(64) __m512i w[32];
  alignas(64) float acc[kRowBlock * kColumns] = {};
  const int64_t blocks = p.in / p.block;
  for (int64_t a = 0; a < blocks; ++a) {
    const uint8_t* first = p.data + a * byte_rows * p.out_features + col;
    if (a + kPrefetchBlocks < blocks) Prefetch(p, a + kPrefetchBlocks, col);
    PrepareWeights<kInt4>(first, p.out_features, byte_rows / 4, w);
    AccumulateBlock<kInt4>(p, a, col, w, row0, rows, acc, kColumns);
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm512_load_ps(acc + r * kColumns + 16 * k);
    TransposeLanes(v);
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(p.out + (row0 + r) * p.out_features + col + 16 * k, v[k]);
  }
}

// Few rows of a wide weight: one task is every row and columns [col_begin,
// col_end) over input blocks [begin, end), walking each block's weight rows
// front to back (every column tile of the part before the next block),
// summed into those columns of its block range's partial [rows, out] (lane
// order). Column strips would read a 64-byte piece of every row, a new page
// each time.
template <bool kInt4>
void BlockRangeTask(const Problem& p, int64_t begin, int64_t end, int64_t col_begin, int64_t col_end,
                    float* partial) {
  const int64_t byte_rows = kInt4 ? p.block / 2 : p.block;
  alignas(64) __m512i w[32];
  for (int64_t r = 0; r < p.rows; ++r) {
    std::fill(partial + r * p.out_features + col_begin, partial + r * p.out_features + col_end, 0.0f);
  }
  for (int64_t a = begin; a < end; ++a) {
    for (int64_t col = col_begin; col < col_end; col += kColumns) {
      PrepareWeights<kInt4>(p.data + a * byte_rows * p.out_features + col, p.out_features, byte_rows / 4, w);
      AccumulateBlock<kInt4>(p, a, col, w, 0, p.rows, partial + col, p.out_features);
    }
  }
}

ffi::Error Q8MatmulImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                        ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> out, int64_t group_size, bool has_offsets, int64_t block) {
  const auto x_dims = x.dimensions();
  const auto data_dims = data.dimensions();
  if (x_dims.size() != 2 || data_dims.size() != 3) {
    return ffi::Error::InvalidArgument("q8 matmul: x must be [rows, in], data [layers, in(/2), out]");
  }
  Problem p;
  p.int4 = data.element_type() == ffi::DataType::U8;
  if (!p.int4 && data.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("q8 matmul: data must be int8 or uint8 (packed int4)");
  }
  p.rows = x_dims[0];
  p.in = x_dims[1];
  p.out_features = data_dims[2];
  p.group = group_size;
  p.block = block;
  // Blocks of 16 or 32 inputs: whole vectors of activations, whole quads of
  // byte rows, at most 32 prepared weight vectors.
  if (p.in != data_dims[1] * (p.int4 ? 2 : 1) || p.group <= 0 || p.in % p.group != 0 ||
      (p.block != 16 && p.block != 32) || p.group % p.block != 0 || p.out_features % kColumns != 0) {
    return ffi::Error::InvalidArgument(
        "q8 matmul: shapes do not match (blocks of 16 or 32 inputs in whole groups, out a multiple of 64)");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= data_dims[0]) {
    return ffi::Error::InvalidArgument("q8 matmul: layer index outside the stacked weights");
  }
  const int64_t groups = p.in / p.group;
  p.data = static_cast<const uint8_t*>(data.untyped_data()) + layer_index * data_dims[1] * p.out_features;
  p.half = scales.element_type() == ffi::DataType::F16;
  if ((!p.half && scales.element_type() != ffi::DataType::F32) ||
      (has_offsets && offsets.element_type() != scales.element_type())) {
    return ffi::Error::InvalidArgument("q8 matmul: scales and offsets must both be float32 or both float16");
  }
  const int64_t layer_scales = layer_index * groups * p.out_features * (p.half ? 2 : 4);
  p.scales = static_cast<const char*>(scales.untyped_data()) + layer_scales;
  p.offsets = has_offsets ? static_cast<const char*>(offsets.untyped_data()) + layer_scales : nullptr;
  p.out = out->typed_data();
  QuantizeActivations(x.typed_data(), p);
  const int64_t blocks = p.in / p.block;
  if (p.rows <= kFewRows && p.out_features >= kPageBytes) {
    const int64_t chunks = std::min(blocks, kBlockRanges);
    std::vector<float>& partials = PartialsBuffer();
    partials.resize(chunks * p.rows * p.out_features);
    const int64_t tiles = p.out_features / kColumns, parts = std::min(tiles, kColumnParts);
    jaxinfer::ParallelFor(thread_pool, chunks * parts, [&p, &partials, blocks, chunks, tiles, parts](int64_t task) {
      const int64_t chunk = task / parts, part = task % parts;
      const int64_t begin = chunk * blocks / chunks, end = (chunk + 1) * blocks / chunks;
      const int64_t col_begin = part * tiles / parts * kColumns, col_end = (part + 1) * tiles / parts * kColumns;
      float* partial = partials.data() + chunk * p.rows * p.out_features;
      if (p.int4) {
        BlockRangeTask<true>(p, begin, end, col_begin, col_end, partial);
      } else {
        BlockRangeTask<false>(p, begin, end, col_begin, col_end, partial);
      }
    });
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t col = 0; col < p.out_features; col += kColumns) {
        __m512 v[4];
        for (int k = 0; k < 4; ++k) {
          const float* first = partials.data() + r * p.out_features + col + 16 * k;
          v[k] = _mm512_loadu_ps(first);
          for (int64_t c = 1; c < chunks; ++c) {
            v[k] = _mm512_add_ps(v[k], _mm512_loadu_ps(first + c * p.rows * p.out_features));
          }
        }
        TransposeLanes(v);
        for (int k = 0; k < 4; ++k) _mm512_storeu_ps(p.out + r * p.out_features + col + 16 * k, v[k]);
      }
    }
    return ffi::Error::Success();
  }
  const int64_t row_blocks = (p.rows + kRowBlock - 1) / kRowBlock;
  // Row blocks of one column tile are neighbours in task order, so the two
  // threads stream different columns and the weights are read about once.
  jaxinfer::ParallelFor(thread_pool, row_blocks * (p.out_features / kColumns), [&p, row_blocks](int64_t task) {
    const int64_t row0 = (task % row_blocks) * kRowBlock, col = (task / row_blocks) * kColumns;
    const int64_t rows = std::min(kRowBlock, p.rows - row0);
    if (p.int4) {
      ColumnTask<true>(p, row0, rows, col);
    } else {
      ColumnTask<false>(p, row0, rows, col);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// K-quant weights (quant/kquant.py: Q2_K .. Q6_K as the file stores them, in
// tiles of 64 columns, each code plane in 32-bit words of one column). The
// "gguf-a8" path of those weights, as llama.cpp multiplies them (its Q8_K
// activations): activations in int8 blocks of one super-block (256 inputs,
// one scale d_x each), and per super-block s, exactly in int32,
//
//   dots[r, o]  = sum_g sub_scale[g, o] * (sum_{i in g} code[i, o] * xq[r, i] - bias * sum_{i in g} xq[r, i])
//   mins[r, o]  = sum_g sub_min[g, o] * sum_{i in g} xq[r, i]
//   y[r, o]    += float(dots) * (d[s, o] * d_x[r, s]) - (dmin[s, o] * d_x[r, s]) * float(mins)
//
// (kquant_matmul.cc has the formats). The integer sums are exact, so a row's
// result never depends on the rows beside it. A low word holds a run of 32 /
// low inputs of one column, input u at bit low * u, so shifting 16 columns'
// words right by low * n and masking each byte leaves in byte k the code of
// input k * per_byte + n (per_byte = 8 / low); the high plane is laid out so
// that one more shift and mask puts the same inputs' high bits above them
// (quant/kquant.py). Each 32-bit lane then holds 4 inputs' whole codes of one
// column, in natural column order, as vpdpbusd multiplies them by 4 int8
// activations, which are stored in the matching order (KQuantOrder).
namespace kquant {

using jaxinfer::kquant::kQ2K;
using jaxinfer::kquant::kQ3K;
using jaxinfer::kquant::kQ4K;
using jaxinfer::kquant::kQ5K;
using jaxinfer::kquant::kQ6K;
using jaxinfer::kquant::kPacked;
using jaxinfer::kquant::kSeparate;
using jaxinfer::kquant::kSuperBlock;
using jaxinfer::kquant::Shape;
using jaxinfer::kquant::ShapeOf;

// x's int8 blocks as the kinds of one code width and group read them: the
// codes (KQuantOrder), their scales and each row's sum over each group.
struct KActivations {
  Problem act;
  std::vector<int32_t> group_code_sums;  // [rows, groups]
  int low, group;
};

// One layer of a weight (kquant_layer.h) times x's int8 blocks into out.
struct KProblem : jaxinfer::kquant::Layer {
  std::shared_ptr<const KActivations> xq;  // shared by a call's weights whose kinds read them alike
  float* out;
};

// Run `run` of a tile (32 / low inputs), slot n: byte k of each column's
// lane the unsigned code of input k * per_byte + n of the run, the 16
// columns of quarter q in out[q].
template <int64_t kKind>
__attribute__((always_inline)) inline void RunSlotCodes(const uint8_t* codes, const uint8_t* high, int64_t run,
                                                        int n, __m512i out[4]) {
  constexpr Shape s = ShapeOf(kKind);
  constexpr int per_byte = 8 / s.low, run_inputs = 32 / s.low;
  const __m512i low_mask = _mm512_set1_epi8(static_cast<char>((1 << s.low) - 1));
  for (int q = 0; q < 4; ++q) {
    const __m512i low = _mm512_loadu_si512(codes + (run * 4 + q) * 64);
    out[q] = _mm512_and_si512(_mm512_srl_epi16(low, _mm_cvtsi32_si128(s.low * n)), low_mask);
  }
  if constexpr (s.high > 0) {
    constexpr int chunk = 32 / (s.high > 0 ? s.high : 1);  // inputs per high word
    const int64_t first = run * run_inputs;
    const int h = static_cast<int>(first % chunk / run_inputs);
    const int bit = s.high * (h * per_byte + n);  // the slot's high bits in each byte
    const __m512i high_mask = _mm512_set1_epi8(static_cast<char>(((1 << s.high) - 1) << s.low));
    const uint8_t* words = high + first / chunk * 4 * 64;
    for (int q = 0; q < 4; ++q) {
      const __m512i bits = _mm512_loadu_si512(words + q * 64);
      const __m512i placed = bit >= s.low ? _mm512_srl_epi16(bits, _mm_cvtsi32_si128(bit - s.low))
                                          : _mm512_sll_epi16(bits, _mm_cvtsi32_si128(s.low - bit));
      out[q] = _mm512_ternarylogic_epi32(out[q], placed, high_mask, 0xF8);  // out | (placed & mask)
    }
  }
}

// xq rows in the order RunSlotCodes gives the weights: within each run of
// 32 / low inputs, dword n holds inputs n, per_byte + n, 2 * per_byte + n,
// 3 * per_byte + n.
void KQuantOrder(std::vector<int8_t>& codes, int64_t low) {
  const int64_t per_byte = 8 / low, run = 32 / low;
  std::vector<int8_t> ordered(codes.size());
  for (int64_t first = 0; first < static_cast<int64_t>(codes.size()); first += run) {
    for (int64_t n = 0; n < per_byte; ++n)
      for (int64_t k = 0; k < 4; ++k) ordered[first + 4 * n + k] = codes[first + k * per_byte + n];
  }
  codes.swap(ordered);
}

// Group g's sub-scales and sub-minimums (integers) of a tile's 64 columns, as int32.
template <int64_t kKind>
void GroupSubScales(const uint8_t* sub_scales, const uint8_t* sub_mins, int64_t g, __m512i scale[4],
                    __m512i minimum[4]) {
  constexpr Shape s = ShapeOf(kKind);
  for (int k = 0; k < 4; ++k) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales + g * 64 + 16 * k));
    scale[k] = s.signed_scales ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    if (s.minimums == kPacked) {
      minimum[k] = _mm512_srli_epi32(scale[k], 4);
      scale[k] = _mm512_and_si512(scale[k], _mm512_set1_epi32(0x0F));
    } else if (s.minimums == kSeparate) {
      minimum[k] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_mins + g * 64 + 16 * k)));
    } else {
      minimum[k] = _mm512_setzero_si512();
    }
  }
}

// Super-block sb's d (or dmin) of a tile's 64 columns as float32.
void SuperScales(const uint16_t* d, int64_t sb, __m512 out[4]) {
  for (int k = 0; k < 4; ++k) {
    out[k] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + sb * 64 + 16 * k)));
  }
}

// Rows [row0, row0 + rows) x the 64 columns of tile `tile`, every super-block.
// Per super-block the codes of its groups are unpacked once (into an L1
// buffer), and each row's integer sums of sub_scale * (dot - bias
// * sum(xq)) and of sub_min * sum(xq) over the groups are exact; one
// float multiply-add per super-block then scales them by d * d_x (dmin * d_x).
template <int64_t kKind>
void KQuantColumnTask(const KProblem& p, int64_t row0, int64_t rows, int64_t tile) {
  constexpr Shape s = ShapeOf(kKind);
  const uint8_t* codes = p.codes + tile * p.code_rows * 64;
  const uint8_t* high = s.high ? p.high + tile * p.high_rows * 64 : nullptr;
  const uint8_t* sub_scales = p.sub_scales + tile * p.groups * 64;
  const uint8_t* sub_mins = s.minimums == kSeparate ? p.sub_mins + tile * p.groups * 64 : nullptr;
  const uint16_t* d = p.d + tile * p.supers * 64;
  const uint16_t* dmin = s.minimums ? p.dmin + tile * p.supers * 64 : nullptr;
  const int64_t quads = s.group / 4, per_super = kSuperBlock / s.group;
  alignas(64) __m512i weights[kSuperBlock];  // a super-block's codes as bytes: 4 vectors (quarters) per 4 inputs
  alignas(64) __m512i scales[16][4], minimums[16][4];
  alignas(64) float acc[kRowBlock * kColumns] = {};
  for (int64_t sb = 0; sb < p.supers; ++sb) {
    for (int64_t gi = 0; gi < per_super; ++gi) {
      const int64_t g = sb * per_super + gi;
      constexpr int64_t per_byte = 8 / s.low, run_inputs = 32 / s.low;
      for (int64_t run = 0; run < s.group / run_inputs; ++run) {
        for (int n = 0; n < per_byte; ++n) {
          RunSlotCodes<kKind>(codes, high, g * (s.group / run_inputs) + run, n,
                              weights + 4 * (gi * quads + run * per_byte + n));
        }
      }
      GroupSubScales<kKind>(sub_scales, sub_mins, g, scales[gi], minimums[gi]);
    }
    __m512 d_s[4], dmin_s[4];
    SuperScales(d, sb, d_s);
    if (s.minimums) SuperScales(dmin, sb, dmin_s);
    for (int64_t r = 0; r < rows; r += 2) {
      const int pair = r + 1 < rows ? 2 : 1;
      __m512i sums[2][4], mins[2][4];
      for (int i = 0; i < 2; ++i)
        for (int k = 0; k < 4; ++k) sums[i][k] = mins[i][k] = _mm512_setzero_si512();
      for (int64_t gi = 0; gi < per_super; ++gi) {
        const int64_t g = sb * per_super + gi;
        const int32_t* x[2];
        for (int i = 0; i < pair; ++i)
          x[i] = reinterpret_cast<const int32_t*>(p.xq->act.codes.data() + (row0 + r + i) * p.in + g * s.group);
        __m512i dot[2][4];
        if (pair == 2) {
          BlockDots<false, 2>(x, weights + 4 * gi * quads, quads, dot);
        } else {
          BlockDots<false, 1>(x, weights + 4 * gi * quads, quads, dot);
        }
        for (int i = 0; i < pair; ++i) {
          const int32_t code_sum = p.xq->group_code_sums[(row0 + r + i) * p.groups + g];
          const __m512i bias = _mm512_set1_epi32(s.bias * code_sum), sum = _mm512_set1_epi32(code_sum);
          for (int k = 0; k < 4; ++k) {
            sums[i][k] = _mm512_add_epi32(sums[i][k], _mm512_mullo_epi32(scales[gi][k], _mm512_sub_epi32(dot[i][k], bias)));
            if (s.minimums) mins[i][k] = _mm512_add_epi32(mins[i][k], _mm512_mullo_epi32(minimums[gi][k], sum));
          }
        }
      }
      for (int i = 0; i < pair; ++i) {
        const __m512 dx = _mm512_set1_ps(p.xq->act.x_scales[(row0 + r + i) * p.supers + sb]);
        float* out = acc + (r + i) * kColumns;
        for (int k = 0; k < 4; ++k) {
          __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][k]), _mm512_mul_ps(d_s[k], dx), _mm512_loadu_ps(out + 16 * k));
          if (s.minimums) v = _mm512_fnmadd_ps(_mm512_mul_ps(dmin_s[k], dx), _mm512_cvtepi32_ps(mins[i][k]), v);
          _mm512_storeu_ps(out + 16 * k, v);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::copy_n(acc + r * kColumns, kColumns, p.out + (row0 + r) * p.out_features + tile * kColumns);
}

// One weight's product on x's int8 blocks (RunPlans): its layer, the
// activations as its kind reads them, and its tasks (row blocks x tiles).
struct Plan {
  KProblem p;
  int64_t row_blocks = 0, num_tasks = 0;
  void (*run)(Plan&, int64_t) = nullptr;
  void Finish() {}
};

template <int64_t kKind>
void RunColumnTask(Plan& plan, int64_t task) {
  const int64_t row0 = (task % plan.row_blocks) * kRowBlock;
  KQuantColumnTask<kKind>(plan.p, row0, std::min(kRowBlock, plan.p.rows - row0), task / plan.row_blocks);
}

// x rounded to int8 per super-block (llama.cpp's Q8_K), each group's sum of
// codes and the codes in the order of a kind of `low` bits (KQuantOrder).
std::shared_ptr<const KActivations> QuantizeFor(const float* x, int64_t rows, int64_t in, int low, int group) {
  auto xq = std::make_shared<KActivations>();
  xq->low = low;
  xq->group = group;
  Problem& act = xq->act;
  act.int4 = false;
  act.rows = rows;
  act.in = in;
  act.block = kSuperBlock;
  QuantizeActivations(x, act);
  const int64_t groups = in / group;
  xq->group_code_sums.resize(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* codes = act.codes.data() + r * in + g * group;
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) sum += codes[i];
      xq->group_code_sums[r * groups + g] = sum;
    }
  }
  KQuantOrder(act.codes, low);
  return xq;
}

// Plan's activations (those of an earlier plan of the call where its kind
// reads them alike: q, k and v of one kind round x once) and its tasks.
void PlanProduct(const float* x, Plan& plan, const std::vector<std::unique_ptr<Plan>>& plans) {
  KProblem& p = plan.p;
  for (const auto& other : plans) {
    const auto& xq = other->p.xq;  // null for this plan and any that failed its check
    if (xq && xq->low == p.shape.low && xq->group == p.shape.group) {
      p.xq = xq;
      break;
    }
  }
  if (!p.xq) p.xq = QuantizeFor(x, p.rows, p.in, p.shape.low, p.shape.group);
  plan.row_blocks = (p.rows + kRowBlock - 1) / kRowBlock;
  plan.num_tasks = plan.row_blocks * p.Tiles();
  switch (p.kind) {
    case kQ2K: plan.run = RunColumnTask<kQ2K>; break;
    case kQ3K: plan.run = RunColumnTask<kQ3K>; break;
    case kQ4K: plan.run = RunColumnTask<kQ4K>; break;
    case kQ5K: plan.run = RunColumnTask<kQ5K>; break;
    default: plan.run = RunColumnTask<kQ6K>; break;
  }
}

// x's int8 blocks times one layer of each of several weights (a layer's q, k
// and v; a MixedStack's parts as kquant_layer.h's ForEachWeight says), in
// one parallel loop.
ffi::Error Q8KQuantMatmulsImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layers,
                               ffi::RemainingArgs weights, ffi::RemainingRets outs, ffi::Span<const int64_t> kinds,
                               ffi::Span<const int64_t> stacks) {
  std::vector<std::unique_ptr<Plan>> plans;
  ffi::Error error = jaxinfer::kquant::ForEachWeight(
      "q8 k-quant matmul", layers, weights, outs, kinds, stacks,
      [&](int64_t, int64_t layer, int64_t kind, ffi::AnyBuffer* a, float* out) {
        plans.push_back(std::make_unique<Plan>());
        KProblem& p = plans.back()->p;
        ffi::Error described = jaxinfer::kquant::DescribeLayer("q8 k-quant matmul", x, layer, kind, a[0], a[1],
                                                               a[2], a[3], a[4], a[5], &p);
        p.out = out;
        if (!described.failure()) PlanProduct(x.typed_data(), *plans.back(), plans);
        return described;
      });
  if (error.failure()) return error;
  jaxinfer::RunPlans(thread_pool, plans);
  return ffi::Error::Success();
}

}  // namespace kquant

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQ8Matmul, Q8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // data
                                  .Arg<ffi::AnyBuffer>()         // scales
                                  .Arg<ffi::AnyBuffer>()         // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("has_offsets")
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQ8KQuantMatmuls, kquant::Q8KQuantMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layers
                                  .RemainingArgs()               // six arrays of each stack
                                  .RemainingRets()               // each weight's out
                                  .Attr<ffi::Span<const int64_t>>("kinds")
                                  .Attr<ffi::Span<const int64_t>>("stacks"));
