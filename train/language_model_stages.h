// LanguageModelStages: one rank's pipeline stage of the GPT (LanguageModel:
// embedding, ResidualStack's blocks, final norm and head), trained by a
// StagePipeline (or an InterleavedStagePipeline) over the ranks of a
// communicator, the loss computed on the last stage and given to every rank:
//
//   LanguageModelStages stages(ctx, pipeline_comm, config, /*batch=*/2, /*microbatches=*/4);
//   // write each microbatch's tokens (stage 0) and labels (last stage), then:
//   std::vector<Tensor> out = stages(ctx);  // out[0]: the iteration's loss, on every rank
//   stages.gradient_sums();                 // this stage's parameters' gradients, summed
//
// The same call runs eager or traced: CapturedStep::capture(ctx, [&] {
// return stages(ctx); }, {.communicators = stages.communicators()}). With
// options.virtual_stages = V > 1 each rank holds V chunks of the model
// (Megatron's interleaved layout and 1F1B: InterleavedStagePipeline).
//
// Note [The GPT in pipeline stages]
// The split. The model is L entries, one per block; the first carries the
// token embedding before block 0 and the last the final norm and the head
// after block L - 1 (LayerChain, gpt_stage_layers.h), so StagePipeline's
// even split of the entries (stage_layers) gives every stage L / P blocks,
// the embedding riding with stage 0's and the head with stage P - 1's
// (interleaved: L / (P V) blocks a chunk, the embedding in model chunk 0 on
// stage 0, the head in model chunk P V - 1 on stage P - 1). Each rank
// builds only its own stage's layers (the others' entries are null),
// with the names and seeds LanguageModel gives them. Stage 0's input is the
// tokens of the microbatch (int32; the embedding computes no input gradient,
// which StagePipeline allows its first layer); every transfer between stages
// is the residual stream, [rows, hidden] in the model dtype; the last stage's
// output is the logits.
//
// The loss. After forward m the last stage takes the softmax cross-entropy
// of its logits (NormHeadLayer::loss: ResidualStack::loss, the op
// TrainStep's LanguageModel path uses) with loss_scale 1 / (M D), M the
// microbatches and D the data-parallel replicas, and its dlogits start
// backward m. Every microbatch has the same number of rows, so the
// microbatches' mean losses times 1 / (M D), summed over microbatches and
// replicas, are the mean over the global batch's rows, and so are the
// gradients summed over both. The logged loss is that sum: sum_m 1/(M D)
// loss_m, added in microbatch order (forwards run in order on the last
// stage), all-reduced over the last stages of the replicas, then broadcast
// from the last stage to every stage of the pipeline (ops::broadcast_, an
// op: traced and captured like the transfers).
//
// Where the broadcast goes. Every rank issues it after its iteration's last
// pass and last transfer group (and after the replicas' gradient all-reduce,
// StagePipeline's, or this class's for interleaved stages, which do it at
// the same point). The stages' transfer groups complete on their own
// (check_stage_schedules, or check_interleaved_stage_schedules, proves it at
// construction: no group waits on anything after it), so every rank
// reaches the broadcast, which then waits only on ranks that have reached
// it: no deadlock. Issued any earlier, say
// after the last stage's last forward, it would wait on stage 0 while stage 0
// waits in a receive of a backward that the last stage sends only after the
// broadcast. The data-parallel loss all-reduce groups only last stages,
// each past its own pipeline's transfers, for the same reason.
//
// Tensor parallelism (options.tensor_parallel, PP x TP). Each TP rank of a
// stage holds its slices of the stage's layers, built as LanguageModel's over
// the same group (Note [Tensor-parallel ResidualStack]); the ranks of one
// TP index across the stages form a pipeline communicator of their own, and
// each sends its rows of the residual stream, [rows / N, hidden]. Every TP
// collective stays inside a stage and every TP rank of a stage runs the same
// passes, so the collectives meet as in one TP world. The last stage's loss
// is vocabulary-parallel over all the group's rows (each rank's labels
// all-gathered, as ResidualStack::gather_labels), the same value on every TP
// rank, and each pipeline broadcasts its own.
//
// Order of sums. Pipelining changes no sum's order: each parameter's
// gradient is computed by the same ops on the same operands as one rank
// running LanguageModel on microbatch m, and summed over the microbatches in
// the order 0, 1, ..., M - 1 on every stage (Note [Gradients summed over
// microbatches]; interleaved 1F1B runs each chunk's backwards in that order
// too), as one rank running the microbatches in order does; the logged loss
// adds in the same order as well. One rank and P stages agree bit for bit,
// and so do a TP world of N and P stages of N TP ranks each
// (language_model_stages_test.cc). Across data-parallel replicas the sums
// are the replicas' sums added by the all-reduce.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/any_layer.h"
#include "layers/language_model.h"
#include "layers/parameter.h"
#include "train/gpt_stage_layers.h"
#include "train/interleaved_stage_pipeline.h"
#include "train/pipeline_schedule.h"
#include "train/stage_pipeline.h"

