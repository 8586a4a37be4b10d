// AlgorithmChoice: how a library kernel (a cuBLASLt GEMM) is picked among
// the candidates that compute the same product.
//
// Note [Deterministic algorithm choice]
// cuBLASLt's candidates for one GEMM differ in tile, split-K and reduction
// scheme, and so in the order their fp32 sums are added: two candidates give
// different bits for the same operands. Its heuristic is a pure function of
// the problem, the operands' alignment, the workspace limit, the library
// version and the GPU model, so kHeuristic gives the same bits on every run
// of one binary on one GPU model: eager and graphed, fresh and resumed.
// kTimed times the candidates once per process and keeps the fastest; two
// near-equal candidates trade places from run to run (on an H200 a bf16
// wgrad picked a 64x64 tile in one process and 128x64 in the next, and with
// a split-K candidate winning in one of them the losses of a bf16 GPT on
// text differed from the second step on). A timed choice is therefore off
// by default; where it is on, the picks are recorded (kernels/gemm.h:
// export_timed_gemm_algorithms) so a resumed run makes the same ones.
// docs/deterministic_gemm_algorithms.md has the measurements.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace stepgraph {

enum class AlgorithmChoice : std::uint8_t {
  kHeuristic,  // the library's heuristic: the same bits on every run (the default)
  kTimed,      // the fastest candidate by timing, once per process: faster, not reproducible across processes
};

std::string algorithm_choice_name(AlgorithmChoice choice);  // "heuristic" | "timed"
// The choice a name gives, or nullopt for an unknown name.
std::optional<AlgorithmChoice> parse_algorithm_choice(std::string_view name);

}  // namespace stepgraph
