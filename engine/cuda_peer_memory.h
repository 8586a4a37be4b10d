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

// Where this process runs, and the GPU `device` as a PCI bus id.
std::string host_name();
std::string pci_bus_id(int device);
// Whether `device` can read and write the memory of the GPU with PCI bus id
// `peer_bus_id` directly (visible to this process, peer access possible).
bool can_access(int device, const std::string& peer_bus_id);

// Stream-ordered flag operations on 32-bit words of device memory (local or
// a peer's mapped memory). post: a fence, then *flag = value (the stream's
// earlier writes, peer copies included, land before the flag). wait: the
// stream stalls until *flag == value. Both are recorded under capture.
void post_flag(CUstream_st* stream, std::uint32_t* flag, std::uint32_t value);
void wait_flag(CUstream_st* stream, std::uint32_t* flag, std::uint32_t value);

}  // namespace stepgraph::cuda_peer
