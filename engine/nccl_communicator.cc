#include "engine/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/cuda_peer_memory.h"
#include "engine/error.h"
#include "engine/logging.h"
#include "engine/nccl_check.h"

namespace stepgraph {
namespace {

// NVLink multicast must stay off on shared hosts (it can take a host's GPUs
// out of service); NCCL reads the variable when the first communicator is made.
void keep_nvls_off() { ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: return ncclUint8;  // moved as bytes; never reduced (check_reducible)
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclUniqueId& id, int rank, int world_size, const NcclCommunicatorOptions& options)
      : Communicator(options.name, rank, world_size),
        device_(options.device),
        timeout_(options.timeout),
        peer_copies_(options.peer_copies) {
    keep_nvls_off();
    SG_CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId nccl_id;
    static_assert(sizeof(nccl_id.internal) == sizeof(id.bytes));
    std::memcpy(nccl_id.internal, id.bytes.data(), sizeof(nccl_id.internal));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Non-blocking: the init returns ncclInProgress and completes in the background.
    const ncclResult_t started = ncclCommInitRankConfig(&comm_, world_size, nccl_id, rank, &config);
    if (started != ncclSuccess && started != ncclInProgress) SG_NCCL_CHECK(started);
    wait_for_nccl("ncclCommInitRankConfig");
    SG_CUDA_CHECK(cudaStreamCreateWithFlags(&exchange_stream_, cudaStreamNonBlocking));
    choose_peer_transport();
  }

  ~NcclCommunicator() override {
    release_signals();
    if (exchange_stream_ != nullptr && cudaStreamDestroy(exchange_stream_) != cudaSuccess) {
      logger().error("{}: cudaStreamDestroy failed", describe());
    }
    if (comm_ == nullptr || aborted_.load()) return;
    // A communicator that failed is aborted (destroy would wait for peers
    // that may be gone); a healthy one is finalized, which on a non-blocking
    // communicator returns ncclInProgress and completes in the background:
    // destroying it before then breaks the next communicator of the process.
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      ncclCommAbort(comm_);
      return;
    }
    state = ncclCommFinalize(comm_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
    } else {
      logger().error("{}: finalize did not complete ({}); aborting", describe(), ncclGetErrorString(state));
      ncclCommAbort(comm_);
    }
  }

  Device device() const override { return Device::kCuda; }

