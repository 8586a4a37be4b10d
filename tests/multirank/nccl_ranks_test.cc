// Multi-rank tests on real NCCL: one process per GPU, started by a launcher
// (tools/gpu_run.sh's multigpu stage):
//
//   torchrun --standalone --nproc-per-node 2 --no-python multirank_nccl_ranks_test
//
// Every rank runs every test in the same order. Each compares the ranks'
// results with what this rank computes alone on its own GPU over the whole
// global batch (the one-GPU reference), or with the values the collectives
// must give, and each data-parallel and tensor-parallel step's graph with its
// eager run, bit for bit. Without a launcher the binary is one rank (world
// size 1): the collectives are local copies and the tests that need a peer
// say so and skip; without a GPU everything skips.
//
// Tolerances (fp32 models, cuBLASLt with fp32 compute, no TF32): the ranks
// compute the one-GPU sums in another order (a rank's rows, then the
// all-reduce; the split ffn, vocabulary and pipelined rings) and cuBLASLt may
// pick another algorithm for another row count: about 1e-6 relative per step.
// 1e-4 relative on the global loss over 4 AdamW steps leaves room for that,
// while a missing or mis-scaled reduction is off by 1e-2 and more.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "launch/join.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "optim/adamw.h"
#include "layers/layernorm_mlp.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/moe_exchange_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/global_batch.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

// This process's rank of the launcher's world (NCCL), joined once.
Communicator& world() {
  static std::unique_ptr<Communicator> comm = [] {
    const LaunchInfo launch = launch_info_from_env();
    SG_CUDA_CHECK(cudaSetDevice(launch.local_rank));
    JoinedWorld joined = join_world(Device::kCuda, "nccl_ranks_test", std::chrono::minutes(2), launch);
    return joined.comm != nullptr ? std::move(joined.comm) : make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  }();
  return *comm;
}

