// Matmul of a few rows of float32 activations by grouped int8 / int4 weights for
// XLA:CPU, through the XLA FFI (quant/cpu_matmul.py builds and registers it).
//
// Why it exists: XLA does not fuse a convert into a dot, so quant/linear.py's
// XLA path writes a float32 copy of every weight on every call; at a few rows
// (decode at small batches, speculative verification) that copy is the step,
// and up to 16 rows this kernel's float dots still win
// (quant/cpu_matmul.py, MAX_ROWS says where it stops paying). Here
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
// Computed per group as scale * (x . q) + offset * sum(x): the same real
// numbers as the dequantized weight, rounded in another order.
//
// Work: the output columns are cut into chunks shared by the calling thread
// and XLA's intra-op pool (cpu_parallel.h); a chunk streams its columns of
// each weight row in order, so the weights are read sequentially, once per
// block of 8 rows (the first from memory, the others from the cache).
#include <algorithm>
#include <cstdint>

#include "jaxinfer/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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
};

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

// Rows [row0, row0 + min(kRowBlock, rows - row0)) of one chunk of columns.
void MatmulRowBlock(const Problem& p, int64_t row0, int64_t begin, int64_t end) {
  Problem block = p;
  block.x = p.x + row0 * p.in;
  block.out = p.out + row0 * p.out_features;
  block.rows = std::min(kRowBlock, p.rows - row0);
  switch (block.rows) {
    case 1: return MatmulColumns<1>(block, begin, end);
    case 2: return MatmulColumns<2>(block, begin, end);
    case 3: return MatmulColumns<3>(block, begin, end);
    case 4: return MatmulColumns<4>(block, begin, end);
    case 5: return MatmulColumns<5>(block, begin, end);
    case 6: return MatmulColumns<6>(block, begin, end);
    case 7: return MatmulColumns<7>(block, begin, end);
    default: return MatmulColumns<8>(block, begin, end);
  }
}

// Every row block of one chunk of columns, one after another: the chunk's
// codes come from memory for the first and from the cache for the others.
void MatmulChunk(const Problem& p, int64_t chunk) {
  const int64_t begin = chunk * kChunk, end = std::min(p.out_features, begin + kChunk);
  for (int64_t row0 = 0; row0 < p.rows; row0 += kRowBlock) MatmulRowBlock(p, row0, begin, end);
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                               ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets,
                               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t group_size,
                               bool has_offsets) {
  const auto x_dims = x.dimensions();
  const auto data_dims = data.dimensions();
  if (x_dims.size() != 2 || data_dims.size() != 3) {
    return ffi::Error::InvalidArgument("quantized matmul: x must be [rows, in], data [layers, in(/2), out]");
  }
  Problem p;
  p.int4 = data.element_type() == ffi::DataType::U8;
  if (!p.int4 && data.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("quantized matmul: data must be int8 or uint8 (packed int4)");
  }
  p.x = x.typed_data();
  p.data = data.untyped_data();
  p.scales = scales.typed_data();
  p.offsets = has_offsets ? offsets.typed_data() : nullptr;
  p.out = out->typed_data();
  p.rows = x_dims[0];
  p.in = x_dims[1];
  p.out_features = data_dims[2];
  p.group = group_size;
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= data_dims[0]) {
    return ffi::Error::InvalidArgument("quantized matmul: layer index outside the stacked weights");
  }
  if (p.rows < 1 || p.in != data_dims[1] * (p.int4 ? 2 : 1) || p.group <= 0 || p.in % p.group != 0 ||
      (p.int4 && p.group % 2 != 0)) {
    return ffi::Error::InvalidArgument("quantized matmul: shapes do not match (whole groups)");
  }
  jaxinfer::ParallelFor(thread_pool, (p.out_features + kChunk - 1) / kChunk,
                        [&p](int64_t chunk) { MatmulChunk(p, chunk); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // data
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offsets
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("has_offsets"));
