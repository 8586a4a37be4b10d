// Ops register themselves in the file that defines them, so the registry
// (ops/registry.h) cannot miss one:
//
//   const OpDef& adamw_op() { static const OpDef op{...}; return op; }
//   SG_REGISTER_OP(adamw_op);
//
// Registration runs at static initialization. Every library that registers
// ops is `alwayslink = True` in ops/BUILD.bazel: nothing refers to a
// registrar by name, so a static link would otherwise drop it.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "engine/op.h"

namespace stepgraph::ops {

// Ops by name, sorted by name.
class OpRegistry {
 public:
  // Error(kInvalidArgument) when the name is empty or already registered.
  void add(const OpDef& op);
  std::span<const OpDef* const> ops() const { return ops_; }
  // Null when no op has the name.
  const OpDef* find(std::string_view name) const;

 private:
  std::vector<const OpDef*> ops_;
};

// The registry SG_REGISTER_OP adds to.
OpRegistry& global_op_registry();

// Adds `op()` to the global registry; a failure (a name taken twice) is
// printed and aborts the program: it is a build mistake, found at startup.
class OpRegistrar {
 public:
  explicit OpRegistrar(const OpDef& (*op)());
};

}  // namespace stepgraph::ops

#define SG_OP_REGISTRAR_NAME_(line) sg_op_registrar_##line
#define SG_OP_REGISTRAR_NAME(line) SG_OP_REGISTRAR_NAME_(line)
// Registers the op that `op_function()` returns (at namespace scope, in the op's own file).
#define SG_REGISTER_OP(op_function) \
  [[maybe_unused]] static const ::stepgraph::ops::OpRegistrar SG_OP_REGISTRAR_NAME(__LINE__)(&op_function)
