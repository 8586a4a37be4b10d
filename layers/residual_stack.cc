#include "layers/residual_stack.h"

#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "engine/error.h"
#include "layers/fp8_operand.h"
#include "layers/layer_checks.h"
#include "ops/activation_ops.h"
#include "kernels/dropout.h"
#include "kernels/moe_routing.h"
#include "ops/collective_ops.h"
#include "ops/dropout_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/stream_ops.h"

namespace stepgraph {

std::optional<std::string> ResidualStack::tensor_parallel_gap(const ResidualStackConfig& config) {
  // A rank's dropout draws start at its first row's (Note [Dropout in a
  // captured step]): whole 4-element draws only.
  if (config.dropout > 0.0f && config.hidden % 4 != 0) {
    return detail::concat("dropout (", config.dropout, ") with hidden ", config.hidden, " (not a multiple of 4)");
  }
  return std::nullopt;
}

ResidualStack::ResidualStack(Context& ctx, const ResidualStackConfig& config, Communicator* tensor_parallel,
                             Communicator* context_parallel, Communicator* expert_parallel)
    : config_(config), tp_(tensor_parallel), cp_(context_parallel), ep_(expert_parallel) {
  SG_CHECK(config.layers >= 0 && config.vocab > 0, "ResidualStack: layers must be >= 0 and vocab > 0, got ",
           config.layers, " and ", config.vocab);
  // The loss reads the logits in 16-byte vectors (kernels/cross_entropy):
  // refuse here, at construction, rather than at the first step or capture.
  const auto logits_width = static_cast<std::int64_t>(16 / dtype_size(config.dtype));
  SG_CHECK(config.vocab % logits_width == 0, "ResidualStack: vocab ", config.vocab, " must be a multiple of ",
           logits_width, " for ", dtype_name(config.dtype),
           " logits (the loss reads 16-byte vectors); pad the vocabulary and never use the padded classes as labels");
  SG_CHECK(config.experts >= 0, "ResidualStack: experts must be >= 0 (0: no MoE blocks), got ", config.experts);
  if (config.experts > 0) {
    SG_CHECK(config.topk >= 1 && config.topk <= kernels::kMaxTopk, "ResidualStack: topk must be in [1, ",
             kernels::kMaxTopk, "], got ", config.topk);
    SG_CHECK(config.topk <= config.experts, "ResidualStack: topk (", config.topk, ") must not exceed experts (",
             config.experts, "): each token goes to topk distinct experts");
    SG_CHECK(config.moe_every >= 1 && config.moe_every <= config.layers,
             "ResidualStack: moe_every must be in [1, layers = ", config.layers,
             "] so that some block is an MoE block, got ", config.moe_every);
  }
  // Load balancing (Note [MoE load balancing] in layers/moe_mlp.h) needs MoE blocks to balance.
  for (const auto& [field, value] : {std::pair{"moe_aux_loss_coef", config.moe_aux_loss_coef},
                                     std::pair{"moe_bias_update_rate", config.moe_bias_update_rate}}) {
    SG_CHECK(std::isfinite(value) && value >= 0.0f, "ResidualStack: ", field, " must be finite and >= 0 (0: off), got ",
             value);
    SG_CHECK(value == 0.0f || config.experts > 0, "ResidualStack: ", field, " (", value,
             ") balances the MoE blocks' experts, but experts is 0; set experts > 0, or leave ", field, " at 0");
  }
  SG_CHECK(config.heads >= 0, "ResidualStack: heads must be >= 0 (0: no attention), got ", config.heads);
  SG_CHECK(std::isfinite(config.dropout) && config.dropout >= 0.0f && config.dropout < 1.0f,
           "ResidualStack: dropout must be in [0, 1), got ", config.dropout);
  if (tensor_parallel != nullptr) {
    const std::optional<std::string> gap = tensor_parallel_gap(config);
    SG_CHECK_CODE(!gap, ErrorCode::kUnsupported, "ResidualStack: ", gap.value_or(""),
                  " is not supported with tensor parallelism yet; use data parallelism, or leave it out");
  }
  if (context_parallel != nullptr) {
    context_parallel->check_device(ctx.device(), "ResidualStack (context parallel)");
    SG_CHECK_CODE(config.heads > 0, ErrorCode::kUnsupported, "ResidualStack: context parallelism over ",
                  context_parallel->describe(),
                  " splits attention's sequences, but heads is 0 (no attention); "
                  "give heads > 0, or use data parallelism");
    SG_CHECK_CODE(config.experts == 0 && config.dropout == 0.0f, ErrorCode::kUnsupported, "ResidualStack: experts (",
                  config.experts, ") and dropout (", config.dropout,
                  ") are not supported with context parallelism yet; set both to 0, or leave context "
                  "parallelism out");
  }
  if (expert_parallel != nullptr) {
    SG_CHECK_CODE(tensor_parallel == nullptr, ErrorCode::kUnsupported,
                  "ResidualStack: expert parallelism over ", expert_parallel->describe(),
                  " together with tensor parallelism over ", tensor_parallel != nullptr ? tensor_parallel->describe() : "",
                  " is not supported yet; pass tensor_parallel or expert_parallel, not both");
    SG_CHECK(config.experts > 0, "ResidualStack: expert_parallel (", expert_parallel->describe(),
             ") spreads the MoE blocks' experts, but experts is 0; set experts > 0, or pass no expert_parallel");
  }
  if (config.dropout > 0.0f) {
    rng_ = ctx.persistent("rng.state", {Shape{2}, DType::kInt64});
    // The seed spread over 64 bits (the golden-ratio multiplier; unsigned, so it wraps), as the key's bits.
    const std::uint64_t key = static_cast<std::uint64_t>(config.seed) * 0x9E3779B97F4A7C15ULL + 1;
    const std::int64_t initial[2] = {static_cast<std::int64_t>(key), 0};
    ctx.copy_from_host(rng_, initial, sizeof(initial));
  }
  for (std::int64_t i = 0; i < config.layers; ++i) {
    const std::string name = "block" + std::to_string(i);
    const std::uint32_t seed = block_seed(config, i);
    Block block;
    if (config.heads > 0) {
      block.attention = std::make_unique<MultiheadAttention>(ctx, name + ".attention", attention_config(config),
                                                             seed + 8, tensor_parallel, context_parallel);
    }
    if (is_moe_block(i)) {
      const MoEMLPConfig moe{.hidden = config.hidden,
                             .ffn = config.ffn,
                             .experts = config.experts,
                             .topk = static_cast<int>(config.topk),
                             .norm = config.norm,
                             .eps = config.eps,
                             .dtype = config.dtype,
                             .fp8 = config.fp8,
                             .recompute_activation = config.recompute_activation,
                             .aux_loss_coef = config.moe_aux_loss_coef,
                             .bias_update_rate = config.moe_bias_update_rate};
      block.moe = std::make_unique<MoEMLP>(ctx, name, moe, seed, tensor_parallel, expert_parallel);
    } else {
      block.dense = std::make_unique<LayerNormMLP>(ctx, name, dense_mlp_config(config), seed, tensor_parallel);
    }
    blocks_.push_back(std::move(block));
  }
  if (config.fp8) {
    fp8_non_finite_ = detail::make_non_finite_counter(ctx, "fp8.non_finite_amaxes");
    for (Linear* linear : fp8_linears()) linear->share_non_finite_counter(fp8_non_finite_);
    for (GroupedLinear* experts : fp8_experts()) experts->share_non_finite_counter(fp8_non_finite_);
  }
  final_norm_ = std::make_unique<Norm>(ctx, "final_norm", final_norm_config(config));
  head_ = std::make_unique<VocabParallelHead>(
      ctx, "head", VocabParallelHeadConfig{.hidden = config.hidden, .vocab = config.vocab, .dtype = config.dtype},
      head_seed(config), tensor_parallel);
}

std::uint32_t ResidualStack::block_seed(const ResidualStackConfig& config, std::int64_t block) {
  return config.seed + 16 * static_cast<std::uint32_t>(block);
}

MultiheadAttentionConfig ResidualStack::attention_config(const ResidualStackConfig& config) {
  return {.hidden = config.hidden,
          .heads = config.heads,
          .kv_heads = config.kv_heads,
          .norm = config.norm,
          .eps = config.eps,
          .dtype = config.dtype,
          .rope_base = config.rope_base,
          .fp8 = config.fp8,
          .sequence_parallel = true,
          .overlap = config.overlap};
}

LayerNormMLPConfig ResidualStack::dense_mlp_config(const ResidualStackConfig& config) {
  return {.hidden = config.hidden,
          .ffn = config.ffn,
          .norm = config.norm,
          .eps = config.eps,
          .dtype = config.dtype,
          .overlap = config.overlap,
          .fp8 = config.fp8,
          .recompute_activation = config.recompute_activation};
}

NormConfig ResidualStack::final_norm_config(const ResidualStackConfig& config) {
  return {.kind = config.norm, .hidden = config.hidden, .eps = config.eps, .dtype = config.dtype};
}

ops::CrossEntropyResult ResidualStack::loss(Context& ctx, const Tensor& logits, const Tensor& labels,
                                            const Tensor& error_flag, const ops::CrossEntropyParams& params) const {
  return head_->loss(ctx, logits, labels, error_flag, params);
}

Tensor ResidualStack::gather_labels(Context& ctx, const Tensor& labels) const {
  return tp_ != nullptr ? ops::all_gather(ctx, *tp_, labels) : labels;
}

std::int64_t ResidualStack::global_tokens(std::int64_t rows) const {
  return rows * (tp_ != nullptr ? tp_->world_size() : 1) * (cp_ != nullptr ? cp_->world_size() : 1);
}

bool ResidualStack::is_moe_block(std::int64_t i) const {
  return config_.experts > 0 && (i + 1) % config_.moe_every == 0;
}

std::vector<Parameter*> ResidualStack::parameters() {
  std::vector<Parameter*> out;
  for (Block& block : blocks_) {
    if (block.attention) {
      for (Parameter* p : block.attention->parameters()) out.push_back(p);
    }
    for (Parameter* p : block.moe ? block.moe->parameters() : block.dense->parameters()) out.push_back(p);
  }
  for (Parameter* p : final_norm_->parameters()) out.push_back(p);
  for (Parameter* p : head_->parameters()) out.push_back(p);
  return out;
}

std::vector<Parameter*> ResidualStack::expert_parameters() {
  std::vector<Parameter*> out;
  if (ep_ == nullptr) return out;
  for (Block& block : blocks_) {
    if (block.moe) {
      for (Parameter* p : block.moe->expert_parameters()) out.push_back(p);
    }
  }
  return out;
}

std::vector<Linear*> ResidualStack::fp8_linears() const {
  std::vector<Linear*> out;
  auto add = [&out](const std::vector<Linear*>& linears) { out.insert(out.end(), linears.begin(), linears.end()); };
  for (const Block& block : blocks_) {
    if (block.attention) add(block.attention->fp8_linears());
    if (block.dense) add(block.dense->fp8_linears());
  }
  return out;
}

std::vector<GroupedLinear*> ResidualStack::fp8_experts() const {
  std::vector<GroupedLinear*> out;
  for (const Block& block : blocks_) {
    if (block.moe) {
      for (GroupedLinear* experts : block.moe->fp8_experts()) out.push_back(experts);
    }
  }
  return out;
}

std::vector<StateTensor> ResidualStack::state() const {
  std::vector<StateTensor> out = state_of(fp8_linears());
  if (rng_.defined()) out.push_back({"rng.state", rng_});
  for (const GroupedLinear* experts : fp8_experts()) {
    for (StateTensor& t : experts->state()) out.push_back(std::move(t));
  }
  for (const Block& block : blocks_) {
    if (block.moe) {
      for (StateTensor& t : block.moe->state()) out.push_back(std::move(t));
    }
  }
  return out;
}

ResidualStack::Forward ResidualStack::forward(Context& ctx, const Tensor& x, const Tensor& cu_seqlens) const {
  check_input("ResidualStack", "forward", "input", x, {"tokens", config_.hidden}, config_.dtype);
  if (has_attention()) {
    check_input("ResidualStack", "forward", "cu_seqlens", cu_seqlens, {"sequences + 1"}, DType::kInt32,
                "the packing of the sequences attention runs over");
  } else {
    SG_CHECK(!cu_seqlens.defined(), "ResidualStack forward: cu_seqlens given, but the blocks have no attention "
             "(heads = 0)");
  }
  // Context-parallel: the rank's plan of the global packing, once for every block.
  std::optional<ops::ContextParallelPlan> plan;
  if (cp_ != nullptr) {
    plan = ops::context_parallel_plan(
        ctx, {.ranks = cp_->world_size(), .rank = cp_->rank(), .tokens = global_tokens(x.shape().dim(0))}, cu_seqlens);
  }
  Forward out;
  Tensor h = dropout(ctx, x, 0);
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    const Block& block = blocks_[i];
    const auto site = static_cast<std::int64_t>(1 + 2 * i);  // attention's; the MLP's is the next
    BlockSaved saved;
    if (block.attention) {
      MultiheadAttention::Forward a = block.attention->forward(ctx, {h, cu_seqlens, plan});
      h = ops::residual_add(ctx, h, dropout(ctx, a.y, site));
      saved.attention = std::move(a.saved);
    }
    Tensor y;
    if (block.moe) {
      MoEMLP::Forward f = block.moe->forward(ctx, {h});
      y = f.y;
      saved.mlp = std::move(f.saved);
      if (f.aux_loss.defined()) {
        out.saved.aux_loss = out.saved.aux_loss.defined() ? ops::add(ctx, out.saved.aux_loss, f.aux_loss) : f.aux_loss;
      }
    } else {
      LayerNormMLP::Forward f = block.dense->forward(ctx, {h});
      y = f.y;
      saved.mlp = std::move(f.saved);
    }
    out.saved.blocks.push_back(std::move(saved));
    h = ops::residual_add(ctx, h, dropout(ctx, y, site + 1));
  }
  const Norm::Forward normed = final_norm_->forward(ctx, {h});
  const VocabParallelHead::Forward logits = head_->forward(ctx, {normed.y});
  out.logits = logits.logits;
  out.saved.final_norm = normed.saved;
  out.saved.head = logits.saved;
  return out;
}

