// The point-to-point traffic of pipeline stages on ranks, derived from each
// stage's schedule, and the check that the stages' schedules fit together:
// every send meets its receive, for the same microbatch, without deadlock.
//
//   std::vector<PipelineSchedule> stages = {PipelineSchedule::one_f_one_b(4, 1),
//                                           PipelineSchedule::one_f_one_b(4, 0)};
//   check_stage_schedules(stages);  // an Error naming the stuck or mismatched transfer
//
// StagePipeline (stage_pipeline.h) issues exactly the groups stage_transfers()
// lists; see Note [Pipeline stages across ranks] there for why 1F1B passes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/pipeline_schedule.h"

namespace stepgraph {

// One send or receive of a stage. `what` names the tensor: F m is
// microbatch m's activation (forward), B m its gradient (backward).
struct StageTransfer {
  enum class Kind : std::uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = 0;
  PipelinePass what;

  std::string to_string() const;  // "send F2 to stage 1", "recv B0 from stage 3"
};

// The transfers a stage issues together (one NCCL group: they complete
// together, in any order between them). Before pass 0 a stage receives its
// input; after pass i it sends pass i's output together with receiving pass
// i + 1's input. Empty groups are left out.
using StageTransferGroup = std::vector<StageTransfer>;

// Stage `stage` of `stages`' groups, in the order it issues them.
std::vector<StageTransferGroup> stage_transfers(const PipelineSchedule& schedule, int stage, int stages);

// An Error (kInvalidState) unless the stages' schedules (one per stage, in
// stage order, the same number of microbatches) run to the end when every
// group waits until each of its transfers' partners is posted in the
// partner's current group (NCCL's rendezvous, the strictest case), and each
// send meets the receive of the same tensor. The message names the first
// mismatch or, for a deadlock, what every stuck stage waits for.
void check_stage_schedules(const std::vector<PipelineSchedule>& stages);

}  // namespace stepgraph
