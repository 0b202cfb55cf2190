// Matmul of float32 activations by K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K) held as the file stores them (quant/kquant.py, KQuantTensor, in tiles
// of 64 columns), for XLA:CPU through the XLA FFI (native/kquant_matmul.py
// builds and registers it). AVX-512, or AVX2 with FMA and F16C (vec16.h:
// the same lanes, operations and order on both); elsewhere the build fails
// on purpose and quant/linear.py multiplies the dequantized weight in XLA.
//
// Built as two kinds of library from this one file: the handler (no
// JAXINFER_KQUANT_KIND: the checks, the plan's table of planners, the FFI
// symbol), and one library per kind (JAXINFER_KQUANT_KIND = its Kind: its
// PlanKind and kernels, handed to the handler's table by
// kquant_matmul.py), so that a machine's first start compiles only the
// kinds its file holds.
//
// Why: matmul.cc multiplies int8 / int4 codes with float32 scales per group.
// A K-quant weight in that form carries 4 bytes of scale (and 4 of offset)
// per group and its 5- and 6-bit codes widened to bytes: a Q4_K_M model read
// 308 MiB a decode step where its file holds ~200 MB. Here the codes stay at
// their bit width and the scales in two levels (an f16 super-scale per 256
// inputs times an integer sub-scale per group), and both are expanded in
// registers: the same float32 values as gguf's dequantizer.
//
//   x           f32 [R, in]
//   layers      s32 [stacks]: the layer of each stack to multiply, -1 in the
//               stacks of a weight that do not hold its layer
//   then per stack (a weight is one stack, or several where its layers are
//   stored in several kinds, quant/mixed_stack.py: the one whose layer is
//   not -1 is read; a layer's q, k and v in one call):
//   codes       u8 [L, out / 64, in * low / 8, 64]   low bits of each code
//   high        u8 [L, out / 64, in * high / 8, 64]  its high bits ([1] where none)
//   sub_scales  s8 / u8 [L, out / 64, in / group, 64]
//   sub_mins    u8, as sub_scales ([1] where none)
//   d, dmin     f16 [L, out / 64, in / 256, 64] (dmin [1] where none)
//   out         f32 [R, out] per weight
//   kinds       attribute: each stack's kind (Kind, kquant_layer.h)
//   stacks      attribute: each weight's number of stacks
//
// Byte row j of a code plane of b bits holds inputs (8 / b) * j + i in bits
// [b * i, b * i + b), its 64 bytes in nibble order (byte 4d + m holds column
// 16m + d): a 32-bit lane d then holds columns d, 16 + d, 32 + d, 48 + d, so
// shifting it right by 8m + b * i leaves column 16m + d's code in its low
// bits, and vpermps, which reads only the low 4, looks up its float in a
// table of 16 (LowTable, HighTable: the bias and the masking of the bits
// above are in the table). A code is then a shift and a lookup; with one
// high bit (Q3_K, Q5_K) two shifts, a bitwise select of the low bits and the
// high bit into one index and one lookup of the whole code; with two (Q6_K)
// two shifts and lookups and an add of the two exact integers. AVX2 has no
// 16-entry permute: there the code's bits are masked into one integer,
// converted, and the bias subtracted. Every way gives the same float, so the
// sums below do not depend on it.
//
// Computed per group g of `group` inputs, per row r and column c, in this order:
//
//   acc      = sum_i x[r, i] * float(code - bias)      (fused multiply-adds, i ascending, from 0)
//   out     += (d * sub_scale) * acc                    (one fused multiply-add)
//   out     -= (dmin * sub_min) * sum_i x[r, i]         (kinds with minimums; one fused multiply-add)
//
// the same real numbers as x @ dequantize(w), rounded in another order. A
// row's arithmetic depends on the weight's shape and the core count only
// (InputParts), never on the other rows: the few-row path (codes expanded in
// registers, up to kFewRowsMax rows) and the many-row path (each group's codes
// expanded once into an L1 buffer for all rows) do the same operations in
// the same order.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "jaxinfer/native/kquant_layer.h"
#include "jaxinfer/native/parallel.h"
#include "jaxinfer/native/vec16.h"
#include "xla/ffi/api/ffi.h"

#if !JAXINFER_VEC16
#error "the K-quant kernel needs AVX-512, or AVX2 with FMA and F16C (-march=native on a CPU without them); XLA runs it instead"
#endif

namespace ffi = xla::ffi;
namespace vec = jaxinfer::vec16;

