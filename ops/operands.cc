#include "ops/operands.h"

namespace stepgraph::ops {

std::string slot_name(const Slot& slot) {
  std::string name(slot.name);
  if (slot.index >= 0) name += "[" + std::to_string(slot.index) + "]";
  return name;
}

namespace operands_detail {

void Flattener::operator()(const Slot& slot, const Tensor& tensor) {
  SG_CHECK(tensor.defined() == slot.present, "op ", op_, ": operand '", slot_name(slot), "' ",
           slot.present ? "is missing (an undefined tensor)" : "is given, but this call's params leave it out");
  if (slot.present) inputs_.push_back(tensor);
}

void throw_count(std::string_view op, const Namer& namer, std::size_t got) {
  // Long lists (an optimizer's parameters) are shown by their ends.
  constexpr std::size_t kShown = 8;
  std::string names;
  for (std::size_t i = 0; i < namer.names.size(); ++i) {
    if (i == kShown && namer.names.size() > kShown + 1) {
      names += ", ...";
      i = namer.names.size() - 1;
    }
    names += (names.empty() ? "" : ", ") + namer.names[i];
  }
  if (!namer.rest.empty()) {
    SG_THROW(ErrorCode::kInvalidArgument, "op ", op, " takes ", names, " and then its ", namer.rest, " list; got ", got,
             " inputs");
  }
  SG_THROW(ErrorCode::kInvalidArgument, "op ", op, " takes ", namer.names.size(), " inputs (", names, "), got ", got);
}

}  // namespace operands_detail
}  // namespace stepgraph::ops
