// LayerNorm and RMSNorm forward and backward (contract in norm.h).
//
// Rows over threads. A row is owned by a "row slice" of threads_per_row
// threads (blockDim.x, a multiple of 32); a block holds rows_per_block slices
// (blockDim.y) that work on consecutive rows. threads_per_row is sized so
// that each thread holds `vecs` 16-byte vectors of the row (of x, and of dy
// in the backward) in registers, in the raw dtype: x and dy are read from HBM
// exactly once, and the statistics are exact two-pass sums over registers
// (the mean, then squared deviations from it; no E[x^2] - E[x]^2
// cancellation), each reduced over the slice with block_sum.
//
// Why a slice of several warps per row rather than one warp per row: at
// hidden 4096 bf16 a warp would need 16 vectors per thread (64 registers of x
// and dy each in the backward, before the dgamma/dbeta accumulators). 128-256
// threads per row keep 2-4 vectors per thread, registers for several blocks
// per SM, and the two or three block reductions per row are cheap next to
// the 16-24 KB each such row moves. Short rows (up to 128 vectors in the
// forward, 64 in the backward) get one warp per row, and several rows share a
// block so that blocks stay at 128 (forward) or 256 (backward) threads.
//
// Rows longer than one tile of vecs * max threads vectors (forward: 32768
// bf16/fp16 or 16384 fp32 elements; backward: 16384 or 8192) are processed
// in tiles and re-read for each pass (mostly from L2), and the backward
// accumulates dgamma/dbeta in its partial rows in global memory: correct,
// not tuned.
//
// Access width. Rows are read and written in 16-byte vectors when hidden is
// a multiple of the vector width and every row pointer is 16-byte aligned;
// otherwise (hidden 4097, or offset pointers) the same kernels run with
// kVector false and access single elements. An element takes a 32-bit
// register as 16 bytes take four, so the backward holds four elements per
// vector of its budget (the same registers); the forward holds two (see
// kForwardElements). Element-wise rows are register-resident up to 8192
// elements in the forward and the backward (4096 + 1 included).
//
// Backward. The grid is persistent: as many blocks as are resident on the
// device at once, each looping over a fixed set of row groups. No slice
// prefetches its next rows into L2: on an H100 that made the backward slower
// at every depth tried (docs/norm_backward_l2_prefetch.md).
// Parameter gradients: each thread accumulates dy * xhat and dy for its columns
// over its block's rows in registers; the slices of a block are summed in
// shared memory in slice order, and block b writes partial row b of
// `workspace` ([partial_rows, hidden] fp32 for dgamma, then the same for
// dbeta). A second kernel sums each column's partial rows in a fixed order.
// No atomics: dgamma/dbeta are bitwise reproducible from run to run.
#include "kernels/norm.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/fp8_device.cuh"
#include "kernels/launch_config.cuh"
#include "kernels/reduce.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

// Forward: 4 vectors of x per thread (16 registers of raw data); element-wise,
// 8 elements (16 spill under the 64-register launch bound: each element
// carries its own bounds check and gamma/beta/y addresses).
constexpr int kForwardVecs = 4;
constexpr int kForwardElements = 8;
constexpr int kForwardMaxThreads = 1024;  // threads per row, also the launch bounds
constexpr int kForwardBlockThreads = 128;  // block size when rows share a block

// Backward: x and dy held raw (8 registers per vector pair) plus two fp32
// accumulators per element. Two register budgets:
//   2 vectors per thread, <= 80 registers: rows up to 512 vectors (4096
//     bf16/fp16, 2048 fp32) on up to 256 threads; 3 blocks of 256 per SM.
//   4 vectors per thread, <= 128 registers: rows up to 2048 vectors (16384
//     bf16/fp16, 8192 fp32) on up to 512 threads; 2 blocks of 256 per SM.
// Longer rows are processed in tiles of 4 * 512 vectors (see the backward).
constexpr int kBackwardMaxThreads = 512;
constexpr int kBackwardBlockThreads = 256;
constexpr int backward_max_registers(int vecs) { return vecs == 2 ? 80 : 128; }

constexpr int kMaxRowsPerBlock = std::max(kForwardBlockThreads, kBackwardBlockThreads) / 32;

// Upper bound on backward blocks, hence on partial rows in the workspace
// (4 blocks of 256 threads per SM of an H100). The launch uses the number
// that fits on the device at once, never more than this.
constexpr std::int64_t kMaxBackwardBlocks = kMaxBlocks / 2;

// Partial-row reduction: 32 columns x 32 partial-row strides per block, so
// that a few hundred partial rows take one wave of the whole device.
constexpr int kReduceColumns = 32;
constexpr int kReduceStrides = 32;

