#include "layers/moe_mlp.h"

#include <cmath>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "layers/layer_checks.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/moe_balance_ops.h"
#include "ops/moe_exchange_ops.h"

namespace stepgraph {
namespace {

const MoEMLPConfig& checked(Context& ctx, const std::string& name, const MoEMLPConfig& config,
                            const Communicator* tp, const Communicator* ep) {
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
  SG_CHECK(std::isfinite(config.aux_loss_coef) && config.aux_loss_coef >= 0.0f, "MoEMLP '", name,
           "': aux_loss_coef must be finite and >= 0 (0: no auxiliary loss), got ", config.aux_loss_coef);
  SG_CHECK(std::isfinite(config.bias_update_rate) && config.bias_update_rate >= 0.0f, "MoEMLP '", name,
           "': bias_update_rate must be finite and >= 0 (0: no expert bias), got ", config.bias_update_rate);
  if (ep != nullptr) {
    // See Note [Expert-parallel MoE] for what is refused and why.
    SG_CHECK_CODE(tp == nullptr, ErrorCode::kUnsupported, "MoEMLP '", name,
                  "': expert parallelism with tensor-parallel experts is not built; pass either tensor_parallel or "
                  "expert_parallel, not both");
    SG_CHECK_CODE(!config.fp8, ErrorCode::kUnsupported, "MoEMLP '", name,
                  "': FP8 experts under expert parallelism are not built (each rank's tensor-wise scales would cover "
                  "only its experts); leave config.fp8 unset or pass no expert_parallel communicator");
    ep->check_device(ctx.device(), layer_label("MoEMLP", name));
    SG_CHECK(config.experts % ep->world_size() == 0, "MoEMLP '", name, "': experts ", config.experts,
             " must divide by the ", ep->world_size(), " expert-parallel ranks (each rank holds experts / P whole "
             "experts); pick config.experts a multiple of the expert-parallel world size");
  }
  return config;
}

// fc1 (`first`) or fc2 of the experts. See Note [Tensor-parallel MoE]: fc1
// column-parallel, fc2 row-parallel; GeLU between them as fc1's activation
// and fc2's input activation.
// Under expert parallelism (See Note [Expert-parallel MoE]): this rank's whole
// experts, over a receive buffer whose splits cover at most its rows.
GroupedLinearConfig experts_config(const MoEMLPConfig& config, bool first, const Communicator* ep) {
  GroupedLinearConfig out{.experts = config.experts,
                          .in_features = first ? config.hidden : config.ffn,
                          .out_features = first ? config.ffn : config.hidden,
                          .dtype = config.dtype,
                          .parallel = first ? GroupedParallel::kColumn : GroupedParallel::kRow,
                          .fp8 = config.fp8,
                          .activation = first ? LinearActivation::kGelu : LinearActivation::kNone,
                          .input_activation = first ? LinearActivation::kNone : LinearActivation::kGelu};
  if (ep != nullptr) {
    out.held_experts = config.experts / ep->world_size();
    out.first_expert = ep->rank() * out.held_experts;
    out.split_sum = kernels::SplitSum::kAtMostRows;
  }
  return out;
}

}  // namespace

MoEMLP::MoEMLP(Context& ctx, const std::string& name, const MoEMLPConfig& config, std::uint32_t seed,
               Communicator* tensor_parallel, Communicator* expert_parallel)
    : name_(name),
      config_(checked(ctx, name, config, tensor_parallel, expert_parallel)),
      tp_(tensor_parallel),
      ep_(expert_parallel),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.hidden, config.eps, config.dtype}),
      router_(ctx, name + ".router",
              LinearConfig{
                  .in_features = config.hidden, .out_features = config.experts, .bias = false, .dtype = config.dtype},
              seed),
      fc1_(ctx, name + ".fc1", experts_config(config, true, expert_parallel), seed + 2, tensor_parallel),
      fc2_(ctx, name + ".fc2", experts_config(config, false, expert_parallel), seed + 4, tensor_parallel) {
  // The router's outputs, and both expert layers, must agree on the expert count.
  SG_CHECK(router_.config().out_features == config.experts && fc1_.config().experts == config.experts &&
               fc2_.config().experts == config.experts,
           "MoEMLP '", name, "': the router has ", router_.config().out_features, " outputs but the experts are ",
           fc1_.config().experts, " and ", fc2_.config().experts, "; they must all be ", config.experts);
  routing_error_ = ctx.persistent(name + ".routing_error", {Shape{1}, DType::kInt32});
  if (config.bias_update_rate > 0.0f) {
    expert_bias_ = ctx.persistent(name + ".expert_bias", {Shape{config.experts}, DType::kFloat32});
    const std::vector<float> zeros(static_cast<std::size_t>(config.experts), 0.0f);
    ctx.copy_from_host(expert_bias_, zeros.data(), zeros.size() * sizeof(float));
  }
}

std::vector<StateTensor> MoEMLP::state() const {
  if (!expert_bias_.defined()) return {};
  return {{name_ + ".expert_bias", expert_bias_}};
}

std::vector<GroupedLinear*> MoEMLP::fp8_experts() {
  if (!config_.fp8) return {};
  return {&fc1_, &fc2_};
}

