// Shapes: a list of non-negative dimension sizes, row-major.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

namespace stepgraph {

class Shape {
 public:
  Shape() = default;  // a scalar: rank 0, one element
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(std::vector<std::int64_t> dims);

  int rank() const { return static_cast<int>(dims_.size()); }
  const std::vector<std::int64_t>& dims() const { return dims_; }

  // dim(-1) is the last dimension; an index outside [-rank, rank) is an Error.
  std::int64_t dim(int index) const;

  // Product of the dimensions (1 for a scalar, 0 if any dimension is 0).
  // Throws if the product overflows int64.
  std::int64_t numel() const;

  // Bytes for `numel()` elements of `element_size` bytes, overflow-checked.
  std::int64_t bytes(std::size_t element_size) const;

  // "[2, 3, 4]"
  std::string to_string() const;

  bool operator==(const Shape& other) const = default;

 private:
  std::vector<std::int64_t> dims_;
};

std::ostream& operator<<(std::ostream& out, const Shape& shape);

}  // namespace stepgraph
