// Pipeline stages in 2-D host thread worlds of 4 ranks, against one rank
// running all layers on the same global batch, eager and captured:
//
// PP = 2 x DP = 2: the world split into pipeline groups (the stages of one
// replica) and data-parallel groups (one stage across the replicas). Each
// replica trains its half of the global batch's microbatches; after the
// iteration each stage's gradient sums are all-reduced over its DP group
// (StagePipelineOptions::data_parallel). The output gradients drawn are
// those of the global loss, so each replica's are of its share of it, as
// TrainStep's loss divides by the data-parallel size; the sum over the
// replicas is then the global gradient.
//
// PP = 2 x TP = 2: every layer a sequence-parallel LayerNormMLP over a TP
// group (each TP rank holds T / TP rows of every activation, so a stage
// sends its rank's shard), the stages over the PP groups of one TP rank.
//
// Bit for bit where no sum crosses ranks: the PP x DP outputs and input
// gradients equal one rank's; the PP x DP gradient sums equal one rank's
// sums of each replica's microbatches added in fp32 (the all-reduce of two
// ranks is one addition); every PP x TP value equals a TP world's without
// pipelining (pipelining changes no sum's order). Eager equals captured bit
// for bit on every rank.
//
// Tolerance against one rank where a sum crosses ranks (the rule of
// tests/layers/tensor_parallel_test.cc and data_parallel_test.cc): the
// replicas' sums added by the all-reduce, and the TP ranks' fc2 partial
// products and fc1 data gradients added by the reduce-scatters, are the same
// fp32 terms as one rank's in another order, about 1e-7 relative per sum.
// We allow 1e-5 of the largest reference value (at least 1); a gradient
// summed over one replica only, or a missing or doubled reduction, is off by
// 1e-2 or more.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/any_layer.h"
#include "layers/layernorm_mlp.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/seed.h"
#include "tests/train/pipeline_test_model.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"
#include "train/stage_pipeline.h"

namespace stepgraph {
namespace {

using testing::bits;
using testing::read_floats;
using testing::write_floats;

constexpr std::int64_t kHidden = 32;
constexpr std::int64_t kFfn = 2 * kHidden;
constexpr std::int64_t kTokens = 8;  // rows of a microbatch
constexpr std::size_t kLayers = 4;
constexpr int kStages = 2;
constexpr int kIterations = 2;
constexpr std::size_t kParametersPerLayer = 6;  // norm gamma, beta, fc1 weight, bias, fc2 weight, bias

TensorMeta activation(std::int64_t rows) { return {Shape{rows, kHidden}, DType::kFloat32}; }

using pipeline_testing::Batches;
using pipeline_testing::Mode;

// The whole model, the same weights in every context; with `tensor_parallel`,
// each rank's slices of them.
pipeline_testing::MlpStack make_stack(Context& ctx, Communicator* tensor_parallel = nullptr) {
  return pipeline_testing::MlpStack(ctx, kLayers, kHidden, kFfn, tensor_parallel);
}

// Per iteration, per global microbatch: x and the loss's gradient dy, [kTokens, kHidden].
Batches draw(std::mt19937& rng, std::int64_t microbatches) {
  return pipeline_testing::draw_batches(rng, kIterations, microbatches, kTokens * kHidden);
}

// Rows [first, first + count) of a row-major matrix of `cols` columns.
std::vector<float> rows(const std::vector<float>& m, std::int64_t cols, std::int64_t first, std::int64_t count) {
  return {m.begin() + first * cols, m.begin() + (first + count) * cols};
}

// Columns [first, first + count) of a row-major [row_count, cols] matrix.
std::vector<float> columns(const std::vector<float>& m, std::int64_t row_count, std::int64_t cols, std::int64_t first,
                           std::int64_t count) {
  std::vector<float> out;
  for (std::int64_t r = 0; r < row_count; ++r) {
    out.insert(out.end(), m.begin() + r * cols + first, m.begin() + r * cols + first + count);
  }
  return out;
}

// See the tolerance at the top of the file.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 1.0f, worst = 0.0f;
  for (float v : want) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst, 1e-5f * scale) << what << ": largest difference to one rank " << worst << " of " << scale;
}

