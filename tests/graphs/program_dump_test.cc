#include "graphs/program_dump.h"

#include <gtest/gtest.h>

#include <string>

#include "engine/error.h"
#include "ops/elementwise_ops.h"
#include "graphs/tracer.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TEST(ProgramDumpTest, TracedProgramDumpsOneLinePerInstructionWithOffsets) {
  Context ctx(Device::kHost, 1);
  const Tensor x = ctx.persistent("x", {Shape{4, 8}, DType::kFloat32});
  Tracer tracer(ctx);
  const Tensor h = ops::mul(ctx, x, x).set_name("h");
  Tensor s;
  {
    StreamScope side(ctx, 1);
    s = ops::axpy(ctx, h, x, 0.5f).set_name("s");
  }
  const Tensor loss = ops::sum(ctx, ops::add(ctx, h, s)).set_name("loss");
  TraceResult traced = tracer.finish(std::vector<Tensor>{loss});
  const StepPlan plan = plan_step(traced.program);

  const std::string unplanned = dump_program(traced.program);
  EXPECT_NE(unplanned.find("program: 5 values, 4 instructions, 2 stream(s), 1 segment(s)"), std::string::npos)
      << unplanned;
  EXPECT_NE(unplanned.find("[1] s1  %2 s:[4, 8] fp32 = axpy{alpha=0.5}(%1 h:[4, 8] fp32, %0 x:[4, 8] fp32 "
                           "@persistent)"),
            std::string::npos)
      << unplanned;

  const std::string planned = dump_program(traced.program, &plan);
  EXPECT_NE(planned.find("pool: "), std::string::npos) << planned;
  EXPECT_NE(planned.find("@pool+"), std::string::npos) << planned;
  EXPECT_NE(planned.find("s1 wait e"), std::string::npos) << planned;
  EXPECT_NE(planned.find("loss:[] fp32 @pool+"), std::string::npos) << planned;
  EXPECT_NE(planned.find("(live out)"), std::string::npos) << planned;
}

TEST(TracerTest, TracingRunsNothingAndNestingIsAnError) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", {Shape{2}, DType::kFloat32});
  Tracer tracer(ctx);
  ops::axpy_(ctx, x, x, 1.0f);  // recorded, not run
  EXPECT_ERROR_CONTAINS(Tracer nested(ctx), "already being traced on this context; traces cannot nest");
  TraceResult traced = tracer.finish({});
  EXPECT_EQ(traced.program.instructions().size(), 1u);
  EXPECT_EQ(ctx.to_vector<float>(x), std::vector<float>(2, 0.0f));
}

TEST(TracerTest, TracedValuesHaveNoMemory) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", {Shape{2}, DType::kFloat32});
  Tensor y;
  {
    Tracer tracer(ctx);
    y = ops::add(ctx, x, x).set_name("y");
    EXPECT_ERROR_CONTAINS(y.data(), "tensor 'y' is a traced value: it has no memory while tracing");
    EXPECT_ERROR_CONTAINS(ctx.to_vector<float>(y), "reading tensor 'y' on the host", "cannot happen while tracing");
    tracer.finish({});
  }
  EXPECT_ERROR_CONTAINS(ops::add(ctx, y, x), "op add: tensor 'y' is a traced value without memory");  // outside its trace
}

}  // namespace
}  // namespace stepgraph