namespace {

using jaxinfer::kquant::kQ2K;
using jaxinfer::kquant::kQ3K;
using jaxinfer::kquant::kQ4K;
using jaxinfer::kquant::kQ5K;
using jaxinfer::kquant::kQ6K;
using jaxinfer::kquant::kNone;
using jaxinfer::kquant::kPacked;
using jaxinfer::kquant::kSeparate;
using jaxinfer::kquant::kSuperBlock;
using jaxinfer::kquant::kTileColumns;
using jaxinfer::kquant::Minimums;
using jaxinfer::kquant::Shape;
using jaxinfer::kquant::ShapeOf;

constexpr int64_t kMaxTaskRows = 36;  // the many-row path's rows per task at most
using vec::kFewRowsMax;  // rows the few-row path takes (PlanKind)
using vec::kTileRows;
using vec::kTileVectors;

// A kind's numbers (kquant_layer.h, ShapeOf) as constants of the kernels'
// templates: the shifts, masks and tables compile to immediates.
template <int64_t kKind>
struct Format {
  static constexpr Shape kShape = ShapeOf(kKind);
  static constexpr int kLow = kShape.low, kHigh = kShape.high, kGroup = kShape.group, kBias = kShape.bias;
  static constexpr bool kSignedScales = kShape.signed_scales;
  static constexpr Minimums kMins = kShape.minimums;
};

// One layer of a weight (kquant_layer.h) times x into out.
struct Problem : jaxinfer::kquant::Layer {
  const float* x;
  float* out;
};

// One tile's pointers (64 columns at column tile * 64).
struct Tile {
  const uint8_t* codes;
  const uint8_t* high;
  const uint8_t* sub_scales;
  const uint8_t* sub_mins;
  const uint16_t* d;
  const uint16_t* dmin;
};

Tile TileOf(const Problem& p, int64_t tile) {
  const int64_t area = kTileColumns;
  return {p.codes + tile * p.code_rows * area,
          p.high ? p.high + tile * p.high_rows * area : nullptr,
          p.sub_scales + tile * p.groups * area,
          p.sub_mins ? p.sub_mins + tile * p.groups * area : nullptr,
          p.d + tile * p.supers * area,
          p.dmin ? p.dmin + tile * p.supers * area : nullptr};
}

#if defined(__AVX512F__)
// The tables Floats looks codes up in (vpermps reads an index's low 4 bits,
// vpermt2ps its low 5, from two tables). Kinds without high bits: the low
// bits' value at each 4-bit index (the bits above masked off by the table).
// One high bit (Q3_K, Q5_K): the whole code less the bias at each index of
// low + 1 bits (Q3_K: the table repeats every 8, masking bit 3; Q5_K: 32
// entries, LowTable then HighTable). Two (Q6_K): the low bits' value, and
// HighTable the high bits' share less the bias, (high << low) - bias.
template <int64_t kKind>
inline __m512 LowTable() {
  using F = Format<kKind>;
  alignas(64) float table[16];
  for (int i = 0; i < 16; ++i) {
    table[i] = F::kHigh == 1 ? static_cast<float>((i & ((2 << F::kLow) - 1)) - F::kBias)
                             : static_cast<float>(i & ((1 << F::kLow) - 1));
  }
  return _mm512_load_ps(table);
}

template <int64_t kKind>
inline __m512 HighTable() {
  using F = Format<kKind>;
  alignas(64) float table[16];
  for (int i = 0; i < 16; ++i) {
    table[i] = F::kHigh == 1 ? static_cast<float>(((16 + i) & ((2 << F::kLow) - 1)) - F::kBias)
                             : static_cast<float>(((i & ((1 << F::kHigh) - 1)) << F::kLow) - F::kBias);
  }
  return _mm512_load_ps(table);
}

// What Floats is handed: the two tables.
struct Tables {
  __m512 low, high;
};
template <int64_t kKind>
inline Tables TablesOf() {
  return {LowTable<kKind>(), HighTable<kKind>()};
}
#else
struct Tables {};  // AVX2 composes each code's integer instead (Run::Floats)
template <int64_t kKind>
inline Tables TablesOf() {
  return {};
}
#endif

template <int kShift>
inline vec::I ShiftedRight(vec::I v) {
  if constexpr (kShift == 0) {
    return v;
  } else {
    return vec::ShiftRight<kShift>(v);
  }
}

// v with bit kFrom of each lane at bit kTo (one shift by an immediate).
template <int kFrom, int kTo>
inline vec::I MoveBits(vec::I v) {
  if constexpr (kFrom >= kTo) {
    return ShiftedRight<kFrom - kTo>(v);
  } else {
    return vec::ShiftLeft<kTo - kFrom>(v);
  }
}

// Calls fn(std::integral_constant<int, i>) for i in [0, kCount).
template <int kCount, typename Fn>
__attribute__((always_inline)) inline void Unroll(Fn&& fn) {
  if constexpr (kCount > 0) {
    Unroll<kCount - 1>(fn);
    fn(std::integral_constant<int, kCount - 1>{});
  }
}

// Calls fn(j, std::integral_constant<int, shift>) for each run j of a group
// of kind kKind, shift the bits of the run's place in its high chunk past
// its group's (Run::HighShiftOf), a constant: a shift by an immediate is one
// micro-op, one by a register count two.
template <int64_t kKind, typename Fn>
__attribute__((always_inline)) inline void ForRunsOfGroup(Fn&& fn);

// A run of a tile's inputs: one 32-bit word of low bits per column, 32 /
// low inputs (kRun: 8 or 16), so run r's low bits of quarter q (16 columns)
// are the 64-byte line (r * 4 + q) of the plane, input u at bit low * u.
// Their high bits are in the high plane's word of the run's high chunk
// (32 / high inputs, one or more runs), at bit 8 * (u / per_byte) + high *
// (h * per_byte + u % per_byte) for the run's place h in that chunk
// (quant/kquant.py, _word_positions): so that the gguf-a8 kernel gets each
// byte's full codes with one shift and mask (q8_matmul.cc).
template <int64_t kKind>
struct Run {
  using F = Format<kKind>;
  static constexpr int kRun = 32 / F::kLow;
  static constexpr int kPerByte = 8 / F::kLow;
  // Whether a group is part of a high chunk (Q3_K: half of one) rather than
  // whole chunks (Q5_K, Q6_K): the group's place in its chunk then shifts
  // the high words first (group_shift), once a run for all its inputs.
  static constexpr bool kGroupInChunk = F::kHigh > 0 && F::kGroup < 32 / F::kHigh;
  const uint8_t* low;   // the run's quarter-0 line of low bits
  const uint8_t* high;  // the run's high chunk's quarter-0 line
  int group_shift;      // bits of the group's place in its high chunk (kGroupInChunk)

