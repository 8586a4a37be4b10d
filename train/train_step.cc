#include "train/train_step.h"

#include <functional>
#include <unordered_set>
#include <utility>

#include "engine/error.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/loss_ops.h"
#include "ops/step_guard_ops.h"
#include "train/expert_data_parallel_groups.h"

namespace stepgraph {

std::string_view data_parallel_mode_name(DataParallelMode mode) {
  return mode == DataParallelMode::kZero1 ? "zero1" : "allreduce";
}

// The model side of a step: it owns the model's persistent inputs (and their
// error flags); forward reads them and hands back the logits with the
// backward of that forward.
class TrainStep::ModelSide {
 public:
  struct Forward {
    Tensor logits;  // [rows, vocab]
    Tensor aux_loss;  // the MoE blocks' auxiliary losses summed, fp32 [1]; undefined without
    // Writes every parameter gradient from d loss / d logits, calling `ready`
    // as each parameter group's gradients become final.
    std::function<void(const Tensor& dlogits, const GradientsReady& ready)> backward;
  };

  virtual ~ModelSide() = default;
  virtual const Tensor& inputs() const = 0;
  // cu_seqlens of a model with attention; undefined otherwise.
  const Tensor& packing() const { return packing_; }
  // Rows of the logits, one label each.
  virtual std::int64_t rows() const = 0;
  virtual Forward forward(Context& ctx) const = 0;
  virtual std::vector<std::size_t> parameter_group_sizes() = 0;
  virtual std::vector<Parameter*> parameters() = 0;
  // Under expert parallelism, the experts' parameters (empty without).
  virtual std::vector<Parameter*> expert_parameters() = 0;
  virtual std::int64_t vocab() const = 0;
  // The model's stack: its loss and its tensor-parallel group, if any.
  virtual const ResidualStack& stack() const = 0;
  // Errors of the inputs, checked before the labels (a bad token explains a
  // bad label better than the other way round).
  virtual void check_input_errors(Context& ctx) const = 0;
  // The model's own device error words (MoE routing and split sizes).
  virtual void check_model_errors(Context& ctx) const = 0;
  // FP8 delayed scaling's amaxes reduced over the data-parallel group.
  virtual void set_fp8_amax_group(Communicator* group) = 0;
  // The MoE blocks' load balancing (Note [MoE load balancing] in layers/moe_mlp.h).
  virtual void set_moe_balance(const MoEBalanceSetup& setup) = 0;

 protected:
  // With attention: a persistent cu_seqlens [sequences + 1], filled with
  // `sequences` sequences of tokens / sequences each. Tensor-parallel, the
  // rank's tokens and sequences are 1/N of its group's, and the packing is
  // the group's: N times as many (Note [Tensor-parallel attention]).
  void make_packing(Context& ctx, std::int64_t tokens, std::int64_t sequences, const ResidualStack& stack) {
    SG_CHECK(sequences > 0 && tokens % sequences == 0, "TrainStep: ", tokens,
             " tokens do not split into sequences of equal length (sequences = ", sequences, ")");
    const std::int64_t ranks = stack.global_tokens(1);  // the TP x CP group's rows per rank's row
    tokens *= ranks;
    sequences *= ranks;
    std::vector<std::int32_t> cu(static_cast<std::size_t>(sequences + 1));
    for (std::int64_t s = 0; s <= sequences; ++s) cu[s] = static_cast<std::int32_t>(s * (tokens / sequences));
    set_packing(ctx, tokens, cu);
  }
  // A persistent cu_seqlens [sequences + 1] for packings of any lengths:
  // first one sequence of all the tokens, then empty ones. Tensor-parallel,
  // the tokens are the group's, N times the rank's; `sequences` already
  // counts the group's.
  void make_open_packing(Context& ctx, std::int64_t tokens, std::int64_t sequences, const ResidualStack& stack) {
    SG_CHECK(sequences > 0, "TrainStep: a packing needs at least one sequence, got ", sequences);
    tokens = stack.global_tokens(tokens);
    SG_CHECK(tokens < (std::int64_t{1} << 31), "TrainStep: ", tokens, " tokens exceed cu_seqlens' int32");
    std::vector<std::int32_t> cu(static_cast<std::size_t>(sequences + 1), static_cast<std::int32_t>(tokens));
    cu[0] = 0;
    set_packing(ctx, tokens, cu);
  }

