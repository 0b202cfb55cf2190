// Matmul of float32 activations by grouped int8 / int4 weights, with the
// activations quantized to int8 on the fly in blocks of 32 inputs (the way
// llama.cpp multiplies its Q4/Q8 blocks by Q8 activations), for XLA:CPU
// through the XLA FFI (native/matmul.py builds and registers it).
//
// Why: past a few rows a float32 matmul is compute-bound on the dev VM's two
// cores (16 multiply-adds per AVX-512 FMA, 8 per AVX2 one). An int8 x uint8
// dot does 64 per instruction (AVX512-VNNI vpdpbusd; AVX2's vpmaddubsw and
// vpmaddwd: 32 in two) and needs no float copy of the weight, so the whole
// step runs on the codes as stored. Built where vec16.h is (AVX-512 with BW
// and VNNI, or AVX2 with FMA and F16C); elsewhere (AVX-512 without VNNI
// among them) the build fails on purpose and quant/linear.py runs the same
// numbers in XLA.
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
// order: the integer sums are exact (on both instruction sets, so both give
// the same numbers). quant/linear.py's XLA path computes that x' and
// multiplies it in float, the reference the tests hold this to.
//
// Layout trick: the dot multiplies 4 adjacent bytes of each 32-bit lane
// and adds them into the lane. Four weight rows of 64 columns, transposed
// byte-wise in registers (unpack 8 then 16 bit), give 4 vectors whose lanes
// each hold 4 consecutive input rows of one column, so one dot advances 16
// columns by 4 inputs against an activation dword broadcast to every lane,
// and the sums never need a horizontal add. The transposition leaves column
// 16 * l + 4 * k + i in lane 4 * l + i of vector k (l the 128-bit lane:
// AVX2's two registers unpack within the same lanes); scales and results go
// through the matching 4 x 4 shuffle of 128-bit lanes (TransposeLanes),
// which is its own inverse.
#include "jaxinfer/native/vec16.h"

#if defined(__AVX512F__) ? !(defined(__AVX512BW__) && defined(__AVX512VNNI__)) : !JAXINFER_VEC16
#error "the Q8-activation matmul needs AVX512-VNNI, or AVX2 with FMA and F16C (-march=native on a CPU without them); XLA runs it instead"
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

namespace vec = jaxinfer::vec16;
using vec::F;
using vec::I;