  Run(const Tile& t, int64_t run) {
    low = t.codes + run * 4 * kTileColumns;
    high = nullptr;
    group_shift = 0;
    if constexpr (F::kHigh > 0) {
      constexpr int kChunkHigh = 32 / F::kHigh;
      high = t.high + run * kRun / kChunkHigh * 4 * kTileColumns;
      if constexpr (kGroupInChunk) group_shift = F::kHigh * static_cast<int>(run * kRun % kChunkHigh / kRun) * kPerByte;
    }
  }

  // The bits of run j's place in its high chunk, past its group's place.
  template <int kRunInGroup>
  static constexpr int HighShiftOf() {
    if constexpr (F::kHigh == 0) {
      return 0;
    } else {
      return F::kHigh * (kRunInGroup * kRun % (32 / F::kHigh) / kRun) * kPerByte;
    }
  }

  // Input kInput of the run, the 16 columns of quarter kQuarter, as floats
  // (AVX-512: the tables, LowTable and HighTable). kHighShift: HighShiftOf the run.
  template <int kInput, int kQuarter, int kHighShift>
  vec::F Floats(const Tables& tables) const {
    const vec::I low_bits = ShiftedRight<F::kLow * kInput>(vec::Pinned(vec::LoadInts(low + kQuarter * kTileColumns)));
    constexpr int kHighBit = F::kHigh == 0 ? 0 : 8 * (kInput / kPerByte) + F::kHigh * (kInput % kPerByte) + kHighShift;
    vec::I high_bits{};
    if constexpr (F::kHigh > 0) {
      high_bits = vec::LoadInts(high + kQuarter * kTileColumns);
      if constexpr (kGroupInChunk) high_bits = vec::ShiftRightBy(high_bits, group_shift);
    }
#if defined(__AVX512F__)
    if constexpr (F::kHigh == 0) {
      const __m512 v = _mm512_permutexvar_ps(low_bits, tables.low);
      return F::kBias ? _mm512_sub_ps(v, _mm512_set1_ps(static_cast<float>(F::kBias))) : v;
    } else if constexpr (F::kHigh == 1) {
      // One lookup of the whole code: the low bits, and the high bit moved
      // beside them (a bitwise select, vpternlogd 0xCA: mask ? low : high).
      const __m512i index = _mm512_ternarylogic_epi32(_mm512_set1_epi32((1 << F::kLow) - 1), low_bits,
                                                      MoveBits<kHighBit, F::kLow>(high_bits), 0xCA);
      if constexpr (F::kLow == 4) {
        return _mm512_permutex2var_ps(tables.low, index, tables.high);
      } else {
        return _mm512_permutexvar_ps(index, tables.low);
      }
    } else {
      return _mm512_add_ps(_mm512_permutexvar_ps(low_bits, tables.low),
                           _mm512_permutexvar_ps(ShiftedRight<kHighBit>(high_bits), tables.high));
    }
#else
    // The code as one integer (the low bits, the high bits moved above them), less the bias.
    vec::I code = vec::And(low_bits, vec::SetInts((1 << F::kLow) - 1));
    if constexpr (F::kHigh > 0) {
      code = vec::Or(code, vec::And(MoveBits<kHighBit, F::kLow>(high_bits),
                                    vec::SetInts(((1 << F::kHigh) - 1) << F::kLow)));
    }
    const vec::F v = vec::ToFloat(code);
    return F::kBias ? vec::Sub(v, vec::Set(static_cast<float>(F::kBias))) : v;
#endif
  }
};

template <int64_t kKind, typename Fn>
__attribute__((always_inline)) inline void ForRunsOfGroup(Fn&& fn) {
  Unroll<Format<kKind>::kGroup / Run<kKind>::kRun>([&](auto run) __attribute__((always_inline)) {
    fn(run, std::integral_constant<int, Run<kKind>::template HighShiftOf<run>()>{});
  });
}

// Group g's scales (d * sub_scale) and minimums (dmin * sub_min) of the 16
// columns at 16 * k of a tile.
template <int64_t kKind>
inline void GroupScales(const Tile& t, int64_t g, int k, vec::F* scale, vec::F* minimum) {
  using F = Format<kKind>;
  const int64_t s = g * F::kGroup / kSuperBlock;
  const uint8_t* bytes = t.sub_scales + g * kTileColumns + 16 * k;
  vec::I sub;
  if constexpr (F::kSignedScales) {
    sub = vec::FromSignedBytes(bytes);
  } else {
    sub = vec::FromBytes(bytes);
  }
  if constexpr (F::kMins == kPacked) sub = vec::And(sub, vec::SetInts(0x0F));
  *scale = vec::Mul(vec::FromHalves(t.d + s * kTileColumns + 16 * k), vec::ToFloat(sub));
  if constexpr (F::kMins != kNone) {
    vec::I m;
    if constexpr (F::kMins == kPacked) {
      m = vec::ShiftRight<4>(vec::FromBytes(bytes));
    } else {
      m = vec::FromBytes(t.sub_mins + g * kTileColumns + 16 * k);
    }
    *minimum = vec::Mul(vec::FromHalves(t.dmin + s * kTileColumns + 16 * k), vec::ToFloat(m));
  }
}

// result (kRowFloats floats a row, rows [row0, row0 + kRows)) += group g's
// dots acc[.][v] of vector v, scaled, less the minimums times the group's
// sums of x.
template <int64_t kKind, int kRows, int kVectors, int kRowFloats = 16 * kVectors>
__attribute__((always_inline)) inline void FoldVector(const Problem& p, const vec::F (&acc)[kRows][kVectors], int v,
                                                      vec::F scale, vec::F minimum, int64_t g, int64_t row0,
                                                      const float* x_sums, float* result) {
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    float* out = result + (row0 + r) * kRowFloats + 16 * v;
    vec::F sum = vec::MulAdd(scale, acc[r][v], vec::Load(out));
    if constexpr (Format<kKind>::kMins != kNone) {
      sum = vec::NegMulAdd(minimum, vec::Set(x_sums[(row0 + r) * p.groups + g]), sum);
    }
    vec::Store(out, sum);
  }
}

