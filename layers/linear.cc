#include "layers/linear.h"

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"
#include "ops/row_ops.h"

namespace stepgraph {

using kernels::GemmEpilogue;

std::string_view tensor_parallel_mode_name(TensorParallelMode mode) {
  switch (mode) {
    case TensorParallelMode::kNone: return "none";
    case TensorParallelMode::kColumn: return "column";
    case TensorParallelMode::kRow: return "row";
  }
  return "unknown";
}

Linear::Linear(Context& ctx, const std::string& name, const LinearConfig& config, std::uint32_t seed,
               Communicator* tensor_parallel)
    : label_(layer_label("Linear", name)), config_(config), tp_(tensor_parallel) {
  SG_CHECK(config.in_features > 0 && config.out_features > 0, "Linear '", name,
           "': in_features and out_features must be > 0, got ", config.in_features, " and ", config.out_features);
  // See Note [Column- and row-parallel Linear].
  const bool split = config.tensor_parallel != TensorParallelMode::kNone;
  SG_CHECK(split || tp_ == nullptr, label_, ": got a tensor-parallel communicator (", tp_ ? tp_->describe() : "",
           ") but config.tensor_parallel is none; set it to kColumn or kRow, or pass no communicator");
  SG_CHECK(!split || tp_ != nullptr, label_, ": config.tensor_parallel is ",
           tensor_parallel_mode_name(config.tensor_parallel),
           " but no communicator was given; pass the tensor-parallel group's Communicator (a world of one for a "
           "single rank)");
  SG_CHECK(column() || config.out_blocks.empty(), label_,
           ": out_blocks splits the rows of a column-parallel layer; set config.tensor_parallel to kColumn or leave "
           "out_blocks empty");
  SG_CHECK(split || !config.sequence_parallel, label_,
           ": sequence_parallel needs a tensor-parallel layer; set config.tensor_parallel to kColumn or kRow");
  if (tp_ != nullptr) {
    tp_->check_device(ctx.device(), label_);
    const std::int64_t n = tp_->world_size();
    SG_CHECK(!column() || !config.out_blocks.empty() || config.out_features % n == 0, label_,
             ": a column-parallel layer splits out_features ",
             config.out_features, " over the ", n, " ranks of ", tp_->describe(), "; make out_features a multiple of ",
             n);
    if (column() && !config.out_blocks.empty()) {
      std::int64_t sum = 0;
      for (const LinearOutBlock& b : config.out_blocks) {
        SG_CHECK(b.copies >= 1 && n % b.copies == 0 && b.rows > 0 && b.rows % (n / b.copies) == 0, label_,
                 ": config.out_blocks holds a block of ", b.rows, " rows with ", b.copies, " copies, which does not "
                 "split over the ", n, " ranks of ", tp_->describe(), "; copies must divide ", n,
                 " and the rows must be a positive multiple of ", n, " / copies");
        sum += b.rows;
      }
      SG_CHECK(sum == config.out_features, label_, ": config.out_blocks sum to ", sum, " rows, not out_features ",
               config.out_features, "; give blocks that tile the rows of W");
    }
    SG_CHECK(!row() || config.in_features % n == 0, label_, ": a row-parallel layer splits in_features ",
             config.in_features, " over the ", n, " ranks of ", tp_->describe(), "; make in_features a multiple of ",
             n);
  }
  if (config.fp8) {
    // See Note [FP8 Linear]: what is built so far.
    config.fp8->check();
    ctx.backend().check_fp8_supported();
    const std::int64_t multiple = config.fp8->scaling == Fp8Scaling::kBlock ? 128 : 16;
    SG_CHECK(local_in_features() % multiple == 0 && local_out_features() % multiple == 0, label_, ": FP8 GEMMs",
             config.fp8->scaling == Fp8Scaling::kBlock ? " with block scaling" : "",
             " need in_features and out_features divisible by ", multiple, split ? " on every rank" : "", ", got ",
             local_in_features(), " and ", local_out_features(),
             split ? " (" + std::to_string(config.in_features) + " and " + std::to_string(config.out_features) +
                         " over " + std::to_string(ranks()) + " ranks)"
                   : std::string());
    // An FP8 GEMM quantizes its whole operand first (one scale, or blocks
    // across the gathered tokens): the chunked overlaps have no shard-by-shard
    // GEMM to run.
    for (const auto& [field, mode] : {std::pair{"fprop_overlap", config.fprop_overlap},
                                      std::pair{"dgrad_overlap", config.dgrad_overlap}}) {
      SG_CHECK_CODE(!split || mode == CommOverlap::kNone || mode == CommOverlap::kBulk, ErrorCode::kUnsupported,
                    label_, ": ", field, " ", comm_overlap_name(mode),
                    " with FP8: an FP8 tensor-parallel layer runs its collectives none or bulk (Note [FP8 Linear])");
    }
  }
  // See Note [Linear epilogues]: an activation of a partial sum is not the sum's.
  SG_CHECK(!row() || config.activation == LinearActivation::kNone, label_, ": activation ",
           linear_activation_name(config.activation),
           " on a row-parallel layer would act on each rank's partial sum; put it on a column-parallel or plain Linear");
  SG_CHECK(!column() || config.input_activation == LinearActivation::kNone, label_, ": input_activation ",
           linear_activation_name(config.input_activation),
           " on a column-parallel layer would differentiate each rank's partial dx; use it on a row-parallel or "
           "plain Linear");
  check_overlap("fprop_overlap", config.fprop_overlap, column() ? CommOverlap::kRingExchange : CommOverlap::kPipelined);
  check_overlap("dgrad_overlap", config.dgrad_overlap, column() ? CommOverlap::kPipelined : CommOverlap::kRingExchange);
  const float scale = 1.0f / std::sqrt(static_cast<float>(config.in_features));
  const std::int64_t in = local_in_features();
  const std::int64_t out = local_out_features();
  const std::int64_t rank = tp_ != nullptr ? tp_->rank() : 0;
  // This rank's slice of the weights one rank draws from `seed`; the plain
  // layer's whole draw without a communicator.
  ParameterInit w_init = ParameterInit::uniform(scale, seed);
  ParameterInit b_init = ParameterInit::uniform(scale, seed + 1);
  if (column()) {
    std::vector<ParameterInit::RowBlock> blocks;
    for (const LinearOutBlock& b : config.out_blocks) {
      blocks.push_back({.rows = b.rows, .parts = ranks() / b.copies, .part = rank / b.copies});
    }
    if (blocks.empty()) blocks.push_back({.rows = config.out_features, .parts = ranks(), .part = rank});
    w_init = w_init.row_blocks_from(blocks, config.in_features);
    b_init = b_init.row_blocks_from(blocks, 1);
  } else if (row()) {
    w_init = w_init.columns_from(config.out_features, config.in_features, rank * in);
  }
  weight_ = make_parameter(ctx, name + ".weight", Shape{out, in}, config.dtype, w_init);
  if (config.bias) bias_ = make_parameter(ctx, name + ".bias", Shape{out}, config.dtype, b_init);
  if (config.fp8) non_finite_ = detail::make_non_finite_counter(ctx, name + ".fp8.non_finite_amaxes");
  if (config.fp8 && config.fp8->scaling == Fp8Scaling::kDelayed) {
    x_state_ = detail::make_delayed_state(ctx, name + ".fp8.x", *config.fp8, state_);
    w_state_ = detail::make_delayed_state(ctx, name + ".fp8.w", *config.fp8, state_);
    dy_state_ = detail::make_delayed_state(ctx, name + ".fp8.dy", *config.fp8, state_);
  }
  if (config.fp8 && config.fp8->cache_weights) {
    w_cache_ = detail::make_weight_cache(ctx, name + ".fp8.w_cache", weight_.value, *config.fp8);
    weight_.after_update = {weight_cache_hook()};
    run_after_update(ctx, weight_);
  }
}

void Linear::check_overlap(std::string_view field, CommOverlap mode, CommOverlap chunked) const {
  if (mode == CommOverlap::kNone || mode == CommOverlap::kBulk) return;
  SG_CHECK(sequence_parallel() && mode == chunked, label_, ": ", field, " ", comm_overlap_name(mode),
           " does not fit this layer's collective; ",
           sequence_parallel() ? "use none, bulk or " + std::string(comm_overlap_name(chunked))
                               : std::string("without sequence parallelism the collectives are all-reduces: use none or bulk"));
}

std::int64_t Linear::local_in_features() const { return config_.in_features / (row() ? ranks() : 1); }
std::int64_t Linear::local_out_features() const {
  if (!column()) return config_.out_features;
  if (config_.out_blocks.empty()) return config_.out_features / ranks();
  std::int64_t out = 0;
  for (const LinearOutBlock& b : config_.out_blocks) out += b.rows / (ranks() / b.copies);
  return out;
}

std::vector<StateTensor> Linear::state() const { return state_; }

std::vector<StateTensor> state_of(const std::vector<Linear*>& linears) {
  std::vector<StateTensor> out;
  for (const Linear* linear : linears) {
    for (StateTensor& t : linear->state()) out.push_back(std::move(t));
  }
  return out;
}

std::vector<Parameter*> Linear::parameters() {
  std::vector<Parameter*> out{&weight_};
  if (config_.bias) out.push_back(&bias_);
  return out;
}

bool Linear::fuses_gelu() const { return !config_.fp8 && config_.dtype != DType::kFloat32; }

Linear::Forward Linear::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", local_in_features()}, config_.dtype);
  SG_CHECK(args.x.shape().dim(0) > 0, label_, " forward: the input has 0 tokens (shape ", args.x.shape(),
           "); give it at least one row");
  if (config_.fp8) return forward_fp8(ctx, args);
  const std::int64_t tokens = args.x.shape().dim(0);
  if (row() && sequence_parallel()) {
    SG_CHECK(tokens % ranks() == 0, label_, " forward: a sequence-parallel row-parallel layer reduce-scatters its ",
             tokens, " tokens over the ", ranks(), " ranks of ", tp_->describe(), "; give it a multiple of ", ranks(),
             " tokens");
  }
  // Row-parallel: the bias once in the sum of the ranks' partial products.
  const bool adds_bias = config_.bias && (!row() || tp_->rank() == 0);
  // Note [Linear epilogues]: GeLU in the epilogue, writing pre as its aux, or as an op after the GEMM.
  const bool activates = config_.activation == LinearActivation::kGelu;
  const bool fused = activates && adds_bias && fuses_gelu();
  const ops::GemmParams params{
      .trans_b = true,
      .epilogue = fused ? GemmEpilogue::kGeluAuxBias : adds_bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
      .out_dtype = config_.dtype};
  const Tensor bias = adds_bias ? bias_.value : Tensor();
  Forward out;
  // The GEMM over every row of `rows` into fresh outputs.
  auto whole = [&](const Tensor& rows) {
    const ops::GemmResult r = ops::gemm(ctx, rows, weight_.value, params, bias);
    if (!activates) {
      out.y = r.d;
      return;
    }
    out.pre = fused ? r.aux : r.d;
    out.y = fused ? r.d : ops::gelu(ctx, out.pre);
  };
  Tensor x = args.x;
  if (column() && sequence_parallel()) {
    // The GEMM takes every rank's tokens, whole or shard by shard as they arrive.
    const std::int64_t all = tokens * ranks();
    x = all_gather_gemm(ctx, *tp_, args.x, config_.fprop_overlap, [&](const Tensor& rows, std::int64_t first_row) {
      if (first_row == 0 && rows.shape().dim(0) == all) {
        whole(rows);
        return;
      }
      // Row windows of outputs made whole first (Note [Row windows of a GEMM]).
      const TensorMeta meta{Shape{all, local_out_features()}, config_.dtype};
      if (activates && !out.pre.defined()) out.pre = ops::empty(ctx, meta);
      if ((fused || !activates) && !out.y.defined()) out.y = ops::empty(ctx, meta);
      ops::GemmParams window = params;
      window.rows = rows.shape().dim(0);
      window.d_row = first_row;
      // The GEMM writes y (and pre as the epilogue's aux), or pre when GeLU runs after it.
      ops::gemm_into_(ctx, activates && !fused ? out.pre : out.y, rows, weight_.value, window, bias,
                      fused ? out.pre : Tensor());
    });
    if (activates && !out.y.defined()) out.y = ops::gelu(ctx, out.pre);  // unfused GeLU after a chunked GEMM
  } else if (row() && sequence_parallel()) {
    out.y = gemm_reduce_scatter(ctx, *tp_, tokens, config_.fprop_overlap, [&](std::int64_t first, std::int64_t rows) {
      ops::GemmParams window = params;
      if (rows != tokens) {
        window.rows = rows;
        window.a_row = first;
      }
      return ops::gemm(ctx, x, weight_.value, window, bias).d;
    });
  } else {
    whole(x);
    if (row()) {
      std::optional<InlineCollectives> serial;
      if (config_.fprop_overlap == CommOverlap::kNone) serial.emplace(ctx);
      out.y = ops::all_reduce(ctx, *tp_, out.y, ReduceOp::kSum);
    }
  }
  out.saved = Saved{x, config_.dgrad, config_.wgrad};
  return out;
}

