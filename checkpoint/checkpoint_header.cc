#include "checkpoint/checkpoint_header.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>

#include "checkpoint/checkpoint.h"

namespace stepgraph::checkpoint_detail {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";

[[noreturn]] void fail(std::string what) { throw HeaderError{std::move(what)}; }

// Where the parse is: which object or array the next event belongs to.
enum class Place {
  kTop,       // before the root object
  kRoot,      // in the root object
  kMetadata,  // in "__metadata__"
  kEntry,     // in a tensor's entry
  kShape,     // in an entry's "shape"
  kOffsets,   // in an entry's "data_offsets"
  kDone,      // after the root object
};

// The SAX events of nlohmann's parser, checked against the schema. A false
// return stops the parse; the reason is kept in error_.
class HeaderHandler {
 public:
  bool null() { return value("null"); }
  bool boolean(bool) { return value("a boolean"); }
  bool number_integer(Json::number_integer_t number) {
    if (place_ == Place::kShape || place_ == Place::kOffsets) {
      return refuse(fmt::format("tensor {} has a negative number {} in its {}", printable(entry_.name), number,
                                place_ == Place::kShape ? "shape" : "data_offsets"));
    }
    return value("a number");
  }
  bool number_unsigned(Json::number_unsigned_t number) {
    if (place_ == Place::kShape) {
      if (entry_.shape.size() >= kMaxDimensions) {
        return refuse(fmt::format("tensor {} has more than {} dimensions", printable(entry_.name), kMaxDimensions));
      }
      if (number > (std::uint64_t{1} << 62)) {
        return refuse(fmt::format("tensor {} has a dimension {} past 2^62", printable(entry_.name), number));
      }
      entry_.shape.push_back(static_cast<std::int64_t>(number));
      return true;
    }
    if (place_ == Place::kOffsets) {
      if (offsets_ >= 2) return refuse(fmt::format("tensor {} has more than 2 data_offsets", printable(entry_.name)));
      (offsets_++ == 0 ? entry_.begin : entry_.end) = number;
      return true;
    }
    return value("a number");
  }
  bool number_float(Json::number_float_t, const Json::string_t& text) {
    if (place_ == Place::kShape || place_ == Place::kOffsets) {
      return refuse(fmt::format("tensor {} has {} in its {}, not an integer below 2^64", printable(entry_.name),
                                printable(text, 32), place_ == Place::kShape ? "shape" : "data_offsets"));
    }
    return value("a number");
  }
  bool binary(Json::binary_t&) { return value("binary data"); }

  bool string(Json::string_t& text) {
    if (place_ == Place::kMetadata) {
      parsed_.metadata.emplace(key_, std::move(text));
      return true;
    }
    if (place_ == Place::kEntry && key_ == "dtype") {
      const std::optional<DType> dtype = find_safetensors_dtype(text);
      if (!dtype) {
        return refuse(fmt::format("tensor {} has dtype {}; StepGraph reads {}", printable(entry_.name),
                                  printable(text, 32), kSafetensorsDTypeList));
      }
      entry_.dtype = *dtype;
      return true;
    }
    return value("a string");
  }

