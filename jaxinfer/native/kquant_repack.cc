// GGUF K-quant blocks (Q2_K .. Q6_K) of an [out, in] matrix -> the tiled
// planes of a KQuantTensor [in, out] (quant/kquant.py's module docstring
// defines every plane and the word layout; this writes exactly that), in one
// pass over the blocks. Called from Python with ctypes (kquant_repack.py) on
// a load's worker threads, one tensor a call: the numpy conversion and tiling
// it replaces took seconds of a start for a 0.5B model.
//
// The blocks' bit layouts are ggml's (ggml-common.h), read here as
// loading/gguf.py's _k_codes and _k_sub_scales read them; the tests hold the
// two to each other byte for byte and to gguf.quants.dequantize.

#include <cstdint>
#include <cstring>

namespace {

enum Kind { Q2K = 0, Q3K = 1, Q4K = 2, Q5K = 3, Q6K = 4 };

struct Format {
  int block_bytes, low_bits, high_bits, group, d_at, dmin_at;  // dmin_at < 0: none
};

constexpr Format kFormats[] = {
    {84, 2, 0, 16, 80, 82},    // Q2_K: scales[16], qs[64], d, dmin
    {110, 2, 1, 16, 108, -1},  // Q3_K: hmask[32], qs[64], scales[12], d
    {144, 4, 0, 32, 0, 2},     // Q4_K: d, dmin, scales[12], qs[128]
    {176, 4, 1, 32, 0, 2},     // Q5_K: d, dmin, scales[12], qh[32], qs[128]
    {210, 4, 2, 16, 208, -1},  // Q6_K: ql[128], qh[64], scales[16], d
};

// Bits `width` wide of `bytes` read `shifts` times over runs of `run` bytes:
// field (chunk * shifts + shift) * run + l is byte chunk * run + l shifted
// right by shift * width (gguf.py's _bit_fields), OR-ed into out at `at`.
inline void bit_fields(const uint8_t* bytes, int nbytes, int width, int shifts, int run, uint8_t* out, int at) {
  const uint8_t mask = (1 << width) - 1;
  for (int chunk = 0; chunk < nbytes / run; ++chunk)
    for (int shift = 0; shift < shifts; ++shift)
      for (int l = 0; l < run; ++l)
        out[(chunk * shifts + shift) * run + l] |= ((bytes[chunk * run + l] >> (shift * width)) & mask) << at;
}

// The 6-bit scales and minimums of Q4_K / Q5_K, packed in 12 bytes.
inline void scale_min_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block: its 256 unsigned codes, sub-scale and sub-minimum bytes as
// KQuantTensor holds them.
void decode(int kind, const uint8_t* b, uint8_t* code, uint8_t* sc, uint8_t* mn) {
  std::memset(code, 0, 256);
  switch (kind) {
    case Q2K:
      bit_fields(b + 16, 64, 2, 4, 32, code, 0);
      std::memcpy(sc, b, 16);  // scale | minimum << 4, as stored
      break;
    case Q3K: {
      bit_fields(b + 32, 64, 2, 4, 32, code, 0);
      bit_fields(b, 32, 1, 8, 32, code, 2);  // the high bit as stored (set: no -4)
      uint8_t low[16] = {}, high[16] = {};
      bit_fields(b + 96, 8, 4, 2, 8, low, 0);
      bit_fields(b + 104, 4, 2, 4, 4, high, 0);
      for (int g = 0; g < 16; ++g) sc[g] = static_cast<uint8_t>(static_cast<int8_t>((low[g] | (high[g] << 4)) - 32));
      break;
    }
    case Q4K:
      bit_fields(b + 16, 128, 4, 2, 32, code, 0);
      scale_min_k4(b + 4, sc, mn);
      break;
    case Q5K:
      bit_fields(b + 48, 128, 4, 2, 32, code, 0);
      bit_fields(b + 16, 32, 1, 8, 32, code, 4);
      scale_min_k4(b + 4, sc, mn);
      break;
    case Q6K:
      bit_fields(b, 128, 4, 2, 64, code, 0);
      bit_fields(b + 128, 64, 2, 4, 32, code, 4);
      std::memcpy(sc, b + 192, 16);  // int8, as stored
      break;
  }
}

}  // namespace

