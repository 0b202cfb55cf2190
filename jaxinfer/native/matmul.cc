// Matmul of a few rows of float32 activations by grouped int8 / int4 weights for
// XLA:CPU, through the XLA FFI (native/matmul.py builds and registers it).
//
// Why it exists: XLA does not fuse a convert into a dot, so quant/linear.py's
// XLA path writes a float32 copy of every weight on every call; at a few rows
// (decode at small batches, speculative verification) that copy is the step,
// and up to 128 rows this kernel's float dots still win (native/matmul.py,
// MAX_ROWS says where it stops paying). Here
// the codes are read once, in place, from the stacked weights of all layers
// (a per-layer slice handed to a custom call would itself be copied by XLA).
//
//   x        f32 [R, in]
//   data     int8 [L, in, out], or uint8 [L, in / 2, out] for int4: row 2j
//            in the low nibble of byte row j, row 2j + 1 in the high nibble
//   scales   f32 [L, in / group, out]; offsets the same, or [1] for none
//   layer    s32 []
//   out      f32 [R, out]:  y[r, o] = sum_i x[r, i] * (q[i, o] * scale[g, o] + offset[g, o]),  g = i / group
//
// or, tiled (quant/tensor.py: `tile` 64, AVX-512 builds only), data [L, out / 64,
// in(/2), 64] and scales / offsets [L, out / 64, in / group, 64]; int4 codes
// in a tile's 64-byte lines in nibble order (NibbleFloats).
//
// Computed per group as scale * (x . q) + offset * sum(x): the same real
// numbers as the dequantized weight, rounded in another order.
//
// One call multiplies x by one layer of each of several weights (a layer's
// q, k and v), their tasks in one parallel loop: the arguments are x, layer,
// then data, scales and offsets of each weight; the results each weight's out.
//
// A mixture of experts' rows each multiply their own matrix of a stack
// (JaxinferQuantizedExpertMatmuls, below): the rows arrive sorted by matrix
// (layer * experts + expert), each run of one matrix is one product of the
// kind above, and the runs' tasks share one parallel loop. Only the selected
// experts' codes are read, each once for all its rows.
//
// Work: the output columns are cut into tasks shared by the calling thread
// and the helper threads (parallel.h), numbered in the order of the
// memory they read; a task streams its columns of each weight row in order.
// Plain weights at up to 8 rows (MatmulChunk) read each chunk once per
// block of 8 rows (the first from memory, the others from the cache); tiled
// weights keep partial sums in registers (FewRows, ManyRows) and may cut
// each tile's inputs into parts (InputParts) to keep every core busy.
#include "jaxinfer/native/vec16.h"  // the register paths (JAXINFER_VEC16); the rest builds on any CPU

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "jaxinfer/native/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#if JAXINFER_VEC16
namespace vec = jaxinfer::vec16;
#endif

namespace {

constexpr int64_t kRowBlock = 8;  // rows MatmulColumns keeps in flight
constexpr int64_t kChunk = 256;   // output columns per task

struct Problem {
  const float* x;
  const void* data;
  const float* scales;
  const float* offsets;  // null: none
  float* out;
  bool int4;
  int64_t rows, in, out_features, group, layer;
  int64_t tile;  // 0: plain layout; else columns per tile (kTileColumns)
};

// Where the layouts differ: the distance between consecutive code rows (and
// groups of scales) of one column, and where column col's code row 0 and
// group g's scale lie.
int64_t RowStride(const Problem& p) { return p.tile ? p.tile : p.out_features; }

const uint8_t* CodeColumn(const Problem& p, int64_t col) {
  const int64_t data_rows = p.int4 ? p.in / 2 : p.in;
  const uint8_t* layer = static_cast<const uint8_t*>(p.data) + p.layer * data_rows * p.out_features;
  return p.tile ? layer + (col / p.tile) * data_rows * p.tile + col % p.tile : layer + col;
}

int64_t ScaleIndex(const Problem& p, int64_t g, int64_t col) {
  const int64_t groups = p.in / p.group, layer = p.layer * groups * p.out_features;
  return p.tile ? layer + (col / p.tile) * groups * p.tile + g * p.tile + col % p.tile
                : layer + g * p.out_features + col;
}

// Columns [begin, end) of every row. partial[r][c] accumulates x . q over
// the current group while the group's weight rows stream by in order; the
// group's scale and offset then fold it into the result.
template <int64_t kRows>
void MatmulColumns(const Problem& p, int64_t begin, int64_t end) {
  const int64_t width = end - begin, num_groups = p.in / p.group;
  float partial[kRows][kChunk];
  float result[kRows][kChunk] = {};
  const int64_t data_rows = p.int4 ? p.in / 2 : p.in;
  const int64_t layer_data = p.layer * data_rows * p.out_features;
  const int64_t layer_scales = p.layer * num_groups * p.out_features;
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t r = 0; r < kRows; ++r) std::fill_n(partial[r], width, 0.0f);
    float x_sums[kRows] = {};
    if (p.int4) {
      const uint8_t* codes = static_cast<const uint8_t*>(p.data) + layer_data;
      for (int64_t j = g * p.group / 2; j < (g + 1) * p.group / 2; ++j) {
        const uint8_t* row = codes + j * p.out_features + begin;
        float x_low[kRows], x_high[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          x_low[r] = p.x[r * p.in + 2 * j];
          x_high[r] = p.x[r * p.in + 2 * j + 1];
          x_sums[r] += x_low[r] + x_high[r];
        }
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          const float low = static_cast<float>(row[c] & 0x0F), high = static_cast<float>(row[c] >> 4);
          for (int64_t r = 0; r < kRows; ++r) partial[r][c] += x_low[r] * low + x_high[r] * high;
        }
      }
    } else {
      const int8_t* codes = static_cast<const int8_t*>(p.data) + layer_data;
      for (int64_t i = g * p.group; i < (g + 1) * p.group; ++i) {
        const int8_t* row = codes + i * p.out_features + begin;
        float xs[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          xs[r] = p.x[r * p.in + i];
          x_sums[r] += xs[r];
        }
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          const float q = static_cast<float>(row[c]);
          for (int64_t r = 0; r < kRows; ++r) partial[r][c] += xs[r] * q;
        }
      }
    }
    const float* scale = p.scales + layer_scales + g * p.out_features + begin;
    const float* offset = p.offsets ? p.offsets + layer_scales + g * p.out_features + begin : nullptr;
    for (int64_t r = 0; r < kRows; ++r) {
      if (offset) {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) result[r][c] += scale[c] * partial[r][c] + offset[c] * x_sums[r];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) result[r][c] += scale[c] * partial[r][c];
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) std::copy_n(result[r], width, p.out + r * p.out_features + begin);
}