// What one rank's iteration gives: per microbatch (local numbering) the
// output (last stage) and input gradient (first stage) of the rows it holds,
// and per parameter, in the stage's order, its name and gradient sum.
struct Results {
  std::vector<std::vector<float>> outputs, grad_inputs;
  std::vector<std::string> names;
  std::vector<std::vector<float>> sums;
};

// Writes iteration `it`'s input x and output gradient dy of local microbatch m.
using Load = std::function<void(int it, std::size_t m, const Tensor& x, const Tensor& dy)>;

// One rank running `layers` (all of them, or a TP rank's slices) in 1F1B
// with no pipeline stages: backwards in microbatch order, as on every stage.
std::vector<Results> run_layers(Context& ctx, const std::vector<AnyLayer*>& layers, std::int64_t microbatches,
                                const TensorMeta& meta, const Load& load) {
  LayerPipeline pipeline(ctx, layers, microbatches);
  const PipelineSchedule schedule = PipelineSchedule::one_f_one_b(microbatches, 0);
  std::vector<Results> out(kIterations);
  const Tensor x = ctx.persistent("x", meta);
  const Tensor dy = ctx.persistent("dy", meta);
  for (int it = 0; it < kIterations; ++it) {
    Results& r = out[it];
    r.outputs.resize(static_cast<std::size_t>(microbatches));
    r.grad_inputs.resize(static_cast<std::size_t>(microbatches));
    for (const PipelinePass& pass : schedule.passes()) {
      const auto m = static_cast<std::size_t>(pass.microbatch);
      load(it, m, x, dy);
      if (pass.kind == PipelinePass::Kind::kForward) {
        r.outputs[m] = read_floats(ctx, pipeline.forward(ctx, pass.microbatch, x));
      } else {
        r.grad_inputs[m] = read_floats(ctx, pipeline.backward(ctx, pass.microbatch, dy));
      }
    }
    for (std::size_t p = 0; p < pipeline.parameters().size(); ++p) {
      r.names.push_back(pipeline.parameters()[p]->name);
      r.sums.push_back(read_floats(ctx, pipeline.gradient_sums()[p]));
    }
  }
  return out;
}


// `stage`'s iterations on this rank, eager or captured once and replayed
// (`communicators`: every group the iteration's ops use).
std::vector<Results> run_stage(Context& ctx, StagePipeline& stage, const std::vector<Communicator*>& communicators,
                               std::int64_t microbatches, const TensorMeta& meta, Mode mode, const Load& load) {
  const auto count = static_cast<std::size_t>(microbatches);
  std::vector<Tensor> x, dy, y(count), dx(count);
  for (std::size_t m = 0; m < count; ++m) {
    x.push_back(ctx.persistent("x." + std::to_string(m), meta));
    dy.push_back(ctx.persistent("dy." + std::to_string(m), meta));
  }
  auto iteration = [&] {
    std::vector<Tensor> results;
    for (const PipelinePass& pass : stage.schedule().passes()) {
      const auto m = static_cast<std::size_t>(pass.microbatch);
      if (pass.kind == PipelinePass::Kind::kForward) {
        y[m] = stage.forward(ctx, pass.microbatch, stage.is_first() ? x[m] : Tensor{});
        if (y[m].defined()) results.push_back(y[m]);
      } else {
        dx[m] = stage.backward(ctx, pass.microbatch, stage.is_last() ? dy[m] : Tensor{});
        if (dx[m].defined()) results.push_back(dx[m]);
      }
    }
    return results;
  };
  std::shared_ptr<CapturedStep> step;
  if (mode == Mode::kGraphed) {
    CaptureOptions options;
    options.pool_report_policy = PoolReportPolicy::kError;
    options.communicators = communicators;
    step = CapturedStep::capture(ctx, iteration, options);
  }
  std::vector<Results> out(kIterations);
  for (int it = 0; it < kIterations; ++it) {
    for (std::size_t m = 0; m < count; ++m) load(it, m, x[m], dy[m]);
    if (step) {
      step->replay();
      std::size_t k = 0;  // the step's outputs, in the order the iteration returned them
      for (const PipelinePass& pass : stage.schedule().passes()) {
        const auto m = static_cast<std::size_t>(pass.microbatch);
        const bool forward = pass.kind == PipelinePass::Kind::kForward;
        if (forward && stage.is_last()) y[m] = step->outputs().at(k++);
        if (!forward && stage.is_first()) dx[m] = step->outputs().at(k++);
      }
    } else {
      (void)iteration();
    }
    Results& r = out[it];
    r.outputs.resize(count);
    r.grad_inputs.resize(count);
    for (std::size_t m = 0; m < count; ++m) {
      if (stage.is_last()) r.outputs[m] = read_floats(ctx, y[m]);
      if (stage.is_first()) r.grad_inputs[m] = read_floats(ctx, dx[m]);
    }
    for (std::size_t p = 0; p < stage.parameters().size(); ++p) {
      r.names.push_back(stage.parameters()[p]->name);
      r.sums.push_back(read_floats(ctx, stage.gradient_sums()[p]));
    }
  }
  return out;
}