constexpr int vector_count(DType dtype) { return 16 / static_cast<int>(dtype_size(dtype)); }

// Elements per access.
constexpr int access_width(DType dtype, bool vector) { return vector ? vector_count(dtype) : 1; }

// Accesses per thread for a register budget of `vecs` 16-byte vectors (see
// "Access width" above).
constexpr int backward_slots(int vecs, bool vector) { return vector ? vecs : 4 * vecs; }
constexpr int forward_slots(bool vector) { return vector ? kForwardVecs : kForwardElements; }

const char* kind_name(NormKind kind) { return kind == NormKind::kRMSNorm ? "rmsnorm" : "layernorm"; }

// How a launch lays rows over threads.
struct RowPlan {
  bool vector = true;        // 16-byte accesses, else single elements
  int vecs = 1;              // register budget: 16-byte vectors per thread per tile
  bool resident = true;      // the whole row fits in one tile (registers)
  int threads_per_row = 32;  // blockDim.x, a multiple of 32
  int rows_per_block = 1;    // blockDim.y
  std::int64_t groups = 1;   // groups of rows_per_block rows
};

RowPlan plan_rows(const NormDesc& desc, bool vector, int vecs, int slots, int max_threads, int block_threads) {
  const std::int64_t accesses = desc.hidden / access_width(desc.dtype, vector);
  const std::int64_t threads = (accesses + slots - 1) / slots;
  RowPlan plan;
  plan.vector = vector;
  plan.vecs = vecs;
  plan.threads_per_row = static_cast<int>(std::clamp<std::int64_t>((threads + 31) / 32 * 32, 32, max_threads));
  plan.resident = accesses <= static_cast<std::int64_t>(slots) * plan.threads_per_row;
  plan.rows_per_block = static_cast<int>(std::clamp<std::int64_t>(block_threads / plan.threads_per_row, 1, desc.rows));
  plan.groups = (desc.rows + plan.rows_per_block - 1) / plan.rows_per_block;
  return plan;
}

RowPlan forward_plan(const NormDesc& desc, bool vector) {
  return plan_rows(desc, vector, kForwardVecs, forward_slots(vector), kForwardMaxThreads, kForwardBlockThreads);
}

// The plan of a register budget before the rows per block are chosen.
RowPlan backward_budget_plan(const NormDesc& desc, bool vector, int vecs) {
  const std::int64_t accesses = desc.hidden / access_width(desc.dtype, vector);
  const bool fits_two = accesses <= backward_slots(2, vector) * kBackwardBlockThreads;
  if (vecs == 0) vecs = fits_two ? 2 : 4;
  SG_CHECK(vecs == 4 || (vecs == 2 && fits_two), "norm backward tuning: vecs ", vecs, " is not a plan for hidden ",
           desc.hidden, "; use 0 (automatic), 4, or 2 for rows up to ",
           backward_slots(2, vector) * kBackwardBlockThreads * access_width(desc.dtype, vector), " elements");
  if (vecs == 2) {
    return plan_rows(desc, vector, 2, backward_slots(2, vector), kBackwardBlockThreads, kBackwardBlockThreads);
  }
  return plan_rows(desc, vector, 4, backward_slots(4, vector), kBackwardMaxThreads, kBackwardBlockThreads);
}

// Note [Norm backward rows per block]
// A block of 256 threads takes 256 / threads_per_row rows at once: 8 rows of
// 512 bf16 features. With few rows that leaves most SMs idle (the small
// step config's 256 rows ran as 32 blocks, 1.7% SM throughput in ncu), so the
// automatic plan takes fewer rows a block where rows / kBackwardTargetGroups
// says so, down to one: at least kBackwardTargetGroups blocks where there are
// as many rows. The rule depends on the shape alone, so the workspace and the
// row-to-block assignment (and with them dgamma's bits) are fixed by it.
constexpr std::int64_t kBackwardTargetGroups = 256;

// tuning.vecs: the register budget (2 or 4), 0 for the smallest that holds
// the row; tuning.rows_per_block as in NormBackwardTuning.
RowPlan backward_plan(const NormDesc& desc, bool vector, const NormBackwardTuning& tuning = {}) {
  RowPlan plan = backward_budget_plan(desc, vector, tuning.vecs);
  const std::int64_t wanted = tuning.rows_per_block > 0
                                  ? tuning.rows_per_block
                                  : std::max<std::int64_t>(1, desc.rows / kBackwardTargetGroups);
  plan.rows_per_block = static_cast<int>(std::min<std::int64_t>(plan.rows_per_block, wanted));
  plan.groups = (desc.rows + plan.rows_per_block - 1) / plan.rows_per_block;
  return plan;
}

