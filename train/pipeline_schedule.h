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

}  // namespace stepgraph