Tensor Linear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  return backward_fused(ctx, saved, args).dx;
}

Linear::Backward Linear::backward_fused(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const bool takes_pre = config_.input_activation == LinearActivation::kGelu;
  if (config_.fp8) {
    SG_CHECK(!args.bias_grad.defined(), label_,
             " backward: an FP8 layer sums its bias gradient from the 16-bit dy; pass no bias_grad");
    Backward out{backward_fp8(ctx, saved, args)};
    // FP8 GEMMs have no dGeLU epilogue (Note [Linear epilogues]).
    if (takes_pre && out.dx.defined()) {
      check_input(label_, "backward", "input_pre", args.input_pre, exactly(out.dx.shape()), config_.dtype,
                  "the pre-activation of the forward's input (the Linear before's Forward::pre)");
      out.dx = ops::gelu_backward(ctx, out.dx, args.input_pre);
    }
    return out;
  }
  // A saved x left undefined is made again from input_pre (Note [Linear epilogues]).
  const bool remakes_x = takes_pre && !saved.x.defined();
  if (!remakes_x) {
    check_input(label_, "backward", "saved.x", saved.x, {"tokens", local_in_features()}, config_.dtype,
                "the forward's input");
  }
  if (takes_pre) {
    check_input(label_, "backward", "input_pre", args.input_pre,
                {remakes_x ? ExpectedDim("tokens") : ExpectedDim(saved.x.shape().dim(0)), local_in_features()},
                config_.dtype, "the pre-activation of the forward's input (the Linear before's Forward::pre)");
  }
  // The GEMM's tokens; a sequence-parallel row-parallel output holds 1/N of them.
  const std::int64_t tokens = (remakes_x ? args.input_pre : saved.x).shape().dim(0);
  const bool gathers_dy = row() && sequence_parallel();
  check_input(label_, "backward", "dy", args.dy, {gathers_dy ? tokens / ranks() : tokens, local_out_features()},
              config_.dtype, "the forward's output");
  if (args.bias_grad.defined()) {
    SG_CHECK(config_.bias, label_, " backward: got a bias_grad but the layer has no bias; pass none");
    check_input(label_, "backward", "bias_grad", args.bias_grad, {local_out_features()}, config_.dtype,
                "this layer's bias gradient, from the epilogue of the Linear after");
  }
  // dx[tokens, in] = dy W, with GeLU's derivative (and the Linear before's
  // bias gradient) in the epilogue where cuBLASLt has it.
  const bool fused_dgelu = takes_pre && fuses_gelu();
  const ops::GemmParams dgrad{.epilogue = fused_dgelu ? GemmEpilogue::kDGeluBGrad : GemmEpilogue::kNone,
                              .out_dtype = config_.dtype};
  const Tensor aux = fused_dgelu ? args.input_pre : Tensor();
  Backward out;
  Tensor& dx = out.dx;
  auto dgrad_whole = [&](const Tensor& rows) {
    const ops::GemmResult r = ops::gemm(ctx, rows, weight_.value, dgrad, {}, aux);
    dx = r.d;
    out.input_bias_grad = r.bias_grad;
  };
  // Over rows of dy: whole, or (a sequence-parallel row-parallel layer) shard
  // by shard as dy's shards arrive; by windows the Linear before sums its own
  // bias gradient, since the windows' sums would need adding.
  Tensor dy = args.dy;
  if (gathers_dy) {
    dy = all_gather_gemm(ctx, *tp_, args.dy, config_.dgrad_overlap, [&](const Tensor& rows, std::int64_t first_row) {
      if (!saved.dgrad) return;
      if (first_row == 0 && rows.shape().dim(0) == tokens) {
        dgrad_whole(rows);
        return;
      }
      if (!dx.defined()) dx = ops::empty(ctx, {Shape{tokens, local_in_features()}, config_.dtype});
      ops::GemmParams window = dgrad;
      window.rows = rows.shape().dim(0);
      window.d_row = first_row;
      ops::gemm_into_(ctx, dx, rows, weight_.value, window, {}, aux);
    });
  } else if (takes_pre && saved.dgrad) {
    dgrad_whole(dy);  // first: see Note [Linear epilogues]
  }
  if (takes_pre && dx.defined() && !fused_dgelu) dx = ops::gelu_backward(ctx, dx, args.input_pre);
  if (saved.wgrad) {
    // grad_W[out, in] = dy^T x, on the weight-gradient stream.
    WeightGradScope weight_grads(ctx);
    const Tensor x = remakes_x ? ops::gelu(ctx, args.input_pre) : saved.x;
    if (args.bias_grad.defined()) {
      // The bias gradient came from the Linear after's epilogue: in fp32 into bias_.grad.
      ops::copy_(ctx, bias_.gradient_for_write(ctx), ops::cast(ctx, args.bias_grad, DType::kFloat32));
      ops::gemm_into_(ctx, weight_.gradient_for_write(ctx), dy, x, {.trans_a = true, .out_dtype = DType::kFloat32});
    } else {
      // grad_b = sum over tokens of dy fused (BGRADB), straight into bias_.grad
      // (fp32 like the epilogue's output): no copy after it.
      ops::GemmParams wgrad{.trans_a = true,
                            .epilogue = config_.bias ? GemmEpilogue::kBiasGradOfA : GemmEpilogue::kNone,
                            .out_dtype = DType::kFloat32};
      ops::gemm_into_(ctx, weight_.gradient_for_write(ctx), dy, x, wgrad, {}, {},
                      config_.bias ? bias_.gradient_for_write(ctx) : Tensor());
    }
  }
  if (!saved.dgrad) return out;
  if (column() && sequence_parallel()) {
    // Every rank's slice of out contributed to every input feature: sum them
    // and keep this rank's tokens.
    dx = gemm_reduce_scatter(ctx, *tp_, tokens, config_.dgrad_overlap, [&](std::int64_t first, std::int64_t rows) {
      ops::GemmParams window{.out_dtype = config_.dtype};
      if (rows != tokens) {
        window.rows = rows;
        window.a_row = first;
      }
      return ops::gemm(ctx, dy, weight_.value, window).d;
    });
    return out;
  }
  if (!dx.defined()) dx = ops::gemm(ctx, dy, weight_.value, {.out_dtype = config_.dtype}).d;
  if (column()) {
    std::optional<InlineCollectives> serial;
    if (config_.dgrad_overlap == CommOverlap::kNone) serial.emplace(ctx);
    dx = ops::all_reduce(ctx, *tp_, dx, ReduceOp::kSum);
  }
  return out;
}

}  // namespace stepgraph
