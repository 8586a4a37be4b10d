// A context-parallel rank's share of a global batch (Note [Context-parallel
// token layout] in kernels/context_parallel_plan.h): the T rows cut into 2N
// chunks, rank r's rows chunk r then chunk 2N - 1 - r. What a program (the
// trainer, a test) writes into a context-parallel TrainStep's tokens and
// labels; the packing (cu_seqlens) stays the global batch's.
//
//   std::vector<std::int32_t> mine = context_parallel_rows<std::int32_t>(tokens, 1, cp.world_size(), cp.rank());
//
// Under TP too, the TP rank's rows are its contiguous 1/TP of `mine`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/error.h"

namespace stepgraph {

// rows: T rows of `width` elements each (row-major); T must divide by 2 ranks.
template <typename T>
std::vector<T> context_parallel_rows(std::span<const T> rows, std::int64_t width, int ranks, int rank) {
  SG_CHECK(width > 0 && static_cast<std::int64_t>(rows.size()) % width == 0,
           "context_parallel_rows: rows must hold whole rows of width ", width, ", got ", rows.size(), " elements");
  SG_CHECK(ranks > 0 && rank >= 0 && rank < ranks, "context_parallel_rows: rank ", rank, " is not one of ", ranks,
           " context-parallel ranks");
  const std::int64_t tokens = static_cast<std::int64_t>(rows.size()) / width;
  SG_CHECK(tokens > 0 && tokens % (2 * ranks) == 0, "context_parallel_rows: the global batch's ", tokens,
           " tokens must divide into 2 x ", ranks, " context-parallel chunks; make the tokens a multiple of ",
           2 * ranks);
  const std::int64_t chunk = tokens / (2 * ranks);
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(2 * chunk * width));
  for (const std::int64_t c : {static_cast<std::int64_t>(rank), static_cast<std::int64_t>(2 * ranks - 1 - rank)}) {
    const auto first = rows.begin() + c * chunk * width;
    out.insert(out.end(), first, first + chunk * width);
  }
  return out;
}

}  // namespace stepgraph
