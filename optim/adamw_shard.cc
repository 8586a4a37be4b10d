// AdamW's ZeRO-1 mode (AdamW::shard).
//
// Note [Sharded AdamW]
// With N data-parallel ranks, each parameter group's gradients are packed
// end to end into one bucket (padded to N equal shards of a multiple of 64
// elements), reduce-scattered so that rank r holds the sum of shard r, and
// rank r runs the AdamW update over shard r alone: its fp32 master weights,
// moments m and v exist for that shard only (1/N of the optimizer's memory;
// the per-parameter moments are released). The updated weights of every
// shard (the bf16 copy, or the fp32 master of an fp32 model) are then
// all-gathered and unpacked into each parameter's value, which is what the
// layers read. The update of an element depends on that element alone, so
// where the reduce-scatter adds in the same order as the all-reduce (the
// host's collectives add in rank order) the result equals plain data
// parallelism bit for bit; padding elements stay zero (zero gradient, zero
// moments, zero weight). The full fp32 masters of a bf16 model are no longer
// updated: only the shards are (Parameter::master is stale once sharded).
//
// Memory, per element, with N ranks: all-reduce keeps the value, gradient, m
// and v (16 bytes for fp32, plus the bf16 copy); ZeRO-1 keeps the value and
// gradient and 1/N of a gradient shard, master, m and v: 8 + 16 / N bytes for
// an fp32 model, a saving from N = 3 on. A bf16 model still holds its full
// (stale) fp32 masters, and the gradients are not sharded (ZeRO-2): both are
// left for later.
#include <algorithm>
#include <string>
#include <vector>

#include "engine/error.h"
#include "optim/adamw.h"
#include "ops/bucket_ops.h"
#include "ops/collective_ops.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kShardMultiple = 64;  // elements: keeps every shard 256-byte aligned in the bucket

}  // namespace

AdamW::Shard AdamW::make_shard(Context& ctx, std::size_t first, std::size_t count, const std::string& name) const {
  const int n = sharding_->world_size();
  const int rank = sharding_->rank();
  Shard shard;
  shard.name = name;
  shard.first = first;
  shard.count = count;
  std::int64_t total = 0;
  const bool has_copy = parameters_[first]->has_copy();
  for (std::size_t i = first; i < first + count; ++i) {
    const Parameter* p = parameters_[i];
    SG_CHECK(p->has_copy() == has_copy, "AdamW::shard: parameters '", parameters_[first]->name, "' and '", p->name,
             "' of one group differ in dtype; a bucket holds one dtype");
    total += p->master.numel();
    shard.grads.push_back(p->grad);
    shard.values.push_back(p->value);
  }
  const std::int64_t per_rank =
      std::max<std::int64_t>(kShardMultiple, (total + n * kShardMultiple - 1) / (n * kShardMultiple) * kShardMultiple);
  shard.padded = per_rank * n;
  const TensorMeta meta{Shape{per_rank}, DType::kFloat32};
  shard.grad = ctx.persistent(name + ".grad", meta);
  shard.master = ctx.persistent(name + ".master", meta);
  const Tensor m = ctx.persistent(name + ".adam_m", meta);
  const Tensor v = ctx.persistent(name + ".adam_v", meta);
  shard.value =
      has_copy ? ctx.persistent(name + ".value", {Shape{per_rank}, parameters_[first]->value.dtype()}) : shard.master;

  // This rank's slice of the group's masters (zero past the end).
  std::vector<float> all;
  all.reserve(static_cast<std::size_t>(shard.padded));
  for (std::size_t i = first; i < first + count; ++i) {
    const std::vector<float> master = ctx.to_vector<float>(parameters_[i]->master);
    all.insert(all.end(), master.begin(), master.end());
  }
  all.resize(static_cast<std::size_t>(shard.padded), 0.0f);
  ctx.copy_from_host(shard.master, all.data() + rank * per_rank, static_cast<std::size_t>(per_rank) * sizeof(float));

  shard.update =
      make_update(ctx, {{shard.master, shard.grad, m, v, has_copy ? shard.value : Tensor()}}, name + ".table");
  return shard;
}

void AdamW::shard(Context& ctx, Communicator& comm) {
  SG_CHECK_CODE(!skips_nonfinite(), ErrorCode::kUnsupported,
                "AdamW::shard: the optimizer skips non-finite steps, whose updates run inside a CUDA conditional "
                "node, where a sharded update's collectives cannot (NCCL #1986); turn the skip off to shard");
  SG_CHECK_CODE(!step_scoped_, ErrorCode::kUnsupported,
                "AdamW::shard: a sharded update reduce-scatters persistent gradients; this optimizer's are "
                "step-scoped (use_step_scoped_gradients)");
  SG_CHECK_CODE(!sharded(), ErrorCode::kInvalidState, "AdamW::shard: the optimizer is already sharded over ",
                sharding_->describe());
  comm.check_device(ctx.device(), "AdamW::shard");
  sharding_ = &comm;
  if (groups_.empty()) {
    shards_.push_back(make_shard(ctx, 0, parameters_.size(), "adamw.shard"));
  } else {
    std::size_t first = 0;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const std::size_t count = groups_[g].grads.size();
      shards_.push_back(make_shard(ctx, first, count, "adamw.group" + std::to_string(g) + ".shard"));
      first += count;
    }
    // Each group's unsharded table and tensors go; the group count stays.
    for (Update& group : groups_) group = Update{};
  }
  // The per-parameter moments and the whole-model table go: this rank keeps
  // only its shards (that is the memory ZeRO-1 saves).
  m_.clear();
  v_.clear();
  all_ = Update{};
}

std::vector<AdamW::ShardState> AdamW::shard_states() const {
  SG_CHECK_CODE(sharded(), ErrorCode::kInvalidState, "AdamW::shard_states: the optimizer is not sharded");
  std::vector<ShardState> out;
  for (const Shard& shard : shards_) {
    const UpdateTensors& tensors = shard.update.tensors.at(0);  // the shard is one parameter
    out.push_back({shard.name, tensors.master, tensors.m, tensors.v});
  }
  return out;
}

void AdamW::step_shard(Context& ctx, const Shard& shard, bool advance_step) const {
  const Tensor bucket = ops::pack(ctx, shard.grads, shard.padded);
  ops::reduce_scatter_into_(ctx, *sharding_, bucket, shard.grad, ReduceOp::kSum);
  ops::AdamWParams params = shard.update.params;
  params.advance_step = advance_step;
  run_update(ctx, params, shard.update.table, shard.update.tensors);
  const Tensor gathered = ops::all_gather(ctx, *sharding_, shard.value);
  ops::unpack_(ctx, gathered, shard.values);
  after_update(ctx, shard.first, shard.count);
}

}  // namespace stepgraph
