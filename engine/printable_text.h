// Text from outside the process (a file, the network, the environment) made
// fit for a message: every byte that is not printable ASCII, terminal
// escapes included, becomes \xNN, and long text is cut.
//
//   SG_THROW(ErrorCode::kIo, "metadata ", quoted(key), " appears twice");   // 'a\x1b[2Jb'
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace stepgraph {

// In single quotes, quotes and backslashes escaped too, cut after `shown` bytes ("'abc'...").
std::string quoted(std::string_view text, std::size_t shown = 120);
// No quotes (quotes and backslashes kept), cut after `shown` bytes: for a whole message that came off the wire.
std::string escaped(std::string_view text, std::size_t shown = 16384);

}  // namespace stepgraph
