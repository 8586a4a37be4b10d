// GraphKey: adding fields, the canonical hash and the readable form.
#include "graphs/graph_key.h"

#include <bit>
#include <charconv>
#include <cmath>
#include <sstream>
#include <system_error>
#include <type_traits>

namespace stepgraph {
namespace {

// Type tags of the canonical encoding: part of the hash, so "1" != 1 != 1.0.
// Fixed numbers, independent of the order of the variant's alternatives.
enum class Tag : std::uint8_t {
  kString = 1,
  kInt = 2,
  kDouble = 3,
  kBool = 4,
  kShape = 5,
  kDType = 6,
  kNested = 7,
};

// 64-bit FNV-1a. Multi-byte integers are fed little-endian, byte by byte, so
// the hash does not depend on the host's byte order.
class Fnv1a {
 public:
  void byte(std::uint8_t value) {
    state_ ^= value;
    state_ *= kPrime;
  }
  void u64(std::uint64_t value) {
    for (int i = 0; i < 8; ++i) byte(static_cast<std::uint8_t>(value >> (8 * i)));
  }
  void tag(Tag value) { byte(static_cast<std::uint8_t>(value)); }
  // Length-prefixed, so consecutive strings cannot run into each other.
  void text(std::string_view value) {
    u64(value.size());
    for (char c : value) byte(static_cast<std::uint8_t>(c));
  }
  std::uint64_t value() const { return state_; }

 private:
  static constexpr std::uint64_t kOffset = 14695981039346656037ull;
  static constexpr std::uint64_t kPrime = 1099511628211ull;
  std::uint64_t state_ = kOffset;
};

void encode(const GraphKey& key, Fnv1a& out);

void encode(const GraphKey::Value& value, Fnv1a& out) {
  std::visit(
      [&out](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          out.tag(Tag::kString);
          out.text(v);
        } else if constexpr (std::is_same_v<T, std::int64_t>) {
          out.tag(Tag::kInt);
          out.u64(static_cast<std::uint64_t>(v));
        } else if constexpr (std::is_same_v<T, double>) {
          out.tag(Tag::kDouble);
          out.u64(std::bit_cast<std::uint64_t>(v == 0.0 ? 0.0 : v));  // -0.0 hashes as 0.0
        } else if constexpr (std::is_same_v<T, bool>) {
          out.tag(Tag::kBool);
          out.byte(v ? 1 : 0);
        } else if constexpr (std::is_same_v<T, Shape>) {
          out.tag(Tag::kShape);
          out.u64(v.dims().size());
          for (std::int64_t d : v.dims()) out.u64(static_cast<std::uint64_t>(d));
        } else if constexpr (std::is_same_v<T, DType>) {
          out.tag(Tag::kDType);
          out.text(dtype_name(v));  // by name: stable if the enum is reordered
        } else {
          static_assert(std::is_same_v<T, GraphKey::Nested>);
          out.tag(Tag::kNested);
          encode(*v.key, out);
        }
      },
      value);
}

// The field count first, so a nested key's end is unambiguous.
void encode(const GraphKey& key, Fnv1a& out) {
  out.u64(key.size());
  for (const GraphKey::Field& field : key.fields()) {
    out.text(field.name);
    encode(field.value, out);
  }
}

// Shortest text that reads back as the same double: 0.001, 1e-07, 512.
std::string double_text(double value) {
  char buffer[32];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  SG_CHECK_CODE(error == std::errc{}, ErrorCode::kInternal, "cannot format double");
  return std::string(buffer, end);
}

void write(const GraphKey::Value& value, std::ostringstream& out) {
  std::visit(
      [&out](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, double>) {
          out << double_text(v);
        } else if constexpr (std::is_same_v<T, bool>) {
          out << (v ? "true" : "false");
        } else if constexpr (std::is_same_v<T, DType>) {
          out << dtype_name(v);
        } else if constexpr (std::is_same_v<T, GraphKey::Nested>) {
          out << v.key->to_string();
        } else {
          out << v;  // string, int64, Shape
        }
      },
      value);
}

}  // namespace

bool GraphKey::Nested::operator==(const Nested& other) const { return *key == *other.key; }

GraphKey& GraphKey::add(std::string_view name, std::string_view value) {
  return add_field(name, Value{std::string(value)});
}

GraphKey& GraphKey::add(std::string_view name, const char* value) {
  SG_CHECK(value != nullptr, "graph key field '", name, "': null string");
  return add(name, std::string_view(value));
}

GraphKey& GraphKey::add(std::string_view name, double value) {
  SG_CHECK(!std::isnan(value), "graph key field '", name,
           "' is NaN; NaN never equals itself, so a key holding it would never hit the cache");
  return add_field(name, Value{value});
}

GraphKey& GraphKey::add(std::string_view name, bool value) { return add_field(name, Value{value}); }

GraphKey& GraphKey::add(std::string_view name, const Shape& value) { return add_field(name, Value{value}); }

GraphKey& GraphKey::add(std::string_view name, DType value) { return add_field(name, Value{value}); }

GraphKey& GraphKey::add(std::string_view name, const GraphKey& nested) {
  return add_field(name, Value{Nested{std::make_shared<const GraphKey>(nested)}});
}

GraphKey& GraphKey::add(std::string_view name, const Fp8Recipe& recipe) {
  GraphKey fields;
  recipe.for_each_field([&](std::string_view field, const auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, int>) {
      fields.add(field, static_cast<std::int64_t>(value));
    } else {
      fields.add(field, value);
    }
  });
  return add(name, fields);
}

GraphKey& GraphKey::add_field(std::string_view name, Value value) {
  SG_CHECK(!name.empty(), "graph key fields need a name");
  for (const Field& field : fields_) {
    SG_CHECK(field.name != name, "graph key field '", name, "' added twice to ", to_string(),
             "; each field name may appear once");
  }
  fields_.push_back(Field{std::string(name), std::move(value)});
  return *this;
}

std::size_t GraphKey::hash() const {
  Fnv1a out;
  encode(*this, out);
  return static_cast<std::size_t>(out.value());
}

std::string GraphKey::to_string() const {
  std::ostringstream out;
  out << '{';
  for (std::size_t i = 0; i < fields_.size(); ++i) {
    if (i > 0) out << ", ";
    out << fields_[i].name << '=';
    write(fields_[i].value, out);
  }
  out << '}';
  return out.str();
}

}  // namespace stepgraph
