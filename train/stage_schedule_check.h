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

#include <cstddef>
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
  // Interleaved stages: the tensor crosses from the model's chunk `boundary`
  // to chunk boundary + 1 (an activation) or back (a gradient); -1 where
  // each stage holds one chunk.
  int boundary = -1;

  // "send F2 to stage 1", "recv B0 from stage 3"; interleaved
  // "send F2 (chunk 1|2) to stage 1".
  std::string to_string() const;
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

// Interleaved stages (V chunks a rank; see Note [Interleaved transfer groups]).
// Stage `stage`'s groups in the order it issues them, and where: group i
// right before pass issued_before[i] (passes().size(): after the last pass).
struct InterleavedTransfers {
  std::vector<StageTransferGroup> groups;
  std::vector<std::size_t> issued_before;
};
InterleavedTransfers interleaved_transfer_plan(const InterleavedSchedule& schedule, int stage, int stages);
// Its groups alone.
std::vector<StageTransferGroup> interleaved_stage_transfers(const InterleavedSchedule& schedule, int stage,
                                                            int stages);
// check_stage_schedules for interleaved stages: one schedule per stage, the
// same chunks and microbatches, simulated over interleaved_stage_transfers.
void check_interleaved_stage_schedules(const std::vector<InterleavedSchedule>& stages);

// Note [Interleaved transfer groups]
// With V > 1 chunks a rank, the one-chunk grouping (after pass i, send its
// output and receive pass i + 1's input) deadlocks Megatron's interleaved
// 1F1B under the rendezvous (P = 2, V = 2, M = 4: stage 0 waits to send
// stage 1 a gradient alone, while stage 1 waits to send stage 0 a gradient
// together with receiving a forward that stage 0 issues only later). So the
// groups follow Megatron's
// (send_forward_backward_recv_forward_backward): the passes are cut into
// units, a warmup forward alone, then in the steady state a forward and the
// backward right after it together, then the cooldown backwards alone; no
// unit pairs passes where every forward comes before every backward.
// Between two units Megatron issues one group of up to four transfers (the
// sends of the unit before, the receives of the unit after); we issue it as
// two groups of at most one send and one receive each (a send_recv op each):
// the forward group (send the activation, receive the next forward's
// input), then the backward group. Issuing the backward group first
// deadlocks (P = 8, V = 3 among others); forward first, the check passes
// for P in {2, 3, 4, 8}, V in {1, 2, 3} and M in {P, 2P, 4P} (the
// interleaved test). Under 1F1B's alternation the one-chunk grouping of
// V = 1 pairs up already; StagePipeline keeps it there.

}  // namespace stepgraph