  void all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op,
                  CUstream_st* stream) override {
    check_count("all_reduce", count);
    check_reducible("all_reduce", dtype);
    issue("ncclAllReduce",
          ncclAllReduce(send, recv, static_cast<std::size_t>(count), nccl_type(dtype), nccl_op(op), comm_, stream));
  }

  void all_reduce_many(std::span<void* const> buffers, std::span<const std::int64_t> counts, DType dtype, ReduceOp op,
                       CUstream_st* stream) override {
    SG_CHECK(buffers.size() == counts.size(), describe(), " all_reduce_many: ", buffers.size(), " buffers but ",
             counts.size(), " counts");
    check_reducible("all_reduce_many", dtype);
    for (const std::int64_t count : counts) check_count("all_reduce_many", count);
    SG_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first_failure = ncclSuccess;
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const ncclResult_t status = ncclAllReduce(buffers[i], buffers[i], static_cast<std::size_t>(counts[i]),
                                                nccl_type(dtype), nccl_op(op), comm_, stream);
      if (status != ncclSuccess && status != ncclInProgress && first_failure == ncclSuccess) first_failure = status;
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (first_failure != ncclSuccess) issue("ncclAllReduce (all_reduce_many)", first_failure);
    issue("ncclGroupEnd (all_reduce_many)", ended);
  }

  void reduce_scatter(const void* send, void* recv, std::int64_t recv_count, DType dtype, ReduceOp op,
                      CUstream_st* stream) override {
    check_count("reduce_scatter", recv_count);
    check_reducible("reduce_scatter", dtype);
    issue("ncclReduceScatter", ncclReduceScatter(send, recv, static_cast<std::size_t>(recv_count), nccl_type(dtype),
                                                 nccl_op(op), comm_, stream));
  }

  void all_gather(const void* send, void* recv, std::int64_t send_count, DType dtype, CUstream_st* stream) override {
    check_count("all_gather", send_count);
    issue("ncclAllGather",
          ncclAllGather(send, recv, static_cast<std::size_t>(send_count), nccl_type(dtype), comm_, stream));
  }

  void broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                 CUstream_st* stream) override {
    check_count("broadcast", count);
    check_peer("broadcast", root, "root");
    issue("ncclBroadcast",
          ncclBroadcast(send, recv, static_cast<std::size_t>(count), nccl_type(dtype), root, comm_, stream));
  }

  void send(const void* data, std::int64_t count, DType dtype, int peer, CUstream_st* stream) override {
    check_count("send", count);
    check_peer("send", peer, "peer");
    issue("ncclSend", ncclSend(data, static_cast<std::size_t>(count), nccl_type(dtype), peer, comm_, stream));
  }

  void recv(void* data, std::int64_t count, DType dtype, int peer, CUstream_st* stream) override {
    check_count("recv", count);
    check_peer("recv", peer, "peer");
    issue("ncclRecv", ncclRecv(data, static_cast<std::size_t>(count), nccl_type(dtype), peer, comm_, stream));
  }

  void send_recv(const void* send_data, int to, void* recv_data, int from, std::int64_t count, DType dtype,
                 CUstream_st* stream) override {
    check_count("send_recv", count);
    check_peer("send_recv", to, "peer");
    check_peer("send_recv", from, "peer");
    const auto n = static_cast<std::size_t>(count);
    SG_NCCL_CHECK(ncclGroupStart());
    const ncclResult_t sent = ncclSend(send_data, n, nccl_type(dtype), to, comm_, stream);
    const ncclResult_t received = ncclRecv(recv_data, n, nccl_type(dtype), from, comm_, stream);
    const ncclResult_t ended = ncclGroupEnd();
    for (const ncclResult_t status : {sent, received}) {
      if (status != ncclSuccess && status != ncclInProgress) issue("ncclSend/ncclRecv", status);
    }
    issue("ncclGroupEnd (send_recv)", ended);
  }

  // Note [The pool as symmetric memory]: the pool by CUDA IPC; the first
  // window also maps every rank's flags, which stay mapped while the
  // communicator lives.
  std::shared_ptr<PeerWindow> share_window(std::byte* base, std::int64_t bytes,
                                           const std::vector<PeerReceive>& receives) override {
    SG_CHECK_CODE(peer_transport() == PeerTransport::kPeerCopy, ErrorCode::kUnsupported, describe(),
                  " cannot share a pool with its peers (", peer_transport_reason(), ")");
    SG_CUDA_CHECK(cudaSetDevice(device_));
    if (signals_ == nullptr) {
      SG_CUDA_CHECK(cudaMalloc(&signals_, 2 * kPeerSignalSlots * sizeof(std::uint32_t)));
      SG_CUDA_CHECK(cudaMemset(signals_, 0, 2 * kPeerSignalSlots * sizeof(std::uint32_t)));
    }
    const cuda_peer::IpcHandle pool = base != nullptr ? cuda_peer::export_memory(base) : cuda_peer::IpcHandle{};
    const cuda_peer::IpcHandle flags = cuda_peer::export_memory(signals_);
    std::string mine(pool.bytes.data(), pool.bytes.size());
    mine.append(flags.bytes.data(), flags.bytes.size());
    mine += encode_peer_receives(receives);
    const std::vector<std::string> all = exchange(mine, "peer window");
    const std::size_t handles = pool.bytes.size() + flags.bytes.size();
    std::vector<PeerWindow::Peer> peers(static_cast<std::size_t>(world_size()));
    std::vector<void*> mapped;
    try {
      for (int r = 0; r < world_size(); ++r) {
        const std::string& theirs = all[static_cast<std::size_t>(r)];
        SG_CHECK(theirs.size() >= handles, describe(), " peer window: rank ", r, " sent ", theirs.size(),
                 " bytes, not its handles");
        PeerWindow::Peer& peer = peers[static_cast<std::size_t>(r)];
        peer.receives = decode_peer_receives(std::string_view(theirs).substr(handles),
                                             detail::concat(describe(), " peer window of rank ", r));
        if (r == rank()) continue;
        cuda_peer::IpcHandle handle;
        std::memcpy(handle.bytes.data(), theirs.data(), handle.bytes.size());
        if (!peer.receives.empty()) {
          mapped.push_back(cuda_peer::import_memory(handle));
          peer.base = static_cast<std::byte*>(mapped.back());
        }
        if (peer_signals_.empty()) peer_signals_.resize(static_cast<std::size_t>(world_size()), nullptr);
        if (peer_signals_[static_cast<std::size_t>(r)] == nullptr) {
          std::memcpy(handle.bytes.data(), theirs.data() + pool.bytes.size(), handle.bytes.size());
          peer_signals_[static_cast<std::size_t>(r)] = static_cast<std::uint32_t*>(cuda_peer::import_memory(handle));
        }
      }
    } catch (...) {
      for (void* m : mapped) cuda_peer::close_memory(m);
      throw;
    }
    return PeerWindow::make(id(), rank(), base, bytes, std::move(peers), [mapped, device = device_] {
      int previous = 0;
      (void)cudaGetDevice(&previous);
      (void)cudaSetDevice(device);
      for (void* m : mapped) cuda_peer::close_memory(m);
      (void)cudaSetDevice(previous);
    });
  }

  void window_send_recv(const PeerWindow& window, std::int64_t slot, const void* send, int to, void* recv, int from,
                        std::int64_t bytes, CUstream_st* stream) override {
    check_peer("send_recv", to, "peer");
    check_peer("send_recv", from, "peer");
    SG_CHECK_CODE(!aborted_.load(), ErrorCode::kNccl, describe(), " send_recv: the communicator was aborted");
    SG_CHECK_CODE(signals_ != nullptr && window.receives_at(slot, recv), ErrorCode::kInternal, describe(),
                  " send_recv in slot ", slot, ": the receive buffer is not this window's");
    void* destination = window.receive_address(to, slot, bytes);
    const std::int64_t flag = slot % kPeerSignalSlots;
    std::uint32_t* ready = signals_ + flag;  // set by `to`: its receive buffer is free
    std::uint32_t* data = signals_ + kPeerSignalSlots + flag;  // set by `from`: my receive buffer is full
    const auto timeout_ns = static_cast<std::uint64_t>(timeout_.count()) * 1000000u;
    cuda_peer::post_flag(stream, peer_signals_[static_cast<std::size_t>(from)] + flag);
    cuda_peer::await_flag(stream, ready, timeout_ns);
    if (bytes > 0) {
      SG_CUDA_CHECK(cudaMemcpyAsync(destination, send, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToDevice,
                                    stream));
    }
    cuda_peer::post_flag(stream, peer_signals_[static_cast<std::size_t>(to)] + kPeerSignalSlots + flag);
    cuda_peer::await_flag(stream, data, timeout_ns);
    count_window_transfer();
  }

  void window_post(const PeerWindow& window, std::int64_t slot, PeerFlag flag, int to, CUstream_st* stream) override {
    check_peer("window_post", to, "peer");
    SG_CHECK_CODE(!aborted_.load(), ErrorCode::kNccl, describe(), " window_post: the communicator was aborted");
    SG_CHECK_CODE(window.communicator() == id() && !peer_signals_.empty() &&
                      peer_signals_[static_cast<std::size_t>(to)] != nullptr,
                  ErrorCode::kInternal, describe(), " window_post to rank ", to, ": its flags are not mapped");
    cuda_peer::post_flag(stream, peer_signals_[static_cast<std::size_t>(to)] + peer_flag_index(slot, flag));
  }

  void window_await(const PeerWindow& window, std::int64_t slot, PeerFlag flag, int from,
                    CUstream_st* stream) override {
    check_peer("window_await", from, "peer");
    SG_CHECK_CODE(!aborted_.load(), ErrorCode::kNccl, describe(), " window_await: the communicator was aborted");
    SG_CHECK_CODE(window.communicator() == id() && signals_ != nullptr, ErrorCode::kInternal, describe(),
                  " window_await: no window shared this communicator's flags");
    const auto timeout_ns = static_cast<std::uint64_t>(timeout_.count()) * 1000000u;
    cuda_peer::await_flag(stream, signals_ + peer_flag_index(slot, flag), timeout_ns);
    if (flag == PeerFlag::kData) count_window_transfer();
  }

  // Two all-gathers on a private stream: every rank's length, then the bytes
  // padded to the longest.
  std::vector<std::string> exchange(std::string_view local, std::string_view what) override {
    const auto n = static_cast<std::size_t>(world_size());
    std::vector<std::int64_t> lengths(n);
    const std::int64_t length = static_cast<std::int64_t>(local.size());
    gather_on_device(&length, lengths.data(), sizeof(length), what);
    std::int64_t longest = 0;
    for (std::int64_t l : lengths) longest = std::max(longest, l);
    std::string padded(local);
    padded.resize(static_cast<std::size_t>(longest));
    std::string all(static_cast<std::size_t>(longest) * n, '\0');
    gather_on_device(padded.data(), all.data(), static_cast<std::size_t>(longest), what);
    std::vector<std::string> out;
    for (std::size_t r = 0; r < n; ++r) {
      out.push_back(all.substr(r * static_cast<std::size_t>(longest), static_cast<std::size_t>(lengths[r])));
    }
    return out;
  }

  // May come from another thread (the trainer's watchdog) while this one
  // waits in NCCL: ncclCommAbort is what ends that wait; the handle stays
  // set and every later call sees aborted_.
  void abort(std::string_view reason) noexcept override {
    if (comm_ == nullptr || aborted_.exchange(true)) return;
    logger().error("{}: aborting: {}", describe(), reason);
    ncclCommAbort(comm_);
  }

  void check_health() override {
    SG_CHECK_CODE(!aborted_.load(), ErrorCode::kNccl, describe(), " was aborted");
    ncclResult_t state = ncclSuccess;
    SG_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      SG_THROW(ErrorCode::kNccl, describe(), " failed asynchronously: ", ncclGetErrorString(state), " (",
               ncclGetLastError(comm_), ")");
    }
  }

  // The group's leader makes an NCCL unique id; every rank learns its
  // group's from the exchange and joins a communicator of its own group on
  // the same GPU.
 protected:
  std::unique_ptr<Communicator> make_group(const Group& group, std::string name) override {
    NcclUniqueId id;
    std::string mine;
    if (group.rank == 0) {
      id = make_nccl_unique_id();
      mine.assign(id.bytes.data(), id.bytes.size());
    }
    const std::vector<std::string> ids = exchange(mine, detail::concat("split '", name, "' ids"));
    const std::string& leaders = ids.at(static_cast<std::size_t>(group.leader));
    SG_CHECK(leaders.size() == id.bytes.size(), describe(), " split '", name, "': the group's leader (rank ",
             group.leader, ") sent no NCCL id");
    std::memcpy(id.bytes.data(), leaders.data(), id.bytes.size());
    return std::make_unique<NcclCommunicator>(id, group.rank, group.size,
                                              NcclCommunicatorOptions{.name = std::move(name),
                                                                      .device = device_,
                                                                      .timeout = timeout_,
                                                                      .peer_copies = peer_copies_});
  }

 private:
  // Peer copies where every rank can map every other's GPU: one host, each
  // peer's GPU visible here with peer access, NCCL's P2P not switched off
  // (NCCL_P2P_DISABLE=1 says the peers are to be treated as unreachable,
  // as in the two-node rehearsal). Every rank decides, then all agree.
  void choose_peer_transport() {
    if (world_size() == 1) {
      set_peer_transport(PeerTransport::kNccl, "a world of one rank sends nothing");
      return;
    }
    std::string reason;
    const char* p2p = std::getenv("NCCL_P2P_DISABLE");
    if (!peer_copies_) {
      reason = "peer copies turned off for this communicator";
    } else if (p2p != nullptr && std::string_view(p2p) == "1") {
      reason = "NCCL_P2P_DISABLE=1";
    }
    const std::string host = cuda_peer::host_name();
    const std::vector<std::string> places =
        exchange(detail::concat(host, "\n", cuda_peer::pci_bus_id(device_)), "peer reachability");
    for (int r = 0; r < world_size() && reason.empty(); ++r) {
      if (r == rank()) continue;
      const std::string& place = places[static_cast<std::size_t>(r)];
      const std::size_t newline = place.find('\n');
      if (place.substr(0, newline) != host) {
        reason = detail::concat("rank ", r, " runs on another host (", place.substr(0, newline), ")");
      } else if (!cuda_peer::can_access(device_, place.substr(newline + 1))) {
        reason = detail::concat("rank ", r, "'s GPU (", place.substr(newline + 1),
                                ") is not reachable by peer access from this process");
      }
    }
    const std::vector<std::string> verdicts = exchange(reason, "peer transport");
    for (int r = 0; r < world_size(); ++r) {
      if (!verdicts[static_cast<std::size_t>(r)].empty()) {
        set_peer_transport(PeerTransport::kNccl, detail::concat("rank ", r, ": ", verdicts[static_cast<std::size_t>(r)]));
        logger().info("{}: captured send_recv by NCCL ({})", describe(), peer_transport_reason());
        return;
      }
    }
    set_peer_transport(PeerTransport::kPeerCopy, "every rank maps every other's GPU (CUDA IPC, copy engines)");
    logger().info("{}: captured send_recv by peer copies ({})", describe(), peer_transport_reason());
  }

  void release_signals() noexcept {
    if (signals_ == nullptr && peer_signals_.empty()) return;
    (void)cudaSetDevice(device_);
    for (std::uint32_t* peer : peer_signals_) cuda_peer::close_memory(peer);
    peer_signals_.clear();
    if (signals_ != nullptr) (void)cudaFree(signals_);
    signals_ = nullptr;
  }

  void check_reducible(std::string_view call, DType dtype) const {
    SG_CHECK(!is_fp8(dtype), describe(), " ", call, ": fp8 values cannot be reduced; reduce in bf16 or fp32, got ",
             dtype_name(dtype));
  }

  // A non-blocking call returns ncclInProgress until NCCL has taken it.
  void issue(const char* call, ncclResult_t status) {
    SG_CHECK_CODE(!aborted_.load(), ErrorCode::kNccl, describe(), " ", call, ": the communicator was aborted");
    if (status != ncclSuccess && status != ncclInProgress) {
      SG_THROW(ErrorCode::kNccl, describe(), " ", call, " failed: ", ncclGetErrorString(status), " (",
               ncclGetLastError(comm_), ")");
    }
    wait_for_nccl(call);
  }

  void wait_for_nccl(const char* call) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (true) {
      SG_CHECK_CODE(!aborted_.load(), ErrorCode::kNccl, describe(), " ", call, ": the communicator was aborted");
      SG_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state != ncclInProgress) break;
      if (std::chrono::steady_clock::now() > deadline) {
        abort(detail::concat(call, " did not complete within ", timeout_.count(), " ms"));
        SG_THROW(ErrorCode::kNccl, describe(), " ", call, " did not complete within ", timeout_.count(),
                 " ms (a peer that never came?); the communicator was aborted");
      }
      std::this_thread::yield();
    }
    if (state != ncclSuccess) {
      SG_THROW(ErrorCode::kNccl, describe(), " ", call, " failed: ", ncclGetErrorString(state), " (",
               ncclGetLastError(comm_), ")");
    }
  }

  void gather_on_device(const void* local, void* all, std::size_t bytes, std::string_view what) {
    const std::size_t n = static_cast<std::size_t>(world_size());
    void* buffer = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&buffer, std::max<std::size_t>(bytes * (n + 1), 1)));
    try {
      auto* base = static_cast<char*>(buffer);
      SG_CUDA_CHECK(cudaMemcpyAsync(base, local, bytes, cudaMemcpyHostToDevice, exchange_stream_));
      issue(detail::concat("exchange '", what, "'").c_str(),
            ncclAllGather(base, base + bytes, bytes, ncclUint8, comm_, exchange_stream_));
      SG_CUDA_CHECK(cudaMemcpyAsync(all, base + bytes, bytes * n, cudaMemcpyDeviceToHost, exchange_stream_));
      SG_CUDA_CHECK(cudaStreamSynchronize(exchange_stream_));
    } catch (...) {
      cudaFree(buffer);
      throw;
    }
    SG_CUDA_CHECK(cudaFree(buffer));
  }

  int device_;
  std::chrono::milliseconds timeout_;
  bool peer_copies_;
  // This rank's flags (ready[kPeerSignalSlots] then data[...]) and every
  // rank's as mapped here (null for this rank): Note [The pool as symmetric memory].
  std::uint32_t* signals_ = nullptr;
  std::vector<std::uint32_t*> peer_signals_;
  ncclComm_t comm_ = nullptr;  // set once by the constructor
  std::atomic<bool> aborted_{false};
  cudaStream_t exchange_stream_ = nullptr;
};

}  // namespace

