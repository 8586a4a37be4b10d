// ResidualStack: the residual trunk of a language model, fed activations:
// N residual blocks, a final norm and an LM head (Linear without bias),
// x [tokens, hidden] -> logits [tokens, vocab]. With heads > 0 each block is
// a TransformerLayer (TransformerEngine's layout):
//   h = h + MultiheadAttention(h)    (causal, over packed sequences: cu_seqlens)
//   h = h + MLP(h)
// and with heads = 0 an MLP block alone, h = h + MLP(h). The MLP is a
// dense LayerNormMLP, or with experts > 0 a mixture-of-experts MoEMLP in
// every moe_every-th block (see ResidualStackConfig). The whole model on
// tokens is LanguageModel (language_model.h: an embedding, then this stack);
// TrainStep (train_step.h) adds the loss and the optimizer to either.
//
// Note [Tensor-parallel ResidualStack]
// With a tensor-parallel communicator of N ranks (Megatron's tensor and
// sequence parallelism) each rank holds 1/N of the tokens outside the
// blocks: x, the residual stream and the final norm's output are
// [tokens / N, hidden]. Each block shards its attention heads (Note
// [Tensor-parallel attention]: cu_seqlens is the packing of every rank's
// tokens, rank r's shard being rows [r T/N, (r+1) T/N) of them) and its ffn
// (Note [Sequence-parallel LayerNormMLP], Note [Tensor-parallel MoE]) and
// meets its collectives as the config's `overlap` says; the head is vocabulary-parallel
// (VocabParallelHead): it gathers the tokens, and the logits are every
// token's over this rank's vocabulary slice, [tokens, vocab / N], whose loss
// is loss()'s vocabulary-parallel cross-entropy over the labels of every
// rank's tokens (gather_labels). The norms saw only this rank's tokens, so
// their gradients are all-reduced across the ranks in the backward (the
// final norm's here, each block's in its attention and MLP), and each
// parameter group holds this rank's shards and those all-reduced norms.
//
// Note [Context-parallel ResidualStack]
// With a context-parallel communicator of M ranks each rank holds T/M of
// the global batch's T tokens, its two zig-zag chunks (Note
// [Context-parallel token layout] in kernels/context_parallel_plan.h;
// train/context_parallel_batch.h cuts a global batch so), and cu_seqlens is
// the packing of all T. forward() makes the rank's plan of it once and every
// block's attention runs context-parallel on it (Note [Context-parallel
// attention layer]); everything else is per token and runs on the rank's
// tokens as it is. Every parameter is replicated over the CP ranks and its
// gradient here is of this rank's tokens only: like data-parallel ranks'
// they must be summed over the CP ranks, and the loss (mean over this
// rank's tokens) averaged, which TrainStep does over its gradient group
// (data x context parallel). With TP as well (a TP group inside each CP
// rank) x is the TP rank's shard of the CP rank's tokens, cu_seqlens still
// all T, and the TP collectives and the vocabulary-parallel head act within
// the CP rank. Attention is required (heads > 0); MoE blocks and dropout
// are not supported with CP yet (an Error).
//
// Note [Expert-parallel ResidualStack]
// With an expert-parallel communicator of P ranks every MoE block spreads its
// experts over the ranks (Note [Expert-parallel MoE] in layers/moe_mlp.h) and
// everything else is replicated: each rank runs the whole stack on its own
// tokens, as a data-parallel rank does. So the replicated parameters'
// gradients must be summed over the P ranks (and the loss averaged), while
// the experts' gradients already hold every rank's tokens and are whole on
// their rank: expert_parameters() lists them, and TrainStep leaves them out
// of its data-parallel reduction (its data-parallel group is then this one).
// Expert x data parallelism (Megatron's layout): DP replicas of this EP
// group, EP x DP ranks with EP innermost (world rank w is EP rank w % EP of
// replica w / EP; train/expert_data_parallel_groups.h makes the groups).
// Each rank still trains its own tokens, so the replicated gradients are
// summed over the whole world, and an expert's gradient, whole over its EP
// group's tokens, is summed over the DP ranks that hold the same expert
// (the expert-data-parallel group: the same EP rank in every replica).
// TrainStep does both (GradientGroups: data_parallel the world,
// expert_data_parallel that group); this stack only takes its EP group.
// Not with tensor or context parallelism yet (an Error).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <variant>
#include <vector>