// The byte-wise operations of the int8 dots on vec16's 64 bytes (I): one
// AVX-512 register, or two AVX2 registers that unpack and shift within the
// same 128-bit lanes, so a transposed tile holds the same columns in the
// same lanes on both.
#if defined(__AVX512F__)
// vpdpbusd multiplies unsigned by signed bytes exactly, whatever they hold:
// int8 weights go in as codes + 128 (PrepareWeights), the bias taken back off.
constexpr bool kInt8ByMagnitude = false;
inline I UnpackLow8(I a, I b) { return _mm512_unpacklo_epi8(a, b); }
inline I UnpackHigh8(I a, I b) { return _mm512_unpackhi_epi8(a, b); }
inline I UnpackLow16(I a, I b) { return _mm512_unpacklo_epi16(a, b); }
inline I UnpackHigh16(I a, I b) { return _mm512_unpackhi_epi16(a, b); }
inline I SetBytes(uint8_t v) { return _mm512_set1_epi8(static_cast<char>(v)); }
// Each 16-bit half word shifted (bits below 16).
inline I ShiftRight16(I v, int bits) { return _mm512_srl_epi16(v, _mm_cvtsi32_si128(bits)); }
inline I ShiftLeft16(I v, int bits) { return _mm512_sll_epi16(v, _mm_cvtsi32_si128(bits)); }
// sum + in each 32-bit lane the dot of u's 4 bytes (unsigned) with s's (signed).
inline I DotBytes(I sum, I u, I s) { return _mm512_dpbusd_epi32(sum, u, s); }
// The same for two pairs (u0, s0), (u1, s1), where each u byte is at most 64 (codes of up to 6 bits).
inline I DotBytes2(I sum, I u0, I s0, I u1, I s1) { return DotBytes(DotBytes(sum, u0, s0), u1, s1); }
// The 16 lanes' low bytes (each lane's value in [-128, 127]).
inline __m128i LowBytes(I v) { return _mm512_cvtepi32_epi8(v); }
// Quarters (128-bit lanes) a[i0], a[i1], b[i2], b[i3], kSelect = i0 | i1 << 2 | i2 << 4 | i3 << 6.
template <int kSelect>
inline F ShuffleQuarters(F a, F b) { return _mm512_shuffle_f32x4(a, b, kSelect); }
// An int8 weight vector as the dots take it (kInt8Vectors vectors), and its dot.
constexpr int kInt8Vectors = 1;
inline void PrepareInt8(I codes, I* w) { w[0] = _mm512_xor_si512(codes, SetBytes(0x80)); }
inline I DotInt8(I sum, const I* w, I x) { return DotBytes(sum, w[0], x); }
#else
// vpmaddubsw adds two products into a saturating int16: exact while
// |u0 * s0 + u1 * s1| < 2^15, so the unsigned side must stay at most 128
// (s in [-127, 127]). Codes of up to 7 bits are; int8 weights go in as |w|
// with the activations taking w's signs (vpsignb).
constexpr bool kInt8ByMagnitude = true;
inline I UnpackLow8(I a, I b) { return {_mm256_unpacklo_epi8(a.lo, b.lo), _mm256_unpacklo_epi8(a.hi, b.hi)}; }
inline I UnpackHigh8(I a, I b) { return {_mm256_unpackhi_epi8(a.lo, b.lo), _mm256_unpackhi_epi8(a.hi, b.hi)}; }
inline I UnpackLow16(I a, I b) { return {_mm256_unpacklo_epi16(a.lo, b.lo), _mm256_unpacklo_epi16(a.hi, b.hi)}; }
inline I UnpackHigh16(I a, I b) { return {_mm256_unpackhi_epi16(a.lo, b.lo), _mm256_unpackhi_epi16(a.hi, b.hi)}; }
inline I SetBytes(uint8_t v) {
  const __m256i bytes = _mm256_set1_epi8(static_cast<char>(v));
  return {bytes, bytes};
}
inline I ShiftRight16(I v, int bits) {
  const __m128i count = _mm_cvtsi32_si128(bits);
  return {_mm256_srl_epi16(v.lo, count), _mm256_srl_epi16(v.hi, count)};
}
inline I ShiftLeft16(I v, int bits) {
  const __m128i count = _mm_cvtsi32_si128(bits);
  return {_mm256_sll_epi16(v.lo, count), _mm256_sll_epi16(v.hi, count)};
}
inline I AbsBytes(I v) { return {_mm256_abs_epi8(v.lo), _mm256_abs_epi8(v.hi)}; }
// s negated where w's byte is negative, 0 where it is 0.
inline I SignBytes(I s, I w) { return {_mm256_sign_epi8(s.lo, w.lo), _mm256_sign_epi8(s.hi, w.hi)}; }
inline I DotBytes(I sum, I u, I s) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto half = [&](__m256i sum, __m256i u, __m256i s) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
  };
  return {half(sum.lo, u.lo, s.lo), half(sum.hi, u.hi, s.hi)};
}
// Two dots' products added in int16 before widening: exact while |4 products| < 2^15, so for u
// at most 64 (codes of up to 6 bits, s in [-127, 127]).
inline I DotBytes2(I sum, I u0, I s0, I u1, I s1) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto half = [&](__m256i sum, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
  };
  return {half(sum.lo, u0.lo, s0.lo, u1.lo, s1.lo), half(sum.hi, u0.hi, s0.hi, u1.hi, s1.hi)};
}
inline __m128i LowBytes(I v) {
  // packs keep values in [-128, 127]; the 256-bit pack interleaves the halves' 128-bit lanes.
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(v.lo, v.hi), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}
template <int kSelect>
inline F ShuffleQuarters(F a, F b) {
  // permute2f128's selector 0-3 names the quarters of (first, second) in order.
  constexpr int i0 = kSelect & 3, i1 = kSelect >> 2 & 3, i2 = kSelect >> 4 & 3, i3 = kSelect >> 6 & 3;
  return {_mm256_permute2f128_ps(a.lo, a.hi, i0 | i1 << 4), _mm256_permute2f128_ps(b.lo, b.hi, i2 | i3 << 4)};
}
constexpr int kInt8Vectors = 2;  // |w|, then w for its signs
inline void PrepareInt8(I codes, I* w) { w[0] = AbsBytes(codes), w[1] = codes; }
inline I DotInt8(I sum, const I* w, I x) { return DotBytes(sum, w[0], SignBytes(x, w[1])); }
#endif
// What int8 weights' dots owe back per activation code sum (the + 128 above).
constexpr int32_t kInt8Bias = kInt8ByMagnitude ? 0 : 128;

