#include "train/pipeline_schedule.h"

#include <algorithm>
#include <limits>

#include "engine/error.h"

namespace stepgraph {

std::string PipelinePass::to_string() const {
  return (kind == Kind::kForward ? "F" : "B") + std::to_string(microbatch);
}

PipelineSchedule::PipelineSchedule(std::vector<PipelinePass> passes) : passes_(std::move(passes)) {
  SG_CHECK(!passes_.empty(), "a pipeline schedule needs at least one pass");
  SG_CHECK(passes_.size() % 2 == 0, "a pipeline schedule runs each microbatch's forward and backward once: ",
           passes_.size(), " passes cannot be that");
  microbatches_ = static_cast<std::int64_t>(passes_.size() / 2);
  std::vector<bool> forward(static_cast<std::size_t>(microbatches_), false);
  std::vector<bool> backward(static_cast<std::size_t>(microbatches_), false);
  for (std::size_t i = 0; i < passes_.size(); ++i) {
    const PipelinePass& pass = passes_[i];
    SG_CHECK(pass.microbatch >= 0 && pass.microbatch < microbatches_, "pipeline schedule: pass ", i, " (",
             pass.to_string(), ") names microbatch ", pass.microbatch, ", outside [0, ", microbatches_,
             ") for a schedule of ", passes_.size(), " passes");
    const auto m = static_cast<std::size_t>(pass.microbatch);
    if (pass.kind == PipelinePass::Kind::kForward) {
      SG_CHECK(!forward[m], "pipeline schedule: pass ", i, " runs microbatch ", m, "'s forward a second time");
      forward[m] = true;
    } else {
      SG_CHECK(forward[m], "pipeline schedule: pass ", i, " runs microbatch ", m, "'s backward before its forward");
      SG_CHECK(!backward[m], "pipeline schedule: pass ", i, " runs microbatch ", m, "'s backward a second time");
      backward[m] = true;
    }
  }
}

PipelineSchedule PipelineSchedule::one_f_one_b(std::int64_t microbatches, std::int64_t warmup) {
  SG_CHECK(microbatches > 0, "one_f_one_b: microbatches must be positive, got ", microbatches);
  SG_CHECK(warmup >= 0, "one_f_one_b: warmup must be >= 0, got ", warmup);
  warmup = std::min(warmup, microbatches - 1);
  std::vector<PipelinePass> passes;
  std::int64_t next_forward = 0;
  std::int64_t next_backward = 0;
  for (; next_forward <= warmup; ++next_forward) passes.push_back({PipelinePass::Kind::kForward, next_forward});
  while (next_backward < microbatches) {
    passes.push_back({PipelinePass::Kind::kBackward, next_backward++});
    if (next_forward < microbatches) passes.push_back({PipelinePass::Kind::kForward, next_forward++});
  }
  return PipelineSchedule(std::move(passes));
}

PipelineSchedule PipelineSchedule::all_forward_all_backward(std::int64_t microbatches) {
  SG_CHECK(microbatches > 0, "all_forward_all_backward: microbatches must be positive, got ", microbatches);
  std::vector<PipelinePass> passes;
  for (std::int64_t m = 0; m < microbatches; ++m) passes.push_back({PipelinePass::Kind::kForward, m});
  for (std::int64_t m = 0; m < microbatches; ++m) passes.push_back({PipelinePass::Kind::kBackward, m});
  return PipelineSchedule(std::move(passes));
}

PipelineSchedule PipelineSchedule::from_signed(const std::vector<std::int64_t>& order) {
  std::vector<PipelinePass> passes;
  for (std::size_t i = 0; i < order.size(); ++i) {
    SG_CHECK(order[i] != 0 && order[i] != std::numeric_limits<std::int64_t>::min(), "pipeline order: entry ", i,
             " is ", order[i], "; +m runs microbatch m's forward and -m its backward, counting from 1");
    passes.push_back({order[i] > 0 ? PipelinePass::Kind::kForward : PipelinePass::Kind::kBackward,
                      (order[i] > 0 ? order[i] : -order[i]) - 1});
  }
  return PipelineSchedule(std::move(passes));
}

std::string PipelineSchedule::to_string() const {
  std::string out;
  for (const PipelinePass& pass : passes_) out += (out.empty() ? "" : " ") + pass.to_string();
  return out;
}

}  // namespace stepgraph

