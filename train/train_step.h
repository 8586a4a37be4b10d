// TrainStep: one whole training step (forward, softmax cross-entropy,
// backward, AdamW), written once: called directly it runs eagerly; passed to
// CapturedStep::capture it becomes one graph, replayed with new data bound
// into its persistent inputs.
//
// The step trains either model kind; the kind decides the step's inputs:
//   - a LanguageModel (language_model.h): a sequence model on batch
//     sequences of context tokens, int32 [batch * context, 1], one label per
//     token; a window model on tokens int32 [batch, context], one label per
//     example (the trainer's step);
//   - a ResidualStack (residual_stack.h) on activations x [tokens, hidden]
//     in the model dtype, one label per token (the C API's and the
//     benchmarks' step).
// A model with attention also reads packing() (cu_seqlens int32
// [sequences + 1]), filled with sequences of equal length (tensor-parallel:
// the packing of every rank's tokens of the group, rank r's rows
// [r T/N, (r+1) T/N) of them); write another
// packing of the same tokens into it between replays to train on sequences
// of other lengths, without a new capture.
// The loss, the backward with its optimizer groups (each group updates as
// soon as its gradients are final when the context has a weight-gradient
// stream; after the backward, where nothing is NaN or infinite, when the
// optimizer skips non-finite steps: Note [Non-finite steps] in
// optim/adamw.h) and the error flags are shared.
//
//   TrainStep step(ctx, model, optimizer, batch);
//   auto graph = CapturedStep::capture(ctx, [&] { return step(ctx); });
//   graph->replay({{step.inputs(), tokens}, {step.labels(), labels}});
//   step.check_errors(ctx);
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "optim/adamw.h"
#include "layers/language_model.h"
#include "layers/residual_stack.h"

