// The host Communicator over the rendezvous, between real processes: each
// test forks one child per rank on 127.0.0.1 through forked_ranks.h, as
// rendezvous_test does (a child reports by exit code; a hang is killed and
// fails the test).
//
// Every collective is checked against a reference computed in the child, and
// bit for bit against a HostWorld (threads) of the same size run in the same
// child on the same inputs: a process world and a thread world give the same
// bits.
#include "launch/rendezvous_communicator.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/host_reduce.h"
#include "engine/host_world.h"
#include "launch/rendezvous.h"
#include "tests/launch/forked_ranks.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using namespace ::stepgraph::testing;  // NOLINT(google-build-using-namespace): the harness of forked_ranks.h

using Bytes = std::vector<std::byte>;

// Rank `rank` of a world of `world` processes; `timeout` is the rendezvous's per-exchange timeout.
std::unique_ptr<Communicator> connect(int rank, int world, int port, milliseconds timeout = seconds(5)) {
  std::unique_ptr<Rendezvous> rendezvous = Rendezvous::connect(rank_info(rank, world, port), "comm-test", seconds(5));
  rendezvous->set_timeout(timeout);
  return make_rendezvous_communicator(std::move(rendezvous), "world");
}

// Each of `world` forked ranks connects (`timeout` per exchange) and runs
// body(rank, comm), whose return is the rank's exit code; every rank must
// succeed.
void on_connected_ranks(int world, const std::function<int(int, std::unique_ptr<Communicator>&)>& body,
                        milliseconds timeout = seconds(5)) {
  const int port = free_port();
  expect_all_succeeded(run_processes(world, [&](int rank) {
    auto comm = connect(rank, world, port, timeout);
    return body(rank, comm);
  }));
}

// ---- inputs and references

// Rank `rank`'s input `salt`: values of mixed signs and magnitudes, so that a sum in another order gives other bits.
Bytes input(DType dtype, int rank, std::int64_t count, int salt) {
  Bytes out(static_cast<std::size_t>(count) * dtype_size(dtype));
  constexpr float kScales[] = {1e-3f, 1.0f, 3e7f};
  constexpr float kHalfScales[] = {1e-3f, 1.0f, 30.0f};  // fp16 ends at 65504
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t base = (i * 37 + rank * 101 + salt * 13) % 1001 - 500;
    const std::size_t scale = static_cast<std::size_t>((i + rank) % 3);
    switch (dtype) {
      case DType::kFloat32:
        store_from_float(dtype, out.data(), i,
                         static_cast<float>(base) * kScales[scale] + 0.1f * static_cast<float>(rank));
        break;
      case DType::kBFloat16:
      case DType::kFloat16:
        store_from_float(dtype, out.data(), i, static_cast<float>(base) * kHalfScales[scale]);
        break;
      case DType::kInt32:
        reinterpret_cast<std::int32_t*>(out.data())[i] = static_cast<std::int32_t>(base * 1000 + rank);
        break;
      case DType::kInt64: reinterpret_cast<std::int64_t*>(out.data())[i] = base * 1'000'000'000'000 + rank; break;
      default: ADD_FAILURE() << "no inputs of " << dtype_name(dtype);
    }
  }
  return out;
}

