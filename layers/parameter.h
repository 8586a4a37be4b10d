// Parameters: an fp32 master weight (what the optimizer updates), the copy in
// the model's dtype that layers read (the master itself when that is fp32),
// and an fp32 main gradient. All persistent: fixed addresses for every step,
// except the gradient of an optimizer with step-scoped gradients.
//
// Note [Step-scoped gradients]
// A persistent gradient holds 4 bytes a parameter for the whole step, the
// forward included, although it is only ever written by the backward and
// read by the optimizer right after. With AdamW::use_step_scoped_gradients
// each gradient is a tensor of the step instead: made where the backward
// first writes it (Parameter::gradient_for_write: on the weight-gradient
// stream for the GEMMs' gradients), read by its group's update, and dropped
// when the step's updates are issued. Traced, it is a pool value that lives
// from its weight-gradient GEMM to its group's AdamW, so the gradients of
// the blocks updated earlier in the backward share memory with those of the
// blocks after them, and none is live during the forward, whose saved
// activations set the pool's peak (docs/memory.md, "Step-scoped
// gradients"). Eager, it comes from the caching allocator, made on the main
// stream, where its last handle frees it (gradient_for_write). Between steps
// the parameter has no gradient (`grad` is undefined): code that reads
// gradients after a step (tests, gradient sums over microbatches) needs
// persistent ones, the default.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/context.h"

namespace stepgraph {

// A persistent tensor a layer keeps between steps that is not a parameter
// (FP8 delayed scaling's amax histories and scales): checkpoints save and
// restore it, so a resumed run continues exactly.
struct StateTensor {
  std::string name;
  Tensor tensor;
};

struct Parameter {
  std::string name;
  Tensor master;  // fp32
  Tensor value;   // what layers read: `master`, or its copy in the model dtype
  // fp32, overwritten by each backward. Step-scoped (Note [Step-scoped
  // gradients]): undefined between steps, made by gradient_for_write; a
  // layer's const backward makes it, hence mutable.
  mutable Tensor grad;
  bool step_scoped_gradient = false;
  // What a layer derives from `value` and keeps (an FP8 weight cache, Note
  // [FP8 weight cache] in layers/fp8_operand.h), remade whenever the value
  // changes: by the optimizer right after its update (inside the step), and
  // by sync_copy_from_master. Each captures tensors by value, never a layer.
  std::vector<std::function<void(Context&)>> after_update;

  bool has_copy() const { return value.impl() != master.impl(); }
  // The gradient a backward overwrites in full: `grad`, made first where it
  // is step-scoped and this step has none yet (traced on the current stream,
  // eager on the main one). An Error where a persistent gradient was
  // released.
  const Tensor& gradient_for_write(Context& ctx) const;
};

// Runs the parameter's after_update hooks, in order.
void run_after_update(Context& ctx, const Parameter& parameter);

// A parameter of `shape` and model dtype `dtype`, initialised from `init`
// (numel values; the copy is init rounded to dtype).
// The gradients of `params`, in their order.
std::vector<Tensor> gradients_of(const std::vector<Parameter*>& params);
// What the main stream waits for to join the weight-gradient stream behind
// `params`' group (Note [Joining the weight-gradient stream] in
// ops/stream_ops.h): each gradient's last write, and where the gradient is
// step-scoped its master's too, which the group's update writes after it read
// the gradient: from the join on, the gradient's memory is free as well.
std::vector<Tensor> join_tensors_of(const std::vector<Parameter*>& params);

Parameter make_parameter(Context& ctx, const std::string& name, const Shape& shape, DType dtype,
                         std::span<const float> init);

// Initial values: uniform in [-scale, scale) from `seed`; or a constant.
std::vector<float> uniform_init(std::int64_t numel, float scale, std::uint32_t seed);
std::vector<float> constant_init(std::int64_t numel, float value);

// How a layer initialises a parameter, made only once its device memory
// exists: a model too large for memory then fails on the allocation, with an
// error naming the parameter, before any host buffer of its size is made.
struct ParameterInit {
  static ParameterInit uniform(float scale, std::uint32_t seed) { return {false, scale, seed}; }
  static ParameterInit constant(float value) { return {true, value, 0}; }
  // A tensor-parallel slice of the [rows, cols] matrix this init fills: its
  // rows (or columns) from `first` on, as many as the parameter holds.
  ParameterInit rows_from(std::int64_t rows, std::int64_t cols, std::int64_t first) const;
  ParameterInit columns_from(std::int64_t rows, std::int64_t cols, std::int64_t first) const;
  // One row block of row_blocks_from: `rows` rows split into `parts` equal
  // parts, of which the parameter holds part `part`.
  struct RowBlock {
    std::int64_t rows = 0;
    std::int64_t parts = 1;
    std::int64_t part = 0;
  };
  // A part of every row block of the [sum of rows, cols] matrix this init
  // fills, whose rows are `blocks` end to end, in block order: block b's rows
  // [part b/parts, (part + 1) b/parts). The heads of a fused QKV weight split
  // over tensor-parallel ranks (Note [Tensor-parallel attention] in
  // layers/multihead_attention.h); one block of N parts is rows_from's slice.
  ParameterInit row_blocks_from(std::vector<RowBlock> blocks, std::int64_t cols) const;
  std::vector<float> values(std::int64_t numel) const;

  bool is_constant = false;
  float scale_or_value = 0;
  std::uint32_t seed = 0;
  enum class Slice : std::uint8_t { kWhole, kRows, kColumns, kRowBlocks };
  Slice slice = Slice::kWhole;
  std::int64_t full_rows = 0;
  std::int64_t full_cols = 0;
  std::int64_t first = 0;
  std::vector<RowBlock> row_blocks;  // kRowBlocks
};
Parameter make_parameter(Context& ctx, const std::string& name, const Shape& shape, DType dtype,
                         const ParameterInit& init);

// Writes `value` into the dtype copy from the master (after the optimizer
// changed the master outside a step), then runs the after_update hooks.
void sync_copy_from_master(Context& ctx, const Parameter& parameter);

}  // namespace stepgraph
