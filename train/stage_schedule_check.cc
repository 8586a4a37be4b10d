#include "train/stage_schedule_check.h"

#include <cstddef>
#include <optional>
#include <utility>

#include "engine/error.h"

namespace stepgraph {

namespace {

// The tensor a transfer carries: "F2", interleaved "F2 (chunk 1|2)".
std::string tensor_name(const StageTransfer& t) {
  std::string name = t.what.to_string();
  if (t.boundary >= 0) name += " (chunk " + std::to_string(t.boundary) + "|" + std::to_string(t.boundary + 1) + ")";
  return name;
}

}  // namespace

std::string StageTransfer::to_string() const {
  const std::string tensor = tensor_name(*this);
  return kind == Kind::kSend ? "send " + tensor + " to stage " + std::to_string(peer)
                             : "recv " + tensor + " from stage " + std::to_string(peer);
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

namespace {

// Runs the stages' groups under NCCL's rendezvous (see check_stage_schedules);
// `orders` prints each stage's schedule, `hint` ends every Error.
void simulate(const std::vector<std::vector<StageTransferGroup>>& groups, const std::vector<std::string>& orders,
              const std::string& hint) {
  const int n = static_cast<int>(groups.size());
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
          SG_CHECK_CODE(recv.what == send.what && recv.boundary == send.boundary, ErrorCode::kInvalidState,
                        "pipeline stage schedules do not match: stage ", s, " sends ", tensor_name(send), " to stage ",
                        send.peer, " (schedule ", orders[s], ") where stage ", send.peer, " receives ",
                        tensor_name(recv), " (schedule ", orders[send.peer], "); ", hint);
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
        stuck += "; stage " + std::to_string(s) + " (" + orders[s] + ") waits to " + describe(*current(s), matched[s]);
      }
      SG_THROW(ErrorCode::kInvalidState, "pipeline stage schedules deadlock: every stage waits for another", stuck,
               "; ", hint);
    }
  }
}

}  // namespace

void check_stage_schedules(const std::vector<PipelineSchedule>& stages) {
  const int n = static_cast<int>(stages.size());
  SG_CHECK(n >= 1, "check_stage_schedules: no stages");
  for (int s = 1; s < n; ++s) {
    SG_CHECK_CODE(stages[s].microbatches() == stages[0].microbatches(), ErrorCode::kInvalidState,
                  "pipeline stages disagree on the microbatches: stage 0 runs ", stages[0].microbatches(),
                  " and stage ", s, " runs ", stages[s].microbatches(), "; give every stage the same number");
  }
  std::vector<std::vector<StageTransferGroup>> groups;
  std::vector<std::string> orders;
  for (int s = 0; s < n; ++s) {
    groups.push_back(stage_transfers(stages[s], s, n));
    orders.push_back(stages[s].to_string());
  }
  simulate(groups, orders, "give stage s of P PipelineSchedule::one_f_one_b(M, P - 1 - s)");
}

namespace {

// Where chunk pass `p` of stage `stage` gets its input and sends its output
// (the model's chunk g = chunk * P + stage; see Note [Interleaved transfer groups]).
std::optional<StageTransfer> chunk_input(const ChunkPass& p, int stage, int stages, int chunks) {
  const int g = p.chunk * stages + stage;
  const int last = stages * chunks - 1;
  if (p.pass.kind == PipelinePass::Kind::kForward) {
    if (g == 0) return std::nullopt;
    return StageTransfer{StageTransfer::Kind::kRecv, (g - 1) % stages, p.pass, g - 1};
  }
  if (g == last) return std::nullopt;
  return StageTransfer{StageTransfer::Kind::kRecv, (g + 1) % stages, p.pass, g};
}

std::optional<StageTransfer> chunk_output(const ChunkPass& p, int stage, int stages, int chunks) {
  const int g = p.chunk * stages + stage;
  const int last = stages * chunks - 1;
  if (p.pass.kind == PipelinePass::Kind::kForward) {
    if (g == last) return std::nullopt;
    return StageTransfer{StageTransfer::Kind::kSend, (g + 1) % stages, p.pass, g};
  }
  if (g == 0) return std::nullopt;
  return StageTransfer{StageTransfer::Kind::kSend, (g - 1) % stages, p.pass, g - 1};
}

}  // namespace