Bytes concat_bytes(const std::vector<Bytes>& parts) {
  Bytes out;
  for (const Bytes& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

std::string first_difference(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return detail::concat(a.size(), " bytes against ", b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return detail::concat("byte ", i, " differs");
  }
  return "";
}

// 0 when fp32 `got` is within rounding of the exact sum of every rank's input `salt` (elements [first, first+n)).
int check_fp32_sum(const Bytes& got, int world, std::int64_t total, int salt, std::int64_t first, std::int64_t n,
                   std::string_view what) {
  std::vector<Bytes> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(input(DType::kFloat32, r, total, salt));
  for (std::int64_t i = 0; i < n; ++i) {
    double exact = 0;
    double magnitude = 0;
    for (const Bytes& in : inputs) {
      const double x = reinterpret_cast<const float*>(in.data())[first + i];
      exact += x;
      magnitude += std::abs(x);
    }
    const double value = reinterpret_cast<const float*>(got.data())[i];
    CHILD_CHECK(std::abs(value - exact) <= world * 1.2e-7 * magnitude, what, " element ", i, ": ", value,
                " instead of ", exact);
  }
  return 0;
}

// ---- every collective, as the same calls on any communicator

using Results = std::map<std::string, Bytes>;

Results run_suite(Communicator& comm) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  Results out;
  constexpr std::int64_t kN = 1000;
  struct Reduction {
    const char* name;
    DType dtype;
    ReduceOp op;
  };
  for (const Reduction& reduction : {Reduction{"all_reduce fp32 sum", DType::kFloat32, ReduceOp::kSum},
                                     Reduction{"all_reduce fp32 max", DType::kFloat32, ReduceOp::kMax},
                                     Reduction{"all_reduce bf16 sum", DType::kBFloat16, ReduceOp::kSum},
                                     Reduction{"all_reduce fp16 sum", DType::kFloat16, ReduceOp::kSum},
                                     Reduction{"all_reduce int32 sum", DType::kInt32, ReduceOp::kSum},
                                     Reduction{"all_reduce int64 max", DType::kInt64, ReduceOp::kMax}}) {
    const Bytes send = input(reduction.dtype, rank, kN, 1);
    Bytes recv(send.size());
    comm.all_reduce(send.data(), recv.data(), kN, reduction.dtype, reduction.op, nullptr);
    out[reduction.name] = recv;
  }
  {
    Bytes buffer = input(DType::kFloat32, rank, kN, 2);
    comm.all_reduce(buffer.data(), buffer.data(), kN, DType::kFloat32, ReduceOp::kSum, nullptr);
    out["all_reduce fp32 sum in place"] = buffer;
    comm.all_reduce(nullptr, nullptr, 0, DType::kFloat32, ReduceOp::kSum, nullptr);
  }
  {
    const std::vector<std::int64_t> counts = {300, 0, 77, 500};
    std::vector<Bytes> buffers;
    std::vector<void*> pointers;
    for (std::size_t b = 0; b < counts.size(); ++b)
      buffers.push_back(input(DType::kFloat32, rank, counts[b], 3 + static_cast<int>(b)));
    for (Bytes& buffer : buffers) pointers.push_back(buffer.data());
    comm.all_reduce_many(pointers, counts, DType::kFloat32, ReduceOp::kSum, nullptr);
    for (std::size_t b = 0; b < counts.size(); ++b) out["all_reduce_many buffer " + std::to_string(b)] = buffers[b];
  }
  {
    constexpr std::int64_t kBlock = 250;
    const Bytes send = input(DType::kFloat32, rank, world * kBlock, 7);
    Bytes recv(kBlock * 4);
    comm.reduce_scatter(send.data(), recv.data(), kBlock, DType::kFloat32, ReduceOp::kSum, nullptr);
    out["reduce_scatter fp32 sum"] = recv;
  }
  {
    constexpr std::int64_t kBlock = 100;
    Bytes buffer = input(DType::kBFloat16, rank, world * kBlock, 8);
    std::byte* mine = buffer.data() + rank * kBlock * 2;
    comm.reduce_scatter(buffer.data(), mine, kBlock, DType::kBFloat16, ReduceOp::kMax, nullptr);
    out["reduce_scatter bf16 max in place"] = Bytes(mine, mine + kBlock * 2);
  }
  {
    const Bytes send = input(DType::kInt64, rank, 33, 9);
    Bytes recv(static_cast<std::size_t>(world) * send.size());
    comm.all_gather(send.data(), recv.data(), 33, DType::kInt64, nullptr);
    out["all_gather int64"] = recv;
  }
  {
    constexpr std::int64_t kCount = 50;
    Bytes buffer(static_cast<std::size_t>(world * kCount * 2));
    const Bytes mine = input(DType::kFloat16, rank, kCount, 10);
    std::memcpy(buffer.data() + rank * kCount * 2, mine.data(), mine.size());
    comm.all_gather(buffer.data() + rank * kCount * 2, buffer.data(), kCount, DType::kFloat16, nullptr);
    out["all_gather fp16 in place"] = buffer;
  }
  for (const int root : {0, world - 1}) {
    Bytes buffer = input(DType::kInt32, rank, 64, 11);
    comm.broadcast(buffer.data(), buffer.data(), 64, DType::kInt32, root, nullptr);
    out["broadcast root " + std::to_string(root)] = buffer;
  }
  if (world > 1) {
    const Bytes send = input(DType::kFloat32, rank, 40, 12);
    Bytes recv(send.size());
    comm.send_recv(send.data(), (rank + 1) % world, recv.data(), (rank + world - 1) % world, 40, DType::kFloat32,
                   nullptr);
    out["send_recv ring"] = recv;
  }
  {
    std::string all;
    for (const std::string& blob : comm.exchange("rank " + std::to_string(rank), "names")) all += blob + ";";
    const auto* bytes = reinterpret_cast<const std::byte*>(all.data());
    out["exchange"] = Bytes(bytes, bytes + all.size());
  }
  return out;
}

// The references of run_suite's results on rank `rank` of `world`.
int check_references(const Results& got, int rank, int world) {
  int failed = check_fp32_sum(got.at("all_reduce fp32 sum"), world, 1000, 1, 0, 1000, "all_reduce fp32 sum");
  failed |= check_fp32_sum(got.at("all_reduce fp32 sum in place"), world, 1000, 2, 0, 1000, "in place");
  failed |= check_fp32_sum(got.at("reduce_scatter fp32 sum"), world, world * 250, 7, rank * 250, 250, "reduce_scatter");
  const std::int64_t counts[] = {300, 0, 77, 500};
  for (int b = 0; b < 4; ++b) {
    failed |= check_fp32_sum(got.at("all_reduce_many buffer " + std::to_string(b)), world, counts[b], 3 + b, 0,
                             counts[b], "all_reduce_many");
  }
  std::vector<Bytes> ints32, ints64, floats, bf16s, gathered, halves;
  for (int r = 0; r < world; ++r) {
    ints32.push_back(input(DType::kInt32, r, 1000, 1));
    ints64.push_back(input(DType::kInt64, r, 1000, 1));
    floats.push_back(input(DType::kFloat32, r, 1000, 1));
    bf16s.push_back(input(DType::kBFloat16, r, world * 100, 8));
    gathered.push_back(input(DType::kInt64, r, 33, 9));
    halves.push_back(input(DType::kFloat16, r, 50, 10));
  }
  for (std::int64_t i = 0; i < 1000; ++i) {
    std::int32_t sum = 0;
    std::int64_t max64 = INT64_MIN;
    float max32 = -INFINITY;
    for (int r = 0; r < world; ++r) {
      sum += reinterpret_cast<const std::int32_t*>(ints32[static_cast<std::size_t>(r)].data())[i];
      max64 = std::max(max64, reinterpret_cast<const std::int64_t*>(ints64[static_cast<std::size_t>(r)].data())[i]);
      max32 = std::max(max32, reinterpret_cast<const float*>(floats[static_cast<std::size_t>(r)].data())[i]);
    }
    CHILD_CHECK(reinterpret_cast<const std::int32_t*>(got.at("all_reduce int32 sum").data())[i] == sum, "element ", i);
    CHILD_CHECK(reinterpret_cast<const std::int64_t*>(got.at("all_reduce int64 max").data())[i] == max64, "element ",
                i);
    CHILD_CHECK(reinterpret_cast<const float*>(got.at("all_reduce fp32 max").data())[i] == max32, "element ", i);
  }
  for (std::int64_t i = 0; i < 100; ++i) {
    float max = -INFINITY;
    for (const Bytes& in : bf16s) max = std::max(max, load_as_float(DType::kBFloat16, in.data(), rank * 100 + i));
    CHILD_CHECK(load_as_float(DType::kBFloat16, got.at("reduce_scatter bf16 max in place").data(), i) == max,
                "element ", i);
  }
  CHILD_CHECK(got.at("all_gather int64") == concat_bytes(gathered));
  CHILD_CHECK(got.at("all_gather fp16 in place") == concat_bytes(halves));
  CHILD_CHECK(got.at("broadcast root 0") == input(DType::kInt32, 0, 64, 11));
  CHILD_CHECK(got.at("broadcast root " + std::to_string(world - 1)) == input(DType::kInt32, world - 1, 64, 11));
  CHILD_CHECK(got.at("send_recv ring") == input(DType::kFloat32, (rank + world - 1) % world, 40, 12));
  std::string names;
  for (int r = 0; r < world; ++r) names += "rank " + std::to_string(r) + ";";
  const Bytes& exchanged = got.at("exchange");
  CHILD_CHECK(std::string(reinterpret_cast<const char*>(exchanged.data()), exchanged.size()) == names);
  return failed;
}

// The suite on a world of `world` processes: references, and the same bits as a HostWorld of `world` threads.
void suite_matches_host_world(int world) {
  on_connected_ranks(world, [&](int rank, std::unique_ptr<Communicator>& comm) {
    CHILD_CHECK(comm->rank() == rank && comm->world_size() == world);
    comm->check_device(Device::kHost, "test");
    const Results processes = run_suite(*comm);
    comm->check_health();

    Results threads;
    std::mutex mutex;
    HostWorld::run(world, [&](Communicator& thread_comm) {
      Results mine = run_suite(thread_comm);
      std::lock_guard lock(mutex);
      if (thread_comm.rank() == rank) threads = std::move(mine);
    });
    CHILD_CHECK(processes.size() == threads.size(), processes.size(), " results against ", threads.size());
    for (const auto& [name, bytes] : processes) {
      CHILD_CHECK(threads.count(name) == 1, "no thread result for ", name);
      const std::string difference = first_difference(bytes, threads.at(name));
      CHILD_CHECK(difference.empty(), name, " on rank ", rank,
                  ": the process world and the thread world differ: ", difference);
    }
    return check_references(processes, rank, world);
  });
}

TEST(RendezvousCommunicatorTest, EveryCollectiveOnTwoRanksMatchesItsReferenceAndHostWorldBitForBit) {
  suite_matches_host_world(2);
}

TEST(RendezvousCommunicatorTest, EveryCollectiveOnFourRanksMatchesItsReferenceAndHostWorldBitForBit) {
  suite_matches_host_world(4);
}

TEST(RendezvousCommunicatorTest, BuffersLargerThanAPartTravelInPartsWithTheSameBits) {
  // 18 MB of fp32 per rank: two parts of at most 16 MiB each.
  constexpr int kWorld = 2;
  constexpr std::int64_t kBig = 4'500'000;
  const int port = free_port();
  expect_all_succeeded(run_processes(
      kWorld,
      [&](int rank) {
        auto comm = connect(rank, kWorld, port, seconds(10));
        const Bytes mine = input(DType::kFloat32, rank, kBig, 1);
        const std::vector<Bytes> all = {input(DType::kFloat32, 0, kBig, 1), input(DType::kFloat32, 1, kBig, 1)};
        const std::vector<const void*> sources = {all[0].data(), all[1].data()};

        Bytes reduced(mine.size());
        comm->all_reduce(mine.data(), reduced.data(), kBig, DType::kFloat32, ReduceOp::kSum, nullptr);
        Bytes expected(mine.size());
        reduce_on_host(expected.data(), sources, 0, kBig, DType::kFloat32, ReduceOp::kSum);
        CHILD_CHECK(reduced == expected, "all_reduce: ", first_difference(reduced, expected));

        // Two buffers whose concatenation (5M elements) splits inside the second.
        Bytes first(mine.begin(), mine.begin() + 3'000'000 * 4);
        Bytes second(mine.begin() + 2'500'000 * 4, mine.end());
        const std::vector<void*> buffers = {first.data(), second.data()};
        const std::vector<std::int64_t> counts = {3'000'000, 2'000'000};
        comm->all_reduce_many(buffers, counts, DType::kFloat32, ReduceOp::kSum, nullptr);
        CHILD_CHECK(std::memcmp(first.data(), expected.data(), first.size()) == 0, "all_reduce_many buffer 0");
        CHILD_CHECK(std::memcmp(second.data(), expected.data() + 2'500'000 * 4, second.size()) == 0,
                    "all_reduce_many buffer 1");

        // 2.25M elements per rank's block, 2M per part and block.
        constexpr std::int64_t kBlock = kBig / 2;
        Bytes scattered(kBlock * 4);
        comm->reduce_scatter(mine.data(), scattered.data(), kBlock, DType::kFloat32, ReduceOp::kSum, nullptr);
        CHILD_CHECK(std::memcmp(scattered.data(), expected.data() + rank * kBlock * 4, scattered.size()) == 0,
                    "reduce_scatter");

        Bytes gathered(2 * mine.size());
        comm->all_gather(mine.data(), gathered.data(), kBig, DType::kFloat32, nullptr);
        CHILD_CHECK(gathered == concat_bytes(all), "all_gather");

        Bytes from1 = mine;
        comm->broadcast(from1.data(), from1.data(), kBig, DType::kFloat32, 1, nullptr);
        CHILD_CHECK(from1 == all[1], "broadcast from root 1");

        Bytes swapped(mine.size());
        comm->send_recv(mine.data(), 1 - rank, swapped.data(), 1 - rank, kBig, DType::kFloat32, nullptr);
        CHILD_CHECK(swapped == all[static_cast<std::size_t>(1 - rank)], "send_recv");
        return 0;
      },
      seconds(30)));
}

// ---- ranks that disagree

TEST(RendezvousCommunicatorTest, ACountMismatchIsAnErrorOnEveryRankNamingBothCalls) {
  constexpr int kWorld = 4;
  on_connected_ranks(kWorld, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kFloat32, rank, 1024, 0);
    comm->all_reduce(buffer.data(), buffer.data(), 1024, DType::kFloat32, ReduceOp::kSum, nullptr);
    const std::int64_t count = rank == 2 ? 512 : 1024;
    int failed = expect_error(
        [&] { comm->all_reduce(buffer.data(), buffer.data(), count, DType::kFloat32, ReduceOp::kSum, nullptr); },
        ErrorCode::kInvalidState,
        {"collective #2 differs between ranks", "rank 2 is in", "all_reduce(512 fp32, sum) #2",
         "all_reduce(1024 fp32, sum) #2"});
    // Spent: later calls and check_health name the first failure.
    failed |= expect_error([&] { (void)comm->exchange("x", "after"); }, ErrorCode::kInvalidState,
                           {"failed earlier", "all_reduce(512 fp32, sum) #2"});
    failed |= expect_error([&] { comm->check_health(); }, ErrorCode::kInvalidState, {"differs between ranks"});
    return failed;
  });
}