// FoldVector for every vector; vector v is vector v % 4 of tile tiles[v / 4].
template <int64_t kKind, int kRows, int kVectors>
__attribute__((always_inline)) inline void FoldGroup(const Problem& p, const Tile* tiles,
                                                     const vec::F (&acc)[kRows][kVectors], int64_t g, int64_t row0,
                                                     const float* x_sums, float* result) {
#pragma GCC unroll 16
  for (int v = 0; v < kVectors; ++v) {
    vec::F scale, minimum = vec::Zero();
    GroupScales<kKind>(tiles[v / 4], g, v % 4, &scale, &minimum);
    FoldVector<kKind, kRows, kVectors>(p, acc, v, scale, minimum, g, row0, x_sums, result);
  }
}

// The few-row path: rows [row0, row0 + kRows) x 16 * kVectors columns
// (kVectors / 4 tiles), group g, each code expanded in registers as it is
// used (at a few rows a store and a load of each would cost more than the
// multiply-adds it serves). kRows * kVectors <= 16 accumulators hide the
// multiply-add's latency.
template <int64_t kKind, int kRows, int kVectors>
void FewRowsGroup(const Problem& p, const Tile* tiles, int64_t g, int64_t row0, const float* x_sums,
                  float* result) {
  using F = Format<kKind>;
  constexpr int kTiles = kVectors / 4;
  const Tables tables = TablesOf<kKind>();
  vec::F acc[kRows][kVectors];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = vec::Zero();
  const float* x = p.x + row0 * p.in + g * F::kGroup;
  constexpr int kRun = Run<kKind>::kRun;
  ForRunsOfGroup<kKind>([&](int64_t run, auto high_shift) __attribute__((always_inline)) {
    const int64_t index = g * (F::kGroup / kRun) + run;  // the run's index in the tile
    // Tile by tile, so that only one tile's code lines are live beside the
    // accumulators: input by input over all tiles kept every tile's lines
    // live, more than the 32 registers, and g++ spilled them to the stack
    // (368 stack accesses in the Q4_K one-row loop). Each accumulator still
    // takes its inputs in order, so the sums are the same.
    Unroll<kTiles>([&](auto l) __attribute__((always_inline)) {
      const Run<kKind> codes(tiles[l], index);
      if constexpr (vec::kVecRegisters == 32) {
        Unroll<kRun>([&](auto input) __attribute__((always_inline)) {
          vec::F xi[kRows];
          for (int r = 0; r < kRows; ++r) xi[r] = vec::Set(x[r * p.in + run * kRun + input]);
          Unroll<4>([&](auto quarter) __attribute__((always_inline)) {
            const vec::F w = codes.template Floats<input, quarter, decltype(high_shift)::value>(tables);
            for (int r = 0; r < kRows; ++r) acc[r][4 * l + quarter] = vec::MulAdd(w, xi[r], acc[r][4 * l + quarter]);
          });
        });
      } else {
        // AVX2: quarter by quarter, so that only one quarter's code lines
        // are live beside the sums (input by input, g++ kept every
        // quarter's shifted lines on the stack); x is broadcast from memory.
        Unroll<4>([&](auto quarter) __attribute__((always_inline)) {
          Unroll<kRun>([&](auto input) __attribute__((always_inline)) {
            const vec::F w = codes.template Floats<input, quarter, decltype(high_shift)::value>(tables);
            for (int r = 0; r < kRows; ++r) {
              acc[r][4 * l + quarter] = vec::MulAdd(w, vec::Set(x[r * p.in + run * kRun + input]), acc[r][4 * l + quarter]);
            }
          });
        });
      }
    });
  });
  FoldGroup<kKind, kRows, kVectors>(p, tiles, acc, g, row0, x_sums, result);
}

