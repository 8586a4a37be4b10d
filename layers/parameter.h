// Parameters: an fp32 master weight (what the optimizer updates), the copy in
// the model's dtype that layers read (the master itself when that is fp32),
// and an fp32 main gradient. All persistent: fixed addresses for every step.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/context.h"

namespace stepgraph {

struct Parameter {
  std::string name;
  Tensor master;  // fp32
  Tensor value;   // what layers read: `master`, or its copy in the model dtype
  Tensor grad;    // fp32, overwritten by each backward

  bool has_copy() const { return value.impl() != master.impl(); }
};

// A parameter of `shape` and model dtype `dtype`, initialised from `init`
// (numel values; the copy is init rounded to dtype).
Parameter make_parameter(Context& ctx, const std::string& name, const Shape& shape, DType dtype,
                         std::span<const float> init);

// Initial values: uniform in [-scale, scale) from `seed`; or a constant.
std::vector<float> uniform_init(std::int64_t numel, float scale, std::uint32_t seed);
std::vector<float> constant_init(std::int64_t numel, float value);

// Writes `value` into the dtype copy from the master (after the optimizer
// changed the master outside a step).
void sync_copy_from_master(Context& ctx, const Parameter& parameter);

}  // namespace stepgraph
