// Communicator: one rank's handle on a group of ranks that move bytes
// together (NCCL on cuda, a world of threads on host). CUDA-free header.
//
// Note [Collectives are ops]
// Layers never call a Communicator directly: they call the collective ops
// (ops/collective_ops.h), which run now (eager), are recorded (tracing) or
// run on the host, like any op. An op's parameters are plain values, so a
// collective names its communicator by id() (a process-unique number that
// find_communicator() maps back while the communicator lives) together with
// its rank and size, and a graph key holding them is a value key.
//
// Every rank must issue the same collectives in the same order: NCCL matches
// them by order alone, and a mismatch hangs. CapturedStep checks this before
// it records anything (graphs/collective_check.h): each rank's sequence of
// collectives is exchanged with exchange() and compared, and a difference is
// an Error on every rank naming the first op that differs.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/device_kind.h"
#include "engine/dtype.h"
#include "engine/peer_window.h"

struct CUstream_st;

namespace stepgraph {

enum class ReduceOp : std::uint8_t { kSum, kMax };
std::string_view reduce_op_name(ReduceOp op);  // "sum", "max"

class Communicator {
 public:
  Communicator(std::string name, int rank, int world_size);
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // The group's name in messages ("world", "dp", "tp").
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // Process-unique, never reused (see Note [Collectives are ops]).
  std::uint64_t id() const { return id_; }
  // "communicator 'dp' (rank 1 of 2, nccl)"
  std::string describe() const;

  virtual Device device() const = 0;
  // An Error naming `what` unless this communicator moves `device` memory.
  void check_device(Device device, std::string_view what) const;

