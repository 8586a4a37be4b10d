#include "train/stage_schedule_check.h"

#include <cstddef>
#include <optional>

#include "engine/error.h"

namespace stepgraph {

std::string StageTransfer::to_string() const {
  return kind == Kind::kSend ? "send " + what.to_string() + " to stage " + std::to_string(peer)
                             : "recv " + what.to_string() + " from stage " + std::to_string(peer);
}

namespace {

// Where pass `pass` of stage `stage` gets its input: F m from the previous
// stage, B m from the next; none on the first stage's forwards and the last
// stage's backwards (the caller's x and dy).
std::optional<StageTransfer> input_of(const PipelinePass& pass, int stage, int stages) {
  const bool forward = pass.kind == PipelinePass::Kind::kForward;
  const int peer = forward ? stage - 1 : stage + 1;
  if (peer < 0 || peer >= stages) return std::nullopt;
  return StageTransfer{StageTransfer::Kind::kRecv, peer, pass};
}

// Where its output goes: F m's activation to the next stage, B m's input
// gradient to the previous one.
std::optional<StageTransfer> output_of(const PipelinePass& pass, int stage, int stages) {
  const bool forward = pass.kind == PipelinePass::Kind::kForward;
  const int peer = forward ? stage + 1 : stage - 1;
  if (peer < 0 || peer >= stages) return std::nullopt;
  return StageTransfer{StageTransfer::Kind::kSend, peer, pass};
}

std::string describe(const StageTransferGroup& group, const std::vector<bool>& matched) {
  std::string text;
  for (std::size_t k = 0; k < group.size(); ++k) {
    if (matched[k]) continue;
    if (!text.empty()) text += " and ";
    text += group[k].to_string();
  }
  return text;
}

}  // namespace

std::vector<StageTransferGroup> stage_transfers(const PipelineSchedule& schedule, int stage, int stages) {
  SG_CHECK(stages >= 1 && stage >= 0 && stage < stages, "stage_transfers: stage ", stage, " is outside [0, ", stages,
           ")");
  const std::vector<PipelinePass>& passes = schedule.passes();
  std::vector<StageTransferGroup> groups;
  auto add = [&](std::optional<StageTransfer> a, std::optional<StageTransfer> b) {
    StageTransferGroup group;
    if (a) group.push_back(*a);
    if (b) group.push_back(*b);
    if (!group.empty()) groups.push_back(std::move(group));
  };
  if (!passes.empty()) add(std::nullopt, input_of(passes.front(), stage, stages));
  for (std::size_t i = 0; i < passes.size(); ++i) {
    add(output_of(passes[i], stage, stages),
        i + 1 < passes.size() ? input_of(passes[i + 1], stage, stages) : std::nullopt);
  }
  return groups;
}

void check_stage_schedules(const std::vector<PipelineSchedule>& stages) {
  const int n = static_cast<int>(stages.size());
  SG_CHECK(n >= 1, "check_stage_schedules: no stages");
  for (int s = 1; s < n; ++s) {
    SG_CHECK_CODE(stages[s].microbatches() == stages[0].microbatches(), ErrorCode::kInvalidState,
                  "pipeline stages disagree on the microbatches: stage 0 runs ", stages[0].microbatches(),
                  " and stage ", s, " runs ", stages[s].microbatches(), "; give every stage the same number");
  }
  std::vector<std::vector<StageTransferGroup>> groups;
  for (int s = 0; s < n; ++s) groups.push_back(stage_transfers(stages[s], s, n));
  std::vector<std::size_t> next(n, 0);                   // each stage's current group
  std::vector<std::vector<bool>> matched(n);             // per transfer of the current group
  auto current = [&](int s) -> const StageTransferGroup* {
    return next[s] < groups[s].size() ? &groups[s][next[s]] : nullptr;
  };
  for (int s = 0; s < n; ++s) matched[s].assign(current(s) ? current(s)->size() : 0, false);

  for (;;) {
    bool progress = false;
    // Pair every posted send with its posted receive.
    for (int s = 0; s < n; ++s) {
      const StageTransferGroup* group = current(s);
      if (group == nullptr) continue;
      for (std::size_t k = 0; k < group->size(); ++k) {
        const StageTransfer& send = (*group)[k];
        if (matched[s][k] || send.kind != StageTransfer::Kind::kSend) continue;
        const StageTransferGroup* other = current(send.peer);
        if (other == nullptr) continue;
        for (std::size_t j = 0; j < other->size(); ++j) {
          const StageTransfer& recv = (*other)[j];
          if (matched[send.peer][j] || recv.kind != StageTransfer::Kind::kRecv || recv.peer != s) continue;
          SG_CHECK_CODE(recv.what == send.what, ErrorCode::kInvalidState, "pipeline stage schedules do not match: stage ",
                        s, " sends ", send.what.to_string(), " to stage ", send.peer, " (schedule ",
                        stages[s].to_string(), ") where stage ", send.peer, " receives ", recv.what.to_string(),
                        " (schedule ", stages[send.peer].to_string(),
                        "); give stage s of P PipelineSchedule::one_f_one_b(M, P - 1 - s)");
          matched[s][k] = matched[send.peer][j] = true;
          progress = true;
          break;
        }
      }
    }
    // A group whose transfers all met is done: the stage issues its next.
    bool finished = true;
    for (int s = 0; s < n; ++s) {
      const StageTransferGroup* group = current(s);
      if (group == nullptr) continue;
      bool all = true;
      for (const bool m : matched[s]) all = all && m;
      if (all) {
        ++next[s];
        matched[s].assign(current(s) ? current(s)->size() : 0, false);
        progress = true;
      }
      finished = finished && current(s) == nullptr;
    }
    if (finished) return;
    if (!progress) {
      std::string stuck;
      for (int s = 0; s < n; ++s) {
        if (current(s) == nullptr) continue;
        stuck += "; stage " + std::to_string(s) + " (" + stages[s].to_string() + ") waits to " +
                 describe(*current(s), matched[s]);
      }
      SG_THROW(ErrorCode::kInvalidState, "pipeline stage schedules deadlock: every stage waits for another", stuck,
               "; give stage s of P PipelineSchedule::one_f_one_b(M, P - 1 - s)");
    }
  }
}

}  // namespace stepgraph
