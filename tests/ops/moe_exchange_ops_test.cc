// The expert-parallel exchange ops on host thread worlds of 1, 2 and 4 ranks
// (E = 8 experts, 6 tokens, k = 2, H = 16, fp32 and bf16): dispatch gives
// every local expert exactly the rows the ranks sent it, in rank order, and
// the right splits; combine brings them back bit for bit; a captured step
// whose routing changes before every one of 100 replays equals eager; the
// corner routings (one rank's experts take everything, an empty expert, a
// rank that keeps its rows, a rank with no rows, counts out of range); the
// errors. GPU tests run one rank on CUDA (eager, and captured for 100
// replays) against the host reference, and the kernels at 2 and 4 ranks
// against theirs.
#include "ops/moe_exchange_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "kernels/moe_exchange.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/moe_exchange_inputs.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kExperts = 8;
constexpr std::int64_t kTokens = 6;
constexpr std::int64_t kTopk = 2;
constexpr std::int64_t kRows = kTokens * kTopk;  // R
constexpr std::int64_t kHidden = 16;

constexpr testing::EpExchangeShape kShape{kExperts, kRows, kHidden};
using Routing = testing::EpRouting;
using RankInput = testing::EpRankInput;
using Inputs = testing::EpInputs;

std::vector<RankInput> make_inputs(std::uint32_t seed, int ranks, Routing routing, DType dtype) {
  std::vector<RankInput> all;
  for (int p = 0; p < ranks; ++p) all.push_back(testing::make_ep_input(kShape, seed, p, ranks, routing, dtype));
  return all;
}

// What rank r's experts receive, padded to ep_dispatch's rows [P*R, H].
testing::EpDispatched expected_dispatch(const std::vector<RankInput>& all, int r, DType dtype) {
  testing::EpDispatched out = testing::expected_ep_dispatch(kShape, all, r, dtype);
  out.rows.resize(all.size() * static_cast<std::size_t>(kRows) * kShape.row_bytes(dtype), 0);
  return out;
}

// counts, dispatch and combine: {rows, splits, y_perm, counts}.
std::vector<Tensor> exchange_step(Context& ctx, Communicator& comm, const Inputs& in) {
  const Tensor counts = ops::ep_counts(ctx, comm, in.splits);
  const ops::EpDispatch d = ops::ep_dispatch(ctx, comm, in.x, counts);
  const Tensor y = ops::ep_combine(ctx, comm, d.rows, counts);
  return {d.rows, d.splits, y, counts};
}

// The dispatched rows up to the splits' sum: all that the peer transport
// writes (Note [Expert-parallel exchange]; the padded exchange zeroes the rest).
std::vector<std::uint8_t> received_rows(const std::vector<std::uint8_t>& rows, const std::vector<std::int32_t>& splits,
                                        DType dtype) {
  std::int64_t sum = 0;
  for (const std::int32_t s : splits) sum += s;
  return {rows.begin(),
          rows.begin() + static_cast<std::ptrdiff_t>(sum * static_cast<std::int64_t>(kShape.row_bytes(dtype)))};
}

// What the dispatched rows past the received sum hold.
enum class Padding { kZero, kUnspecified };

// Rank r's results against the expectations from every rank's input.
void expect_exchange(Context& ctx, const std::vector<Tensor>& out, const std::vector<RankInput>& all, int r,
                     DType dtype, Padding padding = Padding::kZero) {
  const int P = static_cast<int>(all.size());
  const testing::EpDispatched want = expected_dispatch(all, r, dtype);
  ASSERT_EQ(out[0].shape(), (Shape{P * kRows, kHidden}));
  ASSERT_EQ(out[1].shape(), (Shape{kExperts / P}));
  EXPECT_EQ(ctx.to_vector<std::int32_t>(out[1]), want.splits) << "rank " << r;
  if (padding == Padding::kZero) {
    EXPECT_TRUE(testing::tensor_bytes(ctx, out[0]) == want.rows) << "rank " << r << ": dispatched rows differ";
  } else {
    EXPECT_TRUE(received_rows(testing::tensor_bytes(ctx, out[0]), want.splits, dtype) ==
                received_rows(want.rows, want.splits, dtype))
        << "rank " << r << ": dispatched rows differ";
  }
  EXPECT_TRUE(testing::tensor_bytes(ctx, out[2]) == testing::expected_ep_round_trip(kShape, all[r], dtype))
      << "rank " << r << ": combine(dispatch(x)) is not x";
  std::vector<std::int32_t> counts;
  for (const RankInput& in : all) counts.insert(counts.end(), in.splits.begin(), in.splits.end());
  EXPECT_EQ(ctx.to_vector<std::int32_t>(out[3]), counts) << "rank " << r;
}

