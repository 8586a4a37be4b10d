// The GEMMs' cuBLASLt workspace in the pool is what their algorithms need on
// the GPU and nothing on the host (before this, the README's Python
// example, hidden 64 and 64 tokens, planned a 64 MiB pool on the host for
// about 200 KB of tensors, every GEMM carrying a 32 MiB workspace).
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "layers/residual_stack.h"
#include "ops/gemm_ops.h"
#include "tests/layers/train_rig.h"
#include "tests/support/gpu.h"

namespace stepgraph {
namespace {

// The README example's model and step: hidden 64, ffn 256, 2 blocks, vocab 128, 64 tokens, bf16.
std::int64_t readme_model_pool_bytes(Device device) {
  Context ctx(device);
  testing::TrainRig<ResidualStack> rig(
      ctx, ResidualStackConfig{.hidden = 64, .ffn = 256, .layers = 2, .vocab = 128, .dtype = DType::kBFloat16}, 64);
  auto graph = CapturedStep::capture(ctx, [&] { return rig.step(ctx); },
                                     {.pool_report_policy = PoolReportPolicy::kError});
  graph->replay();
  return graph->pool_bytes();
}

TEST(GemmWorkspaceTest, TheHostPlansNoWorkspace) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", {Shape{16, 32}, DType::kBFloat16});
  const Tensor b = ctx.persistent("b", {Shape{8, 32}, DType::kBFloat16});
  ops::GemmParams params{.trans_b = true};
  // Without workspace_bytes the op's only output is D (a workspace would follow it).
  EXPECT_EQ(ops::gemm_op().check(OpParams(params), std::vector<TensorMeta>{a.meta(), b.meta()}).size(), 1u);
  const ops::GemmResult r = ops::gemm(ctx, a, b, params);
  EXPECT_EQ(r.d.shape(), (Shape{16, 8}));
  // The README example's pool holds its activations: well under a MiB (it was 64 MiB).
  const std::int64_t pool = readme_model_pool_bytes(Device::kHost);
  std::cout << "README model on the host: " << pool << " pool bytes\n";
  EXPECT_LT(pool, std::int64_t{1} << 20) << pool << " pool bytes";
}

TEST(GemmWorkspaceTest, TheGpuPlansWhatTheAlgorithmsNeed) {
  SG_SKIP_WITHOUT_GPU();
  const std::int64_t pool = readme_model_pool_bytes(Device::kCuda);
  std::cout << "README model on the GPU: " << pool << " pool bytes\n";
  // Two 32 MiB workspaces were live at once before.
  EXPECT_LT(pool, std::int64_t{64} << 20) << pool << " pool bytes";
}

}  // namespace
}  // namespace stepgraph
