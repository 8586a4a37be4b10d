// The reduction of host collectives (the host thread world, and ranks in
// several processes that meet through the rendezvous): every rank computes
// the same bits, whatever the timing, by reducing in rank order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/communicator.h"
#include "engine/dtype.h"

namespace stepgraph {

// out[i] = reduce over r in 0, 1, ... of sources[r][first + i], for i in
// [0, count). fp32 adds in fp32; bf16 and fp16 add in fp32 and round once;
// int32 and int64 exactly. fp8 is an Error (nothing reduces fp8).
void reduce_on_host(std::byte* out, const std::vector<const void*>& sources, std::int64_t first, std::int64_t count,
                    DType dtype, ReduceOp op);

}  // namespace stepgraph