TEST(RendezvousCommunicatorTest, ARootMismatchIsAnErrorOnEveryRankNamingBothCalls) {
  // Root 0 travels by Rendezvous::broadcast, root 1 by all_gather: still both calls named.
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kInt32, rank, 16, 0);
    return expect_error([&] { comm->broadcast(buffer.data(), buffer.data(), 16, DType::kInt32, rank, nullptr); },
                        ErrorCode::kInvalidState,
                        {"differs between ranks", "broadcast(16 int32, root 0) #1", "broadcast(16 int32, root 1) #1"});
  });
}

TEST(RendezvousCommunicatorTest, AnOperatorMismatchIsAnErrorOnEveryRankNamingBothCalls) {
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    const std::vector<std::int64_t> counts = {4, 5};
    Bytes a = input(DType::kFloat32, rank, 4, 0);
    Bytes b = input(DType::kFloat32, rank, 5, 1);
    const std::vector<void*> buffers = {a.data(), b.data()};
    const ReduceOp op = rank == 0 ? ReduceOp::kSum : ReduceOp::kMax;
    return expect_error([&] { comm->all_reduce_many(buffers, counts, DType::kFloat32, op, nullptr); },
                        ErrorCode::kInvalidState,
                        {"all_reduce_many([4, 5] fp32, sum) #1", "all_reduce_many([4, 5] fp32, max) #1"});
  });
}

