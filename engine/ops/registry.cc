#include "engine/ops/registry.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/ops/elementwise_ops.h"

namespace stepgraph::ops {

std::span<const OpDef* const> all_ops() {
  // One line per op family as they arrive.
  static const std::vector<const OpDef*> ops = {
      &fill_op(), &copy_op(), &copy_inplace_op(), &axpy_op(), &axpy_inplace_op(), &add_op(), &mul_op(), &sum_op(), &cast_op(),
  };
  return ops;
}

const OpDef& find_op(std::string_view name) {
  std::string known;
  for (const OpDef* op : all_ops()) {
    if (op->name == name) return *op;
    known += known.empty() ? "" : ", ";
    known += op->name;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown op '", name, "'; known ops: ", known);
}

}  // namespace stepgraph::ops