// Partial rows in the workspace: its size cannot depend on the pointers or
// the tuning, so it covers every plan: one row a block at most.
std::int64_t max_partial_rows(const NormDesc& desc) { return std::min(desc.rows, kMaxBackwardBlocks); }

// ---------------------------------------------------------------------------
// Device side.

// One element with Vec16's interface, for the element-wise path.
template <typename T>
struct Element {
  static constexpr int kCount = 1;
  T values[1];

  __device__ __forceinline__ void to_float(float (&out)[1]) const {
    out[0] = stepgraph::kernels::to_float(values[0]);
  }
  __device__ __forceinline__ static Element from_float(const float (&in)[1]) {
    return {{stepgraph::kernels::from_float<T>(in[0])}};
  }
};

// What one access moves: a 16-byte vector, or one element.
template <typename T, bool kVector>
using Pack = std::conditional_t<kVector, Vec16<T>, Element<T>>;

template <typename T, bool kVector>
__device__ __forceinline__ Pack<T, kVector> load_pack(const T* pointer) {
  if constexpr (kVector) {
    return load16(pointer);
  } else {
    return {{*pointer}};
  }
}

template <typename T, bool kVector>
__device__ __forceinline__ void store_pack(T* pointer, const Pack<T, kVector>& value) {
  if constexpr (kVector) {
    store16(pointer, value);
  } else {
    *pointer = value.values[0];
  }
}

template <typename T>
struct ForwardArgs {
  const T* x;
  const T* gamma;
  const T* beta;
  T* y;
  float* mean;
  float* rstd;
  std::int64_t rows;
  int hidden;
  float eps;
  // The FP8 epilogue (kFp8 only; launch_norm_forward_fp8).
  Fp8Format format;
  const float* scale;     // null: amax alone
  std::uint8_t* q;        // [rows, hidden], or null
  unsigned* amax_bits;    // Note [Amax on bits] in kernels/fp8_device.cuh
};

template <typename T>
struct BackwardArgs {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  const T* gamma;
  T* dx;
  const T* dx_residual;  // added to dx, or null
  float* partials;  // [2][gridDim.x][hidden]: dgamma partial rows, then dbeta
  std::int64_t rows;
  int hidden;
};

// The part of one row that the calling thread owns: access v = base +
// threadIdx.x + i * blockDim.x of each tile [base, base + kSlots * blockDim.x),
// an access being kCount elements (one 16-byte vector or one element). When
// the row fits in one tile (kResident), it is loaded once and stays in
// registers for every pass; otherwise each pass reloads its tiles.
template <typename T, bool kVector, int kSlots, int kInputs, bool kResident>
struct RowSlice {
  static constexpr int kCount = Pack<T, kVector>::kCount;

  const T* inputs[kInputs];  // row starts of x (and dy)
  int vectors;               // accesses per row: hidden / kCount
  bool live;                 // this slice has a row (the last block may not)
  Pack<T, kVector> held[kInputs][kSlots];

  __device__ __forceinline__ int tile() const { return kSlots * static_cast<int>(blockDim.x); }
  __device__ __forceinline__ int vector_at(int base, int i) const {
    return base + static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
  }

  __device__ __forceinline__ void load(int base) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int v = vector_at(base, i);
      if (live && v < vectors) {
#pragma unroll
        for (int in = 0; in < kInputs; ++in) {
          held[in][i] = load_pack<T, kVector>(inputs[in] + static_cast<std::int64_t>(v) * kCount);
        }
      }
    }
  }

  __device__ __forceinline__ void begin() {
    if constexpr (kResident) load(0);
  }

  // Keeps the held vectors in their raw 16-bit form between passes: without
  // this barrier the compiler keeps the fp32 conversions of the first pass
  // alive for the next, twice the registers for bf16/fp16 (and spills in the
  // backward). Converting again costs one instruction per pair.
  __device__ __forceinline__ void keep_raw() {
    if constexpr (kResident && sizeof(T) < 4) {
#pragma unroll
      for (int in = 0; in < kInputs; ++in) {
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          if constexpr (kVector) {
            auto* words = reinterpret_cast<unsigned*>(held[in][i].values);
#pragma unroll
            for (int w = 0; w < 4; ++w) asm volatile("" : "+r"(words[w]));
          } else {
            asm volatile("" : "+h"(*reinterpret_cast<unsigned short*>(held[in][i].values)));
          }
        }
      }
    }
  }

  // body(i, v, values) for each vector this thread owns, in fp32:
  // values[in][k] is element k of vector v of input `in`; i is the slot.
  template <typename Body>
  __device__ __forceinline__ void sweep(Body&& body) {
    keep_raw();
    for (int base = 0; kResident ? base == 0 : base < vectors; base += tile()) {
      if constexpr (!kResident) load(base);
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int v = vector_at(base, i);
        if (live && v < vectors) {
          float values[kInputs][kCount];
#pragma unroll
          for (int in = 0; in < kInputs; ++in) held[in][i].to_float(values[in]);
          body(i, v, values);
        }
      }
    }
  }
};

