#include "layers/layer_checks.h"

#include <sstream>

#include "engine/error.h"

namespace stepgraph {
namespace {

bool matches(const std::vector<ExpectedDim>& want, const Shape& got) {
  const bool leading = !want.empty() && want.front().name == "...";
  const std::size_t fixed = want.size() - (leading ? 1 : 0);
  const std::size_t rank = static_cast<std::size_t>(got.rank());
  if (leading ? rank < fixed : rank != fixed) return false;
  const std::size_t offset = rank - fixed;
  for (std::size_t i = 0; i < fixed; ++i) {
    const ExpectedDim& dim = want[i + (leading ? 1 : 0)];
    if (dim.size >= 0 && dim.size != got.dims()[offset + i]) return false;
  }
  return true;
}

std::string describe(const std::vector<ExpectedDim>& want) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < want.size(); ++i) {
    out << (i ? ", " : "");
    if (want[i].size >= 0) {
      out << want[i].size;
    } else {
      out << want[i].name;
    }
  }
  out << "]";
  return out.str();
}

}  // namespace

std::string layer_label(std::string_view kind, std::string_view name) {
  if (name.empty()) return std::string(kind);
  return std::string(kind) + " '" + std::string(name) + "'";
}

void check_input(const std::string& layer, std::string_view what, std::string_view arg, const Tensor& tensor,
                 const std::vector<ExpectedDim>& shape, DType dtype, std::string_view note) {
  if (tensor.defined() && tensor.dtype() == dtype && matches(shape, tensor.shape())) return;
  std::ostringstream got;
  if (tensor.defined()) {
    got << tensor.shape() << " " << dtype_name(tensor.dtype());
  } else {
    got << "an undefined tensor";
  }
  SG_THROW(ErrorCode::kInvalidArgument, layer, " ", what, ": ", arg, " must be ", describe(shape), " ",
           dtype_name(dtype), note.empty() ? "" : " (", note, note.empty() ? "" : ")", ", got ", got.str());
}

std::vector<ExpectedDim> exactly(const Shape& shape) {
  return std::vector<ExpectedDim>(shape.dims().begin(), shape.dims().end());
}

}  // namespace stepgraph
