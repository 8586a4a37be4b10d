// The README's "Capturing a step" example, as written there, on the host.
#include <gtest/gtest.h>

#include <vector>

#include "engine/context.h"
#include "ops/elementwise_ops.h"
#include "graphs/captured_step.h"

namespace stepgraph {
namespace {

TEST(ReadmeExampleTest, CapturesReplaysAndReadsTheLoss) {
  Context ctx(Device::kHost, /*side_streams=*/1);
  Tensor x = ctx.persistent("x", {Shape{64, 256}, DType::kFloat32});  // step input, fixed address
  Tensor w = ctx.persistent("w", x.meta());                           // parameter
  Tensor batch = ctx.persistent("batch", x.meta());                   // this step's data
  auto step = CapturedStep::capture(ctx,
                                    [&] {
                                      Tensor h = ops::mul(ctx, x, w).set_name("h");
                                      Tensor s;
                                      {
                                        StreamScope side(ctx, 1);
                                        s = ops::axpy(ctx, h, x, 0.5f);
                                      }  // overlaps on a side stream
                                      return std::vector<Tensor>{ops::sum(ctx, ops::add(ctx, h, s)).set_name("loss")};
                                    },
                                    {.pool_report_policy = PoolReportPolicy::kError});
  step->replay({{x, batch}});  // copies batch into x (unless it is x), one launch
  float loss = ops::item(ctx, step->outputs()[0]);

  EXPECT_EQ(loss, 0.0f);  // zero-filled inputs
  const std::vector<float> twos(64 * 256, 2.0f);
  ctx.copy_from_host(batch, twos.data(), twos.size() * sizeof(float));
  ctx.copy_from_host(w, twos.data(), twos.size() * sizeof(float));
  step->replay({{x, batch}});
  // h = 2 * 2 = 4, s = h + 0.5 * 2 = 5, sum(h + s) = 9 per element.
  EXPECT_EQ(ops::item(ctx, step->outputs()[0]), 9.0f * 64 * 256);
}

}  // namespace
}  // namespace stepgraph