// Rows [row0, row0 + min(kRowBlock, rows - row0)) of one chunk of columns,
// as row blocks of 8, 4, 2 and 1: only those are compiled, since each
// instance adds to the build a machine's first run waits for (the chunk's
// codes come from the cache for the second block on).
void MatmulRowBlock(const Problem& p, int64_t row0, int64_t begin, int64_t end) {
  const int64_t rows = std::min(kRowBlock, p.rows - row0);
  for (int64_t done = 0; done < rows;) {
    Problem block = p;
    block.x = p.x + (row0 + done) * p.in;
    block.out = p.out + (row0 + done) * p.out_features;
    const int64_t left = rows - done;
    if (left >= 8) {
      MatmulColumns<8>(block, begin, end), done += 8;
    } else if (left >= 4) {
      MatmulColumns<4>(block, begin, end), done += 4;
    } else if (left >= 2) {
      MatmulColumns<2>(block, begin, end), done += 2;
    } else {
      MatmulColumns<1>(block, begin, end), done += 1;
    }
  }
}

// Every row block of one chunk of columns, one after another: the chunk's
// codes come from memory for the first and from the cache for the others.
void MatmulChunk(const Problem& p, int64_t chunk) {
  const int64_t begin = chunk * kChunk, end = std::min(p.out_features, begin + kChunk);
  for (int64_t row0 = 0; row0 < p.rows; row0 += kRowBlock) MatmulRowBlock(p, row0, begin, end);
}

#if JAXINFER_VEC16
// Past kRowBlock rows the float multiply-adds are the work (the codes are read
// once for all rows), and MatmulColumns, whose partial sums live in memory,
// runs at a third of the FMA peak. (At 2-8 rows, with the weights coming from
// memory, MatmulColumns is as fast or faster on AVX-512: the default model's
// seven projections x 30 layers at 2 / 4 / 8 rows 6.4 / 8.2 / 11.3 ms against
// 8.4 / 9.5 / 11.4 here.) This path keeps a tile of kTileRows rows x
// kTileVectors vectors of partial sums in registers: per input, kTileVectors
// weight vectors and kTileRows broadcasts feed kTileRows * kTileVectors
// FMAs. The group's codes are turned into floats once per task, into an L1
// buffer every row tile reads. Written on vec16.h: AVX-512, or AVX2 with FMA
// and F16C, the same operations in the same order on both.
constexpr int64_t kTileColumns = 64;
using vec::kFewRowsMax;  // rows a tiled weight takes the few-row path at (PlanProduct); at most kRowBlock
using vec::kTileRows;
using vec::kTileVectors;
static_assert(kFewRowsMax <= kRowBlock);
// Rows per task at most: a group's codes are turned into floats once per task,
// for all its row tiles. Rows are split into equal tasks (64 rows: two of 32,
// not 36 + 28), more of them where that makes the tasks a multiple of the
// cores (QuantizedMatmulImpl).
constexpr int64_t kMaxTaskRows = 36;