// Every row (at most kFewRowsMax) x 16 * kVectors columns from column tile
// `tile`, groups [g_begin, g_end), written to out [rows, out_features].
template <int64_t kKind, int kVectors>
void FewRowsTask(const Problem& p, int64_t tile, int64_t g_begin, int64_t g_end, const float* x_sums, float* out) {
  constexpr int64_t kWidth = 16 * kVectors;
  Tile tiles[kVectors / 4];
  for (int l = 0; l < kVectors / 4; ++l) tiles[l] = TileOf(p, tile + l);
  alignas(64) float result[kFewRowsMax * kWidth];
  std::fill_n(result, p.rows * kWidth, 0.0f);
  for (int64_t g = g_begin; g < g_end; ++g) {
    if constexpr (kVectors == 16) {
      FewRowsGroup<kKind, 1, 16>(p, tiles, g, 0, x_sums, result);
    } else if constexpr (kVectors == 8) {
      if (p.rows == 1) {
        FewRowsGroup<kKind, 1, 8>(p, tiles, g, 0, x_sums, result);
      } else {
        FewRowsGroup<kKind, 2, 8>(p, tiles, g, 0, x_sums, result);
      }
    } else {
      for (int64_t row = 0; row < p.rows;) {  // row tiles of 4, 3, 2 and 1 (AVX2: one row)
        const int64_t left = p.rows - row;
        if constexpr (kFewRowsMax == 1) {
          FewRowsGroup<kKind, 1, 4>(p, tiles, g, row, x_sums, result), row += 1;
        } else if (left >= 4 && left != 5 && left != 6) {
          FewRowsGroup<kKind, 4, 4>(p, tiles, g, row, x_sums, result), row += 4;
        } else if (left >= 3) {
          FewRowsGroup<kKind, 3, 4>(p, tiles, g, row, x_sums, result), row += 3;
        } else if (left == 2) {
          FewRowsGroup<kKind, 2, 4>(p, tiles, g, row, x_sums, result), row += 2;
        } else {
          FewRowsGroup<kKind, 1, 4>(p, tiles, g, row, x_sums, result), row += 1;
        }
      }
    }
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    std::copy_n(result + r * kWidth, kWidth, out + r * p.out_features + tile * kTileColumns);
  }
}

