#include "engine/layers/adamw.h"

#include "engine/error.h"

namespace stepgraph {

AdamW::AdamW(Context& ctx, const std::vector<Parameter*>& parameters, const kernels::AdamWHyper& hyper) {
  SG_CHECK(!parameters.empty(), "AdamW needs at least one parameter");
  params_.hyper = hyper;
  std::vector<kernels::AdamWTensor> table_entries;
  for (const Parameter* p : parameters) {
    const TensorMeta meta = p->master.meta();
    const Tensor m = ctx.persistent(p->name + ".adam_m", meta);
    const Tensor v = ctx.persistent(p->name + ".adam_v", meta);
    tensors_.insert(tensors_.end(), {p->master, p->grad, m, v});
    if (p->has_copy()) tensors_.push_back(p->value);
    params_.has_copy.push_back(p->has_copy());
    params_.total_numel += meta.numel();
    table_entries.push_back({p->master.data_as<float>(), p->grad.data_as<float>(), m.data_as<float>(),
                             v.data_as<float>(), p->has_copy() ? p->value.data() : nullptr, meta.numel()});
  }
  const std::size_t table_bytes = kernels::adamw_table_bytes(table_entries);
  const auto words = static_cast<std::int64_t>((table_bytes + 7) / 8);
  std::vector<std::int64_t> table_host(static_cast<std::size_t>(words), 0);
  kernels::build_adamw_table(table_entries, table_host.data());
  table_ = ctx.persistent("adamw.table", {Shape{words}, DType::kInt64});
  ctx.copy_from_host(table_, table_host.data(), table_host.size() * sizeof(std::int64_t));
  step_ = ctx.persistent("adamw.step", {Shape{1}, DType::kInt64});
}

void AdamW::step(Context& ctx) const { ops::adamw_step(ctx, params_, table_, step_, tensors_); }

std::int64_t AdamW::steps_taken(Context& ctx) const { return ctx.to_vector<std::int64_t>(step_).at(0); }

std::vector<AdamW::Moments> AdamW::moments() const {
  // tensors_ holds per parameter: master, grad, m, v[, copy].
  std::vector<Moments> out;
  std::size_t at = 0;
  for (const bool has_copy : params_.has_copy) {
    out.push_back({tensors_[at + 2], tensors_[at + 3]});
    at += has_copy ? 5 : 4;
  }
  return out;
}

}  // namespace stepgraph
