// On one NCCL rank a tensor-parallel layer's all-gathers, reduce-scatters and
// all-reduces are identities: the layer built with the communicator and the
// plain layer, each captured and replayed on the same inputs, give the same
// outputs and gradients, bit for bit. ParityGraphs holds the two captures of
// any such step; OneRankParity the whole check for a 16-bit layer.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "graphs/captured_step.h"

namespace stepgraph::testing {

// The parallel step captured with its collectives on a communicator, and the
// plain step captured without one; the pool report an error in both.
struct ParityGraphs {
  ParityGraphs(Context& ctx, Communicator& comm, const CapturedStep::StepFunction& parallel,
               const CapturedStep::StepFunction& plain)
      : with(CapturedStep::capture(ctx, parallel,
                                   {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}})),
        without(CapturedStep::capture(ctx, plain, {.pool_report_policy = PoolReportPolicy::kError})) {}

  // Replays both `times` times, in turn.
  void replay(int times = 1) const {
    for (int i = 0; i < times; ++i) {
      with->replay();
      without->replay();
    }
  }

  std::shared_ptr<CapturedStep> with, without;
};

// Layer is a 16-bit layer with forward(ctx, {x}) -> {y, saved},
// backward(ctx, saved, {dy}) -> dx and parameters(); each graph is the
// forward of x and the backward of dy.
template <typename Layer>
class OneRankParity {
 public:
  OneRankParity(Context& ctx, Communicator& comm, Layer& parallel, Layer& plain, const Tensor& x, const Tensor& dy)
      : ctx_(ctx), parallel_(parallel), plain_(plain), graphs_(ctx, comm, step(parallel, x, dy), step(plain, x, dy)) {}

  // Replays both steps once.
  void replay() { graphs_.replay(); }

  // y, dx and every gradient of the two layers are equal (fatal where not).
  void expect_equal() const {
    for (std::size_t o = 0; o < 2; ++o) {
      ASSERT_EQ(ctx_.to_vector<std::uint16_t>(graphs_.with->outputs()[o]),
                ctx_.to_vector<std::uint16_t>(graphs_.without->outputs()[o]))
          << "output " << o;
    }
    const auto a = parallel_.parameters();
    const auto b = plain_.parameters();
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(ctx_.to_vector<float>(a[i]->grad), ctx_.to_vector<float>(b[i]->grad)) << a[i]->name;
    }
  }

 private:
  CapturedStep::StepFunction step(Layer& layer, const Tensor& x, const Tensor& dy) {
    return [this, &layer, x, dy] {
      const typename Layer::Forward f = layer.forward(ctx_, {x});
      return std::vector<Tensor>{f.y, layer.backward(ctx_, f.saved, {dy})};
    };
  }

  Context& ctx_;
  Layer& parallel_;
  Layer& plain_;
  ParityGraphs graphs_;
};

}  // namespace stepgraph::testing
