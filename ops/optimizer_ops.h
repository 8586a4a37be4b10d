// AdamW over many parameters in one op (kernels/adamw.h), and the device
// learning-rate schedule. AdamW's operands are AdamWOperands (Note [Named
// operands] in ops/operands.h).
#pragma once

#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/adamw.h"
#include "kernels/lr_schedule.h"
#include "ops/operands.h"

namespace stepgraph::ops {

struct AdamWParams {
  kernels::AdamWHyper hyper;
  std::vector<bool> has_copy;  // per parameter
  std::int64_t total_numel = 0;
  bool advance_step = true;  // false: every update of a split step but its last (kernels/adamw.h)
  // The rate is read on the device from the `lr` operand at every launch,
  // hyper.lr otherwise (Note [Learning-rate schedule] in kernels/lr_schedule.h);
  // hyper.lr then takes no part in equality or to_string.
  bool device_lr = false;
  // Every gradient is multiplied by 1/S of the `loss_scale` operand before the
  // update: Note [Loss scaling] in kernels/step_guard.h.
  bool unscale_grads = false;
  // The table's tensor entries are written from the op's own tensors before
  // each update (kernels::write_adamw_table_entries): for gradients whose
  // addresses are the step's (step-scoped gradients, made and freed inside
  // each step). The table is then an input the op writes.
  bool table_from_operands = false;

  bool operator==(const AdamWParams& other) const;
  std::string to_string() const;
};

// One parameter's operands of an AdamW update.
template <typename F>
struct AdamWParamOperands {
  F master;  // fp32, written
  F grad;    // fp32 like the master, read
  F m, v;    // fp32 moments like the master, written
  F copy;    // the model-dtype copy (bf16 or fp16), written; only where AdamWParams::has_copy
};

template <typename F>
struct AdamWOperands {
  F table;                                    // the launch table, int64 words: written when table_from_operands
  F step;                                     // the device step counter, int64 [1]: written when advance_step
  std::vector<AdamWParamOperands<F>> params;  // in AdamWParams::has_copy's order
  F lr;                                       // fp32 [1]: only with device_lr
  F loss_scale;  // the loss-scale state, fp32 [kLossScaleStateSize]: only with unscale_grads
};

// The program's order: table, step, per parameter master, grad, m, v[, copy], lr, loss_scale.
template <typename F, typename V>
void visit_operands(const AdamWParams& p, AdamWOperands<F>& o, V& v) {
  v({.name = "table", .use = p.table_from_operands ? Use::kWrite : Use::kRead}, o.table);
  v({.name = "step", .use = p.advance_step ? Use::kWrite : Use::kRead}, o.step);
  v.list("params", o.params, p.has_copy.size());
  for (std::size_t t = 0; t < o.params.size(); ++t) {
    const auto i = static_cast<std::int64_t>(t);
    AdamWParamOperands<F>& param = o.params[t];
    v({.name = "master", .index = i, .use = Use::kWrite}, param.master);
    v({.name = "grad", .index = i}, param.grad);
    v({.name = "m", .index = i, .use = Use::kWrite}, param.m);
    v({.name = "v", .index = i, .use = Use::kWrite}, param.v);
    v({.name = "copy", .index = i, .use = Use::kWrite, .present = p.has_copy[t]}, param.copy);
  }
  v({.name = "lr", .present = p.device_lr}, o.lr);
  v({.name = "loss_scale", .present = p.unscale_grads}, o.loss_scale);
}

// `operands.lr` is given exactly when params.device_lr, `loss_scale` when
// params.unscale_grads, each parameter's `copy` where params.has_copy.
void adamw_step(Context& ctx, const AdamWParams& params, AdamWOperands<Tensor> operands);

// lr = the schedule's rate for the update after `step` steps (int64 [1]):
// kernels/lr_schedule.h, on the device, so a replay needs nothing from the host.
void lr_schedule_(Context& ctx, const kernels::LrSchedule& schedule, const Tensor& step, const Tensor& lr);

const OpDef& adamw_op();
const OpDef& lr_schedule_op();

}  // namespace stepgraph::ops
