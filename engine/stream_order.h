// StreamOrder: which waits make accesses on several streams safe.
//
// Work on one stream runs in order. Work on different streams is ordered only
// by events: the signal stream records an event after one of its instructions
// and the waiting stream waits on it. StreamOrder tracks, per value, the last
// write and the reads since, and per stream a vector clock of what that stream
// is already ordered after, and answers which waits an access needs:
//   read  after write  (RAW): wait for the last writer on another stream;
//   write after read   (WAR): wait for every read since the last write on another stream;
//   write after write  (WAW): wait for the last writer on another stream.
// Waits already implied by earlier ones (transitively) are not repeated.
//
// It serves the Planner (offline, over a Program) and eager execution (online:
// the waits become cudaEventRecord/cudaStreamWaitEvent now). Freeing memory
// is a write: waits for a free make every earlier access complete first.
// CUDA-free.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace stepgraph {

// `waiter` must not start its next instruction before instruction number
// `signal_token` (1-based count of instructions issued on `signal`) completes.
struct StreamWait {
  int waiter = 0;
  int signal = 0;
  std::int64_t signal_token = 0;

  bool operator==(const StreamWait&) const = default;
};

class StreamOrder {
 public:
  explicit StreamOrder(int stream_count);

  int stream_count() const;

  // The waits an instruction on `stream` needs before it reads `reads` and
  // writes `writes` (value ids: any non-negative integers). The caller must
  // perform them; StreamOrder records them as performed.
  std::vector<StreamWait> prepare(int stream, std::span<const std::int64_t> reads,
                                  std::span<const std::int64_t> writes);

  // Issues the instruction prepared last on `stream` with these accesses;
  // returns its token (1-based count on `stream`).
  std::int64_t issue(int stream, std::span<const std::int64_t> reads, std::span<const std::int64_t> writes);

  // Waits that order `waiter` after everything issued so far on `signal`
  // (a fork when waiter is a side stream and signal the main stream; a join
  // the other way round). Empty when already ordered or nothing was issued.
  std::vector<StreamWait> order_after(int waiter, int signal);

  // What `stream` is ordered after now: clock[s] is the highest token of
  // stream s known complete before the stream's next instruction
  // (clock[stream] is the count issued on it so far).
  const std::vector<std::int64_t>& clock(int stream) const;

  // Drops a value's access history (eager: after its memory was freed).
  void forget(std::int64_t value);

 private:
  struct Access {
    int stream = 0;
    std::int64_t token = 0;
  };
  struct ValueState {
    Access last_write;                      // token 0: never written
    std::vector<std::int64_t> reads_since;  // per stream: highest read token since the last write
  };
  void wait(int waiter, int signal, std::int64_t token, std::vector<StreamWait>& out);

  int stream_count_;
  std::vector<std::vector<std::int64_t>> clocks_;                // per stream: current knowledge
  std::vector<std::vector<std::vector<std::int64_t>>> history_;  // per stream, per token: clock at issue
  std::unordered_map<std::int64_t, ValueState> values_;
};

}  // namespace stepgraph