std::vector<Parameter*> MoEMLP::expert_parameters() {
  std::vector<Parameter*> out = fc1_.parameters();
  for (Parameter* p : fc2_.parameters()) out.push_back(p);
  return out;
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
  s.routed = ops::router_topk(ctx, s.logits, config_.topk, expert_bias_);  // the bias steers the choice only
  s.plan = ops::moe_plan(ctx, s.routed.experts, routing_error_, config_.experts);
  if (config_.aux_loss_coef > 0.0f) {
    out.aux_loss = ops::router_aux_loss(ctx, s.logits, s.plan.splits, aux_params());
  }
  const Tensor x_perm = ops::moe_permute(ctx, tokens, s.plan.sources);
  // The experts' rows and splits: this rank's, or under expert parallelism
  // every rank's rows for this rank's experts (See Note [Expert-parallel MoE]).
  Tensor expert_rows = x_perm;
  Tensor expert_splits = s.plan.splits;
  if (ep_ != nullptr) {
    s.ep_counts = ops::ep_counts(ctx, *ep_, s.plan.splits);
    const ops::EpDispatch dispatched = ops::ep_dispatch(ctx, *ep_, x_perm, s.ep_counts);
    expert_rows = dispatched.rows;
    expert_splits = dispatched.splits;
  }
  const GroupedLinear::Forward fc1 = fc1_.forward(ctx, {expert_rows, expert_splits});  // GeLU(pre) and pre
  s.fc1 = fc1.saved;
  s.pre = fc1.pre;
  const GroupedLinear::Forward fc2 = fc2_.forward(ctx, {fc1.y, expert_splits});
  s.fc2 = fc2.saved;
  if (config_.recompute_activation && !config_.fp8) s.fc2.x = Tensor();  // made again in the backward
  s.expert_out = ep_ != nullptr ? ops::ep_combine(ctx, *ep_, fc2.y, s.ep_counts) : fc2.y;
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
  if (ep_ != nullptr) {
    check_input(label, "backward", "saved.ep_counts", saved.ep_counts, {ep_->world_size(), config_.experts},
                DType::kInt32, "the forward's exchanged split sizes");
  }
  // Every token's gradient reached this rank's expert slices.
  const Tensor dy = tp_ != nullptr ? ops::all_gather(ctx, *tp_, args.dy) : args.dy;
  ops::UnpermuteGrads unpermuted =
      ops::moe_unpermute_backward(ctx, dy, saved.expert_out, saved.plan.positions, saved.routed.gates);
  // d gate = <dy, whole expert output>: the sum of the ranks' dots with their
  // partial outputs (See Note [Tensor-parallel MoE]).
  if (tp_ != nullptr) unpermuted.dgates = ops::all_reduce(ctx, *tp_, unpermuted.dgates, ReduceOp::kSum);
  // Under expert parallelism the experts' gradients go to their ranks and back
  // (the exchange's backwards, See Note [Expert-parallel MoE]).
  const Tensor d_expert_out = ep_ != nullptr
                                  ? ops::ep_combine_backward(ctx, *ep_, unpermuted.dy_perm, saved.ep_counts)
                                  : unpermuted.dy_perm;
  // fc2 gives the gradient of pre (and makes its input again under recompute_activation).
  const Tensor d_pre = fc2_.backward(ctx, saved.fc2, {.dy = d_expert_out, .input_pre = saved.pre});
  const Tensor d_expert_rows = fc1_.backward(ctx, saved.fc1, {d_pre});
  const Tensor d_x_perm =
      ep_ != nullptr ? ops::ep_dispatch_backward(ctx, *ep_, d_expert_rows, saved.ep_counts) : d_expert_rows;
  // The normed rows reach the output through the experts (summed back over
  // the k copies: permute's backward) and through the router's gates.
  const Tensor d_normed_experts = ops::moe_unpermute(ctx, d_x_perm, saved.plan.positions);
  Tensor d_logits = ops::router_topk_backward(ctx, unpermuted.dgates, saved.logits, saved.routed);
  if (config_.aux_loss_coef > 0.0f) {
    d_logits = ops::router_aux_loss_backward(ctx, d_logits, saved.logits, saved.plan.splits, balance_.loss_scale,
                                             aux_params());
  }
  update_expert_bias(ctx, saved);
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

ops::AuxLossParams MoEMLP::aux_params() const {
  return {.coef = config_.aux_loss_coef, .topk = config_.topk, .grad_factor = balance_.loss_factor};
}

void MoEMLP::update_expert_bias(Context& ctx, const Saved& saved) const {
  if (!expert_bias_.defined()) return;
  // Every rank of the group adds the same loads, so every rank's bias moves alike.
  const Tensor loads = balance_.load_group != nullptr
                           ? ops::all_reduce(ctx, *balance_.load_group, saved.plan.splits, ReduceOp::kSum)
                           : saved.plan.splits;
  ops::expert_bias_update_(ctx, expert_bias_, loads, {.rate = config_.bias_update_rate});
}

void MoEMLP::check_errors(Context& ctx) const {
  check_routing_error_word(ctx, routing_error_, "MoEMLP '" + name_ + "'");
  fc1_.check_splits(ctx);
  fc2_.check_splits(ctx);
}

}  // namespace stepgraph
