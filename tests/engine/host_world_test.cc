// The host thread world: every collective against its single-process
// reference on worlds of 2 and 4 ranks, and its faults (a mismatched call, a
// dead rank, a stalled rank) ending in an Error within a bounded time.
#include "engine/host_world.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using namespace std::chrono_literals;

// Rank r's i-th element: distinct per rank and element, exact in bf16.
float value(int rank, std::int64_t i) { return static_cast<float>((rank + 1) * 0.5 + static_cast<double>(i % 7)); }

std::vector<float> rank_data(int rank, std::int64_t count) {
  std::vector<float> data(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) data[static_cast<std::size_t>(i)] = value(rank, i);
  return data;
}

class HostWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(HostWorldTest, AllReduceSumAndMaxMatchTheReferenceOnEveryRank) {
  const int n = GetParam();
  constexpr std::int64_t kCount = 1000;
  HostWorld::run(n, [&](Communicator& comm) {
    std::vector<float> data = rank_data(comm.rank(), kCount);
    std::vector<float> sum(kCount), max(kCount);
    comm.all_reduce(data.data(), sum.data(), kCount, DType::kFloat32, ReduceOp::kSum, nullptr);
    comm.all_reduce(data.data(), max.data(), kCount, DType::kFloat32, ReduceOp::kMax, nullptr);
    comm.all_reduce(data.data(), data.data(), kCount, DType::kFloat32, ReduceOp::kSum, nullptr);  // in place
    for (std::int64_t i = 0; i < kCount; ++i) {
      float expected = value(0, i);
      for (int r = 1; r < n; ++r) expected += value(r, i);  // rank order, in fp32
      ASSERT_EQ(sum[i], expected) << "rank " << comm.rank() << " element " << i;
      ASSERT_EQ(data[i], expected) << "in place, rank " << comm.rank() << " element " << i;
      ASSERT_EQ(max[i], value(n - 1, i));
    }
  });
}

TEST_P(HostWorldTest, AllReduceOfBf16AndInt64) {
  const int n = GetParam();
  HostWorld::run(n, [&](Communicator& comm) {
    std::vector<std::uint16_t> bf16(16);
    for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = float_to_bf16(value(comm.rank(), static_cast<int>(i)));
    comm.all_reduce(bf16.data(), bf16.data(), 16, DType::kBFloat16, ReduceOp::kSum, nullptr);
    std::vector<std::int64_t> ints = {comm.rank() + 1, std::int64_t{1} << 40};
    comm.all_reduce(ints.data(), ints.data(), 2, DType::kInt64, ReduceOp::kSum, nullptr);
    for (std::size_t i = 0; i < bf16.size(); ++i) {
      float expected = 0;
      for (int r = 0; r < n; ++r) expected += value(r, static_cast<int>(i));
      ASSERT_EQ(bf16_to_float(bf16[i]), bf16_to_float(float_to_bf16(expected)));
    }
    EXPECT_EQ(ints[0], n * (n + 1) / 2);
    EXPECT_EQ(ints[1], n * (std::int64_t{1} << 40));
  });
}

TEST_P(HostWorldTest, ReduceScatterAllGatherAndBroadcast) {
  const int n = GetParam();
  constexpr std::int64_t kBlock = 37;
  HostWorld::run(n, [&](Communicator& comm) {
    const int rank = comm.rank();
    const std::vector<float> data = rank_data(rank, kBlock * n);
    std::vector<float> shard(kBlock);
    comm.reduce_scatter(data.data(), shard.data(), kBlock, DType::kFloat32, ReduceOp::kSum, nullptr);
    for (std::int64_t i = 0; i < kBlock; ++i) {
      float expected = value(0, rank * kBlock + i);
      for (int r = 1; r < n; ++r) expected += value(r, rank * kBlock + i);
      ASSERT_EQ(shard[i], expected);
    }
    // all_gather in place: this rank's block already sits at its offset.
    std::vector<float> gathered(static_cast<std::size_t>(kBlock * n), -1.0f);
    for (std::int64_t i = 0; i < kBlock; ++i) gathered[rank * kBlock + i] = value(rank, i);
    comm.all_gather(gathered.data() + rank * kBlock, gathered.data(), kBlock, DType::kFloat32, nullptr);
    for (int r = 0; r < n; ++r) {
      for (std::int64_t i = 0; i < kBlock; ++i) ASSERT_EQ(gathered[r * kBlock + i], value(r, i));
    }
    std::vector<float> root_data = rank_data(rank, 5);
    comm.broadcast(root_data.data(), root_data.data(), 5, DType::kFloat32, n - 1, nullptr);
    EXPECT_EQ(root_data, rank_data(n - 1, 5));
  });
}

