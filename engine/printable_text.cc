#include "engine/printable_text.h"

namespace stepgraph {
namespace {

void escape_into(std::string& out, std::string_view text, bool quote) {
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f && !(quote && (c == '\'' || c == '\\'))) {
      out += c;
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
    }
  }
}

}  // namespace

std::string quoted(std::string_view text, std::size_t shown) {
  std::string out = "'";
  escape_into(out, text.substr(0, shown), true);
  out += text.size() > shown ? "'..." : "'";
  return out;
}

std::string escaped(std::string_view text, std::size_t shown) {
  std::string out;
  escape_into(out, text.substr(0, shown), false);
  if (text.size() > shown) out += "...";
  return out;
}

}  // namespace stepgraph
