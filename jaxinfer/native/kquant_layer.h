// One layer of a K-quant weight (Q2_K .. Q6_K) as quant/kquant.py lays it
// out and native/kquant_matmul.py passes it to a kernel: the formats' bit
// widths and scale kinds, and the check of a call's buffers that finds the
// layer's arrays. Shared by the float-activation kernel (kquant_matmul.cc,
// which describes the tile layout) and the int8-activation one
// (q8_matmul.cc), so that both read one definition of the layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer::kquant {

constexpr int64_t kTileColumns = 64;  // output columns of a tile
constexpr int64_t kSuperBlock = 256;  // inputs under one f16 super-scale

// quant/kquant.py's kinds, in the order of native/kquant_matmul.py's KINDS.
enum Kind : int64_t { kQ2K = 0, kQ3K = 1, kQ4K = 2, kQ5K = 3, kQ6K = 4 };

// Minimums: none, a separate byte per group (sub_mins), or the high nibble
// of the sub-scale byte (Q2_K).
enum Minimums : int { kNone = 0, kSeparate = 1, kPacked = 2 };

// A kind's codes (low bits + high bits, less bias), its group of inputs per
// sub-scale, and its scales' kinds.
struct Shape {
  int low, high, group, bias;
  bool signed_scales;
  Minimums minimums;
};

constexpr Shape ShapeOf(int64_t kind) {
  switch (kind) {
    case kQ2K: return {2, 0, 16, 0, false, kPacked};
    case kQ3K: return {2, 1, 16, 4, true, kNone};
    case kQ4K: return {4, 0, 32, 0, false, kSeparate};
    case kQ5K: return {4, 1, 32, 0, false, kSeparate};
    default: return {4, 2, 16, 32, true, kNone};
  }
}

// One layer of a weight times x [rows, in]: its arrays (tile t's part of
// each at t times its tile size) and sizes.
struct Layer {
  int64_t kind;
  Shape shape;
  const uint8_t* codes;
  const uint8_t* high;        // nullptr where the kind has no high bits
  const uint8_t* sub_scales;
  const uint8_t* sub_mins;    // nullptr unless kSeparate
  const uint16_t* d;
  const uint16_t* dmin;       // nullptr where the kind has no minimums
  int64_t rows, in, out_features;
  int64_t code_rows, high_rows, groups, supers;  // rows per tile of each array

  int64_t Tiles() const { return out_features / kTileColumns; }
};

// Checks one weight's buffers (each [layers, out / 64, rows, 64]; "[1]"
// stand-ins where a kind has no such array) against x and layer, and fills
// *w with that layer. `who` names the kernel in the errors.
inline xla::ffi::Error DescribeLayer(const char* who, const xla::ffi::Buffer<xla::ffi::F32>& x, int64_t layer,
                                     int64_t kind, xla::ffi::AnyBuffer codes, xla::ffi::AnyBuffer high,
                                     xla::ffi::AnyBuffer sub_scales, xla::ffi::AnyBuffer sub_mins,
                                     xla::ffi::AnyBuffer d, xla::ffi::AnyBuffer dmin, Layer* w) {
  using xla::ffi::Error;
  auto invalid = [who](const char* what) { return Error::InvalidArgument(std::string(who) + ": " + what); };
  if (kind < kQ2K || kind > kQ6K) return invalid("unknown kind");
  Layer p;
  p.kind = kind;
  p.shape = ShapeOf(kind);
  const auto x_dims = x.dimensions();
  const auto code_dims = codes.dimensions(), scale_dims = sub_scales.dimensions(), d_dims = d.dimensions();
  if (x_dims.size() != 2 || code_dims.size() != 4 || scale_dims.size() != 4 || d_dims.size() != 4 ||
      code_dims[3] != kTileColumns) {
    return invalid("x must be [rows, in], the weight's arrays [layers, out / 64, rows, 64]");
  }
  p.rows = x_dims[0];
  p.in = x_dims[1];
  p.out_features = code_dims[1] * kTileColumns;
  p.code_rows = p.in * p.shape.low / 8;
  p.high_rows = p.in * p.shape.high / 8;
  p.groups = p.in / p.shape.group;
  p.supers = p.in / kSuperBlock;
  const int64_t layers = code_dims[0], tiles = code_dims[1];
  if (p.rows < 1 || p.in % kSuperBlock != 0 || code_dims[2] != p.code_rows || scale_dims[1] != tiles ||
      scale_dims[2] != p.groups || d_dims[1] != tiles || d_dims[2] != p.supers) {
    return invalid("shapes do not match (whole super-blocks of 256 inputs)");
  }
  if (layer < 0 || layer >= layers) return invalid("layer index outside the stacked weights");
  const bool has_high = p.shape.high > 0, has_sub_mins = p.shape.minimums == kSeparate;
  const bool has_dmin = p.shape.minimums != kNone;
  if ((has_high && high.dimensions().size() != 4) || (has_sub_mins && sub_mins.dimensions().size() != 4) ||
      (has_dmin && dmin.dimensions().size() != 4)) {
    return invalid("this kind needs its high bits, minimums and dmin");
  }
  const int64_t area = tiles * kTileColumns;
  auto bytes = [](xla::ffi::AnyBuffer b) { return static_cast<const uint8_t*>(b.untyped_data()); };
  auto halves = [](xla::ffi::AnyBuffer b) { return static_cast<const uint16_t*>(b.untyped_data()); };
  p.codes = bytes(codes) + layer * p.code_rows * area;
  p.high = has_high ? bytes(high) + layer * p.high_rows * area : nullptr;
  p.sub_scales = bytes(sub_scales) + layer * p.groups * area;
  p.sub_mins = has_sub_mins ? bytes(sub_mins) + layer * p.groups * area : nullptr;
  p.d = halves(d) + layer * p.supers * area;
  p.dmin = has_dmin ? halves(dmin) + layer * p.supers * area : nullptr;
  *w = p;
  return Error::Success();
}


