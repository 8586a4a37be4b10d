#include "layers/moe_mlp.h"

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "layers/layer_checks.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"

namespace stepgraph {
namespace {

const MoEMLPConfig& checked(Context& ctx, const std::string& name, const MoEMLPConfig& config,
                            const Communicator* tp) {
  SG_CHECK(config.hidden > 0 && config.ffn > 0, "MoEMLP '", name, "': hidden and ffn must be > 0, got ", config.hidden,
           " and ", config.ffn);
  SG_CHECK(config.topk >= 1 && config.topk <= kernels::kMaxTopk, "MoEMLP '", name, "': topk must be in [1, ",
           kernels::kMaxTopk, "], got ", config.topk);
  SG_CHECK(config.experts >= config.topk && config.experts <= kernels::kMaxExperts, "MoEMLP '", name,
           "': experts must be in [topk = ", config.topk, ", ", kernels::kMaxExperts, "], got ", config.experts);
  if (tp != nullptr) {
    tp->check_device(ctx.device(), layer_label("MoEMLP", name));
    SG_CHECK(config.ffn % tp->world_size() == 0, "MoEMLP '", name, "': ffn ", config.ffn, " must divide by the ",
             tp->world_size(), " tensor-parallel ranks (each rank holds ffn / N of every expert); pick an ffn that "
             "is a multiple of the tensor-parallel world size");
  }
  return config;
}

// fc1 (`first`) or fc2 of the experts. See Note [Tensor-parallel MoE]: fc1
// column-parallel, fc2 row-parallel; GeLU between them as fc1's activation
// and fc2's input activation.
GroupedLinearConfig experts_config(const MoEMLPConfig& config, bool first) {
  return {.experts = config.experts,
          .in_features = first ? config.hidden : config.ffn,
          .out_features = first ? config.ffn : config.hidden,
          .dtype = config.dtype,
          .parallel = first ? GroupedParallel::kColumn : GroupedParallel::kRow,
          .fp8 = config.fp8,
          .activation = first ? LinearActivation::kGelu : LinearActivation::kNone,
          .input_activation = first ? LinearActivation::kNone : LinearActivation::kGelu};
}

}  // namespace

MoEMLP::MoEMLP(Context& ctx, const std::string& name, const MoEMLPConfig& config, std::uint32_t seed,
               Communicator* tensor_parallel)
    : name_(name),
      config_(checked(ctx, name, config, tensor_parallel)),
      tp_(tensor_parallel),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.hidden, config.eps, config.dtype}),
      router_(ctx, name + ".router",
              LinearConfig{
                  .in_features = config.hidden, .out_features = config.experts, .bias = false, .dtype = config.dtype},
              seed),
      fc1_(ctx, name + ".fc1", experts_config(config, true), seed + 2, tensor_parallel),
      fc2_(ctx, name + ".fc2", experts_config(config, false), seed + 4, tensor_parallel) {
  // The router's outputs, and both expert layers, must agree on the expert count.
  SG_CHECK(router_.config().out_features == config.experts && fc1_.config().experts == config.experts &&
               fc2_.config().experts == config.experts,
           "MoEMLP '", name, "': the router has ", router_.config().out_features, " outputs but the experts are ",
           fc1_.config().experts, " and ", fc2_.config().experts, "; they must all be ", config.experts);
  routing_error_ = ctx.persistent(name + ".routing_error", {Shape{1}, DType::kInt32});
}

std::vector<GroupedLinear*> MoEMLP::fp8_experts() {
  if (!config_.fp8) return {};
  return {&fc1_, &fc2_};
}

std::vector<Parameter*> MoEMLP::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Parameter* p : router_.parameters()) out.push_back(p);
  for (Parameter* p : fc1_.parameters()) out.push_back(p);
  for (Parameter* p : fc2_.parameters()) out.push_back(p);
  return out;
}

