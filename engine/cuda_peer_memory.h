// The CUDA pieces of peer windows (Note [The pool as symmetric memory] in
// engine/peer_window.h): device memory exported to other processes of the
// host by CUDA IPC, and flags posted and awaited by stream memory operations
// (no kernel, no SM). CUDA-free header.
#pragma once

#include <array>
#include <cstdint>
#include <string>

struct CUstream_st;

namespace stepgraph::cuda_peer {

// cudaIpcMemHandle_t as plain bytes (what a communicator exchanges).
struct IpcHandle {
  std::array<char, 64> bytes{};
};
// The handle of the cudaMalloc allocation that starts at `base`.
IpcHandle export_memory(void* base);
// Maps another process's allocation into this one (peer access enabled
// lazily); the result is valid until close_memory.
void* import_memory(const IpcHandle& handle);
void close_memory(void* mapped) noexcept;

// Where this process runs (the host name and the kernel's boot id), and the
// GPU `device` as a PCI bus id.
std::string host_name();
std::string pci_bus_id(int device);
// Whether `device` can read and write the memory of the GPU with PCI bus id
// `peer_bus_id` directly (visible to this process, peer access possible).
bool can_access(int device, const std::string& peer_bus_id);

// Stream-ordered flag operations on 32-bit words of device memory, both
// recorded under capture. post: a stream memory operation (no kernel, no
// SM) on a flag in a peer's mapped memory: a fence, then *flag = 1, so the
// stream's earlier writes, peer copies included, land before the flag.
// await: a one-thread kernel on a flag in this GPU's memory, until it is 1,
// then 0 again (engine/peer_flag_kernel.h says why a kernel); a wait longer
// than `timeout_ns` fails the launch.
void post_flag(CUstream_st* stream, std::uint32_t* flag);
void await_flag(CUstream_st* stream, std::uint32_t* flag, std::uint64_t timeout_ns);

}  // namespace stepgraph::cuda_peer