// ---- ranks that are gone

// `victim` is killed (SIGKILL) after one good call; the others' next call names it, quickly.
void killed_rank_is_named(int world, int victim) {
  const int port = free_port();
  constexpr milliseconds kTimeout(1500);
  const std::vector<int> codes = run_processes(world, [&](int rank) {
    auto comm = connect(rank, world, port, kTimeout);
    Bytes buffer = input(DType::kFloat32, rank, 1024, 0);
    comm->all_reduce(buffer.data(), buffer.data(), 1024, DType::kFloat32, ReduceOp::kSum, nullptr);
    if (rank == victim) ::kill(::getpid(), SIGKILL);
    const Clock::time_point start = Clock::now();
    const std::string named = "rank " + std::to_string(victim);
    int failed = expect_error(
        [&] { comm->all_reduce(buffer.data(), buffer.data(), 1024, DType::kFloat32, ReduceOp::kSum, nullptr); },
        ErrorCode::kIo, {named, "the connection", "all_reduce(1024 fp32, sum) #2"});
    CHILD_CHECK(Clock::now() - start < seconds(3), "took too long");
    failed |= expect_error([&] { comm->check_health(); }, ErrorCode::kIo, {named, "all_reduce(1024 fp32, sum) #2"});
    failed |= expect_error([&] { comm->broadcast(buffer.data(), buffer.data(), 4, DType::kFloat32, 0, nullptr); },
                           ErrorCode::kInvalidState, {"failed earlier", named});
    return failed;
  });
  for (int rank = 0; rank < world; ++rank) {
    const int expected = rank == victim ? 128 + SIGKILL : 0;
    EXPECT_EQ(codes[static_cast<std::size_t>(rank)], expected) << "process " << rank;
  }
}