  // The collectives. Buffers are memory of the communicator's device; counts
  // are elements of `dtype`. On cuda each call is enqueued on `stream` (under
  // stream capture it is recorded); on host it runs now and `stream` is null.
  // Every rank must make the same call: the same kind, counts, dtype and
  // operator, in the same order. send == recv (in place) is allowed where
  // NCCL allows it: all_reduce and broadcast with equal pointers,
  // reduce_scatter with recv at send + rank * recv_count, all_gather with
  // send at recv + rank * send_count.
  virtual void all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op,
                          CUstream_st* stream) = 0;
  // Several all-reduces issued together (one NCCL group: NCCL fuses them
  // into few kernels), each buffer in place; one dtype for all.
  virtual void all_reduce_many(std::span<void* const> buffers, std::span<const std::int64_t> counts, DType dtype,
                               ReduceOp op, CUstream_st* stream) = 0;
  // send holds world_size * recv_count elements; rank r receives the
  // reduction of block r.
  virtual void reduce_scatter(const void* send, void* recv, std::int64_t recv_count, DType dtype, ReduceOp op,
                              CUstream_st* stream) = 0;
  // recv holds world_size * send_count elements, rank r's at block r.
  virtual void all_gather(const void* send, void* recv, std::int64_t send_count, DType dtype, CUstream_st* stream) = 0;
  virtual void broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                         CUstream_st* stream) = 0;
  // Point to point: a send on rank a to b pairs with a recv on b from a.
  // NCCL's send waits for its receive: ranks that all send first, as in a
  // ring, deadlock there; use send_recv for that.
  virtual void send(const void* data, std::int64_t count, DType dtype, int peer, CUstream_st* stream) = 0;
  virtual void recv(void* data, std::int64_t count, DType dtype, int peer, CUstream_st* stream) = 0;
  // A send to `to` and a receive from `from` issued together (one NCCL
  // group), so a ring of them never deadlocks.
  virtual void send_recv(const void* send, int to, void* recv, int from, std::int64_t count, DType dtype,
                         CUstream_st* stream) = 0;

  // Peer windows (Note [The pool as symmetric memory], engine/peer_window.h).
  // How captured send_recv calls move bytes: chosen at construction, the
  // same on every rank, and logged.
  PeerTransport peer_transport() const { return peer_transport_; }
  // Why peer_transport() is what it is ("every rank maps every other's GPU",
  // "NCCL_P2P_DISABLE=1", ...), for the setup line programs print.
  const std::string& peer_transport_reason() const { return peer_transport_reason_; }
  // Shares this rank's pool [base, base + bytes) with every rank, with the
  // receives this rank makes through it, and maps every other rank's.
  // Collective: every rank calls it, host side, not under capture, only
  // where peer_transport() is kPeerCopy (kUnsupported otherwise).
  virtual std::shared_ptr<PeerWindow> share_window(std::byte* base, std::int64_t bytes,
                                                   const std::vector<PeerReceive>& receives);
  // A send_recv of a captured step through `window`, in signal slot `slot`:
  // copies `bytes` from `send` into `to`'s receive buffer of the slot and
  // completes when `from` has filled `recv` (the Note's protocol). On cuda
  // enqueued on `stream` (recorded under capture); on host it runs now.
  virtual void window_send_recv(const PeerWindow& window, std::int64_t slot, const void* send, int to, void* recv,
                                int from, std::int64_t bytes, CUstream_st* stream);
  // The flags alone, for an exchange whose bytes a kernel writes through
  // `window` itself (ops/moe_exchange_ops.h): window_post sets `flag` of
  // slot `slot` on rank `to`, after this stream's earlier writes;
  // window_await waits until this rank's is set (by `from`), then clears it,
  // failing after the communicator's timeout. On cuda enqueued on `stream`
  // (recorded under capture); on host they run now.
  virtual void window_post(const PeerWindow& window, std::int64_t slot, PeerFlag flag, int to, CUstream_st* stream);
  virtual void window_await(const PeerWindow& window, std::int64_t slot, PeerFlag flag, int from, CUstream_st* stream);
  // The next signal slot, in trace order (ops::send_recv while tracing);
  // take_signal_slots(n) takes n in a row and returns the first.
  std::int64_t take_signal_slot() { return next_signal_slot_++; }
  std::int64_t take_signal_slots(std::int64_t n) {
    const std::int64_t first = next_signal_slot_;
    next_signal_slot_ += n;
    return first;
  }
  // Receives through a window so far on this rank (window_send_recv calls
  // and window_await calls on data flags; host: run; cuda: issued or
  // recorded): tests see which path a step took.
  std::int64_t window_transfers() const { return window_transfers_; }

  // Host-side exchange of small byte strings (checks before any device work,
  // e.g. the capture uniformity check): every rank passes its bytes and gets
  // every rank's, in rank order. Blocking; not while a stream is captured.
  virtual std::vector<std::string> exchange(std::string_view local, std::string_view what) = 0;

  // Ends pending and later operations of every rank with an error
  // (ncclCommAbort on cuda). Never throws.
  virtual void abort(std::string_view reason) noexcept = 0;

  // An Error if the communicator failed asynchronously (a peer died, NCCL
  // reported an error) since the last check.
  virtual void check_health() = 0;

  // A new communicator of the ranks that pass the same `color` (>= 0),
  // ranked by `key` and then by rank here: the tensor- and data-parallel
  // groups of a 2-D world. Every rank of this communicator must call it (it
  // exchanges the colors); the new one is independent of this one.
  // Supported by the NCCL and thread-world communicators; others raise
  // ErrorCode::kUnsupported.
  std::unique_ptr<Communicator> split(int color, int key, std::string name);

 protected:
  // A group of a split: this rank's place in it and the world rank of its
  // first rank (who makes what the group shares).
  struct Group {
    int color = 0;
    int rank = 0;
    int size = 0;
    int leader = 0;
    int number = 0;  // this communicator's splits so far (tells them apart)
  };
  // Makes the group's communicator; called by every rank of this one, after
  // the colors are known. The default raises kUnsupported.
  virtual std::unique_ptr<Communicator> make_group(const Group& group, std::string name);

  // Implementations choose once, at construction.
  void set_peer_transport(PeerTransport transport, std::string reason);
  void count_window_transfer() { ++window_transfers_; }

  // Checks shared by every implementation: counts, dtype, ranks.
  void check_count(std::string_view call, std::int64_t count) const;
  void check_peer(std::string_view call, int peer, std::string_view role) const;

 private:
  std::string name_;
  int rank_;
  int world_size_;
  std::uint64_t id_;
  int splits_ = 0;
  PeerTransport peer_transport_ = PeerTransport::kNccl;
  std::string peer_transport_reason_ = "peer copies not supported by this communicator";
  std::int64_t next_signal_slot_ = 0;
  std::int64_t window_transfers_ = 0;
};

// The live communicator with this id, or an Error saying it was destroyed.
Communicator& find_communicator(std::uint64_t id);

}  // namespace stepgraph
