#include "launch/rendezvous_communicator.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "engine/host_reduce.h"
#include "engine/logging.h"
#include "launch/rendezvous_pair_transfers.h"

namespace stepgraph {
namespace {

// The most bytes one rank gives to one exchange (see Note [Collectives over
// the rendezvous]); a multiple of every element size.
constexpr std::int64_t kPartBytes = std::int64_t{16} << 20;
// all_reduce_many lists its counts in the call's name up to this many buffers, a hash of them beyond.
constexpr std::size_t kListedCounts = 8;
// The caller's name of an exchange() is cut to this many bytes in the call's name.
constexpr std::size_t kShownWhat = 200;
// send_recv's header in each rank's bytes: its `to` and `from`.
constexpr std::size_t kPairBytes = 8;

std::int64_t element_bytes(DType dtype) { return static_cast<std::int64_t>(dtype_size(dtype)); }

// How many parts a call of `count` elements travels in, `per_part` elements each (one part for an empty call,
// so that every rank still meets and compares).
std::int64_t parts_of(std::int64_t count, std::int64_t per_part) {
  return count == 0 ? 1 : (count + per_part - 1) / per_part;
}

std::string part_name(const std::string& call, std::int64_t part, std::int64_t parts) {
  return parts == 1 ? call : detail::concat(call, ", part ", part + 1, " of ", parts);
}

// Runs each_part(first, n, name) for every part of `call` in order: elements [first, first + n) of the `count`,
// exchanged under `name` (the call's name, with "part k of K" when there are several).
template <typename EachPart>
void for_each_part(const std::string& call, std::int64_t count, std::int64_t per_part, const EachPart& each_part) {
  const std::int64_t parts = parts_of(count, per_part);
  for (std::int64_t part = 0; part < parts; ++part) {
    const std::int64_t first = part * per_part;
    each_part(first, std::min(per_part, count - first), part_name(call, part, parts));
  }
}

void copy_bytes(void* to, const void* from, std::int64_t bytes) {
  if (bytes > 0) std::memcpy(to, from, static_cast<std::size_t>(bytes));
}

void put_i32(std::string& out, int value) {
  const auto bits = static_cast<std::uint32_t>(value);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

int get_i32(std::string_view bytes) {
  std::uint32_t bits = 0;
  for (int i = 0; i < 4; ++i)
    bits |= std::uint32_t{static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)])} << (8 * i);
  return static_cast<int>(bits);
}

