#include "ops/registry.h"

#include <string>

#include "engine/error.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::span<const OpDef* const> all_ops() { return global_op_registry().ops(); }

const OpDef& find_op(std::string_view name) {
  if (const OpDef* op = global_op_registry().find(name)) return *op;
  std::string known;
  for (const OpDef* op : all_ops()) {
    known += known.empty() ? "" : ", ";
    known += op->name;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown op '", name, "'; known ops: ", known);
}

}  // namespace stepgraph::ops
