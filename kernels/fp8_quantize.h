// Quantizing tensors to FP8 (Note [FP8 scaling] in
// engine/fp8_recipe.h): the scale rules, the host references the CUDA
// kernels are held to, bit for bit on the quantized bytes, and the kernels
// (tensor-wise so far). FP8 tensors
// are raw bytes (engine/fp8.h); scales and amaxes are fp32.
//
//   QuantizeDesc d{DType::kBFloat16, Fp8Format::kE4M3, rows, cols, /*rowwise=*/true, /*columnwise=*/true};
//   quantize_host(d, x, scale, q_rows, q_cols, &amax);  // q_cols: the transpose, [cols, rows]
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"
#include "engine/fp8.h"
#include "engine/fp8_recipe.h"
#include "kernels/fp8_block_scales.h"

namespace stepgraph::kernels {

// --- scales ----------------------------------------------------------------

// fp8_max(format) / amax / 2^margin; 1 when amax is 0 (nothing to scale),
// the largest finite float when the quotient overflows. power_of_two rounds
// it down to a power of two (2^floor(log2)), so scale_inv = 1 / scale is
// exact. An amax that is not finite is the caller's to handle (check first:
// amax_is_usable).
float fp8_scale(float amax, Fp8Format format, int margin, bool power_of_two);
inline bool amax_is_usable(float amax) { return amax >= 0.0f && amax <= 3.402823466e38f; }  // false for NaN, inf

// --- tensor-wise (current and delayed scaling) ------------------------------

struct QuantizeDesc {
  DType in_dtype = DType::kBFloat16;  // fp32, bf16 or fp16
  Fp8Format format = Fp8Format::kE4M3;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  bool rowwise = true;      // q [rows, cols]
  bool columnwise = false;  // q^T [cols, rows]: the copy a TN GEMM reads when the tensor is its other operand
};

// An Error naming what is wrong: in_dtype not fp32/bf16/fp16, a negative size,
// neither copy asked for.
void check_quantize(const QuantizeDesc& desc);

// q = fp8(x * scale) (float_to_fp8: nearest even, saturating) into the copies
// asked for, and *amax = max |x| over the whole tensor (NaN if any x is NaN).
// rowwise/columnwise may be null when not asked for.
void quantize_host(const QuantizeDesc& desc, const void* x, float scale, std::uint8_t* rowwise,
                   std::uint8_t* columnwise, float* amax);

// The CUDA kernel (kernels/fp8_quantize.cu): the same bytes as quantize_host
// and the same amax, bit for bit. scale and amax are device pointers (the
// scale is read on the device, so a captured step takes whatever a delayed
// update wrote); amax is overwritten.
void launch_quantize(const QuantizeDesc& desc, const void* x, const float* scale, std::uint8_t* rowwise,
                     std::uint8_t* columnwise, float* amax, cudaStream_t stream);

// *amax = max |x| of x [rows, cols] (fp32, bf16 or fp16): current scaling's
// first pass. The host reference is amax_host; equal bit for bit.
float amax_host(DType dtype, std::int64_t rows, std::int64_t cols, const void* x);
void launch_amax(DType dtype, std::int64_t rows, std::int64_t cols, const void* x, float* amax, cudaStream_t stream);

// --- block scaling -----------------------------------------------------------

// The shape must divide into blocks: cols a multiple of 128, and rows too for
// 128 x 128 or for a column-wise 1 x 128 copy. An Error naming the shape
// otherwise.
void check_block_quantize(const QuantizeDesc& desc, BlockShape shape);

// Quantizes with a scale per block, each fp8_scale(block amax, format, 0,
// power_of_two), writing q and scale_inv = 1 / scale per block:
//  - 1 x 128: row-wise q [rows, cols], blocks of 128 columns of a row; the
//    column-wise copy q^T [cols, rows] has its own blocks, 128 consecutive
//    rows of a column (what its GEMM reduces over);
//  - 128 x 128: the same tiles for both copies.
// Each copy's scale_inv is in the layout its GEMM reads (BlockScaleLayout in
// kernels/fp8_block_scales.h: {shape, rows, cols} for the row-wise copy,
// {shape, cols, rows} for the column-wise one; 128 x 128's padding floats
// are written 0). Returns false (and leaves the outputs unspecified) when a
// block's amax is not finite.
struct BlockOutputs {
  std::uint8_t* rowwise = nullptr;
  float* rowwise_scale_inv = nullptr;
  std::uint8_t* columnwise = nullptr;
  float* columnwise_scale_inv = nullptr;
};
bool quantize_blocks_host(const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const void* x,
                          const BlockOutputs& out);

// The CUDA kernel: the same bytes and scale_inv as quantize_blocks_host, bit
// for bit; *non_finite (a device int) becomes 1 when some block's amax is not
// finite (the host reference's false), else 0.
void launch_quantize_blocks(const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const void* x,
                            const BlockOutputs& out, int* non_finite, cudaStream_t stream);

// --- delayed scaling ----------------------------------------------------------

// One tensor's state between steps: its amax history (history[0] the most
// recent) and its scale.
struct DelayedScale {
  float* history = nullptr;  // [recipe.amax_history_len]
  float* scale = nullptr;
  float* scale_inv = nullptr;
};

// After a step that saw `amax`: the history rolls (every entry moves one
// older, the oldest drops, amax becomes history[0]); the amax the scale uses
// is the history's max or its most recent (recipe.amax_reduction); the scale
// becomes fp8_scale(that, format, recipe.margin, false) unless that amax is 0
// (the scale stays). A non-finite amax changes nothing and returns false.
bool delayed_scaling_update_host(const Fp8Recipe& recipe, Fp8Format format, float amax, const DelayedScale& state);

// --- scale updates on the device (kernels/fp8_scaling.cu) ---------------------
// Device pointers throughout (one float each for amax, scale and scale_inv);
// *non_finite becomes 1 when the amax is not finite (scale and scale_inv
// are then 1 for current scaling, unchanged for delayed), else 0. Bit for
// bit the host references' results.

// Current scaling: scale = fp8_scale(*amax, format, 0, power_of_two), scale_inv = 1 / scale.
void launch_scale_from_amax(const float* amax, Fp8Format format, bool power_of_two, float* scale, float* scale_inv,
                            int* non_finite, cudaStream_t stream);

// Delayed scaling: delayed_scaling_update_host on the device, the history
// ([recipe.amax_history_len] fp32), scale and scale_inv updated in place.
void launch_delayed_scaling_update(const Fp8Recipe& recipe, Fp8Format format, const float* amax, float* history,
                                   float* scale, float* scale_inv, int* non_finite, cudaStream_t stream);

// *counter += the sum of the flags (each a device int, 0 or 1): a layer's
// tally of non-finite amaxes over its steps, kept on the device and read
// when the caller checks for errors. At most kMaxCountedFlags flags a launch.
inline constexpr int kMaxCountedFlags = 8;
void launch_count_flags(const int* const* flags, int count, int* counter, cudaStream_t stream);

}  // namespace stepgraph::kernels