// Group g's codes of a tile as floats, w[i * 64 + c], then its scales and
// minimums (GroupScales), w[(group + 0 or 1) * 64 + c]: the many-row path's
// L1 buffer, read by every row tile of the task.
template <int64_t kKind>
void GroupCodes(const Tile& t, int64_t g, float* w) {
  using F = Format<kKind>;
  for (int k = 0; k < 4; ++k) {
    vec::F scale, minimum = vec::Zero();
    GroupScales<kKind>(t, g, k, &scale, &minimum);
    vec::Store(w + F::kGroup * kTileColumns + 16 * k, scale);
    vec::Store(w + (F::kGroup + 1) * kTileColumns + 16 * k, minimum);
  }
  constexpr int kRun = Run<kKind>::kRun;
  const Tables tables = TablesOf<kKind>();
  ForRunsOfGroup<kKind>([&](int64_t run, auto high_shift) __attribute__((always_inline)) {
    const Run<kKind> codes(t, g * (F::kGroup / kRun) + run);
    float* rows = w + run * kRun * kTileColumns;
    Unroll<kRun>([&](auto input) __attribute__((always_inline)) {
      Unroll<4>([&](auto quarter) __attribute__((always_inline)) {
        vec::Store(rows + input * kTileColumns + 16 * quarter,
                   codes.template Floats<input, quarter, decltype(high_shift)::value>(tables));
      });
    });
  });
}

// Asks for group g's code rows of a tile while the group before is multiplied.
template <int64_t kKind>
__attribute__((always_inline)) inline void PrefetchGroup(const Tile& t, int64_t g) {
  using F = Format<kKind>;
  for (int j = 0; j < F::kGroup * F::kLow / 8; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(t.codes + (g * F::kGroup * F::kLow / 8 + j) * kTileColumns),
                 _MM_HINT_T0);
  }
  if constexpr (F::kHigh > 0) {  // the group's high lines: whole high chunks, or a part of one
    constexpr int kLines = F::kGroup * F::kHigh / 8 < 4 ? 4 : F::kGroup * F::kHigh / 8;
    const int64_t first = g * F::kGroup * F::kHigh / 32 * 4;
    for (int j = 0; j < kLines; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(t.high + (first + j) * kTileColumns), _MM_HINT_T0);
    }
  }
}

// Rows [row0, row0 + kRows) x the 64 columns of a tile, group g, from the
// group's codes, scales and minimums as floats (w, GroupCodes):
// FewRowsGroup's operations in its order (vec16.h's TileDots).
template <int64_t kKind, int kRows>
void TileGroup(const Problem& p, const float* w, int64_t g, int64_t row0, const float* x_sums, float* result) {
  using F = Format<kKind>;
  vec::TileDots<kRows>(
      p.x + row0 * p.in + g * F::kGroup, p.in, w, std::integral_constant<int64_t, F::kGroup>{},
      [&](const vec::F (&acc)[kRows][kTileVectors], int pass) __attribute__((always_inline)) {
#pragma GCC unroll 4
        for (int k = 0; k < kTileVectors; ++k) {
          const int v = pass + k;
          FoldVector<kKind, kRows, kTileVectors, kTileColumns>(
              p, acc, k, vec::Load(w + F::kGroup * kTileColumns + 16 * v),
              vec::Load(w + (F::kGroup + 1) * kTileColumns + 16 * v), g, row0, x_sums, result + 16 * pass);
        }
      });
}

// Rows [row_begin, row_end) x the 64 columns of tile `tile`, every group, in
// `parts` runs of groups whose sums add into the output in order (as the
// few-row path's parts do).
template <int64_t kKind>
void ManyRowsTask(const Problem& p, int64_t tile, int64_t row_begin, int64_t row_end, int64_t parts,
                  const float* x_sums) {
  using F = Format<kKind>;
  alignas(64) float w[(F::kGroup + 2) * kTileColumns];  // GroupCodes
  alignas(64) float result[kMaxTaskRows * kTileColumns];
  float* base = result - row_begin * kTileColumns;  // indexed by absolute row
  const Tile t = TileOf(p, tile);
  for (int64_t part = 0; part < parts; ++part) {
    std::fill_n(result, kMaxTaskRows * kTileColumns, 0.0f);
    for (int64_t g = p.groups * part / parts; g < p.groups * (part + 1) / parts; ++g) {
      if (g + 1 < p.groups) PrefetchGroup<kKind>(t, g + 1);
      GroupCodes<kKind>(t, g, w);
      int64_t r = row_begin;
      for (; r + kTileRows <= row_end; r += kTileRows) TileGroup<kKind, kTileRows>(p, w, g, r, x_sums, base);
      vec::ForRowsLeft(row_end - r,
                       [&](auto rows) { TileGroup<kKind, decltype(rows)::value>(p, w, g, r, x_sums, base); });
    }
    for (int64_t r = row_begin; r < row_end; ++r) {
      float* out = p.out + r * p.out_features + tile * kTileColumns;
      const float* sum = base + r * kTileColumns;
      if (part == 0) {
        std::copy_n(sum, kTileColumns, out);
      } else {
        for (int64_t c = 0; c < kTileColumns; ++c) out[c] += sum[c];
      }
    }
  }
}