 private:
  // packing_: a persistent int32 copy of `cu`, the cu_seqlens of `tokens` tokens.
  void set_packing(Context& ctx, std::int64_t tokens, const std::vector<std::int32_t>& cu) {
    SG_CHECK(tokens < (std::int64_t{1} << 31), "TrainStep: ", tokens, " tokens exceed cu_seqlens' int32");
    packing_ = ctx.persistent("step.cu_seqlens", {Shape{static_cast<std::int64_t>(cu.size())}, DType::kInt32});
    ctx.copy_from_host(packing_, cu.data(), cu.size() * sizeof(std::int32_t));
  }

  Tensor packing_;
};

namespace {

// Where each model kind's forward keeps its stack's summed auxiliary loss.
const Tensor& aux_loss_of(const ResidualStack::Saved& saved) { return saved.aux_loss; }
const Tensor& aux_loss_of(const LanguageModel::Saved& saved) { return saved.stack.aux_loss; }

std::int64_t checked_rows(std::int64_t rows, const char* what) {
  SG_CHECK(rows > 0, "TrainStep: ", what, " must be > 0, got ", rows);
  return rows;
}

// What both kinds share over their model type M: the backward of M's
// forward (its Saved kept by the closure), the parameter groups and M's
// error words.
template <typename M>
class ModelSideOf : public TrainStep::ModelSide {
 public:
  Forward forward(Context& ctx) const final {
    typename M::Forward f = model_forward(ctx);
    const Tensor aux = aux_loss_of(f.saved);
    return {f.logits, aux,
            [&ctx, this, saved = std::move(f.saved)](const Tensor& dlogits, const GradientsReady& ready) {
              model_.backward(ctx, saved, dlogits, ready);
            }};
  }
  std::vector<std::size_t> parameter_group_sizes() final { return model_.parameter_group_sizes(); }
  std::vector<Parameter*> parameters() final { return model_.parameters(); }
  std::vector<Parameter*> expert_parameters() final { return model_.expert_parameters(); }
  void check_model_errors(Context& ctx) const final { model_.check_errors(ctx); }
  void set_fp8_amax_group(Communicator* group) final { model_.set_fp8_amax_group(group); }
  void set_moe_balance(const MoEBalanceSetup& setup) final { model_.set_moe_balance(setup); }

 protected:
  explicit ModelSideOf(M& model) : model_(model) {}
  // M's forward from the step's inputs.
  virtual typename M::Forward model_forward(Context& ctx) const = 0;

  M& model_;
};

// A LanguageModel on tokens [batch, context] (window model) or on batch
// sequences of context tokens, [batch * context, 1] (sequence model).
class LanguageModelSide final : public ModelSideOf<LanguageModel> {
 public:
  LanguageModelSide(Context& ctx, LanguageModel& model, std::int64_t batch)
      : ModelSideOf(model),
        tokens_(ctx.persistent("step.tokens", {token_shape(model.config(), batch), DType::kInt32})),
        token_error_(ctx.persistent("step.token_error", {Shape{1}, DType::kInt32})) {
    if (model.config().sequence_model()) make_packing(ctx, tokens_.shape().dim(0), batch, model.stack());
  }
  LanguageModelSide(Context& ctx, LanguageModel& model, TrainStep::PackedTokens packed)
      : ModelSideOf(model),
        tokens_(ctx.persistent("step.tokens", {Shape{packed.tokens, 1}, DType::kInt32})),
        token_error_(ctx.persistent("step.token_error", {Shape{1}, DType::kInt32})) {
    SG_CHECK(model.config().sequence_model(), "TrainStep: packed tokens need a sequence model (with attention); "
             "this LanguageModel is a window model");
    make_open_packing(ctx, packed.tokens, packed.sequences, model.stack());
  }

