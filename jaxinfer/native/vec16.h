// Sixteen 32-bit lanes, as the native kernels' vector paths work on them
// (kquant_matmul.cc, matmul.cc's tiled paths, q8_matmul.cc with byte
// operations of its own, paged_attention.cc's float pool and softmax): one
// AVX-512 register, or two AVX2 registers (lanes 0-7 and 8-15) where the
// CPU has AVX2, FMA and F16C but no AVX-512. Every
// operation here acts lane by lane (but Sum and MaxOf), so a kernel written
// on these computes the same numbers on both, in the same order; only what
// the registers hold at once differs (16 ymm against 32 zmm: the kernel
// sizes its register tiles by kVecRegisters).
//
// Why two halves rather than a kernel of 8 lanes: the tiled layouts
// (quant/kquant.py, quant/tensor.py) put 16 columns in each 64-byte line, and
// a lane of 32 bits holds one column's codes; read as two 32-byte halves,
// the line's lanes keep their columns and every shift and mask is the same.
#pragma once

#include <cstdint>
#include <type_traits>

// JAXINFER_VEC16: whether this build has them (AVX-512, or AVX2 with FMA and
// F16C); without, this header defines nothing and a kernel that needs it
// says so (kquant_matmul.cc) or leaves out its paths built on it (matmul.cc).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define JAXINFER_VEC16 1
#else
#define JAXINFER_VEC16 0
#endif

#if JAXINFER_VEC16
#include <immintrin.h>