TEST(RendezvousCommunicatorTest, AKilledRankIsNamedByTheOthersQuicklyOnFourRanks) { killed_rank_is_named(4, 3); }

TEST(RendezvousCommunicatorTest, AKilledRankZeroIsNamedByTheOtherQuicklyOnTwoRanks) { killed_rank_is_named(2, 0); }

TEST(RendezvousCommunicatorTest, AbortClosesTheRendezvousSoPeersFailFast) {
  // Rank 1 aborts and stays alive: the others learn of it from the closed rendezvous, long before any timeout.
  constexpr int kWorld = 4;
  on_connected_ranks(
      kWorld,
      [&](int rank, std::unique_ptr<Communicator>& comm) {
        Bytes buffer = input(DType::kFloat32, rank, 256, 0);
        comm->all_reduce(buffer.data(), buffer.data(), 256, DType::kFloat32, ReduceOp::kSum, nullptr);
        if (rank == 1) {
          comm->abort("watchdog: step 7 stalled");
          int failed = expect_error([&] { comm->check_health(); }, ErrorCode::kInvalidState,
                                    {"rank 1 aborted: watchdog: step 7 stalled"});
          failed |= expect_error(
              [&] { comm->all_reduce(buffer.data(), buffer.data(), 256, DType::kFloat32, ReduceOp::kSum, nullptr); },
              ErrorCode::kInvalidState, {"failed earlier", "aborted"});
          comm->abort("again");  // harmless
          std::this_thread::sleep_for(seconds(3));
          return failed;
        }
        const Clock::time_point start = Clock::now();
        const int failed = expect_error(
            [&] { comm->all_reduce(buffer.data(), buffer.data(), 256, DType::kFloat32, ReduceOp::kSum, nullptr); },
            ErrorCode::kIo, {"rank 1", "all_reduce(256 fp32, sum) #2"});
        CHILD_CHECK(Clock::now() - start < seconds(2), "took too long");
        return failed;
      },
      seconds(8));
}

