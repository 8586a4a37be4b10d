// The wait of Note [The pool as symmetric memory] (engine/peer_window.h): a
// one-thread kernel that spins on a flag in this GPU's memory until a peer
// posts it, then resets it. A kernel, not a stream memory operation
// (cuStreamWaitValue32): the driver's documentation warns that the order such
// a wait makes is invisible to CUDA's scheduler, which may queue independent
// work behind it, and in a graph that work may be what a peer waits for (a
// deadlock across GPUs); a kernel holds back only what depends on it, and a
// wait too long traps instead of hanging.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace stepgraph {

// Waits until *flag == 1, then sets it to 0 (one block of one thread; recorded
// under stream capture). A wait longer than `timeout_ns` traps, so a peer
// that never posts ends the launch with an error instead of a hang.
void launch_await_flag(std::uint32_t* flag, std::uint64_t timeout_ns, cudaStream_t stream);

}  // namespace stepgraph