// kFp8: y (rounded to T) is also quantized and its amax taken (launch_norm_forward_fp8); y may be null.
template <typename T, bool kRms, bool kVector, bool kResident, bool kFp8 = false>
__global__ void __launch_bounds__(kForwardMaxThreads) norm_forward_kernel(ForwardArgs<T> a) {
  constexpr int kCount = Pack<T, kVector>::kCount;
  __shared__ float scratch[kMaxRowsPerBlock][32];
  float* slice_scratch = scratch[threadIdx.y];
  const float hidden = static_cast<float>(a.hidden);
  const std::int64_t groups = (a.rows + blockDim.y - 1) / blockDim.y;
  [[maybe_unused]] float scale = 1.0f;
  if constexpr (kFp8) {
    if (a.scale != nullptr) scale = *a.scale;
  }
  [[maybe_unused]] unsigned amax = 0;

  for (std::int64_t group = blockIdx.x; group < groups; group += gridDim.x) {
    const std::int64_t row = group * blockDim.y + threadIdx.y;
    RowSlice<T, kVector, forward_slots(kVector), 1, kResident> slice;
    slice.live = row < a.rows;
    slice.inputs[0] = a.x + row * a.hidden;
    slice.vectors = a.hidden / kCount;
    slice.begin();

    // Two passes: the mean, then the mean squared deviation from it (no
    // cancellation, unlike E[x^2] - E[x]^2). RMSNorm: mean(x^2) directly.
    float mean = 0.0f;
    if constexpr (!kRms) {
      float sum = 0.0f;
      slice.sweep([&](int, int, const float (&in)[1][kCount]) {
#pragma unroll
        for (int k = 0; k < kCount; ++k) sum += in[0][k];
      });
      mean = block_sum(sum, slice_scratch) / hidden;
    }
    float squares = 0.0f;
    slice.sweep([&](int, int, const float (&in)[1][kCount]) {
#pragma unroll
      for (int k = 0; k < kCount; ++k) {
        const float centered = in[0][k] - mean;
        squares += centered * centered;
      }
    });
    const float rstd = rsqrtf(block_sum(squares, slice_scratch) / hidden + a.eps);

    T* y_row = a.y + row * a.hidden;
    slice.sweep([&](int, int v, const float (&in)[1][kCount]) {
      float gamma[kCount];
      float out[kCount];
      load_pack<T, kVector>(a.gamma + v * kCount).to_float(gamma);
      if constexpr (kRms) {
#pragma unroll
        for (int k = 0; k < kCount; ++k) out[k] = in[0][k] * rstd * gamma[k];
      } else {
        float beta[kCount];
        load_pack<T, kVector>(a.beta + v * kCount).to_float(beta);
#pragma unroll
        for (int k = 0; k < kCount; ++k) out[k] = (in[0][k] - mean) * rstd * gamma[k] + beta[k];
      }
      const auto y = Pack<T, kVector>::from_float(out);
      if (!kFp8 || a.y != nullptr) store_pack<T, kVector>(y_row + v * kCount, y);
      if constexpr (kFp8) {
        float rounded[kCount];  // quantize what y holds: fused == norm then quantize
        std::uint8_t q[kCount];
        y.to_float(rounded);
        quantize_values(rounded, scale, a.format, q, amax);
        if (a.q != nullptr) store_bytes(a.q + row * a.hidden + v * kCount, q);
      }
    });
    if (slice.live && threadIdx.x == 0) {
      if constexpr (!kRms) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
  if constexpr (kFp8) block_amax_atomic(amax, a.amax_bits);
}

// A register cap rather than launch bounds: the budgets above (for 2
// vectors per thread, 88 registers unconstrained would fit only two blocks
// of 256 threads per SM instead of three).
template <typename T, bool kRms, bool kVector, int kVecs, bool kResident>
__global__ void __maxnreg__(backward_max_registers(kVecs)) norm_backward_kernel(BackwardArgs<T> a) {
  constexpr int kCount = Pack<T, kVector>::kCount;
  constexpr int kSlots = backward_slots(kVecs, kVector);
  __shared__ float scratch[kMaxRowsPerBlock][32];
  float* slice_scratch = scratch[threadIdx.y];
  const float hidden = static_cast<float>(a.hidden);
  const std::int64_t groups = (a.rows + blockDim.y - 1) / blockDim.y;
  const int vectors = a.hidden / kCount;
  float* partial_gamma = a.partials + static_cast<std::int64_t>(blockIdx.x) * a.hidden;
  float* partial_beta = a.partials + static_cast<std::int64_t>(gridDim.x + blockIdx.x) * a.hidden;

  // Resident rows: this thread's share of dgamma (sum dy * xhat) and dbeta
  // (sum dy) over the block's rows, for the columns it holds. Rows in tiles:
  // one slice per block (threads_per_row is the maximum), so each thread owns
  // its columns of the block's partial rows and accumulates there directly.
  float acc_gamma[kSlots][kCount] = {};
  float acc_beta[kSlots][kCount] = {};
  if constexpr (!kResident) {
    for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
#pragma unroll
      for (int k = 0; k < kCount; ++k) {
        partial_gamma[v * kCount + k] = 0.0f;
        if constexpr (!kRms) partial_beta[v * kCount + k] = 0.0f;
      }
    }
  }

  for (std::int64_t group = blockIdx.x; group < groups; group += gridDim.x) {
    const std::int64_t row = group * blockDim.y + threadIdx.y;
    RowSlice<T, kVector, kSlots, 2, kResident> slice;  // inputs: x, dy
    slice.live = row < a.rows;
    slice.inputs[0] = a.x + row * a.hidden;
    slice.inputs[1] = a.dy + row * a.hidden;
    slice.vectors = vectors;
    const float mean = (kRms || !slice.live) ? 0.0f : a.mean[row];
    const float rstd = slice.live ? a.rstd[row] : 0.0f;
    slice.begin();
    // Means over the row of gamma*dy and gamma*dy*xhat.
    float sum_gdy = 0.0f;
    float sum_gdy_xhat = 0.0f;
    slice.sweep([&](int, int v, const float (&in)[2][kCount]) {
      float gamma[kCount];
      load_pack<T, kVector>(a.gamma + v * kCount).to_float(gamma);
#pragma unroll
      for (int k = 0; k < kCount; ++k) {
        const float xhat = (in[0][k] - mean) * rstd;
        const float gdy = gamma[k] * in[1][k];
        sum_gdy += gdy;
        sum_gdy_xhat += gdy * xhat;
      }
    });
    const float mean_gdy = kRms ? 0.0f : block_sum(sum_gdy, slice_scratch) / hidden;
    const float mean_gdy_xhat = block_sum(sum_gdy_xhat, slice_scratch) / hidden;

    T* dx_row = a.dx + row * a.hidden;
    const T* residual_row = a.dx_residual != nullptr ? a.dx_residual + row * a.hidden : nullptr;
    slice.sweep([&](int i, int v, const float (&in)[2][kCount]) {
      float gamma[kCount];
      float dx[kCount];
      float residual[kCount] = {};
      load_pack<T, kVector>(a.gamma + v * kCount).to_float(gamma);
      if (residual_row != nullptr) load_pack<T, kVector>(residual_row + v * kCount).to_float(residual);
#pragma unroll
      for (int k = 0; k < kCount; ++k) {
        const float xhat = (in[0][k] - mean) * rstd;
        const float dy = in[1][k];
        dx[k] = rstd * (gamma[k] * dy - mean_gdy - xhat * mean_gdy_xhat) + residual[k];
        if constexpr (kResident) {
          acc_gamma[i][k] += dy * xhat;
          if constexpr (!kRms) acc_beta[i][k] += dy;
        } else {
          partial_gamma[v * kCount + k] += dy * xhat;
          if constexpr (!kRms) partial_beta[v * kCount + k] += dy;
        }
      }
      store_pack<T, kVector>(dx_row + v * kCount, Pack<T, kVector>::from_float(dx));
    });
  }

  if constexpr (kResident) {
    // This block's partial rows: slice 0 + slice 1 + ... in order.
    __shared__ float exchange[kBackwardBlockThreads * kCount];
    const int slices = blockDim.y;
    const int tpr = blockDim.x;
    auto write_partial = [&](const float (&acc)[kSlots][kCount], float* partial) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int v = threadIdx.x + i * tpr;
        if (slices == 1) {
          if (v < vectors) {
            if constexpr (kVector) {
              // Partial rows are 16-byte aligned: hidden is a multiple of 4.
#pragma unroll
              for (int k = 0; k < kCount; k += 4) {
                *reinterpret_cast<float4*>(partial + v * kCount + k) =
                    make_float4(acc[i][k], acc[i][k + 1], acc[i][k + 2], acc[i][k + 3]);
              }
            } else {
              partial[v] = acc[i][0];
            }
          }
          continue;
        }
        __syncthreads();  // the previous round's readers are done
#pragma unroll
        for (int k = 0; k < kCount; ++k) exchange[(threadIdx.y * kCount + k) * tpr + threadIdx.x] = acc[i][k];
        __syncthreads();
        if (threadIdx.y == 0 && v < vectors) {
#pragma unroll
          for (int k = 0; k < kCount; ++k) {
            float total = exchange[k * tpr + threadIdx.x];
            for (int s = 1; s < slices; ++s) total += exchange[(s * kCount + k) * tpr + threadIdx.x];
            partial[v * kCount + k] = total;
          }
        }
      }
    };
    write_partial(acc_gamma, partial_gamma);
    if constexpr (!kRms) write_partial(acc_beta, partial_beta);
  }
}

