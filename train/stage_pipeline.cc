#include "train/stage_pipeline.h"

#include <sstream>
#include <utility>

#include "engine/error.h"
#include "ops/collective_ops.h"
#include "train/stage_schedule_check.h"

namespace stepgraph {

namespace {

std::vector<AnyLayer*> share_of(const std::vector<AnyLayer*>& layers, StagePipeline::LayerRange range) {
  return {layers.begin() + static_cast<std::ptrdiff_t>(range.first),
          layers.begin() + static_cast<std::ptrdiff_t>(range.last)};
}

PipelineSchedule schedule_for(const StagePipelineOptions& options, std::int64_t microbatches, int stage, int stages) {
  if (options.schedule) return *options.schedule;
  return PipelineSchedule::one_f_one_b(microbatches, stages - 1 - stage);
}

std::string describe(const TensorMeta& meta) {
  return meta.shape.to_string() + " " + std::string(dtype_name(meta.dtype));
}

// What the stages exchange: a line every stage must share, then the signed order.
std::string encode(std::size_t layers, std::int64_t microbatches, const TensorMeta& activation,
                   const PipelineSchedule& schedule) {
  std::string text = "layers " + std::to_string(layers) + ", microbatches " + std::to_string(microbatches) +
                     ", activations " + describe(activation) + "\n";
  for (const PipelinePass& pass : schedule.passes()) {
    const std::int64_t one_based = pass.microbatch + 1;
    text += std::to_string(pass.kind == PipelinePass::Kind::kForward ? one_based : -one_based) + " ";
  }
  return text;
}

std::pair<std::string, PipelineSchedule> decode(const std::string& text) {
  const std::size_t newline = text.find('\n');
  SG_CHECK_CODE(newline != std::string::npos, ErrorCode::kInternal, "StagePipeline: a malformed schedule message");
  std::istringstream order(text.substr(newline + 1));
  std::vector<std::int64_t> signed_order;
  for (std::int64_t value = 0; order >> value;) signed_order.push_back(value);
  return {text.substr(0, newline), PipelineSchedule::from_signed(signed_order)};
}

}  // namespace

StagePipeline::LayerRange StagePipeline::stage_layers(std::size_t layer_count, int stage, int stages) {
  SG_CHECK(stages >= 1 && stage >= 0 && stage < stages, "StagePipeline: stage ", stage, " is outside [0, ", stages,
           ")");
  const auto p = static_cast<std::size_t>(stages);
  SG_CHECK(layer_count >= p && layer_count % p == 0, "StagePipeline: ", layer_count,
           " layer(s) cannot be split evenly into ", stages,
           " pipeline stages (one per rank of the communicator); give a number of layers divisible by the stages");
  const std::size_t per_stage = layer_count / p;
  const auto s = static_cast<std::size_t>(stage);
  return {s * per_stage, (s + 1) * per_stage};
}

StagePipeline::StagePipeline(Context& ctx, Communicator& comm, const std::vector<AnyLayer*>& layers,
                             std::int64_t microbatches, TensorMeta activation, const StagePipelineOptions& options)
    : comm_(comm),
      data_parallel_(options.data_parallel),
      stage_(comm.rank()),
      stages_(comm.world_size()),
      range_(stage_layers(layers.size(), comm.rank(), comm.world_size())),
      activation_(std::move(activation)),
      schedule_(schedule_for(options, microbatches, comm.rank(), comm.world_size())),
      pipeline_(ctx, share_of(layers, range_), microbatches, options.pipeline) {
  SG_CHECK(schedule_.microbatches() == microbatches, "StagePipeline: the schedule (", schedule_.to_string(), ") runs ",
           schedule_.microbatches(), " microbatch(es), but microbatches is ", microbatches);
  // See Note [Pipeline stages across ranks]: every rank checks every stage's
  // schedule, so all raise the same Error.
  const std::string mine = encode(layers.size(), microbatches, activation_, schedule_);
  const std::vector<std::string> all = comm_.exchange(mine, "pipeline stage schedules");
  const std::string first = decode(all.at(0)).first;
  std::vector<PipelineSchedule> schedules;
  for (int s = 0; s < stages_; ++s) {
    auto [line, schedule] = decode(all.at(static_cast<std::size_t>(s)));
    SG_CHECK_CODE(line == first, ErrorCode::kInvalidState, "StagePipeline on ", comm_.describe(), ": stage 0 has ",
                  first, " but stage ", s, " has ", line,
                  "; every stage must pass the same model layers, microbatches and activation");
    schedules.push_back(std::move(schedule));
  }
  check_stage_schedules(schedules);
  if (data_parallel_ != nullptr) {
    data_parallel_->check_device(ctx.device(), "StagePipeline (data parallel)");
    // Every replica's rank here must run the same stage of the same model.
    const std::string stage_line = "stage " + std::to_string(stage_) + " of " + std::to_string(stages_) + ", " + first;
    const std::vector<std::string> replicas = data_parallel_->exchange(stage_line, "pipeline stages of the replicas");
    for (std::size_t d = 0; d < replicas.size(); ++d) {
      SG_CHECK_CODE(replicas[d] == replicas[0], ErrorCode::kInvalidState, "StagePipeline: the data-parallel group '",
                    data_parallel_->name(), "' of ", replicas.size(), " ranks holds ", replicas[0],
                    " on its rank 0 but ", replicas[d], " on its rank ", d,
                    "; options.data_parallel must group the same stage of every replica (split the world by stage)");
    }
  }
}

void StagePipeline::reduce_over_replicas(Context& ctx) {
  // One all_reduce_many_ per dtype, in the order each dtype first appears.
  const std::vector<Tensor>& sums = pipeline_.gradient_sums();
  std::vector<bool> done(sums.size(), false);
  for (std::size_t i = 0; i < sums.size(); ++i) {
    if (done[i]) continue;
    std::vector<Tensor> bucket;
    for (std::size_t j = i; j < sums.size(); ++j) {
      if (done[j] || sums[j].dtype() != sums[i].dtype()) continue;
      bucket.push_back(sums[j]);
      done[j] = true;
    }
    ctx.begin_segment("gradient sums all-reduce (" + std::string(dtype_name(sums[i].dtype())) + ")");
    ops::all_reduce_many_(ctx, *data_parallel_, bucket, ReduceOp::kSum);
  }
}

void StagePipeline::check_next(const PipelinePass& pass) {
  SG_CHECK_CODE(schedule_.passes()[next_] == pass, ErrorCode::kInvalidState, "StagePipeline (stage ", stage_, " of ",
                stages_, "): ", pass.to_string(), " is not the schedule's next pass, ", next_pass(), " (schedule ",
                schedule_.to_string(), "); the other stages send and receive in that order");
}

Tensor StagePipeline::take_input(Context& ctx, const PipelinePass& pass) {
  const bool forward = pass.kind == PipelinePass::Kind::kForward;
  const int peer = forward ? stage_ - 1 : stage_ + 1;
  if (next_ == 0 && !received_.defined()) {
    ctx.begin_segment(pass.to_string() + " recv");
    received_ = ops::recv(ctx, comm_, activation_, peer);
  }
  SG_CHECK_CODE(received_.defined(), ErrorCode::kInternal, "StagePipeline: ", pass.to_string(),
                "'s input was not received");
  return std::exchange(received_, Tensor{});
}

void StagePipeline::finish_pass(Context& ctx, const PipelinePass& pass, const Tensor& out) {
  const std::vector<PipelinePass>& passes = schedule_.passes();
  const std::size_t following = (next_ + 1) % passes.size();
  std::optional<int> from;  // where the following pass's input comes from, if a peer
  if (following != 0) {
    const PipelinePass& after = passes[following];
    const int peer = after.kind == PipelinePass::Kind::kForward ? stage_ - 1 : stage_ + 1;
    if (peer >= 0 && peer < stages_) from = peer;
  }
  if (out.defined() || from) {
    std::string name = pass.to_string();
    name += out.defined() ? " send" : "";
    if (from) name += (out.defined() ? ", " : " ") + passes[following].to_string() + " recv";
    ctx.begin_segment(std::move(name));
  }
  if (out.defined()) {
    SG_CHECK(out.meta() == activation_, "StagePipeline (stage ", stage_, "): ", pass.to_string(), "'s output is ",
             describe(out.meta()), " but the activations between stages are ", describe(activation_),
             "; every stage's input and output must have the activation's shape and dtype");
    const int to = pass.kind == PipelinePass::Kind::kForward ? stage_ + 1 : stage_ - 1;
    // One group: see Note [Pipeline stages across ranks].
    if (from) received_ = ops::send_recv(ctx, comm_, out, to, *from);
    else ops::send(ctx, comm_, out, to);
  } else if (from) {
    received_ = ops::recv(ctx, comm_, activation_, *from);
  }
  next_ = following;
}

Tensor StagePipeline::forward(Context& ctx, std::int64_t m, const Tensor& x) {
  const PipelinePass pass{PipelinePass::Kind::kForward, m};
  check_next(pass);
  Tensor input;
  if (is_first()) {
    SG_CHECK(x.defined(), "StagePipeline forward: stage 0 needs microbatch ", m, "'s input x");
    input = x;
  } else {
    SG_CHECK(!x.defined(), "StagePipeline forward: stage ", stage_, " receives microbatch ", m,
             "'s input from stage ", stage_ - 1, "; pass no x");
    input = take_input(ctx, pass);
  }
  Tensor y = pipeline_.forward(ctx, m, input);
  if (is_last()) {
    finish_pass(ctx, pass, Tensor{});
    return y;
  }
  finish_pass(ctx, pass, y);
  return Tensor{};
}

Tensor StagePipeline::backward(Context& ctx, std::int64_t m, const Tensor& dy) {
  const PipelinePass pass{PipelinePass::Kind::kBackward, m};
  check_next(pass);
  Tensor grad;
  if (is_last()) {
    SG_CHECK(dy.defined(), "StagePipeline backward: the last stage (", stage_, ") needs microbatch ", m,
             "'s output gradient dy");
    grad = dy;
  } else {
    SG_CHECK(!dy.defined(), "StagePipeline backward: stage ", stage_, " receives microbatch ", m,
             "'s output gradient from stage ", stage_ + 1, "; pass no dy");
    grad = take_input(ctx, pass);
  }
  Tensor dx = pipeline_.backward(ctx, m, grad);
  if (!is_first()) {
    SG_CHECK(dx.defined(), "StagePipeline backward: stage ", stage_,
             "'s first layer computes no input gradient, but stage ", stage_ - 1,
             " needs one; only the model's first layer may skip dgrad");
  }
  finish_pass(ctx, pass, is_first() ? Tensor{} : dx);
  // See Note [Pipeline stages across ranks]: the replicas' sums meet after the last pass.
  if (next_ == 0 && data_parallel_ != nullptr) reduce_over_replicas(ctx);
  return is_first() ? dx : Tensor{};
}

}  // namespace stepgraph
