#include "train/interleaved_stage_pipeline.h"

#include <sstream>
#include <utility>

#include "engine/error.h"
#include "ops/collective_ops.h"

namespace stepgraph {

namespace {

std::string describe(const TensorMeta& meta) {
  return meta.shape.to_string() + " " + std::string(dtype_name(meta.dtype));
}

// What the stages exchange: a line every stage must share, then the passes
// as "chunk F|B microbatch" triples (any order, not only the signed form's).
std::string encode(std::size_t layers, int chunks, std::int64_t microbatches, const TensorMeta& activation,
                   const InterleavedSchedule& schedule) {
  std::string text = "layers " + std::to_string(layers) + ", chunks " + std::to_string(chunks) + ", microbatches " +
                     std::to_string(microbatches) + ", activations " + describe(activation) + "\n";
  for (const ChunkPass& p : schedule.passes()) {
    text += std::to_string(p.chunk) + (p.pass.kind == PipelinePass::Kind::kForward ? " F " : " B ") +
            std::to_string(p.pass.microbatch) + " ";
  }
  return text;
}

std::pair<std::string, InterleavedSchedule> decode(const std::string& text, int chunks) {
  const std::size_t newline = text.find('\n');
  SG_CHECK_CODE(newline != std::string::npos, ErrorCode::kInternal,
                "InterleavedStagePipeline: a malformed schedule message");
  std::istringstream in(text.substr(newline + 1));
  std::vector<ChunkPass> passes;
  int chunk = 0;
  std::string kind;
  std::int64_t m = 0;
  while (in >> chunk >> kind >> m) {
    passes.push_back({chunk, {kind == "F" ? PipelinePass::Kind::kForward : PipelinePass::Kind::kBackward, m}});
  }
  return {text.substr(0, newline), InterleavedSchedule(std::move(passes), chunks)};
}

}  // namespace

InterleavedStagePipeline::LayerRange InterleavedStagePipeline::chunk_layers(std::size_t layer_count, int model_chunk,
                                                                            int chunks_total) {
  SG_CHECK(chunks_total >= 1 && model_chunk >= 0 && model_chunk < chunks_total, "InterleavedStagePipeline: chunk ",
           model_chunk, " is outside [0, ", chunks_total, ")");
  const auto n = static_cast<std::size_t>(chunks_total);
  SG_CHECK(layer_count >= n && layer_count % n == 0, "InterleavedStagePipeline: ", layer_count,
           " layer(s) cannot be split evenly into ", chunks_total,
           " chunks (stages x chunks per stage); give a number of layers divisible by them");
  const std::size_t per_chunk = layer_count / n;
  const auto c = static_cast<std::size_t>(model_chunk);
  return {c * per_chunk, (c + 1) * per_chunk};
}

InterleavedStagePipeline::InterleavedStagePipeline(Context& ctx, Communicator& comm,
                                                   const std::vector<AnyLayer*>& layers, int chunks,
                                                   std::int64_t microbatches, TensorMeta activation,
                                                   const InterleavedStagePipelineOptions& options)
    : comm_(comm),
      stage_(comm.rank()),
      stages_(comm.world_size()),
      activation_(std::move(activation)),
      schedule_(options.schedule ? *options.schedule
                                 : InterleavedSchedule::interleaved_one_f_one_b(microbatches, comm.world_size(),
                                                                                comm.rank(), chunks)) {
  SG_CHECK(schedule_.chunks() == chunks && schedule_.microbatches() == microbatches,
           "InterleavedStagePipeline: the schedule (", schedule_.to_string(), ") runs ", schedule_.chunks(),
           " chunk(s) of ", schedule_.microbatches(), " microbatch(es), but chunks is ", chunks,
           " and microbatches is ", microbatches);
  for (int c = 0; c < chunks; ++c) ranges_.push_back(chunk_layers(layers.size(), model_chunk(c), stages_ * chunks));
  // Every rank checks every stage's order, so all raise the same Error
  // (Note [Pipeline stages across ranks] in stage_pipeline.h).
  const std::string mine = encode(layers.size(), chunks, microbatches, activation_, schedule_);
  const std::vector<std::string> all = comm_.exchange(mine, "interleaved pipeline stage schedules");
  const std::string first = all.at(0).substr(0, all.at(0).find('\n'));
  std::vector<InterleavedSchedule> schedules;
  for (int s = 0; s < stages_; ++s) {
    const std::string& message = all.at(static_cast<std::size_t>(s));
    const std::string line = message.substr(0, message.find('\n'));
    SG_CHECK_CODE(line == first, ErrorCode::kInvalidState, "InterleavedStagePipeline on ", comm_.describe(),
                  ": stage 0 has ", first, " but stage ", s, " has ", line,
                  "; every stage must pass the same model layers, chunks, microbatches and activation");
    schedules.push_back(decode(message, chunks).second);
  }
  check_interleaved_stage_schedules(schedules);
  plan_ = interleaved_transfer_plan(schedule_, stage_, stages_);
  for (int c = 0; c < chunks; ++c) {
    const LayerRange range = layer_range(c);
    chunks_.push_back(std::make_unique<LayerPipeline>(
        ctx,
        std::vector<AnyLayer*>(layers.begin() + static_cast<std::ptrdiff_t>(range.first),
                               layers.begin() + static_cast<std::ptrdiff_t>(range.last)),
        microbatches, options.pipeline));
    const std::vector<Parameter*>& mine_c = chunks_.back()->parameters();
    parameters_.insert(parameters_.end(), mine_c.begin(), mine_c.end());
  }
}

InterleavedStagePipeline::LayerRange InterleavedStagePipeline::layer_range(int chunk) const {
  SG_CHECK(chunk >= 0 && chunk < chunks(), "InterleavedStagePipeline: chunk ", chunk, " is outside [0, ", chunks(),
           ")");
  return ranges_[static_cast<std::size_t>(chunk)];
}

std::vector<Tensor> InterleavedStagePipeline::gradient_sums() const {
  std::vector<Tensor> sums;
  for (const auto& chunk : chunks_) sums.insert(sums.end(), chunk->gradient_sums().begin(), chunk->gradient_sums().end());
  return sums;
}

void InterleavedStagePipeline::check_next(const ChunkPass& pass) {
  SG_CHECK_CODE(schedule_.passes()[next_] == pass, ErrorCode::kInvalidState, "InterleavedStagePipeline (stage ",
                stage_, " of ", stages_, "): ", pass.to_string(), " is not the schedule's next pass, ", next_pass(),
                " (schedule ", schedule_.to_string(), "); the other stages send and receive in that order");
}

void InterleavedStagePipeline::issue_groups(Context& ctx) {
  while (next_group_ < plan_.groups.size() && plan_.issued_before[next_group_] == next_) {
    const StageTransferGroup& group = plan_.groups[next_group_++];
    const StageTransfer* send = nullptr;
    const StageTransfer* recv = nullptr;
    std::string name;
    for (const StageTransfer& t : group) {
      (t.kind == StageTransfer::Kind::kSend ? send : recv) = &t;
      name += (name.empty() ? "" : ", ") + t.to_string();
    }
    // This stage's chunk the tensor belongs to: a forward's output and a
    // backward's input sit at the boundary after the chunk, the others before.
    auto key = [&](const StageTransfer& t) {
      const bool forward = t.what.kind == PipelinePass::Kind::kForward;
      const bool after = (t.kind == StageTransfer::Kind::kSend) == forward;
      const int g = t.boundary + (after ? 0 : 1);
      return Key{g / stages_, t.what.kind, t.what.microbatch};
    };
    ctx.begin_segment(std::move(name));
    Tensor out;
    if (send != nullptr) {
      auto it = outputs_.find(key(*send));
      SG_CHECK_CODE(it != outputs_.end(), ErrorCode::kInternal, "InterleavedStagePipeline: ", send->to_string(),
                    " has no output to send");
      out = std::move(it->second);
      outputs_.erase(it);
    }
    // One group: see Note [Interleaved transfer groups].
    if (send != nullptr && recv != nullptr) received_[key(*recv)] = ops::send_recv(ctx, comm_, out, send->peer, recv->peer);
    else if (send != nullptr) ops::send(ctx, comm_, out, send->peer);
    else if (recv != nullptr) received_[key(*recv)] = ops::recv(ctx, comm_, activation_, recv->peer);
  }
}

Tensor InterleavedStagePipeline::run(Context& ctx, const ChunkPass& pass, const Tensor& given) {
  check_next(pass);
  issue_groups(ctx);
  const bool forward = pass.pass.kind == PipelinePass::Kind::kForward;
  const bool from_caller = forward ? takes_model_input(pass.chunk) : takes_model_gradient(pass.chunk);
  const bool to_caller = forward ? takes_model_gradient(pass.chunk) : takes_model_input(pass.chunk);
  const char* what = forward ? "input x" : "output gradient dy";
  Tensor input;
  if (from_caller) {
    SG_CHECK(given.defined(), "InterleavedStagePipeline: ", pass.to_string(), " on stage ", stage_,
             " is the model's ", forward ? "first" : "last", " chunk and needs microbatch ", pass.pass.microbatch,
             "'s ", what);
    input = given;
  } else {
    SG_CHECK(!given.defined(), "InterleavedStagePipeline: ", pass.to_string(), " on stage ", stage_,
             " receives microbatch ", pass.pass.microbatch, "'s ", what, " from another chunk; pass none");
    auto it = received_.find(Key{pass.chunk, pass.pass.kind, pass.pass.microbatch});
    SG_CHECK_CODE(it != received_.end(), ErrorCode::kInternal, "InterleavedStagePipeline: ", pass.to_string(),
                  "'s input was not received");
    input = std::move(it->second);
    received_.erase(it);
  }
  LayerPipeline& chunk = *chunks_[static_cast<std::size_t>(pass.chunk)];
  Tensor out = forward ? chunk.forward(ctx, pass.pass.microbatch, input) : chunk.backward(ctx, pass.pass.microbatch, input);
  Tensor result;
  if (to_caller) {
    result = out;
  } else {
    SG_CHECK(out.defined() && out.meta() == activation_, "InterleavedStagePipeline (stage ", stage_, "): ",
             pass.to_string(), "'s output is ", out.defined() ? describe(out.meta()) : std::string("missing"),
             " but the tensors between chunks are ", describe(activation_),
             "; every chunk's input and output (and input gradient) must have the activation's shape and dtype");
    outputs_[Key{pass.chunk, pass.pass.kind, pass.pass.microbatch}] = out;
  }
  ++next_;
  if (next_ == schedule_.passes().size()) {
    issue_groups(ctx);  // the last unit's sends
    next_ = 0;
    next_group_ = 0;
  }
  return result;
}

Tensor InterleavedStagePipeline::forward(Context& ctx, int chunk, std::int64_t m, const Tensor& x) {
  return run(ctx, ChunkPass{chunk, {PipelinePass::Kind::kForward, m}}, x);
}

Tensor InterleavedStagePipeline::backward(Context& ctx, int chunk, std::int64_t m, const Tensor& dy) {
  return run(ctx, ChunkPass{chunk, {PipelinePass::Kind::kBackward, m}}, dy);
}

}  // namespace stepgraph
