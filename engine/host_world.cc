#include "engine/host_world.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "engine/error.h"
#include "engine/host_reduce.h"
#include "engine/logging.h"

namespace stepgraph {
namespace {

// One rank's posted call (Note [Host collectives]).
struct Call {
  std::string kind;
  std::int64_t count = 0;
  DType dtype = DType::kFloat32;
  std::optional<ReduceOp> op;
  int root = -1;
  const void* send = nullptr;
  std::string bytes;  // exchange()

  bool same_as(const Call& other) const {
    return kind == other.kind && count == other.count && dtype == other.dtype && op == other.op && root == other.root;
  }
  std::string describe() const {
    std::ostringstream out;
    out << kind << "(" << count << " " << dtype_name(dtype);
    if (op) out << ", " << reduce_op_name(*op);
    if (root >= 0) out << ", root " << root;
    out << ")";
    return out.str();
  }
};

}  // namespace

struct HostWorld::Shared {
  Shared(int size, std::chrono::milliseconds timeout, bool peer_copies)
      : size(size),
        timeout(timeout),
        peer_copies(peer_copies),
        posted(static_cast<std::size_t>(size)),
        waiting(static_cast<std::size_t>(size)) {
    for (int r = 0; r < size; ++r) signals.push_back(std::make_unique<std::atomic<std::uint32_t>[]>(2 * kPeerSignalSlots));
  }

  const int size;
  const std::chrono::milliseconds timeout;
  const bool peer_copies;
  // Per rank: ready[kPeerSignalSlots] then data[...] (Note [The pool as symmetric memory]).
  std::vector<std::unique_ptr<std::atomic<std::uint32_t>[]>> signals;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Call> posted;   // per rank, valid between the two barriers of a call
  std::vector<bool> waiting;  // per rank: arrived at the current barrier
  int arrived = 0;
  std::int64_t generation = 0;  // barriers passed
  std::string abort_reason;     // set once: the world is aborted
  std::exception_ptr first_failure;
  int first_failed_rank = -1;
  std::map<std::pair<int, int>, std::deque<std::string>> mailbox;  // (from, to) -> messages

  // Both under `mutex`.
  void abort_locked(std::string reason) {
    if (!abort_reason.empty()) return;
    abort_reason = std::move(reason);
    logger().error("host world aborted: {}", abort_reason);
    changed.notify_all();
  }
  [[noreturn]] void raise_aborted(int rank, const std::string& call) const {
    SG_THROW(ErrorCode::kInvalidState, "host world rank ", rank, " at ", call,
             ": the world was aborted: ", abort_reason);
  }