std::uint32_t bits(float value) {
  std::uint32_t out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

// --- collectives ------------------------------------------------------------

// Rank r's buffer: element i is (r + 1) * 10 + i.
std::vector<float> rank_values(int r, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((r + 1) * 10 + i);
  return v;
}

TEST(NcclRanksTest, EveryCollectiveEagerAndCapturedGivesTheExpectedValues) {
  SG_SKIP_WITHOUT_GPU();
  Communicator& comm = world();
  const int n = comm.world_size();
  const int r = comm.rank();
  constexpr std::int64_t kCount = 8;
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const Tensor x = ctx.persistent("x", {Shape{kCount}, DType::kFloat32});
  const std::vector<float> mine = rank_values(r, kCount);
  ctx.copy_from_host(x, mine.data(), mine.size() * 4);
  std::vector<float> sum(kCount, 0), max(kCount, 0), gathered;
  for (int q = 0; q < n; ++q) {
    const std::vector<float> v = rank_values(q, kCount);
    for (std::int64_t i = 0; i < kCount; ++i) {
      sum[i] += v[i];
      max[i] = std::max(max[i], v[i]);
    }
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  const std::int64_t block = kCount / n;
  const std::vector<float> scattered(sum.begin() + r * block, sum.begin() + (r + 1) * block);
  const int from = (r - 1 + n) % n;
  auto run = [&] {
    std::vector<Tensor> out;
    out.push_back(ops::all_reduce(ctx, comm, x, ReduceOp::kSum));
    out.push_back(ops::all_reduce(ctx, comm, x, ReduceOp::kMax));
    out.push_back(ops::all_gather(ctx, comm, x));
    out.push_back(ops::reduce_scatter(ctx, comm, x, ReduceOp::kSum));
    Tensor shifted = ops::copy(ctx, x);
    ops::broadcast_(ctx, comm, shifted, n - 1);
    out.push_back(shifted);
    if (n > 1) out.push_back(ops::send_recv(ctx, comm, x, (r + 1) % n, from));
    return out;
  };
  auto check = [&](const std::vector<Tensor>& out, const std::string& how) {
    const std::string who = how + ", rank " + std::to_string(r) + " of " + std::to_string(n);
    EXPECT_EQ(ctx.to_vector<float>(out[0]), sum) << who << ": all_reduce sum";
    EXPECT_EQ(ctx.to_vector<float>(out[1]), max) << who << ": all_reduce max";
    EXPECT_EQ(ctx.to_vector<float>(out[2]), gathered) << who << ": all_gather";
    EXPECT_EQ(ctx.to_vector<float>(out[3]), scattered) << who << ": reduce_scatter";
    EXPECT_EQ(ctx.to_vector<float>(out[4]), rank_values(n - 1, kCount)) << who << ": broadcast from the last rank";
    if (n > 1) {
      EXPECT_EQ(ctx.to_vector<float>(out[5]), rank_values(from, kCount)) << who << ": send_recv ring";
    }
  };
  check(run(), "eager");
  auto graph = CapturedStep::capture(ctx, run, {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
  for (int i = 0; i < 3; ++i) graph->replay();
  check(graph->outputs(), "graph, 3 replays");
  comm.check_health();
}

// --- data and tensor parallelism against one GPU ------------------------------

constexpr std::int64_t kHidden = 64;
constexpr std::int64_t kVocab = 64;
constexpr std::int64_t kTokens = 64;  // the global batch
constexpr int kSteps = 4;

ResidualStackConfig model_config(bool moe, const MLPOverlap& overlap) {
  ResidualStackConfig c{.hidden = kHidden, .ffn = 128, .layers = 2, .vocab = kVocab, .dtype = DType::kFloat32,
                        .seed = 3, .overlap = overlap};
  if (moe) {
    c.experts = 4;
    c.topk = 2;
    c.moe_every = 2;
  }
  return c;
}

// The global batch of step s (tests/support/global_batch.h) at this file's sizes.
using Batch = testing::GlobalBatch;
Batch global_batch(std::uint32_t seed, int step) { return testing::global_batch(seed, step, kTokens, kHidden, kVocab); }

struct Rig {
  Rig(Context& ctx, const ResidualStackConfig& config, std::int64_t tokens, Communicator* tp, Communicator* dp,
      DataParallelMode mode)
      : model(ctx, config, tp),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f}),
        step(ctx, model, optimizer, tokens, dp, mode) {}
  void load(Context& ctx, const Batch& b, std::int64_t first, std::int64_t tokens) {
    ctx.copy_from_host(step.inputs(), b.x.data() + first * kHidden, static_cast<std::size_t>(tokens * kHidden) * 4);
    ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(tokens) * 4);
  }
  ResidualStack model;
  AdamW optimizer;
  TrainStep step;
};

// The one-GPU losses of `config` on the whole global batch.
std::vector<float> one_gpu_losses(const ResidualStackConfig& config, std::uint32_t seed) {
  Context ctx(Device::kCuda, 2);
  Rig rig(ctx, config, kTokens, nullptr, nullptr, DataParallelMode::kAllReduce);
  std::vector<float> losses;
  for (int s = 0; s < kSteps; ++s) {
    rig.load(ctx, global_batch(seed, s), 0, kTokens);
    losses.push_back(ctx.to_vector<float>(rig.step(ctx)[0]).at(0));
  }
  return losses;
}

// Every rank trains its rows (rank r: [r t, (r + 1) t)) with `tp` and `dp`,
// eager and graphed side by side: the graph equals eager bit for bit and the
// global loss equals the one-GPU loss within 1e-4 relative.
void expect_parallel_equals_one_gpu(const ResidualStackConfig& config, Communicator* tp, Communicator* dp,
                                    DataParallelMode mode, const std::string& what) {
  Communicator& comm = world();
  // Every rank draws the global batch from rank 0's seed.
  const testing::TestSeed drawn;
  const auto seed_value = static_cast<std::uint32_t>(
      std::stoul(comm.exchange(std::to_string(drawn.value()), "the test's seed").at(0)));
  SCOPED_TRACE("global batch seed " + std::to_string(seed_value) + " (rank 0's)");
  const std::vector<float> want = one_gpu_losses(config, seed_value);
  const std::int64_t local = kTokens / comm.world_size();
  const std::int64_t first = comm.rank() * local;
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  Rig eager(ctx, config, local, tp, dp, mode);
  Rig graphed(ctx, config, local, tp, dp, mode);
  auto graph = CapturedStep::capture(
      ctx, [&] { return graphed.step(ctx); },
      {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.step.communicators()});
  const std::string who = what + ", rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.world_size());
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = global_batch(seed_value, s);
    eager.load(ctx, b, first, local);
    graphed.load(ctx, b, first, local);
    const float eager_loss = ctx.to_vector<float>(eager.step(ctx)[0]).at(0);
    graph->replay();
    const float graph_loss = ctx.to_vector<float>(graph->outputs()[0]).at(0);
    EXPECT_EQ(bits(eager_loss), bits(graph_loss)) << who << " step " << s << ": eager " << eager_loss << ", graph "
                                                  << graph_loss;
    EXPECT_NEAR(graph_loss, want[s], 1e-4 * std::abs(want[s])) << who << " step " << s;
  }
  for (std::size_t i = 0; i < graphed.model.parameters().size(); ++i) {
    const Parameter* p = graphed.model.parameters()[i];
    EXPECT_EQ(ctx.to_vector<float>(p->master), ctx.to_vector<float>(eager.model.parameters()[i]->master))
        << who << ": " << p->name << " graph != eager";
  }
  eager.step.check_errors(ctx);
  graphed.step.check_errors(ctx);
  comm.check_health();
}