MoEMLP::Forward MoEMLP::forward(Context& ctx, const FwdArgs& args) const {
  check_input(layer_label("MoEMLP", name_), "forward", "input", args.x, {"tokens", config_.hidden}, config_.dtype);
  Forward out;
  Saved& s = out.saved;
  const Norm::Forward normed = norm_.forward(ctx, {args.x});
  s.norm = normed.saved;
  // Every rank's normed tokens, so every rank routes all of them the same way
  // (See Note [Tensor-parallel MoE]).
  const Tensor tokens = tp_ != nullptr ? ops::all_gather(ctx, *tp_, normed.y) : normed.y;
  const Linear::Forward router = router_.forward(ctx, {tokens});
  s.router = router.saved;
  s.logits = router.y;
  s.routed = ops::router_topk(ctx, s.logits, config_.topk);
  s.plan = ops::moe_plan(ctx, s.routed.experts, routing_error_, config_.experts);
  const Tensor x_perm = ops::moe_permute(ctx, tokens, s.plan.sources);
  const GroupedLinear::Forward fc1 = fc1_.forward(ctx, {x_perm, s.plan.splits});  // GeLU(pre) and pre
  s.fc1 = fc1.saved;
  s.pre = fc1.pre;
  const GroupedLinear::Forward fc2 = fc2_.forward(ctx, {fc1.y, s.plan.splits});
  s.fc2 = fc2.saved;
  if (config_.recompute_activation && !config_.fp8) s.fc2.x = Tensor();  // made again in the backward
  s.expert_out = fc2.y;
  out.y = ops::moe_unpermute(ctx, s.expert_out, s.plan.positions, s.routed.gates);
  // The ranks' gated partial sums, summed, this rank's tokens kept.
  if (tp_ != nullptr) out.y = ops::reduce_scatter(ctx, *tp_, out.y, ReduceOp::kSum);
  return out;
}

Tensor MoEMLP::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const std::string label = layer_label("MoEMLP", name_);
  check_input(label, "backward", "saved.norm.x", saved.norm.x, {"tokens", config_.hidden}, config_.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  const std::int64_t all_tokens = tokens * ranks();  // what the experts saw (Note [Tensor-parallel MoE])
  check_input(label, "backward", "saved.logits", saved.logits, {all_tokens, config_.experts}, config_.dtype,
              "the forward's router logits");
  check_input(label, "backward", "saved.expert_out", saved.expert_out, {all_tokens * config_.topk, config_.hidden},
              config_.dtype, "the forward's expert outputs");
  check_input(label, "backward", "dy", args.dy, {tokens, config_.hidden}, config_.dtype, "the forward's output");
  // Every token's gradient reached this rank's expert slices.
  const Tensor dy = tp_ != nullptr ? ops::all_gather(ctx, *tp_, args.dy) : args.dy;
  ops::UnpermuteGrads unpermuted =
      ops::moe_unpermute_backward(ctx, dy, saved.expert_out, saved.plan.positions, saved.routed.gates);
  // d gate = <dy, whole expert output>: the sum of the ranks' dots with their
  // partial outputs (See Note [Tensor-parallel MoE]).
  if (tp_ != nullptr) unpermuted.dgates = ops::all_reduce(ctx, *tp_, unpermuted.dgates, ReduceOp::kSum);
  // fc2 gives the gradient of pre (and makes its input again under recompute_activation).
  const Tensor d_pre = fc2_.backward(ctx, saved.fc2, {.dy = unpermuted.dy_perm, .input_pre = saved.pre});
  const Tensor d_x_perm = fc1_.backward(ctx, saved.fc1, {d_pre});
  // The normed rows reach the output through the experts (summed back over
  // the k copies: permute's backward) and through the router's gates.
  const Tensor d_normed_experts = ops::moe_unpermute(ctx, d_x_perm, saved.plan.positions);
  const Tensor d_logits = ops::router_topk_backward(ctx, unpermuted.dgates, saved.logits, saved.routed);
  const Tensor d_normed_router = router_.backward(ctx, saved.router, {d_logits});
  if (tp_ == nullptr) {
    return norm_.backward(ctx, saved.norm,
                          {ops::residual_add(ctx, d_normed_experts, d_normed_router), args.dx_residual});
  }
  // The experts' part is a partial sum over the ranks, the router's is whole
  // on every rank: rank 0 adds it, so the reduce-scatter's sum holds it once.
  const Tensor d_partial =
      tp_->rank() == 0 ? ops::residual_add(ctx, d_normed_experts, d_normed_router) : d_normed_experts;
  const Tensor d_normed = ops::reduce_scatter(ctx, *tp_, d_partial, ReduceOp::kSum);
  const Tensor dx = norm_.backward(ctx, saved.norm, {d_normed, args.dx_residual});
  // gamma and beta saw only this rank's tokens.
  ops::all_reduce_many_(ctx, *tp_, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

void MoEMLP::check_errors(Context& ctx) const {
  check_routing_error_word(ctx, routing_error_, "MoEMLP '" + name_ + "'");
  fc1_.check_splits(ctx);
  fc2_.check_splits(ctx);
}

}  // namespace stepgraph