// out[c] = sum over p = 0, 1, ... of partials[p][c], for dgamma (blockIdx.y 0)
// and dbeta (blockIdx.y 1). Thread (x, y) sums partial rows y, y + 32, ... of
// column x in that order (four loads in flight, added one by one), then the
// 32 strides are added in order: a fixed order, so the result is reproducible.
__global__ void __launch_bounds__(kReduceColumns * kReduceStrides)
    norm_reduce_partials_kernel(const float* partials, float* dgamma, float* dbeta, int partial_rows, int hidden) {
  __shared__ float strides[kReduceStrides][kReduceColumns + 1];
  const float* source = partials + static_cast<std::int64_t>(blockIdx.y) * partial_rows * hidden;
  float* out = blockIdx.y == 0 ? dgamma : dbeta;
  const int column = blockIdx.x * kReduceColumns + threadIdx.x;
  float sum = 0.0f;
  if (column < hidden) {
    auto at = [&](int p) { return source[static_cast<std::int64_t>(p) * hidden + column]; };
    int p = threadIdx.y;
    for (; p + 3 * kReduceStrides < partial_rows; p += 4 * kReduceStrides) {
      const float v0 = at(p), v1 = at(p + kReduceStrides), v2 = at(p + 2 * kReduceStrides),
                  v3 = at(p + 3 * kReduceStrides);
      sum += v0;
      sum += v1;
      sum += v2;
      sum += v3;
    }
    for (; p < partial_rows; p += kReduceStrides) sum += at(p);
  }
  strides[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && column < hidden) {
    float total = strides[0][threadIdx.x];
#pragma unroll
    for (int s = 1; s < kReduceStrides; ++s) total += strides[s][threadIdx.x];
    out[column] = total;
  }
}

