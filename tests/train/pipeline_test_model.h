// What the cross-rank pipeline tests share (stage_pipeline_test,
// stage_pipeline_interleaved_test, stage_pipeline_2d_test,
// stage_pipeline_memory_test): a stack of fp32 LayerNormMLP layers with the
// same weights in every context, random inputs and output gradients per
// iteration and microbatch, and one rank running every layer as the
// reference the pipelines must equal bit for bit.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/tensor.h"
#include "layers/any_layer.h"
#include "layers/layernorm_mlp.h"

namespace stepgraph::pipeline_testing {

// Layers "mlp.0", "mlp.1", ... of [hidden -> ffn -> hidden], fp32, layer i
// seeded i + 1; with `tensor_parallel`, each rank's slices of them.
struct MlpStack {
  MlpStack(Context& ctx, std::size_t layers, std::int64_t hidden = 32, std::int64_t ffn = 64,
           Communicator* tensor_parallel = nullptr);
  std::vector<AnyLayer*> layers() const;
  std::vector<std::unique_ptr<AnyLayerOf<LayerNormMLP>>> owned;
};

// Per iteration, per microbatch: the input x and the output's gradient dy.
struct Batches {
  std::vector<std::vector<std::vector<float>>> x, dy;
};

// x of scale 1 and dy of scale 0.1, `values` each, drawn iteration by iteration.
Batches draw_batches(std::mt19937& rng, int iterations, std::int64_t microbatches, std::int64_t values);

// What one iteration gives: per microbatch the model's output and input
// gradient, per parameter name its gradient summed over the microbatches.
struct Results {
  std::vector<std::vector<float>> outputs, grad_inputs;
  std::map<std::string, std::vector<float>> gradient_sums;
};

// One rank, every layer of an MlpStack of `layer_count` default layers,
// `activation` a microbatch's [rows, hidden], over the iterations of
// `batches`. Its order is 1F1B with no warmup (F0 B0 F1 B1 ...): a layer's
// gradient sum is the copy of its first backward's gradient plus the
// others' in the order its backwards run (Note [Gradients summed over
// microbatches]), and every pipeline stage, 1F1B or interleaved, runs each
// layer's backwards in microbatch order 0, 1, ..., M - 1, so this order
// adds the same numbers in the same order; the forwards' order adds nothing
// across microbatches. B1 before B0 would differ in the last bits.
std::vector<Results> one_rank_reference(std::size_t layer_count, std::int64_t microbatches,
                                        const TensorMeta& activation, const Batches& batches);

enum class Mode { kEager, kGraphed };
const char* mode_name(Mode mode);

}  // namespace stepgraph::pipeline_testing