  const Tensor& inputs() const override { return tokens_; }
  std::int64_t rows() const override { return tokens_.shape().dim(0); }
  std::int64_t vocab() const override { return model_.config().model.vocab; }
  void check_input_errors(Context& ctx) const override {
    SG_CHECK(ctx.to_vector<std::int32_t>(token_error_).at(0) == 0, "an input token was outside [0, ", vocab(),
             "): its embedding does not exist; check the data and --data's vocabulary against the model");
  }

 private:
  static Shape token_shape(const LanguageModelConfig& config, std::int64_t batch) {
    return config.sequence_model() ? Shape{batch * config.context, 1} : Shape{batch, config.context};
  }
  LanguageModel::Forward model_forward(Context& ctx) const override {
    return model_.forward(ctx, tokens_, token_error_, packing());
  }
  const ResidualStack& stack() const override { return model_.stack(); }

  Tensor tokens_;
  Tensor token_error_;
};

// A ResidualStack on activations [tokens, hidden].
class ResidualStackSide final : public ModelSideOf<ResidualStack> {
 public:
  ResidualStackSide(Context& ctx, ResidualStack& model, std::int64_t tokens, std::int64_t sequences)
      : ModelSideOf(model),
        x_(ctx.persistent("step.x", {Shape{tokens, model.config().hidden}, model.config().dtype})) {
    if (model.has_attention()) make_packing(ctx, tokens, sequences, model);
  }

  const Tensor& inputs() const override { return x_; }
  std::int64_t rows() const override { return x_.shape().dim(0); }
  std::int64_t vocab() const override { return model_.config().vocab; }
  void check_input_errors(Context&) const override {}  // activations have no range to check

 private:
  ResidualStack::Forward model_forward(Context& ctx) const override { return model_.forward(ctx, x_, packing()); }
  const ResidualStack& stack() const override { return model_; }

  Tensor x_;
};

}  // namespace

TrainStep::TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, std::int64_t batch,
                     Communicator* data_parallel, DataParallelMode mode)
    : TrainStep(ctx, model, optimizer, batch, GradientGroups{.data_parallel = data_parallel, .mode = mode}) {}

TrainStep::TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, std::int64_t batch,
                     const GradientGroups& groups)
    : TrainStep(ctx, std::make_unique<LanguageModelSide>(ctx, model, checked_rows(batch, "batch")), optimizer,
                groups) {}

TrainStep::TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, PackedTokens packed,
                     Communicator* data_parallel, DataParallelMode mode)
    : TrainStep(ctx, model, optimizer, packed, GradientGroups{.data_parallel = data_parallel, .mode = mode}) {}

TrainStep::TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, PackedTokens packed,
                     const GradientGroups& groups)
    : TrainStep(ctx,
                std::make_unique<LanguageModelSide>(
                    ctx, model,
                    PackedTokens{.tokens = checked_rows(packed.tokens, "tokens"), .sequences = packed.sequences}),
                optimizer, groups) {}

TrainStep::TrainStep(Context& ctx, ResidualStack& model, AdamW& optimizer, std::int64_t tokens,
                     Communicator* data_parallel, DataParallelMode mode, std::int64_t sequences)
    : TrainStep(ctx, model, optimizer, tokens, GradientGroups{.data_parallel = data_parallel, .mode = mode},
                sequences) {}

TrainStep::TrainStep(Context& ctx, ResidualStack& model, AdamW& optimizer, std::int64_t tokens,
                     const GradientGroups& groups, std::int64_t sequences)
    : TrainStep(ctx, std::make_unique<ResidualStackSide>(ctx, model, checked_rows(tokens, "tokens"), sequences),
                optimizer, groups) {}

namespace {

// The optimizer must update exactly the model's parameters: with any other
// set the step trains nothing, or another model, without a word.
void check_optimizer_covers(const std::vector<Parameter*>& model, const std::vector<Parameter*>& optimizer) {
  const std::unordered_set<const Parameter*> in_model(model.begin(), model.end());
  const std::unordered_set<const Parameter*> in_optimizer(optimizer.begin(), optimizer.end());
  for (const Parameter* p : optimizer) {
    SG_CHECK(in_model.count(p) > 0, "TrainStep: the optimizer updates parameter '", p->name,
             "', which is not a parameter of the step's model; build the AdamW over this model's parameters");
  }
  for (const Parameter* p : model) {
    SG_CHECK(in_optimizer.count(p) > 0, "TrainStep: the model's parameter '", p->name,
             "' is not updated by the optimizer (it updates ", optimizer.size(),
             " parameter(s)); build the AdamW over this model's parameters");
  }
}

}  // namespace