// blocks: [out_dim, in_dim / 256, block bytes] as the file stores them.
// rows: out_dim source rows, rows[j] the file's row that becomes column j
// (the llama un-permutation of q / k), or null for the identity.
// Outputs (tile = 64, tiles = out_dim / 64), C-contiguous:
//   codes      uint8 [tiles, in * low / 8, 64]     high  uint8 [tiles, in * high / 8, 64] (null where none)
//   sub_scales uint8 [tiles, in / group, 64]       sub_mins the same (null where none)
//   d          uint16 (float16 bits) [tiles, in / 256, 64]   dmin the same (null where none)
// Returns 0, or -1 for a kind or shape it does not take.
extern "C" int jaxinfer_kquant_repack(int kind, const uint8_t* blocks, int64_t out_dim, int64_t in_dim,
                                      const int64_t* rows, uint8_t* codes, uint8_t* high, uint8_t* sub_scales,
                                      uint8_t* sub_mins, uint16_t* d, uint16_t* dmin) {
  constexpr int kTile = 64, kSuper = 256;
  if (kind < Q2K || kind > Q6K || out_dim % kTile || in_dim % kSuper) return -1;
  const Format& f = kFormats[kind];
  const int64_t supers = in_dim / kSuper, tiles = out_dim / kTile;
  const int groups = kSuper / f.group;
  const int low_words = kSuper * f.low_bits / 32, high_words = kSuper * f.high_bits / 32;
  const int low_run = 32 / f.low_bits;  // inputs a low word holds
  const int per_byte = 8 / f.low_bits;
  const uint32_t low_mask = (1u << f.low_bits) - 1;
  // The bit of each input of a high word (kquant.py's _word_positions).
  int high_at[32] = {};
  for (int j = 0; f.high_bits && j < 32 / f.high_bits; ++j) {
    const int h = j / low_run, u = j % low_run;
    high_at[j] = 8 * (u / per_byte) + f.high_bits * (h * per_byte + u % per_byte);
  }
  uint8_t code[kSuper], sc[16], mn[16];
  for (int64_t t = 0; t < tiles; ++t) {
    uint8_t* tile_codes = codes + t * (in_dim * f.low_bits / 8) * kTile;
    uint8_t* tile_high = high ? high + t * (in_dim * f.high_bits / 8) * kTile : nullptr;
    for (int col = 0; col < kTile; ++col) {
      const int64_t j = t * kTile + col;
      const int64_t row = rows ? rows[j] : j;
      // Where this column's 32-bit words sit: word c at line 4c + col / 16, lane col % 16.
      const int64_t lane = (col / 16) * 64 + (col % 16) * 4;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* b = blocks + (row * supers + s) * f.block_bytes;
        decode(kind, b, code, sc, mn);
        for (int g = 0; g < groups; ++g) {
          const int64_t at = ((t * supers + s) * groups + g) * kTile + col;
          sub_scales[at] = sc[g];
          if (sub_mins) sub_mins[at] = mn[g];
        }
        const int64_t at = (t * supers + s) * kTile + col;
        std::memcpy(d + at, b + f.d_at, 2);
        if (dmin) std::memcpy(dmin + at, b + f.dmin_at, 2);
        for (int w = 0; w < low_words; ++w) {
          uint32_t word = 0;
          for (int u = 0; u < low_run; ++u) word |= (code[w * low_run + u] & low_mask) << (f.low_bits * u);
          std::memcpy(tile_codes + (4 * (s * low_words + w)) * 64 + lane, &word, 4);
        }
        for (int w = 0; w < high_words; ++w) {
          uint32_t word = 0;
          const int run = 32 / f.high_bits;
          for (int u = 0; u < run; ++u) word |= static_cast<uint32_t>(code[w * run + u] >> f.low_bits) << high_at[u];
          std::memcpy(tile_high + (4 * (s * high_words + w)) * 64 + lane, &word, 4);
        }
      }
    }
  }
  return 0;
}
