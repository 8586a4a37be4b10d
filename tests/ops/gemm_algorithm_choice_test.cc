// The context's GEMM algorithm choice (Note [Deterministic algorithm choice]
// in engine/algorithm_choice.h) travels with each GEMM op: a traced step
// records it in the op's parameters (so two steps traced with different
// choices are different programs), and it cannot change while tracing.
#include <gtest/gtest.h>

#include "engine/algorithm_choice.h"
#include "engine/context.h"
#include "graphs/tracer.h"
#include "ops/gemm_ops.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

ops::GemmParams traced_gemm_params(Context& ctx) {
  const Tensor a = ctx.persistent("a", {Shape{8, 32}, DType::kFloat32});
  const Tensor b = ctx.persistent("b", {Shape{16, 32}, DType::kFloat32});
  Tracer tracer(ctx);
  const Tensor d = ops::gemm(ctx, a, b, {.trans_b = true, .out_dtype = DType::kFloat32}).d;
  const TraceResult result = tracer.finish(std::vector<Tensor>{d});
  for (const Instruction& instruction : result.program.instructions()) {
    if (instruction.op != nullptr && instruction.op->name == "gemm") return instruction.params.as<ops::GemmParams>();
  }
  ADD_FAILURE() << "no gemm instruction in the traced program";
  return {};
}

TEST(GemmAlgorithmChoiceTest, HeuristicByDefaultAndRecordedInTheTrace) {
  Context ctx(Device::kHost);
  EXPECT_EQ(ctx.algorithm_choice(), AlgorithmChoice::kHeuristic);
  const ops::GemmParams heuristic = traced_gemm_params(ctx);
  EXPECT_EQ(heuristic.algorithm, AlgorithmChoice::kHeuristic);
  ctx.set_algorithm_choice(AlgorithmChoice::kTimed);
  const ops::GemmParams timed = traced_gemm_params(ctx);
  EXPECT_EQ(timed.algorithm, AlgorithmChoice::kTimed);
  EXPECT_FALSE(heuristic == timed);
  EXPECT_NE(timed.to_string().find("timed algorithm"), std::string::npos) << timed.to_string();
}

TEST(GemmAlgorithmChoiceTest, CannotChangeWhileTracing) {
  Context ctx(Device::kHost);
  Tracer tracer(ctx);
  EXPECT_ERROR_CONTAINS(ctx.set_algorithm_choice(AlgorithmChoice::kTimed), "being traced", "before tracing");
  EXPECT_ERROR_CONTAINS(ctx.set_algorithm_choice(static_cast<AlgorithmChoice>(7)), "unknown choice 7");
  (void)tracer.finish({});
}

TEST(GemmAlgorithmChoiceTest, NamesRoundTrip) {
  for (const AlgorithmChoice choice : {AlgorithmChoice::kHeuristic, AlgorithmChoice::kTimed}) {
    EXPECT_EQ(parse_algorithm_choice(algorithm_choice_name(choice)), choice);
  }
  EXPECT_EQ(parse_algorithm_choice("fastest"), std::nullopt);
}

}  // namespace
}  // namespace stepgraph