namespace jaxinfer::vec16 {

#if defined(__AVX512F__)

constexpr int kVecRegisters = 32;  // vector registers the compiler can keep values in

using F = __m512;   // 16 floats
using I = __m512i;  // 16 int32

inline F Load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline F LoadUnaligned(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, F v) { _mm512_store_ps(p, v); }  // 64-byte aligned
inline I LoadInts(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 64 bytes as 16 int32
inline F Set(float v) { return _mm512_set1_ps(v); }
inline I SetInts(int32_t v) { return _mm512_set1_epi32(v); }
inline F Zero() { return _mm512_setzero_ps(); }
inline F Add(F a, F b) { return _mm512_add_ps(a, b); }
inline F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F MulAdd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }      // a * b + c, one rounding
inline F Div(F a, F b) { return _mm512_div_ps(a, b); }
inline F Min(F a, F b) { return _mm512_min_ps(a, b); }  // b where either is NaN
inline F Abs(F v) { return _mm512_abs_ps(v); }
inline I ToInts(F v) { return _mm512_cvtps_epi32(v); }  // rounded to nearest even: exact for whole numbers
inline I AddInts(I a, I b) { return _mm512_add_epi32(a, b); }
inline I SubInts(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I MulInts(I a, I b) { return _mm512_mullo_epi32(a, b); }  // the product's low 32 bits
inline int32_t SumInts(I v) { return _mm512_reduce_add_epi32(v); }
inline F NegMulAdd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline I And(I a, I b) { return _mm512_and_si512(a, b); }
inline I Or(I a, I b) { return _mm512_or_si512(a, b); }
template <int kBits>
inline I ShiftRight(I v) { return _mm512_srli_epi32(v, kBits); }
template <int kBits>
inline I ShiftLeft(I v) { return _mm512_slli_epi32(v, kBits); }
inline I ShiftRightBy(I v, int bits) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(bits)); }
inline F ToFloat(I v) { return _mm512_cvtepi32_ps(v); }
inline I FromSignedBytes(const uint8_t* p) {  // 16 int8 as int32
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline I FromBytes(const uint8_t* p) {  // 16 uint8 as int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline F FromHalves(const uint16_t* p) {  // 16 float16 as float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline float Sum(F v) { return _mm512_reduce_add_ps(v); }
inline void StoreUnaligned(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F Max(F a, F b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline float MaxOf(F v) { return _mm512_reduce_max_ps(v); }
inline F RoundNearest(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// v * 2^n for integral n (one rounding: 0 or a subnormal below the float range).
inline F ScaleByPowerOf2(F v, F n) { return _mm512_scalef_ps(v, n); }

// Which lanes an operation touches: lane i where pos + i is in [first, last).
using M = __mmask16;
inline M LanesIn(int64_t pos, int64_t first, int64_t last) {
  const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(pos)),
                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(static_cast<int32_t>(first))) &
         _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32(static_cast<int32_t>(last)));
}
inline F LoadMasked(M m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // 0 in the other lanes
inline void StoreMasked(float* p, M m, F v) { _mm512_mask_storeu_ps(p, m, v); }
inline F Masked(M m, F v) { return _mm512_maskz_mov_ps(m, v); }                        // 0 in the other lanes
inline F MaxMasked(F acc, M m, F v) { return _mm512_mask_max_ps(acc, m, acc, v); }  // acc in the other lanes
// With 32 registers g++ schedules the kernels well as they are (see the AVX2 Pinned).
inline I Pinned(I v) { return v; }
inline F Pinned(F v) { return v; }

#else

constexpr int kVecRegisters = 16;

struct F {
  __m256 lo, hi;
};
struct I {
  __m256i lo, hi;
};

inline F Load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline F LoadUnaligned(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void Store(float* p, F v) { _mm256_store_ps(p, v.lo), _mm256_store_ps(p + 8, v.hi); }
inline I LoadInts(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline F Set(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline I SetInts(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline F Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F Add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F Sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F Mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F MulAdd(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F NegMulAdd(F a, F b, F c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F Div(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F Min(F a, F b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F Abs(F v) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, v.lo), _mm256_andnot_ps(sign, v.hi)};
}
inline I ToInts(F v) { return {_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi)}; }
inline I AddInts(I a, I b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I SubInts(I a, I b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline I MulInts(I a, I b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline int32_t SumInts(I v) {
  const __m256i s = _mm256_add_epi32(v.lo, v.hi);
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
  return _mm_cvtsi128_si32(q);
}
inline I And(I a, I b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline I Or(I a, I b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
template <int kBits>
inline I ShiftRight(I v) { return {_mm256_srli_epi32(v.lo, kBits), _mm256_srli_epi32(v.hi, kBits)}; }
template <int kBits>
inline I ShiftLeft(I v) { return {_mm256_slli_epi32(v.lo, kBits), _mm256_slli_epi32(v.hi, kBits)}; }
inline I ShiftRightBy(I v, int bits) {
  const __m128i count = _mm_cvtsi32_si128(bits);
  return {_mm256_srl_epi32(v.lo, count), _mm256_srl_epi32(v.hi, count)};
}
inline F ToFloat(I v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
// v, which the compiler may no longer assume it knows (an empty asm, no
// instruction): what is computed from it stays after this point, in
// program order. With 16 registers, g++ otherwise computed every input's
// shifted code lines of a run ahead and kept them on the stack.
inline I Pinned(I v) {
  asm volatile("" : "+x"(v.lo), "+x"(v.hi));
  return v;
}
// v in registers (g++ otherwise reloads it from memory at each use).
inline F Pinned(F v) {
  asm volatile("" : "+x"(v.lo), "+x"(v.hi));
  return v;
}
inline I FromSignedBytes(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi32(bytes), _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))};
}
inline I FromBytes(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
}
inline F FromHalves(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// The 16 lanes folded by op (halves, then quarters, pairs and lanes) into one float.
template <typename Op>
inline float Fold(F v, Op op) {
  const __m256 s = op(v.lo, v.hi);
  __m128 q = op(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = op(q, _mm_movehl_ps(q, q));
  q = op(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
struct AddLanes {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_add_ps(a, b); }
};
struct MaxLanes {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_max_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_max_ps(a, b); }
};
inline float Sum(F v) { return Fold(v, AddLanes{}); }
inline float MaxOf(F v) { return Fold(v, MaxLanes{}); }
inline void StoreUnaligned(float* p, F v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline F Max(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F RoundNearest(F v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kMode), _mm256_round_ps(v.hi, kMode)};
}
// v * 2^n for integral n in [-150, 127], as two exact powers of two built in
// the exponent bits (AVX2 has no vscalefps): 2^max(n, -126), then the rest
// (at most 2^-24), so only results below the normal range round, possibly twice.
inline F ScaleByPowerOf2(F v, F n) {
  auto half = [](__m256 v, __m256 n) {
    const __m256i whole = _mm256_cvtps_epi32(n);
    const __m256i first = _mm256_max_epi32(whole, _mm256_set1_epi32(-126));
    const auto power = [](__m256i e) {  // 2^e for e in [-126, 127]: the biased exponent's bits
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    };
    return _mm256_mul_ps(_mm256_mul_ps(v, power(first)), power(_mm256_sub_epi32(whole, first)));
  };
  return {half(v.lo, n.lo), half(v.hi, n.hi)};
}

// Which lanes an operation touches (all ones in a lane it does): lane i
// where pos + i is in [first, last).
struct M {
  __m256i lo, hi;
};
inline M LanesIn(int64_t pos, int64_t first, int64_t last) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(first) - 1);
  const __m256i end = _mm256_set1_epi32(static_cast<int32_t>(last));
  auto half = [&](int64_t at) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(at)), lanes);
    return _mm256_and_si256(_mm256_cmpgt_epi32(index, below), _mm256_cmpgt_epi32(end, index));
  };
  return {half(pos), half(pos + 8)};
}
inline F LoadMasked(M m, const float* p) { return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)}; }
inline void StoreMasked(float* p, M m, F v) {
  _mm256_maskstore_ps(p, m.lo, v.lo), _mm256_maskstore_ps(p + 8, m.hi, v.hi);
}
inline F Masked(M m, F v) {
  return {_mm256_and_ps(_mm256_castsi256_ps(m.lo), v.lo), _mm256_and_ps(_mm256_castsi256_ps(m.hi), v.hi)};
}
inline F MaxMasked(F acc, M m, F v) {
  return {_mm256_blendv_ps(acc.lo, _mm256_max_ps(acc.lo, v.lo), _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(acc.hi, _mm256_max_ps(acc.hi, v.hi), _mm256_castsi256_ps(m.hi))};
}

#endif

// The register budget of the exact kernels' two paths (matmul.cc's tiled
// paths, kquant_matmul.cc), one rule for both:
// - the many-row path's register tile, kTileRows rows x kTileVectors vectors
//   of partial sums beside the kTileVectors weight vectors they multiply
//   (AVX-512 24 + 4 of 32 registers; AVX2, two registers a vector, 12 + 2 of
//   16, a tile's 64 columns in four passes);
// - the rows the few-row path takes at most, expanding the codes in
//   registers for each row tile: 8 on AVX-512; on AVX2 one row's 4 vectors
//   of sums (8 registers) beside a code line's expansion, and 2 rows on go
//   through the many-row path's L1 buffer (expanding the codes again for each
//   further row cost more: batch 8 of a 0.47B Q4_K_M 241 ms a step, against
//   200 with matmul.cc's int4 copy, BENCHMARKS.md).
constexpr int kTileRows = 6;
constexpr int kTileVectors = kVecRegisters == 32 ? 4 : 1;
constexpr int kFewRowsMax = kVecRegisters == 32 ? 8 : 1;

// The many-row path's register tile, written once for both kernels: kRows
// rows (at most kTileRows) times one group of a 64-column tile whose codes
// are expanded to floats, w[64 * i + c] for the group's input i (each
// kernel's GroupCodes). For each pass over kTileVectors of the tile's 4
// vectors of columns, acc[r][k] = the sum over the group's inputs i, in
// order from 0, of x[r * x_stride + i] * w[16 * (4 * i + pass + k)], then
// fold(acc, pass) adds it to the row's result with the kernel's scales. That
// order is the few-row path's too, so a row's result never depends on the
// rows beside it. group: an int64_t, or a std::integral_constant where the
// kernel knows it (the loop then unrolls as before).
template <int kRows, typename Group, typename Fold>
__attribute__((always_inline)) inline void TileDots(const float* x, int64_t x_stride, const float* w, Group group,
                                                    Fold&& fold) {
#pragma GCC unroll 4
  for (int pass = 0; pass < 4; pass += kTileVectors) {
    F acc[kRows][kTileVectors];
    for (int r = 0; r < kRows; ++r)
      for (int k = 0; k < kTileVectors; ++k) acc[r][k] = Zero();
    for (int64_t i = 0; i < group; ++i) {
      F wi[kTileVectors];
      // One load for all rows (on AVX2 g++ folded a load into each row's multiply-add).
      for (int k = 0; k < kTileVectors; ++k) wi[k] = Pinned(Load(w + 16 * (4 * i + pass + k)));
      for (int r = 0; r < kRows; ++r) {
        const F xi = Set(x[r * x_stride + i]);
        for (int k = 0; k < kTileVectors; ++k) acc[r][k] = MulAdd(wi[k], xi, acc[r][k]);
      }
    }
    fold(acc, pass);
  }
}

// tile(std::integral_constant<int, left>{}) for the rows left after the row
// tiles (0 < left < kTileRows; nothing for 0): a tile's rows are a template
// argument, so that its sums stay in registers.
template <int kRows = kTileRows - 1, typename Tile>
inline void ForRowsLeft(int64_t left, Tile&& tile) {
  if constexpr (kRows > 0) {
    if (left == kRows) return tile(std::integral_constant<int, kRows>{});
    ForRowsLeft<kRows - 1>(left, tile);
  }
}

}  // namespace jaxinfer::vec16
#endif  // JAXINFER_VEC16
