// Sixteen 32-bit lanes, as the exact kernels (kquant_matmul.cc, matmul.cc's
// tiled paths) work on them: one AVX-512 register, or two AVX2 registers
// (lanes 0-7 and 8-15) where the CPU has AVX2, FMA and F16C but no AVX-512. Every operation here
// acts lane by lane, so a kernel written on these computes the same numbers
// on both, in the same order; only what the registers hold at once differs
// (16 ymm against 32 zmm: the kernel sizes its register tiles by
// kVecRegisters).
//
// Why two halves rather than a kernel of 8 lanes: the tiled layouts
// (quant/kquant.py, quant/tensor.py) put 16 columns in each 64-byte line, and
// a lane of 32 bits holds one column's codes; read as two 32-byte halves,
// the line's lanes keep their columns and every shift and mask is the same.
#pragma once

#include <cstdint>

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
inline float Sum(F v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

#endif

}  // namespace jaxinfer::vec16
#endif  // JAXINFER_VEC16