namespace stepgraph {

// How data-parallel ranks combine their gradients (TrainStep).
enum class DataParallelMode : std::uint8_t {
  kAllReduce,  // every rank all-reduces the gradients and runs the whole update
  kZero1,      // reduce-scatter, each rank updates its 1/N shard, all-gather the weights (Note [Sharded AdamW])
};
std::string_view data_parallel_mode_name(DataParallelMode mode);  // "allreduce" | "zero1"

// The groups a TrainStep sums its gradients over (see TrainStep's comment):
//   TrainStep step(ctx, model, optimizer, batch,
//                  {.data_parallel = &world, .expert_data_parallel = &edp});
struct GradientGroups {
  // Every gradient but rank-local experts' is summed over it and the loss
  // averaged over its ranks; null: one rank alone.
  Communicator* data_parallel = nullptr;
  DataParallelMode mode = DataParallelMode::kAllReduce;
  // Expert x data parallelism only (Note [Expert-parallel ResidualStack]):
  // the ranks that hold the same experts as this one, over which the
  // experts' gradients are summed; null: the experts are whole on their rank
  // (data_parallel is then the expert-parallel group itself).
  Communicator* expert_data_parallel = nullptr;
};

class TrainStep {
 public:
  // Creates the step's persistent inputs: the tokens (see above: `batch`
  // sequences or examples), one label per logits row, the token and label
  // error flags, and for a sequence model packing().
  //
  // Data parallelism: with `data_parallel` of N > 1 ranks, each rank's step
  // trains on its own `batch` rows of a global batch of N * batch: the loss
  // divides by N, each parameter group's gradients are summed across the
  // ranks as soon as the backward finishes them (overlapping the rest of the
  // backward, see AdamW::GroupedStep), and the returned loss is the global
  // mean. Every rank must build the same model (same seed) and step. With
  // DataParallelMode::kZero1 the optimizer is sharded over the ranks
  // (AdamW::shard) instead of all-reducing the gradients.
  //
  // Tensor parallelism comes with the model (a model built over a
  // tensor-parallel communicator): each rank's inputs and labels are its
  // 1/N of the rows, and with data parallelism too (a 2-D world) every
  // parameter shard is all-reduced over `data_parallel`, the ranks holding
  // the same shard.
  //
  // Context parallelism comes with the model too (Note [Context-parallel
  // ResidualStack]): each rank's inputs and labels are its zig-zag tokens
  // of the CP group's (train/context_parallel_batch.h; under TP as well, its
  // TP rank's rows of those), packing() packs the whole CP group's tokens,
  // and `data_parallel` must be the data x context-parallel group (every
  // rank holding the same parameter shard; the CP group alone without data
  // parallelism): the gradients are summed and the loss averaged over it in
  // one reduction, as Megatron reduces over DP x CP.
  //
  // Expert parallelism comes with the model too (Note [Expert-parallel
  // ResidualStack]): each rank trains its own `batch` rows like a
  // data-parallel rank. Either `data_parallel` is the model's
  // expert-parallel communicator: every gradient but the experts' is summed
  // over it and the loss averaged; the experts' gradients (the model's
  // expert_parameters()) are whole on their rank and left out. Or, expert x
  // data parallelism (GradientGroups): a world of EP x DP ranks, expert
  // parallelism innermost (world rank w is rank w % EP of the EP group of
  // replica w / EP, as the trainer lays out TP; split_expert_data_parallel
  // in train/expert_data_parallel_groups.h makes the groups), where
  //   - data_parallel is the whole world: the replicated gradients are
  //     summed over all EP x DP ranks and the loss averaged over them;
  //   - the model's expert-parallel communicator is this rank's EP group;
  //   - expert_data_parallel is the DP ranks holding the same experts (the
  //     same EP rank in every replica), over which the experts' gradients
  //     are summed, on the communication stream like the other groups'
  //     sums (with the optimizer's groups, overlapping the backward).
  // The constructor checks that layout on every rank (a host exchange over
  // the three groups) and refuses, on every rank alike, sizes that do not
  // multiply up and groups that mix replicas, naming the argument. Not with
  // ZeRO-1 yet.
  TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, std::int64_t batch,
            Communicator* data_parallel = nullptr, DataParallelMode mode = DataParallelMode::kAllReduce);
  TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, std::int64_t batch, const GradientGroups& groups);
  // A sequence model's step over `tokens` tokens packed as up to `sequences`
  // sequences of any lengths (so a batch can be padded into a fixed shape
  // bucket): tokens int32 [tokens, 1], one label per token, and
  // packing() [sequences + 1], which starts as one sequence of all the
  // tokens and empty ones after it; write each batch's packing into it.
  // Tensor-parallel, `tokens` are this rank's rows and packing() packs the
  // group's N * tokens (up to `sequences` sequences in all, which may span
  // the ranks' rows); context-parallel, the TP x CP group's.
  struct PackedTokens {
    std::int64_t tokens = 0;
    std::int64_t sequences = 0;
  };
  TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, PackedTokens packed,
            Communicator* data_parallel = nullptr, DataParallelMode mode = DataParallelMode::kAllReduce);
  TrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, PackedTokens packed, const GradientGroups& groups);
  // Creates the step's persistent inputs: activations x [tokens, hidden] in
  // the model dtype, labels int32 [tokens], and the label error flag; with
  // attention, packing() of `sequences` sequences of tokens / sequences.
  TrainStep(Context& ctx, ResidualStack& model, AdamW& optimizer, std::int64_t tokens,
            Communicator* data_parallel = nullptr, DataParallelMode mode = DataParallelMode::kAllReduce,
            std::int64_t sequences = 1);
  TrainStep(Context& ctx, ResidualStack& model, AdamW& optimizer, std::int64_t tokens, const GradientGroups& groups,
            std::int64_t sequences = 1);
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // One training step; returns {loss} (fp32 scalar, the mean over the rows),
  // and with MoE load balancing's auxiliary loss on (ResidualStackConfig's
  // moe_aux_loss_coef) {loss, aux_loss}: the MoE blocks' auxiliary losses
  // summed, averaged over the data-parallel ranks like the loss, reported
  // only (the loss stays the language model's; the aux loss's gradient is
  // in the step: Note [MoE load balancing] in layers/moe_mlp.h). The expert
  // biases' update runs inside the step too.
  // The same call runs eager or is traced.
  std::vector<Tensor> operator()(Context& ctx) const;

  // The model's input: tokens (LanguageModel) or activations (ResidualStack).
  const Tensor& inputs() const;
  const Tensor& labels() const { return labels_; }
  // cu_seqlens int32 [sequences + 1] of a model with attention (undefined
  // without): a persistent input like the tokens.
  const Tensor& packing() const;
  // The communicators a capture of this step must check
  // (CaptureOptions::communicators): the model's tensor-, context- and
  // expert-parallel ones, the data-parallel and expert-data-parallel ones,
  // those that exist, each once.
  std::vector<Communicator*> communicators() const;

  // Error if any token (LanguageModel) or label so far was outside
  // [0, vocab), or an MoE block raised a routing or split-size error word.
  // Reads device flags: call it after a step, never inside one.
  void check_errors(Context& ctx) const;

  // What differs between the model kinds (train_step.cc): the inputs the
  // model reads, its forward and backward, its parameter groups and errors.
  class ModelSide;

 private:
  TrainStep(Context& ctx, std::unique_ptr<ModelSide> model, AdamW& optimizer, const GradientGroups& groups);

  std::unique_ptr<ModelSide> model_;
  AdamW& optimizer_;
  Communicator* data_parallel_;
  // The model's expert-parallel experts: left out of the data-parallel sum,
  // summed over expert_data_parallel_ where there is one.
  std::vector<Parameter*> rank_local_;
  Communicator* expert_data_parallel_ = nullptr;
  Tensor labels_;
  Tensor label_error_;
};

}  // namespace stepgraph
