// The one-NCCL-rank check both parallel MoEMLP tests make on the GPU: a bf16
// MoEMLP built with a communicator (tensor- or expert-parallel; at one rank
// its collectives and its exchange are identities) and the plain layer, each
// captured, replayed over ten rounds of new inputs (so the routing changes),
// give the same outputs and gradients bit for bit (OneRankParity).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/nccl_communicator.h"
#include "layers/moe_mlp.h"
#include "tests/layers/one_rank_parity.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/seed.h"

namespace stepgraph::testing {

// `make_parallel` builds the layer under test from (ctx, config, seed, the
// one-rank communicator); the plain layer is MoEMLP(ctx, "moe", config, seed).
using MakeParallelMoE =
    std::function<std::unique_ptr<MoEMLP>(Context&, const MoEMLPConfig&, std::uint32_t, Communicator&)>;

inline void expect_moe_equals_plain_at_one_nccl_rank(std::uint32_t layer_seed, const MakeParallelMoE& make_parallel) {
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const MoEMLPConfig bf16{.hidden = 256, .ffn = 512, .experts = 8, .topk = 2, .dtype = DType::kBFloat16};
  const std::unique_ptr<MoEMLP> parallel = make_parallel(ctx, bf16, layer_seed, *comm);
  MoEMLP plain(ctx, "moe", bf16, layer_seed);
  const TensorMeta meta{Shape{128, 256}, DType::kBFloat16};
  const Tensor x = ctx.persistent("x", meta);
  const Tensor dy = ctx.persistent("dy", meta);
  OneRankParity steps(ctx, *comm, *parallel, plain, x, dy);
  const TestSeed seed;
  for (int round = 0; round < 10; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    write_floats(ctx, x, normal_values(seed.value() + 2 * round, meta.numel()));
    write_floats(ctx, dy, normal_values(seed.value() + 2 * round + 1, meta.numel()));
    steps.replay();
    steps.expect_equal();
    if (::testing::Test::HasFatalFailure()) return;
  }
  parallel->check_errors(ctx);
  plain.check_errors(ctx);
  comm->check_health();
}

}  // namespace stepgraph::testing
