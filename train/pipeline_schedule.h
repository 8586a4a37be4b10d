// PipelineSchedule: the order in which one pipeline stage runs the forward
// and backward passes of its microbatches, as TransformerEngine's
// make_graphed_callables takes it (`_order`), for one model chunk:
//
//   PipelineSchedule s = PipelineSchedule::one_f_one_b(4, 1);  // F0 F1 B0 F2 B1 F3 B2 B3
//   PipelineSchedule t = PipelineSchedule::from_signed({1, 2, -1, 3, -2, 4, -3, -4});  // the same
//
// A valid schedule runs every microbatch's forward once and its backward
// once, after its forward; anything else is an Error naming the pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace stepgraph {

struct PipelinePass {
  enum class Kind : std::uint8_t { kForward, kBackward };
  Kind kind = Kind::kForward;
  std::int64_t microbatch = 0;  // 0-based

  bool operator==(const PipelinePass&) const = default;
  std::string to_string() const;  // "F2", "B0"
};

class PipelineSchedule {
 public:
  // Checks `passes` (see the file comment).
  explicit PipelineSchedule(std::vector<PipelinePass> passes);

  // One-forward-one-backward for a stage `warmup` forwards ahead of its
  // first backward (a stage s of p has p - s - 1; clamped to microbatches):
  // warmup + 1 forwards, then alternately a backward and a forward, then
  // the remaining backwards.
  static PipelineSchedule one_f_one_b(std::int64_t microbatches, std::int64_t warmup);
  // Every forward, then every backward (GPipe's order).
  static PipelineSchedule all_forward_all_backward(std::int64_t microbatches);
  // TransformerEngine's signed form, 1-based: +m is microbatch m's forward,
  // -m its backward.
  static PipelineSchedule from_signed(const std::vector<std::int64_t>& order);

  const std::vector<PipelinePass>& passes() const { return passes_; }
  std::int64_t microbatches() const { return microbatches_; }
  std::string to_string() const;  // "F0 F1 B0 F2 B1 B2"

 private:
  std::vector<PipelinePass> passes_;
  std::int64_t microbatches_ = 0;
};

// Interleaved (virtual) pipelines: a rank holds V model chunks, chunk v of
// stage s being the model's chunk v * P + s of P * V (Megatron's layout), and
// runs the passes of all its chunks in one order.
struct ChunkPass {
  int chunk = 0;  // this rank's chunk, 0-based (not the model's chunk index)
  PipelinePass pass;

  bool operator==(const ChunkPass&) const = default;
  std::string to_string() const;  // "c1F2": chunk 1's forward of microbatch 2
};

class InterleavedSchedule {
 public:
  // Checks that each chunk's passes form a PipelineSchedule (every
  // microbatch's forward, then its backward, once) of the same microbatches.
  InterleavedSchedule(std::vector<ChunkPass> passes, int chunks);

  // Megatron's interleaved 1F1B for stage `stage` of `stages` with `chunks`
  // chunks a rank: forwards in groups of `stages` microbatches per chunk
  // (chunk 0's group, chunk 1's, ..., then the next group), backwards in
  // the same groups from the last chunk down; (P - s - 1) * 2 + (V - 1) * P
  // warmup forwards (every forward first where microbatches == stages, as
  // Megatron), then one forward and one backward alternately, then the
  // remaining backwards. `microbatches` must be a multiple of `stages`.
  // Every chunk runs its backwards in microbatch order 0, 1, ..., M - 1.
  static InterleavedSchedule interleaved_one_f_one_b(std::int64_t microbatches, int stages, int stage, int chunks);
  // TransformerEngine's signed form for chunks (make_graphed_callables'
  // `_order`): +c runs chunk c's (1-based) next forward, -c its next
  // backward; microbatches are implicit, counted per chunk in order. The
  // form cannot say which microbatch a pass runs, so each chunk's forwards
  // and backwards run in microbatch order. (PipelineSchedule::from_signed's
  // +m/-m names microbatches of one chunk: it cannot express chunks.)
  static InterleavedSchedule from_chunk_signed(const std::vector<std::int64_t>& order, int chunks);
  // The signed form back; an Error where a chunk's passes are not in microbatch order.
  std::vector<std::int64_t> to_chunk_signed() const;

  const std::vector<ChunkPass>& passes() const { return passes_; }
  int chunks() const { return chunks_; }
  std::int64_t microbatches() const { return microbatches_; }
  // The passes of one chunk, in this order.
  PipelineSchedule chunk_schedule(int chunk) const;
  std::string to_string() const;  // "c0F0 c0F1 c1F0 ..."

 private:
  std::vector<ChunkPass> passes_;
  int chunks_ = 1;
  std::int64_t microbatches_ = 0;
};

}  // namespace stepgraph