  bool start_object(std::size_t) {
    if (++depth_ > kMaxHeaderDepth) return too_deep();
    switch (place_) {
      case Place::kTop: place_ = Place::kRoot; return true;
      case Place::kRoot:
        if (key_ == kMetadataKey) {
          metadata_seen_ = true;
          place_ = Place::kMetadata;
        } else {
          entry_ = HeaderEntry{.name = key_};
          entry_keys_.clear();
          place_ = Place::kEntry;
        }
        keys_.clear();
        return true;
      default: return value("an object");
    }
  }
  bool key(Json::string_t& key) {
    if (place_ == Place::kRoot) {
      if (!root_keys_.insert(key).second) {
        return refuse(key == kMetadataKey ? std::string("it has two __metadata__ objects")
                                          : fmt::format("tensor {} appears twice in its header", printable(key)));
      }
      if (key.empty()) return refuse("it has a tensor with an empty name");
    } else if (place_ == Place::kMetadata) {
      if (!keys_.insert(key).second) return refuse(fmt::format("metadata {} appears twice", printable(key)));
    } else if (place_ == Place::kEntry) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        return refuse(fmt::format("tensor {} has an unknown key {} (an entry has dtype, shape and data_offsets)",
                                  printable(entry_.name), printable(key)));
      }
      if (!entry_keys_.insert(key).second) {
        return refuse(fmt::format("tensor {} has {} twice", printable(entry_.name), key));
      }
    }
    key_ = std::move(key);
    return true;
  }
  bool end_object() {
    --depth_;
    switch (place_) {
      case Place::kRoot: place_ = Place::kDone; return true;
      case Place::kMetadata: place_ = Place::kRoot; return true;
      case Place::kEntry: place_ = Place::kRoot; return finish_entry();
      default: return refuse("its header has an unexpected end of an object");
    }
  }
  bool start_array(std::size_t) {
    if (++depth_ > kMaxHeaderDepth) return too_deep();
    if (place_ == Place::kEntry && key_ == "shape") {
      place_ = Place::kShape;
      return true;
    }
    if (place_ == Place::kEntry && key_ == "data_offsets") {
      place_ = Place::kOffsets;
      offsets_ = 0;
      return true;
    }
    return value("a list");
  }
  bool end_array() {
    --depth_;
    if (place_ == Place::kOffsets && offsets_ != 2) {
      return refuse(fmt::format("tensor {} has {} data_offsets, not 2", printable(entry_.name), offsets_));
    }
    place_ = Place::kEntry;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception&) {
    return refuse(fmt::format("its header is not valid JSON (at byte {} of the header)", position));
  }

  ParsedHeader take() {
    if (!error_.empty()) fail(error_);
    if (place_ != Place::kDone) fail("its header is not one complete JSON object");
    if (!metadata_seen_) fail("it has no __metadata__ object");
    return std::move(parsed_);
  }
  const std::string& error() const { return error_; }

 private:
  bool refuse(std::string what) {
    if (error_.empty()) error_ = std::move(what);
    return false;
  }
  bool too_deep() {
    return refuse(fmt::format("its header nests deeper than the {} levels of a checkpoint", kMaxHeaderDepth));
  }
  // A value where the schema has none of its kind.
  bool value(std::string_view kind) {
    switch (place_) {
      case Place::kTop: return refuse(fmt::format("its header is {}, not a JSON object", kind));
      case Place::kRoot:
        return refuse(fmt::format("{} is {}, not an object",
                                  key_ == kMetadataKey ? std::string(kMetadataKey) : "tensor " + printable(key_),
                                  kind));
      case Place::kMetadata: return refuse(fmt::format("metadata {} is {}, not a string", printable(key_), kind));
      case Place::kEntry: return refuse(fmt::format("tensor {} has {} as its {}", printable(entry_.name), kind, key_));
      case Place::kShape:
      case Place::kOffsets:
        return refuse(fmt::format("tensor {} has {} in its {}", printable(entry_.name), kind,
                                  place_ == Place::kShape ? "shape" : "data_offsets"));
      case Place::kDone: return refuse("its header has more after the JSON object");
    }
    return refuse("its header does not have a checkpoint's layout");
  }
  bool finish_entry() {
    if (entry_keys_.size() != 3) {
      return refuse(fmt::format("tensor {} lacks dtype, shape or data_offsets", printable(entry_.name)));
    }
    const std::optional<std::uint64_t> bytes = byte_size(entry_.shape, entry_.dtype);
    if (!bytes) return refuse(fmt::format("tensor {} has a shape too large for any file", printable(entry_.name)));
    if (entry_.end < entry_.begin || entry_.end - entry_.begin != *bytes) {
      return refuse(fmt::format("tensor {} has data_offsets [{}, {}] but its shape and dtype need {} bytes",
                                printable(entry_.name), entry_.begin, entry_.end, *bytes));
    }
    parsed_.entries.push_back(std::move(entry_));
    return true;
  }

  ParsedHeader parsed_;
  Place place_ = Place::kTop;
  int depth_ = 0;
  std::string key_;
  std::set<std::string> root_keys_;
  std::set<std::string> keys_;  // of the metadata
  std::set<std::string> entry_keys_;
  HeaderEntry entry_;
  int offsets_ = 0;
  bool metadata_seen_ = false;
  std::string error_;
};

}  // namespace

std::optional<std::uint64_t> byte_size(const std::vector<std::int64_t>& shape, DType dtype) {
  constexpr std::uint64_t kLimit = std::uint64_t{1} << 62;
  std::uint64_t bytes = dtype_size(dtype);
  for (std::int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && bytes > kLimit / static_cast<std::uint64_t>(dim)) return std::nullopt;
    bytes *= static_cast<std::uint64_t>(dim);
  }
  return bytes;
}

ParsedHeader parse_checkpoint_header(std::string_view text) {
  HeaderHandler handler;
  const bool parsed = Json::sax_parse(text.begin(), text.end(), &handler, Json::input_format_t::json, true);
  if (!parsed && handler.error().empty()) fail("its header is not valid JSON");
  return handler.take();
}

}  // namespace stepgraph::checkpoint_detail