namespace stepgraph {

struct LanguageModelStagesOptions {
  // Chunks of the model each rank holds: 1 runs StagePipeline (1F1B), V > 1
  // InterleavedStagePipeline (interleaved 1F1B); config.model.layers must
  // divide by stages x V.
  int virtual_stages = 1;
  // The data-parallel group (stage.data_parallel: this stage across the
  // replicas; see Note [Pipeline stages across ranks]), any V; and where
  // V = 1, this stage's order (nullopt: 1F1B).
  StagePipelineOptions stage;
  // V > 1: this stage's order (nullopt: Megatron's interleaved 1F1B).
  std::optional<InterleavedSchedule> interleaved_schedule;
  // The stage's tensor-parallel group (null: none), as LanguageModel's
  // (Note [Tensor-parallel ResidualStack]): each of its ranks holds 1/N of
  // every microbatch's rows (its tokens, its labels, the activations it
  // sends) and 1/N of every weight; the packing is of all the rows. Every
  // TP rank of a stage is a stage of its own pipeline communicator.
  Communicator* tensor_parallel = nullptr;
};

class LanguageModelStages {
 public:
  // This rank's stage (its rank of `pipeline`) of the model `config`
  // describes, over `microbatches` microbatches of `batch` rows' worth each:
  // a sequence model's `batch` sequences of config.context tokens, a window
  // model's `batch` examples. config.model.layers must divide by the stages
  // (times options.virtual_stages). Every rank of `pipeline` (and of
  // options.stage.data_parallel) constructs its stage together; both must
  // outlive this.
  LanguageModelStages(Context& ctx, Communicator& pipeline, const LanguageModelConfig& config, std::int64_t batch,
                      std::int64_t microbatches, const LanguageModelStagesOptions& options = {});
  LanguageModelStages(const LanguageModelStages&) = delete;
  LanguageModelStages& operator=(const LanguageModelStages&) = delete;

  // One iteration, every pass of this stage's schedule: returns {loss} on
  // every rank (fp32 scalar, the mean over the global batch's rows; see Note
  // [The GPT in pipeline stages]), and on the last stage each microbatch's
  // mean loss after it, {loss, loss_0, ..., loss_{M-1}}.
  std::vector<Tensor> operator()(Context& ctx);

  // Microbatch m's tokens, int32 [batch * context, 1] (sequence model) or
  // [batch, context] (window model), tensor-parallel this rank's 1/N of the
  // rows (rows [r R/N, (r+1) R/N)): stage 0's persistent inputs.
  const Tensor& tokens(std::int64_t m) const;
  // Microbatch m's labels, int32 [rows] (tensor-parallel, this rank's
  // rows'): the last stage's persistent inputs.
  const Tensor& labels(std::int64_t m) const;
  // A sequence model's packing, cu_seqlens int32 [batch + 1], of every
  // microbatch's rows (all TP ranks' together): `batch` sequences of context
  // tokens. Every rank holds its own copy for its blocks' attention; to
  // train on other lengths write the same packing into every rank's between
  // iterations. Undefined for a window model.
  const Tensor& packing() const { return packing_; }

  // The communicators a capture must check: the pipeline's, and the data-
  // and tensor-parallel ones if any.
  std::vector<Communicator*> communicators() const;
  int stage() const { return pipeline_.rank(); }
  int stages() const { return pipeline_.world_size(); }
  int virtual_stages() const { return interleaved_ ? interleaved_->chunks() : 1; }
  bool is_first() const { return stage() == 0; }            // holds the embedding
  bool is_last() const { return stage() + 1 == stages(); }  // holds the head and the loss
  // This stage's passes in order (chunk 0 only where V = 1).
  const std::vector<ChunkPass>& passes() const { return passes_; }
  // This stage's parameters (chunk by chunk, in layer order), and their
  // gradients summed over the microbatches (and the replicas) after an iteration.
  const std::vector<Parameter*>& parameters() const;
  std::vector<Tensor> gradient_sums() const;

  // Error if a token (stage 0) or a label (last stage) so far was outside
  // [0, vocab). Reads device flags: after an iteration, never inside one.
  void check_errors(Context& ctx) const;

 private:
  // The loss all-reduced over the replicas' last stages and broadcast from this pipeline's.
  Tensor logged_loss(Context& ctx, Tensor loss_sum);
  // Interleaved: every rank of options.stage.data_parallel runs the same stage (the same Error on each otherwise).
  void check_replicas(Context& ctx, std::int64_t microbatches) const;
  // Whether this stage's chunk holds the embedding (takes the tokens) or the head (gives the logits).
  bool holds_embedding(int chunk) const;
  bool holds_head(int chunk) const;
  Tensor forward(Context& ctx, int chunk, std::int64_t m, const Tensor& tokens);
  void backward(Context& ctx, int chunk, std::int64_t m, const Tensor& dlogits);

  Communicator& pipeline_;
  Communicator* data_parallel_ = nullptr;
  Communicator* tensor_parallel_ = nullptr;
  LanguageModelConfig config_;
  std::int64_t microbatches_ = 0;
  Tensor packing_;
  Tensor token_error_;                            // stage 0
  Tensor label_error_;                            // the last stage
  std::vector<Tensor> tokens_;                    // stage 0, per microbatch
  std::vector<Tensor> labels_;                    // the last stage, per microbatch
  std::vector<std::unique_ptr<AnyLayer>> owned_;  // this stage's entries of the model
  NormHeadLayer* head_ = nullptr;                 // the last stage's
  // Exactly one is set: V = 1 or V > 1.
  std::unique_ptr<StagePipeline> stage_;
  std::unique_ptr<InterleavedStagePipeline> interleaved_;
  std::vector<ChunkPass> passes_;
};

}  // namespace stepgraph