// A group's codes as floats (GroupCodes), per thread and kept across calls:
// group x 64 floats (8 KB for a group of 32; per-channel int8, one group of
// all inputs, 384 KB at 1,536 inputs), 64-byte aligned.
float* GroupBuffer(int64_t group) {
  static thread_local std::vector<float> buffer;
  buffer.resize(group * kTileColumns + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

// 16 int8 codes in memory as 16 floats. Widening straight from memory: taking
// them out of a 64-byte register first (vextracti32x4) was a second
// cross-lane shuffle per 16 codes, and the one-row matvec of the Q8_0 head's
// shape ran 1.25x slower from L2 (BENCHMARKS.md, "Why the CPU path is built this way").
inline vec::F Int8Floats(const uint8_t* codes) { return vec::ToFloat(vec::FromSignedBytes(codes)); }

// Tiled int4 codes are stored in nibble order (quant/tensor.py, `tiled`):
// within each 64-byte line, byte 4d + m holds column 16m + d, low nibble
// input 2j, high nibble 2j + 1. Shifted right by 8m + 4h, 32-bit lane d then
// holds column 16m + d's code of input 2j + h in its low 4 bits. AVX-512:
// vpermps, which reads only those, looks its float up in a 16-entry table: a
// shift and an in-register permute per 16 codes, where widening bytes in
// column order took a mask, an extract, a vpmovzxbd and a vcvtdq2ps (a
// one-row matvec of 576 x 3072 from L2: 78 -> 51 us, BENCHMARKS.md, "Why the
// CPU path is built this way"). AVX2 has no 16-entry permute: the 4 bits are
// masked and converted, the same float.
template <int kShift>
inline vec::F NibbleFloats(vec::I line) {
  const vec::I shifted = kShift ? vec::ShiftRight<kShift>(line) : line;
#if defined(__AVX512F__)
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(shifted, values);
#else
  return vec::ToFloat(vec::And(shifted, vec::SetInts(0x0F)));
#endif
}

// Group g's codes of the 64 columns at col as floats: w[i * 64 + c] = q[g * group + i, col + c].
void GroupCodes(const Problem& p, int64_t g, int64_t col, float* w) {
  const uint8_t* codes = CodeColumn(p, col);
  const int64_t stride = RowStride(p);
  if (p.int4 && p.tile) {
    for (int64_t j = 0; j < p.group / 2; ++j) {  // byte row j: inputs 2j and 2j + 1, in nibble order
      const vec::I line = vec::LoadInts(codes + (g * p.group / 2 + j) * stride);
      float* low = w + 2 * j * kTileColumns;
      float* high = low + kTileColumns;
      vec::Store(low, NibbleFloats<0>(line)), vec::Store(high, NibbleFloats<4>(line));
      vec::Store(low + 16, NibbleFloats<8>(line)), vec::Store(high + 16, NibbleFloats<12>(line));
      vec::Store(low + 32, NibbleFloats<16>(line)), vec::Store(high + 32, NibbleFloats<20>(line));
      vec::Store(low + 48, NibbleFloats<24>(line)), vec::Store(high + 48, NibbleFloats<28>(line));
    }
  } else if (p.int4) {
    for (int64_t j = 0; j < p.group / 2; ++j) {  // byte row j: input 2j (low nibbles), 2j + 1 (high)
      const uint8_t* row = codes + (g * p.group / 2 + j) * stride;
      for (int k = 0; k < 4; ++k) {
        const vec::I bytes = vec::FromBytes(row + 16 * k);
        vec::Store(w + 2 * j * kTileColumns + 16 * k, vec::ToFloat(vec::And(bytes, vec::SetInts(0x0F))));
        vec::Store(w + (2 * j + 1) * kTileColumns + 16 * k, vec::ToFloat(vec::ShiftRight<4>(bytes)));
      }
    }
  } else {
    for (int64_t i = 0; i < p.group; ++i) {
      const uint8_t* row = codes + (g * p.group + i) * stride;
      for (int k = 0; k < 4; ++k) vec::Store(w + i * kTileColumns + 16 * k, Int8Floats(row + 16 * k));
    }
  }
}

// Asks for group g's code rows of the 64 columns at col, while the rows of
// the group before are multiplied (ManyRowsTask). Always inlined: outlined,
// g++ 12 judged it free of side effects (a prefetch counts as none) and
// dropped every call. With it, the default model's projections x 30 layers
// and its head (medians of 40 alternated calls): 32 rows 53.5 -> 51.4 ms,
// 64 rows 101.0 -> 98.4. The few-row path does without it: there it cost
// 12% at one row and 8% at two, and gained 2-4% at eight (the hardware
// prefetcher follows a task's contiguous tile).
__attribute__((always_inline)) inline void PrefetchGroup(const Problem& p, int64_t g, int64_t col) {
  const int64_t byte_rows = p.int4 ? p.group / 2 : p.group, stride = RowStride(p);
  const char* first = reinterpret_cast<const char*>(CodeColumn(p, col)) + g * byte_rows * stride;
  for (int64_t j = 0; j < byte_rows; ++j) _mm_prefetch(first + j * stride, _MM_HINT_T0);
}

// Group g's dots acc (rows [row0, row0 + kRows) x the 16 * kVectors columns
// at col) into result (kRowFloats floats a row, these columns from its
// start): result += scale * dot + offset * sum(x) of the group, as
// MatmulColumns does.
// Unrolled completely and always inlined so that acc is read from the
// registers the dots left it in: as loops, g++ 12 stored all of acc to the
// stack and loaded it back at every group, and the default model's
// projections at 32 rows (one thread, /tmp harness) ran at 87 GFLOP/s against
// 95 unrolled; the tiles of 5 rows (a 35-row task) were still called out of
// line, 92 -> 94 GFLOP/s inlined (BENCHMARKS.md, "Why the CPU path is built this way").
template <int kRows, int kVectors, int kRowFloats = 16 * kVectors>
__attribute__((always_inline)) inline void FoldGroup(const Problem& p, const vec::F (&acc)[kRows][kVectors],
                                                     int64_t g, int64_t col, int64_t row0, const float* x_sums,
                                                     float* result) {
  const int64_t num_groups = p.in / p.group;
#pragma GCC unroll 16
  for (int k = 0; k < kVectors; ++k) {
    const int64_t at = ScaleIndex(p, g, col + 16 * k);
    const vec::F scale = vec::LoadUnaligned(p.scales + at);
    const vec::F offset = p.offsets ? vec::LoadUnaligned(p.offsets + at) : vec::Zero();
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      float* out = result + (row0 + r) * kRowFloats + 16 * k;
      vec::F v = vec::MulAdd(scale, acc[r][k], vec::Load(out));
      if (p.offsets) v = vec::MulAdd(offset, vec::Set(x_sums[(row0 + r) * num_groups + g]), v);
      vec::Store(out, v);
    }
  }
}

// Rows [row0, row0 + kRows) x the 64 columns at col, group g: the dot of each
// row's group inputs with the codes w (GroupCodes, vec16.h's TileDots),
// folded into result.
template <int kRows>
void TileGroup(const Problem& p, const float* w, int64_t g, int64_t col, int64_t row0, const float* x_sums,
               float* result) {
  vec::TileDots<kRows>(p.x + row0 * p.in + g * p.group, p.in, w, p.group,
                       [&](const vec::F (&acc)[kRows][kTileVectors], int pass) __attribute__((always_inline)) {
                         FoldGroup<kRows, kTileVectors, kTileColumns>(p, acc, g, col + 16 * pass, row0, x_sums,
                                                                      result + 16 * pass);
                       });
}

// Each row's sum of x over each group, [rows, groups]: what the offsets multiply.
std::vector<float> GroupSums(const Problem& p) {
  const int64_t num_groups = p.in / p.group;
  std::vector<float> sums(p.rows * num_groups);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const float* x = p.x + r * p.in + g * p.group;
      vec::F sum = vec::Zero();
      int64_t i = 0;
      for (; i + 16 <= p.group; i += 16) sum = vec::Add(sum, vec::LoadUnaligned(x + i));
      float total = vec::Sum(sum);
      for (; i < p.group; ++i) total += x[i];
      sums[r * num_groups + g] = total;
    }
  }
  return sums;
}