#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "layers/gradients_ready.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "layers/moe_mlp.h"
#include "layers/multihead_attention.h"
#include "layers/norm.h"
#include "layers/vocab_parallel_head.h"
#include "ops/loss_ops.h"

namespace stepgraph {

struct ResidualStackConfig {
  std::int64_t hidden = 256;
  std::int64_t ffn = 1024;
  std::int64_t layers = 4;
  std::int64_t vocab = 512;
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
  std::uint32_t seed = 1;
  // Mixture of experts: with experts > 0, every moe_every-th block (blocks
  // moe_every-1, 2*moe_every-1, ...: with moe_every = 1 all of them) is an
  // MoE MLP routing each token to its top-k experts, each expert an fc1/fc2
  // of `ffn`; the others stay dense LayerNormMLP blocks. topk must be 1 to kernels::kMaxTopk (2)
  // and at most experts, and at least one block must be MoE (Error at build
  // time otherwise).
  std::int64_t experts = 0;
  std::int64_t topk = 2;
  std::int64_t moe_every = 2;
  // Every MoE block's load balancing (MoEMLPConfig's aux_loss_coef and
  // bias_update_rate; Note [MoE load balancing] in layers/moe_mlp.h): 0 is off.
  float moe_aux_loss_coef = 0.0f;
  float moe_bias_update_rate = 0.0f;
  // Attention: with heads > 0 every block is a TransformerLayer whose
  // MultiheadAttention has `heads` query heads of hidden / heads features,
  // kv_heads key/value heads (0: heads; fewer: grouped-query attention) and
  // a rotary embedding of base rope_base; forward() then takes cu_seqlens.
  // Tensor-parallel, heads and kv_heads must divide by the TP size (Note
  // [Tensor-parallel attention] in layers/multihead_attention.h).
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  float rope_base = 10000.0f;
  // Tensor-parallel only: how the dense blocks' collectives meet their GEMMs,
  // and the attention's alike (fc1: QKV, fc2: the output projection).
  MLPOverlap overlap;
  // FP8 GEMMs in every block's projections and MLP: attention's
  // QKV and output projections, the dense MLP's fc1 and fc2, and an MoE
  // block's expert products (not block scaling: Note [FP8 GroupedLinear]);
  // the embedding, attention itself, the norms, the router and the head stay
  // 16-bit.
  std::optional<Fp8Recipe> fp8;
  // The dense blocks keep fc1's pre-activation only and compute GeLU again
  // in the backward (Note [Recomputed activation] in layers/layernorm_mlp.h),
  // and so do the 16-bit MoE blocks' experts (MoEMLPConfig, the same bits).
  bool recompute_activation = false;
  // The probability of dropping each element of the stack's input and of
  // every attention and MLP output before its residual add (Note [Dropout
  // in a captured step]); 0: no dropout ops at all.
  float dropout = 0.0f;
};

// Note [Dropout in a captured step]
// The generator is Philox (kernels/philox.h) with its state {seed, counter}
// in a persistent int64 [2] tensor, rng_state(): every dropout op reads it
// on the device, so one captured step draws new numbers at every replay.
// The forward's dropout sites are numbered (the input, then each block's
// attention and MLP outputs), each [tokens, hidden] taking D =
// dropout_draws(tokens * hidden) draws at offset site * D past the counter;
// the backward applies the same masks to the gradients by calling dropout
// with the same offsets (nothing is saved), then advances the counter by
// the step's draws. Eager and graph read the same state: the same bits. The
// state is a StateTensor, so checkpoints resume the numbers exactly. With
// tensor parallelism a rank's [T/N, hidden] rows are rows [r T/N, (r+1) T/N)
// of one rank's tensor, and its call starts at those rows' draws (offset
// site * D + r T/N hidden / 4, D of the whole T): the ranks drop exactly the
// elements one rank drops (hidden a multiple of 4). Not with context
// parallelism yet (an Error).

class ResidualStack {
 public:
  struct BlockSaved {
    std::optional<MultiheadAttention::Saved> attention;  // set in TransformerLayers (heads > 0)
    std::variant<LayerNormMLP::Saved, MoEMLP::Saved> mlp;
  };
  struct Saved {
    std::vector<BlockSaved> blocks;
    Norm::Saved final_norm;
    VocabParallelHead::Saved head;
    // The MoE blocks' auxiliary losses summed, fp32 [1] (undefined without
    // moe_aux_loss_coef): for reporting, the backward does not read it.
    Tensor aux_loss;
  };
  struct Forward {
    Tensor logits;  // [tokens, vocab] ([all tokens, vocab / N] tensor-parallel)
    Saved saved;
  };