NcclUniqueId make_nccl_unique_id() {
  keep_nvls_off();
  ncclUniqueId nccl_id;
  SG_NCCL_CHECK(ncclGetUniqueId(&nccl_id));
  NcclUniqueId id;
  std::memcpy(id.bytes.data(), nccl_id.internal, id.bytes.size());
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int world_size,
                                                     const NcclCommunicatorOptions& options) {
  return std::make_unique<NcclCommunicator>(id, rank, world_size, options);
}

std::unique_ptr<Communicator> make_nccl_communicator_like(Communicator& group, const NcclCommunicatorOptions& options) {
  NcclUniqueId id;
  std::string mine;
  if (group.rank() == 0) {
    id = make_nccl_unique_id();
    mine.assign(id.bytes.data(), id.bytes.size());
  }
  const std::string first = group.exchange(mine, detail::concat("communicator '", options.name, "' id")).at(0);
  SG_CHECK(first.size() == id.bytes.size(), group.describe(), ": rank 0 sent no NCCL id for '", options.name, "'");
  std::memcpy(id.bytes.data(), first.data(), id.bytes.size());
  return make_nccl_communicator(id, group.rank(), group.world_size(), options);
}

std::string nccl_version() {
  int version = 0;
  SG_NCCL_CHECK(ncclGetVersion(&version));
  return detail::concat(version / 10000, ".", (version / 100) % 100, ".", version % 100);
}

}  // namespace stepgraph
