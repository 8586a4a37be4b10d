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

  // Checks shared by every implementation: counts, dtype, ranks.
  void check_count(std::string_view call, std::int64_t count) const;
  void check_peer(std::string_view call, int peer, std::string_view role) const;

 private:
  std::string name_;
  int rank_;
  int world_size_;
  std::uint64_t id_;
  int splits_ = 0;
};

// The live communicator with this id, or an Error saying it was destroyed.
Communicator& find_communicator(std::uint64_t id);

}  // namespace stepgraph