constexpr int64_t kBuffersPerStack = 6;  // codes, high, sub_scales, sub_mins, d, dmin

// The weights of one call (both kernels take several on the same x: a
// layer's q, k and v): each weight one or more stacks (a MixedStack's parts,
// quant/mixed_stack.py), each stack kBuffersPerStack arrays, a kind and a
// layer index, -1 in the stacks that do not hold the weight's layer. Calls
// describe(j, layer, kind, arrays, out) for each weight j with the stack
// that holds its layer; the first error ends the loop.
template <typename Describe>
xla::ffi::Error ForEachWeight(const char* who, const xla::ffi::Buffer<xla::ffi::S32>& layers,
                              xla::ffi::RemainingArgs& weights, xla::ffi::RemainingRets& outs,
                              xla::ffi::Span<const int64_t> kinds, xla::ffi::Span<const int64_t> stacks,
                              Describe&& describe) {
  using xla::ffi::Error;
  const int64_t count = static_cast<int64_t>(outs.size());
  const int64_t num_stacks = static_cast<int64_t>(kinds.size());
  int64_t stacks_given = 0;
  for (int64_t n : stacks) stacks_given += n < 1 ? num_stacks + 1 : n;
  if (count == 0 || static_cast<int64_t>(stacks.size()) != count || stacks_given != num_stacks ||
      static_cast<int64_t>(weights.size()) != kBuffersPerStack * num_stacks ||
      static_cast<int64_t>(layers.element_count()) != num_stacks) {
    return Error::InvalidArgument(std::string(who) +
                                  ": give each output one or more stacks, each with six arrays, a kind and a layer");
  }
  for (int64_t j = 0, first = 0; j < count; first += stacks[j], ++j) {
    int64_t stack = -1;  // the weight's stack that holds its layer
    for (int64_t k = first; k < first + stacks[j]; ++k) {
      if (layers.typed_data()[k] >= 0) stack = k;
    }
    if (stack < 0) return Error::InvalidArgument(std::string(who) + ": no stack of a weight holds its layer");
    std::vector<xla::ffi::AnyBuffer> arrays;  // (no default constructor: no array)
    for (int64_t a = 0; a < kBuffersPerStack; ++a) {
      auto buffer = weights.get<xla::ffi::AnyBuffer>(kBuffersPerStack * stack + a);
      if (buffer.has_error()) return buffer.error();
      arrays.push_back(buffer.value());
    }
    auto out = outs.get<xla::ffi::Buffer<xla::ffi::F32>>(j);
    if (out.has_error()) return out.error();
    Error error = describe(j, layers.typed_data()[stack], kinds[stack], arrays.data(), out.value()->typed_data());
    if (error.failure()) return error;
  }
  return Error::Success();
}

}  // namespace jaxinfer::kquant