  // `tensor_parallel`: See Note [Tensor-parallel ResidualStack]; null (the
  // default) is the model on one rank. A config with a tensor_parallel_gap
  // and a tensor-parallel communicator is Error(kUnsupported).
  // How the stack builds its pieces, for code that builds them alone
  // (the GPT's pipeline stages, train/gpt_stage_layers.h): a piece built
  // from these holds the same parameters as the stack's.
  static std::uint32_t block_seed(const ResidualStackConfig& config, std::int64_t block);
  static std::uint32_t head_seed(const ResidualStackConfig& config) { return config.seed + 7919; }
  static MultiheadAttentionConfig attention_config(const ResidualStackConfig& config);  // seed: block_seed + 8
  static LayerNormMLPConfig dense_mlp_config(const ResidualStackConfig& config);         // seed: block_seed
  static NormConfig final_norm_config(const ResidualStackConfig& config);

  // `context_parallel`: Note [Context-parallel ResidualStack]; null: none.
  // `expert_parallel`: Note [Expert-parallel ResidualStack]; null: every
  // rank holds every expert. It needs experts > 0 dividing by its size.
  ResidualStack(Context& ctx, const ResidualStackConfig& config, Communicator* tensor_parallel = nullptr,
                Communicator* context_parallel = nullptr, Communicator* expert_parallel = nullptr);

  // What of `config` a tensor-parallel stack cannot hold yet ("dropout
  // (0.1) with hidden 30 (not a multiple of 4)"), or nothing. The constructor refuses it;
  // a program may ask first, to name its own flags.
  static std::optional<std::string> tensor_parallel_gap(const ResidualStackConfig& config);

  // x: [tokens, hidden] (this rank's [tokens / N, hidden]); with attention
  // (heads > 0) cu_seqlens int32 [sequences + 1] says where each packed
  // sequence starts (kernels/attention.h), and without it must be undefined.
  Forward forward(Context& ctx, const Tensor& x, const Tensor& cu_seqlens = {}) const;
  bool has_attention() const { return config_.heads > 0; }

