// On one NCCL rank a tensor-parallel layer's all-gathers, reduce-scatters and
// all-reduces are identities: the layer built with the communicator and the
// plain layer, each captured (forward of x, backward of dy) and replayed on
// the same inputs, give the same 16-bit outputs and fp32 gradients, bit for
// bit. Layer is a 16-bit layer with forward(ctx, {x}) -> {y, saved},
// backward(ctx, saved, {dy}) -> dx and parameters().
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "graphs/captured_step.h"

namespace stepgraph::testing {

template <typename Layer>
class OneRankParity {
 public:
  OneRankParity(Context& ctx, Communicator& comm, Layer& parallel, Layer& plain, const Tensor& x, const Tensor& dy)
      : ctx_(ctx),
        parallel_(parallel),
        plain_(plain),
        with_(capture(parallel, x, dy, {&comm})),
        without_(capture(plain, x, dy, {})) {}

  // Replays both steps once.
  void replay() {
    with_->replay();
    without_->replay();
  }

  // y, dx and every gradient of the two layers are equal (fatal where not).
  void expect_equal() const {
    for (std::size_t o = 0; o < 2; ++o) {
      ASSERT_EQ(ctx_.to_vector<std::uint16_t>(with_->outputs()[o]), ctx_.to_vector<std::uint16_t>(without_->outputs()[o]))
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
  std::shared_ptr<CapturedStep> capture(Layer& layer, const Tensor& x, const Tensor& dy,
                                        std::vector<Communicator*> comms) {
    return CapturedStep::capture(
        ctx_,
        [this, &layer, x, dy] {
          const typename Layer::Forward f = layer.forward(ctx_, {x});
          return std::vector<Tensor>{f.y, layer.backward(ctx_, f.saved, {dy})};
        },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = std::move(comms)});
  }

  Context& ctx_;
  Layer& parallel_;
  Layer& plain_;
  std::shared_ptr<CapturedStep> with_, without_;
};

}  // namespace stepgraph::testing
