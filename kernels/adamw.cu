// Multi-tensor AdamW: one update launch over every tensor of the table, then a
// one-thread launch that advances the device step counter.
//
// Note [AdamW launch table]
// The table is a host-built blob, uploaded once:
//   TableHeader  {tensor_count, chunk_count}
//   TableTensor  tensor_count x {weight, grad, m, v, copy, numel, copy_is_fp16}
//   TableChunk   chunk_count x {tensor, chunk}: chunk c of tensor i covers
//                elements [c * kChunk, min((c + 1) * kChunk, numel)).
// Block b takes chunk b (and b + gridDim.x, ... should the grid be smaller
// than the chunk list): one table read maps it to its tensor, no search. The
// launcher sizes the grid from total_numel / kChunk + tensor_count, an upper
// bound on the chunk count; blocks past the end return at once. Within a
// chunk each thread updates 8 elements at a time (two 16-byte fp32 vectors
// of w, g, m, v and one 16-byte vector of the bf16 copy); the last
// numel % 8 elements of a tensor take a scalar tail. Chunks start at
// multiples of kChunk, so 16-byte aligned tensors keep every vector aligned;
// build_adamw_table rejects others.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/adamw.h"
#include "kernels/launch_config.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr std::int64_t kChunk = 16384;  // 8 rounds of 256 threads x 8 elements
constexpr int kElementsPerThread = 8;

struct TableHeader {
  std::int64_t tensor_count;
  std::int64_t chunk_count;
};

struct TableTensor {
  float* weight;
  const float* grad;
  float* m;
  float* v;
  void* copy;  // __nv_bfloat16, or __half where copy_is_fp16
  std::int64_t numel;
  std::int64_t copy_is_fp16;
  std::int64_t padding;  // 16-byte entries
};

struct TableChunk {
  std::int32_t tensor;
  std::int32_t chunk;
};

static_assert(sizeof(TableHeader) % 16 == 0 && sizeof(TableTensor) % 16 == 0, "table entries keep 16-byte alignment");

TableTensor entry_of(const AdamWTensor& t) {
  return {t.weight, t.grad, t.m, t.v, t.copy, t.numel, t.copy_is_fp16 ? 1 : 0, 0};
}

// Tensor entries passed by value (within the 4 KiB of kernel parameters
// every CUDA version takes), for write_adamw_table_entries.
constexpr int kEntriesPerWrite = 56;
struct EntryBatch {
  TableTensor entries[kEntriesPerWrite];
  std::int32_t count;
};
static_assert(sizeof(EntryBatch) <= 4000, "an entry batch fits the kernel parameter space");

__global__ void write_entries_kernel(TableTensor* __restrict__ dst, const EntryBatch batch) {
  for (int i = static_cast<int>(threadIdx.x); i < batch.count; i += static_cast<int>(blockDim.x)) {
    dst[i] = batch.entries[i];
  }
}

// Per-launch constants; the bias corrections need t, which only the device
// knows. log_beta = log1p(beta - 1) comes from the host (exact argument for
// beta >= 0.5), the host reference computes the same values.
struct AdamWConstants {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float log_beta1;
  float log_beta2;
};

struct BiasCorrections {
  float first;   // 1 - beta1^t
  float second;  // 1 - beta2^t
};

__device__ __forceinline__ BiasCorrections bias_corrections(const AdamWConstants& c, std::int64_t t) {
  const auto steps = static_cast<float>(t);
  return {-expm1f(steps * c.log_beta1), -expm1f(steps * c.log_beta2)};
}

// One element. Explicit fmaf and no other contractible a * b + c, so the host
// reference (host::adamw, keep it in step) computes the same fp32 values.
__device__ __forceinline__ void adamw_update(const AdamWConstants& c, const BiasCorrections& bias, float lr, float& w,
                                             float g, float& m, float& v) {
  m = fmaf(c.beta1, m, c.one_minus_beta1 * g);
  v = fmaf(c.beta2, v, (c.one_minus_beta2 * g) * g);
  const float m_hat = m / bias.first;
  const float v_hat = v / bias.second;
  const float update = fmaf(c.weight_decay, w, m_hat / (sqrtf(v_hat) + c.eps));
  w = fmaf(-lr, update, w);
}

__device__ __forceinline__ void load8(const float* pointer, float (&out)[kElementsPerThread]) {
  const Vec16<float> low = load16(pointer);
  const Vec16<float> high = load16(pointer + 4);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[k] = low.values[k];
    out[k + 4] = high.values[k];
  }
}

__device__ __forceinline__ void store8(float* pointer, const float (&in)[kElementsPerThread]) {
  Vec16<float> low;
  Vec16<float> high;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    low.values[k] = in[k];
    high.values[k] = in[k + 4];
  }
  store16(pointer, low);
  store16(pointer + 4, high);
}

