// FP8 on the host: the OCP E4M3 and E5M2 formats, decoded exactly and
// encoded bit for bit as the device's saturating conversion does it
// (cvt.rn.satfinite.{e4m3,e5m2}x2.f32, __nv_cvt_float_to_fp8 with
// __NV_SATFINITE): round to nearest, ties to even; a finite value past the
// largest finite one, and +-inf, saturate to it; NaN becomes NaN (0x7f).
// Host references keep fp8 tensors as these raw bytes. CUDA-free.
//
//   std::uint8_t code = float_to_fp8(Fp8Format::kE4M3, 300.5f);  // 0x79
//   float back = fp8_to_float(Fp8Format::kE4M3, code);             // 288 (the grid is 32 apart there)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "engine/dtype.h"

namespace stepgraph {

enum class Fp8Format : std::uint8_t {
  kE4M3,  // 4 exponent bits (bias 7), 3 mantissa bits; no infinities; largest finite 448
  kE5M2,  // 5 exponent bits (bias 15), 2 mantissa bits; IEEE-like with infinities; largest finite 57344
};

std::string_view fp8_format_name(Fp8Format format);  // "e4m3", "e5m2"
DType fp8_dtype(Fp8Format format);                    // kFloat8E4M3, kFloat8E5M2

// The largest finite value: 448 (E4M3), 57344 (E5M2).
float fp8_max(Fp8Format format);

float fp8_to_float(Fp8Format format, std::uint8_t code);
std::uint8_t float_to_fp8(Fp8Format format, float value);

// FP8 needs Hopper here: cuBLASLt's FP8 GEMMs need compute capability 8.9
// (tensor-wise) or 9.0 (block scaling), and this build's FP8 kernels are
// sm_90a. An Error (kUnsupported) naming the GPU and what it lacks otherwise.
// Backend::check_fp8_supported asks this of the backend's GPU.
void check_fp8_device(int compute_major, int compute_minor, const std::string& device_name);

}  // namespace stepgraph