// ---------------------------------------------------------------------------
// Host side.

// fn.template operator()<T, kRms>() for the desc's dtype and kind.
template <typename Fn>
void dispatch_norm(const NormDesc& desc, Fn&& fn) {
  auto with_kind = [&]<typename T>() {
    if (desc.kind == NormKind::kRMSNorm) return fn.template operator()<T, true>();
    return fn.template operator()<T, false>();
  };
  switch (desc.dtype) {
    case DType::kFloat32: return with_kind.template operator()<float>();
    case DType::kBFloat16: return with_kind.template operator()<__nv_bfloat16>();
    case DType::kFloat16: return with_kind.template operator()<__half>();
    default: SG_THROW(ErrorCode::kInternal, "norm: dtype ", dtype_name(desc.dtype), " passed check_norm");
  }
}

// Non-null and aligned to `alignment` bytes (its element size; 16 for the workspace).
void check_device_pointer(const std::string& op, const char* name, const void* pointer, std::size_t alignment) {
  SG_CHECK(pointer != nullptr, op, ": ", name, " is null; pass a device pointer");
  SG_CHECK(reinterpret_cast<std::uintptr_t>(pointer) % alignment == 0, op, ": ", name, " (", pointer,
           ") is not ", alignment, "-byte aligned; pass a pointer to whole elements, e.g. from cudaMalloc plus a "
           "multiple of ", alignment, " bytes");
}

// The 16-byte vector path: hidden a multiple of the vector width, so that
// every row of the (non-null) pointers starts 16-byte aligned when the first does.
bool vector_access(const NormDesc& desc, std::initializer_list<const void*> pointers) {
  if (desc.hidden % vector_count(desc.dtype) != 0) return false;
  return std::all_of(pointers.begin(), pointers.end(), [](const void* p) { return p == nullptr || is_aligned16(p); });
}

std::string op_name(const NormDesc& desc, const char* direction) {
  return detail::concat(kind_name(desc.kind), "_", direction, " (", dtype_name(desc.dtype), ", ", desc.rows, "x",
                        desc.hidden, ")");
}

}  // namespace

