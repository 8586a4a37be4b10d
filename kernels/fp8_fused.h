// Fused FP8 quantization (Note [FP8 scaling] in
// engine/fp8_recipe.h): LayerNorm/RMSNorm, GeLU and GeLU's backward, each
// writing its usual 16-bit result (optional) together with its FP8 copies
// (row-wise q [rows, cols], column-wise q^T [cols, rows]) and amax in one
// pass, in place of the op followed by launch_quantize.
//
// Contract: the bytes and amax are, bit for bit, those of the unfused
// sequence: the op's own kernel (launch_norm_forward, launch_gelu_forward,
// launch_gelu_backward) writing its 16-bit output v, then quantize on that v
// with the given scale: q = fp8(v * scale), amax = max |v| (NaN if any v is
// NaN). The host references below are the ops' host references followed by
// quantize_host, so they hold the CUDA kernels to the same rule.
//
//   Fp8Copies out{Fp8Format::kE4M3, scale_dev, q_dev, qt_dev, amax_dev};
//   launch_gelu_fp8(DType::kBFloat16, rows, cols, pre, /*act=*/nullptr, out, stream);
//   Fp8Copies first{Fp8Format::kE4M3, nullptr, nullptr, nullptr, amax_dev};  // amax alone (current scaling)
//
// Shapes: dtype bf16 or fp16; cols a multiple of 16 (16-byte vectors of the
// input and 16-byte runs of the byte tiles); any rows >= 0, zero included.
// Device pointers 16-byte aligned (cudaMalloc'd buffers are).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"
#include "engine/fp8.h"
#include "kernels/norm.h"

namespace stepgraph::kernels {

// Where a fused kernel puts its FP8 result. On the device, device pointers
// (the scale is read by the kernel, so a captured step takes whatever a
// delayed-scaling update wrote before it); in the host references, host ones.
struct Fp8Copies {
  Fp8Format format = Fp8Format::kE4M3;
  // Null: amax alone (current scaling's first pass); then rowwise and
  // columnwise must be null too.
  const float* scale = nullptr;
  std::uint8_t* rowwise = nullptr;     // [rows, cols], or null
  std::uint8_t* columnwise = nullptr;  // [cols, rows], or null
  float* amax = nullptr;               // required; overwritten
};

// An Error naming what is wrong: dtype not bf16/fp16, a negative size, cols
// not a multiple of 16, amax null, copies without a scale. `op` names the
// caller in the message.
void check_fp8_fused(const char* op, DType dtype, std::int64_t rows, std::int64_t cols, const Fp8Copies& out);

// --- LayerNorm / RMSNorm -> FP8 ---------------------------------------------
// desc as for launch_norm_forward, except that rows may be 0; hidden is the
// cols above. Writes mean (LayerNorm) and rstd as launch_norm_forward does,
// y [rows, hidden] when non-null, and out's copies of y. The column-wise copy
// is transposed from the row-wise one (Note [FP8 transpose tile] in
// kernels/fp8_device.cuh), so it needs the row-wise copy too.
// check_norm_fp8: check_norm's and check_fp8_fused's Errors, and that one.
void check_norm_fp8(const NormDesc& desc, const Fp8Copies& out);
void launch_norm_fp8(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
                     float* rstd, const Fp8Copies& out, cudaStream_t stream);

// --- GeLU -> FP8 (fc1's output to fc2's input) ---------------------------------
// act = gelu_tanh(pre) rounded to dtype, as launch_gelu_forward writes it;
// act (may be null) and out's copies of act.
void launch_gelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* pre, void* act,
                     const Fp8Copies& out, cudaStream_t stream);

// --- dGeLU -> FP8 (gradients; usually E5M2) ------------------------------------
// d_pre = dact * gelu_tanh'(pre) rounded to dtype, as launch_gelu_backward
// writes it; d_pre (may be null) and out's copies of d_pre.
void launch_dgelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* dact, const void* pre,
                      void* d_pre, const Fp8Copies& out, cudaStream_t stream);

// Plain quantize (and amax alone, with out.scale null) through the same tile
// kernel, the identity in place of GeLU: the bytes and amax of
// launch_quantize / launch_amax (kernels/fp8_quantize.h), at the vectorised
// kernel's bandwidth. Only for what it takes: bf16 or fp16 x, cols a
// multiple of 16, every pointer 16-byte aligned; returns false (launching
// nothing) otherwise, for the caller to run launch_quantize instead.
bool launch_quantize_vectorized(DType dtype, std::int64_t rows, std::int64_t cols, const void* x,
                                const Fp8Copies& out, cudaStream_t stream);

namespace host {
// The host references: host::norm_forward / gelu_forward / gelu_backward,
// then quantize_host on their 16-bit output (scale = *out.scale). The 16-bit
// outputs (y, act, d_pre) may be null here too.
void norm_fp8(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
              float* rstd, const Fp8Copies& out);
void gelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* pre, void* act, const Fp8Copies& out);
void dgelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* dact, const void* pre, void* d_pre,
               const Fp8Copies& out);
}  // namespace host

}  // namespace stepgraph::kernels
