// The op registry: every op by its stable name, sorted by name. Each op
// registers itself in its own file (ops/op_registration.h); depending on this
// target links every op family in.
#pragma once

#include <span>
#include <string_view>

#include "engine/op.h"

namespace stepgraph::ops {

std::span<const OpDef* const> all_ops();

// Error(kInvalidArgument) listing the known names when `name` is unknown.
const OpDef& find_op(std::string_view name);

}  // namespace stepgraph::ops
