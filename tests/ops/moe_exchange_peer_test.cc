// The expert-parallel exchange by peer copies (Note [Expert-parallel
// exchange]) on host thread worlds of 2, 3 and 4 ranks (E = 12 experts, 5
// tokens, k = 2, H = 8, fp32 and bf16): a captured step with peer copies, the
// same step captured in a world without them (the padded NCCL exchange) and
// eager calls agree bit for bit (the dispatched rows up to their sum, the
// splits, the combined rows, the backwards) over 120 replays whose routing
// changes every time (random, every row to rank 0, a rank that receives
// nothing, an empty expert, a rank with no rows, counts out of range); only
// the peer world's captured calls move rows through windows. A peer that
// never posts its flag is an Error within the world's timeout. The route
// table of a small case is checked against Note [Expert-parallel routes] by
// hand, and on a GPU the kernels at 2, 3 and 4 ranks equal their host
// references.
#include "kernels/moe_exchange_peer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "kernels/moe_exchange.h"
#include "ops/moe_exchange_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/moe_exchange_inputs.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using namespace std::chrono_literals;

constexpr std::int64_t kExperts = 12;  // a multiple of 2, 3 and 4
constexpr std::int64_t kTokens = 5;
constexpr std::int64_t kTopk = 2;
constexpr std::int64_t kRows = kTokens * kTopk;  // R
constexpr std::int64_t kHidden = 8;
constexpr int kReplays = 120;
// A failing rank leaves its peers waiting: they end within this.
constexpr std::chrono::milliseconds kWorldTimeout = 60s;

constexpr testing::EpExchangeShape kShape{kExperts, kRows, kHidden};
using Routing = testing::EpRouting;
using RankInput = testing::EpRankInput;
using Inputs = testing::EpInputs;

constexpr Routing kRoutings[] = {Routing::kRandom,      Routing::kAllToRankZero,    Routing::kRankReceivesNothing,
                                 Routing::kEmptyExpert, Routing::kRankSendsNothing, Routing::kCountsOutOfRange};

// Replay i's routing and seed (every world and rank derives the same).
Routing routing_of(int replay) { return kRoutings[replay % std::size(kRoutings)]; }

// Every exchange of a MoE layer's forward and backward:
// {rows, splits, y_perm, counts, d_x = dispatch_backward(rows), d_rows = combine_backward(y_perm)}.
enum Output { kDispatched, kSplits, kCombined, kCounts, kDispatchBackward, kCombineBackward, kOutputs };
constexpr int kExchangesPerStep = 4;

std::vector<Tensor> exchange_step(Context& ctx, Communicator& comm, const Inputs& in) {
  const Tensor counts = ops::ep_counts(ctx, comm, in.splits);
  const ops::EpDispatch d = ops::ep_dispatch(ctx, comm, in.x, counts);
  const Tensor y = ops::ep_combine(ctx, comm, d.rows, counts);
  return {d.rows,
          d.splits,
          y,
          counts,
          ops::ep_dispatch_backward(ctx, comm, d.rows, counts),
          ops::ep_combine_backward(ctx, comm, y, counts)};
}

// One step's outputs as bytes, the dispatched rows cut at their sum (the
// peer transport leaves the rows past it as they were).
std::vector<std::vector<std::uint8_t>> comparable(Context& ctx, const std::vector<Tensor>& out, DType dtype) {
  std::int64_t received = 0;
  for (const std::int32_t s : ctx.to_vector<std::int32_t>(out[kSplits])) received += s;
  std::vector<std::vector<std::uint8_t>> all;
  for (int k = 0; k < kOutputs; ++k) {
    std::vector<std::uint8_t> bytes = testing::tensor_bytes(ctx, out[static_cast<std::size_t>(k)]);
    if (k == kDispatched || k == kCombineBackward)
      bytes.resize(static_cast<std::size_t>(received) * kShape.row_bytes(dtype));
    all.push_back(std::move(bytes));
  }
  return all;
}

struct Case {
  int ranks;
  DType dtype;
};

void PrintTo(const Case& c, std::ostream* os) { *os << "P=" << c.ranks << " " << dtype_name(c.dtype); }

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "ep" + std::to_string(info.param.ranks) + "_" + std::string(dtype_name(info.param.dtype));
}

// results[rank][replay]: a world's comparable outputs.
using Results = std::vector<std::vector<std::vector<std::vector<std::uint8_t>>>>;