TEST(NcclRanksTest, DataParallelAllReduceAndZero1EqualOneGpuOnTheGlobalBatch) {
  SG_SKIP_WITHOUT_GPU();
  Communicator& comm = world();
  expect_parallel_equals_one_gpu(model_config(false, {}), nullptr, &comm, DataParallelMode::kAllReduce, "dp allreduce");
  expect_parallel_equals_one_gpu(model_config(false, {}), nullptr, &comm, DataParallelMode::kZero1, "dp zero1");
}

TEST(NcclRanksTest, TensorParallelInEveryOverlapModeEqualsOneGpuOnTheGlobalBatch) {
  SG_SKIP_WITHOUT_GPU();
  Communicator& comm = world();
  for (const char* mode : {"none", "bulk", "overlap"}) {
    expect_parallel_equals_one_gpu(model_config(true, MLPOverlap::parse(mode)), &comm, nullptr,
                                   DataParallelMode::kAllReduce, std::string("tp, dense + MoE blocks, ") + mode);
  }
}

// --- peer windows -------------------------------------------------------------

// One sequence-parallel LayerNormMLP's forward and backward (bf16, the
// overlapped modes' ring steps) captured three ways on the same rows: rings
// by peer copies into the neighbour's pool (the world, where every rank maps
// every other's GPU), rings by NCCL (a second communicator without peer
// copies), and every collective `none`. At two ranks every way gives the
// same bits (a + b == b + a), eagerly too; then the peer-copy graph replays
// 10,000 times and still gives them (its flags return to zero every replay).
TEST(NcclRanksTest, PeerCopyRingsEqualNcclRingsAndNoneAndReplayTenThousandTimes) {
  SG_SKIP_WITHOUT_GPU();
  Communicator& comm = world();
  if (comm.world_size() < 2) GTEST_SKIP() << "needs 2 ranks: run under torchrun --nproc-per-node 2 (world size 1 now)";
  if (comm.world_size() != 2) GTEST_SKIP() << "bit-for-bit pipelined sums need exactly 2 ranks, world size "
                                           << comm.world_size();
  std::printf("[ peer     ] %s: %s (%s)\n", comm.describe().c_str(),
              std::string(peer_transport_name(comm.peer_transport())).c_str(), comm.peer_transport_reason().c_str());
  if (comm.peer_transport() != PeerTransport::kPeerCopy) {
    GTEST_SKIP() << "the ranks cannot map each other's GPUs here: " << comm.peer_transport_reason();
  }
  int device = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  const std::unique_ptr<Communicator> nccl =
      make_nccl_communicator_like(comm, {.name = "tp_nccl", .device = device, .peer_copies = false});
  ASSERT_EQ(nccl->peer_transport(), PeerTransport::kNccl);

  constexpr std::int64_t kRows = 256, kWidth = 256, kFfnWidth = 1024;
  const testing::TestSeed drawn;
  const auto seed = static_cast<std::uint32_t>(
      std::stoul(comm.exchange(std::to_string(drawn.value()), "the test's seed").at(0)));
  const std::string who = "rank " + std::to_string(comm.rank()) + ", seed " + std::to_string(seed) + " (rank 0's)";
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  std::mt19937 rng(seed + static_cast<std::uint32_t>(comm.rank()));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random_input = [&](const char* name) {
    std::vector<std::uint16_t> values(kRows * kWidth);
    for (std::uint16_t& v : values) v = float_to_bf16(normal(rng));
    const Tensor b = ctx.persistent(name, {Shape{kRows, kWidth}, DType::kBFloat16});
    ctx.copy_from_host(b, values.data(), values.size() * sizeof(std::uint16_t));
    return b;
  };
  const Tensor x = random_input("x");
  const Tensor dy = random_input("dy");
  auto layer = [&](const char* overlap, Communicator& group) {
    return std::make_unique<LayerNormMLP>(ctx, "mlp",
                                          LayerNormMLPConfig{.hidden = kWidth, .ffn = kFfnWidth,
                                                             .dtype = DType::kBFloat16,
                                                             .overlap = MLPOverlap::parse(overlap)},
                                          11, &group);
  };
  auto outputs_of = [&](const std::vector<Tensor>& out) {
    return std::vector<std::vector<std::uint16_t>>{ctx.to_vector<std::uint16_t>(out[0]),
                                                   ctx.to_vector<std::uint16_t>(out[1])};
  };
  auto capture = [&](LayerNormMLP& mlp, Communicator& group) {
    return CapturedStep::capture(ctx,
                                 [&] {
                                   const LayerNormMLP::Forward f = mlp.forward(ctx, {x});
                                   return std::vector<Tensor>{f.y, mlp.backward(ctx, f.saved, {dy})};
                                 },
                                 {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&group}});
  };
  const auto none = layer("none", comm);
  const LayerNormMLP::Forward f = none->forward(ctx, {x});
  const std::vector<Tensor> eager_out{f.y, none->backward(ctx, f.saved, {dy})};
  const std::vector<std::vector<std::uint16_t>> want = outputs_of(eager_out);

  const auto by_peers = layer("overlap", comm);
  const auto by_nccl = layer("overlap", *nccl);
  const std::int64_t before = comm.window_transfers();
  auto peer_graph = capture(*by_peers, comm);
  auto nccl_graph = capture(*by_nccl, *nccl);
  EXPECT_EQ(comm.window_transfers() - before, 4) << who << ": the four ring steps recorded as peer copies";
  EXPECT_EQ(nccl->window_transfers(), 0) << who;
  nccl_graph->replay();
  peer_graph->replay();
  EXPECT_EQ(outputs_of(nccl_graph->outputs()), want) << who << ": NCCL rings != none";
  EXPECT_EQ(outputs_of(peer_graph->outputs()), want) << who << ": peer-copy rings != none";

  // STEPGRAPH_PEER_REPLAYS lowers the count under compute-sanitizer, which
  // instruments every kernel of every replay.
  const char* asked = std::getenv("STEPGRAPH_PEER_REPLAYS");
  const int replays = asked != nullptr ? std::atoi(asked) : 10000;
  const auto start = std::chrono::steady_clock::now();
  for (int replay = 0; replay < replays; ++replay) peer_graph->replay();
  ctx.synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ peer     ] %s: %d replays in %.2f s\n", who.c_str(), replays, seconds);
  EXPECT_EQ(outputs_of(peer_graph->outputs()), want) << who << ": after " << replays << " replays";
  comm.check_health();
  nccl->check_health();
}

