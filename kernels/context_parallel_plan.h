// The context-parallel plan: which query segments and key ranges a rank's
// attention reads, and its tokens' rotary positions, computed from the
// global cu_seqlens (on the device for CUDA, so a captured step takes any
// packing).
//
// Note [Context-parallel token layout]
// The global batch is T packed tokens (cu_seqlens int32 [S + 1], see
// kernels/attention.h). It is cut into 2N chunks of c = T / (2N) tokens, and
// rank r of N holds chunks r and 2N - 1 - r, in that order (the zig-zag that
// gives every rank the same share of the causal work): local token t < c is
// stream token r c + t, local token c + t is stream token (2N - 1 - r) c + t.
// A sequence crossing a chunk boundary spans chunks (and ranks); a short one
// lies in one chunk.
//
// Rank r's attention reads the K/V of all T tokens in stream order (gathered
// from every rank) through a segment table (Note [Segment attention]) of 2S
// entries: entry s (s < S) is sequence s's piece of chunk r and entry S + s
// its piece of chunk 2N - 1 - r, empty where the sequence misses the chunk.
//   q_offsets int32 [2S + 1]: q_offsets[s] = clamp(cu[s] - r c, 0, c) for
//                             s <= S, q_offsets[S + s] = c + clamp(cu[s] -
//                             (2N - 1 - r) c, 0, c): each piece's local rows.
//   kv_ranges int32 [2S, 2]:  a piece's keys: its sequence's start up to the
//                             piece's end (causal: with bottom-right alignment
//                             each query sees exactly its causal keys) or to
//                             the sequence's end (non-causal); [0, 0) for an
//                             empty piece.
//   positions int32 [T / N]:  each local token's position within its sequence
//                             (the rotary embedding's).
// On the device cu_seqlens is read as Note [Safe cu_seqlens] reads it, so any
// contents give a valid table; positions use the rotary kernels' reading
// (kernels/packed_sequences.cuh), so they match one rank's rope.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace stepgraph::kernels {

struct ContextParallelPlanDesc {
  std::int64_t tokens = 0;     // T, the global batch
  std::int64_t sequences = 0;  // S
  int ranks = 1;               // N
  int rank = 0;                // r
  bool causal = true;

  std::int64_t chunk() const { return tokens / (2 * ranks); }  // c
  std::int64_t local_tokens() const { return tokens / ranks; }
  std::int64_t segments() const { return 2 * sequences; }
};

// An Error unless T > 0, S > 0, N > 0, 0 <= r < N, T divides by 2N, and T < 2^31.
void check_context_parallel_plan(const ContextParallelPlanDesc& desc);

// The stream chunk (of 2N) that block b of a rank-major gathered tensor holds:
// block 2 rho is rank rho's first chunk (rho), block 2 rho + 1 its second
// (2N - 1 - rho).
inline std::int64_t zigzag_stream_chunk(std::int64_t ranks, std::int64_t block) {
  const std::int64_t rank = block / 2;
  return block % 2 == 0 ? rank : 2 * ranks - 1 - rank;
}

void launch_context_parallel_plan(const ContextParallelPlanDesc& desc, const std::int32_t* cu_seqlens,
                                  std::int32_t* q_offsets, std::int32_t* kv_ranges, std::int32_t* positions,
                                  CUstream_st* stream);

namespace host {

// The same on host memory; cu_seqlens must be a valid packing of T tokens (an Error otherwise).
void context_parallel_plan(const ContextParallelPlanDesc& desc, const std::int32_t* cu_seqlens, std::int32_t* q_offsets,
                           std::int32_t* kv_ranges, std::int32_t* positions);

}  // namespace host
}  // namespace stepgraph::kernels