// A tiled weight at up to kFewRowsMax rows: rows [row0, row0 + kRows) x the
// 16 * kVectors columns at col, group g. TileGroup's multiply-adds in the same
// order, with each code row turned into floats in registers as it is used
// instead of through GroupBuffer (at a few rows there are too few
// multiply-adds per code to repay a store and a load of each). Fewer rows
// take more columns, so that kRows * kVectors = 16 independent accumulators
// hide the multiply-add's latency on AVX-512 (FewRows; a leftover tile of 2
// or 1 rows has fewer); AVX2's one row keeps 4 (8 registers).
template <int kRows, int kVectors>
void FewRowsGroup(const Problem& p, int64_t g, int64_t col, int64_t row0, const float* x_sums, float* result) {
  constexpr int kLines = kVectors / 4;  // 64-byte code lines (tiles) per input
  vec::F acc[kRows][kVectors];
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < kVectors; ++k) acc[r][k] = vec::Zero();
  const float* x = p.x + row0 * p.in + g * p.group;
  // One input's codes, 16 columns at a time as floats from code_floats(k),
  // into every row's accumulators.
  auto multiply_add = [&](int64_t i, auto code_floats) {
    vec::F xi[kRows];
    for (int r = 0; r < kRows; ++r) xi[r] = vec::Set(x[r * p.in + i]);
    for (int k = 0; k < kVectors; ++k) {
      const vec::F w = code_floats(k);
      for (int r = 0; r < kRows; ++r) acc[r][k] = vec::MulAdd(w, xi[r], acc[r][k]);
    }
  };
  const uint8_t* codes[kLines];
  for (int l = 0; l < kLines; ++l) codes[l] = CodeColumn(p, col + 64 * l);
  const int64_t stride = RowStride(p);
  if (p.int4) {
    for (int64_t j = 0; j < p.group / 2; ++j) {  // byte row j: inputs 2j and 2j + 1, in nibble order
      vec::I lines[kLines];
      for (int l = 0; l < kLines; ++l) lines[l] = vec::LoadInts(codes[l] + (g * p.group / 2 + j) * stride);
      // Vector k is columns 16(k % 4) .. + 15 of line k / 4 (k unrolled: the shifts are constants).
      multiply_add(2 * j, [&](int k) {
        switch (k % 4) {
          case 0: return NibbleFloats<0>(lines[k / 4]);
          case 1: return NibbleFloats<8>(lines[k / 4]);
          case 2: return NibbleFloats<16>(lines[k / 4]);
          default: return NibbleFloats<24>(lines[k / 4]);
        }
      });
      multiply_add(2 * j + 1, [&](int k) {
        switch (k % 4) {
          case 0: return NibbleFloats<4>(lines[k / 4]);
          case 1: return NibbleFloats<12>(lines[k / 4]);
          case 2: return NibbleFloats<20>(lines[k / 4]);
          default: return NibbleFloats<28>(lines[k / 4]);
        }
      });
    }
  } else {
    for (int64_t i = 0; i < p.group; ++i) {
      const int64_t at = (g * p.group + i) * stride;
      multiply_add(i, [&](int k) { return Int8Floats(codes[k / 4] + at + 16 * (k % 4)); });
    }
  }
  FoldGroup<kRows, kVectors>(p, acc, g, col, row0, x_sums, result);
}

