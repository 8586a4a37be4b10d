// Argument checks at the top of a layer's forward and backward, so a tensor
// of the wrong shape or dtype is reported in the layer's terms before any op
// runs:
//
//   Linear 'fc1' backward: dy must be [5, 8] bf16 (the forward's output), got [5, 9] bf16
//
// The ops keep their own checks; these name the layer, the argument and the
// shape it expected instead of an internal op.
//
//   check_input(layer_label("Linear", name_), "forward", "x", args.x, {"tokens", in}, dtype);
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/context.h"

namespace stepgraph {

// One expected dimension: a fixed size, or any size shown by its name
// ("tokens"). The name "..." stands for any number of leading dimensions
// (allowed first only).
struct ExpectedDim {
  ExpectedDim(std::int64_t size) : size(size) {}       // NOLINT: implicit by design
  ExpectedDim(const char* name) : size(-1), name(name) {}  // NOLINT: implicit by design
  std::int64_t size;
  std::string_view name;
};

// "Linear 'fc1'", or the kind alone when the layer has no name.
std::string layer_label(std::string_view kind, std::string_view name);

// Error (kInvalidArgument) unless `tensor` is defined, of dtype `dtype` and of
// a shape matching `shape`. `note` (optional) says where the expectation comes
// from, e.g. "the forward's output".
void check_input(const std::string& layer, std::string_view what, std::string_view arg, const Tensor& tensor,
                 const std::vector<ExpectedDim>& shape, DType dtype, std::string_view note = {});

// An exact shape as expected dimensions (for check_input).
std::vector<ExpectedDim> exactly(const Shape& shape);

}  // namespace stepgraph