TEST(RendezvousCommunicatorTest, AnAbortFromAnotherThreadEndsTheCallInFlight) {
  // Rank 1's watchdog thread aborts while rank 1 waits in a call for rank 0, which comes only once told (a pipe)
  // that the abort is done: the call ends with the abort when it returns, and closes the rendezvous then; rank 0's
  // next call names rank 1.
  int aborted[2];
  ASSERT_EQ(::pipe(aborted), 0);
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kFloat32, rank, 64, 0);
    if (rank == 0) {
      pollfd told{aborted[0], POLLIN, 0};
      CHILD_CHECK(::poll(&told, 1, 8000) == 1, "rank 1 never aborted");
      comm->all_reduce(buffer.data(), buffer.data(), 64, DType::kFloat32, ReduceOp::kSum, nullptr);
      return expect_error(
          [&] { comm->all_reduce(buffer.data(), buffer.data(), 64, DType::kFloat32, ReduceOp::kSum, nullptr); },
          ErrorCode::kIo, {"rank 1", "all_reduce(64 fp32, sum) #2"});
    }
    std::thread watchdog([&] {
      std::this_thread::sleep_for(milliseconds(500));  // the main thread is in the call by then
      comm->abort("watchdog");
      (void)::write(aborted[1], "x", 1);
    });
    const int failed = expect_error(
        [&] { comm->all_reduce(buffer.data(), buffer.data(), 64, DType::kFloat32, ReduceOp::kSum, nullptr); },
        ErrorCode::kInvalidState, {"rank 1 aborted: watchdog", "during this call", "all_reduce(64 fp32, sum) #1"});
    watchdog.join();
    std::this_thread::sleep_for(seconds(2));  // alive: rank 0 learns from the closed rendezvous
    return failed;
  });
  ::close(aborted[0]);
  ::close(aborted[1]);
}

// ---- point to point

TEST(RendezvousCommunicatorTest, SendAndRecvWorkInAWorldOfTwo) {
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    const Bytes mine = input(DType::kInt32, rank, 64, 0);
    Bytes got(mine.size());
    if (rank == 0) {
      comm->send(mine.data(), 64, DType::kInt32, 1, nullptr);
      comm->recv(got.data(), 64, DType::kInt32, 1, nullptr);
    } else {
      comm->recv(got.data(), 64, DType::kInt32, 0, nullptr);
      comm->send(mine.data(), 64, DType::kInt32, 0, nullptr);
    }
    CHILD_CHECK(got == input(DType::kInt32, 1 - rank, 64, 0));
    // Both send first: on NCCL a deadlock, here an Error naming both calls.
    return expect_error([&] { comm->send(mine.data(), 8, DType::kFloat32, 1 - rank, nullptr); },
                        ErrorCode::kInvalidState,
                        {"no transfer can move", "send(8 fp32 to rank 1), transfer #3",
                         "send(8 fp32 to rank 0), transfer #3", "its send waits for a receive", "send_recv"});
  });
}

TEST(RendezvousCommunicatorTest, AGroupedSendRecvPairsWithTheLoneRecvAndLaterSendOfThePeer) {
  // A pipeline of two stages with one microbatch: stage 0 sends its activation and receives its gradient in one
  // group; stage 1 receives the activation alone, and sends the gradient alone after a collective-free pass. Then
  // the collectives after agree although the ranks made different numbers of transfers.
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    const Bytes mine = input(DType::kFloat32, rank, 300, 4);
    Bytes got(mine.size());
    if (rank == 0) {
      comm->send_recv(mine.data(), 1, got.data(), 1, 300, DType::kFloat32, nullptr);
    } else {
      comm->recv(got.data(), 300, DType::kFloat32, 0, nullptr);
      comm->send(mine.data(), 300, DType::kFloat32, 0, nullptr);
    }
    CHILD_CHECK(got == input(DType::kFloat32, 1 - rank, 300, 4));
    // The other way round: rank 1 sends first alone, rank 0's group receives it and sends back.
    Bytes back(mine.size());
    if (rank == 0) {
      comm->send_recv(mine.data(), 1, back.data(), 1, 300, DType::kFloat32, nullptr);
    } else {
      comm->send(mine.data(), 300, DType::kFloat32, 0, nullptr);
      comm->recv(back.data(), 300, DType::kFloat32, 0, nullptr);
    }
    CHILD_CHECK(back == input(DType::kFloat32, 1 - rank, 300, 4));
    Bytes sum = mine;
    comm->all_reduce(sum.data(), sum.data(), 300, DType::kFloat32, ReduceOp::kSum, nullptr);
    int failed = check_fp32_sum(sum, 2, 300, 4, 0, 300, "all_reduce after the transfers");
    comm->check_health();
    return failed;
  });
}

