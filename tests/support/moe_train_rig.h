// The small MoE training setup of the expert-parallel TrainStep tests
// (tests/train/expert_*_test.cc): a ResidualStack of hidden 16, ffn 32, 2
// blocks, vocab 32, fp32, E = 8 experts top-2 (an MoE block every
// `moe_every`), or the GPT LanguageModel over it; AdamW with lr 1e-3 and
// eps 1e-2 (about the gradients' size here, so an update moves by at most
// lr / eps times its gradient's change: the tests' tolerance notes rest on
// it); and a TrainStep over the given gradient groups.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/language_model.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/support/global_batch.h"
#include "train/train_step.h"

namespace stepgraph::testing {

inline constexpr std::int64_t kSmallMoeHidden = 16;
inline constexpr std::int64_t kSmallMoeVocab = 32;
inline constexpr std::int64_t kSmallMoeExperts = 8;

inline ResidualStackConfig small_moe_config(std::int64_t moe_every) {
  return {.hidden = kSmallMoeHidden,
          .ffn = 32,
          .layers = 2,
          .vocab = kSmallMoeVocab,
          .dtype = DType::kFloat32,
          .seed = 5,
          .experts = kSmallMoeExperts,
          .topk = 2,
          .moe_every = moe_every};
}

// The GPT LanguageModel over it (every block MoE, 2 heads), on sequences of
// kSmallMoeContext tokens.
inline constexpr std::int64_t kSmallMoeContext = 6;

inline LanguageModelConfig small_moe_gpt_config() {
  ResidualStackConfig model = small_moe_config(1);
  model.heads = 2;
  return {.model = model, .context = kSmallMoeContext};
}

// A GPT step's global batch of `count` tokens and labels, uniform in [0,
// vocab) from `seed` and the step (the tokens the labels reversed), the same
// on every rank.
inline std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> small_moe_gpt_batch(std::uint32_t seed, int step,
                                                                                           std::int64_t count) {
  const GlobalBatch b = global_batch(seed, step, count, 1, kSmallMoeVocab);
  return {std::vector<std::int32_t>(b.labels.rbegin(), b.labels.rend()), b.labels};
}

// A host Context whose optimizer groups overlap the backward (a
// weight-gradient stream and the communication stream 2), or with one
// stream: one update after the backward.
inline std::unique_ptr<Context> small_moe_context(bool grouped) {
  if (!grouped) return std::make_unique<Context>(Device::kHost, 0);
  auto ctx = std::make_unique<Context>(Device::kHost, 2);
  ctx->set_communication_stream(2);
  return ctx;
}

// Model (ResidualStack or LanguageModel) with its experts over `ep` (null:
// all on this rank), its optimizer, and its TrainStep over `rows` (tokens of
// a ResidualStack, sequences of a LanguageModel).
template <typename Model>
struct MoeTrainRig {
  template <typename ModelConfig>
  MoeTrainRig(Context& ctx, const ModelConfig& config, std::int64_t rows, Communicator* ep,
              const GradientGroups& groups)
      : model(ctx, config, nullptr, nullptr, ep),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f, .eps = 1e-2f}),
        step(ctx, model, optimizer, rows, groups) {}

  // A ResidualStack's step: rows [first, first + tokens) of the global batch.
  void load(Context& ctx, const GlobalBatch& b, std::int64_t first, std::int64_t tokens) {
    const std::int64_t hidden = step.inputs().shape().dim(1);
    ctx.copy_from_host(step.inputs(), b.x.data() + first * hidden, static_cast<std::size_t>(tokens * hidden) * 4);
    ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(tokens) * 4);
  }
  // A LanguageModel's step: tokens and labels [first, first + count).
  void load(Context& ctx, const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& labels,
            std::int64_t first, std::int64_t count) {
    ctx.copy_from_host(step.inputs(), tokens.data() + first, static_cast<std::size_t>(count) * 4);
    ctx.copy_from_host(step.labels(), labels.data() + first, static_cast<std::size_t>(count) * 4);
  }

  Model model;
  AdamW optimizer;
  TrainStep step;
};

}  // namespace stepgraph::testing