// --- expert-parallel exchange by peer copies ---------------------------------

// A captured EP=2 dispatch and combine by peer copies (the world) equals the
// same step captured on a communicator without peer copies (the padded NCCL
// exchange): the splits, the dispatched rows up to their sum and the
// combined rows, bit for bit, over 1,000 replays whose routing changes every
// time (every fourth sends every row to expert 0, on rank 0).
TEST(NcclRanksTest, PeerCopyExpertExchangeEqualsThePaddedExchangeOverAThousandReplays) {
  SG_SKIP_WITHOUT_GPU();
  Communicator& comm = world();
  if (comm.world_size() != 2) {
    GTEST_SKIP() << "needs exactly 2 ranks: run under torchrun --nproc-per-node 2 (world size " << comm.world_size()
                 << " now)";
  }
  if (comm.peer_transport() != PeerTransport::kPeerCopy) {
    GTEST_SKIP() << "the ranks cannot map each other's GPUs here: " << comm.peer_transport_reason();
  }
  int device = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  const std::unique_ptr<Communicator> nccl =
      make_nccl_communicator_like(comm, {.name = "ep_nccl", .device = device, .peer_copies = false});
  constexpr std::int64_t kExperts = 8, kRows = 64, kHidden = 128;
  const testing::TestSeed drawn;
  const auto seed =
      static_cast<std::uint32_t>(std::stoul(comm.exchange(std::to_string(drawn.value()), "the test's seed").at(0)));
  const std::string who = "rank " + std::to_string(comm.rank()) + ", seed " + std::to_string(seed) + " (rank 0's)";
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const Tensor x = ctx.persistent("ep.x_perm", {Shape{kRows, kHidden}, DType::kBFloat16});
  const Tensor splits = ctx.persistent("ep.splits", {Shape{kExperts}, DType::kInt32});
  auto capture = [&](Communicator& group) {
    return CapturedStep::capture(
        ctx,
        [&] {
          const Tensor counts = ops::ep_counts(ctx, group, splits);
          const ops::EpDispatch d = ops::ep_dispatch(ctx, group, x, counts);
          return std::vector<Tensor>{d.rows, d.splits, ops::ep_combine(ctx, group, d.rows, counts)};
        },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&group}});
  };
  const std::int64_t before = comm.window_transfers();
  auto by_peers = capture(comm);
  auto by_nccl = capture(*nccl);
  EXPECT_EQ(comm.window_transfers() - before, 2) << who << ": dispatch and combine recorded as peer copies";
  EXPECT_EQ(nccl->window_transfers(), 0) << who;
  std::mt19937 rng(seed * 31u + static_cast<std::uint32_t>(comm.rank()));
  int mismatches = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int replay = 0; replay < 1000; ++replay) {
    std::vector<std::int32_t> counts(kExperts, 0);
    const bool to_expert_zero = replay % 4 == 3 && comm.rank() == 0;
    for (std::int64_t row = 0; row < kRows; ++row) ++counts[to_expert_zero ? 0 : rng() % kExperts];
    std::vector<std::uint16_t> rows(kRows * kHidden);
    for (std::uint16_t& v : rows) v = static_cast<std::uint16_t>(rng());  // any bits: the exchange only copies
    ctx.copy_from_host(splits, counts.data(), counts.size() * sizeof(std::int32_t));
    ctx.copy_from_host(x, rows.data(), rows.size() * sizeof(std::uint16_t));
    by_nccl->replay();
    by_peers->replay();
    const std::vector<std::int32_t> want_splits = ctx.to_vector<std::int32_t>(by_nccl->outputs()[1]);
    std::int64_t received = 0;
    for (const std::int32_t s : want_splits) received += s;
    std::vector<std::uint16_t> want_rows = ctx.to_vector<std::uint16_t>(by_nccl->outputs()[0]);
    std::vector<std::uint16_t> got_rows = ctx.to_vector<std::uint16_t>(by_peers->outputs()[0]);
    want_rows.resize(static_cast<std::size_t>(received * kHidden));
    got_rows.resize(want_rows.size());
    const bool same =
        ctx.to_vector<std::int32_t>(by_peers->outputs()[1]) == want_splits && got_rows == want_rows &&
        ctx.to_vector<std::uint16_t>(by_peers->outputs()[2]) == ctx.to_vector<std::uint16_t>(by_nccl->outputs()[2]) &&
        ctx.to_vector<std::uint16_t>(by_peers->outputs()[2]) == rows;
    // Every rank replays all 1,000 (its peer waits on its flags): count, then report.
    if (!same && mismatches++ == 0)
      ADD_FAILURE() << who << ": replay " << replay << " differs from the padded exchange";
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ peer     ] %s: 1000 expert-parallel replays (both graphs, with checks) in %.2f s\n", who.c_str(),
              seconds);
  EXPECT_EQ(mismatches, 0) << who;
  comm.check_health();
  nccl->check_health();
}

