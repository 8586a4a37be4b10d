// The CUDA side of kernels/fp8_quantize.h's scale updates, held bit for bit
// to the host references: the scale from an amax (current scaling) and the
// delayed-scaling update of an amax history. One block each: a handful of
// floats, launched inside the captured step so nothing runs between replays.
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/fp8_device.cuh"
#include "kernels/fp8_quantize.h"

namespace stepgraph::kernels {
namespace {

__global__ void scale_from_amax_kernel(const float* amax, float fp8_max, bool power_of_two, float* scale,
                                       float* scale_inv, int* non_finite) {
  const float a = *amax;
  const bool ok = device_amax_usable(a);
  *non_finite = ok ? 0 : 1;
  const float s = ok ? device_fp8_scale(a, fp8_max, 0, power_of_two) : 1.0f;
  *scale = s;
  *scale_inv = 1.0f / s;
}

constexpr int kUpdateThreads = 1024;
constexpr int kMaxPerThread = 64;  // history up to 65536 entries

__global__ void __launch_bounds__(kUpdateThreads)
    delayed_update_kernel(const float* amax, float* history, int length, bool most_recent, int margin, float fp8_max,
                          float* scale, float* scale_inv, int* non_finite) {
  __shared__ float warp_max[kUpdateThreads / 32];
  const float a = *amax;
  if (!device_amax_usable(a)) {  // a non-finite amax changes nothing
    if (threadIdx.x == 0) *non_finite = 1;
    return;
  }
  // Roll: every entry moves one older (all read before any is written), the newest is a.
  float kept[kMaxPerThread];
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kUpdateThreads;
    kept[j] = i + 1 < length ? history[i] : 0.0f;
  }
  __syncthreads();
  float local = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kUpdateThreads;
    if (i + 1 < length) {
      history[i + 1] = kept[j];
      local = fmaxf(local, kept[j]);
    }
  }
  if (threadIdx.x == 0) history[0] = a;
  for (int offset = 16; offset > 0; offset >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x != 0) return;
  *non_finite = 0;
  float reduced = a;
  if (!most_recent) {
    for (int w = 0; w < kUpdateThreads / 32; ++w) reduced = fmaxf(reduced, warp_max[w]);
  }
  if (reduced > 0.0f) {
    const float s = device_fp8_scale(reduced, fp8_max, margin, false);
    *scale = s;
    *scale_inv = 1.0f / s;
  }
}

struct FlagList {
  const int* flags[kMaxCountedFlags];
  int count;
};

__global__ void count_flags_kernel(FlagList list, int* counter) {
  int sum = 0;
  for (int i = 0; i < list.count; ++i) sum += *list.flags[i];
  *counter += sum;
}

}  // namespace

void launch_count_flags(const int* const* flags, int count, int* counter, cudaStream_t stream) {
  SG_CHECK(count >= 0 && count <= kMaxCountedFlags, "count flags: 0 to ", kMaxCountedFlags, " flags a launch, got ",
           count);
  SG_CHECK(counter != nullptr, "count flags: counter must be a device int");
  FlagList list{};
  for (int i = 0; i < count; ++i) {
    SG_CHECK(flags[i] != nullptr, "count flags: flag ", i, " is null");
    list.flags[i] = flags[i];
  }
  list.count = count;
  count_flags_kernel<<<1, 1, 0, stream>>>(list, counter);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_scale_from_amax(const float* amax, Fp8Format format, bool power_of_two, float* scale, float* scale_inv,
                            int* non_finite, cudaStream_t stream) {
  SG_CHECK(amax != nullptr && scale != nullptr && scale_inv != nullptr && non_finite != nullptr,
           "scale from amax: amax, scale, scale_inv and non_finite must be device pointers, got a null one");
  scale_from_amax_kernel<<<1, 1, 0, stream>>>(amax, fp8_max(format), power_of_two, scale, scale_inv, non_finite);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_delayed_scaling_update(const Fp8Recipe& recipe, Fp8Format format, const float* amax, float* history,
                                   float* scale, float* scale_inv, int* non_finite, cudaStream_t stream) {
  recipe.check();
  SG_CHECK(recipe.scaling == Fp8Scaling::kDelayed, "delayed scaling update: the recipe's scaling is ",
           fp8_scaling_name(recipe.scaling), ", not delayed");
  SG_CHECK(amax != nullptr && history != nullptr && scale != nullptr && scale_inv != nullptr && non_finite != nullptr,
           "delayed scaling update: amax, history, scale, scale_inv and non_finite must be device pointers");
  static_assert(kUpdateThreads * kMaxPerThread >= 65536, "the recipe allows histories of 65536");
  delayed_update_kernel<<<1, kUpdateThreads, 0, stream>>>(amax, history, recipe.amax_history_len,
                                                          recipe.amax_reduction == AmaxReduction::kMostRecent,
                                                          recipe.margin, fp8_max(format), scale, scale_inv,
                                                          non_finite);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
