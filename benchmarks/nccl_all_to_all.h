// NCCL's all-to-all with counts on the host, the bandwidth reference of
// ep_exchange_bench: one NCCL group of ncclSend / ncclRecv to and from every
// rank (this one included), each with its own row count, as PyTorch's
// all_to_all_single with split sizes runs it (and as ncclAlltoAll does for
// equal counts). The communicator is NCCL's own, made here over the ranks of
// a world (its unique id carried by the world's host exchange), so the
// reference is NCCL alone, with none of our Communicator's bookkeeping.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/communicator.h"

struct CUstream_st;

namespace stepgraph::bench {

class NcclAllToAll {
 public:
  // Collective over `world` (every rank calls it): an NCCL communicator of
  // its ranks on the current GPU. An Error naming --reference where there is
  // no GPU.
  explicit NcclAllToAll(Communicator& world);
  ~NcclAllToAll();
  NcclAllToAll(const NcclAllToAll&) = delete;
  NcclAllToAll& operator=(const NcclAllToAll&) = delete;

  // Sends send_rows[q] rows of `row_bytes` each, from `send` at row
  // send_offsets[q], to rank q, and receives recv_rows[p] rows from rank p
  // into `recv` at row recv_offsets[p]: one NCCL group, enqueued on `stream`.
  void run(const void* send, const std::vector<std::int64_t>& send_rows,
           const std::vector<std::int64_t>& send_offsets, void* recv, const std::vector<std::int64_t>& recv_rows,
           const std::vector<std::int64_t>& recv_offsets, std::int64_t row_bytes, CUstream_st* stream);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  int rank_ = 0;
  int world_size_ = 1;
};

}  // namespace stepgraph::bench