// Every value of two runs of one rank equal bit for bit.
void expect_same_bits(const std::vector<Results>& got, const std::vector<Results>& want, const std::string& who) {
  ASSERT_EQ(got.size(), want.size()) << who;
  for (std::size_t it = 0; it < got.size(); ++it) {
    const std::string at = who + ", iteration " + std::to_string(it);
    ASSERT_EQ(got[it].outputs.size(), want[it].outputs.size()) << at;
    for (std::size_t m = 0; m < got[it].outputs.size(); ++m) {
      EXPECT_EQ(bits(got[it].outputs[m]), bits(want[it].outputs[m])) << at << ": output of microbatch " << m;
      EXPECT_EQ(bits(got[it].grad_inputs[m]), bits(want[it].grad_inputs[m]))
          << at << ": input gradient of microbatch " << m;
    }
    ASSERT_EQ(got[it].names, want[it].names) << at;
    for (std::size_t p = 0; p < got[it].sums.size(); ++p) {
      EXPECT_EQ(bits(got[it].sums[p]), bits(want[it].sums[p])) << at << ": " << got[it].names[p] << "'s gradient sum";
    }
  }
}

// Where each of a one-rank reference's parameters (by name) lies in its results.
std::map<std::string, std::size_t> index_of(const Results& r) {
  std::map<std::string, std::size_t> out;
  for (std::size_t p = 0; p < r.names.size(); ++p) out[r.names[p]] = p;
  return out;
}

// ---------------------------------------------------------------- PP x DP

constexpr int kReplicas = 2;
constexpr std::int64_t kReplicaMicrobatches = 4;
constexpr std::int64_t kGlobalMicrobatches = kReplicas * kReplicaMicrobatches;

// World rank w is stage w % 2 of replica w / 2.
std::vector<std::vector<Results>> pipeline_times_data_parallel(const Batches& b, Mode mode) {
  std::vector<std::vector<Results>> out(kStages * kReplicas);
  std::mutex mutex;
  HostWorld::run(kStages * kReplicas, [&](Communicator& world) {
    const int w = world.rank();
    const int replica = w / kStages, s = w % kStages;
    const std::unique_ptr<Communicator> pp = world.split(replica, s, "pp");
    const std::unique_ptr<Communicator> dp = world.split(s, replica, "dp");
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    pipeline_testing::MlpStack stack = make_stack(ctx);
    StagePipeline stage(ctx, *pp, stack.layers(), kReplicaMicrobatches, activation(kTokens),
                        {.data_parallel = dp.get()});
    EXPECT_EQ(stage.stage(), s);
    const std::int64_t first = replica * kReplicaMicrobatches;  // this replica's global microbatches
    std::vector<Results> got = run_stage(ctx, stage, {pp.get(), dp.get()}, kReplicaMicrobatches, activation(kTokens),
                                         mode, [&](int it, std::size_t m, const Tensor& x, const Tensor& dy) {
                                           write_floats(ctx, x, b.x[it][first + m]);
                                           write_floats(ctx, dy, b.dy[it][first + m]);
                                         });
    std::lock_guard lock(mutex);
    out[w] = std::move(got);
  });
  return out;
}