// Rows a task's dots take at once: independent dot chains for the core (a
// dot's latency is several cycles), where the registers hold two rows' 64
// columns of sums (AVX2's 16 registers hold one row's 8 beside its operands).
constexpr int kRowsTogether = vec::kVecRegisters == 32 ? 2 : 1;

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
  const F lowest = vec::Set(-127.0f), highest = vec::Set(127.0f);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t a = 0; a < blocks; ++a) {
      const float* xs = x + r * p.in + a * p.block;
      const int64_t vectors = p.block / 16;
      F amax = vec::Zero();
      for (int64_t v = 0; v < vectors; ++v) amax = vec::Max(amax, vec::Abs(vec::LoadUnaligned(xs + 16 * v)));
      float d = vec::MaxOf(amax) / 127.0f;
      if (!(d > 0.0f)) d = 1.0f;
      int8_t* codes = p.codes.data() + r * p.in + a * p.block;
      I sum = vec::SetInts(0);
      for (int64_t v = 0; v < vectors; ++v) {
        // x / d rounded half to even, as jnp.round(x / scale) does.
        const F q = vec::RoundNearest(vec::Div(vec::LoadUnaligned(xs + 16 * v), vec::Set(d)));
        const I qi = vec::ToInts(vec::Min(vec::Max(q, lowest), highest));
        sum = vec::AddInts(sum, qi);
        __m128i bytes = LowBytes(qi);
        if (p.int4) bytes = _mm_shuffle_epi8(bytes, nibble_order);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * v), bytes);
      }
      const int32_t code_sum = vec::SumInts(sum);
      p.x_scales[r * blocks + a] = d;
      p.x_sums[r * blocks + a] = d * static_cast<float>(code_sum);
      p.code_sums[r * blocks + a] = code_sum;
    }
  }
}

// Vectors v[0..3] as a 4 x 4 matrix of 128-bit lanes, transposed.
void TransposeLanes(F v[4]) {
  const F u0 = ShuffleQuarters<0x44>(v[0], v[1]), u1 = ShuffleQuarters<0xEE>(v[0], v[1]);
  const F u2 = ShuffleQuarters<0x44>(v[2], v[3]), u3 = ShuffleQuarters<0xEE>(v[2], v[3]);
  v[0] = ShuffleQuarters<0x88>(u0, u2);
  v[1] = ShuffleQuarters<0xDD>(u0, u2);
  v[2] = ShuffleQuarters<0x88>(u1, u3);
  v[3] = ShuffleQuarters<0xDD>(u1, u3);
}

// Four weight rows of 64 byte columns -> t[k]: lane 4 * l + i holds the
// rows' 4 bytes of column 16 * l + 4 * k + i.
void TransposeRows(const uint8_t* row, int64_t stride, I t[4]) {
  const I r0 = vec::LoadInts(row), r1 = vec::LoadInts(row + stride);
  const I r2 = vec::LoadInts(row + 2 * stride), r3 = vec::LoadInts(row + 3 * stride);
  const I a0 = UnpackLow8(r0, r1), a1 = UnpackHigh8(r0, r1);
  const I b0 = UnpackLow8(r2, r3), b1 = UnpackHigh8(r2, r3);
  t[0] = UnpackLow16(a0, b0);
  t[1] = UnpackHigh16(a0, b0);
  t[2] = UnpackLow16(a1, b1);
  t[3] = UnpackHigh16(a1, b1);
}