// "all_reduce_many([10, 20, 30] fp32, sum)"; past kListedCounts buffers the counts are hashed (FNV-1a), so the
// name stays short while two ranks with other counts still differ.
std::string many_name(std::span<const std::int64_t> counts, std::int64_t total, DType dtype, ReduceOp op) {
  std::string text = "all_reduce_many(";
  if (counts.size() <= kListedCounts) {
    text += "[";
    for (std::size_t i = 0; i < counts.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(counts[i]);
    text += detail::concat("] ", dtype_name(dtype));
  } else {
    std::uint64_t hash = 0xcbf29ce484222325ULL;
    for (const std::int64_t count : counts) {
      for (int i = 0; i < 8; ++i) {
        hash ^= (static_cast<std::uint64_t>(count) >> (8 * i)) & 0xff;
        hash *= 0x100000001b3ULL;
      }
    }
    text += detail::concat(counts.size(), " buffers, ", total, " ", dtype_name(dtype), " in all, counts hash ",
                           std::hex, hash, std::dec);
  }
  return detail::concat(text, ", ", reduce_op_name(op), ")");
}

class RendezvousCommunicator final : public Communicator {
 public:
  RendezvousCommunicator(std::unique_ptr<Rendezvous> rendezvous, std::string name)
      : Communicator(std::move(name), rendezvous->rank(), rendezvous->world_size()),
        rendezvous_(std::move(rendezvous)) {}

  ~RendezvousCommunicator() override = default;  // closes the rendezvous; never throws

  Device device() const override { return Device::kHost; }

  void all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op, CUstream_st*) override {
    check_count("all_reduce", count);
    check_reducible("all_reduce", dtype);
    const std::string call =
        next_call(detail::concat("all_reduce(", count, " ", dtype_name(dtype), ", ", reduce_op_name(op), ")"));
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const std::int64_t size = element_bytes(dtype);
    reduce_in_parts(
        call, count, dtype, op,
        [&](std::int64_t first, std::int64_t n, std::string&) {
          return n == 0 ? std::string_view()
                        : std::string_view(reinterpret_cast<const char*>(in + first * size),
                                           static_cast<std::size_t>(n * size));
        },
        [&](std::int64_t first, std::int64_t n, const std::byte* result) {
          copy_bytes(out + first * size, result, n * size);
        });
  }

  // One call for all the buffers (their concatenation travels in parts), reduced element by element as
  // all_reduce would: the same bits.
  void all_reduce_many(std::span<void* const> buffers, std::span<const std::int64_t> counts, DType dtype, ReduceOp op,
                       CUstream_st*) override {
    SG_CHECK(buffers.size() == counts.size(), describe(), " all_reduce_many: ", buffers.size(), " buffers but ",
             counts.size(), " counts");
    std::vector<std::int64_t> starts;  // each buffer's first element in the concatenation
    std::int64_t total = 0;
    for (const std::int64_t count : counts) {
      check_count("all_reduce_many", count);
      starts.push_back(total);
      total += count;
    }
    check_reducible("all_reduce_many", dtype);
    const std::string call = next_call(many_name(counts, total, dtype, op));
    const std::int64_t size = element_bytes(dtype);
    // Calls visit(buffer, element in the buffer, element in [first, first + n), count) for each overlap.
    const auto for_each_piece = [&](std::int64_t first, std::int64_t n, const auto& visit) {
      for (std::size_t b = 0; b < buffers.size(); ++b) {
        const std::int64_t begin = std::max(first, starts[b]);
        const std::int64_t end = std::min(first + n, starts[b] + counts[b]);
        if (begin < end) visit(static_cast<std::byte*>(buffers[b]), begin - starts[b], begin - first, end - begin);
      }
    };
    reduce_in_parts(
        call, total, dtype, op,
        [&](std::int64_t first, std::int64_t n, std::string& scratch) {
          scratch.resize(static_cast<std::size_t>(n * size));
          for_each_piece(first, n, [&](std::byte* buffer, std::int64_t at, std::int64_t to, std::int64_t pieces) {
            copy_bytes(scratch.data() + to * size, buffer + at * size, pieces * size);
          });
          return std::string_view(scratch);
        },
        [&](std::int64_t first, std::int64_t n, const std::byte* result) {
          for_each_piece(first, n, [&](std::byte* buffer, std::int64_t at, std::int64_t from, std::int64_t pieces) {
            copy_bytes(buffer + at * size, result + from * size, pieces * size);
          });
        });
  }

  // Each part covers elements [first, first + n) of every rank's block: each rank gives those slices of all
  // world_size blocks and reduces the slices of its own block.
  void reduce_scatter(const void* send, void* recv, std::int64_t recv_count, DType dtype, ReduceOp op,
                      CUstream_st*) override {
    check_count("reduce_scatter", recv_count);
    check_reducible("reduce_scatter", dtype);
    const std::string call =
        next_call(detail::concat("reduce_scatter(", recv_count, " ", dtype_name(dtype), ", ", reduce_op_name(op), ")"));
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const std::int64_t size = element_bytes(dtype);
    const std::int64_t world = world_size();
    // Each rank gives world_size slices per part, so a part holds fewer elements than the other calls'.
    const std::int64_t per_part = std::max<std::int64_t>(1, kPartBytes / (size * world));
    std::string mine;
    std::vector<std::byte> result;
    for_each_part(call, recv_count, per_part, [&](std::int64_t first, std::int64_t n, const std::string& name) {
      mine.resize(static_cast<std::size_t>(world * n * size));
      for (std::int64_t block = 0; block < world; ++block) {
        copy_bytes(mine.data() + block * n * size, in + (block * recv_count + first) * size, n * size);
      }
      const std::vector<std::string> blobs = gather(mine, name);
      check_sizes(blobs, name, [&](int) { return world * n * size; });
      result.resize(static_cast<std::size_t>(n * size));
      reduce_on_host(result.data(), sources_of(blobs), rank() * n, n, dtype, op);
      copy_bytes(out + first * size, result.data(), n * size);
    });
  }

  void all_gather(const void* send, void* recv, std::int64_t send_count, DType dtype, CUstream_st*) override {
    check_count("all_gather", send_count);
    const std::string call = next_call(detail::concat("all_gather(", send_count, " ", dtype_name(dtype), ")"));
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const std::int64_t size = element_bytes(dtype);
    for_each_part(
        call, send_count, kPartBytes / size, [&](std::int64_t first, std::int64_t n, const std::string& name) {
          const std::vector<std::string> blobs = gather(view_of(in + first * size, n * size), name);
          check_sizes(blobs, name, [&](int) { return n * size; });
          for (int r = 0; r < world_size(); ++r) {
            copy_bytes(out + (r * send_count + first) * size, blobs[static_cast<std::size_t>(r)].data(), n * size);
          }
        });
  }

  // Root 0 uses Rendezvous::broadcast; another root gives its bytes to an all_gather where the others give none.
  void broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root, CUstream_st*) override {
    check_count("broadcast", count);
    check_peer("broadcast", root, "root");
    const std::string call =
        next_call(detail::concat("broadcast(", count, " ", dtype_name(dtype), ", root ", root, ")"));
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const std::int64_t size = element_bytes(dtype);
    for_each_part(call, count, kPartBytes / size, [&](std::int64_t first, std::int64_t n, const std::string& name) {
      const std::string_view mine = rank() == root ? view_of(in + first * size, n * size) : std::string_view();
      if (root == 0) {
        const std::string data = broadcast_from_rank0(mine, name);
        if (static_cast<std::int64_t>(data.size()) != n * size) {
          fail(ErrorCode::kInternal,
               detail::concat(describe(), " ", name, ": rank 0 broadcast ", data.size(), " bytes, not ", n * size,
                              " (a different StepGraph build on another rank?)"));
        }
        copy_bytes(out + first * size, data.data(), n * size);
      } else {
        const std::vector<std::string> blobs = gather(mine, name);
        check_sizes(blobs, name, [&](int r) { return r == root ? n * size : 0; });
        copy_bytes(out + first * size, blobs[static_cast<std::size_t>(root)].data(), n * size);
      }
    });
  }

  // A world of two only: Note [Transfers in a world of two].
  void send(const void* data, std::int64_t count, DType dtype, int peer, CUstream_st*) override {
    check_count("send", count);
    check_peer("send", peer, "peer");
    check_pair("send", "to", peer);
    transfer({.call = next_transfer(detail::concat("send(", count, " ", dtype_name(dtype), " to rank ", peer, ")")),
              .send = static_cast<const std::byte*>(data),
              .send_bytes = count * element_bytes(dtype)});
  }

  void recv(void* data, std::int64_t count, DType dtype, int peer, CUstream_st*) override {
    check_count("recv", count);
    check_peer("recv", peer, "peer");
    check_pair("recv", "from", peer);
    transfer({.call = next_transfer(detail::concat("recv(", count, " ", dtype_name(dtype), " from rank ", peer, ")")),
              .recv = static_cast<std::byte*>(data),
              .recv_bytes = count * element_bytes(dtype)});
  }

  // A collective: every rank gives its pair (to, from) and its bytes, and takes the bytes of `from`.
  void send_recv(const void* send_data, int to, void* recv_data, int from, std::int64_t count, DType dtype,
                 CUstream_st*) override {
    check_count("send_recv", count);
    check_peer("send_recv", to, "peer");
    check_peer("send_recv", from, "peer");
    if (world_size() == 2) {  // Note [Transfers in a world of two]
      transfer({.call = next_transfer(detail::concat("send_recv(", count, " ", dtype_name(dtype), " to rank ", to,
                                                     ", from rank ", from, ")")),
                .send = static_cast<const std::byte*>(send_data),
                .send_bytes = count * element_bytes(dtype),
                .recv = static_cast<std::byte*>(recv_data),
                .recv_bytes = count * element_bytes(dtype)});
      return;
    }
    const std::string call = next_call(detail::concat("send_recv(", count, " ", dtype_name(dtype), ")"));
    const auto* in = static_cast<const std::byte*>(send_data);
    auto* out = static_cast<std::byte*>(recv_data);
    const std::int64_t size = element_bytes(dtype);
    std::string mine;
    for_each_part(call, count, kPartBytes / size, [&](std::int64_t first, std::int64_t n, const std::string& name) {
      mine.clear();
      put_i32(mine, to);
      put_i32(mine, from);
      mine.append(view_of(in + first * size, n * size));
      const std::vector<std::string> blobs = gather(mine, name);
      check_sizes(blobs, name, [&](int) { return static_cast<std::int64_t>(kPairBytes) + n * size; });
      if (first == 0) check_pairs(blobs, call);  // the first part
      copy_bytes(out + first * size, blobs[static_cast<std::size_t>(from)].data() + kPairBytes, n * size);
    });
  }

  std::vector<std::string> exchange(std::string_view local, std::string_view what) override {
    SG_CHECK(local.size() <= Rendezvous::kMaxBlobBytes, describe(), " exchange '", what.substr(0, kShownWhat),
             "': ", local.size(), " bytes, more than the ", Rendezvous::kMaxBlobBytes,
             " one exchange takes (exchange is for small blobs: hashes, flags)");
    const std::string call = next_call(detail::concat("exchange '", what.substr(0, kShownWhat), "'"));
    return gather(local, call);
  }

  void abort(std::string_view reason) noexcept override {
    try {
      bool first = false;
      {
        std::lock_guard lock(mutex_);
        if (failure_.empty()) {
          failure_ = detail::concat("rank ", rank(), " aborted: ", reason);
          failure_code_ = ErrorCode::kInvalidState;
          first = true;
        }
        // A call in flight on another thread closes it when it returns (Note [Collectives over the rendezvous]).
        if (!in_call_) rendezvous_.reset();
      }
      if (first) logger().error("{} aborted: {}", describe(), reason);
    } catch (...) {
      // Never throws: a failure to log leaves the abort done.
    }
  }

  void check_health() override {
    std::lock_guard lock(mutex_);
    SG_CHECK_CODE(failure_.empty(), failure_code_, describe(), " failed: ", failure_);
  }

 private:
  void check_reducible(std::string_view call, DType dtype) const {
    SG_CHECK(!is_fp8(dtype), describe(), " ", call,
             ": fp8 values cannot be reduced (NCCL neither); reduce in bf16 or fp32, got ", dtype_name(dtype));
  }

  // A lone send or recv travels only in a world of two (see Note [Collectives over the rendezvous]).
  void check_pair(std::string_view call, std::string_view direction, int peer) const {
    SG_CHECK_CODE(world_size() == 2, ErrorCode::kUnsupported, describe(), " ", call, " ", direction, " rank ", peer,
                  ": a lone ", call, " cannot travel over the rendezvous in a world of ", world_size(),
                  " (a star of collectives: every exchange involves every rank, so only a world of 2 carries it); use "
                  "send_recv with every rank taking part (a ring or shift), or the thread world (HostWorld) or NCCL, "
                  "where point to point is real");
  }

  std::string next_call(std::string_view kind) { return detail::concat(kind, " #", ++calls_); }
  // Transfers are numbered apart from the collectives: the two ranks of a pipeline make different numbers of them
  // (one send_recv against a recv and a send), and the collectives after must still agree.
  std::string next_transfer(std::string_view kind) { return detail::concat(kind, ", transfer #", ++transfers_); }

  // A world of two: see Note [Transfers in a world of two]. A fault spends the communicator on both ranks alike.
  void transfer(const PairTransfer& pair) {
    const std::optional<PairTransferFault> fault =
        run_pair_transfer(rank(), pair, kPartBytes, meetings_, [&](std::string_view local, const std::string& what) {
          return guarded(
              what, [&](Rendezvous& rendezvous) { return rendezvous.all_gather(local, what); }, pair.call);
        });
    if (fault) fail(fault->code, detail::concat(describe(), " ", pair.call, ": ", fault->message));
  }

  static std::string_view view_of(const std::byte* data, std::int64_t bytes) {
    return bytes == 0 ? std::string_view()
                      : std::string_view(reinterpret_cast<const char*>(data), static_cast<std::size_t>(bytes));
  }

  static std::vector<const void*> sources_of(const std::vector<std::string>& blobs) {
    std::vector<const void*> sources;
    sources.reserve(blobs.size());
    for (const std::string& blob : blobs) sources.push_back(blob.data());
    return sources;
  }

  // The all-reduce of `count` elements in parts: local(first, n, scratch) is this rank's bytes of elements
  // [first, first + n); store(first, n, result) takes their reduction, in rank order.
  template <typename Local, typename Store>
  void reduce_in_parts(const std::string& call, std::int64_t count, DType dtype, ReduceOp op, const Local& local,
                       const Store& store) {
    const std::int64_t size = element_bytes(dtype);
    std::string scratch;
    std::vector<std::byte> result;
    for_each_part(call, count, kPartBytes / size, [&](std::int64_t first, std::int64_t n, const std::string& name) {
      const std::vector<std::string> blobs = gather(local(first, n, scratch), name);
      check_sizes(blobs, name, [&](int) { return n * size; });
      result.resize(static_cast<std::size_t>(n * size));
      reduce_on_host(result.data(), sources_of(blobs), 0, n, dtype, op);
      store(first, n, result.data());
    });
  }

  // ---- the exchanges, and what a failure does (Note [Collectives over the rendezvous])

  std::vector<std::string> gather(std::string_view local, const std::string& what) {
    return guarded(what, [&](Rendezvous& rendezvous) { return rendezvous.all_gather(local, what); });
  }

  std::string broadcast_from_rank0(std::string_view local, const std::string& what) {
    return guarded(what, [&](Rendezvous& rendezvous) { return rendezvous.broadcast(local, what); });
  }

  // Runs one exchange of the rendezvous: raises at once if the communicator is spent; spends it if the exchange
  // fails or abort() came meanwhile. `transfer`: the transfer this exchange is a meeting of, if one.
  template <typename Exchange>
  std::invoke_result_t<const Exchange&, Rendezvous&> guarded(const std::string& what, const Exchange& exchange,
                                                             std::string_view transfer = {}) {
    const std::string label = transfer.empty() ? what : detail::concat(transfer, ", ", what);
    Rendezvous& rendezvous = enter(label);
    std::invoke_result_t<const Exchange&, Rendezvous&> result;
    try {
      result = exchange(rendezvous);
    } catch (const Error& error) {
      fail(error.code(), exchange_failure(label, !transfer.empty(), error));
    } catch (const std::exception& error) {
      fail(ErrorCode::kInternal, detail::concat(describe(), " ", label, " failed: ", error.what()));
    }
    leave(label);
    return result;
  }

  Rendezvous& enter(const std::string& what) {
    std::lock_guard lock(mutex_);
    SG_CHECK_CODE(failure_.empty(), ErrorCode::kInvalidState, describe(), " ", what,
                  ": the communicator failed earlier (", failure_, ") and cannot be used again; end this run");
    in_call_ = true;
    return *rendezvous_;
  }

  void leave(const std::string& what) {
    std::lock_guard lock(mutex_);
    in_call_ = false;
    if (failure_.empty()) return;
    rendezvous_.reset();  // abort() came during the call: close now, so the peers fail fast
    SG_THROW(ErrorCode::kInvalidState, describe(), " ", what, ": ", failure_, " (during this call)");
  }

  // The message for a failed exchange. kInvalidState from the rendezvous means the ranks' `what` differ: calls
  // that differ, or are out of order (rendezvous.h).
  std::string exchange_failure(const std::string& what, bool transfer, const Error& error) const {
    if (error.code() == ErrorCode::kInvalidState && transfer) {
      return detail::concat(describe(), " ", what,
                            ": the peer is not in a transfer (send, recv or send_recv) but in "
                            "another call: ",
                            error.message());
    }
    if (error.code() == ErrorCode::kInvalidState) {
      return detail::concat(describe(), " ", what, ": collective #", calls_,
                            " differs between ranks: ", error.message());
    }
    return detail::concat(describe(), " ", what, " failed: ", error.message());
  }

  // Spends the communicator: records the failure, closes the rendezvous (the peers waiting on this rank fail
  // fast) and raises.
  [[noreturn]] void fail(ErrorCode code, const std::string& message) {
    {
      std::lock_guard lock(mutex_);
      in_call_ = false;
      if (failure_.empty()) {
        failure_ = message;
        failure_code_ = code;
      }
      rendezvous_.reset();
    }
    logger().error("{}", message);
    SG_THROW(code, message);
  }

  // Every rank gets the same blobs, so a wrong size (a bug, or another build) raises on every rank alike.
  template <typename Expected>
  void check_sizes(const std::vector<std::string>& blobs, const std::string& what, const Expected& expected) {
    for (std::size_t r = 0; r < blobs.size(); ++r) {
      const std::int64_t want = expected(static_cast<int>(r));
      if (static_cast<std::int64_t>(blobs[r].size()) != want) {
        fail(ErrorCode::kInternal,
             detail::concat(describe(), " ", what, ": rank ", r, " gave ", blobs[r].size(), " bytes, not ", want,
                            " (a different StepGraph build on another rank?)"));
      }
    }
  }

  // send_recv: rank r's `to` must receive from r. Every rank checks the same pairs, so all raise the same Error.
  void check_pairs(const std::vector<std::string>& blobs, const std::string& call) {
    const int world = world_size();
    std::vector<int> to(blobs.size());
    std::vector<int> from(blobs.size());
    for (std::size_t r = 0; r < blobs.size(); ++r) {
      to[r] = get_i32(blobs[r]);
      from[r] = get_i32(std::string_view(blobs[r]).substr(4));
      if (to[r] < 0 || to[r] >= world || from[r] < 0 || from[r] >= world) {
        fail(ErrorCode::kInternal, detail::concat(describe(), " ", call, ": rank ", r, " gave the pair (to ", to[r],
                                                  ", from ", from[r], "), outside the world"));
      }
    }
    std::string unpaired;
    for (int r = 0; r < world; ++r) {
      const int peer = to[static_cast<std::size_t>(r)];
      const int peer_from = from[static_cast<std::size_t>(peer)];
      if (peer_from != r) {
        unpaired += detail::concat(unpaired.empty() ? "" : "; ", "rank ", r, " sends to rank ", peer, ", but rank ",
                                   peer, " receives from rank ", peer_from);
      }
    }
    if (!unpaired.empty()) {
      fail(ErrorCode::kInvalidState,
           detail::concat(describe(), " ", call, ": sends and receives do not pair up: ", unpaired,
                          ". Over the rendezvous send_recv is a collective: every rank calls it, and the rank it "
                          "sends to receives from it (a ring or shift); for other patterns use the thread world "
                          "(HostWorld) or NCCL"));
    }
  }

  std::mutex mutex_;  // guards the four below: abort() and check_health() may come from another thread
  std::unique_ptr<Rendezvous> rendezvous_;  // null once closed (failure_ is set then)
  std::string failure_;                     // the first failure or abort; set once
  ErrorCode failure_code_ = ErrorCode::kInternal;
  bool in_call_ = false;        // an exchange is in flight on the calling thread
  std::int64_t calls_ = 0;      // collectives and exchanges made (the calling thread only)
  std::int64_t transfers_ = 0;  // sends, recvs and send_recvs of a world of two made (the calling thread only)
  std::int64_t meetings_ = 0;   // their meetings (Note [Transfers in a world of two]; the calling thread only)
};

}  // namespace

std::unique_ptr<Communicator> make_rendezvous_communicator(std::unique_ptr<Rendezvous> rendezvous, std::string name) {
  SG_CHECK(rendezvous != nullptr, "make_rendezvous_communicator: the rendezvous is null");
  return std::make_unique<RendezvousCommunicator>(std::move(rendezvous), std::move(name));
}

}  // namespace stepgraph