// One rank, every layer, global microbatches [first, first + count).
std::vector<Results> one_rank(const Batches& b, std::int64_t first, std::int64_t count) {
  Context ctx(Device::kHost);
  pipeline_testing::MlpStack stack = make_stack(ctx);
  return run_layers(ctx, stack.layers(), count, activation(kTokens),
                    [&](int it, std::size_t m, const Tensor& x, const Tensor& dy) {
                      write_floats(ctx, x, b.x[it][first + m]);
                      write_floats(ctx, dy, b.dy[it][first + m]);
                    });
}

TEST(StagePipeline2DTest, PipelineTimesDataParallelEqualsOneRank) {
  testing::SeededRng rng;
  const Batches b = draw(rng, kGlobalMicrobatches);
  const std::vector<Results> whole = one_rank(b, 0, kGlobalMicrobatches);
  std::vector<std::vector<Results>> halves;  // each replica's microbatches on one rank
  for (int d = 0; d < kReplicas; ++d) halves.push_back(one_rank(b, d * kReplicaMicrobatches, kReplicaMicrobatches));
  const std::map<std::string, std::size_t> where = index_of(whole[0]);

  const std::vector<std::vector<Results>> eager = pipeline_times_data_parallel(b, Mode::kEager);
  const std::vector<std::vector<Results>> graphed = pipeline_times_data_parallel(b, Mode::kGraphed);
  for (int w = 0; w < kStages * kReplicas; ++w) {
    const int replica = w / kStages, s = w % kStages;
    const std::string who =
        "rank " + std::to_string(w) + " (stage " + std::to_string(s) + " of replica " + std::to_string(replica) + ")";
    expect_same_bits(graphed[w], eager[w], who + ", graphed against eager");
    const std::vector<Results>& got = eager[w];
    for (int it = 0; it < kIterations; ++it) {
      const std::string at = who + ", iteration " + std::to_string(it);
      for (std::size_t m = 0; m < static_cast<std::size_t>(kReplicaMicrobatches); ++m) {
        const std::size_t global = static_cast<std::size_t>(replica * kReplicaMicrobatches) + m;
        if (s == kStages - 1) {
          EXPECT_EQ(bits(got[it].outputs[m]), bits(whole[it].outputs[global])) << at << ": output of microbatch " << m;
        }
        if (s == 0) {
          EXPECT_EQ(bits(got[it].grad_inputs[m]), bits(whole[it].grad_inputs[global]))
              << at << ": input gradient of microbatch " << m;
        }
      }
      ASSERT_EQ(got[it].names.size(), kLayers / kStages * kParametersPerLayer) << at;
      for (std::size_t p = 0; p < got[it].names.size(); ++p) {
        const std::string& name = got[it].names[p];
        ASSERT_EQ(where.count(name), 1u) << at << ": " << name << " is not a parameter of the model";
        const std::size_t q = where.at(name);
        // The all-reduce of two replicas: replica 0's sum plus replica 1's, in fp32.
        std::vector<float> added = halves[0][it].sums[q];
        for (std::size_t i = 0; i < added.size(); ++i) added[i] += halves[1][it].sums[q][i];
        EXPECT_EQ(bits(got[it].sums[p]), bits(added)) << at << ": " << name << "'s sum over the replicas";
        expect_close(got[it].sums[p], whole[it].sums[q], at + ": " + name + "'s gradient sum against one rank");
      }
    }
  }
}