// The bytes of the weight vectors the dots take: int4 codes (per 4 byte
// rows, low and high nibbles against the even and odd inputs), int8 codes
// (PrepareInt8), or K-quant codes (unsigned, at most 6 bits, as they are).
enum class Codes { kInt4, kInt8, kKQuant };

// Vectors the dots take per transposed vector of grouped codes (TransposeRows'
// t[k]): int4 its low and high nibbles, int8 PrepareInt8's.
template <Codes kCodes>
constexpr int kCodeVectors = kCodes == Codes::kInt4 ? 2 : kInt8Vectors;
// Prepared vectors per byte row quad of 4 inputs' (int4: 8 inputs') codes and
// 64 columns (K-quants: 4, their codes as SlotCodes gives them).
template <Codes kCodes>
constexpr int kQuadVectors = kCodes == Codes::kKQuant ? 4 : 4 * kCodeVectors<kCodes>;
// A block's (at most 32 inputs: 8 quads of int8 codes, 4 of int4).
constexpr int kPreparedVectors = 8 * kQuadVectors<Codes::kInt8>;

// t's kCodeVectors vectors for the dots, into w.
template <Codes kCodes>
__attribute__((always_inline)) inline void PrepareCodes(I t, I* w) {
  if constexpr (kCodes == Codes::kInt4) {
    const I nibble = SetBytes(0x0F);
    w[0] = vec::And(t, nibble);
    w[1] = vec::And(ShiftRight16(t, 4), nibble);
  } else {
    PrepareInt8(t, w);
  }
}

// A row's activation dwords for one quad's dots, broadcast once for its 4
// column vectors: int4 the even and odd inputs' (x[2q], x[2q + 1]: against
// the low and the high nibbles), int8 x[q] (b unused), K-quants x[q] and
// x[q + 1] (two quads' codes in one DotBytes2: DotKQuant).
template <Codes kCodes>
struct QuadInputs {
  I a, b;
  __attribute__((always_inline)) QuadInputs(const int32_t* x, int64_t quad) {
    const int64_t at = kCodes == Codes::kInt4 ? 2 * quad : quad;
    a = vec::SetInts(x[at]);
    b = kCodes == Codes::kInt8 ? a : vec::SetInts(x[at + 1]);
  }
};

// sum plus the dots of one column vector's prepared codes w (PrepareCodes) with in.
template <Codes kCodes>
__attribute__((always_inline)) inline I DotCodes(I sum, const I* w, const QuadInputs<kCodes>& in) {
  if constexpr (kCodes == Codes::kInt4) {
    return DotBytes2(sum, w[0], in.a, w[1], in.b);
  } else {
    return DotInt8(sum, w, in.a);
  }
}

// sum plus the dots of K-quant codes of quad q (w0) and q + 1 (w1) with in.
__attribute__((always_inline)) inline I DotKQuant(I sum, I w0, I w1, const QuadInputs<Codes::kKQuant>& in) {
  return DotBytes2(sum, w0, in.a, w1, in.b);
}

// The weights of one activation block and 64 columns, transposed for the
// dots: per 4 byte rows, vectors kQuadVectors * quad + kCodeVectors * k
// (PrepareCodes of TransposeRows' t[k]), k = 0..3.
template <Codes kCodes>
void PrepareWeights(const uint8_t* first, int64_t stride, int64_t quads, I* w) {
  for (int64_t quad = 0; quad < quads; ++quad) {
    I t[4];
    TransposeRows(first + 4 * quad * stride, stride, t);
    for (int k = 0; k < 4; ++k) PrepareCodes<kCodes>(t[k], w + kQuadVectors<kCodes> * quad + kCodeVectors<kCodes> * k);
  }
}

