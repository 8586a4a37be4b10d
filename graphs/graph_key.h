// GraphKey: the value key a captured graph is cached under. A key is an
// ordered list of named plain values (strings, integers, doubles, bools,
// shapes, dtypes, nested keys); two keys are equal when their fields are, never
// by object identity, so configs built separately with the same values meet
// the same graph. CUDA-free.
//
//   GraphKey key;
//   key.add("layer", "mlp").add("hidden", 512).add("lr", 1e-3)
//      .add("x", Shape{8, 512}).add("dtype", DType::kBFloat16).add("fused", true);
//   key.to_string();  // {layer=mlp, hidden=512, lr=0.001, x=[8, 512], dtype=bf16, fused=true}
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/fp8_recipe.h"
#include "engine/shape.h"

namespace stepgraph {

class GraphKey {
 public:
  // A key inside a key (a layer's key inside a model's key). Held as an
  // immutable copy; compared and hashed by value, never by address.
  struct Nested {
    std::shared_ptr<const GraphKey> key;
    bool operator==(const Nested& other) const;
  };

  using Value = std::variant<std::string, std::int64_t, double, bool, Shape, DType, Nested>;

  struct Field {
    std::string name;
    Value value;
    bool operator==(const Field& other) const = default;
  };

  // Each add appends one field and returns *this for chaining. Names must be
  // non-empty and unique within the key; order matters.
  GraphKey& add(std::string_view name, std::string_view value);
  GraphKey& add(std::string_view name, const char* value);  // else "mlp" would pick the bool overload
  GraphKey& add(std::string_view name, double value);       // NaN is an Error; -0.0 equals 0.0
  GraphKey& add(std::string_view name, bool value);
  GraphKey& add(std::string_view name, const Shape& value);
  GraphKey& add(std::string_view name, DType value);
  GraphKey& add(std::string_view name, const GraphKey& nested);
  // An FP8 recipe as a nested key of the fields that count for its scaling
  // (Fp8Recipe::for_each_field): equal recipes, equal keys.
  GraphKey& add(std::string_view name, const Fp8Recipe& recipe);

  // Every integer type but bool is stored as int64.
  template <std::integral T>
  requires(!std::same_as<T, bool>) GraphKey& add(std::string_view name, T value) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(std::int64_t)) {
      SG_CHECK(std::in_range<std::int64_t>(value), "graph key field '", name, "': ", value, " does not fit in int64");
    }
    return add_field(name, Value{static_cast<std::int64_t>(value)});
  }

  const std::vector<Field>& fields() const { return fields_; }
  bool empty() const { return fields_.empty(); }
  std::size_t size() const { return fields_.size(); }

  // FNV-1a (64-bit) over a canonical encoding of names, type tags and values:
  // equal keys hash equal, on every run and machine of the same word size.
  std::size_t hash() const;

  // "{layer=mlp, hidden=512, lr=0.001, x=[8, 512], dtype=bf16, fused=true}"
  std::string to_string() const;

  bool operator==(const GraphKey& other) const = default;

 private:
  GraphKey& add_field(std::string_view name, Value value);

  std::vector<Field> fields_;
};

struct GraphKeyHash {
  std::size_t operator()(const GraphKey& key) const { return key.hash(); }
};

}  // namespace stepgraph

template <>
struct std::hash<stepgraph::GraphKey> {
  std::size_t operator()(const stepgraph::GraphKey& key) const { return key.hash(); }
};
