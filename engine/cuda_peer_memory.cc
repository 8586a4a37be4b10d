#include "engine/cuda_peer_memory.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>

#include "engine/cuda_check.h"
#include "engine/error.h"

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

struct MemoryOperations {
  PFN_cuStreamWriteValue32_v11070 write = driver_function<PFN_cuStreamWriteValue32_v11070>("cuStreamWriteValue32");
  PFN_cuStreamWaitValue32_v11070 wait = driver_function<PFN_cuStreamWaitValue32_v11070>("cuStreamWaitValue32");
};

const MemoryOperations& memory_operations() {
  static const MemoryOperations operations;
  return operations;
}

void check_driver(CUresult result, const char* call) {
  SG_CHECK_CODE(result == CUDA_SUCCESS, ErrorCode::kCuda, call, " failed (CUresult ", static_cast<int>(result), ")");
}

// Whether waits can flush remote writes (a platform feature; where present
// the wait asks for it, so the bytes a peer copied before its flag are
// visible to the work after the wait).
unsigned int wait_flags() {
  static const unsigned int flags = [] {
    int device = 0;
    SG_CUDA_CHECK(cudaGetDevice(&device));
    int flush = 0;
    if (cudaDeviceGetAttribute(&flush, cudaDevAttrCanFlushRemoteWrites, device) != cudaSuccess) flush = 0;
    return CU_STREAM_WAIT_VALUE_EQ | (flush != 0 ? CU_STREAM_WAIT_VALUE_FLUSH : 0u);
  }();
  return flags;
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
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
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

void post_flag(CUstream_st* stream, std::uint32_t* flag, std::uint32_t value) {
  check_driver(memory_operations().write(stream, reinterpret_cast<CUdeviceptr>(flag), value,
                                         CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue32");
}

void wait_flag(CUstream_st* stream, std::uint32_t* flag, std::uint32_t value) {
  check_driver(memory_operations().wait(stream, reinterpret_cast<CUdeviceptr>(flag), value, wait_flags()),
               "cuStreamWaitValue32");
}

}  // namespace stepgraph::cuda_peer