// Every row (at most kFewRowsMax) x the 16 * kVectors columns at col, groups
// [g_begin, g_end), written to out [rows, out_features].
template <int kVectors>
void FewRowsTask(const Problem& p, int64_t col, int64_t g_begin, int64_t g_end, const float* x_sums, float* out) {
  constexpr int64_t kWidth = 16 * kVectors;
  alignas(64) float result[kFewRowsMax * kWidth];
  std::fill_n(result, p.rows * kWidth, 0.0f);
  for (int64_t g = g_begin; g < g_end; ++g) {
    // Only the row counts FewRows gives each width are compiled (each
    // instance costs build time on a machine's first run); a second row
    // tile reads the group's codes from L1.
    if constexpr (kVectors == 16) {
      FewRowsGroup<1, kVectors>(p, g, col, 0, x_sums, result);
    } else if constexpr (kVectors == 8) {
      if (p.rows == 1) {
        FewRowsGroup<1, kVectors>(p, g, col, 0, x_sums, result);
      } else {
        FewRowsGroup<2, kVectors>(p, g, col, 0, x_sums, result);
      }
    } else if constexpr (kFewRowsMax == 1) {
      FewRowsGroup<1, kVectors>(p, g, col, 0, x_sums, result);
    } else {
      // Row tiles of 5, 4, 3, 2 and 1, as few as the rows allow (6 = 3 + 3,
      // 7 = 4 + 3, 8 = 4 + 4): each tile turns the codes into floats again,
      // so 3 rows as 2 + 1 cost more than 4 rows, and 5 (a verification of
      // 4 drafts) as 4 + 1 a sixth more than as 5 (BENCHMARKS.md, "EAGLE drafting head").
      for (int64_t row = 0; row < p.rows;) {
        const int64_t left = p.rows - row;
        if (left == 5) {
          FewRowsGroup<5, kVectors>(p, g, col, row, x_sums, result), row += 5;
        } else if (left >= 4 && left != 6) {
          FewRowsGroup<4, kVectors>(p, g, col, row, x_sums, result), row += 4;
        } else if (left >= 3) {
          FewRowsGroup<3, kVectors>(p, g, col, row, x_sums, result), row += 3;
        } else if (left == 2) {
          FewRowsGroup<2, kVectors>(p, g, col, row, x_sums, result), row += 2;
        } else {
          FewRowsGroup<1, kVectors>(p, g, col, row, x_sums, result), row += 1;
        }
      }
    }
  }
  for (int64_t r = 0; r < p.rows; ++r) std::copy_n(result + r * kWidth, kWidth, out + r * p.out_features + col);
}