void check_norm(const NormDesc& desc) {
  SG_CHECK(desc.kind == NormKind::kLayerNorm || desc.kind == NormKind::kRMSNorm, "norm: unknown NormKind ",
           static_cast<int>(desc.kind), "; use kLayerNorm or kRMSNorm");
  const char* kind = kind_name(desc.kind);
  SG_CHECK(desc.dtype == DType::kFloat32 || desc.dtype == DType::kBFloat16 || desc.dtype == DType::kFloat16, kind,
           ": dtype ", dtype_name(desc.dtype), " is not supported; use bf16, fp16 or fp32");
  SG_CHECK(desc.rows > 0, kind, ": rows must be > 0, got ", desc.rows);
  SG_CHECK(desc.hidden > 0, kind, ": hidden must be > 0, got ", desc.hidden);
  SG_CHECK(desc.hidden <= std::numeric_limits<int>::max(), kind, ": hidden ", desc.hidden,
           " is too large; it must fit in a 32-bit int");
  SG_CHECK(desc.eps > 0.0f, kind, ": eps must be > 0, got ", desc.eps);
}

std::size_t norm_backward_workspace_bytes(const NormDesc& desc) {
  check_norm(desc);
  const std::int64_t outputs = desc.kind == NormKind::kLayerNorm ? 2 : 1;
  return static_cast<std::size_t>(outputs * max_partial_rows(desc) * desc.hidden) * sizeof(float);
}