static_assert(Vec16<__nv_bfloat16>::kCount == kElementsPerThread, "one bf16 vector per 8 elements");
static_assert(Vec16<__half>::kCount == kElementsPerThread, "one fp16 vector per 8 elements");

// The model-dtype copy of 8 updated weights at element i, or of one.
__device__ __forceinline__ void store_copy(const TableTensor& tensor, std::int64_t i,
                                           const float (&w)[kElementsPerThread]) {
  if (tensor.copy_is_fp16) {
    store16(static_cast<__half*>(tensor.copy) + i, Vec16<__half>::from_float(w));
  } else {
    store16(static_cast<__nv_bfloat16*>(tensor.copy) + i, Vec16<__nv_bfloat16>::from_float(w));
  }
}
__device__ __forceinline__ void store_copy(const TableTensor& tensor, std::int64_t i, float w) {
  if (tensor.copy_is_fp16) {
    static_cast<__half*>(tensor.copy)[i] = __float2half_rn(w);
  } else {
    static_cast<__nv_bfloat16*>(tensor.copy)[i] = __float2bfloat16_rn(w);
  }
}

// body(tensor, begin, end, vector_end) for each chunk of the table this
// block takes (Note [AdamW launch table]): elements [begin, end) of the
// tensor, the 8-element vectors ending at vector_end.
template <typename Body>
__device__ __forceinline__ void for_each_chunk(const std::byte* table, Body&& body) {
  const auto header = *reinterpret_cast<const TableHeader*>(table);
  const auto* tensors = reinterpret_cast<const TableTensor*>(table + sizeof(TableHeader));
  const auto* chunks = reinterpret_cast<const TableChunk*>(tensors + header.tensor_count);
  for (std::int64_t index = blockIdx.x; index < header.chunk_count; index += gridDim.x) {
    const TableChunk chunk = chunks[index];
    const TableTensor tensor = tensors[chunk.tensor];
    const std::int64_t begin = chunk.chunk * kChunk;
    const std::int64_t end = std::min(begin + kChunk, tensor.numel);
    body(tensor, begin, end, begin + (end - begin) / kElementsPerThread * kElementsPerThread);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    adamw_kernel(const std::byte* __restrict__ table, const std::int64_t* __restrict__ step,
                 const float* __restrict__ lr_device, const float* __restrict__ grad_unscale, AdamWConstants c) {
  const BiasCorrections bias = bias_corrections(c, *step + 1);
  const float lr = lr_device != nullptr ? *lr_device : c.lr;
  // Note [Loss scaling]: 1/S, a power of two, so the product is exact.
  const bool unscale = grad_unscale != nullptr;
  const float inverse_scale = unscale ? *grad_unscale : 1.0f;
  const int tid = threadIdx.x;

  for_each_chunk(table, [&](const TableTensor& tensor, std::int64_t begin, std::int64_t end,
                            std::int64_t vector_end) {
    for (std::int64_t i = begin + tid * kElementsPerThread; i < vector_end;
         i += static_cast<std::int64_t>(blockDim.x) * kElementsPerThread) {
      float w[kElementsPerThread], g[kElementsPerThread], m[kElementsPerThread], v[kElementsPerThread];
      load8(tensor.weight + i, w);
      load8(tensor.grad + i, g);
      load8(tensor.m + i, m);
      load8(tensor.v + i, v);
      if (unscale) {
#pragma unroll
        for (int k = 0; k < kElementsPerThread; ++k) g[k] *= inverse_scale;
      }
#pragma unroll
      for (int k = 0; k < kElementsPerThread; ++k) adamw_update(c, bias, lr, w[k], g[k], m[k], v[k]);
      store8(tensor.weight + i, w);
      store8(tensor.m + i, m);
      store8(tensor.v + i, v);
      if (tensor.copy != nullptr) store_copy(tensor, i, w);
    }
    for (std::int64_t i = vector_end + tid; i < end; i += blockDim.x) {  // numel % 8 elements at most
      float w = tensor.weight[i];
      float m = tensor.m[i];
      float v = tensor.v[i];
      adamw_update(c, bias, lr, w, unscale ? tensor.grad[i] * inverse_scale : tensor.grad[i], m, v);
      tensor.weight[i] = w;
      tensor.m[i] = m;
      tensor.v[i] = v;
      if (tensor.copy != nullptr) store_copy(tensor, i, w);
    }
  });
}

// One block per chunk, as the update; a block that finds a non-finite
// gradient sets the flag (the same value from any block: no race matters).
__global__ void __launch_bounds__(kThreadsPerBlock)
    adamw_flag_nonfinite_kernel(const std::byte* __restrict__ table, std::int32_t* flag) {
  bool bad = false;
  for_each_chunk(table, [&](const TableTensor& tensor, std::int64_t begin, std::int64_t end,
                            std::int64_t vector_end) {
    for (std::int64_t i = begin + threadIdx.x * kElementsPerThread; i < vector_end;
         i += static_cast<std::int64_t>(blockDim.x) * kElementsPerThread) {
      float g[kElementsPerThread];
      load8(tensor.grad + i, g);
#pragma unroll
      for (int k = 0; k < kElementsPerThread; ++k) bad |= !isfinite(g[k]);
    }
    for (std::int64_t i = vector_end + threadIdx.x; i < end; i += blockDim.x) bad |= !isfinite(tensor.grad[i]);
  });
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

// After the update kernel on the same stream, which read the old value.
__global__ void adamw_advance_step_kernel(std::int64_t* step) { *step += 1; }

std::int64_t chunks_of(std::int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Every tensor valid, and the sizes the table indexes with int32 fit.
void check_tensors(const std::vector<AdamWTensor>& tensors) {
  constexpr std::int64_t kMaxIndex = std::numeric_limits<std::int32_t>::max();
  SG_CHECK(static_cast<std::int64_t>(tensors.size()) <= kMaxIndex, "adamw: at most 2^31 - 1 tensors in one table, got ",
           tensors.size(), "; split the parameters into several tables");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    SG_CHECK(t.numel >= 0, "adamw: tensor ", i, " has numel ", t.numel, "; numel must be >= 0");
    SG_CHECK(chunks_of(t.numel) <= kMaxIndex, "adamw: tensor ", i, " has ", t.numel,
             " elements, more than one table entry can address; split it");
    if (t.numel == 0) continue;
    const void* required[] = {t.weight, t.grad, t.m, t.v};
    for (const void* pointer : required) {
      SG_CHECK(pointer != nullptr, "adamw: tensor ", i, " (", t.numel,
               " elements) has a null weight, grad, m or v; only empty tensors may");
      SG_CHECK(is_aligned16(pointer), "adamw: tensor ", i, " has weight, grad, m or v at ", pointer,
               ", not 16-byte aligned; allocate parameter state 16-byte aligned (pool offsets are)");
    }
    SG_CHECK(t.copy == nullptr || is_aligned16(t.copy), "adamw: tensor ", i, " has its copy at ", t.copy,
             ", not 16-byte aligned; allocate it 16-byte aligned or pass none");
  }
}

std::int64_t chunk_count(const std::vector<AdamWTensor>& tensors) {
  std::int64_t count = 0;
  for (const AdamWTensor& t : tensors) count += chunks_of(t.numel);
  return count;
}

}  // namespace

void check_adamw_hyper(const AdamWHyper& hyper) {
  SG_CHECK(std::isfinite(hyper.lr) && hyper.lr >= 0.0f, "adamw: lr must be finite and >= 0, got ", hyper.lr);
  SG_CHECK(hyper.beta1 >= 0.0f && hyper.beta1 < 1.0f, "adamw: beta1 must be in [0, 1), got ", hyper.beta1);
  SG_CHECK(hyper.beta2 >= 0.0f && hyper.beta2 < 1.0f, "adamw: beta2 must be in [0, 1), got ", hyper.beta2);
  SG_CHECK(std::isfinite(hyper.eps) && hyper.eps >= 0.0f, "adamw: eps must be finite and >= 0, got ", hyper.eps);
  SG_CHECK(std::isfinite(hyper.weight_decay) && hyper.weight_decay >= 0.0f,
           "adamw: weight_decay must be finite and >= 0, got ", hyper.weight_decay);
}

std::size_t adamw_table_bytes(const std::vector<AdamWTensor>& tensors) {
  check_tensors(tensors);
  return sizeof(TableHeader) + tensors.size() * sizeof(TableTensor) +
         static_cast<std::size_t>(chunk_count(tensors)) * sizeof(TableChunk);
}

void build_adamw_table(const std::vector<AdamWTensor>& tensors, void* table_host) {
  check_tensors(tensors);
  SG_CHECK(table_host != nullptr, "adamw: table_host is null; pass adamw_table_bytes(tensors) bytes of host memory");
  auto* out = static_cast<std::byte*>(table_host);
  const TableHeader header{static_cast<std::int64_t>(tensors.size()), chunk_count(tensors)};
  std::memcpy(out, &header, sizeof(header));
  out += sizeof(header);
  for (const AdamWTensor& t : tensors) {
    const TableTensor entry = entry_of(t);
    std::memcpy(out, &entry, sizeof(entry));
    out += sizeof(entry);
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    for (std::int64_t c = 0; c < chunks_of(tensors[i].numel); ++c) {
      const TableChunk entry{static_cast<std::int32_t>(i), static_cast<std::int32_t>(c)};
      std::memcpy(out, &entry, sizeof(entry));
      out += sizeof(entry);
    }
  }
}

void write_adamw_table_entries(const std::vector<AdamWTensor>& tensors, void* table_device, cudaStream_t stream) {
  check_tensors(tensors);
  SG_CHECK(table_device != nullptr && is_aligned16(table_device),
           "write_adamw_table_entries: table_device must be build_adamw_table's table, 16-byte aligned, got ",
           table_device);
  auto* entries = reinterpret_cast<TableTensor*>(static_cast<std::byte*>(table_device) + sizeof(TableHeader));
  for (std::size_t first = 0; first < tensors.size(); first += kEntriesPerWrite) {
    EntryBatch batch{};
    batch.count = static_cast<std::int32_t>(std::min<std::size_t>(kEntriesPerWrite, tensors.size() - first));
    for (std::int32_t i = 0; i < batch.count; ++i) batch.entries[i] = entry_of(tensors[first + i]);
    write_entries_kernel<<<1, 64, 0, stream>>>(entries + first, batch);
    SG_CUDA_CHECK(cudaGetLastError());
  }
}

void launch_adamw_flag_nonfinite_grads(const void* table_device, std::int64_t tensor_count, std::int64_t total_numel,
                                       std::int32_t* flag, cudaStream_t stream) {
  SG_CHECK(flag != nullptr, "adamw_flag_nonfinite_grads: flag is null; pass a device int32");
  SG_CHECK(tensor_count >= 0 && total_numel >= 0, "adamw_flag_nonfinite_grads: tensor_count and total_numel must be "
           ">= 0, got ", tensor_count, " and ", total_numel);
  if (total_numel == 0) return;
  SG_CHECK(table_device != nullptr && is_aligned16(table_device),
           "adamw_flag_nonfinite_grads: table_device must be build_adamw_table's table, 16-byte aligned, got ",
           table_device);
  const std::int64_t blocks =
      std::min<std::int64_t>(total_numel / kChunk + tensor_count, std::numeric_limits<std::int32_t>::max());
  adamw_flag_nonfinite_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(
      static_cast<const std::byte*>(table_device), flag);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_adamw(const AdamWHyper& hyper, const void* table_device, std::int64_t tensor_count,
                  std::int64_t total_numel, std::int64_t* step, cudaStream_t stream, bool advance_step,
                  const float* lr, const float* grad_unscale) {
  check_adamw_hyper(hyper);
  SG_CHECK(tensor_count >= 0 && total_numel >= 0, "adamw: tensor_count and total_numel must be >= 0, got ",
           tensor_count, " and ", total_numel);
  SG_CHECK(total_numel == 0 || tensor_count > 0, "adamw: total_numel is ", total_numel,
           " but tensor_count is 0; pass the counts of the table's tensors");
  SG_CHECK(step != nullptr, "adamw: step is null; pass the device int64 counter of steps taken (0 before the first)");
  SG_CHECK(reinterpret_cast<std::uintptr_t>(step) % alignof(std::int64_t) == 0, "adamw: step at ", step,
           " is not 8-byte aligned");
  if (total_numel > 0) {
    SG_CHECK(table_device != nullptr, "adamw: table_device is null; upload build_adamw_table's table first");
    SG_CHECK(is_aligned16(table_device), "adamw: table_device at ", table_device,
             " must be 16-byte aligned; upload the table to the start of an allocation");
    const AdamWConstants constants{
        .lr = hyper.lr,
        .beta1 = hyper.beta1,
        .beta2 = hyper.beta2,
        .one_minus_beta1 = 1.0f - hyper.beta1,
        .one_minus_beta2 = 1.0f - hyper.beta2,
        .eps = hyper.eps,
        .weight_decay = hyper.weight_decay,
        .log_beta1 = std::log1p(hyper.beta1 - 1.0f),
        .log_beta2 = std::log1p(hyper.beta2 - 1.0f),
    };
    // An upper bound on the chunk count (see Note [AdamW launch table]).
    const std::int64_t blocks =
        std::min<std::int64_t>(total_numel / kChunk + tensor_count, std::numeric_limits<std::int32_t>::max());
    adamw_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(
        static_cast<const std::byte*>(table_device), step, lr, grad_unscale, constants);
    SG_CUDA_CHECK(cudaGetLastError());
  }
  if (advance_step) {
    adamw_advance_step_kernel<<<1, 1, 0, stream>>>(step);
    SG_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace stepgraph::kernels
