#include "train/language_model_stages.h"

#include <string>
#include <utility>

#include "engine/error.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/loss_ops.h"

namespace stepgraph {

namespace {

// What the stages cannot hold yet, refused before any layer is built.
const LanguageModelConfig& checked(const LanguageModelConfig& config, const Communicator& pipeline, std::int64_t batch,
                                   std::int64_t microbatches, const LanguageModelStagesOptions& options) {
  const ResidualStackConfig& model = config.model;
  SG_CHECK(batch > 0 && microbatches > 0, "LanguageModelStages: batch and microbatches must be > 0, got ", batch,
           " and ", microbatches);
  SG_CHECK(config.context > 0, "LanguageModelStages: context must be > 0, got ", config.context);
  SG_CHECK(config.sequence_model() || (model.hidden > 0 && model.hidden % config.context == 0),
           "LanguageModelStages: a window model's hidden (", model.hidden, ") must be a positive multiple of context (",
           config.context, ")");
  const int stages = pipeline.world_size();
  const int chunks = options.virtual_stages;
  SG_CHECK(chunks >= 1, "LanguageModelStages: options.virtual_stages must be >= 1, got ", chunks);
  SG_CHECK(chunks == 1 || stages >= 2, "LanguageModelStages: options.virtual_stages (", chunks,
           ") needs at least 2 pipeline stages (interleaved chunks pass their activations from rank to rank), but ",
           pipeline.describe(), " has 1 rank; set options.virtual_stages = 1");
  SG_CHECK(model.layers >= stages * chunks && model.layers % (stages * chunks) == 0,
           "LanguageModelStages: config.model.layers (", model.layers,
           ") must be a positive multiple of the pipeline stages (", stages, ", the ranks of ", pipeline.describe(),
           ") times options.virtual_stages (", chunks, "): every chunk runs the same number of blocks");
  const int tp = options.tensor_parallel != nullptr ? options.tensor_parallel->world_size() : 1;
  const std::int64_t rows = config.sequence_model() ? batch * config.context : batch;
  SG_CHECK(rows % tp == 0, "LanguageModelStages: the ", rows, " rows of a microbatch (",
           config.sequence_model() ? "batch x context tokens" : "batch examples", ") do not split evenly over the ", tp,
           " tensor-parallel ranks of options.tensor_parallel; give a batch "
           "whose rows divide by them");
  // The loss reads each rank's slice of the logits in 16-byte vectors, as
  // ResidualStack and VocabParallelHead check. Checked here, on every rank:
  // only the first and last stages build the embedding and the head, and an
  // Error on those alone would leave the others waiting in the constructor's
  // schedule exchange.
  const auto logits_width = static_cast<std::int64_t>(16 / dtype_size(model.dtype));
  SG_CHECK(model.vocab > 0 && model.vocab % (tp * logits_width) == 0, "LanguageModelStages: config.model.vocab (",
           model.vocab, ") must be a positive multiple of ", tp * logits_width, " (", tp, " tensor-parallel rank(s) x ",
           logits_width, " ", dtype_name(model.dtype),
           " logits: the loss reads 16-byte vectors of each rank's vocabulary slice); pad the vocabulary");
  SG_CHECK_CODE(model.experts == 0 && !model.fp8 && model.dropout == 0.0f, ErrorCode::kUnsupported,
                "LanguageModelStages: experts (", model.experts, "), fp8 (", model.fp8 ? "on" : "off",
                ") and dropout (", model.dropout,
                ") are not supported in pipeline stages yet; set experts = 0, no fp8 and dropout = 0");
  return config;
}

}  // namespace

LanguageModelStages::LanguageModelStages(Context& ctx, Communicator& pipeline, const LanguageModelConfig& config,
                                         std::int64_t batch, std::int64_t microbatches,
                                         const LanguageModelStagesOptions& options)
    : pipeline_(pipeline),
      data_parallel_(options.stage.data_parallel),
      tensor_parallel_(options.tensor_parallel),
      config_(checked(config, pipeline, batch, microbatches, options)),
      microbatches_(microbatches) {
  pipeline.check_device(ctx.device(), "LanguageModelStages");
  if (tensor_parallel_ != nullptr)
    tensor_parallel_->check_device(ctx.device(), "LanguageModelStages (tensor parallel)");
  const std::int64_t tp = tensor_parallel_ != nullptr ? tensor_parallel_->world_size() : 1;
  const ResidualStackConfig& model = config_.model;
  const int stage = pipeline.rank();
  const int stages = pipeline.world_size();
  const bool first = stage == 0;
  const bool last = stage + 1 == stages;
  // This rank's rows of a microbatch: all of them, or its 1/N tensor-parallel.
  const std::int64_t all_rows = config_.sequence_model() ? batch * config_.context : batch;
  const std::int64_t rows = all_rows / tp;
  const Shape token_shape = config_.sequence_model() ? Shape{rows, 1} : Shape{rows, config_.context};

  if (config_.sequence_model()) {
    SG_CHECK(all_rows < (std::int64_t{1} << 31), "LanguageModelStages: ", all_rows, " tokens exceed cu_seqlens' int32");
    std::vector<std::int32_t> cu(static_cast<std::size_t>(batch + 1));
    for (std::int64_t s = 0; s <= batch; ++s) cu[s] = static_cast<std::int32_t>(s * config_.context);
    packing_ = ctx.persistent("stages.cu_seqlens", {Shape{batch + 1}, DType::kInt32});
    ctx.copy_from_host(packing_, cu.data(), cu.size() * sizeof(std::int32_t));
  }
  for (std::int64_t m = 0; m < microbatches; ++m) {
    if (first) tokens_.push_back(ctx.persistent("stages.tokens." + std::to_string(m), {token_shape, DType::kInt32}));
    if (last) labels_.push_back(ctx.persistent("stages.labels." + std::to_string(m), {Shape{rows}, DType::kInt32}));
  }
  if (first) token_error_ = ctx.persistent("stages.token_error", {Shape{1}, DType::kInt32});
  if (last) label_error_ = ctx.persistent("stages.label_error", {Shape{1}, DType::kInt32});

  // See Note [The GPT in pipeline stages]: one entry per block, only this stage's built.
  const auto layer_count = static_cast<std::size_t>(model.layers);
  const int chunks = options.virtual_stages;
  std::vector<AnyLayer*> layers(layer_count, nullptr);
  for (int c = 0; c < chunks; ++c) {
    const InterleavedStagePipeline::LayerRange range =
        InterleavedStagePipeline::chunk_layers(layer_count, c * stages + stage, stages * chunks);
    for (std::size_t i = range.first; i < range.last; ++i) {
      std::vector<std::unique_ptr<AnyLayer>> pieces;
      if (i == 0) {
        pieces.push_back(std::make_unique<TokenEmbeddingLayer>(ctx, config_, token_error_, tensor_parallel_));
      }
      pieces.push_back(
          std::make_unique<ResidualBlockLayer>(ctx, model, static_cast<std::int64_t>(i), packing_, tensor_parallel_));
      if (i + 1 == layer_count) {
        auto head = std::make_unique<NormHeadLayer>(ctx, model, tensor_parallel_);
        head_ = head.get();
        pieces.push_back(std::move(head));
      }
      owned_.push_back(pieces.size() == 1 ? std::move(pieces.front())
                                          : std::make_unique<LayerChain>(std::move(pieces)));
      layers[i] = owned_.back().get();
    }
  }
  const TensorMeta activation{Shape{rows, model.hidden}, model.dtype};
  if (chunks == 1) {
    stage_ = std::make_unique<StagePipeline>(ctx, pipeline, layers, microbatches, activation, options.stage);
    for (const PipelinePass& pass : stage_->schedule().passes()) passes_.push_back({0, pass});
  } else {
    interleaved_ = std::make_unique<InterleavedStagePipeline>(
        ctx, pipeline, layers, chunks, microbatches, activation,
        InterleavedStagePipelineOptions{.pipeline = options.stage.pipeline, .schedule = options.interleaved_schedule});
    passes_ = interleaved_->schedule().passes();
    if (data_parallel_ != nullptr) check_replicas(ctx, microbatches);
  }
}

// StagePipeline checks its own replicas; the interleaved one has none, so
// the same check here: every rank of the group runs the same stage and chunks.
void LanguageModelStages::check_replicas(Context& ctx, std::int64_t microbatches) const {
  data_parallel_->check_device(ctx.device(), "LanguageModelStages (data parallel)");
  const std::string line = "stage " + std::to_string(stage()) + " of " + std::to_string(stages()) + " (" +
                           std::to_string(virtual_stages()) + " chunks, " + std::to_string(config_.model.layers) +
                           " blocks, " + std::to_string(microbatches) + " microbatches)";
  const std::vector<std::string> replicas = data_parallel_->exchange(line, "pipeline stages of the replicas");
  for (std::size_t d = 0; d < replicas.size(); ++d) {
    SG_CHECK_CODE(replicas[d] == replicas[0], ErrorCode::kInvalidState,
                  "LanguageModelStages: the data-parallel group '", data_parallel_->name(), "' of ", replicas.size(),
                  " ranks holds ", replicas[0], " on its rank 0 but ", replicas[d], " on its rank ", d,
                  "; options.stage.data_parallel must group the same stage of every replica (split the world by "
                  "stage)");
  }
}

bool LanguageModelStages::holds_embedding(int chunk) const {
  return interleaved_ ? interleaved_->takes_model_input(chunk) : is_first();
}

bool LanguageModelStages::holds_head(int chunk) const {
  return interleaved_ ? interleaved_->takes_model_gradient(chunk) : is_last();
}

Tensor LanguageModelStages::forward(Context& ctx, int chunk, std::int64_t m, const Tensor& tokens) {
  return interleaved_ ? interleaved_->forward(ctx, chunk, m, tokens) : stage_->forward(ctx, m, tokens);
}

void LanguageModelStages::backward(Context& ctx, int chunk, std::int64_t m, const Tensor& dlogits) {
  if (interleaved_)
    (void)interleaved_->backward(ctx, chunk, m, dlogits);
  else
    (void)stage_->backward(ctx, m, dlogits);
}

const std::vector<Parameter*>& LanguageModelStages::parameters() const {
  return interleaved_ ? interleaved_->parameters() : stage_->parameters();
}

std::vector<Tensor> LanguageModelStages::gradient_sums() const {
  return interleaved_ ? interleaved_->gradient_sums() : stage_->gradient_sums();
}

const Tensor& LanguageModelStages::tokens(std::int64_t m) const {
  SG_CHECK(is_first(), "LanguageModelStages: the tokens are stage 0's inputs; this rank runs stage ", stage(), " of ",
           stages());
  SG_CHECK(m >= 0 && m < microbatches_, "LanguageModelStages: microbatch ", m, " is outside [0, ", microbatches_, ")");
  return tokens_[static_cast<std::size_t>(m)];
}

const Tensor& LanguageModelStages::labels(std::int64_t m) const {
  SG_CHECK(is_last(), "LanguageModelStages: the labels are the last stage's (", stages() - 1,
           ") inputs; this rank runs stage ", stage());
  SG_CHECK(m >= 0 && m < microbatches_, "LanguageModelStages: microbatch ", m, " is outside [0, ", microbatches_, ")");
  return labels_[static_cast<std::size_t>(m)];
}

std::vector<Communicator*> LanguageModelStages::communicators() const {
  std::vector<Communicator*> out{&pipeline_};
  if (data_parallel_ != nullptr) out.push_back(data_parallel_);
  if (tensor_parallel_ != nullptr) out.push_back(tensor_parallel_);
  return out;
}

std::vector<Tensor> LanguageModelStages::operator()(Context& ctx) {
  const int replicas = data_parallel_ != nullptr ? data_parallel_->world_size() : 1;
  // See Note [The GPT in pipeline stages]: the sum over microbatches and replicas is the global mean.
  const float scale = 1.0f / static_cast<float>(microbatches_ * replicas);
  std::vector<Tensor> dlogits(static_cast<std::size_t>(microbatches_));
  std::vector<Tensor> losses;
  Tensor loss_sum;
  for (const ChunkPass& step : passes_) {
    const PipelinePass& pass = step.pass;
    const auto m = static_cast<std::size_t>(pass.microbatch);
    if (pass.kind == PipelinePass::Kind::kForward) {
      const Tensor logits =
          forward(ctx, step.chunk, pass.microbatch, holds_embedding(step.chunk) ? tokens_[m] : Tensor{});
      if (!holds_head(step.chunk)) continue;
      ctx.begin_segment(step.to_string() + " loss");
      // Tensor-parallel, the logits are every rank's rows: so are the labels (ResidualStack::gather_labels).
      const Tensor labels =
          tensor_parallel_ != nullptr ? ops::all_gather(ctx, *tensor_parallel_, labels_[m]) : labels_[m];
      ops::CrossEntropyResult ce = head_->loss(ctx, logits, labels, label_error_, {.loss_scale = scale});
      dlogits[m] = std::move(ce.dlogits);
      loss_sum = ops::axpy(ctx, loss_sum.defined() ? loss_sum : ops::fill(ctx, ce.loss.meta(), 0.0f), ce.loss, scale);
      losses.push_back(std::move(ce.loss));
    } else {
      backward(ctx, step.chunk, pass.microbatch,
               holds_head(step.chunk) ? std::exchange(dlogits[m], Tensor{}) : Tensor{});
    }
  }
  if (interleaved_ && data_parallel_ != nullptr) {
    // As StagePipeline does after its last pass (Note [Pipeline stages across ranks]).
    ctx.begin_segment("gradient sums all-reduce");
    ops::all_reduce_many_(ctx, *data_parallel_, interleaved_->gradient_sums(), ReduceOp::kSum);
  }
  std::vector<Tensor> out{logged_loss(ctx, std::move(loss_sum))};
  out.insert(out.end(), losses.begin(), losses.end());
  return out;
}

// See Note [The GPT in pipeline stages]: after every rank's last pass and transfer group.
Tensor LanguageModelStages::logged_loss(Context& ctx, Tensor loss_sum) {
  ctx.begin_segment("loss to every stage");
  Tensor loss = is_last() ? std::move(loss_sum) : ops::fill(ctx, {Shape{}, DType::kFloat32}, 0.0f);
  if (is_last() && data_parallel_ != nullptr) loss = ops::all_reduce(ctx, *data_parallel_, loss, ReduceOp::kSum);
  ops::broadcast_(ctx, pipeline_, loss, stages() - 1);
  loss.set_name("loss");
  return loss;
}

void LanguageModelStages::check_errors(Context& ctx) const {
  if (is_first()) {
    SG_CHECK(ctx.to_vector<std::int32_t>(token_error_).at(0) == 0, "an input token was outside [0, ",
             config_.model.vocab, "): its embedding does not exist; check the data's vocabulary against the model");
  }
  if (is_last()) {
    SG_CHECK(ctx.to_vector<std::int32_t>(label_error_).at(0) == 0, "a training label was outside [0, ",
             config_.model.vocab, "): the cross-entropy of those tokens is undefined; check the data");
  }
}

}  // namespace stepgraph