TrainStep::TrainStep(Context& ctx, std::unique_ptr<ModelSide> model, AdamW& optimizer, const GradientGroups& groups)
    : model_(std::move(model)), optimizer_(optimizer), data_parallel_(groups.data_parallel) {
  Communicator* const data_parallel = groups.data_parallel;
  const DataParallelMode mode = groups.mode;
  check_optimizer_covers(model_->parameters(), optimizer.parameters());
  if (const Communicator* cp = model_->stack().context_parallel()) {
    // Every parameter is replicated over the CP ranks, each of which saw its
    // own tokens: their gradients sum over the CP ranks, as over data-parallel
    // ones, in one reduction over the combined group (Note [Context-parallel
    // ResidualStack]).
    SG_CHECK(data_parallel != nullptr && data_parallel->world_size() % cp->world_size() == 0,
             "TrainStep: the model is context-parallel over ", cp->describe(),
             ", so data_parallel must be the group its gradients are summed over: every rank holding the same "
             "parameter shard, data x context parallel (",
             cp->world_size(), " x the data-parallel size), got ",
             data_parallel != nullptr ? data_parallel->describe() : std::string("none"));
  }
  Communicator* const edp = groups.expert_data_parallel;
  if (Communicator* ep = model_->stack().expert_parallel()) {
    // Each EP rank trains its own tokens: the replicated parameters'
    // gradients sum over every rank, the experts' over the ranks holding
    // the same experts, or nowhere (Note [Expert-parallel ResidualStack]).
    if (edp == nullptr) {
      SG_CHECK(data_parallel == ep, "TrainStep: the model is expert-parallel over ", ep->describe(),
               ", so data_parallel must be that communicator (every other parameter's gradient is summed over it), "
               "got ",
               data_parallel != nullptr ? data_parallel->describe() : std::string("none"),
               "; for expert x data parallelism pass the whole world as data_parallel and the ranks holding this "
               "rank's experts as GradientGroups::expert_data_parallel");
    } else {
      SG_CHECK(data_parallel != nullptr, "TrainStep: expert_data_parallel (", edp->describe(),
               ") sums the experts' gradients over the replicas, but data_parallel is none; pass the whole expert "
               "x data-parallel world as data_parallel");
      edp->check_device(ctx.device(), "TrainStep (expert data parallel)");
      check_expert_data_parallel_layout(*data_parallel, *ep, *edp, "TrainStep");
      expert_data_parallel_ = edp;
    }
    SG_CHECK_CODE(mode != DataParallelMode::kZero1, ErrorCode::kUnsupported,
                  "TrainStep: an expert-parallel model's experts are not summed over the ranks, but ZeRO-1 "
                  "reduce-scatters every gradient; use DataParallelMode::kAllReduce");
    rank_local_ = model_->expert_parameters();
  } else {
    SG_CHECK(edp == nullptr, "TrainStep: expert_data_parallel (", edp != nullptr ? edp->describe() : std::string(),
             ") sums expert-parallel experts' gradients, but the model is not expert-parallel; pass no "
             "expert_data_parallel (data_parallel sums every gradient), or build the model over an "
             "expert-parallel communicator");
  }
  if (data_parallel != nullptr) {
    data_parallel->check_device(ctx.device(), "TrainStep (data parallel)");
    model_->set_fp8_amax_group(data_parallel);  // every rank keeps the same FP8 scales
  }
  labels_ = ctx.persistent("step.labels", {Shape{model_->rows()}, DType::kInt32});
  label_error_ = ctx.persistent("step.label_error", {Shape{1}, DType::kInt32});
  optimizer.group_for_overlap(ctx, model_->parameter_group_sizes());
  if (mode == DataParallelMode::kZero1 && data_parallel != nullptr) {
    optimizer.shard(ctx, *data_parallel);
  }
}