// Each row's sum of x over each group, [rows, groups]: what the minimums multiply.
std::vector<float> GroupSums(const Problem& p) {
  const int64_t group = p.shape.group;
  std::vector<float> sums(p.rows * p.groups);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t g = 0; g < p.groups; ++g) {
      const float* x = p.x + r * p.in + g * group;
      vec::F sum = vec::Zero();
      for (int64_t i = 0; i < group; i += 16) sum = vec::Add(sum, vec::LoadUnaligned(x + i));
      sums[r * p.groups + g] = vec::Sum(sum);
    }
  }
  return sums;
}

// One weight's product cut into tasks: run(plan, i) runs task i (any
// thread); Finish() adds the few-row path's parts past the first, in order.
struct Plan {
  Problem p;
  std::vector<float> x_sums;
  std::vector<float> partials;
  int64_t num_tasks = 0, parts = 1, row_tasks = 1, task_rows = 0, width_tiles = 1;
  void (*run)(Plan& plan, int64_t task) = nullptr;

  void Finish() {
    const int64_t size = p.rows * p.out_features;
    for (int64_t at = 0; at < static_cast<int64_t>(partials.size()); at += size)
      for (int64_t i = 0; i < size; ++i) p.out[i] += partials[at + i];
  }
};

template <int64_t kKind, int kVectors>
void RunFewRows(Plan& plan, int64_t task) {
  const Problem& p = plan.p;
  const int64_t part = task % plan.parts;
  float* out = part == 0 ? p.out : plan.partials.data() + (part - 1) * p.rows * p.out_features;
  FewRowsTask<kKind, kVectors>(p, task / plan.parts * (kVectors / 4), p.groups * part / plan.parts,
                               p.groups * (part + 1) / plan.parts, plan.x_sums.data(), out);
}

template <int64_t kKind>
void RunManyRows(Plan& plan, int64_t task) {
  const int64_t row_begin = (task % plan.row_tasks) * plan.task_rows;
  ManyRowsTask<kKind>(plan.p, task / plan.row_tasks, row_begin, std::min(plan.p.rows, row_begin + plan.task_rows),
                      plan.parts, plan.x_sums.data());
}

// Tiles per few-row task: as many as the rows need for 16 accumulators, 4
// at one row, 2 at two (where they divide the columns), else 1. A kind with
// high bits takes 2 at one row: its second code plane and table beside 16
// accumulators were more than the 32 registers, and g++ kept accumulators
// on the stack (Q6_K); 8 of them hide the multiply-add's latency behind its
// longer expansion of the codes. AVX2: 1 (one tile's 4 vectors of sums are
// half its 16 registers).
int64_t TaskTiles(int64_t rows, int64_t tiles, bool high_bits = false) {
  if (vec::kVecRegisters < 32) return 1;
  if (rows == 1 && tiles % 4 == 0 && !high_bits) return 4;
  if (rows <= 2 && tiles % 2 == 0) return 2;
  return 1;
}

template <int64_t kKind>
void PlanKind(Plan& plan, int64_t workers) {
  const Problem& p = plan.p;
  const int64_t tiles = p.Tiles();
  // The input parts are sized for the one-row tasks of a kind without high
  // bits (the fewest), and so for every row count and kind alike: a row's sums never depend on the rows beside
  // it. (A 256-column weight at one row is one task of 4 tiles: in 2 parts,
  // both cores take one.)
  plan.parts = jaxinfer::InputParts(tiles / TaskTiles(1, tiles), p.groups, workers);
  if (p.rows <= kFewRowsMax) {
    plan.partials.resize((plan.parts - 1) * p.rows * p.out_features);
    const int64_t width = TaskTiles(p.rows, tiles, Format<kKind>::kHigh > 0);
    plan.num_tasks = tiles / width * plan.parts;
    if constexpr (vec::kVecRegisters == 32) {  // wider tasks: TaskTiles
      if constexpr (Format<kKind>::kHigh == 0) {
        if (width == 4) return void(plan.run = RunFewRows<kKind, 16>);
      }
      if (width == 2) return void(plan.run = RunFewRows<kKind, 8>);
    }
    plan.run = RunFewRows<kKind, 4>;
    return;
  }
  int64_t row_tasks = (p.rows + kMaxTaskRows - 1) / kMaxTaskRows;
  // Equal tasks in a multiple of the workers, where the rows allow.
  while (tiles * row_tasks % workers != 0 && row_tasks * kTileRows < p.rows) ++row_tasks;
  plan.row_tasks = row_tasks;
  plan.task_rows = (p.rows + row_tasks - 1) / row_tasks;
  plan.num_tasks = row_tasks * tiles;
  plan.run = RunManyRows<kKind>;
}