// Integer dots of kRows rows' block codes (x[r], as dwords) with prepared
// weights: sum[r][k] for the 64 columns. Several rows at once give the
// core independent dot chains (kRowsTogether).
template <Codes kCodes, int kRows>
void BlockDots(const int32_t* const* x, const I* w, int64_t quads, I sum[][4]) {
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < 4; ++k) sum[r][k] = vec::SetInts(0);
  // K-quant codes two quads at a time (DotBytes2; quads is even: groups of 16 or 32 inputs).
  constexpr int64_t kStep = kCodes == Codes::kKQuant ? 2 : 1;
  for (int64_t quad = 0; quad < quads; quad += kStep) {
    const I* wq = w + kQuadVectors<kCodes> * quad;
    for (int r = 0; r < kRows; ++r) {
      const QuadInputs<kCodes> in(x[r], quad);
      for (int k = 0; k < 4; ++k) {
        if constexpr (kCodes == Codes::kKQuant) {
          sum[r][k] = DotKQuant(sum[r][k], wq[k], wq[4 + k], in);
        } else {
          sum[r][k] = DotCodes(sum[r][k], wq + kCodeVectors<kCodes> * k, in);
        }
      }
    }
  }
}

// BlockDots of one row from the weight's byte rows (first, stride) as
// PrepareWeights reads them, the prepared vectors kept in registers: with
// one row each is used once, so the buffer that rows share is skipped.
template <Codes kCodes>
void RowDotsFromCodes(const int32_t* x, const uint8_t* first, int64_t stride, int64_t quads, I sum[4]) {
  for (int k = 0; k < 4; ++k) sum[k] = vec::SetInts(0);
  for (int64_t quad = 0; quad < quads; ++quad) {
    I t[4];
    TransposeRows(first + 4 * quad * stride, stride, t);
    const QuadInputs<kCodes> in(x, quad);
    for (int k = 0; k < 4; ++k) {
      I w[kCodeVectors<kCodes>];
      PrepareCodes<kCodes>(t[k], w);
      sum[k] = DotCodes(sum[k], w, in);
    }
  }
}

// body(r, std::integral_constant<int, n>) for each run of n rows from r
// that the dots take together: kRowsTogether, and one for the last row left.
template <typename Body>
__attribute__((always_inline)) inline void ForRowGroups(int64_t rows, Body&& body) {
  for (int64_t r = 0; r < rows; r += kRowsTogether) {
    if (rows - r >= kRowsTogether) {
      body(r, std::integral_constant<int, kRowsTogether>{});
    } else {
      body(r, std::integral_constant<int, 1>{});
    }
  }
}

// 16 scales (or offsets) from `base` at element `at`, as float32.
F LoadScales(const Problem& p, const void* base, int64_t at) {
  if (p.half) return vec::FromHalves(static_cast<const uint16_t*>(base) + at);
  return vec::LoadUnaligned(static_cast<const float*>(base) + at);
}