// Rows [row_begin, row_end) x the 64 columns at col, every group, in `parts`
// runs of groups (InputParts): each run's sum starts from zero and is added
// to the output, as FewRows adds its parts.
void ManyRowsTask(const Problem& p, int64_t col, int64_t row_begin, int64_t row_end, int64_t parts,
                  const float* x_sums) {
  float* w = GroupBuffer(p.group);
  alignas(64) float result[kMaxTaskRows * kTileColumns];
  float* base = result - row_begin * kTileColumns;  // indexed by absolute row
  const int64_t num_groups = p.in / p.group;
  for (int64_t part = 0; part < parts; ++part) {
    std::fill_n(result, kMaxTaskRows * kTileColumns, 0.0f);
    for (int64_t g = num_groups * part / parts; g < num_groups * (part + 1) / parts; ++g) {
      if (g + 1 < num_groups) PrefetchGroup(p, g + 1, col);
      GroupCodes(p, g, col, w);
      int64_t r = row_begin;
      for (; r + kTileRows <= row_end; r += kTileRows) TileGroup<kTileRows>(p, w, g, col, r, x_sums, base);
      vec::ForRowsLeft(row_end - r,
                       [&](auto rows) { TileGroup<decltype(rows)::value>(p, w, g, col, r, x_sums, base); });
    }
    for (int64_t r = row_begin; r < row_end; ++r) {
      float* out = p.out + r * p.out_features + col;
      const float* sum = base + r * kTileColumns;
      if (part == 0) {
        std::copy_n(sum, kTileColumns, out);
      } else {
        for (int64_t c = 0; c < kTileColumns; ++c) out[c] += sum[c];
      }
    }
  }
}
#endif

// One weight's product, cut into tasks: run(plan, i) runs task i (any
// thread); Finish() completes the output once every task has run. (Plain
// function pointers, not std::function: each instance adds to the build a
// machine's first start waits for.)
struct Plan {
  Problem p;
  std::vector<float> x_sums;    // [rows, groups] where the weight has offsets
  std::vector<float> partials;  // FewRows: parts 1.. of the output (part 0 is written in place)
  int64_t num_tasks = 0, parts = 1, row_tasks = 1, task_rows = 0;
  void (*run)(Plan& plan, int64_t task) = nullptr;

  // Adds the FewRows parts past the first to the output, in order.
  void Finish() {
    const int64_t size = p.rows * p.out_features;
    for (int64_t at = 0; at < static_cast<int64_t>(partials.size()); at += size)
      for (int64_t i = 0; i < size; ++i) p.out[i] += partials[at + i];
  }
};

#if JAXINFER_VEC16
// Task `task` of a FewRows plan: the task / parts-th run of 16 * kVectors
// columns, its inputs' part task % parts.
template <int kVectors>
void RunFewRows(Plan& plan, int64_t task) {
  const Problem& p = plan.p;
  const int64_t num_groups = p.in / p.group, part = task % plan.parts;
  float* out = part == 0 ? p.out : plan.partials.data() + (part - 1) * p.rows * p.out_features;
  FewRowsTask<kVectors>(p, task / plan.parts * 16 * kVectors, num_groups * part / plan.parts,
                        num_groups * (part + 1) / plan.parts, plan.x_sums.data(), out);
}

// A tiled weight at up to kFewRowsMax rows, in tasks as wide as the row
// count needs (where the width divides the columns): on AVX-512 256 columns
// at 1 row, 128 at 2, else 64 (kRows * kVectors sums in registers; AVX2's
// 16 registers take 64); each width's tasks cut into InputParts runs of groups.
void PlanFewRows(Plan& plan, int64_t workers) {
  const Problem& p = plan.p;
  plan.parts = jaxinfer::InputParts(p.out_features / kTileColumns, p.in / p.group, workers);
  plan.partials.resize((plan.parts - 1) * p.rows * p.out_features);
  plan.run = RunFewRows<4>;
  int64_t width = 64;
  if constexpr (vec::kVecRegisters == 32) {  // the wider tasks' templates only where they are used
    if (p.rows == 1 && p.out_features % 256 == 0) {
      width = 256, plan.run = RunFewRows<16>;
    } else if (p.rows <= 2 && p.out_features % 128 == 0) {
      width = 128, plan.run = RunFewRows<8>;
    }
  }
  plan.num_tasks = p.out_features / width * plan.parts;
}