TrainStep::~TrainStep() = default;

const Tensor& TrainStep::inputs() const { return model_->inputs(); }

const Tensor& TrainStep::packing() const { return model_->packing(); }

std::vector<Communicator*> TrainStep::communicators() const {
  std::vector<Communicator*> out;
  if (Communicator* tp = model_->stack().tensor_parallel()) out.push_back(tp);
  if (Communicator* cp = model_->stack().context_parallel()) out.push_back(cp);
  Communicator* ep = model_->stack().expert_parallel();
  if (ep != nullptr && ep != data_parallel_) out.push_back(ep);
  if (data_parallel_ != nullptr) out.push_back(data_parallel_);
  if (expert_data_parallel_ != nullptr) out.push_back(expert_data_parallel_);
  return out;
}

std::vector<Tensor> TrainStep::operator()(Context& ctx) const {
  const int ranks = data_parallel_ != nullptr ? data_parallel_->world_size() : 1;
  const ModelSide::Forward forward = model_->forward(ctx);
  // Each rank's gradient is of its share of the global mean loss: summed
  // across the ranks it is the gradient of the global mean. Tensor-parallel
  // ranks share one loss, over all their tokens (Note [Tensor-parallel
  // ResidualStack]).
  const ResidualStack& stack = model_->stack();
  ops::CrossEntropyResult loss = stack.loss(ctx, forward.logits, stack.gather_labels(ctx, labels_), label_error_,
                                            {.loss_scale = 1.0f / static_cast<float>(ranks)});
  Tensor reported = loss.loss;
  if (data_parallel_ != nullptr) {  // also at one rank: the collectives run as at any size
    const Tensor share = ops::axpy(ctx, ops::fill(ctx, loss.loss.meta(), 0.0f), loss.loss, 1.0f / ranks);
    reported = ops::all_reduce(ctx, *data_parallel_, share, ReduceOp::kSum);
  }
  reported.set_name("loss");
  // The MoE blocks' balancing (Note [MoE load balancing] in layers/moe_mlp.h):
  // the aux loss's gradient carries the loss's factors, the expert loads are
  // summed over the gradient group. Set here, where the optimizer's loss
  // scaling is final; a plain value the traced ops take as parameters.
  model_->set_moe_balance(
      {.load_group = data_parallel_,
       .loss_factor = 1.0f / static_cast<float>(ranks),
       .loss_scale = optimizer_.scales_loss() ? optimizer_.loss_scale_state() : Tensor()});
  std::vector<Tensor> outputs{reported};
  if (forward.aux_loss.defined()) {  // reported like the loss: the ranks' mean
    Tensor aux = forward.aux_loss;
    if (data_parallel_ != nullptr) {
      aux = ops::all_reduce(ctx, *data_parallel_, ops::axpy(ctx, ops::fill(ctx, aux.meta(), 0.0f), aux, 1.0f / ranks),
                            ReduceOp::kSum);
    }
    aux.set_name("aux_loss");
    outputs.push_back(aux);
  }
  // Note [Non-finite steps] (optim/adamw.h): this rank's loss is checked too.
  if (optimizer_.skips_nonfinite()) optimizer_.flag_nonfinite(ctx, loss.loss);
  // Note [Loss scaling] (kernels/step_guard.h): the backward starts from S times the loss gradient.
  if (optimizer_.scales_loss()) ops::scale_by_loss_scale_(ctx, loss.dlogits, optimizer_.loss_scale_state());
  backward_and_update(
      ctx, optimizer_, [&](const GradientsReady& ready) { forward.backward(loss.dlogits, ready); }, data_parallel_,
      stack.tensor_parallel(), rank_local_, expert_data_parallel_);
  return outputs;
}

void TrainStep::check_errors(Context& ctx) const {
  model_->check_input_errors(ctx);
  SG_CHECK(ctx.to_vector<std::int32_t>(label_error_).at(0) == 0, "a training label was outside [0, ", model_->vocab(),
           "): the cross-entropy of those tokens is undefined; check the data");
  model_->check_model_errors(ctx);
}

}  // namespace stepgraph