struct Case {
  int ranks;
  DType dtype;
  Routing routing;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "P=" << c.ranks << " " << dtype_name(c.dtype) << " " << testing::ep_routing_name(c.routing);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "ep" + std::to_string(info.param.ranks) + "_" + std::string(dtype_name(info.param.dtype)) + "_" +
         testing::ep_routing_name(info.param.routing);
}

class EpExchangeTest : public ::testing::TestWithParam<Case> {};

TEST_P(EpExchangeTest, DispatchGivesEachExpertItsRowsAndCombineRestoresThem) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  const std::vector<RankInput> all = make_inputs(seed.value(), c.ranks, c.routing, c.dtype);
  HostWorld::run(c.ranks, [&](Communicator& comm) {
    SCOPED_TRACE(testing::seed_note(seed.value()));  // traces are per thread
    Context ctx(Device::kHost, /*side_streams=*/1);
    ctx.set_communication_stream(1);
    const Inputs in = testing::make_ep_inputs_on(ctx, kShape, "", c.dtype);
    testing::load_ep_inputs(ctx, in, all[comm.rank()]);
    const std::vector<Tensor> out = exchange_step(ctx, comm, in);
    expect_exchange(ctx, out, all, comm.rank(), c.dtype);
    // The backwards are the other direction.
    const Tensor counts = out[3];
    EXPECT_TRUE(testing::tensor_bytes(ctx, ops::ep_dispatch_backward(ctx, comm, out[0], counts)) ==
                testing::tensor_bytes(ctx, out[2]));
    EXPECT_TRUE(testing::tensor_bytes(ctx, ops::ep_combine_backward(ctx, comm, out[2], counts)) ==
                testing::tensor_bytes(ctx, out[0]));
  });
}