std::vector<std::size_t> ResidualStack::parameter_group_sizes() {
  std::vector<std::size_t> sizes;
  for (Block& block : blocks_) {
    if (block.attention) sizes.push_back(block.attention->parameters().size());
    sizes.push_back(mlp_parameters(block).size());
  }
  sizes.push_back(final_norm_->parameters().size());
  sizes.push_back(head_->parameters().size());
  return sizes;
}

std::vector<Parameter*> ResidualStack::mlp_parameters(const Block& block) {
  return block.moe ? block.moe->parameters() : block.dense->parameters();
}

std::size_t ResidualStack::mlp_group(std::size_t block) const {
  return blocks_[block].attention ? 2 * block + 1 : block;  // every block has attention, or none has
}

Tensor ResidualStack::backward(Context& ctx, const Saved& saved, const Tensor& dlogits,
                               const GradientsReady& ready) const {
  SG_CHECK(saved.blocks.size() == blocks_.size(), "ResidualStack backward: saved.blocks must hold ", blocks_.size(),
           " blocks (the forward's), got ", saved.blocks.size());
  check_input("ResidualStack", "backward", "saved.head.linear.x", saved.head.linear.x, {"tokens", config_.hidden},
              config_.dtype, "the forward's (gathered) normed output");
  check_input("ResidualStack", "backward", "dlogits", dlogits,
              {saved.head.linear.x.shape().dim(0), head_->local_vocab()}, config_.dtype, "the forward's logits");
  auto done = [&](std::size_t group) {
    if (ready) ready(group);
  };
  // The weight-gradient stream joins back one group behind, so the
  // activations the later group's weight gradients read leave the pool
  // (Note [Joining the weight-gradient stream] in ops/stream_ops.h), and
  // step-scoped gradients once their update read them. A block with
  // attention is two groups, so its MLP's gradients go before its
  // attention's backward (the MoE experts' are a block's most).
  std::vector<Parameter*> joined_next = head_->parameters();
  auto done_and_join = [&](std::size_t group, std::vector<Parameter*> params) {
    done(group);
    ops::order_after(ctx, join_tensors_of(joined_next));
    joined_next = std::move(params);
  };
  const std::size_t head_group = blocks_.empty() ? 1 : mlp_group(blocks_.size() - 1) + 2;
  const Tensor d_normed = head_->backward(ctx, saved.head, {dlogits});
  done(head_group);
  Tensor dh = final_norm_->backward(ctx, saved.final_norm, {d_normed});
  // Its gamma and beta saw only this rank's tokens.
  if (tp_ != nullptr) ops::all_reduce_many_(ctx, *tp_, final_norm_->gradients(), ReduceOp::kSum);
  done(head_group - 1);
  for (std::size_t i = blocks_.size(); i-- > 0;) {
    const Block& block = blocks_[i];
    const BlockSaved& block_saved = saved.blocks[i];
    const auto site = static_cast<std::int64_t>(1 + 2 * i);
    // A dropped output's gradient: the forward's mask applied to dh.
    const Tensor d_mlp_out = dropout(ctx, dh, site + 1);
    // Each block's backward returns its dx with dh added in its norm's pass.
    dh = block.moe ? block.moe->backward(ctx, std::get<MoEMLP::Saved>(block_saved.mlp), {d_mlp_out, dh})
                   : block.dense->backward(ctx, std::get<LayerNormMLP::Saved>(block_saved.mlp), {d_mlp_out, dh});
    done_and_join(mlp_group(i), mlp_parameters(block));
    if (block.attention) {
      SG_CHECK(block_saved.attention.has_value(), "ResidualStack backward: block ", i,
               " has attention but its saved state has none (a Saved from another stack?)");
      dh = block.attention->backward(ctx, *block_saved.attention, {dropout(ctx, dh, site), dh});
      done_and_join(mlp_group(i) - 1, block.attention->parameters());
    }
  }
  dh = dropout(ctx, dh, 0);
  // The next step's numbers (Note [Dropout in a captured step]).
  if (rng_.defined()) ops::rng_advance_(ctx, rng_, dropout_sites() * kernels::dropout_draws(dh.numel() * tp_ranks()));
  return dh;
}