namespace {

// launch_norm_forward, and with fp8 non-null launch_norm_forward_fp8.
void norm_forward(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
                  float* rstd, const NormFp8Epilogue* fp8, cudaStream_t stream) {
  check_norm(desc);
  const std::string op = op_name(desc, fp8 != nullptr ? "forward_fp8" : "forward");
  const bool layer_norm = desc.kind == NormKind::kLayerNorm;
  const std::size_t element = dtype_size(desc.dtype);
  check_device_pointer(op, "x", x, element);
  check_device_pointer(op, "gamma", gamma, element);
  if (layer_norm) check_device_pointer(op, "beta", beta, element);
  if (fp8 == nullptr || y != nullptr) check_device_pointer(op, "y", y, element);
  if (layer_norm) check_device_pointer(op, "mean", mean, sizeof(float));
  check_device_pointer(op, "rstd", rstd, sizeof(float));
  if (fp8 != nullptr) {
    check_device_pointer(op, "amax", fp8->amax, sizeof(float));
    SG_CHECK((fp8->scale == nullptr) == (fp8->rowwise == nullptr), op,
             ": give scale and the row-wise output together (both null: amax alone)");
  }

  const RowPlan plan = forward_plan(desc, vector_access(desc, {x, gamma, layer_norm ? beta : nullptr, y}));
  SG_CHECK(fp8 == nullptr || plan.vector, op, ": the FP8 epilogue takes the 16-byte vector path only: hidden ",
           desc.hidden, " must be a multiple of ", vector_count(desc.dtype),
           " and x, gamma, beta, y 16-byte aligned");
  const dim3 block(plan.threads_per_row, plan.rows_per_block);
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>(plan.groups, std::numeric_limits<int>::max()));
  dispatch_norm(desc, [&]<typename T, bool kRms>() {
    const ForwardArgs<T> args{.x = static_cast<const T*>(x),
                              .gamma = static_cast<const T*>(gamma),
                              .beta = static_cast<const T*>(beta),
                              .y = static_cast<T*>(y),
                              .mean = mean,
                              .rstd = rstd,
                              .rows = desc.rows,
                              .hidden = static_cast<int>(desc.hidden),
                              .eps = desc.eps,
                              .format = fp8 != nullptr ? fp8->format : Fp8Format::kE4M3,
                              .scale = fp8 != nullptr ? fp8->scale : nullptr,
                              .q = fp8 != nullptr ? fp8->rowwise : nullptr,
                              .amax_bits = fp8 != nullptr ? reinterpret_cast<unsigned*>(fp8->amax) : nullptr};
    if (fp8 != nullptr) {
      if (plan.resident) {
        norm_forward_kernel<T, kRms, true, true, true><<<grid, block, 0, stream>>>(args);
      } else {
        norm_forward_kernel<T, kRms, true, false, true><<<grid, block, 0, stream>>>(args);
      }
    } else if (plan.vector && plan.resident) {
      norm_forward_kernel<T, kRms, true, true><<<grid, block, 0, stream>>>(args);
    } else if (plan.vector) {
      norm_forward_kernel<T, kRms, true, false><<<grid, block, 0, stream>>>(args);
    } else if (plan.resident) {
      norm_forward_kernel<T, kRms, false, true><<<grid, block, 0, stream>>>(args);
    } else {
      norm_forward_kernel<T, kRms, false, false><<<grid, block, 0, stream>>>(args);
    }
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_norm_forward(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y,
                         float* mean, float* rstd, cudaStream_t stream) {
  norm_forward(desc, x, gamma, beta, y, mean, rstd, nullptr, stream);
}

void launch_norm_forward_fp8(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y,
                             float* mean, float* rstd, const NormFp8Epilogue& fp8, cudaStream_t stream) {
  norm_forward(desc, x, gamma, beta, y, mean, rstd, &fp8, stream);
}

void launch_norm_backward(const NormDesc& desc, const void* dy, const void* x, const float* mean, const float* rstd,
                          const void* gamma, void* dx, float* dgamma, float* dbeta, void* workspace,
                          cudaStream_t stream, const NormBackwardTuning& tuning, const void* dx_residual) {
  check_norm(desc);
  const std::string op = op_name(desc, "backward");
  const bool layer_norm = desc.kind == NormKind::kLayerNorm;
  const std::size_t element = dtype_size(desc.dtype);
  check_device_pointer(op, "dy", dy, element);
  check_device_pointer(op, "x", x, element);
  if (layer_norm) check_device_pointer(op, "mean", mean, sizeof(float));
  check_device_pointer(op, "rstd", rstd, sizeof(float));
  check_device_pointer(op, "gamma", gamma, element);
  check_device_pointer(op, "dx", dx, element);
  if (dx_residual != nullptr) {
    check_device_pointer(op, "dx_residual", dx_residual, element);
    SG_CHECK(dx_residual != dx, op, ": dx_residual may not alias dx");
  }
  check_device_pointer(op, "dgamma", dgamma, sizeof(float));
  if (layer_norm) check_device_pointer(op, "dbeta", dbeta, sizeof(float));
  // The partial rows are written in float4 on the vector path.
  check_device_pointer(op, "workspace (norm_backward_workspace_bytes)", workspace, 16);

  const RowPlan plan = backward_plan(desc, vector_access(desc, {dy, x, gamma, dx, dx_residual}), tuning);
  const dim3 block(plan.threads_per_row, plan.rows_per_block);
  int device = 0;
  int sms = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int partial_rows = 0;
  dispatch_norm(desc, [&]<typename T, bool kRms>() {
    const BackwardArgs<T> args{.dy = static_cast<const T*>(dy),
                               .x = static_cast<const T*>(x),
                               .mean = mean,
                               .rstd = rstd,
                               .gamma = static_cast<const T*>(gamma),
                               .dx = static_cast<T*>(dx),
                               .dx_residual = static_cast<const T*>(dx_residual),
                               .partials = static_cast<float*>(workspace),
                               .rows = desc.rows,
                               .hidden = static_cast<int>(desc.hidden)};
    // Persistent grid: the blocks resident at once (a fixed number on a given
    // device, so the row-to-block assignment and with it dgamma/dbeta are
    // reproducible), and no more partial rows than that.
    auto launch = [&](auto kernel) {
      int per_sm = 0;
      SG_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, static_cast<int>(block.x * block.y), 0));
      const std::int64_t fit = std::max<std::int64_t>(1, static_cast<std::int64_t>(per_sm) * sms);
      partial_rows = static_cast<int>(std::min({plan.groups, kMaxBackwardBlocks, fit}));
      kernel<<<partial_rows, block, 0, stream>>>(args);
    };
    if (plan.vector && plan.vecs == 2) {
      launch(norm_backward_kernel<T, kRms, true, 2, true>);
    } else if (plan.vector && plan.resident) {
      launch(norm_backward_kernel<T, kRms, true, 4, true>);
    } else if (plan.vector) {
      launch(norm_backward_kernel<T, kRms, true, 4, false>);
    } else if (plan.vecs == 2) {
      launch(norm_backward_kernel<T, kRms, false, 2, true>);
    } else if (plan.resident) {
      launch(norm_backward_kernel<T, kRms, false, 4, true>);
    } else {
      launch(norm_backward_kernel<T, kRms, false, 4, false>);
    }
  });
  SG_CUDA_CHECK(cudaGetLastError());
  const dim3 reduce_grid(static_cast<unsigned>((desc.hidden + kReduceColumns - 1) / kReduceColumns),
                         layer_norm ? 2 : 1);
  norm_reduce_partials_kernel<<<reduce_grid, dim3(kReduceColumns, kReduceStrides), 0, stream>>>(
      static_cast<const float*>(workspace), dgamma, dbeta, partial_rows, static_cast<int>(desc.hidden));
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