// Past kFewRowsMax rows (and a plain weight past kRowBlock): tiles of 64 columns x equal runs of at most
// kMaxTaskRows rows.
void PlanManyRows(Plan& plan, int64_t workers) {
  const Problem& p = plan.p;
  const int64_t column_tiles = p.out_features / kTileColumns;
  const int64_t parts = jaxinfer::InputParts(column_tiles, p.in / p.group, workers);
  int64_t row_tasks = (p.rows + kMaxTaskRows - 1) / kMaxTaskRows;
  // Equal tasks in a multiple of the workers, where the rows allow: 9 column
  // tiles (576 outputs) in 9 tasks kept one of two cores idle for a ninth
  // of the call.
  while (column_tiles * row_tasks % workers != 0 && row_tasks * kTileRows < p.rows) ++row_tasks;
  plan.parts = parts;
  plan.row_tasks = row_tasks;
  plan.task_rows = (p.rows + row_tasks - 1) / row_tasks;
  plan.num_tasks = row_tasks * column_tiles;
  plan.run = [](Plan& plan, int64_t task) {
    const int64_t row_begin = (task % plan.row_tasks) * plan.task_rows;
    ManyRowsTask(plan.p, (task / plan.row_tasks) * kTileColumns, row_begin,
                 std::min(plan.p.rows, row_begin + plan.task_rows), plan.parts, plan.x_sums.data());
  };
}
#endif

// Checks one weight's buffers against x and describes its product in *problem.
ffi::Error Describe(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& data, const ffi::Buffer<ffi::F32>& scales,
                    const ffi::Buffer<ffi::F32>& offsets, int64_t layer, float* out, int64_t group_size,
                    bool has_offsets, Problem* problem) {
  const auto x_dims = x.dimensions();
  const auto data_dims = data.dimensions();
  if (x_dims.size() != 2 || (data_dims.size() != 3 && data_dims.size() != 4)) {
    return ffi::Error::InvalidArgument(
        "quantized matmul: x must be [rows, in], data [layers, in(/2), out] or tiled [layers, out / 64, in(/2), 64]");
  }
  Problem p;
  p.int4 = data.element_type() == ffi::DataType::U8;
  if (!p.int4 && data.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("quantized matmul: data must be int8 or uint8 (packed int4)");
  }
  const bool tiled = data_dims.size() == 4;
  p.tile = tiled ? data_dims[3] : 0;
  const int64_t data_rows = tiled ? data_dims[2] : data_dims[1];
  p.x = x.typed_data();
  p.data = data.untyped_data();
  p.scales = scales.typed_data();
  p.offsets = has_offsets ? offsets.typed_data() : nullptr;
  p.out = out;
  p.rows = x_dims[0];
  p.in = x_dims[1];
  p.out_features = tiled ? data_dims[1] * data_dims[3] : data_dims[2];
  p.group = group_size;
  p.layer = layer;
  if (p.layer < 0 || p.layer >= data_dims[0]) {
    return ffi::Error::InvalidArgument("quantized matmul: layer index outside the stacked weights");
  }
  if (p.rows < 1 || p.in != data_rows * (p.int4 ? 2 : 1) || p.group <= 0 || p.in % p.group != 0 ||
      (p.int4 && p.group % 2 != 0)) {
    return ffi::Error::InvalidArgument("quantized matmul: shapes do not match (whole groups)");
  }
#if JAXINFER_VEC16
  if (tiled && p.tile != kTileColumns) {
    return ffi::Error::InvalidArgument("quantized matmul: tiles must be 64 columns wide");
  }
#else
  if (tiled) {
    return ffi::Error::InvalidArgument("quantized matmul: tiled weights need AVX-512, or AVX2 with FMA and F16C");
  }
#endif
  *problem = p;
  return ffi::Error::Success();
}

// Chooses the path and the tasks of a described product.
void PlanProduct(Plan& plan, int64_t workers) {
  const Problem& p = plan.p;
#if JAXINFER_VEC16
  // The register paths: a tiled weight at any row count, a plain one past kRowBlock rows.
  if (p.tile || (p.rows > kRowBlock && p.out_features % kTileColumns == 0)) {
    if (p.offsets) plan.x_sums = GroupSums(p);
    return p.rows <= kFewRowsMax ? PlanFewRows(plan, workers) : PlanManyRows(plan, workers);
  }
#endif
  plan.num_tasks = (p.out_features + kChunk - 1) / kChunk;
  plan.run = [](Plan& plan, int64_t chunk) { MatmulChunk(plan.p, chunk); };
}

// One weight's buffers in a call of several: its (data, scales, offsets)
// and its out.
struct WeightBuffers {
  ffi::AnyBuffer data;
  ffi::Buffer<ffi::F32> scales, offsets;
  float* out;
};

// Weight j's buffers into *w, or the error of the first one missing.
ffi::Error GetWeight(ffi::RemainingArgs& weights, ffi::RemainingRets& outs, int64_t j,
                     std::optional<WeightBuffers>* w) {
  auto data = weights.get<ffi::AnyBuffer>(3 * j);
  auto scales = weights.get<ffi::Buffer<ffi::F32>>(3 * j + 1);
  auto offsets = weights.get<ffi::Buffer<ffi::F32>>(3 * j + 2);
  auto out = outs.get<ffi::Buffer<ffi::F32>>(j);
  if (data.has_error()) return data.error();
  if (scales.has_error()) return scales.error();
  if (offsets.has_error()) return offsets.error();
  if (out.has_error()) return out.error();
  w->emplace(WeightBuffers{data.value(), scales.value(), offsets.value(), out.value()->typed_data()});
  return ffi::Error::Success();
}