  // The mean softmax cross-entropy of the forward's logits and d loss /
  // d logits: vocabulary-parallel over the tensor-parallel ranks, whose
  // labels are every rank's (gather_labels).
  ops::CrossEntropyResult loss(Context& ctx, const Tensor& logits, const Tensor& labels, const Tensor& error_flag,
                               const ops::CrossEntropyParams& params = {}) const;
  // The labels loss() takes from this rank's labels [tokens / N]: every
  // rank's, in rank order (an all-gather); the same tensor without TP.
  Tensor gather_labels(Context& ctx, const Tensor& labels) const;
  Communicator* tensor_parallel() const { return tp_; }
  Communicator* context_parallel() const { return cp_; }
  Communicator* expert_parallel() const { return ep_; }
  // Under expert parallelism, every MoE block's expert weights and biases
  // (this rank's experts, whose gradients are never summed over the group);
  // empty without it (Note [Expert-parallel ResidualStack]).
  std::vector<Parameter*> expert_parameters();
  // The global batch's tokens from this rank's rows: rows x TP size (under
  // sequence parallelism) x CP size.
  std::int64_t global_tokens(std::int64_t rows) const;
  // Called during the backward with the index of a parameter group (see
  // parameter_group_sizes) as soon as that group's gradients are final.
  using GradientsReady = stepgraph::GradientsReady;

  // Writes every parameter gradient; returns d loss / d x.
  Tensor backward(Context& ctx, const Saved& saved, const Tensor& dlogits, const GradientsReady& ready = {}) const;

  // Error if an MoE block's routing went wrong in a step since the last
  // check (reads device error words: after a step, never inside one).
  void check_errors(Context& ctx) const;

  const ResidualStackConfig& config() const { return config_; }
  std::vector<Parameter*> parameters();
  // Every block's FP8 scaling state, the dropout generator's state and the
  // MoE blocks' expert biases (StateTensor): for checkpoints.
  std::vector<StateTensor> state() const;
  // The dropout generator's {seed, counter}, int64 [2] (undefined without dropout).
  const Tensor& rng_state() const { return rng_; }
  // FP8: the quantizations of every block that met a non-finite amax, over
  // every step so far (one counter the blocks share); 0 without FP8.
  std::int64_t non_finite_amaxes(Context& ctx) const;
  // FP8 delayed scaling under data parallelism: every block's amaxes
  // max-all-reduced over `group` (Linear::set_amax_group); TrainStep sets it.
  void set_fp8_amax_group(Communicator* group);
  // Every MoE block's load-balancing setup (Note [MoE load balancing] in
  // layers/moe_mlp.h); TrainStep sets it.
  void set_moe_balance(const MoEBalanceSetup& setup);
  // parameters() in consecutive groups: per block its attention (with
  // attention) and its MLP, then the final norm, the head. The backward
  // finishes them in reverse order.
  std::vector<std::size_t> parameter_group_sizes();
  // Whether block i is an MoE block.
  bool is_moe_block(std::int64_t i) const;

 private:
  // One residual block: exactly one of dense and moe is set; attention in
  // TransformerLayers.
  struct Block {
    std::unique_ptr<MultiheadAttention> attention;
    std::unique_ptr<LayerNormMLP> dense;
    std::unique_ptr<MoEMLP> moe;
  };

  ResidualStackConfig config_;
  Communicator* tp_ = nullptr;
  Communicator* cp_ = nullptr;
  Communicator* ep_ = nullptr;
  std::vector<Block> blocks_;
  std::vector<Linear*> fp8_linears() const;  // every block's FP8 Linears, in block order
  std::vector<GroupedLinear*> fp8_experts() const;  // every MoE block's FP8 expert layers
  static std::vector<Parameter*> mlp_parameters(const Block& block);
  // The parameter group of block `block`'s MLP; its attention's is the one before.
  std::size_t mlp_group(std::size_t block) const;
  Tensor fp8_non_finite_;  // FP8: the counter every block's Linears share
  Tensor rng_;             // dropout's {seed, counter}
  // Dropout site `site` of a step over `tokens` rows (Note [Dropout in a captured step]).
  Tensor dropout(Context& ctx, const Tensor& x, std::int64_t site) const;
  std::int64_t dropout_sites() const { return 1 + 2 * static_cast<std::int64_t>(blocks_.size()); }
  std::int64_t tp_ranks() const { return tp_ != nullptr ? tp_->world_size() : 1; }
  std::unique_ptr<Norm> final_norm_;
  std::unique_ptr<VocabParallelHead> head_;
};

}  // namespace stepgraph