// The check has teeth: a gradient summed over one replica's microbatches
// only is far from the global sum.
TEST(StagePipeline2DTest, OneReplicasGradientIsFarFromTheGlobalSum) {
  testing::SeededRng rng;
  const Batches b = draw(rng, kGlobalMicrobatches);
  const std::vector<Results> whole = one_rank(b, 0, kGlobalMicrobatches);
  const std::vector<Results> half = one_rank(b, 0, kReplicaMicrobatches);
  float worst = 0.0f;
  for (std::size_t p = 0; p < whole[0].sums.size(); ++p) {
    for (std::size_t i = 0; i < whole[0].sums[p].size(); ++i) {
      worst = std::max(worst, std::abs(whole[0].sums[p][i] - half[0].sums[p][i]));
    }
  }
  EXPECT_GT(worst, 1e-2f);
}

TEST(StagePipeline2DTest, ADataParallelGroupOfDifferentStagesIsRefusedOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(4);
  HostWorld::run(
      4,
      [&](Communicator& world) {
        const int w = world.rank();
        const std::unique_ptr<Communicator> pp = world.split(w / kStages, w % kStages, "pp");
        // Wrong: the ranks of one replica (stages 0 and 1) as a data-parallel group.
        const std::unique_ptr<Communicator> dp = world.split(w / kStages, w % kStages, "dp");
        Context ctx(Device::kHost);
        pipeline_testing::MlpStack stack = make_stack(ctx);
        try {
          StagePipeline stage(ctx, *pp, stack.layers(), kReplicaMicrobatches, activation(kTokens),
                              {.data_parallel = dp.get()});
        } catch (const Error& error) {
          std::lock_guard lock(mutex);
          errors[w] = error.message();
        }
      },
      std::chrono::seconds(60));
  for (int w = 0; w < 4; ++w) {
    EXPECT_NE(errors[w].find("options.data_parallel must group the same stage"), std::string::npos)
        << "rank " << w << ": " << errors[w];
    EXPECT_NE(errors[w].find("stage 1 of 2"), std::string::npos) << "rank " << w << ": " << errors[w];
  }
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_EQ(errors[2], errors[3]);
}

// ---------------------------------------------------------------- PP x TP

constexpr int kTensorRanks = 2;
constexpr std::int64_t kMicrobatches = 4;
constexpr std::int64_t kShardRows = kTokens / kTensorRanks;

// Writes TP rank t's rows of iteration it's microbatch m.
Load shard_loader(Context& ctx, const Batches& b, int t) {
  return [&ctx, &b, t](int it, std::size_t m, const Tensor& x, const Tensor& dy) {
    write_floats(ctx, x, rows(b.x[it][m], kHidden, t * kShardRows, kShardRows));
    write_floats(ctx, dy, rows(b.dy[it][m], kHidden, t * kShardRows, kShardRows));
  };
}

// A TP world running every layer with no pipeline: per TP rank.
std::vector<std::vector<Results>> tensor_parallel_only(const Batches& b) {
  std::vector<std::vector<Results>> out(kTensorRanks);
  std::mutex mutex;
  HostWorld::run(kTensorRanks, [&](Communicator& tp) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    pipeline_testing::MlpStack stack = make_stack(ctx, &tp);
    std::vector<Results> got =
        run_layers(ctx, stack.layers(), kMicrobatches, activation(kShardRows), shard_loader(ctx, b, tp.rank()));
    std::lock_guard lock(mutex);
    out[tp.rank()] = std::move(got);
  });
  return out;
}

// World rank w is TP rank w % 2 of stage w / 2.
std::vector<std::vector<Results>> pipeline_times_tensor_parallel(const Batches& b, Mode mode) {
  std::vector<std::vector<Results>> out(kStages * kTensorRanks);
  std::mutex mutex;
  HostWorld::run(kStages * kTensorRanks, [&](Communicator& world) {
    const int w = world.rank();
    const int s = w / kTensorRanks, t = w % kTensorRanks;
    const std::unique_ptr<Communicator> tp = world.split(s, t, "tp");
    const std::unique_ptr<Communicator> pp = world.split(t, s, "pp");
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    pipeline_testing::MlpStack stack = make_stack(ctx, tp.get());
    StagePipeline stage(ctx, *pp, stack.layers(), kMicrobatches, activation(kShardRows));
    EXPECT_EQ(stage.stage(), s);
    std::vector<Results> got = run_stage(ctx, stage, {pp.get(), tp.get()}, kMicrobatches, activation(kShardRows), mode,
                                         shard_loader(ctx, b, t));
    std::lock_guard lock(mutex);
    out[w] = std::move(got);
  });
  return out;
}