// x times each of several weights (one layer of each), in one parallel
// loop: the weights' tasks one after another, in the order of their memory.
// A layer's q, k and v projections (and gate and up) are one call, not
// three (two): fewer calls, and the cores share out all their tasks at once.
ffi::Error QuantizedMatmulsImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                                ffi::RemainingArgs weights, ffi::RemainingRets outs, int64_t group_size,
                                bool has_offsets) {
  const int64_t count = static_cast<int64_t>(outs.size());
  if (count == 0 || static_cast<int64_t>(weights.size()) != 3 * count) {
    return ffi::Error::InvalidArgument("quantized matmul: give (data, scales, offsets) for each output");
  }
  const int64_t workers = jaxinfer::NumWorkers(thread_pool);
  std::vector<std::unique_ptr<Plan>> plans;  // pointers: the tasks refer to their plan
  for (int64_t j = 0; j < count; ++j) {
    std::optional<WeightBuffers> w;
    if (ffi::Error error = GetWeight(weights, outs, j, &w); error.failure()) return error;
    plans.push_back(std::make_unique<Plan>());
    ffi::Error error = Describe(x, w->data, w->scales, w->offsets, layer.typed_data()[0], w->out, group_size,
                                has_offsets, &plans.back()->p);
    if (error.failure()) return error;
    PlanProduct(*plans.back(), workers);
  }
  jaxinfer::RunPlans(thread_pool, plans);
  return ffi::Error::Success();
}

// Rows sorted by matrix (matrix[r] non-decreasing: layer * experts + expert
// of a stack [layers * experts, in, out] of each weight): each run of rows
// of one matrix times that matrix, for every weight, all the runs' tasks in
// one parallel loop. A row's result is the product a call with that row
// alone computes (the paths' sums do not depend on the rows beside it:
// InputParts, FewRows and ManyRows), so a token's experts never depend on
// which other tokens chose them.
ffi::Error QuantizedExpertMatmulsImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x,
                                      ffi::Buffer<ffi::S32> matrix, ffi::RemainingArgs weights,
                                      ffi::RemainingRets outs, int64_t group_size, bool has_offsets) {
  const int64_t count = static_cast<int64_t>(outs.size());
  if (count == 0 || static_cast<int64_t>(weights.size()) != 3 * count) {
    return ffi::Error::InvalidArgument("quantized expert matmul: give (data, scales, offsets) for each output");
  }
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  if (matrix.element_count() != rows) {
    return ffi::Error::InvalidArgument("quantized expert matmul: one matrix index per row of x");
  }
  const int32_t* index = matrix.typed_data();
  std::vector<int64_t> run_begin;  // the first row of each run of one matrix, then rows
  if (!jaxinfer::MatrixRuns(index, rows, &run_begin)) {
    return ffi::Error::InvalidArgument("quantized expert matmul: rows must be sorted by matrix");
  }
  const int64_t workers = jaxinfer::NumWorkers(thread_pool);
  std::vector<std::unique_ptr<Plan>> plans;
  for (int64_t j = 0; j < count; ++j) {
    std::optional<WeightBuffers> w;
    if (ffi::Error error = GetWeight(weights, outs, j, &w); error.failure()) return error;
    for (size_t run = 0; run + 1 < run_begin.size(); ++run) {
      plans.push_back(std::make_unique<Plan>());
      // Checked as the whole x, then narrowed to the run's rows and matrix.
      ffi::Error error = Describe(x, w->data, w->scales, w->offsets, index[run_begin[run]], w->out, group_size,
                                  has_offsets, &plans.back()->p);
      if (error.failure()) return error;
      Problem& p = plans.back()->p;
      p.x += run_begin[run] * in;
      p.out += run_begin[run] * p.out_features;
      p.rows = run_begin[run + 1] - run_begin[run];
      PlanProduct(*plans.back(), workers);
    }
  }
  jaxinfer::RunPlans(thread_pool, plans);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantizedExpertMatmuls, QuantizedExpertMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x, rows sorted by matrix
                                  .Arg<ffi::Buffer<ffi::S32>>()  // matrix of each row
                                  .RemainingArgs()               // data, scales, offsets of each weight
                                  .RemainingRets()               // each weight's out
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("has_offsets"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantizedMatmuls, QuantizedMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .RemainingArgs()               // data, scales, offsets of each weight
                                  .RemainingRets()               // each weight's out
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("has_offsets"));