std::vector<Case> every_case() {
  std::vector<Case> cases;
  for (const int ranks : {1, 2, 4}) {
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (const Routing routing :
           {Routing::kRandom, Routing::kAllToRankZero, Routing::kEmptyExpert, Routing::kRankKeepsItsRows,
            Routing::kRankSendsNothing, Routing::kCountsOutOfRange}) {
        cases.push_back({ranks, dtype, routing});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(HostWorlds, EpExchangeTest, ::testing::ValuesIn(every_case()), case_name);

class EpExchangeCaptureTest : public ::testing::TestWithParam<Case> {};

// The routing changes before every replay (new splits and rows copied into
// the step's persistent inputs); each replay equals eager and the expectation.
// The world has peer copies, so the captured exchange moves the counted rows
// only: the dispatched rows are compared up to their sum.
TEST_P(EpExchangeCaptureTest, CapturedStepEqualsEagerWhileRoutingChanges) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  constexpr int kReplays = 100;
  HostWorld::run(c.ranks, [&](Communicator& comm) {
    SCOPED_TRACE(testing::seed_note(seed.value()));  // traces are per thread
    Context ctx(Device::kHost, /*side_streams=*/1);
    ctx.set_communication_stream(1);
    const Inputs eager = testing::make_ep_inputs_on(ctx, kShape, "eager.", c.dtype);
    const Inputs graphed = testing::make_ep_inputs_on(ctx, kShape, "graph.", c.dtype);
    auto step = CapturedStep::capture(ctx, [&] { return exchange_step(ctx, comm, graphed); },
                                      {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    const Routing routings[] = {Routing::kRandom, Routing::kAllToRankZero, Routing::kEmptyExpert,
                                Routing::kRankKeepsItsRows, Routing::kRankSendsNothing};
    for (int i = 0; i < kReplays; ++i) {
      const Routing routing = routings[i % 5];
      const std::vector<RankInput> all =
          make_inputs(seed.value() + static_cast<std::uint32_t>(i), c.ranks, routing, c.dtype);
      testing::load_ep_inputs(ctx, eager, all[comm.rank()]);
      testing::load_ep_inputs(ctx, graphed, all[comm.rank()]);
      const std::vector<Tensor> want = exchange_step(ctx, comm, eager);
      step->replay();
      const std::vector<Tensor> got = step->outputs();
      const std::vector<std::int32_t> splits = ctx.to_vector<std::int32_t>(want[1]);
      for (std::size_t k = 0; k < want.size(); ++k) {
        const bool rows = k == 0 && c.ranks > 1;
        EXPECT_TRUE(rows ? received_rows(testing::tensor_bytes(ctx, want[k]), splits, c.dtype) ==
                               received_rows(testing::tensor_bytes(ctx, got[k]), splits, c.dtype)
                         : testing::tensor_bytes(ctx, want[k]) == testing::tensor_bytes(ctx, got[k]))
            << "rank " << comm.rank() << " replay " << i << " output " << k << " (" << testing::ep_routing_name(routing)
            << ")";
      }
      expect_exchange(ctx, got, all, comm.rank(), c.dtype, c.ranks > 1 ? Padding::kUnspecified : Padding::kZero);
      if (::testing::Test::HasFailure()) return;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(HostWorlds, EpExchangeCaptureTest,
                         ::testing::Values(Case{1, DType::kFloat32, Routing::kRandom},
                                           Case{2, DType::kBFloat16, Routing::kRandom},
                                           Case{4, DType::kFloat32, Routing::kRandom}),
                         case_name);

// --- errors ---------------------------------------------------------------------------

TEST(EpExchangeErrorTest, ExpertsNotDivisibleByRanks) {
  HostWorld::run(4, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    const Tensor x = ctx.persistent("x", {Shape{kRows, kHidden}, DType::kFloat32});
    const Tensor counts = ctx.persistent("counts", {Shape{4, 6}, DType::kInt32});
    EXPECT_ERROR_CONTAINS(ops::ep_dispatch(ctx, comm, x, counts), "experts (6)",
                          "multiple of the expert-parallel ranks (4)");
  });
}

TEST(EpExchangeErrorTest, CountsOfTheWrongShapeOrDtype) {
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    const Tensor x = ctx.persistent("x", {Shape{kRows, kHidden}, DType::kFloat32});
    const Tensor flat = ctx.persistent("flat", {Shape{2 * kExperts}, DType::kInt32});
    const Tensor three = ctx.persistent("three", {Shape{3, kExperts}, DType::kInt32});
    const Tensor floats = ctx.persistent("floats", {Shape{2, kExperts}, DType::kFloat32});
    EXPECT_ERROR_CONTAINS(ops::ep_dispatch(ctx, comm, x, flat), "ep_dispatch", "counts must be int32 [P, E]", "P = 2",
                          "ep_counts");
    EXPECT_ERROR_CONTAINS(
        ops::ep_combine(ctx, comm, ctx.persistent("y", {Shape{2 * kRows, kHidden}, DType::kFloat32}), three),
        "ep_combine", "counts must be int32 [P, E]", "[3, 8]");
    EXPECT_ERROR_CONTAINS(ops::ep_dispatch(ctx, comm, x, floats), "counts must be int32", "fp32");
  });
}

TEST(EpExchangeErrorTest, MismatchedDtypesAndShapes) {
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    const Tensor float_splits = ctx.persistent("splits", {Shape{kExperts}, DType::kFloat32});
    EXPECT_ERROR_CONTAINS(ops::ep_counts(ctx, comm, float_splits), "splits must be int32 [E]", "fp32");
    const Tensor counts = ctx.persistent("counts", {Shape{2, kExperts}, DType::kInt32});
    const Tensor vector = ctx.persistent("v", {Shape{kRows}, DType::kFloat32});
    EXPECT_ERROR_CONTAINS(ops::ep_dispatch(ctx, comm, vector, counts), "x_perm must be a matrix");
    const Tensor odd = ctx.persistent("odd", {Shape{2 * kRows + 1, kHidden}, DType::kBFloat16});
    EXPECT_ERROR_CONTAINS(ops::ep_combine(ctx, comm, odd, counts), "y_rows", "P * R rows");
  });
}

// The unpack refuses slots of different dtypes (what a peer would send in a
// mismatched exchange), naming the slot.
TEST(EpExchangeErrorTest, UnpackRefusesSlotsOfDifferentDtypes) {
  Context ctx(Device::kHost);
  const ops::EpCopyParams p{kernels::EpDirection::kDispatch, 0, 2, kRows, kExperts};
  const kernels::EpPlanDesc desc{0, 2, kExperts, kRows};
  const Tensor plan = ctx.persistent("plan", {Shape{desc.plan_ints()}, DType::kInt32});
  const Tensor a = ctx.persistent("a", {Shape{kRows, kHidden}, DType::kFloat32});
  const Tensor b = ctx.persistent("b", {Shape{kRows, kHidden}, DType::kBFloat16});
  EXPECT_ERROR_CONTAINS(ctx.call(ops::ep_unpack_op(), p, {plan, a, b}), "slots[1] is bf16 but slots[0] is fp32");
}

// --- GPU ------------------------------------------------------------------------------

// One rank on CUDA through NCCL equals the host reference, bit for bit.
TEST(EpExchangeCudaTest, OneRankEqualsTheHostReference) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  auto comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const std::vector<RankInput> all = make_inputs(seed.value(), 1, Routing::kCountsOutOfRange, dtype);
    Context cuda(Device::kCuda, 1);
    cuda.set_communication_stream(1);
    const Inputs in = testing::make_ep_inputs_on(cuda, kShape, "", dtype);
    testing::load_ep_inputs(cuda, in, all[0]);
    const std::vector<Tensor> got = exchange_step(cuda, *comm, in);
    std::vector<std::vector<std::uint8_t>> want;
    HostWorld::run(1, [&](Communicator& host_comm) {
      Context host(Device::kHost);
      const Inputs host_in = testing::make_ep_inputs_on(host, kShape, "", dtype);
      testing::load_ep_inputs(host, host_in, all[0]);
      for (const Tensor& t : exchange_step(host, host_comm, host_in)) want.push_back(testing::tensor_bytes(host, t));
    });
    for (std::size_t k = 0; k < got.size(); ++k)
      EXPECT_TRUE(testing::tensor_bytes(cuda, got[k]) == want[k]) << "output " << k;
    expect_exchange(cuda, got, all, 0, dtype);
  }
}

// The exchange captured in a CUDA graph on one rank: 100 replays, the routing
// changed before each, every replay equal to the host reference.
TEST(EpExchangeCudaTest, CapturedOneRankEqualsTheHostReferenceWhileRoutingChanges) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  const DType dtype = DType::kBFloat16;
  auto comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context cuda(Device::kCuda, 1);
  cuda.set_communication_stream(1);
  const Inputs in = testing::make_ep_inputs_on(cuda, kShape, "", dtype);
  auto step = CapturedStep::capture(cuda, [&] { return exchange_step(cuda, *comm, in); },
                                    {.pool_report_policy = PoolReportPolicy::kError, .communicators = {comm.get()}});
  const Routing routings[] = {Routing::kRandom, Routing::kEmptyExpert, Routing::kCountsOutOfRange};
  for (int i = 0; i < 100; ++i) {
    const Routing routing = routings[i % 3];
    const std::vector<RankInput> all = make_inputs(seed.value() + static_cast<std::uint32_t>(i), 1, routing, dtype);
    testing::load_ep_inputs(cuda, in, all[0]);
    step->replay();
    expect_exchange(cuda, step->outputs(), all, 0, dtype);
    if (::testing::Test::HasFailure()) FAIL() << "replay " << i << " (" << testing::ep_routing_name(routing) << ")";
  }
}