Tensor ResidualStack::dropout(Context& ctx, const Tensor& x, std::int64_t site) const {
  if (config_.dropout == 0.0f) return x;
  // Tensor-parallel, x is rows [r T/N, (r+1) T/N) of one rank's [T, hidden]:
  // its draws start where those rows' do, so the ranks drop one rank's elements.
  const std::int64_t rank = tp_ != nullptr ? tp_->rank() : 0;
  const std::int64_t offset = site * kernels::dropout_draws(x.numel() * tp_ranks()) + rank * x.numel() / 4;
  return ops::dropout(ctx, x, rng_, {.p = config_.dropout, .offset = offset});
}

void ResidualStack::check_errors(Context& ctx) const {
  for (const Block& block : blocks_) {
    if (block.moe) block.moe->check_errors(ctx);
  }
  if (config_.fp8) check_non_finite_amaxes(non_finite_amaxes(ctx), *config_.fp8, "ResidualStack");
}

void ResidualStack::set_moe_balance(const MoEBalanceSetup& setup) {
  for (Block& block : blocks_) {
    if (block.moe) block.moe->set_balance(setup);
  }
}

void ResidualStack::set_fp8_amax_group(Communicator* group) {
  for (Linear* linear : fp8_linears()) linear->set_amax_group(group);
  for (GroupedLinear* experts : fp8_experts()) experts->set_amax_group(group);
}

std::int64_t ResidualStack::non_finite_amaxes(Context& ctx) const {
  return detail::read_non_finite_counter(ctx, fp8_non_finite_);
}

}  // namespace stepgraph
