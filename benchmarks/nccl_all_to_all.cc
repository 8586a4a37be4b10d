#include "benchmarks/nccl_all_to_all.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <string>

#include "engine/error.h"
#include "engine/nccl_check.h"

namespace stepgraph::bench {

struct NcclAllToAll::State {
  ncclComm_t comm = nullptr;
};

NcclAllToAll::NcclAllToAll(Communicator& world)
    : state_(std::make_unique<State>()), rank_(world.rank()), world_size_(world.world_size()) {
  int gpus = 0;
  const cudaError_t found = cudaGetDeviceCount(&gpus);
  SG_CHECK_CODE(found == cudaSuccess && gpus > 0, ErrorCode::kNoDevice,
                "NCCL's all-to-all reference needs a GPU on every rank (cudaGetDeviceCount: ",
                found == cudaSuccess ? std::to_string(gpus) + " GPUs" : std::string(cudaGetErrorString(found)),
                "); pass --reference none to time the exchange alone");
  ncclUniqueId id{};
  if (rank_ == 0) SG_NCCL_CHECK(ncclGetUniqueId(&id));
  const std::string mine = rank_ == 0 ? std::string(id.internal, sizeof(id.internal)) : std::string();
  const std::vector<std::string> all = world.exchange(mine, "NCCL all-to-all reference id");
  SG_CHECK_CODE(all.at(0).size() == sizeof(id.internal), ErrorCode::kInternal, "rank 0 sent an NCCL id of ",
                all.at(0).size(), " bytes, not ", sizeof(id.internal));
  std::memcpy(id.internal, all[0].data(), sizeof(id.internal));
  SG_NCCL_CHECK(ncclCommInitRank(&state_->comm, world_size_, id, rank_));
}

NcclAllToAll::~NcclAllToAll() {
  // Destructors never throw: a failed destroy is only logged by NCCL itself.
  if (state_ && state_->comm != nullptr) (void)ncclCommDestroy(state_->comm);
}

void NcclAllToAll::run(const void* send, const std::vector<std::int64_t>& send_rows,
                       const std::vector<std::int64_t>& send_offsets, void* recv,
                       const std::vector<std::int64_t>& recv_rows, const std::vector<std::int64_t>& recv_offsets,
                       std::int64_t row_bytes, CUstream_st* stream) {
  const auto n = static_cast<std::size_t>(world_size_);
  SG_CHECK(send_rows.size() == n && send_offsets.size() == n && recv_rows.size() == n && recv_offsets.size() == n,
           "NcclAllToAll::run: counts and offsets need one entry per rank (", n, ")");
  const auto* from = static_cast<const std::byte*>(send);
  auto* to = static_cast<std::byte*>(recv);
  SG_NCCL_CHECK(ncclGroupStart());
  for (int q = 0; q < world_size_; ++q) {
    const std::size_t i = static_cast<std::size_t>(q);
    // Bytes as ncclUint8: row counts times any row width fit, with no dtype to match.
    if (send_rows[i] > 0) {
      SG_NCCL_CHECK(ncclSend(from + send_offsets[i] * row_bytes, static_cast<std::size_t>(send_rows[i] * row_bytes),
                             ncclUint8, q, state_->comm, stream));
    }
    if (recv_rows[i] > 0) {
      SG_NCCL_CHECK(ncclRecv(to + recv_offsets[i] * row_bytes, static_cast<std::size_t>(recv_rows[i] * row_bytes),
                             ncclUint8, q, state_->comm, stream));
    }
  }
  SG_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace stepgraph::bench
