// PeerWindow: one captured step's pool as every rank of a communicator maps
// it, so a rank copies straight into its neighbour's receive buffer.
// CUDA-free header.
//
// Note [The pool as symmetric memory]
// A ring of send_recv (Note [Communication-GEMM overlap]) moves each shard
// into a value of the receiver's pool. Where every rank of a communicator
// can map every other's device memory (one host, peer access; on host, one
// process), its captured steps move those bytes themselves instead of
// through NCCL:
//   - At capture, after planning, every rank shares its pool with the
//     communicator (Communicator::share_window: CUDA IPC handles on cuda,
//     plain addresses on host) together with its receive table: for each
//     send_recv it will receive, the call's signal slot and the offset and
//     bytes of the receive buffer in its pool. The ranks need not plan alike:
//     a sender writes at the offset its receiver announced, found by slot.
//   - A send_recv in slot s on rank r (to t, from f) is then, in stream order:
//       post   f's ready[s] = 1     my receive buffer is free (every reader of
//                                   the bytes it reuses is done: stream order)
//       wait   my ready[s] == 1, then my ready[s] = 0
//       copy   my send buffer -> t's receive buffer of slot s (a peer copy on
//              a copy engine: no SMs)
//       post   t's data[s] = 1      (after a fence: the bytes land first)
//       wait   my data[s] == 1, then my data[s] = 0
//     On cuda a post is a stream memory operation (cuStreamWriteValue32: a
//     fence, then the write; a batch memory-op node in the graph, no SM) on
//     a flag in the peer's mapped memory, and a wait is a one-thread kernel
//     spinning on a flag in this GPU's memory (a stream wait would stall its
//     whole hardware queue: engine/peer_flag_kernel.h); on host, atomics.
//     Each flag has one writer and one waiter, and each wait resets its flag
//     before the rank's next post in that slot, so the same graph replays
//     forever with the same values.
//   - Slots are numbered per communicator in trace order (every rank traces
//     the same calls, and the capture uniformity check compares the numbers).
//     An expert-parallel exchange takes P slots in a row, announces its
//     receive buffer in the first, and posts and awaits the flags around its
//     own copy kernel (Note [Expert-parallel exchange] in
//     ops/moe_exchange_ops.h).
//     Eager calls take no slot and stay on NCCL (their buffers are not in a
//     shared pool); the bytes moved are the same, so eager == graph.
// Where peers are not reachable (another host, NCCL_P2P_DISABLE=1, a GPU not
// visible to this process), the communicator says so at setup and send_recv
// stays on NCCL in graphs too (peer_transport()). The numbers and what the
// design had to get right: docs/peer_copy_rings.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace stepgraph {

// How a communicator's captured send_recv calls (and expert-parallel
// exchanges, ops/moe_exchange_ops.h) move bytes; chosen once, at setup, the
// same on every rank.
enum class PeerTransport : std::uint8_t {
  kNccl,      // NCCL point-to-point kernels
  kPeerCopy,  // copies into the receiver's mapped pool (Note [The pool as symmetric memory])
};
std::string_view peer_transport_name(PeerTransport transport);  // "nccl", "peer_copy"

// The two flags of a signal slot on every rank: kReady, posted by a receiver
// to its sender (my receive buffer is free); kData, posted by a sender to its
// receiver (your bytes have landed). A send_recv uses both of its slot; an
// exchange whose rows a kernel writes (ops/moe_exchange_ops.h) posts and
// awaits them itself, one slot per peer (Communicator::window_post).
enum class PeerFlag : std::uint8_t { kReady, kData };

// One send_recv a rank receives through its window.
struct PeerReceive {
  std::int64_t slot = 0;
  std::int64_t offset = 0;  // of the receive buffer in the rank's pool
  std::int64_t bytes = 0;
};

// Flags per communicator: a slot s uses flags s % kPeerSignalSlots.
inline constexpr std::int64_t kPeerSignalSlots = 4096;
// The flag's index in a rank's table of 2 * kPeerSignalSlots flags (ready
// flags first, then data flags).
inline std::int64_t peer_flag_index(std::int64_t slot, PeerFlag flag) {
  return (flag == PeerFlag::kData ? kPeerSignalSlots : 0) + slot % kPeerSignalSlots;
}

class PeerWindow {
 public:
  struct Peer {
    std::byte* base = nullptr;  // the peer's pool as this process maps it (null for this rank)
    std::vector<PeerReceive> receives;
  };
  // `peers` is indexed by rank; `release` undoes the mappings (run once, by
  // the destructor). The window is registered for find_peer_window() while
  // it lives.
  static std::shared_ptr<PeerWindow> make(std::uint64_t communicator, int rank, std::byte* base, std::int64_t bytes,
                                          std::vector<Peer> peers, std::function<void()> release);
  ~PeerWindow();
  PeerWindow(const PeerWindow&) = delete;
  PeerWindow& operator=(const PeerWindow&) = delete;

  std::uint64_t communicator() const { return communicator_; }
  std::byte* base() const { return base_; }
  std::int64_t bytes() const { return bytes_; }

  // Where `to` receives slot `slot`, in this process's mapping of its pool.
  // An Error if `to` announced no receive in that slot or one of other bytes
  // (the ranks traced different calls).
  void* receive_address(int to, std::int64_t slot, std::int64_t bytes) const;
  // Whether this rank receives slot `slot` at `address` through this window.
  bool receives_at(std::int64_t slot, const void* address) const;

 private:
  PeerWindow(std::uint64_t communicator, int rank, std::byte* base, std::int64_t bytes, std::vector<Peer> peers,
             std::function<void()> release);
  const PeerReceive* find(int rank, std::int64_t slot) const;

  std::uint64_t communicator_;
  int rank_;
  std::byte* base_;
  std::int64_t bytes_;
  std::vector<Peer> peers_;
  std::function<void()> release_;
};

// The live window of `communicator` through which slot `slot` is received
// at `address`, or null (an eager call, a step captured without a window).
std::shared_ptr<PeerWindow> find_peer_window(std::uint64_t communicator, std::int64_t slot, const void* address);

// The receive table as bytes and back (what share_window exchanges).
std::string encode_peer_receives(const std::vector<PeerReceive>& receives);
std::vector<PeerReceive> decode_peer_receives(std::string_view bytes, std::string_view who);

}  // namespace stepgraph