// A kind's planner (PlanKind).
using Planner = void (*)(Plan& plan, int64_t workers);

#if defined(JAXINFER_KQUANT_KIND)
}  // namespace

// A kind library: PlanKind of one kind and the kernels it runs, nothing
// else. kquant_matmul.py gives its planner to the handler library's table.
extern "C" void* JaxinferKQuantPlanner() { return reinterpret_cast<void*>(&PlanKind<JAXINFER_KQUANT_KIND>); }

#else
// The planner of each kind whose library is loaded (null until then). Why
// apart: the kernels of all five kinds took 25 s to compile with AVX-512
// (g++ 12), and a file holds two or three kinds (Q4_K_M: Q4_K and Q6_K).
std::atomic<Planner> planners[5] = {};

ffi::Error PlanProduct(Plan& plan, int64_t workers) {
  const Planner planner = planners[plan.p.kind].load(std::memory_order_acquire);
  if (planner == nullptr) {
    static const char* const names[] = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("k-quant matmul: the kernel of ") + names[plan.p.kind] +
                          " is not loaded (kquant_matmul.py loads a kind's when a call with its weights is traced)");
  }
  if (plan.p.shape.minimums) plan.x_sums = GroupSums(plan.p);
  planner(plan, workers);
  return ffi::Error::Success();
}

// Checks one weight's buffers against x and describes its product in *problem.
ffi::Error Describe(const ffi::Buffer<ffi::F32>& x, int64_t layer, int64_t kind, ffi::AnyBuffer codes,
                    ffi::AnyBuffer high, ffi::AnyBuffer sub_scales, ffi::AnyBuffer sub_mins, ffi::AnyBuffer d,
                    ffi::AnyBuffer dmin, float* out, Problem* problem) {
  ffi::Error error = jaxinfer::kquant::DescribeLayer("k-quant matmul", x, layer, kind, codes, high, sub_scales,
                                                     sub_mins, d, dmin, problem);
  problem->x = x.typed_data();
  problem->out = out;
  return error;
}

// x times one layer of each of several weights, in one parallel loop (the
// weights' tasks one after another, in the order of their memory).
ffi::Error KQuantMatmulsImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layers,
                             ffi::RemainingArgs weights, ffi::RemainingRets outs, ffi::Span<const int64_t> kinds,
                             ffi::Span<const int64_t> stacks) {
  const int64_t workers = jaxinfer::NumWorkers(thread_pool);
  std::vector<std::unique_ptr<Plan>> plans;
  ffi::Error error = jaxinfer::kquant::ForEachWeight(
      "k-quant matmul", layers, weights, outs, kinds, stacks,
      [&](int64_t, int64_t layer, int64_t kind, ffi::AnyBuffer* a, float* out) {
        plans.push_back(std::make_unique<Plan>());
        ffi::Error described = Describe(x, layer, kind, a[0], a[1], a[2], a[3], a[4], a[5], out, &plans.back()->p);
        return described.failure() ? described : PlanProduct(*plans.back(), workers);
      });
  if (error.failure()) return error;
  jaxinfer::RunPlans(thread_pool, plans);
  return ffi::Error::Success();
}

}  // namespace

// Installs a kind library's planner (JaxinferKQuantPlanner) for kind.
extern "C" void JaxinferKQuantSetPlanner(int64_t kind, void* planner) {
  planners[kind].store(reinterpret_cast<Planner>(planner), std::memory_order_release);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferKQuantMatmuls, KQuantMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layers
                                  .RemainingArgs()               // six arrays of each stack
                                  .RemainingRets()               // each weight's out
                                  .Attr<ffi::Span<const int64_t>>("kinds")
                                  .Attr<ffi::Span<const int64_t>>("stacks"));
#endif  // JAXINFER_KQUANT_KIND
