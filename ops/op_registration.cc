#include "ops/op_registration.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "engine/error.h"

namespace stepgraph::ops {

namespace {

bool name_less(const OpDef* op, std::string_view name) { return op->name < name; }

}  // namespace

void OpRegistry::add(const OpDef& op) {
  SG_CHECK(!op.name.empty(), "op registry: an op has no name; give its OpDef a .name");
  const auto at = std::lower_bound(ops_.begin(), ops_.end(), op.name, name_less);
  SG_CHECK(at == ops_.end() || (*at)->name != op.name, "op registry: two ops are named '", op.name,
           "'; op names must be unique (they key programs and graphs)");
  ops_.insert(at, &op);
}

const OpDef* OpRegistry::find(std::string_view name) const {
  const auto at = std::lower_bound(ops_.begin(), ops_.end(), name, name_less);
  return at != ops_.end() && (*at)->name == name ? *at : nullptr;
}

OpRegistry& global_op_registry() {
  // Built on first use: registrars in other files run in no fixed order.
  static OpRegistry registry;
  return registry;
}

OpRegistrar::OpRegistrar(const OpDef& (*op)()) {
  try {
    global_op_registry().add(op());
  } catch (const Error& e) {
    // Static initialization: no caller could catch it.
    std::fprintf(stderr, "stepgraph: %s\n", e.what());
    std::abort();
  }
}

}  // namespace stepgraph::ops