// TP rank t's part of one rank's gradient sum of a LayerNormMLP parameter
// (`which`: its place in the layer's parameters).
std::vector<float> slice_of(const std::vector<float>& whole, std::size_t which, int t) {
  const std::int64_t f = kFfn / kTensorRanks;
  switch (which) {
    case 2: return rows(whole, kHidden, t * f, f);           // fc1 weight [ffn, hidden]: column-parallel
    case 3: return rows(whole, 1, t * f, f);                 // fc1 bias [ffn]
    case 4: return columns(whole, kHidden, kFfn, t * f, f);  // fc2 weight [hidden, ffn]: row-parallel
    default: return whole;                                   // gamma, beta (all-reduced), fc2 bias
  }
}

TEST(StagePipeline2DTest, PipelineTimesTensorParallelEqualsOneRank) {
  testing::SeededRng rng;
  const Batches b = draw(rng, kMicrobatches);
  const std::vector<Results> whole = one_rank(b, 0, kMicrobatches);
  const std::map<std::string, std::size_t> where = index_of(whole[0]);
  const std::vector<std::vector<Results>> unpipelined = tensor_parallel_only(b);

  const std::vector<std::vector<Results>> eager = pipeline_times_tensor_parallel(b, Mode::kEager);
  const std::vector<std::vector<Results>> graphed = pipeline_times_tensor_parallel(b, Mode::kGraphed);
  for (int w = 0; w < kStages * kTensorRanks; ++w) {
    const int s = w / kTensorRanks, t = w % kTensorRanks;
    const std::string who =
        "rank " + std::to_string(w) + " (TP rank " + std::to_string(t) + " of stage " + std::to_string(s) + ")";
    expect_same_bits(graphed[w], eager[w], who + ", graphed against eager");
    const std::vector<Results>& got = eager[w];
    const std::vector<Results>& tp = unpipelined[t];
    for (int it = 0; it < kIterations; ++it) {
      const std::string at = who + ", iteration " + std::to_string(it);
      for (std::size_t m = 0; m < static_cast<std::size_t>(kMicrobatches); ++m) {
        const std::string mb = " of microbatch " + std::to_string(m);
        if (s == kStages - 1) {
          EXPECT_EQ(bits(got[it].outputs[m]), bits(tp[it].outputs[m])) << at << ": output" << mb << " against TP only";
          expect_close(got[it].outputs[m], rows(whole[it].outputs[m], kHidden, t * kShardRows, kShardRows),
                       at + ": output" + mb + " against one rank");
        }
        if (s == 0) {
          EXPECT_EQ(bits(got[it].grad_inputs[m]), bits(tp[it].grad_inputs[m]))
              << at << ": input gradient" << mb << " against TP only";
          expect_close(got[it].grad_inputs[m], rows(whole[it].grad_inputs[m], kHidden, t * kShardRows, kShardRows),
                       at + ": input gradient" + mb + " against one rank");
        }
      }
      const std::size_t per_stage = kLayers / kStages * kParametersPerLayer;
      ASSERT_EQ(got[it].names.size(), per_stage) << at;
      for (std::size_t p = 0; p < per_stage; ++p) {
        const std::string& name = got[it].names[p];
        const std::size_t q = s * per_stage + p;  // the parameter's place in the whole model
        ASSERT_EQ(tp[it].names.at(q), name) << at;
        EXPECT_EQ(bits(got[it].sums[p]), bits(tp[it].sums[q]))
            << at << ": " << name << "'s gradient sum against TP only";
        ASSERT_EQ(where.count(name), 1u) << at << ": " << name << " is not a parameter of the model";
        expect_close(got[it].sums[p], slice_of(whole[it].sums[where.at(name)], p % kParametersPerLayer, t),
                     at + ": " + name + "'s gradient sum against one rank");
      }
    }
  }
}

}  // namespace
}  // namespace stepgraph