InterleavedTransfers interleaved_transfer_plan(const InterleavedSchedule& schedule, int stage, int stages) {
  SG_CHECK(stages >= 1 && stage >= 0 && stage < stages, "interleaved_transfer_plan: stage ", stage,
           " is outside [0, ", stages, ")");
  const std::vector<ChunkPass>& passes = schedule.passes();
  const int chunks = schedule.chunks();
  const auto is_forward = [&](std::size_t i) { return passes[i].pass.kind == PipelinePass::Kind::kForward; };
  // The units (Note [Interleaved transfer groups]): pass indices [begin, end).
  std::size_t forwards = 0;
  for (std::size_t i = 0; i < passes.size(); ++i) forwards += is_forward(i) ? 1 : 0;
  bool forwards_first = true;
  for (std::size_t i = 0; i < forwards; ++i) forwards_first = forwards_first && is_forward(i);
  std::vector<std::pair<std::size_t, std::size_t>> units;
  for (std::size_t i = 0; i < passes.size();) {
    const bool pair = !forwards_first && i + 1 < passes.size() && is_forward(i) && !is_forward(i + 1);
    const std::size_t end = i + (pair ? 2 : 1);
    units.emplace_back(i, end);
    i = end;
  }
  InterleavedTransfers plan;
  // Between unit `done` and unit `next` (either absent at the ends): the
  // forward group, then the backward group.
  auto add = [&](std::optional<std::size_t> done, std::optional<std::size_t> next) {
    for (const PipelinePass::Kind kind : {PipelinePass::Kind::kForward, PipelinePass::Kind::kBackward}) {
      StageTransferGroup group;
      if (done) {
        for (std::size_t i = units[*done].first; i < units[*done].second; ++i) {
          if (passes[i].pass.kind != kind) continue;
          if (auto t = chunk_output(passes[i], stage, stages, chunks)) group.push_back(*t);
        }
      }
      if (next) {
        for (std::size_t i = units[*next].first; i < units[*next].second; ++i) {
          if (passes[i].pass.kind != kind) continue;
          if (auto t = chunk_input(passes[i], stage, stages, chunks)) group.push_back(*t);
        }
      }
      if (group.empty()) continue;
      plan.groups.push_back(std::move(group));
      plan.issued_before.push_back(next ? units[*next].first : passes.size());
    }
  };
  if (!units.empty()) add(std::nullopt, 0);
  for (std::size_t u = 0; u < units.size(); ++u) {
    add(u, u + 1 < units.size() ? std::optional<std::size_t>(u + 1) : std::nullopt);
  }
  return plan;
}

std::vector<StageTransferGroup> interleaved_stage_transfers(const InterleavedSchedule& schedule, int stage,
                                                            int stages) {
  return interleaved_transfer_plan(schedule, stage, stages).groups;
}

void check_interleaved_stage_schedules(const std::vector<InterleavedSchedule>& stages) {
  const int n = static_cast<int>(stages.size());
  SG_CHECK(n >= 1, "check_interleaved_stage_schedules: no stages");
  for (int s = 1; s < n; ++s) {
    SG_CHECK_CODE(stages[s].chunks() == stages[0].chunks() && stages[s].microbatches() == stages[0].microbatches(),
                  ErrorCode::kInvalidState, "interleaved pipeline stages disagree: stage 0 runs ", stages[0].chunks(),
                  " chunk(s) of ", stages[0].microbatches(), " microbatch(es) and stage ", s, " runs ",
                  stages[s].chunks(), " of ", stages[s].microbatches(),
                  "; give every stage the same chunks and microbatches");
  }
  std::vector<std::vector<StageTransferGroup>> groups;
  std::vector<std::string> orders;
  for (int s = 0; s < n; ++s) {
    groups.push_back(interleaved_stage_transfers(stages[s], s, n));
    orders.push_back(stages[s].to_string());
  }
  simulate(groups, orders,
           "give stage s of P InterleavedSchedule::interleaved_one_f_one_b(M, P, s, V) (M a multiple of P)");
}

}  // namespace stepgraph
