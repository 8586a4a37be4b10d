#include "engine/stream_order.h"

#include <algorithm>

#include "engine/error.h"

namespace stepgraph {
namespace {

void check_stream(int stream, int stream_count) {
  SG_CHECK(stream >= 0 && stream < stream_count, "stream index ", stream, " out of range: StreamOrder has ",
           stream_count, " streams");
}

void check_values(std::span<const std::int64_t> values) {
  for (std::int64_t value : values) SG_CHECK(value >= 0, "value ids must be >= 0, got ", value);
}

}  // namespace

StreamOrder::StreamOrder(int stream_count) : stream_count_(stream_count) {
  SG_CHECK(stream_count >= 1, "StreamOrder needs at least one stream, got ", stream_count);
  clocks_.assign(stream_count, std::vector<std::int64_t>(stream_count, 0));
  history_.resize(stream_count);
}

int StreamOrder::stream_count() const { return stream_count_; }

std::vector<StreamWait> StreamOrder::prepare(int stream, std::span<const std::int64_t> reads,
                                             std::span<const std::int64_t> writes) {
  check_stream(stream, stream_count_);
  check_values(reads);
  check_values(writes);
  // Per signal stream, the highest token this instruction must follow (0: none).
  std::vector<std::int64_t> needed(stream_count_, 0);
  const auto need = [&](int signal, std::int64_t token) {
    if (signal != stream) needed[signal] = std::max(needed[signal], token);
  };
  for (std::int64_t value : reads) {
    const auto found = values_.find(value);
    if (found != values_.end()) need(found->second.last_write.stream, found->second.last_write.token);
  }
  for (std::int64_t value : writes) {
    const auto found = values_.find(value);
    if (found == values_.end()) continue;
    need(found->second.last_write.stream, found->second.last_write.token);
    for (int reader = 0; reader < stream_count_; ++reader) need(reader, found->second.reads_since[reader]);
  }
  const std::vector<std::int64_t>& known = clocks_[stream];
  for (int signal = 0; signal < stream_count_; ++signal) {
    if (needed[signal] <= known[signal]) needed[signal] = 0;
  }
  // A need is implied when another need's signal had already seen it when it
  // issued that token. Implication is transitive and acyclic, so dropping every
  // implied need leaves the minimal set.
  std::vector<StreamWait> out;
  for (int signal = 0; signal < stream_count_; ++signal) {
    if (needed[signal] == 0) continue;
    bool implied = false;
    for (int other = 0; other < stream_count_ && !implied; ++other) {
      implied = other != signal && needed[other] > 0 && history_[other][needed[other] - 1][signal] >= needed[signal];
    }
    if (!implied) wait(stream, signal, needed[signal], out);
  }
  return out;
}

std::int64_t StreamOrder::issue(int stream, std::span<const std::int64_t> reads, std::span<const std::int64_t> writes) {
  check_stream(stream, stream_count_);
  check_values(reads);
  check_values(writes);
  std::vector<std::int64_t>& clock = clocks_[stream];
  const std::int64_t token = ++clock[stream];
  history_[stream].push_back(clock);
  const auto state = [&](std::int64_t value) -> ValueState& {
    ValueState& found = values_[value];
    if (found.reads_since.empty()) found.reads_since.assign(stream_count_, 0);
    return found;
  };
  for (std::int64_t value : reads) state(value).reads_since[stream] = token;
  // After the reads: an in-place write's own read is ordered before the next writer by this write.
  for (std::int64_t value : writes) {
    ValueState& written = state(value);
    written.last_write = {stream, token};
    std::fill(written.reads_since.begin(), written.reads_since.end(), 0);
  }
  return token;
}

std::vector<StreamWait> StreamOrder::order_after(int waiter, int signal) {
  check_stream(waiter, stream_count_);
  check_stream(signal, stream_count_);
  std::vector<StreamWait> out;
  const std::int64_t issued = clocks_[signal][signal];
  if (waiter != signal && issued > 0) wait(waiter, signal, issued, out);
  return out;
}

const std::vector<std::int64_t>& StreamOrder::clock(int stream) const {
  check_stream(stream, stream_count_);
  return clocks_[stream];
}

void StreamOrder::forget(std::int64_t value) { values_.erase(value); }

void StreamOrder::wait(int waiter, int signal, std::int64_t token, std::vector<StreamWait>& out) {
  std::vector<std::int64_t>& clock = clocks_[waiter];
  if (clock[signal] >= token) return;
  // Waiting on (signal, token) orders the waiter after all that signal knew when it issued token.
  const std::vector<std::int64_t>& known = history_[signal][token - 1];
  for (int stream = 0; stream < stream_count_; ++stream) clock[stream] = std::max(clock[stream], known[stream]);
  out.push_back({waiter, signal, token});
}

}  // namespace stepgraph