// --- faults -----------------------------------------------------------------

// Ranks that would capture different collectives stop before recording,
// each with an Error naming the first difference, not a hang.
TEST(NcclRanksTest, AMismatchedCaptureIsAnErrorOnEveryRank) {
  SG_SKIP_WITHOUT_GPU();
  Communicator& comm = world();
  if (comm.world_size() < 2) GTEST_SKIP() << "needs 2 ranks: run under torchrun --nproc-per-node 2 (world size 1 now)";
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const Tensor x = ctx.persistent("x", {Shape{8}, DType::kFloat32});
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(CapturedStep::capture(
                            ctx,
                            [&] {
                              // Rank 0 all-reduces, the others all-gather.
                              if (comm.rank() == 0) return std::vector<Tensor>{ops::all_reduce(ctx, comm, x, ReduceOp::kSum)};
                              return std::vector<Tensor>{ops::all_gather(ctx, comm, x)};
                            },
                            {.communicators = {&comm}}),
                        "all_reduce", "all_gather");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 30.0) << "the mismatch took " << seconds << " s to surface";
  // The communicator still works: the check ran before anything was recorded.
  const Tensor sum = ops::all_reduce(ctx, comm, ops::fill(ctx, x.meta(), 1.0f), ReduceOp::kSum);
  EXPECT_EQ(ctx.to_vector<float>(sum).at(0), static_cast<float>(comm.world_size()));
  comm.check_health();
}

}  // namespace
}  // namespace stepgraph
