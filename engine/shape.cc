#include "engine/shape.h"

#include <string_view>

#include "engine/error.h"

namespace stepgraph {
namespace {

void check_dims(const std::vector<std::int64_t>& dims) {
  for (std::size_t i = 0; i < dims.size(); ++i) {
    SG_CHECK(dims[i] >= 0, "shape dimension ", i, " is ", dims[i], "; dimensions must be >= 0");
  }
}

// `what` names the count: "elements" or "bytes".
std::int64_t checked_multiply(std::int64_t a, std::int64_t b, const Shape& shape, std::string_view what) {
  std::int64_t product = 0;
  SG_CHECK(!__builtin_mul_overflow(a, b, &product), "shape ", shape, " has more ", what, " than int64 can count");
  return product;
}

}  // namespace

Shape::Shape(std::initializer_list<std::int64_t> dims) : dims_(dims) { check_dims(dims_); }

Shape::Shape(std::vector<std::int64_t> dims) : dims_(std::move(dims)) { check_dims(dims_); }

std::int64_t Shape::dim(int index) const {
  const int r = rank();
  SG_CHECK(index >= -r && index < r, "dimension index ", index, " is out of range for shape ", *this, " of rank ", r);
  return dims_[index < 0 ? index + r : index];
}

std::int64_t Shape::numel() const {
  std::int64_t product = 1;
  for (std::int64_t d : dims_) product = checked_multiply(product, d, *this, "elements");
  return product;
}

std::int64_t Shape::bytes(std::size_t element_size) const {
  return checked_multiply(numel(), static_cast<std::int64_t>(element_size), *this, "bytes");
}

std::string Shape::to_string() const {
  std::string text = "[";
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(dims_[i]);
  }
  return text + "]";
}

std::ostream& operator<<(std::ostream& out, const Shape& shape) { return out << shape.to_string(); }

}  // namespace stepgraph
