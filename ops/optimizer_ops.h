// AdamW over many parameters in one op (kernels/adamw.h). Its inputs are the
// launch table and the device step counter (persistent), then per parameter
// its fp32 master, fp32 grad, moments m and v, and its dtype copy if it has
// one; everything but the grads (and the table, unless table_from_operands)
// is written in place.
#pragma once

#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/adamw.h"
#include "kernels/lr_schedule.h"

namespace stepgraph::ops {

struct AdamWParams {
  kernels::AdamWHyper hyper;
  std::vector<bool> has_copy;  // per parameter
  std::int64_t total_numel = 0;
  bool advance_step = true;  // false: every update of a split step but its last (kernels/adamw.h)
  // The rate is read on the device from the last input (fp32 [1]) at every
  // launch, hyper.lr otherwise (Note [Learning-rate schedule] in kernels/lr_schedule.h).
  bool device_lr = false;
  // Every gradient is multiplied by 1/S of the loss-scale state (fp32 [3], the
  // last input) before the update: Note [Loss scaling] in kernels/step_guard.h.
  bool unscale_grads = false;
  // The table's tensor entries are written from the op's own tensors before
  // each update (kernels::write_adamw_table_entries): for gradients whose
  // addresses are the step's (step-scoped gradients, made and freed inside
  // each step). The table is then an input the op writes.
  bool table_from_operands = false;

  bool operator==(const AdamWParams& other) const;
  std::string to_string() const;
};

// `tensors`: per parameter {master, grad, m, v[, copy]} in has_copy's order;
// `lr`: the device rate when params.device_lr, undefined otherwise;
// `loss_scale`: the loss-scale state when params.unscale_grads.
void adamw_step(Context& ctx, const AdamWParams& params, const Tensor& table, const Tensor& step,
                const std::vector<Tensor>& tensors, const Tensor& lr = {}, const Tensor& loss_scale = {});

// lr = the schedule's rate for the update after `step` steps (int64 [1]):
// kernels/lr_schedule.h, on the device, so a replay needs nothing from the host.
void lr_schedule_(Context& ctx, const kernels::LrSchedule& schedule, const Tensor& step, const Tensor& lr);

const OpDef& adamw_op();
const OpDef& lr_schedule_op();

}  // namespace stepgraph::ops
