#include "engine/cuda_peer_memory.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/peer_flag_kernel.h"

namespace stepgraph::cuda_peer {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(IpcHandle::bytes));

// Driver entry points, found once through the runtime (no link against libcuda).
template <typename Function>
Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  SG_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found));
  SG_CHECK_CODE(found == cudaDriverEntryPointSuccess && function != nullptr, ErrorCode::kCuda, "the driver has no ",
                name, " (peer windows need CUDA 12+ drivers)");
  return reinterpret_cast<Function>(function);
}

PFN_cuStreamWriteValue32_v11070 write_value() {
  static const auto write = driver_function<PFN_cuStreamWriteValue32_v11070>("cuStreamWriteValue32");
  return write;
}

void check_driver(CUresult result, const char* call) {
  SG_CHECK_CODE(result == CUDA_SUCCESS, ErrorCode::kCuda, call, " failed (CUresult ", static_cast<int>(result), ")");
}

}  // namespace

IpcHandle export_memory(void* base) {
  cudaIpcMemHandle_t handle;
  SG_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  IpcHandle out;
  std::memcpy(out.bytes.data(), &handle, sizeof(handle));
  return out;
}

void* import_memory(const IpcHandle& handle) {
  cudaIpcMemHandle_t native;
  std::memcpy(&native, handle.bytes.data(), sizeof(native));
  void* mapped = nullptr;
  SG_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, native, cudaIpcMemLazyEnablePeerAccess));
  return mapped;
}

void close_memory(void* mapped) noexcept {
  if (mapped != nullptr) (void)cudaIpcCloseMemHandle(mapped);
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) std::strcpy(name, "unknown-host");
  // Containers on different machines may share a host name; the kernel's
  // boot id tells the machines apart (NCCL's host hash does the same).
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  return boot_id.empty() ? std::string(name) : std::string(name) + " (boot " + boot_id + ")";
}

std::string pci_bus_id(int device) {
  char id[64] = {};
  SG_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof(id), device));
  return id;
}

bool can_access(int device, const std::string& peer_bus_id) {
  int peer = -1;
  if (cudaDeviceGetByPCIBusId(&peer, peer_bus_id.c_str()) != cudaSuccess) {
    (void)cudaGetLastError();  // not visible to this process
    return false;
  }
  if (peer == device) return false;  // two ranks on one GPU: NCCL refuses them anyway
  int can = 0;
  SG_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
  return can != 0;
}

void post_flag(CUstream_st* stream, std::uint32_t* flag) {
  check_driver(write_value()(stream, reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue32");
}

void await_flag(CUstream_st* stream, std::uint32_t* flag, std::uint64_t timeout_ns) {
  launch_await_flag(flag, timeout_ns, stream);
}

}  // namespace stepgraph::cuda_peer