TEST_P(HostWorldTest, SendRecvAroundARingAndExchange) {
  const int n = GetParam();
  HostWorld::run(n, [&](Communicator& comm) {
    const int rank = comm.rank();
    if (n > 1) {  // a ring needs a neighbour
      const std::vector<float> mine = rank_data(rank, 9);
      std::vector<float> theirs(9);
      comm.send(mine.data(), 9, DType::kFloat32, (rank + 1) % n, nullptr);
      comm.recv(theirs.data(), 9, DType::kFloat32, (rank + n - 1) % n, nullptr);
      EXPECT_EQ(theirs, rank_data((rank + n - 1) % n, 9));
    }
    const std::vector<std::string> all = comm.exchange(std::string(static_cast<std::size_t>(rank), 'x'), "test");
    ASSERT_EQ(all.size(), static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(all[static_cast<std::size_t>(r)], std::string(static_cast<std::size_t>(r), 'x'));
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, HostWorldTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "ranks" + std::to_string(info.param); });

TEST(HostWorldFaultTest, DifferentCallsOnTwoRanksAreAnErrorNamingBoth) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(HostWorld::run(2,
                                       [](Communicator& comm) {
                                         std::vector<float> data(8);
                                         const std::int64_t count = comm.rank() == 0 ? 8 : 4;
                                         comm.all_reduce(data.data(), data.data(), count, DType::kFloat32,
                                                         ReduceOp::kSum, nullptr);
                                       }),
                        "collective #1 differs between ranks", "rank 0 calls all_reduce(8 fp32, sum)",
                        "rank 1 calls all_reduce(4 fp32, sum)");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(HostWorldFaultTest, ADeadRankEndsTheOthersAtOnceNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(HostWorld::run(4,
                                       [](Communicator& comm) {
                                         if (comm.rank() == 2) SG_THROW(ErrorCode::kIo, "the data file vanished");
                                         std::vector<float> data(8);
                                         comm.all_reduce(data.data(), data.data(), 8, DType::kFloat32, ReduceOp::kSum,
                                                         nullptr);
                                       }),
                        "rank 2", "the data file vanished");
  // The others were waiting in all_reduce with a 5-minute timeout: the abort ended them.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(HostWorldFaultTest, AStalledRankTimesOutNamingTheRankThatNeverArrived) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(HostWorld::run(
                            3,
                            [](Communicator& comm) {
                              if (comm.rank() == 1) {
                                std::this_thread::sleep_for(600ms);  // stalls past the timeout, then leaves
                                return;
                              }
                              std::vector<float> data(8);
                              comm.all_reduce(data.data(), data.data(), 8, DType::kFloat32, ReduceOp::kSum, nullptr);
                            },
                            200ms),
                        "waited 200 ms at all_reduce(8 fp32, sum) #1", "rank(s) 1 never arrived");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(HostWorldFaultTest, ARecvWithoutASendTimesOut) {
  EXPECT_ERROR_CONTAINS(HostWorld::run(
                            2,
                            [](Communicator& comm) {
                              if (comm.rank() == 0) {
                                std::vector<float> data(4);
                                comm.recv(data.data(), 4, DType::kFloat32, 1, nullptr);
                              }
                            },
                            200ms),
                        "recv #1", "for rank 1, which sent nothing");
}

TEST(HostWorldFaultTest, BadArgumentsAreClearErrors) {
  HostWorld world(2);
  auto comm = world.communicator(0, "dp");
  float data[4] = {};
  EXPECT_ERROR_CONTAINS(comm->send(data, 4, DType::kFloat32, 0, nullptr), "communicator 'dp' (rank 0 of 2, host)",
                        "the peer must be another rank");
  EXPECT_ERROR_CONTAINS(comm->broadcast(data, data, 4, DType::kFloat32, 5, nullptr), "root must be a rank in [0, 2)");
  EXPECT_ERROR_CONTAINS(comm->all_reduce(data, data, -1, DType::kFloat32, ReduceOp::kSum, nullptr),
                        "count must be >= 0");
  EXPECT_ERROR_CONTAINS(comm->all_reduce(data, data, 4, DType::kFloat8E4M3, ReduceOp::kSum, nullptr),
                        "fp8 values cannot be reduced");
  EXPECT_ERROR_CONTAINS(world.communicator(2), "rank must be in [0, 2)");
  EXPECT_ERROR_CONTAINS(HostWorld(0), "size must be >= 1");
}

TEST(CommunicatorRegistryTest, ADestroyedCommunicatorIsNotFound) {
  HostWorld world(1);
  std::uint64_t id = 0;
  {
    auto comm = world.communicator(0);
    id = comm->id();
    EXPECT_EQ(&find_communicator(id), comm.get());
  }
  EXPECT_ERROR_CONTAINS(find_communicator(id), "was destroyed");
}

}  // namespace
}  // namespace stepgraph

namespace stepgraph {
namespace {

// A world of 4 split two ways (the tensor- and data-parallel groups of a 2x2
// grid): each group's collectives see only its ranks, ranked by key.
TEST(HostWorldSplitTest, AWorldOfFourSplitsIntoTwoGridsOfGroups) {
  HostWorld::run(4, [](Communicator& world) {
    const int r = world.rank();
    const std::unique_ptr<Communicator> tp = world.split(r / 2, r, "tp");  // {0,1} {2,3}
    const std::unique_ptr<Communicator> dp = world.split(r % 2, -r, "dp");  // {2,0} {3,1}: key reverses the order
    EXPECT_EQ(tp->world_size(), 2);
    EXPECT_EQ(tp->rank(), r % 2);
    EXPECT_EQ(dp->rank(), r < 2 ? 1 : 0);
    EXPECT_EQ(tp->name(), "tp");
    float value = static_cast<float>(r + 1);
    tp->all_reduce(&value, &value, 1, DType::kFloat32, ReduceOp::kSum, nullptr);
    EXPECT_EQ(value, r < 2 ? 3.0f : 7.0f);
    float rank_of = static_cast<float>(r);
    std::vector<float> gathered(2);
    dp->all_gather(&rank_of, gathered.data(), 1, DType::kFloat32, nullptr);
    EXPECT_EQ(gathered, (r % 2 == 0 ? std::vector<float>{2, 0} : std::vector<float>{3, 1}));
    EXPECT_ERROR_CONTAINS(world.split(-1, 0, "bad"), "color must be >= 0");
  });
}

}  // namespace
}  // namespace stepgraph