TEST(RendezvousCommunicatorTest, ALargeSendPairsWithAGroupedReceiveInParts) {
  // 18 MB: the send travels in two parts within one meeting; the grouped send_recv of rank 1 gets it, then its
  // own send goes to rank 0's lone recv.
  constexpr std::int64_t kBig = 4'500'000;
  const int port = free_port();
  expect_all_succeeded(run_processes(
      2,
      [&](int rank) {
        auto comm = connect(rank, 2, port, seconds(10));
        const Bytes mine = input(DType::kFloat32, rank, kBig, 5);
        Bytes got(mine.size());
        if (rank == 0) {
          comm->send(mine.data(), kBig, DType::kFloat32, 1, nullptr);
          comm->recv(got.data(), kBig, DType::kFloat32, 1, nullptr);
        } else {
          comm->send_recv(mine.data(), 0, got.data(), 0, kBig, DType::kFloat32, nullptr);
        }
        CHILD_CHECK(got == input(DType::kFloat32, 1 - rank, kBig, 5),
                    first_difference(got, input(DType::kFloat32, 1 - rank, kBig, 5)));
        return 0;
      },
      seconds(30)));
}

TEST(RendezvousCommunicatorTest, TransfersThatCannotPairAreAnErrorOnBothRanksNamingBothCalls) {
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kFloat32, rank, 32, 0);
    // A send of 32 against a receive of 16.
    return expect_error(
        [&] {
          if (rank == 0)
            comm->send(buffer.data(), 32, DType::kFloat32, 1, nullptr);
          else
            comm->recv(buffer.data(), 16, DType::kFloat32, 0, nullptr);
        },
        ErrorCode::kInvalidState,
        {"rank 0 sends 128 bytes in send(32 fp32 to rank 1), transfer #1",
         "rank 1 receives 64 bytes in recv(16 fp32 from rank 0), transfer #1", "same count and dtype"});
  });
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kFloat32, rank, 16, 0);
    // Both receive first.
    int failed = expect_error([&] { comm->recv(buffer.data(), 16, DType::kFloat32, 1 - rank, nullptr); },
                              ErrorCode::kInvalidState,
                              {"no transfer can move", "recv(16 fp32 from rank 1), transfer #1",
                               "recv(16 fp32 from rank 0), transfer #1", "its receive waits for a send"});
    failed |= expect_error([&] { comm->check_health(); }, ErrorCode::kInvalidState, {"no transfer can move"});
    return failed;
  });
  on_connected_ranks(2, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kFloat32, rank, 16, 0);
    // Rank 0 waits for a gradient that rank 1 never sends: rank 1 goes on to an all_reduce.
    return expect_error(
        [&] {
          if (rank == 0) {
            comm->send_recv(buffer.data(), 1, buffer.data(), 1, 16, DType::kFloat32, nullptr);
          } else {
            comm->recv(buffer.data(), 16, DType::kFloat32, 0, nullptr);
            comm->all_reduce(buffer.data(), buffer.data(), 16, DType::kFloat32, ReduceOp::kSum, nullptr);
          }
        },
        ErrorCode::kInvalidState, {"point to point #2", "all_reduce(16 fp32, sum) #1"});
  });
}

TEST(RendezvousCommunicatorTest, ALoneSendOrRecvInAWorldOfFourIsUnsupportedAndSpendsNothing) {
  constexpr int kWorld = 4;
  on_connected_ranks(kWorld, [&](int rank, std::unique_ptr<Communicator>& comm) {
    Bytes buffer = input(DType::kFloat32, rank, 16, 0);
    const int peer = (rank + 1) % kWorld;
    int failed = expect_error([&] { comm->send(buffer.data(), 16, DType::kFloat32, peer, nullptr); },
                              ErrorCode::kUnsupported, {"world of 4", "send_recv", "HostWorld", "NCCL"});
    failed |= expect_error([&] { comm->recv(buffer.data(), 16, DType::kFloat32, peer, nullptr); },
                           ErrorCode::kUnsupported, {"a lone recv", "HostWorld", "NCCL"});
    comm->check_health();
    // The next call is still #1 on every rank and works.
    Bytes from3 = buffer;
    comm->broadcast(from3.data(), from3.data(), 16, DType::kFloat32, 3, nullptr);
    CHILD_CHECK(from3 == input(DType::kFloat32, 3, 16, 0));
    return failed;
  });
}