// Captures the exchange step in a world with or without peer copies and
// replays it kReplays times with new routing; with `eager`, also runs the
// same calls eagerly before each replay and stores those.
void run_world(const Case& c, std::uint32_t seed, bool peer_copies, Results& captured, Results* eager) {
  captured.assign(static_cast<std::size_t>(c.ranks), {});
  if (eager != nullptr) eager->assign(static_cast<std::size_t>(c.ranks), {});
  HostWorld::run(
      c.ranks,
      [&](Communicator& comm) {
        const int r = comm.rank();
        SCOPED_TRACE(testing::seed_note(seed));
        Context ctx(Device::kHost, /*side_streams=*/1);
        ctx.set_communication_stream(1);
        const Inputs graphed = testing::make_ep_inputs_on(ctx, kShape, "graph.", c.dtype);
        const Inputs direct = testing::make_ep_inputs_on(ctx, kShape, "eager.", c.dtype);
        ASSERT_EQ(comm.peer_transport(), peer_copies ? PeerTransport::kPeerCopy : PeerTransport::kNccl);
        auto step = CapturedStep::capture(ctx, [&] { return exchange_step(ctx, comm, graphed); },
                                          {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
        for (int i = 0; i < kReplays; ++i) {
          std::vector<RankInput> all;
          for (int p = 0; p < c.ranks; ++p) {
            all.push_back(testing::make_ep_input(kShape, seed + static_cast<std::uint32_t>(i), p, c.ranks,
                                                 routing_of(i), c.dtype));
          }
          testing::load_ep_inputs(ctx, graphed, all[static_cast<std::size_t>(r)]);
          if (eager != nullptr) {
            testing::load_ep_inputs(ctx, direct, all[static_cast<std::size_t>(r)]);
            const std::int64_t before = comm.window_transfers();
            (*eager)[static_cast<std::size_t>(r)].push_back(comparable(ctx, exchange_step(ctx, comm, direct), c.dtype));
            EXPECT_EQ(comm.window_transfers(), before) << "rank " << r << ": an eager exchange took a peer window";
          }
          const std::int64_t before = comm.window_transfers();
          step->replay();
          // Peer copies: every exchange awaits one data flag per peer.
          EXPECT_EQ(comm.window_transfers() - before, peer_copies ? kExchangesPerStep * (c.ranks - 1) : 0)
              << "rank " << r << " replay " << i;
          auto got = comparable(ctx, step->outputs(), c.dtype);
          // Against the expectation from every rank's input, too.
          EXPECT_TRUE(got[kDispatched] == testing::expected_ep_dispatch(kShape, all, r, c.dtype).rows)
              << "rank " << r << " replay " << i << " (" << testing::ep_routing_name(routing_of(i)) << ")";
          EXPECT_TRUE(got[kCombined] ==
                      testing::expected_ep_round_trip(kShape, all[static_cast<std::size_t>(r)], c.dtype))
              << "rank " << r << " replay " << i << " (" << testing::ep_routing_name(routing_of(i)) << ")";
          captured[static_cast<std::size_t>(r)].push_back(std::move(got));
        }
      },
      kWorldTimeout, peer_copies);
}

class EpPeerExchangeTest : public ::testing::TestWithParam<Case> {};

// Peer copies (captured) == the padded NCCL exchange (captured) == eager, bit
// for bit, over 120 replays of changing routing.
TEST_P(EpPeerExchangeTest, CapturedPeerCopiesEqualThePaddedExchangeAndEagerWhileRoutingChanges) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  SCOPED_TRACE(testing::seed_note(seed.value()));
  Results by_peers, by_nccl, eager;
  run_world(c, seed.value(), /*peer_copies=*/true, by_peers, &eager);
  run_world(c, seed.value(), /*peer_copies=*/false, by_nccl, nullptr);
  ASSERT_FALSE(HasFailure());
  const char* names[] = {"rows", "splits", "y_perm", "counts", "dispatch_backward", "combine_backward"};
  for (int r = 0; r < c.ranks; ++r) {
    for (int i = 0; i < kReplays; ++i) {
      for (int k = 0; k < kOutputs; ++k) {
        const auto& peer =
            by_peers[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)][static_cast<std::size_t>(k)];
        const auto& nccl =
            by_nccl[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)][static_cast<std::size_t>(k)];
        const auto& now = eager[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)][static_cast<std::size_t>(k)];
        ASSERT_TRUE(peer == nccl) << "rank " << r << " replay " << i << " " << names[k] << " ("
                                  << testing::ep_routing_name(routing_of(i)) << "): peer copies != the padded exchange";
        ASSERT_TRUE(peer == now) << "rank " << r << " replay " << i << " " << names[k] << " ("
                                 << testing::ep_routing_name(routing_of(i)) << "): captured != eager";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HostWorlds, EpPeerExchangeTest,
                         ::testing::Values(Case{2, DType::kFloat32}, Case{2, DType::kBFloat16},
                                           Case{3, DType::kBFloat16}, Case{4, DType::kFloat32}),
                         case_name);

// A rank that stops replaying leaves its peers waiting on a flag: the wait
// ends with an Error after the world's timeout, not a hang. (The counts are
// a step input, so the peer copy is the step's only meeting.)
TEST(EpPeerExchangeFaultTest, APeerThatNeverPostsIsAnErrorWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(HostWorld::run(
                            2,
                            [](Communicator& comm) {
                              Context ctx(Device::kHost, 1);
                              ctx.set_communication_stream(1);
                              const Tensor x = ctx.persistent("x", {Shape{kRows, kHidden}, DType::kFloat32});
                              const Tensor counts = ctx.persistent("counts", {Shape{2, kExperts}, DType::kInt32});
                              std::vector<std::int32_t> zeros(2 * kExperts, 0);
                              ctx.copy_from_host(counts, zeros.data(), zeros.size() * sizeof(std::int32_t));
                              auto graph = CapturedStep::capture(
                                  ctx, [&] { return std::vector<Tensor>{ops::ep_dispatch(ctx, comm, x, counts).rows}; },
                                  {.communicators = {&comm}});
                              graph->replay();
                              EXPECT_EQ(comm.window_transfers(), 1);
                              if (comm.rank() == 0) graph->replay();  // rank 1 never comes
                            },
                            500ms),
                        "never posted its flag");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

// The copy's block count is checked where the call is made, on either path.
TEST(EpPeerExchangeErrorTest, BlocksOutOfRangeAreRefusedNamingTheOption) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    const Tensor x = ctx.persistent("x", {Shape{kRows, kHidden}, DType::kFloat32});
    const Tensor counts = ctx.persistent("counts", {Shape{2, kExperts}, DType::kInt32});
    EXPECT_ERROR_CONTAINS(ops::ep_dispatch(ctx, comm, x, counts, {.blocks = 0}), "ep_dispatch",
                          "EpPeerOptions::blocks must be in [1, 132], got 0");
  });
}