// The kernels at 2 and 4 ranks on one GPU (every rank's buffers on it, the
// exchange by pointers): plan, pack and unpack equal their host references.
TEST(EpExchangeCudaTest, KernelsAtSeveralRanksEqualTheHostReferences) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  const DType dtype = DType::kBFloat16;
  const std::size_t B = kShape.row_bytes(dtype);
  for (const int P : {2, 4}) {
    const std::vector<RankInput> all = make_inputs(seed.value(), P, Routing::kCountsOutOfRange, dtype);
    std::vector<std::int32_t> counts;
    for (const RankInput& in : all) counts.insert(counts.end(), in.splits.begin(), in.splits.end());
    const std::size_t slot_bytes = static_cast<std::size_t>(kRows) * B;
    // Device: counts, then per rank: plan, splits, x, P slots, rows.
    void* d_counts = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&d_counts, counts.size() * 4));
    SG_CUDA_CHECK(cudaMemcpy(d_counts, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
    const kernels::EpPlanDesc base{0, P, kExperts, kRows};
    std::vector<void*> d_plan(P), d_splits(P), d_x(P), d_rows(P), d_back(P);
    std::vector<std::vector<void*>> d_slots(P, std::vector<void*>(P)), d_returned(P, std::vector<void*>(P));
    for (int r = 0; r < P; ++r) {
      SG_CUDA_CHECK(cudaMalloc(&d_plan[r], base.plan_ints() * 4));
      SG_CUDA_CHECK(cudaMalloc(&d_splits[r], kExperts * 4));
      SG_CUDA_CHECK(cudaMalloc(&d_x[r], slot_bytes));
      SG_CUDA_CHECK(cudaMalloc(&d_rows[r], P * slot_bytes));
      SG_CUDA_CHECK(cudaMalloc(&d_back[r], slot_bytes));
      SG_CUDA_CHECK(cudaMemcpy(d_x[r], all[r].x.data(), slot_bytes, cudaMemcpyHostToDevice));
      for (int q = 0; q < P; ++q) {
        SG_CUDA_CHECK(cudaMalloc(&d_slots[r][q], slot_bytes));
        SG_CUDA_CHECK(cudaMalloc(&d_returned[r][q], slot_bytes));
      }
    }
    auto desc = [&](int r, kernels::EpDirection direction) {
      kernels::EpPlanDesc plan = base;
      plan.rank = r;
      return kernels::EpCopyDesc{plan, direction, B};
    };
    using kernels::EpDirection;
    for (int r = 0; r < P; ++r) {
      kernels::launch_ep_plan(desc(r, EpDirection::kDispatch).plan, static_cast<const std::int32_t*>(d_counts),
                              static_cast<std::int32_t*>(d_plan[r]), static_cast<std::int32_t*>(d_splits[r]), nullptr);
      kernels::launch_ep_pack(desc(r, EpDirection::kDispatch), static_cast<const std::int32_t*>(d_plan[r]), d_x[r],
                              d_slots[r].data(), nullptr);
    }
    // Rank r receives slot r of every rank p.
    for (int r = 0; r < P; ++r) {
      std::vector<const void*> in;
      for (int p = 0; p < P; ++p) in.push_back(d_slots[p][r]);
      kernels::launch_ep_unpack(desc(r, EpDirection::kDispatch), static_cast<const std::int32_t*>(d_plan[r]), in.data(),
                                d_rows[r], nullptr);
      kernels::launch_ep_pack(desc(r, EpDirection::kCombine), static_cast<const std::int32_t*>(d_plan[r]), d_rows[r],
                              d_returned[r].data(), nullptr);
    }
    for (int r = 0; r < P; ++r) {
      std::vector<const void*> in;
      for (int q = 0; q < P; ++q) in.push_back(d_returned[q][r]);
      kernels::launch_ep_unpack(desc(r, EpDirection::kCombine), static_cast<const std::int32_t*>(d_plan[r]), in.data(),
                                d_back[r], nullptr);
    }
    SG_CUDA_CHECK(cudaDeviceSynchronize());
    for (int r = 0; r < P; ++r) {
      // The host reference of the same calls.
      std::vector<std::int32_t> plan(static_cast<std::size_t>(base.plan_ints())), splits(kExperts / P);
      kernels::host::ep_plan(desc(r, EpDirection::kDispatch).plan, counts.data(), plan.data(), splits.data());
      std::vector<std::int32_t> got_plan(plan.size()), got_splits(splits.size());
      SG_CUDA_CHECK(cudaMemcpy(got_plan.data(), d_plan[r], plan.size() * 4, cudaMemcpyDeviceToHost));
      SG_CUDA_CHECK(cudaMemcpy(got_splits.data(), d_splits[r], splits.size() * 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(got_plan, plan) << "P " << P << " rank " << r;
      EXPECT_EQ(got_splits, splits) << "P " << P << " rank " << r;
      const testing::EpDispatched want = expected_dispatch(all, r, dtype);
      std::vector<std::uint8_t> rows(P * slot_bytes), back(slot_bytes);
      SG_CUDA_CHECK(cudaMemcpy(rows.data(), d_rows[r], rows.size(), cudaMemcpyDeviceToHost));
      SG_CUDA_CHECK(cudaMemcpy(back.data(), d_back[r], back.size(), cudaMemcpyDeviceToHost));
      EXPECT_TRUE(rows == want.rows) << "P " << P << " rank " << r;
      EXPECT_TRUE(back == testing::expected_ep_round_trip(kShape, all[r], dtype)) << "P " << P << " rank " << r;
    }
    SG_CUDA_CHECK(cudaFree(d_counts));
    for (int r = 0; r < P; ++r) {
      for (void* p : {d_plan[r], d_splits[r], d_x[r], d_rows[r], d_back[r]}) SG_CUDA_CHECK(cudaFree(p));
      for (int q = 0; q < P; ++q) {
        SG_CUDA_CHECK(cudaFree(d_slots[r][q]));
        SG_CUDA_CHECK(cudaFree(d_returned[r][q]));
      }
    }
  }
}

}  // namespace
}  // namespace stepgraph