namespace stepgraph {

std::string ChunkPass::to_string() const { return "c" + std::to_string(chunk) + pass.to_string(); }

InterleavedSchedule::InterleavedSchedule(std::vector<ChunkPass> passes, int chunks)
    : passes_(std::move(passes)), chunks_(chunks) {
  SG_CHECK(chunks_ >= 1, "interleaved schedule: chunks must be >= 1, got ", chunks_);
  SG_CHECK(passes_.size() % static_cast<std::size_t>(2 * chunks_) == 0, "interleaved schedule: ", passes_.size(),
           " passes cannot run a forward and a backward of every microbatch on each of ", chunks_, " chunks");
  for (std::size_t i = 0; i < passes_.size(); ++i) {
    SG_CHECK(passes_[i].chunk >= 0 && passes_[i].chunk < chunks_, "interleaved schedule: pass ", i, " (",
             passes_[i].to_string(), ") names chunk ", passes_[i].chunk, ", outside [0, ", chunks_, ")");
  }
  microbatches_ = static_cast<std::int64_t>(passes_.size()) / (2 * chunks_);
  for (int c = 0; c < chunks_; ++c) {
    const PipelineSchedule one = chunk_schedule(c);  // checks the chunk's passes
    SG_CHECK(one.microbatches() == microbatches_, "interleaved schedule: chunk ", c, " runs ", one.microbatches(),
             " microbatch(es) but the schedule has ", microbatches_, " per chunk; give every chunk the same number");
  }
}

PipelineSchedule InterleavedSchedule::chunk_schedule(int chunk) const {
  std::vector<PipelinePass> mine;
  for (const ChunkPass& p : passes_) {
    if (p.chunk == chunk) mine.push_back(p.pass);
  }
  SG_CHECK(!mine.empty(), "interleaved schedule: chunk ", chunk, " runs no pass (", to_string(), ")");
  return PipelineSchedule(std::move(mine));
}

InterleavedSchedule InterleavedSchedule::interleaved_one_f_one_b(std::int64_t microbatches, int stages, int stage,
                                                                 int chunks) {
  SG_CHECK(stages >= 1 && stage >= 0 && stage < stages, "interleaved_one_f_one_b: stage ", stage, " is outside [0, ",
           stages, ")");
  SG_CHECK(chunks >= 1, "interleaved_one_f_one_b: chunks must be >= 1, got ", chunks);
  SG_CHECK(microbatches > 0 && microbatches % stages == 0, "interleaved_one_f_one_b: microbatches (", microbatches,
           ") must be a positive multiple of the stages (", stages,
           "): forwards run in groups of one microbatch per stage");
  const std::int64_t p = stages;
  const std::int64_t v = chunks;
  const std::int64_t total = microbatches * v;
  // Megatron: with as many microbatches as stages, every forward first (the
  // 1F1B warmup would otherwise wait on a backward no stage can start yet).
  const std::int64_t warmup =
      microbatches == p ? total : std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  // The k-th forward (backward) of this rank: its chunk and microbatch.
  auto nth = [&](std::int64_t k, PipelinePass::Kind kind) {
    const std::int64_t in_group = k % (p * v);
    std::int64_t chunk = in_group / p;
    if (kind == PipelinePass::Kind::kBackward) chunk = v - 1 - chunk;
    return ChunkPass{static_cast<int>(chunk), {kind, (k / (p * v)) * p + in_group % p}};
  };
  std::vector<ChunkPass> passes;
  for (std::int64_t k = 0; k < warmup; ++k) passes.push_back(nth(k, PipelinePass::Kind::kForward));
  for (std::int64_t i = 0; i < total - warmup; ++i) {
    passes.push_back(nth(warmup + i, PipelinePass::Kind::kForward));
    passes.push_back(nth(i, PipelinePass::Kind::kBackward));
  }
  for (std::int64_t i = total - warmup; i < total; ++i) passes.push_back(nth(i, PipelinePass::Kind::kBackward));
  return InterleavedSchedule(std::move(passes), chunks);
}

InterleavedSchedule InterleavedSchedule::from_chunk_signed(const std::vector<std::int64_t>& order, int chunks) {
  SG_CHECK(chunks >= 1, "from_chunk_signed: chunks must be >= 1, got ", chunks);
  std::vector<std::int64_t> forwards(static_cast<std::size_t>(chunks), 0), backwards(forwards);
  std::vector<ChunkPass> passes;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::int64_t c = order[i] > 0 ? order[i] : -order[i];
    SG_CHECK(order[i] != 0 && order[i] != std::numeric_limits<std::int64_t>::min() && c <= chunks,
             "interleaved pipeline order: entry ", i, " is ", order[i], "; +c runs chunk c's next forward and -c its",
             " next backward, c in [1, ", chunks, "]");
    const auto chunk = static_cast<std::size_t>(c - 1);
    const bool forward = order[i] > 0;
    std::int64_t& count = forward ? forwards[chunk] : backwards[chunk];
    passes.push_back({static_cast<int>(chunk),
                      {forward ? PipelinePass::Kind::kForward : PipelinePass::Kind::kBackward, count++}});
  }
  return InterleavedSchedule(std::move(passes), chunks);
}

std::vector<std::int64_t> InterleavedSchedule::to_chunk_signed() const {
  std::vector<std::int64_t> forwards(static_cast<std::size_t>(chunks_), 0), backwards(forwards);
  std::vector<std::int64_t> order;
  for (const ChunkPass& p : passes_) {
    const bool forward = p.pass.kind == PipelinePass::Kind::kForward;
    std::int64_t& count = forward ? forwards[static_cast<std::size_t>(p.chunk)]
                                  : backwards[static_cast<std::size_t>(p.chunk)];
    SG_CHECK(p.pass.microbatch == count++, "to_chunk_signed: ", p.to_string(), " runs out of microbatch order (",
             to_string(), "); the signed form of chunks can only say microbatch order");
    order.push_back(forward ? p.chunk + 1 : -(p.chunk + 1));
  }
  return order;
}

std::string InterleavedSchedule::to_string() const {
  std::string out;
  for (const ChunkPass& pass : passes_) out += (out.empty() ? "" : " ") + pass.to_string();
  return out;
}

}  // namespace stepgraph
