// The GEMM algorithms a process picked by timing, as text that a checkpoint
// keeps (Note [Deterministic algorithm choice] in engine/algorithm_choice.h):
//
//   stepgraph gemm algorithms v1
//   identity cuBLASLt 130100, NVIDIA H100 80GB HBM3 (132 SMs)
//   pick <m> <n> <k> <trans_a> <trans_b> <a_type> <b_type> <d_type> <epilogue> <alpha bits> <beta bits>
//        <fast_accumulation> <a_blocks> <b_blocks> <alignment> <workspace limit> <workspace> <8 algo words>
//
// one pick per line (shown wrapped here): dtypes by name, the epilogue and
// block shapes by gemm_epilogue_name / "1x128" / "128x128" / "-", floats and
// the algorithm's opaque words in hex. CUDA-free, so the format is tested on
// every machine; kernels/gemm.cc turns picks into cuBLASLt's algorithms.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/gemm.h"

namespace stepgraph::kernels {

struct GemmAlgorithmPick {
  GemmDesc desc;
  std::uint64_t alignment = 0;        // the operands' (a power of two, 16 to 256)
  std::uint64_t workspace_limit = 0;  // the most workspace the pick was allowed
  std::uint64_t workspace = 0;        // what the picked algorithm needs
  std::array<std::uint64_t, 8> algo{};  // cublasLtMatmulAlgo_t's words
  bool operator==(const GemmAlgorithmPick&) const = default;
};

struct GemmAlgorithmRecord {
  std::string identity;  // gemm_library_identity() of the process that timed them
  std::vector<GemmAlgorithmPick> picks;
  bool operator==(const GemmAlgorithmRecord&) const = default;
};

std::string format_gemm_algorithm_record(const GemmAlgorithmRecord& record);
// Error(kIo) naming the line and what is wrong with it; total on any input.
GemmAlgorithmRecord parse_gemm_algorithm_record(std::string_view text);

}  // namespace stepgraph::kernels