TEST(RendezvousCommunicatorTest, SendRecvThatDoNotPairUpAreAnErrorOnEveryRank) {
  // A ring, except that rank 1 receives from rank 3 instead of rank 0.
  constexpr int kWorld = 4;
  on_connected_ranks(kWorld, [&](int rank, std::unique_ptr<Communicator>& comm) {
    const Bytes mine = input(DType::kFloat32, rank, 16, 0);
    Bytes got(mine.size());
    const int to = (rank + 1) % kWorld;
    const int from = rank == 1 ? 3 : (rank + kWorld - 1) % kWorld;
    return expect_error(
        [&] { comm->send_recv(mine.data(), to, got.data(), from, 16, DType::kFloat32, nullptr); },
        ErrorCode::kInvalidState,
        {"send_recv(16 fp32) #1", "do not pair up", "rank 0 sends to rank 1, but rank 1 receives from rank 3"});
  });
}

// ---- one process

TEST(RendezvousCommunicatorTest, AWorldOfOneNeedsNoSocket) {
  LaunchInfo info;
  info.master_addr = "no-such-host.invalid";  // never resolved
  auto comm = make_rendezvous_communicator(Rendezvous::connect(info, "alone", milliseconds(100)), "dp");
  EXPECT_EQ(comm->describe(), "communicator 'dp' (rank 0 of 1, host)");
  comm->check_device(Device::kHost, "test");
  EXPECT_ERROR_CONTAINS(comm->check_device(Device::kCuda, "all_reduce_"), "cannot move cuda");

  const Bytes mine = input(DType::kFloat32, 0, 8, 0);
  Bytes out(mine.size());
  comm->all_reduce(mine.data(), out.data(), 8, DType::kFloat32, ReduceOp::kSum, nullptr);
  EXPECT_EQ(out, mine);
  std::fill(out.begin(), out.end(), std::byte{0});
  comm->reduce_scatter(mine.data(), out.data(), 8, DType::kFloat32, ReduceOp::kMax, nullptr);
  EXPECT_EQ(out, mine);
  std::fill(out.begin(), out.end(), std::byte{0});
  comm->all_gather(mine.data(), out.data(), 8, DType::kFloat32, nullptr);
  EXPECT_EQ(out, mine);
  EXPECT_EQ(comm->exchange("mine", "solo"), std::vector<std::string>{"mine"});
  EXPECT_ERROR_CONTAINS(comm->send(mine.data(), 8, DType::kFloat32, 0, nullptr), "another rank");

  // Argument errors spend nothing.
  EXPECT_ERROR_CONTAINS(comm->all_reduce(mine.data(), out.data(), -1, DType::kFloat32, ReduceOp::kSum, nullptr),
                        "count must be >= 0");
  EXPECT_ERROR_CONTAINS(comm->all_reduce(mine.data(), out.data(), 8, DType::kFloat8E4M3, ReduceOp::kSum, nullptr),
                        "fp8");
  const std::vector<void*> one = {out.data()};
  const std::vector<std::int64_t> two = {1, 2};
  EXPECT_ERROR_CONTAINS(comm->all_reduce_many(one, two, DType::kFloat32, ReduceOp::kSum, nullptr), "1 buffers",
                        "2 counts");
  EXPECT_ERROR_CONTAINS((void)comm->exchange(std::string(Rendezvous::kMaxBlobBytes + 1, 'x'), "huge"), "small blobs");
  comm->check_health();
  comm->broadcast(mine.data(), out.data(), 8, DType::kFloat32, 0, nullptr);
  EXPECT_EQ(out, mine);

  comm->abort("test over");
  EXPECT_ERROR_CONTAINS(comm->check_health(), "rank 0 aborted: test over");
  EXPECT_ERROR_CONTAINS(comm->all_reduce(mine.data(), out.data(), 8, DType::kFloat32, ReduceOp::kSum, nullptr),
                        "all_reduce(8 fp32, sum) #6", "failed earlier", "test over");
  EXPECT_ERROR_CONTAINS((void)make_rendezvous_communicator(nullptr), "rendezvous is null");
}

}  // namespace
}  // namespace stepgraph