// Adds activation block a's products for rows [row0, row0 + rows) into
// acc + r * stride (64 floats per row, in the tile's lane order: see the
// top), for the 64 columns whose byte rows start at `first`: one row
// multiplies them as they are (RowDotsFromCodes), more rows prepare them in
// the buffer w (kPreparedVectors) first and share it.
template <Codes kCodes>
void AccumulateBlock(const Problem& p, int64_t a, int64_t col, const uint8_t* first, I* w, int64_t row0,
                     int64_t rows, float* acc, int64_t stride) {
  const int64_t blocks = p.in / p.block;
  const int64_t quads = (kCodes == Codes::kInt4 ? p.block / 2 : p.block) / 4;
  if (rows > 1) PrepareWeights<kCodes>(first, p.out_features, quads, w);
  const int64_t g = a * p.block / p.group;
  F scale[4], offset[4];
  for (int k = 0; k < 4; ++k) {
    scale[k] = LoadScales(p, p.scales, g * p.out_features + col + 16 * k);
    offset[k] = p.offsets ? LoadScales(p, p.offsets, g * p.out_features + col + 16 * k) : vec::Zero();
  }
  TransposeLanes(scale);
  TransposeLanes(offset);
  ForRowGroups(rows, [&](int64_t r0, auto together) {
    constexpr int kRows = decltype(together)::value;
    const int32_t* x[kRows];
    for (int i = 0; i < kRows; ++i)
      x[i] = reinterpret_cast<const int32_t*>(p.codes.data() + (row0 + r0 + i) * p.in + a * p.block);
    I sum[kRows][4];
    if (rows == 1) {
      RowDotsFromCodes<kCodes>(x[0], first, p.out_features, quads, sum[0]);
    } else {
      BlockDots<kCodes, kRows>(x, w, quads, sum);
    }
    for (int i = 0; i < kRows; ++i) {
      const int64_t at = (row0 + r0 + i) * blocks + a;
      const F d = vec::Set(p.x_scales[at]), x_sum = vec::Set(p.x_sums[at]);
      const I bias = vec::SetInts(kCodes == Codes::kInt8 ? kInt8Bias * p.code_sums[at] : 0);
      float* out = acc + (r0 + i) * stride;
      for (int k = 0; k < 4; ++k) {
        const F dot = vec::ToFloat(vec::SubInts(sum[i][k], bias));
        F v = vec::MulAdd(dot, vec::Mul(scale[k], d), vec::LoadUnaligned(out + 16 * k));
        if (p.offsets) v = vec::MulAdd(offset[k], x_sum, v);
        vec::StoreUnaligned(out + 16 * k, v);
      }
    }
  });
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
template <Codes kCodes>
void ColumnTask(const Problem& p, int64_t row0, int64_t rows, int64_t col) {
  const int64_t byte_rows = kCodes == Codes::kInt4 ? p.block / 2 : p.block;
  alignas(64) I w[kPreparedVectors];
  alignas(64) float acc[kRowBlock * kColumns] = {};
  const int64_t blocks = p.in / p.block;
  for (int64_t a = 0; a < blocks; ++a) {
    const uint8_t* first = p.data + a * byte_rows * p.out_features + col;
    if (a + kPrefetchBlocks < blocks) Prefetch(p, a + kPrefetchBlocks, col);
    AccumulateBlock<kCodes>(p, a, col, first, w, row0, rows, acc, kColumns);
  }
  for (int64_t r = 0; r < rows; ++r) {
    F v[4];
    for (int k = 0; k < 4; ++k) v[k] = vec::Load(acc + r * kColumns + 16 * k);
    TransposeLanes(v);
    for (int k = 0; k < 4; ++k) vec::StoreUnaligned(p.out + (row0 + r) * p.out_features + col + 16 * k, v[k]);
  }
}

// Few rows of a wide weight: one task is every row and columns [col_begin,
// col_end) over input blocks [begin, end), walking each block's weight rows
// front to back (every column tile of the part before the next block),
// summed into those columns of its block range's partial [rows, out] (lane
// order). Column strips would read a 64-byte piece of every row, a new page
// each time.
template <Codes kCodes>
void BlockRangeTask(const Problem& p, int64_t begin, int64_t end, int64_t col_begin, int64_t col_end,
                    float* partial) {
  const int64_t byte_rows = kCodes == Codes::kInt4 ? p.block / 2 : p.block;
  alignas(64) I w[kPreparedVectors];
  for (int64_t r = 0; r < p.rows; ++r) {
    std::fill(partial + r * p.out_features + col_begin, partial + r * p.out_features + col_end, 0.0f);
  }
  for (int64_t a = begin; a < end; ++a) {
    for (int64_t col = col_begin; col < col_end; col += kColumns) {
      AccumulateBlock<kCodes>(p, a, col, p.data + a * byte_rows * p.out_features + col, w, 0, p.rows, partial + col,
                              p.out_features);
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
  // byte rows, at most kPreparedVectors prepared weight vectors.
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
        BlockRangeTask<Codes::kInt4>(p, begin, end, col_begin, col_end, partial);
      } else {
        BlockRangeTask<Codes::kInt8>(p, begin, end, col_begin, col_end, partial);
      }
    });
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t col = 0; col < p.out_features; col += kColumns) {
        F v[4];
        for (int k = 0; k < 4; ++k) {
          const float* first = partials.data() + r * p.out_features + col + 16 * k;
          v[k] = vec::LoadUnaligned(first);
          for (int64_t c = 1; c < chunks; ++c) {
            v[k] = vec::Add(v[k], vec::LoadUnaligned(first + c * p.rows * p.out_features));
          }
        }
        TransposeLanes(v);
        for (int k = 0; k < 4; ++k) vec::StoreUnaligned(p.out + r * p.out_features + col + 16 * k, v[k]);
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
      ColumnTask<Codes::kInt4>(p, row0, rows, col);
    } else {
      ColumnTask<Codes::kInt8>(p, row0, rows, col);
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
// column, in natural column order, as the dot multiplies them by 4 int8
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

// Run `run` of a tile (32 / low inputs), slot n, quarter q: byte k of each
// column's lane the unsigned code of input k * per_byte + n of the run, for
// the 16 columns of quarter q.
template <int64_t kKind>
__attribute__((always_inline)) inline I SlotCodes(const uint8_t* codes, const uint8_t* high, int64_t run, int n,
                                                  int q) {
  constexpr Shape s = ShapeOf(kKind);
  constexpr int per_byte = 8 / s.low, run_inputs = 32 / s.low;
  I out = vec::And(ShiftRight16(vec::LoadInts(codes + (run * 4 + q) * 64), s.low * n), SetBytes((1 << s.low) - 1));
  if constexpr (s.high > 0) {
    constexpr int chunk = 32 / (s.high > 0 ? s.high : 1);  // inputs per high word
    const int64_t first = run * run_inputs;
    const int h = static_cast<int>(first % chunk / run_inputs);
    const int bit = s.high * (h * per_byte + n);  // the slot's high bits in each byte
    const I bits = vec::LoadInts(high + first / chunk * 4 * 64 + q * 64);
    const I placed = bit >= s.low ? ShiftRight16(bits, bit - s.low) : ShiftLeft16(bits, s.low - bit);
    out = vec::Or(out, vec::And(placed, SetBytes(((1 << s.high) - 1) << s.low)));
  }
  return out;
}

// Group g's integer dots with one row's codes x (KQuantOrder) straight from
// the tile's code words, quad pairs as BlockDots takes them: with one row
// each code vector is used once, so the buffer of a super-block's codes
// that rows share is skipped.
template <int64_t kKind>
__attribute__((always_inline)) inline void GroupDotsFromCodes(const uint8_t* codes, const uint8_t* high, int64_t g,
                                                              const int32_t* x, I dot[4]) {
  constexpr Shape s = ShapeOf(kKind);
  constexpr int per_byte = 8 / s.low, runs = s.group * s.low / 32;
  for (int k = 0; k < 4; ++k) dot[k] = vec::SetInts(0);
  for (int run = 0; run < runs; ++run) {
    for (int n = 0; n < per_byte; n += 2) {
      const QuadInputs<Codes::kKQuant> in(x, run * per_byte + n);
      for (int k = 0; k < 4; ++k) {
        dot[k] = DotKQuant(dot[k], SlotCodes<kKind>(codes, high, g * runs + run, n, k),
                           SlotCodes<kKind>(codes, high, g * runs + run, n + 1, k), in);
      }
    }
  }
}

// xq rows in the order SlotCodes gives the weights: within each run of
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
void GroupSubScales(const uint8_t* sub_scales, const uint8_t* sub_mins, int64_t g, I scale[4], I minimum[4]) {
  constexpr Shape s = ShapeOf(kKind);
  for (int k = 0; k < 4; ++k) {
    const uint8_t* bytes = sub_scales + g * 64 + 16 * k;
    scale[k] = s.signed_scales ? vec::FromSignedBytes(bytes) : vec::FromBytes(bytes);
    if (s.minimums == kPacked) {
      minimum[k] = vec::ShiftRight<4>(scale[k]);
      scale[k] = vec::And(scale[k], vec::SetInts(0x0F));
    } else if (s.minimums == kSeparate) {
      minimum[k] = vec::FromBytes(sub_mins + g * 64 + 16 * k);
    } else {
      minimum[k] = vec::SetInts(0);
    }
  }
}

// Super-block sb's d (or dmin) of a tile's 64 columns as float32.
void SuperScales(const uint16_t* d, int64_t sb, F out[4]) {
  for (int k = 0; k < 4; ++k) out[k] = vec::FromHalves(d + sb * 64 + 16 * k);
}

// Rows [row0, row0 + rows) x the 64 columns of tile `tile`, every super-block.
// Per super-block the codes of its groups are unpacked once into an L1
// buffer that the rows share (one row multiplies them as they are unpacked:
// GroupDotsFromCodes), and each row's integer sums of sub_scale * (dot - bias
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
  alignas(64) I weights[kSuperBlock];  // a super-block's codes as bytes: 4 vectors (quarters) per 4 inputs
  alignas(64) I scales[16][4], minimums[16][4];
  alignas(64) float acc[kRowBlock * kColumns] = {};
  for (int64_t sb = 0; sb < p.supers; ++sb) {
    for (int64_t gi = 0; gi < per_super; ++gi) {
      const int64_t g = sb * per_super + gi;
      constexpr int64_t per_byte = 8 / s.low, run_inputs = 32 / s.low;
      for (int64_t run = 0; run < s.group / run_inputs && rows > 1; ++run) {  // the buffer, for 2+ rows
        for (int n = 0; n < per_byte; ++n) {
          for (int q = 0; q < 4; ++q) {
            weights[4 * (gi * quads + run * per_byte + n) + q] =
                SlotCodes<kKind>(codes, high, g * (s.group / run_inputs) + run, n, q);
          }
        }
      }
      GroupSubScales<kKind>(sub_scales, sub_mins, g, scales[gi], minimums[gi]);
    }
    F d_s[4], dmin_s[4];
    SuperScales(d, sb, d_s);
    if (s.minimums) SuperScales(dmin, sb, dmin_s);
    ForRowGroups(rows, [&](int64_t r0, auto together) {
      constexpr int kRows = decltype(together)::value;
      constexpr Shape s = ShapeOf(kKind);  // its own: g++ 12 crashes on the outer one used in here
      I sums[kRows][4], mins[kRows][4];
      for (int i = 0; i < kRows; ++i)
        for (int k = 0; k < 4; ++k) sums[i][k] = mins[i][k] = vec::SetInts(0);
      for (int64_t gi = 0; gi < per_super; ++gi) {
        const int64_t g = sb * per_super + gi;
        const int32_t* x[kRows];
        for (int i = 0; i < kRows; ++i)
          x[i] = reinterpret_cast<const int32_t*>(p.xq->act.codes.data() + (row0 + r0 + i) * p.in + g * s.group);
        I dot[kRows][4];
        if (rows == 1) {
          GroupDotsFromCodes<kKind>(codes, high, g, x[0], dot[0]);
        } else {
          BlockDots<Codes::kKQuant, kRows>(x, weights + 4 * gi * quads, quads, dot);
        }
        for (int i = 0; i < kRows; ++i) {
          const int32_t code_sum = p.xq->group_code_sums[(row0 + r0 + i) * p.groups + g];
          const I bias = vec::SetInts(s.bias * code_sum), sum = vec::SetInts(code_sum);
          for (int k = 0; k < 4; ++k) {
            sums[i][k] = vec::AddInts(sums[i][k], vec::MulInts(scales[gi][k], vec::SubInts(dot[i][k], bias)));
            if (s.minimums) mins[i][k] = vec::AddInts(mins[i][k], vec::MulInts(minimums[gi][k], sum));
          }
        }
      }
      for (int i = 0; i < kRows; ++i) {
        const F dx = vec::Set(p.xq->act.x_scales[(row0 + r0 + i) * p.supers + sb]);
        float* out = acc + (r0 + i) * kColumns;
        for (int k = 0; k < 4; ++k) {
          F v = vec::MulAdd(vec::ToFloat(sums[i][k]), vec::Mul(d_s[k], dx), vec::LoadUnaligned(out + 16 * k));
          if (s.minimums) v = vec::NegMulAdd(vec::Mul(dmin_s[k], dx), vec::ToFloat(mins[i][k]), v);
          vec::StoreUnaligned(out + 16 * k, v);
        }
      }
    });
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