// Note [Expert-parallel routes] by hand: P = 2, E = 4, R = 3, rank 0 sends
// expert 0 one row and expert 2 two rows; rank 1 sends expert 1 three rows.
// c_0 = [0 1 1 3 3], c_1 = [0 0 3 3 3]; rank 0 owns experts 0, 1 and rank 1
// experts 2, 3 (L = 2).
TEST(EpRoutesTest, TheTableOfASmallCaseIsTheNotesFormulas) {
  const kernels::EpPlanDesc d0{0, 2, 4, 3};
  const kernels::EpPlanDesc d1{1, 2, 4, 3};
  const std::vector<std::int32_t> counts = {1, 0, 2, 0, 0, 3, 0, 0};
  std::vector<std::int32_t> routes(static_cast<std::size_t>(kernels::ep_route_ints(d0)), -7);
  const std::vector<std::int32_t> clamped = {0, 1, 1, 3, 3, 0, 0, 3, 3, 3};
  auto tables = [&](std::size_t from, std::size_t n) {
    return std::vector<std::int32_t>(routes.begin() + static_cast<std::ptrdiff_t>(from),
                                     routes.begin() + static_cast<std::ptrdiff_t>(from + n));
  };
  // Rank 0 dispatches: segments (q, e) = (0, 0) 1 row x_perm 0 -> rank 0's row 0;
  // (0, 1) none; (1, 0) 2 rows from x_perm 1 -> rank 1's row 0; (1, 1) none.
  // Its own buffer receives 1 (its expert 0) + 3 (rank 1's expert 1) rows.
  kernels::host::ep_routes(d0, kernels::EpDirection::kDispatch, counts.data(), routes.data());
  EXPECT_EQ(tables(0, 10), clamped);
  EXPECT_EQ(tables(10, 5), (std::vector<std::int32_t>{0, 1, 1, 3, 3}));  // start
  EXPECT_EQ(tables(15, 4), (std::vector<std::int32_t>{0, 1, 1, 3}));     // src
  EXPECT_EQ(tables(19, 4), (std::vector<std::int32_t>{0, 1, 0, 2}));     // dst
  EXPECT_EQ(routes[23], 4);                                              // filled
  // Rank 1 dispatches its 3 rows of expert 1 to rank 0, after rank 0's row
  // of expert 0: D(0, 1, 1) = 1 (expert 0's rows) + 0 (rank 0's of expert 1).
  kernels::host::ep_routes(d1, kernels::EpDirection::kDispatch, counts.data(), routes.data());
  EXPECT_EQ(tables(10, 5), (std::vector<std::int32_t>{0, 0, 3, 3, 3}));
  EXPECT_EQ(tables(15, 4), (std::vector<std::int32_t>{0, 0, 3, 3}));
  EXPECT_EQ(tables(19, 4), (std::vector<std::int32_t>{1, 1, 2, 2}));
  EXPECT_EQ(routes[23], 2);  // rank 0's two rows of expert 2
  // Rank 0 combines: its dispatched rows [x0 (from 0, e0), y0 y1 y2 (from 1, e1)]
  // go back: row 0 -> rank 0's y_perm row 0, rows 1..3 -> rank 1's rows 0..2.
  kernels::host::ep_routes(d0, kernels::EpDirection::kCombine, counts.data(), routes.data());
  EXPECT_EQ(tables(10, 5), (std::vector<std::int32_t>{0, 1, 1, 1, 4}));
  EXPECT_EQ(tables(15, 4), (std::vector<std::int32_t>{0, 1, 1, 1}));  // src: D(0, e, q)
  EXPECT_EQ(tables(19, 4), (std::vector<std::int32_t>{0, 1, 0, 0}));  // dst: c_q[0 L + e]
  EXPECT_EQ(routes[23], 3);                                           // c_0[E]
}

