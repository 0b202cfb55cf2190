// A mixture of experts' matmul by float32 experts for XLA:CPU, through the
// XLA FFI (native/expert_matmul.py builds and registers it): each row of x
// multiplies its own expert, and only the selected experts' weights are read.
//
// Why it exists: XLA's grouped matmul (jax.lax.ragged_dot) on CPU multiplies
// every row by every expert under a mask, so a decode step of a model with
// 64 experts and 8 active read 8 times the weights its tokens use; and
// gathering the selected experts first writes a copy of each. Here the rows
// arrive sorted by matrix and each run of rows of one matrix streams that
// matrix once (the quantized experts take the same route through
// matmul.cc's JaxinferQuantizedExpertMatmuls).
//
//   x        f32 [R, in], rows sorted by matrix
//   matrix   s32 [R], non-decreasing: layer * experts + expert
//   w        f32 [M, in, out]: every layer's experts as one stack of matrices
//   out      f32 [R, out]:  out[r] = x[r] @ w[matrix[r]]
//
// One call takes several weights of the same rows (an expert's gate and up
// projections), their tasks in one parallel loop, as matmul.cc does.
//
// Work: per run of rows and weight, the output columns in tiles (256 columns
// at one row, 128 at two, else 64), each a task; a task walks the inputs in
// order and keeps a tile of rows x columns of sums in registers. Every row's
// sum runs over the inputs in the same order whatever the rows beside it, so
// a token's result does not depend on which other tokens chose its experts.
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "jaxinfer/native/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One task: rows [row_begin, row_end) (one run of one matrix) x columns
// [col, col + width) of one weight.
struct Task {
  const float* x;
  const float* w;  // the run's matrix [in, out]
  float* out;
  int64_t in, out_features, row_begin, row_end, col, width;  // width: the tile's, clipped at the last column
  int64_t tile;  // the tile's columns before clipping: 256 (one row), 128 (two rows) or 64
};

#if defined(__AVX512F__)
constexpr int64_t kTileRows = 6;  // 6 rows x 4 vectors: 24 sums and 4 weight vectors in registers

// Rows [row0, row0 + kRows) x the 16 * kVectors columns at t.col (the last
// vectors masked where the tile passes the last column).
template <int kRows, int kVectors>
void TileRows(const Task& t, int64_t row0) {
  __m512 acc[kRows][kVectors];
  __mmask16 mask[kVectors];
  for (int k = 0; k < kVectors; ++k) {
    const int64_t left = t.col + t.width - (t.col + 16 * k);
    mask[k] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    for (int r = 0; r < kRows; ++r) acc[r][k] = _mm512_setzero_ps();
  }
  const float* x = t.x + row0 * t.in;
  const float* w = t.w + t.col;
  for (int64_t i = 0; i < t.in; ++i) {
    __m512 wi[kVectors];
    for (int k = 0; k < kVectors; ++k) wi[k] = _mm512_maskz_loadu_ps(mask[k], w + i * t.out_features + 16 * k);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xi = _mm512_set1_ps(x[r * t.in + i]);
      for (int k = 0; k < kVectors; ++k) acc[r][k] = _mm512_fmadd_ps(wi[k], xi, acc[r][k]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < kVectors; ++k)
      _mm512_mask_storeu_ps(t.out + (row0 + r) * t.out_features + t.col + 16 * k, mask[k], acc[r][k]);
}

template <int kVectors>
void RunTask(const Task& t) {
  int64_t r = t.row_begin;
  if constexpr (kVectors == 4) {
    for (; r + kTileRows <= t.row_end; r += kTileRows) TileRows<kTileRows, 4>(t, r);
    switch (t.row_end - r) {
      case 5: TileRows<5, 4>(t, r); break;
      case 4: TileRows<4, 4>(t, r); break;
      case 3: TileRows<3, 4>(t, r); break;
      case 2: TileRows<2, 4>(t, r); break;
      case 1: TileRows<1, 4>(t, r); break;
      default: break;
    }
  } else if constexpr (kVectors == 8) {  // two rows
    TileRows<2, 8>(t, r);
  } else {  // one row
    TileRows<1, 16>(t, r);
  }
}
#endif

// The portable path: one row at a time, the same order of sums.
void RunTaskPlain(const Task& t) {
  std::vector<float> acc(t.width);
  for (int64_t r = t.row_begin; r < t.row_end; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const float* x = t.x + r * t.in;
    for (int64_t i = 0; i < t.in; ++i) {
      const float* w = t.w + i * t.out_features + t.col;
      const float xi = x[i];
#pragma omp simd
      for (int64_t c = 0; c < t.width; ++c) acc[c] += xi * w[c];
    }
    std::copy(acc.begin(), acc.end(), t.out + r * t.out_features + t.col);
  }
}

void Run(const Task& t) {
#if defined(__AVX512F__)
  if (t.tile == 256) return RunTask<16>(t);
  if (t.tile == 128) return RunTask<8>(t);
  return RunTask<4>(t);
#else
  RunTaskPlain(t);
#endif
}

ffi::Error ExpertMatmulsImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> matrix,
                             ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || matrix.element_count() != x_dims[0] || outs.size() != weights.size() ||
      weights.size() == 0) {
    return ffi::Error::InvalidArgument("expert matmul: x [rows, in], one matrix per row, one out per weight");
  }
  const int64_t rows = x_dims[0], in = x_dims[1];
  const int32_t* index = matrix.typed_data();
  std::vector<int64_t> run_begin;  // the first row of each run of one matrix, then rows
  if (!jaxinfer::MatrixRuns(index, rows, &run_begin)) {
    return ffi::Error::InvalidArgument("expert matmul: rows must be sorted by matrix");
  }
  std::vector<Task> tasks;
  for (size_t j = 0; j < weights.size(); ++j) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(j);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (w.has_error()) return w.error();
    if (out.has_error()) return out.error();
    const auto w_dims = w.value().dimensions();
    if (w_dims.size() != 3 || w_dims[1] != in) {
      return ffi::Error::InvalidArgument("expert matmul: each weight must be [matrices, in, out]");
    }
    const int64_t out_features = w_dims[2];
    for (size_t run = 0; run + 1 < run_begin.size(); ++run) {
      const int64_t m = index[run_begin[run]];
      if (m < 0 || m >= w_dims[0]) return ffi::Error::InvalidArgument("expert matmul: matrix index out of range");
      const int64_t run_rows = run_begin[run + 1] - run_begin[run];
      // One or two rows stream the weight: wide tiles read it in longer runs.
      const int64_t width = run_rows == 1 ? 256 : run_rows == 2 ? 128 : 64;
      for (int64_t col = 0; col < out_features; col += width) {
        tasks.push_back(Task{x.typed_data(), w.value().typed_data() + m * in * out_features,
                             out.value()->typed_data(), in, out_features, run_begin[run], run_begin[run + 1], col,
                             std::min(width, out_features - col), width});
      }
    }
  }
  jaxinfer::ParallelFor(thread_pool, static_cast<int64_t>(tasks.size()), [&tasks](int64_t i) { Run(tasks[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferExpertMatmuls, ExpertMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x, rows sorted by matrix
                                  .Arg<ffi::Buffer<ffi::S32>>()  // matrix of each row
                                  .RemainingArgs()               // each weight [matrices, in, out]
                                  .RemainingRets());             // each weight's out