  // Waits until every rank reached this barrier, or the world aborts.
  void barrier(int rank, const std::string& call, std::unique_lock<std::mutex>& lock) {
    if (!abort_reason.empty()) raise_aborted(rank, call);
    const std::int64_t gen = generation;
    waiting[static_cast<std::size_t>(rank)] = true;
    if (++arrived == size) {
      arrived = 0;
      waiting.assign(waiting.size(), false);
      ++generation;
      changed.notify_all();
      return;
    }
    const bool passed = changed.wait_for(lock, timeout, [&] { return generation != gen || !abort_reason.empty(); });
    if (!abort_reason.empty()) raise_aborted(rank, call);
    if (!passed) {
      std::string missing;
      for (int r = 0; r < size; ++r) {
        if (!waiting[static_cast<std::size_t>(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      abort_locked(detail::concat("rank ", rank, " waited ", timeout.count(), " ms at ", call, "; rank(s) ", missing,
                                  " never arrived (dead, stalled, or issuing other collectives)"));
      raise_aborted(rank, call);
    }
  }
};

namespace {

class HostCommunicator final : public Communicator {
 public:
  HostCommunicator(std::shared_ptr<HostWorld::Shared> shared, int rank, std::string name)
      : Communicator(std::move(name), rank, shared->size), shared_(std::move(shared)) {
    if (shared_->peer_copies) {
      set_peer_transport(PeerTransport::kPeerCopy, "threads of one process share their memory");
    } else {
      set_peer_transport(PeerTransport::kNccl, "peer copies turned off for this host world");
    }
  }

  Device device() const override { return Device::kHost; }

  void all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op, CUstream_st*) override {
    check_count("all_reduce", count);
    check_reducible("all_reduce", dtype);
    meet(
        {"all_reduce", count, dtype, op, -1, send, {}}, recv,
        [&](const std::vector<const void*>& sends, std::byte* out) { reduce_on_host(out, sends, 0, count, dtype, op); },
        count * static_cast<std::int64_t>(dtype_size(dtype)));
  }

  void reduce_scatter(const void* send, void* recv, std::int64_t recv_count, DType dtype, ReduceOp op,
                      CUstream_st*) override {
    check_count("reduce_scatter", recv_count);
    check_reducible("reduce_scatter", dtype);
    meet(
        {"reduce_scatter", recv_count, dtype, op, -1, send, {}}, recv,
        [&](const std::vector<const void*>& sends, std::byte* out) {
          reduce_on_host(out, sends, rank() * recv_count, recv_count, dtype, op);
        },
        recv_count * static_cast<std::int64_t>(dtype_size(dtype)));
  }

  void all_gather(const void* send, void* recv, std::int64_t send_count, DType dtype, CUstream_st*) override {
    check_count("all_gather", send_count);
    const std::int64_t block = send_count * static_cast<std::int64_t>(dtype_size(dtype));
    meet(
        {"all_gather", send_count, dtype, std::nullopt, -1, send, {}}, recv,
        [&](const std::vector<const void*>& sends, std::byte* out) {
          for (std::size_t r = 0; r < sends.size(); ++r) {
            if (block > 0)
              std::memcpy(out + static_cast<std::int64_t>(r) * block, sends[r], static_cast<std::size_t>(block));
          }
        },
        block * world_size());
  }

  void broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root, CUstream_st*) override {
    check_count("broadcast", count);
    check_peer("broadcast", root, "root");
    const std::int64_t bytes = count * static_cast<std::int64_t>(dtype_size(dtype));
    meet(
        {"broadcast", count, dtype, std::nullopt, root, send, {}}, recv,
        [&](const std::vector<const void*>& sends, std::byte* out) {
          if (bytes > 0) std::memcpy(out, sends[static_cast<std::size_t>(root)], static_cast<std::size_t>(bytes));
        },
        bytes);
  }

  void send(const void* data, std::int64_t count, DType dtype, int peer, CUstream_st*) override {
    check_count("send", count);
    check_peer("send", peer, "peer");
    const std::string message(static_cast<const char*>(data), static_cast<std::size_t>(count) * dtype_size(dtype));
    std::lock_guard lock(shared_->mutex);
    const std::string call = next_call_name("send");
    if (!shared_->abort_reason.empty()) shared_->raise_aborted(rank(), call);
    shared_->mailbox[{rank(), peer}].push_back(message);
    shared_->changed.notify_all();
  }

  void recv(void* data, std::int64_t count, DType dtype, int peer, CUstream_st*) override {
    check_count("recv", count);
    check_peer("recv", peer, "peer");
    std::unique_lock lock(shared_->mutex);
    const std::string call = next_call_name("recv");
    auto& queue = shared_->mailbox[{peer, rank()}];
    const bool ready = shared_->changed.wait_for(lock, shared_->timeout,
                                                 [&] { return !queue.empty() || !shared_->abort_reason.empty(); });
    if (!shared_->abort_reason.empty()) shared_->raise_aborted(rank(), call);
    if (!ready) {
      shared_->abort_locked(detail::concat("rank ", rank(), " waited ", shared_->timeout.count(), " ms at ", call,
                                           " for rank ", peer, ", which sent nothing"));
      shared_->raise_aborted(rank(), call);
    }
    const std::string message = std::move(queue.front());
    queue.pop_front();
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    if (message.size() != bytes) {
      shared_->abort_locked(detail::concat(call, " on rank ", rank(), " expected ", bytes, " bytes from rank ", peer,
                                           ", which sent ", message.size()));
      shared_->raise_aborted(rank(), call);
    }
    if (bytes > 0) std::memcpy(data, message.data(), bytes);
  }

  void all_reduce_many(std::span<void* const> buffers, std::span<const std::int64_t> counts, DType dtype, ReduceOp op,
                       CUstream_st*) override {
    SG_CHECK(buffers.size() == counts.size(), describe(), " all_reduce_many: ", buffers.size(), " buffers but ",
             counts.size(), " counts");
    for (std::size_t i = 0; i < buffers.size(); ++i) all_reduce(buffers[i], buffers[i], counts[i], dtype, op, nullptr);
  }

  // Sends are buffered here, so the pair needs no grouping.
  void send_recv(const void* send_data, int to, void* recv_data, int from, std::int64_t count, DType dtype,
                 CUstream_st*) override {
    send(send_data, count, dtype, to, nullptr);
    recv(recv_data, count, dtype, from, nullptr);
  }

  // Note [The pool as symmetric memory]: the ranks share the process, so a
  // peer's pool is its address.
  std::shared_ptr<PeerWindow> share_window(std::byte* base, std::int64_t bytes,
                                           const std::vector<PeerReceive>& receives) override {
    SG_CHECK_CODE(peer_transport() == PeerTransport::kPeerCopy, ErrorCode::kUnsupported, describe(),
                  " cannot share a pool with its peers (", peer_transport_reason(), ")");
    std::string mine(sizeof(base), '\0');
    std::memcpy(mine.data(), &base, sizeof(base));
    mine += encode_peer_receives(receives);
    const std::vector<std::string> all = exchange(mine, "peer window");
    std::vector<PeerWindow::Peer> peers(static_cast<std::size_t>(world_size()));
    for (int r = 0; r < world_size(); ++r) {
      const std::string& theirs = all[static_cast<std::size_t>(r)];
      PeerWindow::Peer& peer = peers[static_cast<std::size_t>(r)];
      peer.receives = decode_peer_receives(std::string_view(theirs).substr(sizeof(base)),
                                           detail::concat(describe(), " peer window of rank ", r));
      if (r != rank()) std::memcpy(&peer.base, theirs.data(), sizeof(base));
    }
    return PeerWindow::make(id(), rank(), base, bytes, std::move(peers), nullptr);
  }

  void window_send_recv(const PeerWindow& window, std::int64_t slot, const void* send, int to, void* recv, int from,
                        std::int64_t bytes, CUstream_st*) override {
    check_peer("send_recv", to, "peer");
    check_peer("send_recv", from, "peer");
    SG_CHECK_CODE(window.receives_at(slot, recv), ErrorCode::kInternal, describe(), " send_recv in slot ", slot,
                  ": the receive buffer is not this window's");
    void* destination = window.receive_address(to, slot, bytes);
    const std::size_t flag = static_cast<std::size_t>(slot % kPeerSignalSlots);
    const std::string call = next_call_name(detail::concat("send_recv (peer copy, slot ", slot, ")"));
    std::atomic<std::uint32_t>* mine = shared_->signals[static_cast<std::size_t>(rank())].get();
    shared_->signals[static_cast<std::size_t>(from)][flag].store(1, std::memory_order_release);
    await(mine[flag], call, to);
    if (bytes > 0) std::memcpy(destination, send, static_cast<std::size_t>(bytes));
    shared_->signals[static_cast<std::size_t>(to)][kPeerSignalSlots + flag].store(1, std::memory_order_release);
    await(mine[kPeerSignalSlots + flag], call, from);
    count_window_transfer();
  }

  void window_post(const PeerWindow& window, std::int64_t slot, PeerFlag flag, int to, CUstream_st*) override {
    check_peer("window_post", to, "peer");
    SG_CHECK_CODE(window.communicator() == id(), ErrorCode::kInternal, describe(),
                  ": a flag posted through another communicator's window");
    shared_->signals[static_cast<std::size_t>(to)][static_cast<std::size_t>(peer_flag_index(slot, flag))].store(
        1, std::memory_order_release);
  }

  void window_await(const PeerWindow& window, std::int64_t slot, PeerFlag flag, int from, CUstream_st*) override {
    check_peer("window_await", from, "peer");
    SG_CHECK_CODE(window.communicator() == id(), ErrorCode::kInternal, describe(),
                  ": a flag awaited through another communicator's window");
    const std::string call = next_call_name(
        detail::concat("peer exchange (", flag == PeerFlag::kData ? "data" : "ready", " flag, slot ", slot, ")"));
    std::atomic<std::uint32_t>* mine = shared_->signals[static_cast<std::size_t>(rank())].get();
    await(mine[static_cast<std::size_t>(peer_flag_index(slot, flag))], call, from);
    if (flag == PeerFlag::kData) count_window_transfer();
  }

  std::vector<std::string> exchange(std::string_view local, std::string_view what) override {
    std::unique_lock lock(shared_->mutex);
    const std::string call = next_call_name(detail::concat("exchange '", what, "'"));
    shared_->posted[static_cast<std::size_t>(rank())] =
        Call{"exchange", 0, DType::kInt32, std::nullopt, -1, nullptr, std::string(local)};
    shared_->barrier(rank(), call, lock);
    std::vector<std::string> all;
    for (const Call& posted : shared_->posted) all.push_back(posted.bytes);
    shared_->barrier(rank(), call, lock);
    return all;
  }

  void abort(std::string_view reason) noexcept override {
    try {
      std::lock_guard lock(shared_->mutex);
      shared_->abort_locked(detail::concat("rank ", rank(), " aborted: ", reason));
    } catch (...) {
      logger().error("host world: abort failed");
    }
  }

  void check_health() override {
    std::lock_guard lock(shared_->mutex);
    if (!shared_->abort_reason.empty()) shared_->raise_aborted(rank(), "check_health");
  }

 protected:
  // The group's leader makes its world's shared state and posts it where the
  // other threads find it (they share the process); two exchanges order the
  // post before the lookups and the lookups before the removal.
  std::unique_ptr<Communicator> make_group(const Group& group, std::string name) override {
    const std::string token = detail::concat(static_cast<const void*>(shared_.get()), "/", group.number, "/",
                                             group.color);
    if (group.rank == 0) {
      std::lock_guard lock(split_board_mutex());
      split_board()[token] = std::make_shared<HostWorld::Shared>(group.size, shared_->timeout, shared_->peer_copies);
    }
    exchange("", detail::concat("split '", name, "' posted"));
    std::shared_ptr<HostWorld::Shared> world;
    {
      std::lock_guard lock(split_board_mutex());
      world = split_board().at(token);
    }
    exchange("", detail::concat("split '", name, "' taken"));
    if (group.rank == 0) {
      std::lock_guard lock(split_board_mutex());
      split_board().erase(token);
    }
    return std::make_unique<HostCommunicator>(std::move(world), group.rank, std::move(name));
  }

 private:
  static std::mutex& split_board_mutex() {
    static std::mutex mutex;
    return mutex;
  }
  static std::map<std::string, std::shared_ptr<HostWorld::Shared>>& split_board() {
    static auto* board = new std::map<std::string, std::shared_ptr<HostWorld::Shared>>;
    return *board;
  }

  void check_reducible(std::string_view call, DType dtype) const {
    SG_CHECK(!is_fp8(dtype), describe(), " ", call,
             ": fp8 values cannot be reduced (NCCL neither); reduce in bf16 or "
             "fp32, got ",
             dtype_name(dtype));
  }

  std::string next_call_name(std::string_view kind) { return detail::concat(kind, " #", ++calls_); }

  // Waits until `flag` is 1 (posted by rank `peer`), then resets it; an
  // aborted world or the world's timeout ends the wait with an Error.
  void await(std::atomic<std::uint32_t>& flag, const std::string& call, int peer) {
    const auto deadline = std::chrono::steady_clock::now() + shared_->timeout;
    for (std::int64_t spins = 1; flag.load(std::memory_order_acquire) != 1; ++spins) {
      if (spins % 256 == 0) {
        std::lock_guard lock(shared_->mutex);
        if (!shared_->abort_reason.empty()) shared_->raise_aborted(rank(), call);
        if (std::chrono::steady_clock::now() > deadline) {
          shared_->abort_locked(detail::concat("rank ", rank(), " waited ", shared_->timeout.count(), " ms at ", call,
                                               " for rank ", peer, ", which never posted its flag"));
          shared_->raise_aborted(rank(), call);
        }
      }
      std::this_thread::yield();
    }
    flag.store(0, std::memory_order_relaxed);
  }

  // Note [Host collectives]: post, meet, compute from every rank's buffer,
  // meet again, then write.
  template <typename Compute>
  void meet(Call call, void* recv, const Compute& compute, std::int64_t result_bytes) {
    std::unique_lock lock(shared_->mutex);
    const std::string name = next_call_name(call.describe());
    shared_->posted[static_cast<std::size_t>(rank())] = call;
    shared_->barrier(rank(), name, lock);
    for (int r = 0; r < world_size(); ++r) {
      const Call& other = shared_->posted[static_cast<std::size_t>(r)];
      if (!other.same_as(shared_->posted[0])) {
        // Every rank sees the same posts and raises the same error.
        shared_->abort_locked(detail::concat("collective #", calls_, " differs between ranks: rank 0 calls ",
                                             shared_->posted[0].describe(), ", rank ", r, " calls ", other.describe()));
        shared_->raise_aborted(rank(), name);
      }
    }
    std::vector<const void*> sends;
    for (const Call& posted : shared_->posted) sends.push_back(posted.send);
    std::vector<std::byte> result(static_cast<std::size_t>(result_bytes));
    lock.unlock();  // the reads of other ranks' buffers need no lock: nobody writes before the next barrier
    compute(sends, result.data());
    lock.lock();
    shared_->barrier(rank(), name, lock);
    if (result_bytes > 0) std::memcpy(recv, result.data(), result.size());
  }

  std::shared_ptr<HostWorld::Shared> shared_;
  std::int64_t calls_ = 0;
};

}  // namespace

HostWorld::HostWorld(int size, std::chrono::milliseconds timeout, bool peer_copies) {
  SG_CHECK(size >= 1, "HostWorld: size must be >= 1, got ", size);
  SG_CHECK(timeout.count() > 0, "HostWorld: the timeout must be positive, got ", timeout.count(), " ms");
  shared_ = std::make_shared<Shared>(size, timeout, peer_copies);
}

HostWorld::~HostWorld() = default;

int HostWorld::size() const { return shared_->size; }

std::unique_ptr<Communicator> HostWorld::communicator(int rank, std::string name) {
  SG_CHECK(rank >= 0 && rank < shared_->size, "HostWorld: rank must be in [0, ", shared_->size, "), got ", rank);
  return std::make_unique<HostCommunicator>(shared_, rank, std::move(name));
}

void HostWorld::run(int size, const std::function<void(Communicator& comm)>& body, std::chrono::milliseconds timeout,
                    bool peer_copies) {
  HostWorld world(size, timeout, peer_copies);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(world.communicator(r));
  Shared& shared = *world.shared_;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(*comms[static_cast<std::size_t>(r)]);
      } catch (const std::exception& error) {
        std::lock_guard lock(shared.mutex);
        if (!shared.first_failure && shared.abort_reason.empty()) {
          shared.first_failure = std::current_exception();
          shared.first_failed_rank = r;
        }
        shared.abort_locked(detail::concat("rank ", r, " failed: ", error.what()));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (shared.first_failure) {
    try {
      std::rethrow_exception(shared.first_failure);
    } catch (const Error& error) {
      SG_THROW(error.code(), "rank ", shared.first_failed_rank, ": ", error.message());
    }
  }
  if (!shared.abort_reason.empty()) SG_THROW(ErrorCode::kInvalidState, "host world aborted: ", shared.abort_reason);
}

}  // namespace stepgraph