// --- GPU ------------------------------------------------------------------------------

// The kernels at 2, 3 and 4 ranks on one GPU (every rank's buffers on it,
// each rank's copy writing into the others' by pointer): the route tables
// and every receive buffer equal the host references, bytes the copies
// leave alone included.
TEST(EpPeerExchangeCudaTest, KernelsAtSeveralRanksEqualTheHostReferences) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  const DType dtype = DType::kBFloat16;
  const std::size_t B = kShape.row_bytes(dtype);
  using kernels::EpDirection;
  for (const int P : {2, 3, 4}) {
    for (const Routing routing : kRoutings) {
      SCOPED_TRACE("P " + std::to_string(P) + " " + testing::ep_routing_name(routing));
      std::vector<std::int32_t> counts;
      std::vector<RankInput> all;
      for (int p = 0; p < P; ++p) {
        all.push_back(testing::make_ep_input(kShape, seed.value(), p, P, routing, dtype));
        counts.insert(counts.end(), all.back().splits.begin(), all.back().splits.end());
      }
      const kernels::EpPlanDesc base{0, P, kExperts, kRows};
      const std::size_t route_bytes = static_cast<std::size_t>(kernels::ep_route_ints(base)) * 4;
      const std::size_t x_bytes = static_cast<std::size_t>(kRows) * B;
      const std::size_t rows_bytes = static_cast<std::size_t>(P) * x_bytes;
      auto device = [](std::size_t bytes, int fill) {
        void* p = nullptr;
        SG_CUDA_CHECK(cudaMalloc(&p, bytes));
        SG_CUDA_CHECK(cudaMemset(p, fill, bytes));
        return p;
      };
      void* d_counts = device(counts.size() * 4, 0);
      SG_CUDA_CHECK(cudaMemcpy(d_counts, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
      std::vector<void*> d_x(P), d_rows(P), d_back(P), d_dispatch_routes(P), d_combine_routes(P);
      for (int r = 0; r < P; ++r) {
        d_x[r] = device(x_bytes, 0);
        SG_CUDA_CHECK(cudaMemcpy(d_x[r], all[r].x.data(), x_bytes, cudaMemcpyHostToDevice));
        d_rows[r] = device(rows_bytes, 0xAB);  // the rows past the sum keep this
        d_back[r] = device(x_bytes, 0xCD);
        d_dispatch_routes[r] = device(route_bytes, 0);
        d_combine_routes[r] = device(route_bytes, 0);
      }
      auto desc = [&](int r, EpDirection direction) {
        kernels::EpPlanDesc plan = base;
        plan.rank = r;
        return kernels::EpCopyDesc{plan, direction, B};
      };
      for (int r = 0; r < P; ++r) {
        for (const EpDirection direction : {EpDirection::kDispatch, EpDirection::kCombine}) {
          kernels::launch_ep_routes(
              desc(r, direction).plan, direction, static_cast<const std::int32_t*>(d_counts),
              static_cast<std::int32_t*>(direction == EpDirection::kDispatch ? d_dispatch_routes[r]
                                                                             : d_combine_routes[r]),
              nullptr);
        }
        kernels::launch_ep_peer_copy(desc(r, EpDirection::kDispatch), 2,
                                     static_cast<const std::int32_t*>(d_dispatch_routes[r]), d_x[r], d_rows.data(),
                                     nullptr);
      }
      SG_CUDA_CHECK(cudaDeviceSynchronize());  // every dispatch lands before the combines read
      for (int r = 0; r < P; ++r) {
        kernels::launch_ep_peer_copy(desc(r, EpDirection::kCombine), 3,
                                     static_cast<const std::int32_t*>(d_combine_routes[r]), d_rows[r], d_back.data(),
                                     nullptr);
      }
      SG_CUDA_CHECK(cudaDeviceSynchronize());
      // The host references of the same calls, into buffers filled alike.
      std::vector<std::vector<std::uint8_t>> rows(P, std::vector<std::uint8_t>(rows_bytes, 0xAB));
      std::vector<std::vector<std::uint8_t>> back(P, std::vector<std::uint8_t>(x_bytes, 0xCD));
      std::vector<std::vector<std::int32_t>> dispatch_routes(P), combine_routes(P);
      std::vector<void*> row_ptrs, back_ptrs;
      for (int r = 0; r < P; ++r) {
        row_ptrs.push_back(rows[r].data());
        back_ptrs.push_back(back[r].data());
      }
      for (int r = 0; r < P; ++r) {
        dispatch_routes[r].resize(route_bytes / 4);
        combine_routes[r].resize(route_bytes / 4);
        kernels::host::ep_routes(desc(r, EpDirection::kDispatch).plan, EpDirection::kDispatch, counts.data(),
                                 dispatch_routes[r].data());
        kernels::host::ep_routes(desc(r, EpDirection::kCombine).plan, EpDirection::kCombine, counts.data(),
                                 combine_routes[r].data());
        kernels::host::ep_peer_copy(desc(r, EpDirection::kDispatch), dispatch_routes[r].data(), all[r].x.data(),
                                    row_ptrs.data());
      }
      for (int r = 0; r < P; ++r) {
        kernels::host::ep_peer_copy(desc(r, EpDirection::kCombine), combine_routes[r].data(), rows[r].data(),
                                    back_ptrs.data());
      }
      for (int r = 0; r < P; ++r) {
        std::vector<std::int32_t> got_dispatch(route_bytes / 4), got_combine(route_bytes / 4);
        std::vector<std::uint8_t> got_rows(rows_bytes), got_back(x_bytes);
        SG_CUDA_CHECK(cudaMemcpy(got_dispatch.data(), d_dispatch_routes[r], route_bytes, cudaMemcpyDeviceToHost));
        SG_CUDA_CHECK(cudaMemcpy(got_combine.data(), d_combine_routes[r], route_bytes, cudaMemcpyDeviceToHost));
        SG_CUDA_CHECK(cudaMemcpy(got_rows.data(), d_rows[r], rows_bytes, cudaMemcpyDeviceToHost));
        SG_CUDA_CHECK(cudaMemcpy(got_back.data(), d_back[r], x_bytes, cudaMemcpyDeviceToHost));
        EXPECT_EQ(got_dispatch, dispatch_routes[r]) << "rank " << r;
        EXPECT_EQ(got_combine, combine_routes[r]) << "rank " << r;
        EXPECT_TRUE(got_rows == rows[r]) << "rank " << r << ": dispatched buffer";
        EXPECT_TRUE(got_back == back[r]) << "rank " << r << ": combined buffer";
        EXPECT_TRUE(got_back == testing::expected_ep_round_trip(kShape, all[r], dtype)) << "rank " << r;
      }
      SG_CUDA_CHECK(cudaFree(d_counts));
      for (int r = 0; r < P; ++r) {
        for (void* p : {d_x[r], d_rows[r], d_back[r], d_dispatch_routes[r], d_combine_routes[r]}) {
          SG_CUDA_CHECK(cudaFree(p));
        }
      }
    }
  }
}

}  // namespace
}  // namespace stepgraph
